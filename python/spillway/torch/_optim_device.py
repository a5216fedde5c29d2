"""CPUAdamW's device path (Note [The device path of CPUAdamW]): bfloat16 parameters on a
CUDA device (or the emulated one) as views of two flat device buffers, stepped by
spillway's optimizer-offload pipeline; each gradient into its slice of the flat buffer,
ordered on the stream the pipeline adopted.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _spillway
from ._common import _local
from ._optim_state import AdamWState

__all__ = ["DevicePath"]


class DevicePath(AdamWState):
    """CPUAdamW's device path (its state: AdamWState, made by CPUAdamW)."""

    # ---- the device path (Note [The device path of CPUAdamW]) --------------------------

    def _make_device_path(self, clip: float, speculative: bool, threads: int) -> Any:
        assert self._device is not None
        sizes = [_local(p).numel() for p in self._params]
        n = sum(sizes)
        dev = self._device
        with torch.no_grad():
            self._flat_w = torch.empty(n, dtype=torch.bfloat16, device=dev)
            self._flat_g = torch.zeros(n, dtype=torch.bfloat16, device=dev)
            at = 0
            for p, k in zip(self._params, sizes):
                self._offsets.append(at)
                self._flat_w[at : at + k].copy_(_local(p).detach().reshape(-1))
                at += k
            # Note [FSDP2 on the device path]: FSDP2 owns its shards' storage (it all-gathers
            # from it), so a DTensor parameter keeps it: its gradient is copied into the
            # flat buffer at its hand-over, and the pipeline's weights back into the shard
            # after step(). Other parameters become views of the flat buffers.
            for i, p in enumerate(self._params):
                if self._sharded:
                    continue
                old_grad = p.grad
                p.data = self._flat_w[self._offsets[i] : self._offsets[i] + sizes[i]].view(p.shape)
                view = self._grad_view(i, p)
                if old_grad is not None:
                    view.copy_(old_grad)
                p.grad = view
        if dev.type == "cuda":
            kind, ordinal = "cuda", dev.index if dev.index is not None else 0
            self._adopted = torch.cuda.current_stream(dev)
            stream = self._adopted.cuda_stream
        else:
            kind, ordinal, stream = "host", 0, 0
        return _spillway.OffloadAdamW(
            kind,
            ordinal,
            stream,
            sizes,
            self._flat_w.data_ptr(),
            self._flat_g.data_ptr(),
            clip,
            speculative,
            threads,
            (self._flat_w, self._flat_g),  # alive until the pipeline's copies are done
        )

    def _grad_ptr(self, i: int) -> int:
        assert self._flat_g is not None
        return self._flat_g.data_ptr() + 2 * self._offsets[i]

    def _grad_view(self, i: int, p: torch.Tensor) -> torch.Tensor:
        assert self._flat_g is not None
        at = self._offsets[i]
        local = _local(p)
        return self._flat_g[at : at + local.numel()].view(local.shape)

    def _into_flat_grad(self, i: int, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The gradient in its slice of the flat buffer (copied there if torch made a new one,
        after ``set_to_none``), ordered on the stream the pipeline adopted."""
        adopted = self._adopted
        if adopted is None:  # CPU tensors (device emulation)
            return self._flat_grad(i, p, grad)
        side = torch.cuda.current_stream(self._device)
        if side.cuda_stream == adopted.cuda_stream:
            return self._flat_grad(i, p, grad)
        # Note [Gradients on a side stream]: FSDP2 reduces gradients and runs the hook on its
        # own reduce stream (so may a user's code). The adopted stream waits for that stream
        # (a device-side wait, no host synchronization), the copy into the flat buffer runs
        # on the adopted stream, where the pipeline's event follows it, and the caching
        # allocator learns that the gradient is read there, so that its memory is not
        # handed out again before that read.
        adopted.wait_stream(side)
        with torch.cuda.stream(adopted):
            view = self._flat_grad(i, p, grad)
        _local(grad).record_stream(adopted)
        return view

    def _flat_grad(self, i: int, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if self._sharded:  # Note [FSDP2 on the device path]: .grad stays FSDP2's DTensor
            view = self._grad_view(i, p)
            view.copy_(_local(grad))
            return view
        if grad.data_ptr() == self._grad_ptr(i) and grad.dtype == torch.bfloat16:
            return grad
        view = self._grad_view(i, p)
        view.copy_(grad)
        p.grad = view
        return view

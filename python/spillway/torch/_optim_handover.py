"""CPUAdamW's hand-over: each gradient, once final, handed to the C++ optimizer (the
parameters written under it read again first: Note [Parameters changed under the
optimizer]), and the parameters that are views of its fp32 master weights (Note [Weights
shared with the parameters]).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Optional

import torch

from ._common import _DTYPES, _local, _stamp
from ._optim_state import AdamWState

__all__ = ["HandOver"]


def _view_at(address: int, shape: torch.Size, owner: Any) -> torch.Tensor:
    """A float32 tensor of ``shape`` over ``address`` (the optimizer's memory), which keeps
    ``owner`` (what owns that memory) alive as long as the tensor or a view of it lives."""
    n = max(1, math.prod(shape))
    buffer = (ctypes.c_float * n).from_address(address)
    buffer._spillway_owner = owner  # type: ignore[attr-defined]
    return torch.frombuffer(buffer, dtype=torch.float32).view(shape)


class HandOver(AdamWState):
    """CPUAdamW's hand-over of gradients (its state: AdamWState, made by CPUAdamW)."""

    # ---- hand-over --------------------------------------------------------------------

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        self._seen[i] += 1
        if self._seen[i] % self.accumulation_steps != 0 or self._handed[i] is not None:
            return
        self._hand_over(i, p)

    def _refresh(self, i: int) -> None:
        """Note [Parameters changed under the optimizer]: a parameter written since its master
        weights were last in step with it (``load_state_dict`` into the model, ``p.data =``,
        an in-place edit) is read again, so that no step starts from a stale copy. A write
        that left its values as they were (a version bump alone) keeps the fp32 master."""
        p = self._params[i]
        if _stamp(p) == self._stamps[i]:
            return
        if self._flat_w is not None:
            at, n = self._offsets[i], _local(p).numel()
            if self._sharded:
                # Note [FSDP2 on the device path]: the shard's values into its flat slice.
                with torch.no_grad():
                    self._flat_w[at : at + n].copy_(_local(p).detach().reshape(-1))
            elif _local(p).data_ptr() != self._flat_w.data_ptr() + 2 * at:
                # p.data was replaced: its values go back into its slice of the flat buffer,
                # which the pipeline writes (Note [The device path of CPUAdamW]).
                with torch.no_grad():
                    view = self._flat_w[at : at + n].view(p.shape)
                    view.copy_(p.detach())
                    p.data = view
        lp = _local(p)
        master = torch.empty(lp.numel(), dtype=torch.float32)
        m = torch.empty_like(master)
        v = torch.empty_like(master)
        self._core.read_state(i, master.data_ptr(), m.data_ptr(), v.data_ptr())
        current = lp.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        seen = master if p.dtype == torch.float32 else master.to(p.dtype).to(torch.float32)
        if not torch.equal(seen, current):
            if self._device is not None:
                self._core.write_state(
                    i, current.data_ptr(), m.data_ptr(), v.data_ptr(), self._core.bucket_step(i)
                )
            else:
                self._core.load_weights(i, lp.data_ptr(), _DTYPES[p.dtype])
        if self._shared is not None:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise ValueError(
                    f"CPUAdamW: parameter {i} became {p.dtype} on {p.device} under "
                    "share_weights=True, whose parameters are the optimizer's float32 CPU "
                    "master weights; close() the optimizer before converting the model, "
                    "then make a new one"
                )
            self._follow(i)  # p.data was replaced: its values are the master's now
        self._stamps[i] = _stamp(p)

    def _hand_over(self, i: int, p: torch.Tensor, in_step: bool = False) -> None:
        if self._synced is None:  # the step's first gradient: its hyperparameters are set
            self._sync_hparams()
            # Note [Parameters changed under the optimizer]: every parameter written since
            # the last step is read before any of this step's gradients arrives (the device
            # path's pipeline takes a bucket's new state only between steps).
            for j in range(len(self._params)):
                self._refresh(j)
        else:
            self._refresh(i)
        grad = p.grad
        if grad is not None and grad.is_sparse:
            raise RuntimeError(
                f"CPUAdamW: parameter {i} has a sparse gradient; CPUAdamW does not support "
                "sparse gradients (as torch.optim.AdamW does not): use a dense layer (e.g. "
                "nn.Embedding(sparse=False)) or torch.optim.SparseAdam for it"
            )
        assert grad is not None
        seen = grad  # what step() checks for changes: FSDP2's DTensor stays .grad
        if self._flat_g is not None:
            grad = self._into_flat_grad(i, p, grad)
            if not self._sharded:
                seen = grad
        g = _local(grad)
        if g.dtype != p.dtype or not g.is_contiguous() or g.layout != torch.strided:
            g = g.to(dtype=p.dtype).contiguous()
        grad = seen
        self._handed[i] = (g, grad, grad._version)
        if grad._base is not None:  # Note [Gradients that share a version counter]
            self._view_versions[id(grad._base)] = grad._version
        # Note [Early weights]: the step's pass writes the weights into the parameter when
        # asked to during backward, and always inside step(), where they are due anyway (one
        # pass instead of a second one reading the master weights back).
        early = self.early_weights or (in_step and self._device is None)
        dst = _local(p).data_ptr() if early and self._shared is None else 0
        self._core.grad_ready(i, g.data_ptr(), _DTYPES[p.dtype], dst)

    # ---- shared weights (Note [Weights shared with the parameters]) --------------------

    def _buffer_views(self, i: int, p: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        first, second = self._core.weight_buffers(i)
        return (
            _view_at(first, p.shape, self._core),
            _view_at(second, p.shape, self._core) if second else None,
        )

    def _follow(self, only: Optional[int] = None) -> None:
        """Points each parameter (or parameter ``only``) at its current weight buffer."""
        assert self._shared is not None
        current = self._core.current_buffers()
        for i in range(len(self._params)) if only is None else (only,):
            view = self._shared[i][current[i]]
            assert view is not None  # a bucket without a second buffer never switches
            p = self._params[i]
            if p.data_ptr() != view.data_ptr():
                p.data = view

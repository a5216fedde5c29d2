"""Layerwise weight streaming for a PyTorch model (DESIGN sections 5 and 10).

``stream_weights(model, depth=2)`` moves every decoder block's parameters into one pinned
host slab per block and computes each block from a ring of ``depth + 1`` device slots that
spillway's weight streamer fills ``depth`` blocks ahead (Note [Ring ordering]). A block's
parameters become views of its slot (Note [Static slots]: block ``l`` always in slot
``l % (depth + 1)``); its forward pre-hook waits for the slot (``spillway::stream_wait``) and
its forward hook releases it (``spillway::stream_release``). Both are ``torch.library``
custom ops with fake kernels, for ``torch.compile`` to trace through.

This version streams inference, eagerly. A forward that records gradients through streamed
blocks raises (the training path, re-streaming backward, is not bound yet), and so does a
forward under ``torch.compile`` (Note [Compiled streaming]).
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .. import _spillway
from .offload import _first_tensor, _record_report, find_decoder_layers

__all__ = ["StreamedWeights", "stream_weights"]

_SESSIONS: dict[int, StreamedWeights] = {}
_IDS = itertools.count(1)
_ALIGN = 64  # bytes: every parameter starts aligned in its slab and slot


# Note [Stream op order]: both ops mutate the session's token, so a compiler keeps every
# wait and release in program order (a wait of block l + 1 moved before the release of
# block l would be refused by the streamer); the wait also mutates the block's weights, so
# the block's reads of them stay after it.
@torch.library.custom_op("spillway::stream_wait", mutates_args=("weights", "token"))
def _stream_wait(
    weights: list[torch.Tensor], token: torch.Tensor, session: int, layer: int
) -> None:
    """Block ``layer``'s weights are in its slot for the work that follows."""
    _SESSIONS[session]._wait(layer, weights)


@_stream_wait.register_fake
def _(weights: list[torch.Tensor], token: torch.Tensor, session: int, layer: int) -> None:
    return None


@torch.library.custom_op("spillway::stream_release", mutates_args=("token",))
def _stream_release(token: torch.Tensor, output: torch.Tensor, session: int, layer: int) -> None:
    """Block ``layer``'s work (which produced ``output``) is enqueued: its slot may be refilled."""
    _SESSIONS[session]._session.release(layer)


@_stream_release.register_fake
def _(token: torch.Tensor, output: torch.Tensor, session: int, layer: int) -> None:
    return None


class StreamedWeights:
    """What :func:`stream_weights` returns: the handle of a model whose blocks stream."""

    def __init__(
        self,
        model: nn.Module,
        depth: int = 2,
        layers: Optional[Sequence[nn.Module]] = None,
        h2d_gbps: float = 0.0,
    ) -> None:
        if not isinstance(depth, int) or not 1 <= depth <= 64:
            raise ValueError(f"stream_weights: depth is {depth!r}; must be an int in [1, 64]")
        if h2d_gbps < 0:
            raise ValueError(f"stream_weights: h2d_gbps is {h2d_gbps!r}; must be >= 0")
        blocks = list(layers) if layers is not None else find_decoder_layers(model)
        if len(blocks) < 2:
            raise ValueError(
                f"stream_weights: {len(blocks)} decoder block(s) found; streaming needs >= 2 "
                "(pass layers=[...])"
            )
        self.model = model
        self.depth = depth
        self.blocks = blocks
        # Per block, its parameters (each once) and their byte offsets in the block's slab.
        owner: dict[int, int] = {}
        self._params: list[list[nn.Parameter]] = []
        self._offsets: list[list[int]] = []
        layer_bytes: list[int] = []
        for i, block in enumerate(blocks):
            ps = list(dict.fromkeys(block.parameters()))
            if not ps:
                raise ValueError(f"stream_weights: block {i} has no parameters")
            offs, at = [], 0
            for p in ps:
                if id(p) in owner:
                    raise ValueError(
                        f"stream_weights: a parameter of block {i} is also block "
                        f"{owner[id(p)]}'s (tied weights cannot stream)"
                    )
                owner[id(p)] = i
                if not p.is_contiguous() or p.layout != torch.strided:
                    raise ValueError(f"stream_weights: block {i} has a non-contiguous parameter")
                offs.append(at)
                at += (p.numel() * p.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
            self._params.append(ps)
            self._offsets.append(offs)
            layer_bytes.append(at)
        devices = {p.device for ps in self._params for p in ps}
        if len(devices) != 1:
            raise ValueError(
                f"stream_weights: the blocks' parameters are on {sorted(map(str, devices))}"
            )
        (device,) = devices
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"stream_weights: parameters on {device} (cpu and cuda are supported)")
        self.device = device
        pin = device.type == "cuda"
        slot_bytes = max(layer_bytes)
        # The slabs (pinned host memory, each block's parameters packed) and the ring.
        self._slabs = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in layer_bytes]
        self._slots = [
            torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(depth + 1)
        ]
        with torch.no_grad():
            for i, ps in enumerate(self._params):
                for p, off in zip(ps, self._offsets[i]):
                    n = p.numel() * p.element_size()
                    self._slabs[i][off : off + n].view(p.dtype).copy_(p.detach().reshape(-1))
                    p.data = self._view(self._slots[i % (depth + 1)], off, p)
        if device.type == "cuda":
            kind, ordinal = "cuda", device.index if device.index is not None else 0
            stream = torch.cuda.current_stream(device).cuda_stream
        else:
            kind, ordinal, stream = "host", 0, 0
        self._session = _spillway.StreamSession(
            kind,
            ordinal,
            stream,
            layer_bytes,
            depth,
            False,
            [s.data_ptr() for s in self._slabs],
            [s.data_ptr() for s in self._slots],
            h2d_gbps,
        )
        self._id = next(_IDS)
        _SESSIONS[self._id] = self
        self._token = torch.zeros(1, device=device)
        self._handles = []
        for i, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(i)))
            self._handles.append(block.register_forward_hook(self._post_hook(i)))
        self.layer_bytes = layer_bytes

    @staticmethod
    def _view(slot: torch.Tensor, off: int, p: torch.Tensor) -> torch.Tensor:
        n = p.numel() * p.element_size()
        return slot[off : off + n].view(p.dtype).view(p.shape)

    def _pre_hook(self, i: int) -> Any:
        sid = self._id
        weights = self._params[i]

        def hook(module: nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                # Note [Compiled streaming]: traced, the two ops give a graph with no break,
                # but the functionalized graph treats every slot as one mutated input and
                # copies its final value back into the slot after the graph, over the blocks
                # the ring loaded meanwhile (the next pass's first ones): pass 2 computes from
                # the wrong weights (measured with inductor on torch 2.15). Refused until the
                # ops stop exposing the slots as mutated inputs.
                raise RuntimeError(
                    "stream_weights: torch.compile over streamed blocks is not supported yet "
                    "(the compiled graph would write stale weights back into the ring); run "
                    "the model eagerly, or compile the blocks' inner modules only"
                )
            if torch.is_grad_enabled() and any(p.requires_grad for p in weights):
                raise RuntimeError(
                    "stream_weights: this version streams inference; run the model under "
                    "torch.no_grad() or torch.inference_mode() (training through streamed "
                    "blocks, re-streaming them in backward, is not bound yet)"
                )
            torch.ops.spillway.stream_wait(weights, self._token, sid, i)

        return hook

    def _post_hook(self, i: int) -> Any:
        sid = self._id

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = _first_tensor(output)
            torch.ops.spillway.stream_release(
                self._token, out if out is not None else self._token, sid, i
            )

        return hook

    def _wait(self, layer: int, weights: list[torch.Tensor]) -> None:
        slot = self._slots[layer % (self.depth + 1)]
        ptr = self._session.acquire(layer)
        if ptr != slot.data_ptr():
            raise RuntimeError(f"stream_weights: block {layer} landed outside its slot")
        # Note [Functionalized copies]: a compiler backend that functionalizes the op without
        # re-inplacing it (aot_eager) hands it copies of the parameters and writes them back
        # into the slots at the end of its graph, over the blocks the ring has loaded since:
        # refused, loudly. Inductor (torch.compile's default) re-inplaces: the op sees the
        # slot views themselves.
        for p, off in zip(weights, self._offsets[layer]):
            if p.data_ptr() != slot.data_ptr() + off:
                raise RuntimeError(
                    "stream_weights: the compiler backend passed copies of block "
                    f"{layer}'s parameters to spillway::stream_wait and would write them back "
                    "into the ring after its graph; use torch.compile's default backend "
                    "(inductor), which re-inplaces the op, or run eagerly"
                )

    def report(self) -> dict[str, Any]:
        """Loads, hits, bytes copied, copy and stall ms, achieved GB/s (since the start)."""
        t = dict(self._session.telemetry())
        _record_report("stream", t)
        return t

    def remove(self) -> None:
        """Stops streaming: every block's parameters get device memory of their own again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        with torch.no_grad():
            for i, ps in enumerate(self._params):
                for p, off in zip(ps, self._offsets[i]):
                    n = p.numel() * p.element_size()
                    host = self._slabs[i][off : off + n].view(p.dtype).view(p.shape)
                    p.data = host.to(self.device, copy=True)
        _SESSIONS.pop(self._id, None)


def stream_weights(
    model: nn.Module,
    depth: int = 2,
    *,
    layers: Optional[Sequence[nn.Module]] = None,
    h2d_gbps: float = 0.0,
) -> StreamedWeights:
    """Streams the weights of ``model``'s decoder blocks from pinned host memory.

    Args:
        model: the model; its decoder blocks are found as :func:`offload_activations` finds
            them, or given as ``layers``.
        depth: blocks copied ahead of the one computing (``depth + 1`` device slots, each the
            size of the largest block).
        h2d_gbps: CPU parameters only (spillway's host backend emulates the device): throttle
            the emulated host-to-device link, GB/s (0: memcpy speed).

    Returns the :class:`StreamedWeights` handle (``report()``, ``remove()``).
    """
    return StreamedWeights(model, depth, layers, h2d_gbps)

"""Layerwise weight streaming for a PyTorch model (docs/stream.md, docs/python.md).

``stream_weights(model, depth=2)`` moves every decoder block's parameters into one pinned
host slab per block and computes each block from a ring of ``depth + 1`` device slots that
spillway's weight streamer fills ``depth`` blocks ahead (Note [Ring ordering]); block ``l``
always lands in slot ``l % (depth + 1)`` (Note [Static slots]).

Note [Streamed blocks]: each block is replaced in its parent by a wrapper whose forward
calls ``spillway::stream_acquire`` (a ``torch.library`` custom op returning the block's
slot as a flat byte tensor, once its weights are there), runs the block with
``torch.func.functional_call`` on views of that tensor, then calls
``spillway::stream_release`` with the block's output (its slot may be refilled after the
work that made it). Both ops mutate one token (Note [Stream op order]), so a compiler keeps
them in program order; the slot comes out of the op as a fresh value rather than as a
mutated input, so a compiled graph never writes weights back into the ring, and
``torch.compile(model, fullgraph=True)`` traces through with no graph break (tested with
inductor and aot_eager, bitwise). The blocks' own parameters keep no memory meanwhile.
That is the path a compiler traces; an eager call does the same work without the
dispatcher and ``functional_call`` (Note [Eager streamed calls]).

Note [Sharded streaming in PyTorch]: with ``sharded=True`` inside a ``torch.distributed``
job, each of the N ranks keeps 1/N of every block in its pinned slab (shards of
ceil(bytes / N) rounded up to 64 bytes) and the streamer copies only that shard into its
place in the slot; the process group's in-place ``all_gather_into_tensor`` assembles the
block (the collective is torch.distributed's: gloo on CPU, NCCL on GPUs). The host link
carries each block once for the N ranks instead of N times. The gathers are pipelined: at
the acquire of block l, the gathers of blocks l+1 .. l+depth-1 start (asynchronous, on a
side stream on CUDA) as soon as the streamer says their shard's copy has landed
(``WeightStreamer::upcoming``), so a block's gather runs while the blocks before it
compute; with depth 1 (the copy of the next block issued at this acquire) a block is
gathered at its own acquire.

Note [Training through streamed blocks]: ``training=True`` (one process, eager mode) runs
the streamer's training schedule, blocks 0..L-1 in forward and L-1..0 in backward. Each
block's call is an ``autograd.Function``: forward acquires the slot, runs the block without
recording a graph and releases it; backward acquires the block again (re-streamed, as the
reference model does: keeping every block's weights for backward is what streaming avoids;
the last ``depth + 1`` blocks of forward are still in their slots, hits), recomputes the
block with its weights as leaves and its saved inputs (the RNG state of the forward
restored), and returns the gradients of the inputs and of the parameters. The parameters
are views of the pinned slabs (on the CPU, also for a CUDA model), so autograd accumulates
their ``.grad`` as for any parameter (hooks fire, accumulation is bitwise the resident
model's) and any optimizer updates them in place in the slabs; the next forward tells the
streamer (``step_end``) that the slabs hold the next weights, first copying back any
parameter an optimizer re-pointed elsewhere. A forward without gradients in a training
session raises (its backward visits would never come).

Note [Stream session lifetime]: each block's wrapper holds its session; the custom ops,
which take the session's id, find it in a weak table. A model dropped without ``remove()``
frees its session, its pinned slabs and its slots.

Note [Weights written after streaming]: ``load_state_dict`` writes a block's weights into
its slab (Note [A streamed model's state dict]); the slabs' version counters tell the next
inference forward, which opens the session again rather than compute from the ring's old
copies or the blocks prefetched at the end of the last forward.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from .. import _spillway
from ._common import _first_tensor, _record_report, find_decoder_layers

__all__ = ["StreamedWeights", "stream_weights"]

# The live sessions by id, for the custom ops (which take ints), held weakly: each wrapper
# holds its session, so a dropped model frees its slabs and slots (Note [Stream session
# lifetime]).
_SESSIONS: weakref.WeakValueDictionary[int, StreamedWeights] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_ALIGN = 64  # bytes: every parameter starts aligned in its slab and slot


# Note [Stream op order]: both ops mutate the session's token, so a compiler keeps every
# acquire and release in program order (an acquire of block l + 1 moved before the release
# of block l would be refused by the streamer).
@torch.library.custom_op("spillway::stream_acquire", mutates_args=("token",))
def _stream_acquire(token: torch.Tensor, session: int, layer: int, nbytes: int) -> torch.Tensor:
    """Block ``layer``'s slot (its first ``nbytes``), holding the block's weights."""
    return _SESSIONS[session]._acquire(layer, nbytes)


@_stream_acquire.register_fake
def _(token: torch.Tensor, session: int, layer: int, nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=token.device)


@torch.library.custom_op("spillway::stream_release", mutates_args=("token",))
def _stream_release(token: torch.Tensor, output: torch.Tensor, session: int, layer: int) -> None:
    """Block ``layer``'s work (which produced ``output``) is enqueued: its slot may be refilled."""
    _SESSIONS[session]._session.release(layer)


@_stream_release.register_fake
def _(token: torch.Tensor, output: torch.Tensor, session: int, layer: int) -> None:
    return None


class _StreamedBlock(nn.Module):
    """A block computing from its slot (Note [Streamed blocks])."""

    def __init__(self, inner: nn.Module, owner: StreamedWeights, index: int) -> None:
        super().__init__()
        self.inner = inner
        self._owner = owner  # Note [Stream session lifetime]: the model holds its session
        self._owner_id = owner._id
        self._index = index
        self._nbytes = owner.layer_bytes[index]
        self._layout = owner._layouts[index]  # (name, offset, dtype, shape, bytes)
        self._token = owner._token
        self._loaded: list[str] = []  # keys the last load wrote into the slab
        self.register_state_dict_post_hook(_hide_wrapper)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_load_into_slab)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_post_hook(_not_missing)  # type: ignore[no-untyped-call]
        # Note [Eager streamed calls]: block l always computes from slot l % (depth + 1)
        # (Note [Static slots]), so its parameters' views of that slot are made once, here,
        # outside any inference mode (a view made under it could not be used outside), each
        # beside the parameter table of the submodule that holds it.
        with torch.inference_mode(False):
            slot = owner._slots[index % (owner.depth + 1)][: self._nbytes]
            self._swaps: list[tuple[dict[str, Any], str, torch.Tensor]] = []
            for name, off, dtype, shape, n in self._layout:
                where, _, key = name.rpartition(".")
                table = inner.get_submodule(where)._parameters
                self._swaps.append((table, key, slot[off : off + n].view(dtype).view(shape)))
            self._slot_views = [view for _, _, view in self._swaps]

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            name: flat[off : off + n].view(dtype).view(shape)
            for name, off, dtype, shape, n in self._layout
        }

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner
        if owner.training:
            return _train_call(self, owner, args, kwargs)
        if not torch.compiler.is_compiling():
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "stream_weights: this session streams inference; run the model under "
                    "torch.no_grad() or torch.inference_mode(), or stream with training=True "
                    "(blocks re-streamed in backward)"
                )
            return self._eager_call(owner, args, kwargs)
        flat = torch.ops.spillway.stream_acquire(
            self._token, self._owner_id, self._index, self._nbytes
        )
        params = {
            name: flat[off : off + n].view(dtype).view(shape)
            for name, off, dtype, shape, n in self._layout
        }
        out = torch.func.functional_call(self.inner, params, args, kwargs, tie_weights=False)
        first = _first_tensor(out)
        torch.ops.spillway.stream_release(
            self._token, first if first is not None else self._token, self._owner_id, self._index
        )
        return out

    def _eager_call(self, owner: StreamedWeights, args: Any, kwargs: Any) -> Any:
        """Note [Eager streamed calls]: outside a compiler the custom ops and
        ``functional_call`` are only their cost (the dispatcher twice, a view per parameter
        and the module walk of functional_call at every call, about 65 us per block on
        2026-11-28): the streamer is called directly and the block computes from the slot's
        views made once (``_call_with``). What the block computes, and from which bytes, is
        the same."""
        owner._ready(self._index)
        out = self._call_with(self._slot_views, args, kwargs)
        owner._session.release(self._index)
        return out

    def _call_with(self, weights: Sequence[torch.Tensor], args: Any, kwargs: Any) -> Any:
        """The block called with `weights` (in layout order) in its parameter tables for the
        length of the call, then what they held again, whatever the call raised."""
        swaps = self._swaps
        held = [table[key] for table, key, _ in swaps]
        for (table, key, _), w in zip(swaps, weights):
            table[key] = w
        try:
            return self.inner(*args, **kwargs)
        finally:
            for (table, key, _), p in zip(swaps, held):
                table[key] = p


# Note [A streamed model's state dict]: a streamed block sits in its wrapper (``inner``) and,
# in inference, its parameters are empty placeholders (the weights are in its pinned slab).
# state_dict() gives the model's own keys and weights all the same: the wrapper's level is
# taken out of the keys and each placeholder is replaced by its view of the slab (a CPU
# tensor). load_state_dict() writes a block's weights into its slab (cast and copied as torch
# copies into a parameter; a shape that differs is an error, as torch's), and the next
# forward streams them (Note [Weights written after streaming]). In training the parameters
# are the slab views themselves and load as any parameter. A sharded session holds 1/N of
# each block: both refuse, naming remove().


def _hide_wrapper(module: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
    """state_dict's post-hook of a wrapper (its entries were the last added: popping and
    re-adding keeps their order)."""
    block: _StreamedBlock = module  # type: ignore[assignment]
    owner = block._owner
    if owner.ranks > 1:
        raise RuntimeError(
            "stream_weights: a sharded session's blocks hold 1/N of their weights on each rank; "
            "call remove() on every rank before state_dict()"
        )
    inner = prefix + "inner."
    views = {} if owner.training else dict(block._views(owner._slabs[block._index]))
    for key in [k for k in state if k.startswith(inner)]:
        name = key[len(inner) :]
        value = state.pop(key)
        state[prefix + name] = views[name].detach() if name in views else value


def _load_into_slab(
    module: nn.Module,
    state: dict[str, Any],
    prefix: str,
    meta: Any,
    strict: bool,
    missing: list[str],
    unexpected: list[str],
    errors: list[str],
) -> None:
    """load_state_dict's pre-hook of a wrapper: the model's keys moved under ``inner``; in
    inference, the block's weights written into its slab."""
    block: _StreamedBlock = module  # type: ignore[assignment]
    owner = block._owner
    if owner.ranks > 1:
        raise RuntimeError(
            "stream_weights: a sharded session cannot load a state dict; call remove() on "
            "every rank, load, then stream again"
        )
    inner = prefix + "inner."
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(inner)]:
        state[inner + key[len(prefix) :]] = state.pop(key)
    block._loaded = []
    if owner.training:
        return
    views = block._views(owner._slabs[block._index])
    with torch.no_grad():
        for name, view in views.items():
            key = inner + name
            if key not in state:
                continue
            value = state.pop(key)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(view.shape):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                errors.append(
                    f"size mismatch for {prefix}{name}: copying a param with shape {shape} "
                    f"from checkpoint, the shape in current model is {tuple(view.shape)}."
                )
                continue
            view.copy_(value)
            block._loaded.append(key)


def _not_missing(module: nn.Module, incompatible: Any) -> None:
    """load_state_dict's post-hook of a wrapper: the weights written into the slab are not
    missing (their placeholders took nothing)."""
    block: _StreamedBlock = module  # type: ignore[assignment]
    done = set(block._loaded)
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in done]
    block._loaded = []


def _train_call(block: _StreamedBlock, owner: StreamedWeights, args: Any, kwargs: Any) -> Any:
    """Note [Training through streamed blocks]: one block's forward, its backward to come."""
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "stream_weights: a training=True session runs every forward with its backward "
            "(the streamer's schedule re-streams the blocks in reverse); a forward without "
            "gradients would leave it waiting. Evaluate with a separate session (remove() "
            "this one, stream_weights(model) for inference) or with gradients enabled"
        )
    if torch.compiler.is_compiling():
        raise RuntimeError("stream_weights: training=True streams in eager mode only")
    leaves, spec = pytree.tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    params = owner._params[block._index]
    box: dict[str, Any] = {}
    outs = _StreamedBlockFn.apply(
        block, owner, leaves, spec, where, len(params), box, owner._anchor,
        *[leaves[i] for i in where], *params,
    )  # fmt: skip
    out_leaves = list(box["leaves"])
    for i, t in zip(box["where"], outs):
        out_leaves[i] = t
    return pytree.tree_unflatten(out_leaves, box["spec"])


class _StreamedBlockFn(torch.autograd.Function):
    """A streamed block in training (Note [Training through streamed blocks])."""

    @staticmethod
    def forward(
        ctx: Any,
        block: _StreamedBlock,
        owner: StreamedWeights,
        leaves: list[Any],
        spec: Any,
        where: list[int],
        n_params: int,
        box: dict[str, Any],
        anchor: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        inputs = tensors[: len(tensors) - n_params]
        layer = block._index
        if layer == 0 and owner._backward_done:
            owner._step_end()
        rng = _rng_state(owner.device)
        owner._ready(layer)
        call = list(leaves)
        for i, t in zip(where, inputs):
            call[i] = t
        args, kwargs = pytree.tree_unflatten(call, spec)
        # Note [Eager streamed calls]: the slot's views, lent for the call.
        out = block._call_with(block._slot_views, args, kwargs)
        owner._session.release(layer)
        out_leaves, out_spec = pytree.tree_flatten(out)
        out_where = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        box.update(leaves=out_leaves, spec=out_spec, where=out_where)
        ctx.save_for_backward(*inputs)
        ctx.block, ctx.owner, ctx.rng = block, owner, rng
        ctx.call, ctx.spec, ctx.where, ctx.out_where = leaves, spec, where, out_where
        return tuple(out_leaves[i] for i in out_where)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        block, owner = ctx.block, ctx.owner
        layer = block._index
        params = owner._params[layer]
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        call = list(ctx.call)
        for i, t in zip(ctx.where, inputs):
            call[i] = t
        args, kwargs = pytree.tree_unflatten(call, ctx.spec)
        owner._ready(layer)
        weights = [
            view.detach().requires_grad_(p.requires_grad)
            for (_, _, view), p in zip(block._swaps, params)
        ]
        with torch.random.fork_rng(devices=_rng_devices(owner.device)), torch.enable_grad():
            _set_rng_state(owner.device, ctx.rng)
            out = block._call_with(weights, args, kwargs)
        out_leaves = pytree.tree_leaves(out)
        outs, gs = [], []
        for i, g in zip(ctx.out_where, grads):
            o = out_leaves[i]
            if g is not None and isinstance(o, torch.Tensor) and o.requires_grad:
                outs.append(o)
                gs.append(g)
        wanted = [t for t in inputs if t.requires_grad] + [w for w in weights if w.requires_grad]
        got = list(torch.autograd.grad(outs, wanted, gs, allow_unused=True)) if outs else []
        owner._session.release(layer)
        if layer == 0:
            owner._backward_done = True
        it = iter(got + [None] * (len(wanted) - len(got)))
        d_in = [next(it) if t.requires_grad else None for t in inputs]
        d_w: list[Optional[torch.Tensor]] = []
        for w, p in zip(weights, params):
            g = next(it) if w.requires_grad else None
            # The parameters live in the slabs (CPU): a CUDA block's gradients come back.
            d_w.append(g.to(p.device) if g is not None and g.device != p.device else g)
        return (None,) * 8 + tuple(d_in) + tuple(d_w)


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(
    device: torch.device, state: tuple[torch.Tensor, Optional[torch.Tensor]]
) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class StreamedWeights:
    """What :func:`stream_weights` returns: the handle of a model whose blocks stream."""

    def __init__(
        self,
        model: nn.Module,
        depth: int = 2,
        layers: Optional[Sequence[nn.Module]] = None,
        h2d_gbps: float = 0.0,
        sharded: bool = False,
        training: bool = False,
    ) -> None:
        if sharded and training:
            raise ValueError(
                "stream_weights: sharded=True streams inference; training=True streams whole "
                "blocks on each rank"
            )
        if sharded and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "stream_weights: sharded=True needs an initialized torch.distributed process "
                "group (each rank streams 1/N of every block, an all-gather assembles it)"
            )
        self.ranks = dist.get_world_size() if sharded else 1
        self.rank = dist.get_rank() if sharded else 0
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
        self.training = training
        self._backward_done = False  # training: a step's backward reached block 0
        # Sharded: the all-gathers started ahead, by block, and how many ran ahead so far.
        self._gathers: dict[int, Any] = {}
        self.gathers_ahead = 0
        self.blocks = blocks
        # Where each block sits in the model, to put its wrapper there.
        self._places = [_place_of(model, b, i) for i, b in enumerate(blocks)]
        owner: dict[int, int] = {}
        self._layouts: list[list[tuple[str, int, torch.dtype, tuple[int, ...], int]]] = []
        self._params: list[list[nn.Parameter]] = []
        self.layer_bytes: list[int] = []
        for i, block in enumerate(blocks):
            layout, ps, at = [], [], 0
            for name, p in block.named_parameters():
                if id(p) in owner:
                    raise ValueError(
                        f"stream_weights: a parameter of block {i} is also block "
                        f"{owner[id(p)]}'s (tied weights cannot stream)"
                    )
                owner[id(p)] = i
                if not p.is_contiguous() or p.layout != torch.strided:
                    raise ValueError(f"stream_weights: block {i} has a non-contiguous parameter")
                n = p.numel() * p.element_size()
                layout.append((name, at, p.dtype, tuple(p.shape), n))
                ps.append(p)
                at += (n + _ALIGN - 1) // _ALIGN * _ALIGN
            if not ps:
                raise ValueError(f"stream_weights: block {i} has no parameters")
            # Note [Streamed calls without tie detection]: a block reaching one parameter
            # under two names (a submodule assigned twice) is refused: functional_call's
            # restore after a call leaves one of the names holding the streamed view instead
            # of the parameter (found: training then put the gradients on the streamed
            # copy, the model's own parameters got none). Without aliases the calls skip
            # the tie detection, which walks the block at every call.
            every = [name for name, _ in block.named_parameters(remove_duplicate=False)]
            if len(every) != len(layout):
                kept = {name for name, *_ in layout}
                raise ValueError(
                    f"stream_weights: block {i} reaches a parameter under two names "
                    f"({', '.join(n for n in every if n not in kept)} again); a block whose "
                    "submodule or parameter is assigned twice cannot stream: assign it once"
                )
            self._layouts.append(layout)
            self._params.append(ps)
            self.layer_bytes.append(at)
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
        # Note [Sharded streaming in PyTorch]: a block is N shards; this rank's slab holds
        # shard `rank` (the whole block when N = 1), the slot all N.
        r, nr = self.rank, self.ranks
        self._shard = [(n + nr - 1) // nr + _ALIGN - 1 for n in self.layer_bytes]
        self._shard = [
            sh // _ALIGN * _ALIGN if nr > 1 else n for sh, n in zip(self._shard, self.layer_bytes)
        ]
        slot_bytes = max(sh * nr for sh in self._shard)
        # The slabs (pinned host memory) and the ring; the blocks' own parameters give their
        # memory up.
        self._slabs = [torch.zeros(sh, dtype=torch.uint8, pin_memory=pin) for sh in self._shard]
        self._slots = [
            torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(depth + 1)
        ]
        with torch.no_grad():
            for i, ps in enumerate(self._params):
                packed = torch.zeros(self._shard[i] * nr, dtype=torch.uint8)
                for p, (_, off, dtype, _, n) in zip(ps, self._layouts[i]):
                    packed[off : off + n].view(dtype).copy_(p.detach().reshape(-1).cpu())
                    p.data = torch.empty(0, dtype=dtype, device=device)
                self._slabs[i].copy_(packed[r * self._shard[i] : (r + 1) * self._shard[i]])
                if training:  # the parameters are the slabs (Note [Training through ...])
                    for p, view in zip(ps, self._slab_views(i)):
                        p.data = view
        # The streamer moves this rank's shards: its "layers" are the shards, its slots the
        # shard's place in each slot (static slots: block l in slot l % (depth + 1); every
        # shard of a slot has the same offset, the largest shard times the rank).
        self._slot_offset = r * max(self._shard)
        self._h2d_gbps = h2d_gbps
        self.reloads = 0  # sessions opened again after the weights were written
        self._session = self._open()
        self._slab_versions = [s._version for s in self._slabs]
        self._id = next(_IDS)
        _SESSIONS[self._id] = self
        self._token = torch.zeros(1, device=device)
        # Sharded on CUDA: the side stream the gathers ahead run from.
        self._side: Optional[torch.cuda.Stream] = None
        if nr > 1 and device.type == "cuda":
            self._side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # Training: an input of every block's autograd.Function that requires grad, so that
        # its backward (and the block's backward visit) runs whatever else is frozen.
        self._anchor = torch.zeros((), requires_grad=True)
        self.wrappers = [_StreamedBlock(b, self, i) for i, b in enumerate(blocks)]
        for (parent, key), w in zip(self._places, self.wrappers):
            _put(parent, key, w)

    def _open(self) -> Any:
        """A streamer session over the slabs and slots."""
        if self.device.type == "cuda":
            kind, ordinal = "cuda", self.device.index if self.device.index is not None else 0
            stream = torch.cuda.current_stream(self.device).cuda_stream
        else:
            kind, ordinal, stream = "host", 0, 0
        return _spillway.StreamSession(
            kind,
            ordinal,
            stream,
            self._shard,
            self.depth,
            self.training,
            [s.data_ptr() for s in self._slabs],
            [s.data_ptr() + self._slot_offset for s in self._slots],
            self._h2d_gbps,
            # The session keeps the slabs and slots alive until its copies are done, whatever
            # order Python frees this object's attributes in.
            (self._slabs, self._slots),
        )

    def _check_writes(self) -> None:
        """Note [Weights written after streaming]: at the start of an inference forward, a
        slab written since the last one (``load_state_dict``; its version counter) means the
        ring may hold old weights, and this forward's first blocks were prefetched at the
        end of the last: the session is opened again (its copies waited for), and every
        block is loaded anew. One comparison per block per forward."""
        if all(s._version == v for s, v in zip(self._slabs, self._slab_versions)):
            return
        self._drain()
        self._session = None
        self._session = self._open()
        self._slab_versions = [s._version for s in self._slabs]
        self.reloads += 1

    def _acquire(self, layer: int, nbytes: int) -> torch.Tensor:
        """Block ``layer``'s slot, its first ``nbytes``, once its weights are there."""
        self._ready(layer)
        return self._slots[layer % (self.depth + 1)][:nbytes]

    def _ready(self, layer: int) -> None:
        """Returns once block ``layer``'s weights are in its slot (for torch's work after)."""
        if layer == 0 and not self.training:
            self._check_writes()
        slot = self._slots[layer % (self.depth + 1)]
        ptr = self._session.acquire(layer)
        if ptr != slot.data_ptr() + self._slot_offset:
            raise RuntimeError(f"stream_weights: block {layer} landed outside its slot")
        if self.ranks == 1:
            return
        # Note [Sharded streaming in PyTorch]: the block's all-gather was started ahead, or
        # runs now; then the gathers of the blocks up to depth - 1 ahead start, each once
        # its shard's copy has landed (the copies run depth ahead), on a side stream on CUDA.
        work = self._gathers.pop(layer, None)
        if work is not None:
            work.wait()
        else:
            self._gather(layer, False)
        for ahead in range(1, self.depth):
            nxt = (layer + ahead) % len(self.blocks)
            if nxt in self._gathers:
                continue
            side = self._side.cuda_stream if self._side is not None else 0
            got = self._session.ahead_ready(ahead, side)
            if got < 0:
                break  # its copy waits for a slot (Note [Static slots]): gathered at acquire
            if got != nxt:
                raise RuntimeError(f"stream_weights: block {got} comes after {layer}, not {nxt}")
            if self._side is not None:
                with torch.cuda.stream(self._side):
                    self._gathers[nxt] = self._gather(nxt, True)
            else:
                self._gathers[nxt] = self._gather(nxt, True)
            self.gathers_ahead += 1

    def _gather(self, layer: int, async_op: bool) -> Any:
        """Assembles block ``layer``'s shards in its slot (its own has landed)."""
        slot = self._slots[layer % (self.depth + 1)]
        # The shards sit at rank * largest shard; they are gathered at rank * this block's
        # shard, so a block whose shard is smaller first moves its own down (a no-op for
        # the largest block).
        sh, big = self._shard[layer], max(self._shard)
        if sh != big:
            mine = slot[self._slot_offset : self._slot_offset + sh].clone()
            slot[self.rank * sh : (self.rank + 1) * sh].copy_(mine)
        whole = slot[: sh * self.ranks]
        mine = whole[self.rank * sh : (self.rank + 1) * sh]
        return dist.all_gather_into_tensor(whole, mine, async_op=async_op)

    def _drain(self) -> None:
        """Waits for the all-gathers started ahead (they write into the slots)."""
        for work in self._gathers.values():
            work.wait()
        self._gathers.clear()

    def _slab_views(self, i: int) -> list[torch.Tensor]:
        """Block ``i``'s parameters as views of its slab (whole blocks only)."""
        return [
            self._slabs[i][off : off + n].view(dtype).view(shape)
            for _, off, dtype, shape, n in self._layouts[i]
        ]

    def _sync_slabs(self) -> None:
        """Training: a parameter an optimizer re-pointed elsewhere is copied back into its
        slab, which stays what the streamer reads."""
        with torch.no_grad():
            for i, ps in enumerate(self._params):
                for p, view in zip(ps, self._slab_views(i)):
                    if p.data_ptr() != view.data_ptr():
                        view.copy_(p.detach().reshape(view.shape))

    def _step_end(self) -> None:
        """Training: the slabs hold the next step's weights; the streamer may load them."""
        self._sync_slabs()
        self._backward_done = False
        self._session.step_end()

    def report(self) -> dict[str, Any]:
        """Loads, hits, bytes copied, copy and stall ms, achieved GB/s (since the start)."""
        t = dict(self._session.telemetry())
        t["reloads"] = self.reloads  # the figures above are since the last reload
        _record_report("stream", t)
        return t

    def remove(self) -> None:
        """Stops streaming: the blocks are back in place with device memory of their own
        (sharded: a collective, every rank calls it)."""
        self._drain()
        if self.training:  # the slabs hold the newest weights
            self._sync_slabs()
        with torch.no_grad():
            for i, ps in enumerate(self._params):
                whole = self._slabs[i]
                if self.ranks > 1:  # every rank calls remove(): the shards are gathered
                    whole = torch.empty(self._shard[i] * self.ranks, dtype=torch.uint8)
                    dist.all_gather_into_tensor(whole, self._slabs[i].clone())
                for p, (_, off, dtype, shape, n) in zip(ps, self._layouts[i]):
                    host = whole[off : off + n].view(dtype).view(shape)
                    p.data = host.to(self.device, copy=True)
        for (parent, key), b in zip(self._places, self.blocks):
            _put(parent, key, b)
        _SESSIONS.pop(self._id, None)


def _place_of(model: nn.Module, block: nn.Module, i: int) -> tuple[nn.Module, str]:
    for parent in model.modules():
        for key, child in parent.named_children():
            if child is block:
                return parent, key
    raise ValueError(f"stream_weights: block {i} is not a submodule of the model")


def _put(parent: nn.Module, key: str, module: nn.Module) -> None:
    if isinstance(parent, (nn.ModuleList, nn.Sequential)):
        parent[int(key)] = module
    else:
        setattr(parent, key, module)


def stream_weights(
    model: nn.Module,
    depth: int = 2,
    *,
    layers: Optional[Sequence[nn.Module]] = None,
    h2d_gbps: float = 0.0,
    sharded: bool = False,
    training: bool = False,
) -> StreamedWeights:
    """Streams the weights of ``model``'s decoder blocks from pinned host memory.

    Args:
        model: the model; its decoder blocks are found as :func:`offload_activations` finds
            them, or given as ``layers`` (submodules of ``model``).
        depth: blocks copied ahead of the one computing (``depth + 1`` device slots, each the
            size of the largest block).
        h2d_gbps: CPU parameters only (spillway's host backend emulates the device): throttle
            the emulated host-to-device link, GB/s (0: memcpy speed).
        sharded: in a torch.distributed job, each rank streams 1/N of every block and an
            all-gather assembles it (Note [Sharded streaming in PyTorch]).
        training: stream forward and backward, eager mode: each block is re-streamed and
            recomputed in backward; the parameters are views of the pinned slabs, where
            their ``.grad`` accumulates and an optimizer updates them (Note [Training
            through streamed blocks]). Every forward must be followed by its backward.

    Returns the :class:`StreamedWeights` handle (``report()``, ``remove()``).
    """
    return StreamedWeights(model, depth, layers, h2d_gbps, sharded, training)

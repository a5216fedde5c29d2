"""Selective recompute of a plan's layer (Note [Selective recompute of a plan]).

Note [Selective recompute of a plan]: a plan's layer that keeps some tensors, offloads some
and recomputes the rest runs under ``torch.utils.checkpoint`` with a per-op policy of our
own (the ``context_fn`` of non-reentrant checkpointing). In the forward, a dispatch mode
records every op; the adapter's module hooks give op outputs their planner names (Note
[Names of Hugging Face tensors]: the output of ``gate_proj`` is ``mlp.gate_out``, the input
of ``down_proj`` is ``mlp.act``), and an op whose output gets a name the plan keeps or
offloads is cached: kept on the device, or handed to the offload engine (reloaded before
the layer's backward like any offloaded tensor). Everything else is dropped as checkpointing
drops it. In backward the layer's forward runs again under a second mode that returns the
cached outputs in place of their ops and recomputes the rest; the ops run in the same order
(the forward's dispatch order, ``SAC_IGNORED_OPS`` left out on both sides, as PyTorch's own
selective checkpointing does), so the op index is the key. Values are the forward's own, so
gradients are bitwise those of the plain model.

A name matches the op that made the tensor's storage (the earliest pending op whose output
shares it), so a projection caches its matmul, not the view of it the module returns. An
op's outputs wait for their name until the module that ran them ends (or a sibling module
starts): only one module's intermediates are held at once. A module's output that takes the
same name as its input (Qwen3's ``q_norm`` after ``q_proj``: both ``attn.qkv_out``) replaces
it: one tensor per name, as the planner counts.

A cached output that a later op of the forward writes in place (Qwen3-MoE's
``norm_topk_prob``: ``router_top_value /= router_top_value.sum(...)`` after ``topk``) no
longer holds what its op returned: the replay would hand the written values to the same
in-place op, which would write them again. An output written in place before its name
comes is not cached, and a cached one is stale from that write on: its op is recomputed in
backward (an offloaded one is still reloaded and dropped, so the engine
sees every ticket used), and the count ``selective_stale:<name>`` says so.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map, tree_map_only

if TYPE_CHECKING:
    from ._offload_state import OffloadState

_IGNORED = torch.utils.checkpoint.SAC_IGNORED_OPS
_EXPERTS = re.compile(r"(^|\.)experts$")


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def _aliases(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _written(func: Any, args: Any, kwargs: Optional[dict[str, Any]]) -> list[torch.Tensor]:
    """The tensors `func` writes in place (its schema's mutable arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out: list[torch.Tensor] = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else (kwargs or {}).get(a.name)
        out.extend(x for x in torch.utils._pytree.tree_leaves(value) if isinstance(x, torch.Tensor))
    return out


class _Pending:
    __slots__ = ("index", "out", "creator", "storages", "written")

    def __init__(self, index: int, out: Any, creator: str) -> None:
        self.index = index
        self.out = out
        self.creator = creator
        self.written = False  # written in place since: never cached
        self.storages = {
            _storage(x) for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)
        }


class SelectiveLayer:
    """One plan layer run under selective recompute: the names it keeps and offloads, and
    what its last forward cached (op index -> outputs, tensors kept or packed)."""

    def __init__(
        self, owner: OffloadState, layer: int, keep: frozenset[str], offload: frozenset[str]
    ) -> None:
        self.owner = owner
        self.layer = layer
        self.keep = keep
        self.offload = offload
        self.recording = False
        self.count = 0
        self.pending: list[_Pending] = []
        # op index -> its name, its outputs' storages, its outputs (kept, or packed)
        self.cached: dict[int, tuple[str, set[int], Any]] = {}
        self.stale: set[int] = set()  # cached, then written in place: recomputed
        self.saved_bytes = 0  # cached this step: kept + offloaded
        self.expert_step = 0  # Note [Names inside fused experts]
        self.act_named = False
        self.inputs: dict[str, int] = {}  # experts module -> its input's storage

    def contexts(self) -> tuple[_Record, _Replay]:
        return _Record(self), _Replay(self)

    # ---- the forward: names from the adapter's hooks -----------------------------------

    def produced(self, func: Any, args: Any, out: Any) -> None:
        index = self.count
        self.count += 1
        if _aliases(func):
            return  # a view or an in-place op: recomputed from what it aliases
        running = self.owner._running
        creator = running[-1] if running else ""
        detached = tree_map_only(torch.Tensor, lambda x: x.detach(), out)
        p = _Pending(index, detached, creator)
        self.pending.append(p)
        if "scaled_dot_product" in str(func):
            # The fused attention core: its output O is the out-projection's input, and its
            # softmax statistics come with it (attn.out_proj_in and attn.core_lse).
            self.name_op(p, "attn.out_proj_in")
        elif _EXPERTS.search(creator):
            name = self._expert_op(func, args, creator)
            if name:
                self.name_op(p, name)

    def _expert_op(self, func: Any, args: Any, creator: str) -> str:
        # Note [Names inside fused experts]: an experts module with its weights as 3-D
        # tensors and no projection submodules (transformers 5's Qwen3-MoE, Mixtral, ...)
        # gathers its tokens from its input (an index of the module's input:
        # moe.dispatch_in), then runs a matmul (gate and up together: named mlp.gate_out),
        # a multiply (silu(gate) * up: mlp.act) and a matmul (moe.expert_out), per expert
        # (a loop) or for all at once (grouped GEMMs). Anything else in it is unnamed
        # (recomputed), and another layout leaves these unnamed too: the saved bytes show it.
        op = str(func)
        if op.startswith("aten.index.Tensor"):
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if source is not None and _storage(source) == self.inputs.get(creator):
                self.expert_step = 0
                self.act_named = False
                return "moe.dispatch_in"
            return ""
        if op.startswith(("aten.mm", "aten._grouped_mm", "aten.bmm")):
            self.expert_step += 1
            return {1: "mlp.gate_out", 2: "moe.expert_out"}.get(self.expert_step, "")
        if op.startswith("aten.mul") and self.expert_step == 1 and not self.act_named:
            self.act_named = True  # the multiply by the routing weight is not mlp.act
            return "mlp.act"
        return ""

    def module_input(self, path: str, t: torch.Tensor) -> None:
        if _EXPERTS.search(path):
            self.inputs[path] = _storage(t)

    def name(self, t: torch.Tensor, name: str, source: Optional[torch.Tensor] = None) -> None:
        """The tensor `t` is `name` (a module hook said so): cache the op that made it if the
        plan keeps or offloads that name. `source`: the module's input; when it is cached
        under the same name already (q_norm after q_proj, act_fn after gate_proj), the
        module's output is recomputed from it instead (one tensor per name, no GEMM run
        again)."""
        if name not in self.keep and name not in self.offload:
            return
        if source is not None and self._cached_as(_storage(source), name):
            return
        ptr = _storage(t)
        for p in self.pending:
            if ptr in p.storages:
                self.name_op(p, name)
                return

    def name_op(self, p: _Pending, name: str) -> None:
        if p.index in self.cached or (name not in self.keep and name not in self.offload):
            return
        if p.written:  # no longer what its op returned: recomputed
            self.owner._counts[f"selective_stale:{name}"] += 1
            return
        tensors = [x for x in torch.utils._pytree.tree_leaves(p.out) if isinstance(x, torch.Tensor)]
        self.saved_bytes += sum(x.nbytes for x in tensors)
        if name in self.offload:
            owner = self.owner
            packed = tree_map_only(
                torch.Tensor, lambda x: owner._offload(x, self.layer, name, uses=1), p.out
            )
            self.cached[p.index] = (name, p.storages, packed)
        else:
            self.cached[p.index] = (name, p.storages, p.out)
        self.owner._counts[
            f"selective_{'offloaded' if name in self.offload else 'kept'}:{name}"
        ] += 1

    def written(self, tensors: list[torch.Tensor]) -> None:
        """The forward wrote `tensors` in place: a cached output among them is stale."""
        ptrs = {_storage(t) for t in tensors} - {0}
        for p in self.pending:
            if ptrs & p.storages:
                p.written = True
        for index, (name, storages, _) in self.cached.items():
            if index not in self.stale and ptrs & storages:
                self.stale.add(index)
                self.owner._counts[f"selective_stale:{name}"] += 1

    def _cached_as(self, ptr: int, name: str) -> bool:
        return any(n == name and ptr in storages for n, storages, _ in self.cached.values())

    def drop(self, creator: str) -> None:
        """The ops `creator` ran so far have had their chance to be named."""
        self.pending = [p for p in self.pending if p.creator != creator]

    # ---- the backward: the forward again, cached ops answered --------------------------

    def replayed(self, index: int) -> Any:
        hit = self.cached.pop(index, None)
        if hit is None:
            return None
        unpack: Callable[[Any], torch.Tensor] = self.owner._unpack
        out = tree_map(lambda x: unpack(x) if not isinstance(x, torch.Tensor) else x, hit[2])
        if index in self.stale:  # written in place after it was cached: recomputed
            self.stale.discard(index)
            return None
        return out

    def begin(self) -> None:
        self.recording = True
        self.count = 0
        self.pending.clear()
        self.cached.clear()
        self.stale.clear()
        self.saved_bytes = 0

    def end(self) -> None:
        self.recording = False
        self.pending.clear()


class _Record(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, sel: SelectiveLayer) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sel = sel

    def __enter__(self) -> _Record:
        self.sel.begin()
        return super().__enter__()  # type: ignore[no-untyped-call,no-any-return]

    def __exit__(self, *exc: Any) -> None:
        self.sel.end()
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func not in _IGNORED:
            self.sel.produced(func, args, out)
            if self.sel.cached or self.sel.pending:
                written = _written(func, args, kwargs)
                if written:
                    self.sel.written(written)
        return out


class _Replay(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, sel: SelectiveLayer) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sel = sel
        self.count = 0

    def __enter__(self) -> _Replay:
        self.count = 0
        return super().__enter__()  # type: ignore[no-untyped-call,no-any-return]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        if func in _IGNORED:
            return func(*args, **(kwargs or {}))
        index = self.count
        self.count += 1
        hit = self.sel.replayed(index)
        if hit is not None:
            return hit
        return func(*args, **(kwargs or {}))

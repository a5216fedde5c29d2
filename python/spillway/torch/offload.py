"""Activation offload inside a PyTorch training step (docs/offload.md, docs/python.md).

``offload_activations(model)`` installs ``torch.autograd.graph.saved_tensors_hooks`` whose
pack hook hands each eligible saved tensor of a decoder block to the C++ offload engine
(borrowed memory: the tensor is kept alive by reference until the engine's copy event says
its copy has read it; never ``record_stream``), and whose unpack hook returns the tensor
reloaded into memory allocated where it is used. Reloads are prefetched one block ahead
(``prefetch_depth``) when backward reaches a block, from a hook on the block's output.

The engine is the one the C++ reference model drives, through the same hooks
(spillway/hooks.hpp): ``step_begin``, per block ``forward_begin``/``saved``/``forward_end``,
in backward ``backward_begin``/``needed``, and ``step_end`` when backward has finished.
"""

from __future__ import annotations

import collections
import functools
import re
import time
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from .. import _spillway
from .adaptive import AutoPlanner
from .selective import SelectiveLayer

__all__ = ["OffloadActivations", "offload_activations", "report"]

_last_reports: dict[str, dict[str, Any]] = {}


def report() -> dict[str, Any]:
    """The last step's telemetry of each spillway engine used in this process.

    ``report()["offload"]``: bytes offloaded and reloaded, stall ms, overlap, tensors
    offloaded and kept (and why), per layer; ``report()["optimizer"]``: the CPU AdamW's
    last step (when a :class:`CPUAdamW` stepped). Empty before the first step ends.
    """
    return {k: dict(v) for k, v in _last_reports.items()}


def _record_report(engine: str, value: dict[str, Any]) -> None:
    _last_reports[engine] = value


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder blocks: the largest ``nn.ModuleList`` of blocks of one class.

    Hugging Face models keep them in ``model.model.layers`` (``transformer.h``, ...); any
    ModuleList whose children share a class qualifies, and so does one of as many blocks
    as ``model.config.num_hidden_layers`` (a hybrid's Mamba and attention blocks, Jamba's,
    are of two classes); the one holding the most parameters wins. Raises ValueError when
    there is none (pass ``layers=`` then).
    """
    config = getattr(model, "config", None)
    n_layers = getattr(config, "num_hidden_layers", None)
    best: Optional[nn.ModuleList] = None
    best_params = -1
    for _, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 1:
            continue
        kinds = {type(m) for m in mod}
        if len(kinds) != 1 and len(mod) != n_layers:
            continue
        n = sum(p.numel() for p in mod.parameters())
        if n > best_params:
            best, best_params = mod, n
    if best is None or best_params <= 0:
        raise ValueError(
            f"offload_activations: no decoder blocks found in {type(model).__name__} (no "
            "nn.ModuleList of same-class blocks with parameters); pass layers=[...] with the "
            "blocks in forward order"
        )
    return list(best)


class _Saved:
    """One offloaded saved tensor: its ticket, how to rebuild it (on the offload's device),
    its reload."""

    __slots__ = (
        "ticket",
        "layer",
        "shape",
        "dtype",
        "nbytes",
        "name",
        "uses",
        "dst",
        "tensor",
        "step",
    )

    def __init__(
        self,
        ticket: int,
        layer: int,
        shape: torch.Size,
        dtype: torch.dtype,
        nbytes: int,
        name: str,
        step: int,
    ) -> None:
        self.ticket = ticket
        self.layer = layer
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.name = name  # counted at the step's end (Note [Hook cost per tensor])
        self.uses = 1  # unpacks still to come (a tensor saved twice is offloaded once)
        self.dst: Optional[torch.Tensor] = None  # prefetch destination
        self.tensor: Optional[torch.Tensor] = None  # reloaded, until its last use
        self.step = step


_MiB = 1 << 20
# The planner's range of a layer forward time (ms), PlanLimits::kMinLayerMs/kMaxLayerMs.
_MIN_LAYER_MS = 1e-9
_MAX_LAYER_MS = 1e9


class OffloadActivations:
    """Offloads a model's saved activations to host memory, step after step.

    Make it once (the engine's pinned pool is allocated once) and enter it around each
    training step's forward and backward::

        offload = spillway.torch.offload_activations(model)
        for batch in data:
            with offload:
                loss = model(**batch).loss
                loss.backward()
            optimizer.step()

    The step ends when backward ends (also when ``backward()`` runs after the ``with``
    block); telemetry is in :meth:`last_report` and :func:`spillway.torch.report`.

    Never offloaded: tensors saved outside the decoder blocks, parameters and views of
    parameters, tensors smaller than ``min_bytes``, non-contiguous or non-strided tensors,
    and the last ``keep_last`` blocks (backward starts there: no time to bring them back).
    """

    # Note [Copies in batches] (src/offload/offload_engine.cpp): the copies of up to
    # 8 saved tensors go to the copy stream together, after one fence, and every block's at
    # its forward's end at the latest: one stream operation per tensor instead of four.
    _copy_batch = 8

    def __init__(
        self,
        model: nn.Module,
        plan: Optional[dict[str, Any] | str] = None,
        *,
        layers: Optional[Sequence[nn.Module]] = None,
        pinned_bytes: Optional[int] = None,
        min_bytes: int = 64 * 1024,
        keep_last: int = 1,
        prefetch_depth: int = 1,
        inflight_bound_bytes: int = 0,
        max_tensors: int = 8192,
        verify: bool = False,
        d2h_gbps: float = 0.0,
        h2d_gbps: float = 0.0,
        on_step: Optional[Callable[[dict[str, Any]], None]] = None,
        offload_tensors: Optional[Sequence[str] | str] = None,
        hardware: str = "gh200",
        hbm_budget_gb: Optional[float] = None,
        margin: float = 0.10,
        layer_fwd_ms: Optional[float] = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"offload_activations: model must be an nn.Module, not {type(model)}")
        if hasattr(model, "_orig_mod") or _compiled_in_place(model):
            raise ValueError(
                "offload_activations: the model is compiled (torch.compile); the saved-tensor "
                "hooks cannot see inside a compiled graph. Pass the eager model and compile "
                "inside it, or offload without compiling (docs/python.md)"
            )
        for name, value in (
            ("min_bytes", min_bytes),
            ("keep_last", keep_last),
            ("inflight_bound_bytes", inflight_bound_bytes),
        ):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"offload_activations: {name} is {value!r}; must be an int >= 0")
        if not isinstance(prefetch_depth, int) or not 1 <= prefetch_depth <= 64:
            raise ValueError(
                f"offload_activations: prefetch_depth is {prefetch_depth!r}; must be in [1, 64]"
            )
        if not isinstance(max_tensors, int) or max_tensors < 1:
            raise ValueError(f"offload_activations: max_tensors is {max_tensors!r}; must be >= 1")
        if layer_fwd_ms is not None:  # Note [A fixed calibration] (adaptive.py)
            if (
                isinstance(layer_fwd_ms, bool)
                or not isinstance(layer_fwd_ms, (int, float))
                or not _MIN_LAYER_MS <= layer_fwd_ms <= _MAX_LAYER_MS  # NaN is neither
            ):
                raise ValueError(
                    f"offload_activations: layer_fwd_ms is {layer_fwd_ms!r}; must be a layer "
                    f"forward time in ms in [{_MIN_LAYER_MS:g}, {_MAX_LAYER_MS:g}] (or None: "
                    "measured)"
                )
            if plan != "auto":
                raise ValueError(
                    f"offload_activations: layer_fwd_ms is {layer_fwd_ms!r}, which calibrates "
                    'plan="auto"; a given plan was calibrated when it was made (pass it to '
                    "spillway.plan() instead)"
                )
        if pinned_bytes is not None and (not isinstance(pinned_bytes, int) or pinned_bytes < 1):
            raise ValueError(
                f"offload_activations: pinned_bytes is {pinned_bytes!r}; must be an int >= 1 "
                "(or None: sized by the first step)"
            )
        self.model = model
        self.layers: list[nn.Module] = (
            list(layers) if layers is not None else find_decoder_layers(model)
        )
        if not self.layers:
            raise ValueError("offload_activations: layers is empty")
        self.pinned_bytes = pinned_bytes
        self.min_bytes = min_bytes
        self.keep_last = min(keep_last, len(self.layers))
        self.prefetch_depth = prefetch_depth
        self.inflight_bound_bytes = inflight_bound_bytes
        self.max_tensors = max_tensors
        self.verify = verify
        self.d2h_gbps = d2h_gbps
        self.h2d_gbps = h2d_gbps
        self.on_step = on_step
        # Note [Re-planning while training]: plan="auto" plans after a measured first step
        # and re-plans between steps.
        self._auto: Optional[AutoPlanner] = None
        self._fwd_start: dict[int, float] = {}
        self._fwd_ms: list[float] = [0.0] * len(self.layers)
        self._shape: Optional[tuple[int, int, str]] = None
        if isinstance(plan, str):
            if plan != "auto":
                raise ValueError(
                    f"offload_activations: plan is {plan!r}; a plan is a dict from spillway.plan() "
                    'or "auto" (planned from a measured first step, re-planned as it drifts)'
                )
            if offload_tensors is not None:
                raise ValueError(
                    'offload_activations: plan="auto" chooses the tensors; offload_tensors '
                    "states them: pass one of the two"
                )
            self._auto = AutoPlanner(
                model,
                hardware=hardware,
                hbm_budget_gb=hbm_budget_gb,
                margin=margin,
                keep_last=max(self.keep_last, 1),
                prefetch_depth=prefetch_depth,
                d2h_gbps=d2h_gbps,
                layer_fwd_ms=None if layer_fwd_ms is None else float(layer_fwd_ms),
            )
            plan = None
        self.plan = plan
        # Plan mode: per layer, the plan's saved-tensor names that go to the host, and the
        # layers the plan recomputes (wrapped in torch.utils.checkpoint).
        self._offload_names: Optional[list[frozenset[str]]] = None
        self._checkpointed: list[int] = []
        # Note [Selective recompute of a plan]: the checkpointed layers that keep or offload
        # some of their tensors.
        self._selective: dict[int, SelectiveLayer] = {}
        self._originals: dict[int, Any] = {}
        if plan is not None:
            if offload_tensors is not None:
                raise ValueError(
                    "offload_activations: plan and offload_tensors both say which tensors go "
                    "to the host; plan with them instead (spillway.plan(..., "
                    "offload_tensors=...))"
                )
            self._read_plan(plan)
        elif offload_tensors is not None:
            self._read_names(offload_tensors)
        elif self._auto is not None:
            # The measured step offloads nothing; the names are given from the first plan on.
            self._offload_names = [frozenset() for _ in self.layers]
            self.keep_last = 0
        self._plan_mode = plan is not None or self._auto is not None
        # Plan mode names each saved tensor (Note [Names of Hugging Face tensors]): the
        # submodules running, and the tensors some of them produced or were given.
        self._running: list[str] = []
        self._named: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}

        self._session: Optional[Any] = None
        self._device: Optional[torch.device] = None
        self._device_index: Optional[int] = None  # its get_device(): -1 for the CPU
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._handles: list[Any] = []
        self._layer: Optional[int] = None
        self._step = 0
        self._open = False  # a step began and has not ended
        self._in_backward = False
        self._param_storages: set[int] = set()
        # The sources of this step's copies, in the order the engine took them, until the
        # engine says they are copied (_released of them were dropped).
        self._pending: collections.deque[torch.Tensor] = collections.deque()
        self._released = 0
        self._release_at = 8  # _pending's length that asks which copies are done
        self._offload_below = len(self.layers)  # the blocks below it may offload
        self._by_layer: list[list[_Saved]] = [[] for _ in self.layers]
        # Offloaded this step, by id(): what it became, the tensor, its version and address.
        self._dedup: dict[int, tuple[_Saved, weakref.ref[torch.Tensor], int, int]] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        self._sizing_bytes = 0
        self._grad_forwards = 0  # blocks that ran with grad enabled this step
        self._warned: set[str] = set()
        self._traced = False  # Note [Compiled after offload]
        # Note [A model as PyTorch runs it] (src/plan/saved_as_run.cpp, measure.py): while
        # not None, what each block saves is counted by name (bytes, each storage once).
        self._census: Optional[list[dict[str, int]]] = None
        self._census_seen: set[int] = set()
        self._last: dict[str, Any] = {}
        self._install_module_hooks()

    # ---- the module hooks: which block runs, where backward is -----------------------

    def _install_module_hooks(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._model_pre))
        for i, block in enumerate(self.layers):
            self._handles.append(block.register_forward_pre_hook(self._make_pre(i)))
            self._handles.append(block.register_forward_hook(self._make_post(i)))
            if self._offload_names is not None:
                for path, sub in block.named_modules():
                    if path:
                        self._handles.append(
                            sub.register_forward_pre_hook(self._make_sub_pre(path))
                        )
                        self._handles.append(sub.register_forward_hook(self._make_sub_post(path)))
        for i in self._checkpointed:
            self._wrap_in_checkpoint(i)

    def _read_plan(self, plan: dict[str, Any]) -> None:
        if not isinstance(plan, dict) or plan.get("schema") != "spillway.plan/1":
            raise ValueError(
                "offload_activations: plan must be a dict of schema spillway.plan/1 (what "
                "spillway.plan() returns, or json.load of `spillway plan --json`), got "
                f"{plan.get('schema') if isinstance(plan, dict) else type(plan).__name__!r}"
            )
        layers = plan.get("layers", [])
        if len(layers) != len(self.layers):
            raise ValueError(
                f"offload_activations: the plan has {len(layers)} layers, the model "
                f"{len(self.layers)} decoder blocks; plan this model (its config.json) with "
                "pp=1"
            )
        names: list[frozenset[str]] = []
        for i, layer in enumerate(layers):
            if layer.get("policy") == "checkpoint":  # only the layer input kept
                self._checkpointed.append(i)
                names.append(frozenset())
                continue
            actions = {t["name"]: t.get("action") for t in layer.get("tensors", [])}
            offload = frozenset(n for n, a in actions.items() if a == "offload")
            if "recompute" in actions.values():
                # Note [Selective recompute of a plan]: kept and offloaded as the plan says,
                # the rest recomputed in backward.
                keep = frozenset(n for n, a in actions.items() if a == "keep")
                self._selective[i] = SelectiveLayer(self, i, keep, offload)
                self._checkpointed.append(i)
            names.append(offload)
        self._offload_names = names
        self.keep_last = 0  # the plan decides which layers keep everything

    def _read_names(self, offload_tensors: Sequence[str] | str) -> None:
        # Note [Named offload tensors]: exactly the named tensors (by Note [Names of Hugging
        # Face tensors]) of every block but the last keep_last; the rest kept.
        given = offload_tensors.split(",") if isinstance(offload_tensors, str) else offload_tensors
        groups = _spillway.offload_tensor_groups()
        named: set[str] = set()
        for n in given:
            if n in groups:
                named |= {a for a in _ADAPTER_NAMES if _spillway.in_offload_group(n, a)}
            elif n in _ADAPTER_NAMES:
                named.add(n)
            else:
                raise ValueError(
                    f"offload_activations: offload_tensors names {n!r}, which the adapter "
                    f"never gives a tensor; it names {', '.join(sorted(_ADAPTER_NAMES))} "
                    f"(groups: {', '.join(groups)}; docs/python.md)"
                )
        if not named:
            raise ValueError(f"offload_activations: offload_tensors is {list(given)!r}: empty")
        self._offload_names = [frozenset(named) for _ in self.layers]

    def _wrap_in_checkpoint(self, i: int) -> None:
        block = self.layers[i]
        original = block.forward
        self._originals[i] = original

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            # A recomputed forward would append to a KV cache twice: as Hugging Face's own
            # gradient checkpointing does, the checkpointed layer runs without the cache.
            for key in ("past_key_values", "past_key_value"):
                if kwargs.get(key) is not None:
                    kwargs[key] = None
                    self._warn_once(
                        "cache",
                        "spillway: a layer the plan recomputes ran without its KV "
                        f"cache ({key}); pass use_cache=False when training",
                    )
            sel = self._selective.get(i)
            if sel is not None:
                return torch.utils.checkpoint.checkpoint(
                    original, *args, use_reentrant=False, context_fn=sel.contexts, **kwargs
                )
            return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)

        block.forward = forward

    def _recording(self) -> Optional[SelectiveLayer]:
        sel = self._selective.get(self._layer) if self._layer is not None else None
        return sel if sel is not None and sel.recording else None

    def _make_sub_pre(self, path: str) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            if self._layer is None or self._in_backward:
                return
            parent = self._running[-1] if self._running else ""
            self._running.append(path)
            name = _input_name(path)
            if name and args and isinstance(args[0], torch.Tensor):
                self._name_tensor(args[0], name)
            sel = self._recording()
            if sel is not None:
                sel.drop(parent)  # the parent's ops before this module had their chance
                if args and isinstance(args[0], torch.Tensor):
                    sel.module_input(path, args[0])

        return pre

    def _make_sub_post(self, path: str) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if self._layer is None or self._in_backward:
                return
            if self._running and self._running[-1] == path:
                self._running.pop()
            name = _output_name(path)
            out = _first_tensor(output)
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if name and out is not None:
                self._name_tensor(out, name, source)
                if name == "moe.router_probs" and isinstance(output, tuple) and len(output) == 3:
                    # A top-k router's (scores, weights, indices) (transformers 5).
                    for extra, t in zip(("moe.topk_weights", "moe.topk_idx"), output[1:]):
                        if isinstance(t, torch.Tensor):
                            self._name_tensor(t, extra)
            sel = self._recording()
            if sel is not None:
                sel.drop(path)

        return post

    def _name_tensor(
        self, t: torch.Tensor, name: str, source: Optional[torch.Tensor] = None
    ) -> None:
        key = id(t)
        if key not in self._named or self._named[key][0]() is not t:
            self._named[key] = (weakref.ref(t), name)
        sel = self._recording()
        if sel is not None:
            sel.name(t, name, source)

    def _plan_name(self, t: torch.Tensor) -> str:
        hit = self._named.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        for path in reversed(self._running):
            name = _running_name(path)
            if name:
                return name
        return "block"

    def _model_pre(self, module: nn.Module, args: Any) -> None:
        # Note [Compiled after offload]: the whole model traced by torch.compile (compiled
        # after offload_activations, or a caller compiled): the hooks break its graph at every
        # block and see only what the pieces save. Said at the step's end. (Blocks compiled
        # one by one are not this: the model's own call runs eagerly.)
        if torch.compiler.is_compiling():
            self._traced = True

    def _make_pre(self, i: int) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            if not self._open or self._in_backward or not torch.is_grad_enabled():
                return
            self._layer = i
            self._grad_forwards += 1
            self._running.clear()
            if self._auto is not None:
                if i == 0 and args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
                    dtype = {torch.float32: "fp32", torch.float16: "fp16"}.get(
                        args[0].dtype, "bf16"
                    )
                    self._shape = (int(args[0].shape[0]), int(args[0].shape[1]), dtype)
                self._fwd_start[i] = time.perf_counter()
            if self._offload_names is not None and args and isinstance(args[0], torch.Tensor):
                self._name_tensor(args[0], "attn.input")
            if self._session is not None:
                self._session.forward_begin(i)

        return pre

    def _make_post(self, i: int) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if not self._open or self._in_backward or not torch.is_grad_enabled():
                return
            self._layer = None
            if self._auto is not None and i in self._fwd_start:
                self._fwd_ms[i] += (time.perf_counter() - self._fwd_start.pop(i)) * 1e3
            if self._session is not None:
                self._session.forward_end(i)
                self._release_copied()
            out = _first_tensor(output)
            if out is not None and out.requires_grad:
                out.register_hook(self._make_backward_hook(i))  # type: ignore[no-untyped-call]

        return post

    def _make_backward_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        step = self._step

        def on_grad(grad: torch.Tensor) -> None:
            if step != self._step or not self._open:
                return
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_step)
            if self._session is None:
                return
            # Reloads of the blocks below start now, into tensors allocated here, where
            # backward will use them.
            for j in range(i - 1, max(i - 1 - self.prefetch_depth, -1), -1):
                self._reload_block(j)
            self._session.backward_begin(i)

        return on_grad

    def _reload_block(self, layer: int) -> None:
        """Starts the reloads of block `layer`'s offloaded tensors not started yet.

        Note [Reloads in slabs]: their destinations are allocated a few at a time, not one
        by one: the tensors of one dtype, device and trailing shape are the parts of one
        tensor split along its first dimension (one allocation and one split instead of an
        allocation each, about 2 us of torch's argument parsing per tensor), and the
        engine hears of them in one call. Each part is contiguous, shaped as its tensor
        was. A slab lives until its last part is released: at the start of the block's
        backward all of them are live in either scheme, so the peak is the same."""
        todo = [s for s in self._by_layer[layer] if s.dst is None and s.tensor is None]
        if not todo:
            return
        device = self._device
        groups: dict[tuple[Any, ...], list[_Saved]] = {}
        for s in todo:
            if s.shape:
                groups.setdefault((s.dtype, s.shape[1:]), []).append(s)
            else:  # a 0-d tensor has no first dimension to split
                s.dst = torch.empty(s.shape, dtype=s.dtype, device=device)
        for (dtype, rest), members in groups.items():
            firsts = [s.shape[0] for s in members]
            slab = torch.empty((sum(firsts), *rest), dtype=dtype, device=device)
            for s, part in zip(members, slab.split_with_sizes(firsts)):
                s.dst = part
        assert self._session is not None
        self._session.will_need_many(
            [s.ticket for s in todo],
            [s.dst.data_ptr() for s in todo],  # type: ignore[union-attr]
        )

    # ---- the saved-tensor hooks ------------------------------------------------------

    # Note [Hook cost per tensor]: the pack and unpack hooks run for every tensor autograd
    # saves, on the training step's CPU path. Each asks what it must and builds little: the
    # cheapest questions first, none that makes a Python object it need not (t.device does:
    # get_device() is an int; the device is the offload's), a tensor saved again found by
    # id() (checked alive, unchanged and at the same address), the engine told once a few
    # tensors which copies are done (copies_done), and the counts of offloaded tensors
    # summed at the step's end from what was offloaded, not counted one by one.

    def _pack(self, t: torch.Tensor) -> Any:
        layer = self._layer
        if layer is None or self._in_backward:
            return t
        if self._census is not None:
            self._count(t, layer)
        if self._stays(t, layer):
            return t
        name = "saved"
        if self._offload_names is not None:
            name = self._plan_name(t)
            if name not in self._offload_names[layer]:
                self._counts["kept_by_plan" if self._plan_mode else "kept_not_named"] += 1
                return t
        return self._offload(t, layer, name)

    def _count(self, t: torch.Tensor, layer: int) -> None:
        """Note [A model as PyTorch runs it]: `t`'s storage counted once, by `t`'s name, in
        block `layer` (parameters and their views left out: they are the weights')."""
        assert self._census is not None
        if t.layout is not torch.strided or (t.is_leaf and t.requires_grad):
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr or ptr in self._param_storages or ptr in self._census_seen:
            return
        self._census_seen.add(ptr)  # alive: autograd holds it until backward
        counts = self._census[layer]
        name = self._plan_name(t)
        counts[name] = counts.get(name, 0) + storage.nbytes()

    def _stays(self, t: torch.Tensor, layer: int) -> bool:
        """Whether `t` of block `layer` stays where it is whatever its name (a last block, an
        ineligible tensor), counted by why."""
        if layer >= self._offload_below:
            self._counts["kept_last_layers"] += 1
            return True
        reason = self._ineligible(t)
        if reason:
            self._counts[reason] += 1
            return True
        return False

    def _offload(self, t: torch.Tensor, layer: int, name: str, uses: int = 0) -> Any:
        """Hands `t` (of block `layer`, named `name`) to the engine: a _Saved to unpack, or
        `t` itself when it stays (ineligible, the sizing step, a full pool). `uses`: a fixed
        count of unpacks (a selective layer's cached output: one replay), 0 for autograd's
        saved tensors (counted as they are saved again)."""
        if uses and self._stays(t, layer):
            return t
        # A tensor saved again (the input of q, k and v projections) is offloaded once: the
        # same tensor object, alive (a freed tensor's id may come back for another), not
        # written in place since, at the same address.
        key = id(t)
        ptr = t.data_ptr()
        dup = self._dedup.get(key)
        if dup is not None and dup[1]() is t and dup[2] == t._version and dup[3] == ptr:
            if self._session is None:
                return t
            dup[0].uses += 1
            self._counts["deduplicated"] += 1
            return dup[0]
        nbytes = t.nbytes
        session = self._session
        if session is None:  # the sizing step
            s = _Saved(-1, layer, t.shape, t.dtype, nbytes, name, self._step)
            self._dedup[key] = (s, weakref.ref(t), t._version, ptr)
            self._sizing_bytes += nbytes
            return t
        ticket = session.saved(layer, name, ptr, nbytes)
        if ticket < 0:
            self._counts["kept_pinned_pool_full"] += 1
            return t
        pending = self._pending
        pending.append(t)
        s = _Saved(ticket, layer, t.shape, t.dtype, nbytes, name, self._step)
        if uses:
            s.uses = uses
        self._dedup[key] = (s, weakref.ref(t), t._version, ptr)
        self._by_layer[layer].append(s)
        if len(pending) > self._release_at:
            self._release_copied()
            self._release_at = len(pending) + 8  # asked again after 8 more
        return s

    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is not _Saved:
            return packed  # type: ignore[no-any-return]
        s: _Saved = packed
        out = s.tensor
        if s.step != self._step or (out is None and not self._open):
            raise RuntimeError(
                "spillway: a saved tensor offloaded in a step that has ended is needed again "
                "(backward run twice with retain_graph=True, or after the step ended); "
                "offload_activations supports one backward per forward"
            )
        if out is None:
            assert self._session is not None
            out = s.dst
            if out is None:
                out = torch.empty(s.shape, dtype=s.dtype, device=self._device)
            self._session.needed(s.ticket, out.data_ptr())
            s.dst = None
        s.uses -= 1
        # Kept for the uses to come; at its last, the memory goes back once autograd is done.
        s.tensor = out if s.uses > 0 else None
        return out

    def _ineligible(self, t: torch.Tensor) -> str:
        # Note [Hook cost per tensor].
        if t.layout is not torch.strided or t.is_quantized:
            return "kept_not_strided"
        if self._device_index is not None and t.get_device() != self._device_index:
            return "kept_other_device"
        # Parameters (their storages are the model's), views of them, and leaves that
        # require grad (FSDP2's unsharded parameters live only while their block runs: they
        # are leaves too, as a Parameter outside the model is).
        if (t.is_leaf and t.requires_grad) or (
            t.untyped_storage().data_ptr() in self._param_storages
        ):
            return "kept_parameters"
        if t.nbytes < self.min_bytes:
            return "kept_small"
        if not t.is_contiguous():
            return "kept_not_contiguous"
        return ""

    def _release_copied(self) -> None:
        session = self._session
        if session is None:
            return
        done = session.copies_done()
        pending = self._pending
        for _ in range(done - self._released):
            pending.popleft()
        self._released = done

    # ---- steps ---------------------------------------------------------------------

    def __enter__(self) -> OffloadActivations:
        if self._hooks is not None:
            raise RuntimeError(
                "offload_activations: this offload's `with` block is already open (a nested "
                "`with offload:`); one training step is one `with` block: leave the outer one "
                "before entering it again"
            )
        if _compiled_in_place(self.model):
            raise ValueError(
                "offload_activations: the model was compiled in place (model.compile()) after "
                "offload_activations; the saved-tensor hooks cannot see inside a compiled "
                "graph. Compile the blocks one by one (block.compile()) instead "
                "(docs/python.md)"
            )
        if _hf_checkpointing(self.model):
            self._warn_once(
                "hf-checkpointing",
                "spillway: Hugging Face gradient checkpointing is on "
                "(gradient_checkpointing_enable / activation_checkpointing_enable): its "
                "blocks keep only their inputs, so offload_activations has next to nothing to "
                "offload. Turn it off (gradient_checkpointing_disable / "
                "activation_checkpointing_disable) and let the plan choose what to recompute: "
                "offload_activations(model, plan=spillway.plan(...))",
            )
        if self._open:
            # The last step had no backward (or it never ended): end it now.
            self._end_step()
        self._begin_step()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._layer = None
        if exc[0] is not None and self._open:
            self._end_step(failed=True)
        elif self._open and self._grad_forwards == 0:
            # No block ran with grad enabled (an evaluation under no_grad): nothing was saved
            # and no backward will end the step, so it ends here, without a warning.
            self._end_step(quiet=True)

    def _begin_step(self) -> None:
        self._step += 1
        if self._device is None:
            self._device = _model_device(self.model)
        self._device_index = (
            -1 if self._device.type == "cpu" else torch.empty(0, device=self._device).get_device()
        )
        if self._session is None and self.pinned_bytes is not None:
            self._make_session(self.pinned_bytes)
        self._param_storages = _parameter_storages(self.model)
        self._offload_below = len(self.layers) - self.keep_last
        self._census_seen.clear()
        if self._census is not None or (self._auto is not None and self._auto.plan is None):
            self._census = [{} for _ in self.layers]  # counted afresh (auto: its measured step)
        self._counts.clear()
        self._dedup.clear()
        self._sizing_bytes = 0
        self._grad_forwards = 0
        self._named.clear()
        self._running.clear()
        for lst in self._by_layer:
            lst.clear()
        self._in_backward = False
        self._open = True
        if self._session is not None:
            self._session.step_begin()

    def _make_session(self, pinned_bytes: int) -> None:
        available = _spillway.host_available_bytes()
        if available >= 0 and pinned_bytes > 0.9 * available:
            raise ValueError(
                f"offload_activations: the pinned pool would be {pinned_bytes / 1e9:.2f} GB but "
                f"the host has {available / 1e9:.2f} GB available (MemAvailable); at most 90% "
                f"of it, {0.9 * available / 1e9:.2f} GB, may be pinned. Offload fewer tensors "
                "(a plan, a larger min_bytes) or free host memory"
            )
        device = self._device or torch.device("cpu")
        layers: list[list[tuple[str, str]]] = []
        for i in range(len(self.layers)):
            if self._offload_names is not None:
                layers.append([(n, "offload") for n in sorted(self._offload_names[i])])
                continue
            offloaded = i < len(self.layers) - self.keep_last
            layers.append([("saved", "offload")] if offloaded else [])
        if device.type == "cuda":
            kind, ordinal = "cuda", device.index or 0
            stream = torch.cuda.current_stream(device).cuda_stream
        elif device.type == "cpu":
            kind, ordinal, stream = "host", 0, 0
        else:
            raise ValueError(
                f"offload_activations: device {device} is not supported (cpu and cuda are)"
            )
        self._session = _spillway.OffloadSession(
            kind,
            ordinal,
            stream,
            layers,
            self.prefetch_depth,
            pinned_bytes,
            64 * _MiB,
            self.inflight_bound_bytes,
            self.max_tensors,
            self.verify,
            float(self.d2h_gbps),
            float(self.h2d_gbps),
            copy_batch=min(self._copy_batch, self.max_tensors),
        )
        self.pinned_bytes = pinned_bytes

    def _end_step(self, failed: bool = False, quiet: bool = False) -> None:
        if not self._open:
            return
        self._open = False
        self._in_backward = False
        self._layer = None
        rep: dict[str, Any] = {"step": self._step}
        if self._session is not None:
            rep.update(self._session.step_end())
        self._pending.clear()
        self._released = 0
        self._release_at = 8
        # Note [Hook cost per tensor]: the offloaded tensors counted here, not one by one.
        offloaded = [s for lst in self._by_layer for s in lst]
        if offloaded:
            self._counts["offloaded"] += len(offloaded)
            self._counts["offloaded_bytes"] += sum(s.nbytes for s in offloaded)
            if self._offload_names is not None:
                self._counts.update("offloaded:" + s.name for s in offloaded)
        for lst in self._by_layer:
            lst.clear()
        self._dedup.clear()
        self._named.clear()
        counts = dict(self._counts)
        if self._checkpointed:
            counts["checkpointed_layers"] = len(self._checkpointed)
        if self._selective:
            counts["selective_layers"] = len(self._selective)
            # Note [Selective recompute of a plan]: what each layer held from its forward
            # to its backward besides its input (kept on the device or offloaded).
            rep["selective_saved_bytes"] = {
                i: sel.saved_bytes for i, sel in sorted(self._selective.items())
            }
            for sel in self._selective.values():
                sel.cached.clear()
        rep["counts"] = counts
        if self._auto is not None:
            if not failed and not quiet:
                self._replan(rep)
        elif self._session is None and not failed and not quiet:
            # The sizing step: nothing was offloaded; the pool is sized from what would
            # have been, with room to spare, and allocated once.
            rep["sizing_step"] = True
            rep["would_offload_bytes"] = self._sizing_bytes
            if self._sizing_bytes > 0:
                size = max(int(self._sizing_bytes * 1.25), 16 * _MiB)
                self._make_session(size)
                self._warn_once(
                    "sizing",
                    f"spillway: offload_activations sized its pinned pool from step 1: "
                    f"{self._sizing_bytes / 1e6:.1f} MB of saved tensors would be offloaded, "
                    f"pool {size / 1e6:.1f} MB; offloading starts at step 2 (pass "
                    "pinned_bytes= to start at step 1)",
                )
        if counts.get("kept_pinned_pool_full", 0):
            self._warn_once(
                "pool_full",
                f"spillway: the pinned pool ({self.pinned_bytes} bytes) was full: "
                f"{counts['kept_pinned_pool_full']} saved tensors stayed on the device this step "
                "(raise pinned_bytes)",
            )
        moved = (
            counts.get("offloaded", 0) + (1 if self._sizing_bytes else 0) + len(self._checkpointed)
        )
        if self._traced:
            self._warn_once(
                "compiled",
                "spillway: the model ran under torch.compile after offload_activations: the "
                "offload hooks break its graph at every block and see only what the compiled "
                f"pieces save ({counts.get('offloaded', 0)} tensors offloaded in step "
                f"{self._step}). Compile the blocks one by one instead (block.compile()), whose "
                "saved tensors the hooks see (docs/python.md)",
            )
        if not failed and not quiet and moved == 0 and not rep.get("measured_step"):
            why = (
                ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
                or "no tensor was saved inside the decoder blocks"
            )
            self._warn_once(
                "nothing",
                f"spillway: offload_activations offloaded nothing in step {self._step} ({why}); "
                "it frees no memory. Is the forward compiled, under no_grad, or are the "
                "blocks not the ones that run?",
            )
        self._last = rep
        _record_report("offload", rep)
        if self.on_step is not None:
            self.on_step(rep)

    def _replan(self, rep: dict[str, Any]) -> None:
        """Note [Re-planning while training]: between steps, the first plan after the measured
        step, then a new one when the link or the layers drift."""
        auto = self._auto
        assert auto is not None
        measured = [ms for ms in self._fwd_ms if ms > 0]
        fwd_ms = sum(measured) / len(measured) if measured else 0.0
        self._fwd_ms = [0.0] * len(self.layers)
        rep["layer_fwd_ms"] = fwd_ms  # measured, also with a fixed calibration
        new: Optional[dict[str, Any]] = None
        if auto.plan is None:
            rep["measured_step"] = True
            saved, self._census = self._census, None
            if saved is not None:
                rep["saved_bytes"] = [sum(layer.values()) for layer in saved]
            if self._shape is not None:
                new = auto.first(self._shape, fwd_ms, saved)
        elif auto.fixed_ms is not None:  # Note [A fixed calibration]: the link as scheduled
            new = auto.after_scheduled(self._step, self.d2h_gbps)
        elif self._session is not None:
            new = auto.after(self._step, rep, self._session.probe_d2h_gbps(), fwd_ms)
        else:  # a plan that offloads nothing has no session to probe the link with
            new = auto.after(self._step, rep, self.d2h_gbps, fwd_ms)
        if new is not None:
            self._apply_plan(new)
        rep["replans"] = list(auto.replans)

    def _apply_plan(self, plan: dict[str, Any]) -> None:
        # Back to the blocks' own forwards, then the new plan's wrappers and engine.
        for i, original in self._originals.items():
            self.layers[i].forward = original
        self._originals.clear()
        self._checkpointed = []
        self._selective = {}
        self.plan = plan
        self._read_plan(plan)
        for i in self._checkpointed:
            self._wrap_in_checkpoint(i)
        planned = sum(layer.get("offload_bytes", 0) for layer in plan["layers"])
        self._session = None
        if planned > 0:
            self._make_session(self.pinned_bytes or max(int(planned * 1.25), 16 * _MiB))

    def set_link(self, d2h_gbps: float, h2d_gbps: float) -> None:
        """Changes the emulated link's speed (CPU tensors, made with both throttles), from
        the next copy on: a test of what re-planning does when the link drifts. With
        ``layer_fwd_ms`` (Note [A fixed calibration]), plan="auto" judges the steps from then
        on by this link, as scheduled."""
        self.d2h_gbps, self.h2d_gbps = d2h_gbps, h2d_gbps
        if self._session is not None:
            self._session.set_link_gbps(float(d2h_gbps), float(h2d_gbps))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def last_report(self) -> dict[str, Any]:
        """The telemetry of the last step that ended (see :func:`spillway.torch.report`)."""
        return dict(self._last)

    def remove(self) -> None:
        """Removes the module hooks and frees the engine's pools."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for i, original in self._originals.items():
            self.layers[i].forward = original
        self._originals.clear()
        self._session = None


def offload_activations(
    model: nn.Module, plan: Optional[dict[str, Any] | str] = None, **kwargs: Any
) -> OffloadActivations:
    """Offload ``model``'s saved activations to host memory; see :class:`OffloadActivations`.

    Args:
        model: the model; its decoder blocks are found (:func:`find_decoder_layers`) unless
            ``layers=`` names them.
        plan: a plan from :func:`spillway.plan` (or ``spillway plan --json``) of this
            model: only the saved tensors the plan offloads go to the host (named by Note
            [Names of Hugging Face tensors]); a layer that recomputes some of its tensors
            runs under selective recompute (kept, offloaded and recomputed as planned:
            Note [Selective recompute of a plan]), a ``checkpoint`` layer under
            ``torch.utils.checkpoint``. None: every eligible saved tensor of the blocks but
            the last ``keep_last``.
            ``"auto"``: the first step measures each block's forward time and the batch's
            shape and offloads nothing; the planner, calibrated by them, makes the plan the
            next steps run, and makes it again between steps when a probe finds the link off
            by a quarter or a layer's copies were late (Note [Re-planning while training];
            ``report()["replans"]`` lists each change with its numbers). Needs
            ``model.config`` (Hugging Face); ``hardware``, ``hbm_budget_gb`` and ``margin``
            are the planner's.
        layer_fwd_ms: with ``plan="auto"``, the layer forward time (ms) the planner plans
            with instead of the measured step's, as ``spillway.plan(layer_fwd_ms=...)`` and
            ``spillway train --layer-fwd-ms``; each step is then judged by the link as
            scheduled (``d2h_gbps``, then what :meth:`OffloadActivations.set_link` set)
            with the layers at this time and no lateness, instead of by the probe and the
            telemetry, so that the re-plans are the same on every run and machine (their
            notes say "as scheduled"; Note [A fixed calibration]); the first step still
            offloads nothing (it gives the batch's shape). None (the default): measured.
            Outside [1e-9, 1e9] (0, negative, NaN), or without ``plan="auto"``: ValueError.
        pinned_bytes: the host pool's size, allocated once; None: sized from the first step
            (which then offloads nothing, and says so).
        min_bytes: smaller saved tensors stay where they are (default 64 KiB).
        keep_last: blocks at the end that never offload (default 1).
        prefetch_depth: blocks ahead that backward reloads (default 1).
        inflight_bound_bytes: bound on D2H bytes in flight (0: none); an offload beyond it
            waits (back-pressure, counted as stall).
        offload_tensors: exactly these saved tensors (their planner names, Note [Names of
            Hugging Face tensors], or the groups ``attn``, ``mlp``, ``moe``; a list or one
            comma-separated string) go to the host in every block but the last
            ``keep_last``; the rest is kept. Not with ``plan`` (plan with them instead).
        verify: checksum every tensor at offload and check it at reload.
        d2h_gbps, h2d_gbps: on CPU, throttle the emulated copies (0: memcpy speed).
        on_step: called with each step's telemetry when the step ends.
    """
    return OffloadActivations(model, plan, **kwargs)


# Note [Names of Hugging Face tensors]: with a plan, a saved tensor of a decoder block gets
# the planner's name (docs/plan-schema.md) from the Hugging Face module paths around it:
# first by what produced it or was given it (the output of `input_layernorm` is
# attn.norm_out, the input of `post_attention_layernorm` is mlp.input), else by the
# innermost running module that names its saved tensors (what `o_proj` saves is
# attn.out_proj_in). A tensor no rule names is "block", which no plan offloads: kept.
# The rules match the last components of a path, so `mlp.experts.3.gate_proj` is an
# expert's gate projection; docs/python.md lists them.
_OUTPUT_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(input_layernorm|attention_norm|ln_1)$", "attn.norm_out"),
    (r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|c_attn|q_norm|k_norm)$", "attn.qkv_out"),
    (r"(^|\.)(post_attention_layernorm|ffn_norm|ln_2)$", "mlp.norm_out"),
    (r"(^|\.)(gate_proj|w1|gate_up_proj|act_fn|act)$", "mlp.gate_out"),
    (r"(^|\.)(up_proj|w3)$", "mlp.up_out"),
    (r"(^|\.)(router|gate)$", "moe.router_probs"),
    (r"experts\.(\d+\.)?(down_proj|w2)$", "moe.expert_out"),
)
_INPUT_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(input_layernorm|attention_norm|ln_1)$", "attn.input"),
    (r"(^|\.)(post_attention_layernorm|ffn_norm|ln_2)$", "mlp.input"),
    (r"(^|\.)(o_proj|out_proj|c_proj|dense)$", "attn.out_proj_in"),
    (r"(^|\.)(down_proj|w2)$", "mlp.act"),
)
_RUNNING_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(o_proj|out_proj)$", "attn.out_proj_in"),
    (r"(^|\.)(down_proj|w2)$", "mlp.act"),
    (r"(^|\.)(gate_proj|up_proj|gate_up_proj|w1|w3)$", "mlp.norm_out"),
    (r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj)$", "attn.norm_out"),
    (r"(^|\.)(input_layernorm|attention_norm)$", "attn.norm_out"),
    (r"(^|\.)(post_attention_layernorm|ffn_norm)$", "mlp.norm_out"),
    (r"(^|\.)experts$", "moe.dispatch_in"),
    (r"(^|\.)(router|gate)$", "moe.router_probs"),
    (r"(^|\.)(self_attn|attention|attn)$", "attn.qkv_out"),
)


# Every name the rules give a tensor: what offload_tensors may name.
_ADAPTER_NAMES: frozenset[str] = frozenset(
    name for rules in (_OUTPUT_RULES, _INPUT_RULES, _RUNNING_RULES) for _, name in rules
)


def _match(rules: tuple[tuple[str, str], ...], path: str) -> str:
    for pattern, name in rules:
        if re.search(pattern, path):
            return name
    return ""


@functools.lru_cache(maxsize=4096)
def _output_name(path: str) -> str:
    return _match(_OUTPUT_RULES, path)


@functools.lru_cache(maxsize=4096)
def _input_name(path: str) -> str:
    return _match(_INPUT_RULES, path)


@functools.lru_cache(maxsize=4096)
def _running_name(path: str) -> str:
    return _match(_RUNNING_RULES, path)


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for o in output:
            if isinstance(o, torch.Tensor):
                return o
    if isinstance(output, dict):
        for o in output.values():
            if isinstance(o, torch.Tensor):
                return o
    return None


def _parameter_storages(model: nn.Module) -> set[int]:
    """The storage addresses of the model's parameters (a DTensor's local shard; a
    parameter whose storage is freed, as FSDP2's unsharded ones between uses, has none)."""
    ptrs: set[int] = set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        try:
            ptr = local.untyped_storage().data_ptr()
        except RuntimeError:
            continue
        if ptr:
            ptrs.add(ptr)
    return ptrs


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _hf_checkpointing(model: torch.nn.Module) -> bool:
    """Whether a Hugging Face model has its own gradient (activation) checkpointing on; read
    through the property its transformers version has, without the deprecated one."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _compiled_in_place(model: torch.nn.Module) -> bool:
    """Whether ``model.compile()`` compiled the model's own call (torch 2.2+)."""
    return getattr(model, "_compiled_call_impl", None) is not None

"""Activation offload inside a PyTorch training step (docs/offload.md, docs/python.md).

``offload_activations(model)`` installs ``torch.autograd.graph.saved_tensors_hooks`` whose
pack hook hands each eligible saved tensor of a decoder block to the C++ offload engine
(borrowed memory: the tensor is kept alive by reference until the engine's copy event says
its copy has read it; never ``record_stream``), and whose unpack hook returns the tensor
reloaded into memory allocated where it is used. Reloads are prefetched one block ahead
(``prefetch_depth``) when backward reaches a block, from a hook on the block's output.

The engine is the one the C++ reference model drives, through the same hooks
(spillway/device/hooks.hpp): ``step_begin``, per block ``forward_begin``/``saved``/``forward_end``,
in backward ``backward_begin``/``needed``, and ``step_end`` when backward has finished.

OffloadActivations is made of pieces: here its construction, the module hooks (which block
runs, where backward is) and the ``with`` block; its plan mode in _offload_plan.py (names
by _names.py), its engine hooks and steps in _offload_engine.py, the state they share
declared in _offload_state.py, the helpers in _common.py.
"""

from __future__ import annotations

import collections
import time
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ._common import _compiled_in_place, _first_tensor, _hf_checkpointing, find_decoder_layers
from ._common import report as report
from ._offload_engine import EngineHooks, Saved
from ._offload_plan import PlanMode
from .adaptive import AutoPlanner
from .selective import SelectiveLayer

__all__ = ["OffloadActivations", "offload_activations", "report"]


# The planner's range of a layer forward time (ms), PlanLimits::kMinLayerMs/kMaxLayerMs.
_MIN_LAYER_MS = 1e-9
_MAX_LAYER_MS = 1e9


class OffloadActivations(PlanMode, EngineHooks):
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
        self._by_layer: list[list[Saved]] = [[] for _ in self.layers]
        # Offloaded this step, by id(): what it became, the tensor, its version and address.
        self._dedup: dict[int, tuple[Saved, weakref.ref[torch.Tensor], int, int]] = {}
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

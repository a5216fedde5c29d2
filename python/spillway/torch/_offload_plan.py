"""Plan mode of offload_activations: a plan read into the saved-tensor names each block
offloads and the layers it recomputes (torch.utils.checkpoint, selective recompute), each
saved tensor named as the blocks run (Note [Names of Hugging Face tensors]), and
plan="auto"'s new plans applied between steps (Note [Re-planning while training]).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from .. import _spillway
from ._common import _first_tensor, _MiB
from ._names import _ADAPTER_NAMES, _input_name, _output_name, _running_name
from ._offload_state import OffloadState
from .selective import SelectiveLayer

__all__ = ["PlanMode"]


class PlanMode(OffloadState):
    """OffloadActivations' plan mode (its state: OffloadState, made by OffloadActivations)."""

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

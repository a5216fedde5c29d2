"""``offload_activations(model, plan="auto")``: plan from measurements, re-plan between steps.

Note [Re-planning while training] (the PyTorch side; ``spillway train --policy adaptive`` is
the C++ side, src/train/adaptive.cpp): the first step offloads nothing and measures each
block's forward time and the batch's shape; the planner, calibrated by them (its
``layer_fwd_ms``) and given the link (``d2h_gbps``, else the hardware profile's), makes the
auto plan, which the next step runs. After every step a 1 MiB probe copy measures the link,
the blocks' forward times are measured again, and the engine's telemetry says whether a
layer's copies were late (its backlog at the next layer's end) and how long backward waited
for reloads. When the link or the layers' time is off by more than a quarter from what the
plan assumed, or a layer was late (then with the margin half as large again, for as long as
it stays late), the plan is made again between steps; when its actions
differ, the next step runs it (offload demoted to recompute where the window no longer
holds, promoted back when it does). Each change is logged with its numbers (a warning-free
``report()["replans"]``). Where a tensor lives never changes the arithmetic: losses and
gradients are bitwise those of the plain model.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

from torch import nn

import spillway

LINK_DRIFT = 0.25  # a link or a layer time off by more than this fraction re-plans


def _actions(plan: dict[str, Any]) -> list[list[tuple[str, str]]]:
    return [[(t["name"], t["action"]) for t in layer["tensors"]] for layer in plan["layers"]]


def _offloaded(plan: dict[str, Any]) -> list[int]:
    return [sum(t["action"] == "offload" for t in layer["tensors"]) for layer in plan["layers"]]


class AutoPlanner:
    """The planner's side of ``plan="auto"``: the first plan from the measured step, then a
    new plan whenever the link or the layers drift."""

    def __init__(
        self,
        model: nn.Module,
        *,
        hardware: str,
        hbm_budget_gb: Optional[float],
        margin: float,
        keep_last: int,
        prefetch_depth: int,
        d2h_gbps: float,
    ) -> None:
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "to_json_file"):
            raise ValueError(
                'offload_activations: plan="auto" plans from the model\'s Hugging Face config '
                "(model.config); this model has none: pass a plan from spillway.plan()"
            )
        self._dir = tempfile.TemporaryDirectory(prefix="spillway-auto-")
        self.config_path = os.path.join(self._dir.name, "config.json")
        config.to_json_file(self.config_path)
        self.hardware = hardware
        self.hbm_budget_gb = hbm_budget_gb
        self.base_margin = margin
        self.margin = margin
        self.keep_last = keep_last
        self.prefetch_depth = prefetch_depth
        self.link_gbps = d2h_gbps  # 0: the hardware profile's
        self.shape: Optional[tuple[int, int, str]] = None  # micro_batch, seq_len, dtype
        self.plan: Optional[dict[str, Any]] = None
        self.fwd_ms = 0.0  # the layer time the plan was calibrated with
        self.replans: list[str] = []

    def _make(self, layer_fwd_ms: float) -> dict[str, Any]:
        assert self.shape is not None
        micro_batch, seq_len, dtype = self.shape
        link = self.link_gbps if self.link_gbps > 0 else None
        return spillway.plan(
            self.config_path,
            self.hardware,
            micro_batch=micro_batch,
            seq_len=seq_len,
            dtype=dtype,
            policy="auto",
            margin=self.margin,
            layer_fwd_ms=layer_fwd_ms if layer_fwd_ms > 0 else None,
            hbm_budget_gb=self.hbm_budget_gb,
            d2h_gbps=link,
            h2d_gbps=link,
            keep_last=self.keep_last,
            prefetch_depth=self.prefetch_depth,
        )

    def first(self, shape: tuple[int, int, str], layer_fwd_ms: float) -> dict[str, Any]:
        self.shape = shape
        self.fwd_ms = layer_fwd_ms
        self.plan = self._make(layer_fwd_ms)
        planned = self.plan["hardware"]["d2h_gbps"]
        self.replans.append(
            f"planned after step 1: micro-batch {shape[0]} x seq {shape[1]} {shape[2]}, layer "
            f"forward {layer_fwd_ms:.3f} ms measured, link {planned:.3f} GB/s; offloaded "
            f"tensors per layer {_offloaded(self.plan)}"
        )
        return self.plan

    def after(
        self, step: int, report: dict[str, Any], probe_gbps: float, layer_fwd_ms: float
    ) -> Optional[dict[str, Any]]:
        """After step `step` (1-based): a new plan when it changes what runs, else None."""
        if self.plan is None or probe_gbps <= 0:
            return None
        planned = float(self.plan["hardware"]["d2h_gbps"])
        late = bool(report.get("snowball"))
        drift = abs(probe_gbps - planned) / planned
        # The layers drift too (a first step's warm-up, clocks, another job on the GPU).
        layers = abs(layer_fwd_ms - self.fwd_ms) / self.fwd_ms if self.fwd_ms > 0 else 0.0
        if not late and drift <= LINK_DRIFT and layers <= LINK_DRIFT:
            return None
        self.fwd_ms = layer_fwd_ms if layer_fwd_ms > 0 else self.fwd_ms
        # A drifted link starts again from the margin asked for; lateness on a link the plan
        # has right means shorter windows than planned: the margin grows.
        if drift > LINK_DRIFT or not late:
            self.margin = self.base_margin
        else:
            self.margin = min(10.0, max(self.base_margin, self.margin) * 1.5)
        self.link_gbps = probe_gbps
        new = self._make(layer_fwd_ms)
        old = self.plan
        self.plan = new  # what the planner assumes now, even when the actions stay
        if _actions(new) == _actions(old):
            return None
        why = (
            f"layer {report.get('snowball_first_layer')}'s copies were late"
            if late
            else f"off by {drift * 100:.0f}%"
            if drift > LINK_DRIFT
            else f"the layers' forward {layer_fwd_ms:.3f} ms, off by {layers * 100:.0f}%"
        )
        self.replans.append(
            f"re-planned after step {step}: link {probe_gbps:.3f} GB/s measured, the plan "
            f"assumed {planned:.3f} ({why}; margin {self.margin * 100:.0f}%; stall "
            f"{report.get('stall_ms', 0.0):.2f} ms); offloaded tensors per layer "
            f"{_offloaded(old)} -> {_offloaded(new)}"
        )
        return new

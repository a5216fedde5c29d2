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

Note [A fixed calibration] (the PyTorch side of ``spillway train --layer-fwd-ms``,
src/train/trainer.cpp): what the measured mode measures, the probe copy and the blocks'
forward times, moves with the machine's load, and so did its re-plans (a loaded 2-core host
re-planned back and forth while the link stayed slow). ``layer_fwd_ms=MS`` gives the planner
MS for each block's forward instead of the measured step's times, and judges each step by
the link as scheduled (``d2h_gbps``, then what ``set_link`` set; 0: the hardware
profile's), the blocks at MS and no lateness, instead of by the probe and the telemetry: the
plans and re-plans are then the same on every run and every machine, and their notes say
"given" and "as scheduled". The step's telemetry is still measured.

Note [A model as PyTorch runs it] (src/plan/saved_as_run.cpp, measure.py): the measured step
also counts what each block saves for backward, by planner name, at the job's own shape;
every plan is made from those bytes (``spillway.plan(saved=...)``), not from the inventory's
fused kernels, which an eager Hugging Face block exceeds 1.3-1.5x (a Mamba block several
times).
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
        layer_fwd_ms: Optional[float] = None,
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
        # Note [A fixed calibration]: the layer time given, None: measured.
        self.fixed_ms = layer_fwd_ms
        self._profile_gbps: Optional[float] = None  # the hardware profile's link, once asked
        # Note [A model as PyTorch runs it]: per block, the bytes the measured step saved by
        # name: every plan is made from them, not from the inventory's fused kernels.
        self.saved: Optional[list[dict[str, int]]] = None
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
            saved=self.saved,
        )

    def first(
        self,
        shape: tuple[int, int, str],
        layer_fwd_ms: float,
        saved: Optional[list[dict[str, int]]] = None,
    ) -> dict[str, Any]:
        """The first plan, from the measured step's shape, its saved tensors (per block, bytes
        by name) and (unless fixed) its layer time."""
        self.shape = shape
        if saved is not None:
            self.saved = saved
        fixed = self.fixed_ms is not None
        if self.fixed_ms is not None:
            layer_fwd_ms = self.fixed_ms  # Note [A fixed calibration]
        self.fwd_ms = layer_fwd_ms
        self.plan = self._make(layer_fwd_ms)
        planned = self.plan["hardware"]["d2h_gbps"]
        self.replans.append(
            f"planned after step 1: micro-batch {shape[0]} x seq {shape[1]} {shape[2]}, layer "
            f"forward {layer_fwd_ms:.3f} ms {'given' if fixed else 'measured'}, link "
            f"{planned:.3f} GB/s; offloaded tensors per layer {_offloaded(self.plan)}"
        )
        return self.plan

    def _profile_link(self) -> float:
        """The hardware profile's D2H link (GB/s): what a plan without a link assumes."""
        if self._profile_gbps is None:
            saved, self.link_gbps = self.link_gbps, 0.0
            try:
                self._profile_gbps = float(self._make(self.fwd_ms)["hardware"]["d2h_gbps"])
            finally:
                self.link_gbps = saved
        return self._profile_gbps

    def after_scheduled(self, step: int, scheduled_gbps: float) -> Optional[dict[str, Any]]:
        """Note [A fixed calibration]: after step `step`, judged by the link as scheduled for
        it (0: the profile's), the layers at the time given and no lateness."""
        assert self.fixed_ms is not None
        link = scheduled_gbps if scheduled_gbps > 0 else self._profile_link()
        return self.after(step, {}, link, self.fixed_ms)

    def after(
        self, step: int, report: dict[str, Any], probe_gbps: float, layer_fwd_ms: float
    ) -> Optional[dict[str, Any]]:
        """After step `step` (1-based): a new plan when it changes what runs, else None."""
        if self.plan is None or probe_gbps <= 0:
            return None
        fixed = self.fixed_ms is not None
        if self.fixed_ms is not None:  # Note [A fixed calibration]: no lateness, no drift
            report, layer_fwd_ms = {}, self.fixed_ms
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
        # A fixed calibration's notes say nothing measured (the stall is), so that two runs
        # give the same notes.
        stall = "" if fixed else f"; stall {report.get('stall_ms', 0.0):.2f} ms"
        self.replans.append(
            f"re-planned after step {step}: link {probe_gbps:.3f} GB/s "
            f"{'as scheduled' if fixed else 'measured'}, the plan assumed {planned:.3f} ({why}; "
            f"margin {self.margin * 100:.0f}%{stall}); offloaded tensors per layer "
            f"{_offloaded(old)} -> {_offloaded(new)}"
        )
        return new

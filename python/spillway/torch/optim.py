"""CPUAdamW: AdamW on the CPU with speculation then validation (docs/optim.md, docs/python.md).

The fp32 master weights and moments live in the C++ optimizer's memory (allocated once).
Each parameter's gradient is handed over when it is final
(``Tensor.register_post_accumulate_grad_hook``) and stepped speculatively on C++ threads
while backward goes on; ``step()`` validates: the global gradient norm clips (replaying the
speculative buckets with the scaled gradient) or, NaN/Inf, skips the step, bitwise as the
non-speculative optimizer would (Note [STV exactness]).

CPUAdamW is made of pieces: here its construction, lifetime and ``step()``; the hand-over
of gradients and shared weights in _optim_handover.py, the device path in
_optim_device.py, the validation of the speculation in _optim_validate.py, checkpoints in
_optim_checkpoints.py, the state they share declared in _optim_state.py.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
import torch.distributed

from .. import _spillway
from . import _clip
from ._common import _DTYPES, _local, _record_report, _stamp
from ._optim_checkpoints import Checkpoints
from ._optim_device import DevicePath
from ._optim_handover import HandOver
from ._optim_validate import Validation

__all__ = ["CPUAdamW"]

_HYPER = ("lr", "betas", "eps", "weight_decay")


class CPUAdamW(HandOver, DevicePath, Validation, Checkpoints):
    """AdamW whose step runs on the CPU, speculatively, while backward goes on.

    Same update as ``torch.optim.AdamW`` (decoupled weight decay, bias correction), in
    fp32 master weights: float32 and bfloat16 parameters (a bfloat16 parameter receives the
    round-to-nearest-even copy of its fp32 master). Within a few ulp of
    ``torch.optim.AdamW`` (docs/python.md) and bitwise equal to spillway's own
    non-speculative optimizer, speculative or not.

    Args:
        params: parameters or parameter groups, as every torch optimizer.
        lr, betas, eps, weight_decay: AdamW's hyperparameters (per group).
        max_grad_norm: clip the global gradient norm (over every parameter of every group)
            to this, as ``torch.nn.utils.clip_grad_norm_`` would before ``step()``; None:
            no clipping. A NaN or Inf gradient anywhere skips the step.
        speculative: step each gradient as it arrives (True), or only in ``step()``.
        accumulation_steps: backward passes per optimizer step (gradient accumulation);
            gradients are handed over, and speculated, on the last one. None: learned from
            the loop (the passes seen between two steps; the first step of an accumulating
            loop runs without speculation).
        threads: CPU threads of the AdamW step (0: every core).
        early_weights: write each parameter's new weights as soon as its speculative step
            is done, during backward (Note [Early weights]): ``step()`` then only validates
            (a replay rewrites them, a skip restores them), so little is left on the
            critical path. The parameters change before ``step()`` returns: use it when
            nothing reads them between backward and ``step()``. None: False for CPU
            parameters, True on the device path (its uploads are the overlap).
        device_emulation: step CPU bfloat16 parameters through the device path on
            spillway's host backend, which emulates a GPU (copy streams, pinned staging,
            events): the GPU path, run and tested without a GPU.
        recognize_clip: opt in to the clip of ``transformers.Trainer`` and ``accelerate``
            (Note [Clips the speculation saw]): True replaces ``torch.nn.utils.
            clip_grad_norm_`` process-wide by ``spillway.torch.clip_grad_norm_``, which
            answers a clip of the gradients this optimizer speculated on from the
            speculation's own norm: a clip that scales nothing (they clip every step)
            keeps the speculative step. False (the default): torch's function is left as it
            is; a clip writes the gradients after the speculation read them, so ``step()``
            runs again from ``.grad`` (the same weights, without the overlap).
        share_weights: the float32 parameters' storage becomes the optimizer's fp32 master
            weights (Note [Weights shared with the parameters]): no copy of the weights is
            kept or written, and a step that commits its speculation points each parameter
            at its other buffer (``p.data``) instead of copying the weights back: 4 bytes
            per parameter fewer each step, in memory and in traffic (docs/optim.md). A
            parameter's ``data_ptr()`` then changes from step to step: a view of a
            parameter taken before a ``step()`` may be stale after it (take them anew, as
            ``nn.Module`` does each forward). CPU float32 parameters only, not with
            ``early_weights``. ``close()`` gives each parameter its own storage back.

    The device path (Note [The device path of CPUAdamW]): bfloat16 parameters on a CUDA
    device are stepped through spillway's optimizer-offload pipeline. Their fp32 master
    weights and moments live in pinned host memory; each gradient, once final, is copied
    to the host on a copy stream ordered after torch's work by an event, stepped on the CPU
    while backward goes on, and its bf16 weights are uploaded on another copy stream. The
    parameters and gradients are rearranged into two flat device buffers the optimizer
    owns (each parameter and each ``.grad`` a view into them, as DDP's
    ``gradient_as_bucket_view``); ``zero_grad`` zeroes them in place. A parameter's
    weights are overwritten once its gradient is final, during backward: nothing may read
    them after that until ``step()`` (true of a model whose layers each read their own
    weights; not of weights also read through ``.detach()`` or a hook). Not yet supported
    there: FSDP2's DTensor shards, float32 parameters (keep them bf16, masters are fp32).

    Telemetry: :meth:`last_step` and ``spillway.torch.report()["optimizer"]``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: Optional[float] = None,
        speculative: bool = True,
        accumulation_steps: Optional[int] = None,
        threads: int = 0,
        early_weights: Optional[bool] = None,
        device_emulation: bool = False,
        recognize_clip: bool = False,
        share_weights: bool = False,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"CPUAdamW: max_grad_norm is {max_grad_norm!r}; must be > 0 or None")
        if accumulation_steps is not None and (
            not isinstance(accumulation_steps, int) or accumulation_steps < 1
        ):
            raise ValueError(
                f"CPUAdamW: accumulation_steps is {accumulation_steps!r}; must be an int >= 1 "
                "or None (learned from the loop)"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.speculative = speculative
        # Note [Backward passes per step]: None learns it from the loop.
        self._learn_accumulation = accumulation_steps is None
        self.accumulation_steps = accumulation_steps or 1
        self._short_steps = 0  # consecutive steps with fewer passes than accumulation_steps
        self.recognize_clip = recognize_clip
        self._params: list[torch.Tensor] = []
        for group in self.param_groups:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            for p in group["params"]:
                self._params.append(p)
        self._device: Optional[torch.device] = _device_path(self._params, device_emulation)
        for i, p in enumerate(self._params):
            _check_param(p, i, self._device)
        if self._device is not None and early_weights is False and speculative:
            raise ValueError(
                "CPUAdamW: early_weights=False with speculative=True on the device path: its "
                "pipeline uploads each speculative step's weights during backward; pass "
                "speculative=False to write them only in step()"
            )
        self.early_weights = self._device is not None or bool(early_weights)
        if share_weights:
            _check_shareable(self._params, self._device, self.early_weights)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        # Note [One optimizer per parameter]: a parameter is stepped by one live CPUAdamW. A
        # new one over parameters of an older one takes them over: the older is closed (its
        # hooks removed; its step() then raises), as `opt = CPUAdamW(...)` run again expects.
        for i, p in enumerate(self._params):
            owner = getattr(p, "_spillway_cpu_adamw", None)
            other = owner() if owner is not None else None
            if other is not None and not other._closed:
                warnings.warn(
                    f"CPUAdamW: parameter {i} was stepped by another CPUAdamW; that one is "
                    "closed (its gradient hooks removed) and this one steps it",
                    stacklevel=2,
                )
                other.close()
        self._closed = False
        # FSDP2 (fully_shard): a parameter is a DTensor; this process steps its local shard,
        # and the gradient norm is all-reduced over the shards (Note [Sharded norms]).
        self._sharded = any(hasattr(p, "to_local") for p in self._params)
        self._norm_groups: Optional[tuple[list[Any], torch.device]] = None
        if self._sharded:  # refused here, not at the first step, when it cannot be done
            self._norm_groups = _norm_groups(self._params)
        # The state is allocated once, here: refuse what the host cannot hold, with numbers.
        elements = sum(_local(p).numel() for p in self._params)
        need = elements * 12 * (2 if speculative else 1)  # p, m, v (+ STV's second buffers)
        if self._device is not None:
            need += elements * 4  # the pipeline's bf16 gradient and weight staging
        available = _spillway.host_available_bytes()
        if available >= 0 and need > 0.9 * available:
            what = " and their undo buffers" if speculative else ""
            raise ValueError(
                f"CPUAdamW: {elements} elements need {need / 1e9:.2f} GB of host memory for "
                f"the fp32 master weights and moments{what}, but the host has "
                f"{available / 1e9:.2f} GB available (MemAvailable); at most 90% of it may be "
                "used" + (" (speculative=False halves it)" if speculative else "")
            )
        self._core: Any
        self._flat_w: Optional[torch.Tensor] = None
        self._flat_g: Optional[torch.Tensor] = None
        self._offsets: list[int] = []
        self._adopted: Optional[torch.cuda.Stream] = None  # the device path's CUDA stream
        if self._device is not None:
            self._core = self._make_device_path(float(max_grad_norm or 0.0), speculative, threads)
        else:
            self._core = _spillway.CpuAdamW(
                [_local(p).numel() for p in self._params],
                float(max_grad_norm or 0.0),
                speculative,
                threads,
            )
            for i, p in enumerate(self._params):
                self._core.load_weights(i, _local(p).data_ptr(), _DTYPES[p.dtype])
        # Note [Weights shared with the parameters]: per parameter, views of its two weight
        # buffers (made once; the second None without one), each parameter on its current one.
        self._shared: Optional[list[tuple[torch.Tensor, Optional[torch.Tensor]]]] = None
        if share_weights:
            self._shared = [self._buffer_views(i, p) for i, p in enumerate(self._params)]
            self._follow()
        # Per parameter, what was handed over: (the gradient stepped, p.grad, its version).
        self._handed: list[Optional[tuple[torch.Tensor, torch.Tensor, int]]] = [None] * len(
            self._params
        )
        self._seen = [0] * len(self._params)  # backward passes since the last step
        # Note [Gradients that share a version counter]: a buffer's counter at its last
        # hand-over, by the buffer's id.
        self._view_versions: dict[int, int] = {}
        # The hooks hold the optimizer weakly (Note [Hook lifetime]): a dropped optimizer is
        # freed with its host state, and its hooks are removed (close(), __del__).
        self._hooks = [
            p.register_post_accumulate_grad_hook(_make_hook(weakref.ref(self), i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(self._params)
            if p.requires_grad
        ]
        for p in self._params:
            p._spillway_cpu_adamw = weakref.ref(self)  # type: ignore[attr-defined]
        # Note [Parameters changed under the optimizer]: what each parameter was when its
        # master weights were last in step with it (its storage and version counter).
        self._stamps = [_stamp(p) for p in self._params]
        self._last: dict[str, Any] = {}
        self._synced: Optional[list[tuple[float, ...]]] = None  # hparams of this step
        # Note [Clips the speculation saw]: why this step's speculation was dropped (None:
        # it was not), and the norm a recognised clip answered with.
        self._discarded: Optional[str] = None
        self._clip_norm: Optional[float] = None
        self._warned_changed = False
        if recognize_clip and speculative:
            _clip.install()  # the device path too (its first GPU run found it missing there)

    # ---- lifetime (Note [Hook lifetime]) -----------------------------------------------

    def close(self) -> None:
        """Removes the gradient hooks: from now on backward hands nothing to this optimizer
        (another may step the parameters). Speculative work not validated is dropped.
        Called when the optimizer is deleted, and at the end of a ``with`` block."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self._params:
            owner = getattr(p, "_spillway_cpu_adamw", None)
            if owner is not None and owner() is self:
                del p._spillway_cpu_adamw  # type: ignore[attr-defined]
        if any(h is not None for h in self._handed):
            self._core.abort()
            self._handed = [None] * len(self._params)
        shared = getattr(self, "_shared", None)
        if shared is not None:
            # Note [Weights shared with the parameters]: the parameters outlive the
            # optimizer's memory, so they take their values into storage of their own.
            with torch.no_grad():
                for p, (first, second) in zip(self._params, shared):
                    if p.data_ptr() in (first.data_ptr(), _ptr(second)):
                        p.data = p.data.clone()
            self._shared = None

    def __enter__(self) -> CPUAdamW:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: torch may be half gone
            pass

    # ---- the step ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Validates the speculative step (clip, NaN/Inf skip) and writes the weights."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        # Gradients changed after their hand-over (edited in place, accumulated again) or
        # not handed over yet: the speculative work is dropped and the step runs from .grad
        # as it is. So do hyperparameters changed after the first hand-over.
        passes = max(self._seen, default=0)
        if any(
            h is not None and not self._unchanged(i, self._params[i].grad)
            for i, h in enumerate(self._handed)
        ):
            self._discard("accumulation" if passes > self.accumulation_steps else "changed")
        elif self._synced is not None and self._synced != self._hparams():
            self._discard("hparams")
        self._check_passes(passes)
        discarded, self._discarded = self._discarded, None
        clip_norm, self._clip_norm = self._clip_norm, None
        if self._synced is None:
            self._sync_hparams()
        if self._closed:
            raise RuntimeError("CPUAdamW.step: the optimizer was closed")
        for i, p in enumerate(self._params):
            if self._handed[i] is None:
                if p.grad is None:
                    self._refresh(i)  # its master is written back to it below
                    self._core.absent(i)
                else:
                    self._hand_over(i, p, in_step=True)
        global_sq = None
        if (
            self._sharded
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        ):
            # Note [Sharded norms]: each process holds a shard of every parameter: the sum of
            # squares is all-reduced, so every shard clips by the same norm and a NaN or Inf
            # anywhere skips the step everywhere. Its rounding differs from one process's
            # (the shards' sums are added, not the buckets' in one order).
            assert self._norm_groups is not None  # made with the optimizer
            groups, device = self._norm_groups
            sq = torch.tensor([self._core.sum_of_squares()], dtype=torch.float64, device=device)
            for group in groups:
                torch.distributed.all_reduce(sq, group=group)
            global_sq = float(sq.item())
        outcome, scale, worker_ms, finish_ms = self._core.finish(global_sq)
        # The weights not written yet (all of them, unless early_weights; after a skip, the
        # early ones are restored). The device path's end of step uploaded them already.
        if self._shared is not None:
            self._follow()  # Note [Weights shared with the parameters]: nothing to write
        elif self._device is None:
            self._core.store_all(
                [_local(p).data_ptr() for p in self._params],
                [_DTYPES[p.dtype] for p in self._params],
            )
        elif self._sharded and self._flat_w is not None:
            # Note [FSDP2 on the device path]: the pipeline's weights into FSDP2's shards (on
            # the compute stream, which end_step ordered after the uploads).
            for i, p in enumerate(self._params):
                lp = _local(p)
                at = self._offsets[i]
                lp.copy_(self._flat_w[at : at + lp.numel()].view(lp.shape))
        self._handed = [None] * len(self._params)
        self._view_versions.clear()
        self._seen = [0] * len(self._params)
        self._synced = None
        self._stamps = [_stamp(p) for p in self._params]
        if not self.state:
            # Note [Optimizer state of sharded parameters]: torch's state_dict helpers (DCP's
            # get_state_dict) take an optimizer with an empty ``state`` for one never stepped
            # and step it once with lr 0 to create it, which here would advance every step
            # counter and decay the moments of a trained optimizer. After its first step
            # ``state`` holds each parameter's step (no copy of the host state: that is
            # made by state_dict() and held only by what it returns).
            self._sync_state_out(full=False)
        self._last = {
            "step": self._core.step,
            "outcome": outcome,  # commit, replay (clipped), skip (NaN/Inf)
            "grad_scale": scale,
            "cpu_optimizer_ms": worker_ms + finish_ms,
            "speculated_ms": worker_ms,  # overlapped with backward when speculative
            "step_call_ms": (time.perf_counter() - t0) * 1e3,
            "rollbacks": 1 if outcome != "commit" else 0,
            # Note [Clips the speculation saw]: the speculation dropped, and why.
            "regathered": discarded is not None,
            "discarded_by": discarded,
            "clip_norm": clip_norm,  # a recognised clip's norm (it scaled nothing)
            "accumulation_steps": self.accumulation_steps,
            **self._core.counters(),
        }
        _record_report("optimizer", self._last)
        return loss

    def last_step(self) -> dict[str, Any]:
        """The telemetry of the last ``step()``: outcome, scale, CPU ms, counters."""
        return dict(self._last)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes (or drops) the gradients; speculative work not yet validated is dropped.

        On the device path the gradients are views of the optimizer's flat buffer: they
        are zeroed in place whatever ``set_to_none`` says (one kernel, no allocation); under
        FSDP2 they are FSDP2's DTensors, as torch's optimizers treat them.
        """
        if any(h is not None for h in self._handed):
            self._core.abort()
            self._handed = [None] * len(self._params)
            self._synced = None
        self._seen = [0] * len(self._params)
        self._discarded = None
        self._clip_norm = None
        if self._flat_g is not None and not self._sharded:
            self._flat_g.zero_()
            for i, p in enumerate(self._params):
                if p.grad is None or p.grad.data_ptr() != self._grad_ptr(i):
                    p.grad = self._grad_view(i, p)
            return
        super().zero_grad(set_to_none=set_to_none)

    def _hparams(self) -> list[tuple[float, ...]]:
        return [
            (float(g["lr"]), *map(float, g["betas"]), float(g["eps"]), float(g["weight_decay"]))
            for g in self.param_groups
        ]

    def _sync_hparams(self) -> None:
        self._synced = self._hparams()
        for group in self.param_groups:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            b1, b2 = group["betas"]
            for p in group["params"]:
                self._core.set_hparams(
                    self._index[id(p)],
                    float(group["lr"]),
                    float(b1),
                    float(b2),
                    float(group["eps"]),
                    float(group["weight_decay"]),
                )


def _make_hook(ref: weakref.ReferenceType[CPUAdamW], i: int) -> Callable[[torch.Tensor], None]:
    """Parameter i's gradient hook (Note [Hook lifetime]): it holds its optimizer weakly, and
    does nothing once the optimizer is gone or closed."""

    def hook(p: torch.Tensor) -> None:
        opt = ref()
        if opt is not None and not opt._closed:
            opt._on_grad(i, p)

    return hook


def _norm_groups(params: list[torch.Tensor]) -> tuple[list[Any], torch.device]:
    """Note [Sharded norms]: the process groups the sum of squares is all-reduced over (one
    per mesh dimension the parameters are sharded along: FSDP2's, not HSDP's replicas, which
    hold the same shards) and the device the groups' backend reduces on (NCCL: the GPU, never
    a CPU tensor; gloo: the CPU)."""
    sharded: list[Any] = [p for p in params if hasattr(p, "device_mesh")]
    plain = [i for i, p in enumerate(params) if not hasattr(p, "device_mesh")]
    if plain:
        # Each process would add its own copy of these to the all-reduced sum: a norm N times
        # theirs, silently.
        raise RuntimeError(
            f"CPUAdamW: parameters {plain[:8]} are plain tensors beside FSDP2's sharded ones "
            "(DTensors); the gradient norm over both cannot be all-reduced: shard every "
            "parameter (fully_shard on the root module too) or step the plain ones with "
            "another optimizer"
        )
    mesh, placements = sharded[0].device_mesh, tuple(sharded[0].placements)
    for p in sharded[1:]:
        if p.device_mesh != mesh or tuple(p.placements) != placements:
            raise RuntimeError(
                "CPUAdamW: the parameters are sharded over different device meshes or "
                f"placements ({mesh} {placements} and {p.device_mesh} {p.placements}); one "
                "CPUAdamW steps the parameters of one mesh: make one optimizer per mesh"
            )
    groups = [mesh.get_group(d) for d, pl in enumerate(placements) if pl.is_shard()]
    if mesh.device_type == "cuda":
        device = torch.device("cuda", _local(sharded[0]).device.index or 0)
    else:
        device = torch.device(mesh.device_type)
    return groups, device


def _ptr(t: Optional[torch.Tensor]) -> int:
    return t.data_ptr() if t is not None else 0


def _check_shareable(
    params: list[torch.Tensor], device: Optional[torch.device], early_weights: bool
) -> None:
    """Note [Weights shared with the parameters]: what share_weights=True needs."""
    if device is not None:
        raise ValueError(
            "CPUAdamW: share_weights=True is for CPU float32 parameters; these are stepped "
            f"on the device path ({device}), whose parameters are bfloat16 views of a flat "
            "device buffer"
        )
    if early_weights:
        raise ValueError(
            "CPUAdamW: share_weights=True with early_weights=True: early weights write the "
            "parameter during backward, which would overwrite the master weights a rollback "
            "(a clip, a NaN) steps again from; pass one of them"
        )
    for i, p in enumerate(params):
        if hasattr(p, "to_local") or p.dtype != torch.float32:
            what = "a DTensor (FSDP2's shard)" if hasattr(p, "to_local") else str(p.dtype)
            raise ValueError(
                f"CPUAdamW: share_weights=True: parameter {i} is {what}; the parameters "
                "whose storage can be the fp32 master weights are plain float32 CPU tensors"
            )


def _check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    if isinstance(lr, torch.Tensor):
        raise ValueError("CPUAdamW: lr as a tensor is not supported; pass a float")
    if not (isinstance(lr, (int, float)) and lr >= 0 and math.isfinite(lr)):
        raise ValueError(f"CPUAdamW: lr is {lr!r}; must be a finite float >= 0")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"CPUAdamW: betas is {betas!r}; must be a pair (beta1, beta2)")
    for name, b in zip(("betas[0]", "betas[1]"), betas):
        if not (0.0 <= b < 1.0):
            raise ValueError(f"CPUAdamW: {name} is {b!r}; must be in [0, 1)")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"CPUAdamW: eps is {eps!r}; must be > 0")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"CPUAdamW: weight_decay is {weight_decay!r}; must be >= 0")


def _device_path(params: list[torch.Tensor], emulate: bool) -> Optional[torch.device]:
    """The device of the device path (Note [The device path of CPUAdamW]), or None."""
    devices = {_local(p).device for p in params if isinstance(p, torch.Tensor)}
    if not any(d.type != "cpu" for d in devices) and not emulate:
        return None
    if len(devices) != 1:
        raise ValueError(
            "CPUAdamW: the parameters are on several devices "
            f"({', '.join(sorted(map(str, devices)))}); one optimizer steps one device's"
        )
    (dev,) = devices
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"CPUAdamW: a parameter is on {dev}; cpu and cuda are supported")
    return dev


def _check_param(p: torch.Tensor, i: int, device: Optional[torch.device]) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"CPUAdamW: parameter {i} is a {type(p).__name__}, not a tensor")
    p = _local(p)
    if device is not None and p.dtype != torch.bfloat16:
        raise ValueError(
            f"CPUAdamW: parameter {i} is {p.dtype} on {p.device}; on the device path the "
            "parameters are bfloat16 (the fp32 master weights live on the host): "
            "model.to(torch.bfloat16)"
        )
    if p.dtype not in _DTYPES:
        raise ValueError(
            f"CPUAdamW: parameter {i} is {p.dtype}; float32 and bfloat16 are supported"
        )
    if p.layout != torch.strided or not p.is_contiguous():
        raise ValueError(f"CPUAdamW: parameter {i} is not a contiguous strided tensor")
    if p.numel() == 0:
        raise ValueError(f"CPUAdamW: parameter {i} has no elements")

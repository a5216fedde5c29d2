"""A whole training step under every activation policy, beside the planner's prediction
(docs/PERFORMANCE.md, "A training step end to end").

A Hugging Face model of a catalog config (data/models/: Qwen3-30B-A3B or Llama-3.1-8B, its
real widths, --layers of its blocks; random weights, synthetic tokens, nothing downloaded)
trains a few steps (forward, backward, AdamW) under each policy, every policy from the same
initial weights and the same batch:
  - keep: every saved activation kept;
  - checkpoint: torch.utils.checkpoint (non-reentrant) around every decoder block, the
    baseline of the ratio columns;
  - selective: offload_activations with the planner's selective plan (torch's selective
    checkpointing with the plan's recompute set, Note [Selective recompute of a plan]);
  - save_on_cpu: torch.autograd.graph.save_on_cpu (pinned on CUDA);
  - offload-auto: offload_activations(plan="auto"), planned from a measured first step;
  - offload-mlp: offload_activations(offload_tensors="mlp"), the MLP block's tensors;
and, on the optimizer axis, torch AdamW (fused on CUDA, foreach on CPU) against
spillway.torch.CPUAdamW (speculative; its device path for bf16 CUDA parameters), both with
every block checkpointed. On CUDA with --hbm-gb the optimizer rows train a model of their own
(--optimizer-layers, sized by default so that its weights, gradients and torch AdamW's
state do not fit the budget while CPUAdamW's device share does); torch AdamW then runs
uncapped as well, for its step time.

Per row: tokens/s and the step time (median of the timed steps after warm-up), the peak
memory (CUDA: torch.cuda.max_memory_allocated over the timed steps; CPU: the peak of the
bytes torch holds during one step, i.e. the storages live at its start (weights, gradients,
torch optimizer state) plus the peak of those made during it, counted op by op; host memory
that spillway's engines allocate themselves, the offload pool and CPUAdamW's state, is not
in it), the ratios to checkpoint of the same run, and the planner's prediction of the step
time and peak (spillway.plan: summary.step_ms, summary.peak_hbm_bytes) from a hardware
profile made in the same run (spillway probe and spillway bench gemm; on CPU a hardware
profile of this host written from them).

Checks, printed and in the JSON (the exit status is 1 when one fails): each activation
policy's first-step loss and every parameter's gradient against keep's: bitwise for
offload-auto, offload-mlp and save_on_cpu (same arithmetic), within RECOMPUTE_TOLERANCE for
checkpoint and selective; and CPUAdamW's weights after its warm-up steps against
torch.optim.AdamW given the same gradients, on a sample of each parameter's elements, within
Note [ulp bound against torch.optim.AdamW] (docs/python.md).

  PYTHONPATH=build/python python bench/torch/bench_train.py --device cpu --tiny
  PYTHONPATH=build/python python bench/torch/bench_train.py --device cuda --model qwen3-30b-a3b \\
      --layers 4 --seq-len 4096 --micro-batch 1 --hbm-gb 40 --json train.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import spillway
import spillway.torch as st

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "qwen3-30b-a3b": ROOT / "data/models/qwen3-30b-a3b.json",
    "llama-3.1-8b": ROOT / "data/models/llama-3.1-8b.json",
}
# --tiny: the same architectures, scaled down (every other field as published).
TINY = {
    "qwen3_moe": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "bos_token_id": None,
        "eos_token_id": None,
    },
    "llama": {
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "bos_token_id": None,
        "eos_token_id": None,
    },
}
ACTIVATION_POLICIES = (
    "keep",
    "checkpoint",
    "selective",
    "save_on_cpu",
    "offload-auto",
    "offload-mlp",
)
OPTIMIZER_POLICIES = ("torch-adamw", "cpu-adamw")
ALL_POLICIES = ACTIVATION_POLICIES + OPTIMIZER_POLICIES
BITWISE = ("save_on_cpu", "offload-auto", "offload-mlp")
RECOMPUTE = ("checkpoint", "selective")
# The planner's policy (and offload_tensors) that predicts each row.
PLANNER_POLICY: dict[str, tuple[str, Optional[str]]] = {
    "keep": ("keep", None),
    "checkpoint": ("checkpoint", None),
    "selective": ("selective", None),
    "save_on_cpu": ("offload", None),
    "offload-auto": ("auto", None),
    "offload-mlp": ("keep", "mlp"),
    "torch-adamw": ("checkpoint", None),
    "cpu-adamw": ("checkpoint", None),
}
# Recompute runs the same forward ops again on the same inputs: on CPU in fp32 the
# gradients came out bitwise those of keep (measured: 0 difference). The bound allows for a
# kernel that sums in another order when it runs again (bf16 on a GPU): the largest
# difference of any gradient element over the largest |gradient| of the model, and the
# loss's difference over the loss.
RECOMPUTE_TOLERANCE = {"cpu": 1e-6, "cuda": 1e-2}
# Note [ulp bound against torch.optim.AdamW] (docs/python.md): within 32 ulp (fp32) of
# max(|p|, lr), given the same gradients. A bfloat16 parameter is the round-to-nearest copy
# of its fp32 master, so two masters within 32 fp32 ulp round to bf16 values at most 1 bf16
# ulp apart.
ULP_BOUND = {torch.float32: 32.0, torch.bfloat16: 1.0}
SAMPLE = 4096  # elements of each parameter the optimizer check steps alongside
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


# ---- the run's context -----------------------------------------------------------------


@dataclasses.dataclass
class Prediction:
    step_ms: Optional[float]
    peak_bytes: Optional[int]
    feasible: Optional[bool]
    policy: str
    note: str = ""
    # The peak less the weights, gradients and optimizer state the planner counts: what the
    # activation policy decides (the planner's device optimizer keeps fp32 masters and
    # moments, 12 bytes a parameter, where torch AdamW over bf16 parameters keeps 4).
    above_state_bytes: Optional[int] = None


@dataclasses.dataclass
class Context:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    dtype_name: str  # the planner's: bf16 or fp32
    config: Any  # the model's transformers config (the layer count overridden)
    workdir: str
    hardware: str  # a catalog name or a hardware JSON path, for spillway.plan
    hardware_label: str
    profile: str  # the gemm profile made in this run ("" when none)
    profile_note: str
    d2h_gbps: Optional[float]
    h2d_gbps: Optional[float]
    batch: dict[str, Any]
    tokens: int
    min_bytes: int
    config_paths: dict[int, str] = dataclasses.field(default_factory=dict)
    # Whether keep's first step, run twice, gave the same bits: where it does not (a
    # device's kernels that sum in a varying order), "bitwise" cannot hold for anything.
    repeatable: bool = True
    experts: str = ""  # the MoE experts' implementation transformers chose (grouped_mm, eager)
    # Note [A model as PyTorch runs it]: what the rows' model saves per block, measured
    # (spillway.torch.measure_saved); the planner plans from it, not from its inventory.
    saved: Optional[Any] = None


def config_path(ctx: Context, layers: int) -> str:
    """The model's config.json with `layers` blocks, written once per layer count."""
    if layers not in ctx.config_paths:
        folder = os.path.join(ctx.workdir, f"config-{layers}")
        os.makedirs(folder, exist_ok=True)
        cfg = ctx.config.to_dict()
        cfg["num_hidden_layers"] = layers
        path = os.path.join(folder, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2, default=str)
        ctx.config_paths[layers] = path
    return ctx.config_paths[layers]


def saved_for(ctx: Context, layers: int) -> Optional[Any]:
    """The measured saved tensors for a model of `layers` blocks: the rows' model's (None for
    another layer count: the planner's inventory then)."""
    if ctx.saved is None or len(ctx.saved.layers) != layers:
        return None
    return ctx.saved


def saved_per_block(ctx: Context) -> Optional[list[int]]:
    """What each block of the rows' model saves for the run's batch, as measured."""
    if ctx.saved is None:
        return None
    return [int(b) for b in ctx.saved.totals(ctx.args.micro_batch, ctx.args.seq_len)]


def planner_gb(gib: Optional[float]) -> Optional[float]:
    """--hbm-gb is GiB (the cap of set_per_process_memory_fraction); the planner's GB are 1e9."""
    return None if gib is None else gib * 2**30 / 1e9


def predict(
    ctx: Context, policy: str, layers: Optional[int] = None, budget_gb: Optional[float] = None
) -> Prediction:
    """The planner's step time and peak for `policy`'s row: a model of `layers` blocks (None:
    the rows' model) under `budget_gb` GiB (None: the hardware profile's HBM)."""
    strategy, tensors = PLANNER_POLICY[policy]
    n = ctx.config.num_hidden_layers if layers is None else layers
    try:
        plan = spillway.plan(
            config_path(ctx, n),
            ctx.hardware,
            micro_batch=ctx.args.micro_batch,
            seq_len=ctx.args.seq_len,
            dtype=ctx.dtype_name,
            policy=strategy,
            profile=ctx.profile,
            hbm_budget_gb=planner_gb(budget_gb),
            d2h_gbps=ctx.d2h_gbps,
            h2d_gbps=ctx.h2d_gbps,
            optimizer="offload" if policy == "cpu-adamw" else "device",
            offload_tensors=tensors,
            saved=saved_for(ctx, n),
            loss_chunk=ctx.tokens,  # transformers' loss: the whole batch's logits at once
        )
    except (ValueError, spillway.Error) as e:
        return Prediction(None, None, None, strategy, f"plan failed: {e}")
    s = plan["summary"]
    label = strategy + (f", offload_tensors={tensors}" if tensors else "")
    cat = s.get("peak_hbm_by_category", {})
    state = sum(int(cat.get(k, 0)) for k in ("weights", "gradients", "optimizer_states"))
    return Prediction(
        float(s["step_ms"]),
        int(s["peak_hbm_bytes"]),
        bool(s["feasible"]),
        label,
        "",
        int(s["peak_hbm_bytes"]) - state,
    )


# ---- the hardware profile, made in this run ---------------------------------------------


def spillway_bin(args: argparse.Namespace) -> Optional[str]:
    if args.spillway:
        return str(args.spillway)
    build = os.environ.get("SPILLWAY_BUILD")
    if build and os.path.exists(os.path.join(build, "bin", "spillway")):
        return os.path.join(build, "bin", "spillway")
    return shutil.which("spillway")


def default_hardware(device: torch.device) -> str:
    if device.type != "cuda":
        return "host"
    name = torch.cuda.get_device_name(device).upper()
    for key, profile in (
        ("GH200", "gh200"),
        ("GB200", "gb200"),
        ("B200", "b200"),
        ("H200", "h200-sxm"),
        ("H100 PCIE", "h100-pcie"),
        ("H100", "h100-sxm"),
    ):
        if key in name:
            return profile
    return "gh200"


def run_cli(cmd: list[str], timeout: float) -> tuple[bool, str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    return r.returncode == 0, f"exit {r.returncode}: {tail[0][:200]}"


def link_of(probe_json: str) -> tuple[Optional[float], Optional[float]]:
    """The probe's pinned D2H and H2D GB/s at its largest size (medians)."""
    with open(probe_json) as f:
        d = json.load(f)
    pts = [p for p in d.get("points", []) if p.get("host_memory") == "pinned"]
    out: dict[str, float] = {}
    for direction in ("D2H", "H2D"):
        mine = [p for p in pts if p["direction"] == direction]
        if mine:
            out[direction] = float(max(mine, key=lambda p: p["bytes"])["gbps_median"])
    return out.get("D2H"), out.get("H2D")


def host_hardware(path: str, gflops: float, gbps: float, memory_gb: float) -> None:
    """A spillway.hardware/1 profile of this host as the device (the CPU run's): its fp32
    GEMM rate (the planner takes fp32 at half the bf16 figure), memcpy bandwidth as its
    memory and its link, its memory as HBM."""
    hw = {
        "schema": "spillway.hardware/1",
        "name": "host",
        "description": f"this host as the device ({os.cpu_count()} cores), measured in this run",
        "projected": False,
        "gpu": {
            "hbm_gb": memory_gb,
            "hbm_tbps": gbps / 1e3,
            "sms": 1,
            "bf16_dense_tflops": 2 * gflops / 1e3,
        },
        "host_link": {
            "kind": "emulated",
            "d2h_nominal_gbps": gbps,
            "h2d_nominal_gbps": gbps,
            "d2h_typical_gbps": gbps,
            "h2d_typical_gbps": gbps,
            "gpus_per_link": 1,
        },
        "host": {"memory_gb": memory_gb, "gpus_per_host_memory": 1},
        "notes": "written by bench/torch/bench_train.py from spillway probe --device host and "
        "spillway bench gemm (cblas sgemm) run just before",
    }
    with open(path, "w") as f:
        json.dump(hw, f, indent=2)


def host_memory_gb() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 1e9
    except (ValueError, OSError):
        return 16.0


def make_profile(
    args: argparse.Namespace, device: torch.device, workdir: str, config: str
) -> tuple[str, str, str, Optional[float], Optional[float], str]:
    """(hardware, its label, gemm profile path or "", d2h, h2d, note): the profile made in
    this run, or the hardware profile's defaults ("no profile: why") where it fails."""
    hardware = args.hardware or default_hardware(device)
    binary = spillway_bin(args)
    probe = os.path.join(workdir, "probe.json")
    gemm = os.path.join(workdir, "gemm-profile.json")
    shape = ["--model", config, "--micro-batch", str(args.micro_batch)]
    shape += ["--seq-len", str(args.seq_len), "--ep", "1"]
    cuda = device.type == "cuda"
    if cuda:
        probe_cmd = [binary or "spillway", "probe", "--device", "cuda", "--hardware", hardware]
        probe_cmd += ["--sizes", "16M,256M", "--repeats", "3", "--no-pageable"]
        gemm_cmd = [binary or "spillway", "bench", "gemm", "--backend", "cuda"]
        gemm_cmd += ["--hardware", hardware, *shape, "--repeats", "3"]
    else:
        probe_cmd = [binary or "spillway", "probe", "--device", "host", "--sizes", "16M"]
        probe_cmd += ["--repeats", "3", "--no-pageable"]
        threads = str(torch.get_num_threads())
        gemm_cmd = [binary or "spillway", "bench", "gemm", *shape, "--square", "256"]
        gemm_cmd += ["--repeats", "1", "--threads", threads]
    probe_cmd += ["--budget-s", "10", "--json", probe]
    gemm_cmd += ["--json", gemm]
    d2h = h2d = None
    notes = []
    fallback = hardware
    if not cuda and hardware == "host":
        fallback = os.path.join(workdir, "host-defaults.json")
        host_hardware(fallback, 50.0, 20.0, planner_gb(args.hbm_gb) or host_memory_gb())
    if binary is None:
        return fallback, hardware, "", None, None, "no profile: no spillway CLI (--spillway)"
    if args.probe:
        ok, why, probe = True, "", args.probe
    else:
        ok, why = run_cli(probe_cmd, 30)
    if ok:
        try:
            d2h, h2d = link_of(probe)
        except (OSError, ValueError, KeyError) as e:
            ok, why = False, f"unreadable: {e}"
    if not ok:
        notes.append(f"probe failed ({why})")
    gok, gwhy = run_cli(gemm_cmd, 60)
    if not gok:
        notes.append(f"bench gemm failed ({gwhy})")
        return fallback, hardware, "", d2h, h2d, "no profile: " + "; ".join(notes)
    label = hardware
    if not cuda and hardware == "host":
        try:
            with open(gemm) as f:
                gflops = float(json.load(f)["bench"]["baseline_gflops"])
        except (OSError, ValueError, KeyError) as e:
            return fallback, hardware, "", d2h, h2d, f"no profile: bench gemm's JSON: {e}"
        hardware = os.path.join(workdir, "host.json")
        host_hardware(hardware, gflops, d2h or 20.0, planner_gb(args.hbm_gb) or host_memory_gb())
        label = f"host ({gflops:.0f} GFLOP/s fp32, {d2h or 20.0:.1f} GB/s memcpy: measured)"
    source = f"probe {os.path.basename(args.probe)}" if args.probe else "probe"
    link = f"link {d2h:.1f}/{h2d:.1f} GB/s D2H/H2D ({source})" if d2h and h2d else "link: profile's"
    notes.insert(0, f"profile: bench gemm in this run; {link}")
    return hardware, label, gemm, d2h, h2d, "; ".join(notes)


# ---- the model -----------------------------------------------------------------------


def model_config(args: argparse.Namespace) -> Any:
    with open(MODELS[args.model]) as f:
        raw = json.load(f)
    if args.tiny:
        raw.update(TINY[raw["model_type"]])
    raw["num_hidden_layers"] = args.layers
    raw["use_cache"] = False
    for key in ("torch_dtype", "dtype", "transformers_version", "architectures"):
        raw.pop(key, None)
    cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(ctx: Context, layers: int, state: Optional[dict[str, Any]] = None) -> Any:
    cfg = ctx.config.__class__.from_dict(ctx.config.to_dict())
    cfg.num_hidden_layers = layers
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    with torch.device(ctx.device):
        try:  # transformers 5 names it dtype; 4.x torch_dtype
            model = auto.from_config(cfg, attn_implementation="sdpa", dtype=ctx.dtype)  # type: ignore[no-untyped-call]
        except TypeError:
            model = auto.from_config(cfg, attn_implementation="sdpa", torch_dtype=ctx.dtype)  # type: ignore[no-untyped-call]
    model.to(ctx.dtype)
    model.config.use_cache = False
    model.train()
    if state is not None:
        model.load_state_dict(state)
    return model


def parameters_of(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- memory --------------------------------------------------------------------------


def _aliases(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The peak of the bytes torch holds on the CPU while it is entered: the storages made by
    ops (views and in-place ops make none) live at the same time, each counted once until
    it is freed, over `base` (the bytes already held)."""

    def __init__(self, base: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = base
        self.peak = base
        self._seen: dict[int, Any] = {}

    def _on_free(self, key: int, nbytes: int) -> Callable[[Any], None]:
        def freed(_ref: Any) -> None:
            self.live -= nbytes
            self._seen.pop(key, None)

        return freed

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if _aliases(func):
            return out
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = id(s)
            if key in self._seen:
                continue
            n = s.nbytes()
            self._seen[key] = weakref.ref(s, self._on_free(key, n))
            self.live += n
            self.peak = max(self.peak, self.live)
        return out


def state_bytes(model: Any, opt: Optional[torch.optim.Optimizer]) -> int:
    """The weights, a gradient for each and the optimizer's state where torch holds it (not
    CPUAdamW's, on the host): what a step's peak holds besides its activations."""
    n = sum(2 * int(p.nbytes) for p in model.parameters())
    if opt is not None and not isinstance(opt, st.CPUAdamW):
        for s in opt.state.values():
            n += sum(int(v.nbytes) for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    return n


def held_bytes(model: Any, opt: Optional[torch.optim.Optimizer]) -> int:
    """Unique storages of the weights, gradients and (torch) optimizer state."""
    tensors: list[torch.Tensor] = []
    for p in model.parameters():
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    if opt is not None and not isinstance(opt, st.CPUAdamW):
        for s in opt.state.values():
            tensors += [v for v in s.values() if isinstance(v, torch.Tensor)]
    seen: dict[int, int] = {}
    for t in tensors:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


# ---- the policies --------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """What a policy puts around each step's forward and backward, and how to undo it."""

    enter: Callable[[], contextlib.AbstractContextManager[Any]]
    remove: Callable[[], None]
    measuring_step: bool = False  # a first step that offloads nothing (sizing / measuring)
    offload: Optional[st.OffloadActivations] = None


def checkpoint_blocks(model: Any) -> Callable[[], None]:
    """torch.utils.checkpoint (non-reentrant) around every decoder block; returns the undo."""
    blocks = list(model.model.layers)
    for block in blocks:
        original = block.forward

        def forward(*a: Any, _original: Callable[..., Any] = original, **k: Any) -> Any:
            if not torch.is_grad_enabled():
                return _original(*a, **k)
            return torch.utils.checkpoint.checkpoint(_original, *a, use_reentrant=False, **k)

        block.forward = forward

    def undo() -> None:
        for block in blocks:
            block.__dict__.pop("forward", None)

    return undo


def setup_policy(ctx: Context, model: Any, policy: str) -> Setup:
    cuda = ctx.device.type == "cuda"
    if policy == "keep":
        return Setup(contextlib.nullcontext, lambda: None)
    if policy in ("checkpoint", "torch-adamw", "cpu-adamw"):
        return Setup(contextlib.nullcontext, checkpoint_blocks(model))
    if policy == "save_on_cpu":
        return Setup(lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda), lambda: None)
    kw: dict[str, Any] = {"min_bytes": ctx.min_bytes}
    if policy == "selective":
        plan = spillway.plan(
            config_path(ctx, ctx.config.num_hidden_layers),
            ctx.hardware,
            micro_batch=ctx.args.micro_batch,
            seq_len=ctx.args.seq_len,
            dtype=ctx.dtype_name,
            policy="selective",
            profile=ctx.profile,
            hbm_budget_gb=planner_gb(ctx.args.hbm_gb),
            d2h_gbps=ctx.d2h_gbps,
            h2d_gbps=ctx.h2d_gbps,
            saved=saved_for(ctx, ctx.config.num_hidden_layers),
            loss_chunk=ctx.tokens,
        )
        off = st.offload_activations(model, plan, **kw)
    elif policy == "offload-auto":
        off = st.offload_activations(
            model, "auto", hardware=ctx.hardware, hbm_budget_gb=planner_gb(ctx.args.hbm_gb), **kw
        )
    elif policy == "offload-mlp":
        off = st.offload_activations(model, offload_tensors="mlp", **kw)
    else:
        raise ValueError(f"unknown policy {policy!r}")
    return Setup(lambda: off, off.remove, measuring_step=True, offload=off)


def make_optimizer(ctx: Context, model: Any, policy: str) -> torch.optim.Optimizer:
    hyper: dict[str, Any] = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}
    if policy == "cpu-adamw":
        return st.CPUAdamW(model.parameters(), **hyper)
    if ctx.device.type == "cuda":
        return torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    return torch.optim.AdamW(model.parameters(), foreach=True, **hyper)


# ---- one row ---------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    policy: str
    status: str = "ok"  # ok, OOM, error
    note: str = ""
    layers: int = 0
    parameters: int = 0
    cap_gb: Optional[float] = None  # the CUDA cap it ran under (None: the whole GPU)
    step_ms: Optional[float] = None
    steps_ms: list[float] = dataclasses.field(default_factory=list)
    tokens_per_s: Optional[float] = None
    peak_bytes: Optional[int] = None
    state_bytes: Optional[int] = None  # weights, their gradients, torch optimizer state
    offloaded_bytes: Optional[int] = None
    prediction: Optional[Prediction] = None


@dataclasses.dataclass
class Check:
    name: str
    policy: str
    passed: bool
    detail: str


@dataclasses.dataclass
class FirstStep:
    loss: float
    grads: dict[str, torch.Tensor]  # on the CPU
    top: float  # the largest |gradient element|


@dataclasses.dataclass
class Diff:
    """A model's gradients against a FirstStep's."""

    loss: float
    equal: int  # gradients bitwise equal
    total: int
    first_differing: str
    worst: float  # the largest |difference| of a gradient element
    where: str
    missing: list[str]


CHUNK = 1 << 24  # elements compared at once on the device (bounds the temporaries)


def sync(ctx: Context) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


@contextlib.contextmanager
def deterministic(ctx: Context) -> Iterator[None]:
    """The checked step: on CUDA with torch's deterministic kernels (index_add_, scatter,
    embedding backward), so that the same arithmetic gives the same bits."""
    if ctx.device.type != "cuda":
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def forward_backward(ctx: Context, model: Any, setup: Setup) -> torch.Tensor:
    with setup.enter():
        loss: torch.Tensor = model(**ctx.batch).loss
        loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


def capture(model: Any, loss: torch.Tensor) -> FirstStep:
    grads: dict[str, torch.Tensor] = {}
    top = 0.0
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach()
            top = max(top, float(g.abs().max()))
            # Pinned on CUDA: each policy's check reads it back to the device.
            grads[n] = torch.empty(g.shape, dtype=g.dtype, pin_memory=g.is_cuda).copy_(g)
    return FirstStep(float(loss.float().item()), grads, top)


def diff(model: Any, loss: torch.Tensor, want: FirstStep) -> Diff:
    """The model's gradients (where they are) against `want`'s, CHUNK elements at a time."""
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    d = Diff(float(loss.float().item()), 0, len(want.grads), "", 0.0, "", [])
    d.missing = sorted(set(want.grads) ^ set(got))
    for n, ref in want.grads.items():
        if n not in got:
            continue
        a, b = got[n].detach().reshape(-1), ref.reshape(-1)
        same = True
        for i in range(0, a.numel(), CHUNK):
            x, y = a[i : i + CHUNK], b[i : i + CHUNK].to(a.device)
            if not torch.equal(x, y):
                same = False
                worst = float((x.float() - y.float()).abs().max())
                if worst > d.worst:
                    d.worst, d.where = worst, n
        if same:
            d.equal += 1
        elif not d.first_differing:
            d.first_differing = n
    return d


def inject_fault(model: Any) -> None:
    """--inject-fault: one gradient element moved by a tenth of the largest |gradient|."""
    for p in model.parameters():
        if p.grad is not None:
            with torch.no_grad():
                g = p.grad.view(-1)
                g[0] += 0.1 * float(g.abs().max()) + 1e-3
            return


def set_cap(ctx: Context, cap: Optional[float]) -> None:
    """On CUDA, this process may allocate `cap` GiB (None: the whole GPU)."""
    if ctx.device.type == "cuda":
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        fraction = 1.0 if cap is None else min(1.0, cap * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, ctx.device)


def free(ctx: Context) -> None:
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)


class AdamReference:
    """torch.optim.AdamW (fp32, on the CPU) over the first SAMPLE elements of each
    parameter, given the gradients the measured optimizer got: AdamW is elementwise, so
    these elements of its result are what the whole would be."""

    def __init__(self, model: Any) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ref = [
            torch.nn.Parameter(p.detach().reshape(-1)[:SAMPLE].to("cpu", torch.float32).clone())
            for p in self.params
        ]
        self.opt = torch.optim.AdamW(
            self.ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False
        )
        self.steps = 0

    def step(self, fault: bool) -> None:
        """After backward, before the measured optimizer's step."""
        for p, r in zip(self.params, self.ref):
            g = p.grad
            r.grad = (
                torch.zeros_like(r)
                if g is None
                else g.detach().reshape(-1)[:SAMPLE].to("cpu", torch.float32).clone()
            )
        if fault and self.ref[0].grad is not None:
            self.ref[0].grad[0] += 1.0
        self.opt.step()
        self.steps += 1

    def worst_ulps(self) -> tuple[float, float]:
        """(the largest distance in ulp of max(|p|, lr), in the parameters' dtype; bound)"""
        worst = 0.0
        dtype = self.params[0].dtype
        for p, r in zip(self.params, self.ref):
            ours = p.detach().reshape(-1)[:SAMPLE].to("cpu")
            theirs = r.detach().to(ours.dtype)
            worst = max(worst, ulps(ours, theirs, LR))
        return worst, ULP_BOUND.get(dtype, 32.0)


def ulps(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """max |a - b| in ulp of max(|a|, |b|, floor), in a's dtype (an ulp of x: eps * 2^(e-1),
    x = m * 2^e with m in [0.5, 1))."""
    a64, b64 = a.double(), b.double()
    scale = torch.maximum(torch.maximum(a64.abs(), b64.abs()), torch.full_like(a64, floor))
    _, e = torch.frexp(scale)
    spacing = torch.finfo(a.dtype).eps * torch.pow(2.0, (e - 1).double())
    return float(((a64 - b64).abs() / spacing).max())


def run_row(
    ctx: Context,
    model: Any,
    policy: str,
    reference: Optional[FirstStep],
    checks: list[Check],
    cap: Optional[float],
) -> Row:
    """One policy: a measuring step where it has one (no optimizer step), the checked first
    step, the rest of the warm-up, the timed steps; then its peak."""
    args = ctx.args
    row = Row(policy, layers=model.config.num_hidden_layers, parameters=parameters_of(model))
    row.cap_gb = cap if ctx.device.type == "cuda" else None
    set_cap(ctx, cap)
    free(ctx)
    opt: Optional[torch.optim.Optimizer] = None
    setup: Optional[Setup] = None
    adam_ref: Optional[AdamReference] = None
    cuda = ctx.device.type == "cuda"
    fault = args.inject_fault == policy
    try:
        setup = setup_policy(ctx, model, policy)
        opt = make_optimizer(ctx, model, policy)
        if policy == "cpu-adamw":
            adam_ref = AdamReference(model)

        def step(first: bool = False) -> torch.Tensor:
            assert opt is not None and setup is not None
            loss = forward_backward(ctx, model, setup)
            if first and policy in ACTIVATION_POLICIES:
                if fault:
                    inject_fault(model)
                if reference is not None:
                    checks.append(compare(ctx, policy, diff(model, loss, reference), reference))
            if adam_ref is not None:
                adam_ref.step(fault)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        if setup.measuring_step:
            forward_backward(ctx, model, setup)
            model.zero_grad(set_to_none=True)
        with deterministic(ctx):
            step(first=True)
        for _ in range(max(0, args.warmup - 1)):
            step()
        sync(ctx)
        if adam_ref is not None:
            worst, bound = adam_ref.worst_ulps()
            checks.append(
                Check(
                    "weights vs torch.optim.AdamW",
                    policy,
                    worst <= bound,
                    f"after {adam_ref.steps} steps given the same gradients: {worst:.1f} ulp "
                    f"of max(|p|, lr) in {str(adam_ref.params[0].dtype).split('.')[-1]} "
                    f"(bound {bound:g}, Note [ulp bound against torch.optim.AdamW]); "
                    f"{SAMPLE} elements of each of {len(adam_ref.params)} parameters",
                )
            )
            adam_ref = None  # the timed steps run alone
        if cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            sync(ctx)
            row.steps_ms.append((time.perf_counter() - t0) * 1e3)
        row.state_bytes = state_bytes(model, opt)
        if cuda:
            row.peak_bytes = int(torch.cuda.max_memory_allocated(ctx.device))
        else:
            tracker = LiveBytes(held_bytes(model, opt))
            with tracker:
                step()
            row.peak_bytes = tracker.peak
        row.step_ms = statistics.median(row.steps_ms)
        row.tokens_per_s = ctx.tokens / (row.step_ms / 1e3)
        if setup.offload is not None:
            rep = setup.offload.last_report()
            row.offloaded_bytes = int(rep.get("d2h_bytes", 0))
    except Exception as e:  # a row that fails is recorded, and the run goes on
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            row.status = "OOM"
            row.note = f"OOM under {cap:g} GiB" if cap is not None else "OOM"
        else:
            row.status = "error"
            row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            checks.append(Check("ran", policy, False, row.note))
        del e
    finally:
        if setup is not None:
            setup.remove()
        if isinstance(opt, st.CPUAdamW):
            opt.close()
        opt = setup = adam_ref = None
        model.zero_grad(set_to_none=True)
        free(ctx)
    return row


def compare(ctx: Context, policy: str, got: Diff, want: FirstStep) -> Check:
    """The first step's loss and every gradient against keep's."""
    if got.missing:
        return Check("first-step gradients", policy, False, f"gradients missing: {got.missing[:3]}")
    bitwise = got.equal == got.total and got.loss == want.loss
    if (policy in BITWISE or policy == "keep") and ctx.repeatable:
        detail = (
            f"loss {got.loss:.9g} {'==' if got.loss == want.loss else '!='} keep's "
            f"{want.loss:.9g}; {got.equal} of {got.total} gradients bitwise keep's"
        )
        if got.first_differing:
            detail += f" (first differing: {got.first_differing})"
        return Check("first step bitwise keep's", policy, bitwise, detail)
    tol = RECOMPUTE_TOLERANCE[ctx.device.type]
    rel = got.worst / want.top if want.top > 0 else got.worst
    loss_rel = abs(got.loss - want.loss) / max(abs(want.loss), 1e-30)
    detail = (
        f"max |dgrad| / max |grad| = {rel:.3g}{f' (at {got.where})' if got.where else ''}, "
        f"|dloss| / loss = {loss_rel:.3g}; bound {tol:g}" + ("; bitwise keep's" if bitwise else "")
    )
    if policy not in RECOMPUTE:
        detail += "; keep's own step is not bitwise run to run here, so neither can this be"
    return Check("first step within tolerance", policy, rel <= tol and loss_rel <= tol, detail)


def reference_step(ctx: Context, model: Any) -> Optional[FirstStep]:
    """keep's first step (uncapped), twice: the gradients every activation policy is checked
    against, and whether the same step gives the same bits on this device."""
    set_cap(ctx, None)
    free(ctx)
    keep = Setup(contextlib.nullcontext, lambda: None)
    try:
        with deterministic(ctx):
            first = capture(model, forward_backward(ctx, model, keep))
        model.zero_grad(set_to_none=True)
        with deterministic(ctx):
            again = diff(model, forward_backward(ctx, model, keep), first)
        ctx.repeatable = again.equal == again.total and again.loss == first.loss
        return first
    except torch.OutOfMemoryError:
        return None
    finally:
        model.zero_grad(set_to_none=True)
        free(ctx)


# ---- the optimizer model -------------------------------------------------------------


def optimizer_layers(ctx: Context, per_layer: int, fixed: int) -> tuple[int, str]:
    """--optimizer-layers auto: with --hbm-gb on CUDA, the blocks that bring the model's
    parameters P nearest a seventh of the budget X, where torch AdamW's weights, gradients
    and two bf16 moments (8 bytes a parameter) and the step's activations A (the head's
    logits: 12 bytes a logit, bf16 and the fp32 loss's copy and gradient) exceed X by 5%,
    while CPUAdamW's device share (weights and gradients: 4P + A) stays under 90% of it and
    its construction (the weights copied once into its flat buffer: 6P) under 95%; else the
    activation rows' model."""
    args = ctx.args
    if args.optimizer_layers != "auto":
        return int(args.optimizer_layers), "given (--optimizer-layers)"
    rows_model = ctx.config.num_hidden_layers
    cap = optimizer_cap(args)
    if ctx.device.type != "cuda" or cap is None:
        return rows_model, "the activation rows' model"
    x = cap * 2**30
    acts = 12 * ctx.tokens * ctx.config.vocab_size
    fits = [
        n
        for n in range(1, 1025)
        if 8 * (fixed + n * per_layer) + acts > 1.05 * x
        and 4 * (fixed + n * per_layer) + acts < 0.90 * x
        and 6 * (fixed + n * per_layer) < 0.95 * x
    ]
    if not fits:
        return rows_model, f"none fits between the two at {cap:g} GiB (the rows' model)"
    n = min(fits, key=lambda n: abs(fixed + n * per_layer - x / 7))
    return n, f"sized to {cap:g} GiB: torch AdamW needs 8 B/param, CPUAdamW 4"


def optimizer_cap(args: argparse.Namespace) -> Optional[float]:
    """The optimizer rows' cap (GiB): --optimizer-hbm-gb, else --hbm-gb."""
    cap = args.optimizer_hbm_gb if args.optimizer_hbm_gb is not None else args.hbm_gb
    return None if cap is None else float(cap)


def optimizer_rows(
    ctx: Context,
    policies: list[str],
    init_state: dict[str, Any],
    sizes: tuple[int, int],
    checks: list[Check],
) -> list[Row]:
    """torch AdamW and CPUAdamW, each on its own model of the same initial weights (the
    activation rows' `init_state`, or a sized model's seed-0 weights). `sizes`: parameters
    per block and outside the blocks."""
    layers = ctx.config.num_hidden_layers
    n, why = optimizer_layers(ctx, *sizes)
    cap = optimizer_cap(ctx.args)
    state: Optional[dict[str, Any]] = init_state if n == layers else None
    rows: list[Row] = []
    for policy in policies:
        model = build_model(ctx, n, state)
        try:
            row = run_row(ctx, model, policy, None, checks, cap)
            row.note = (row.note + "; " if row.note else "") + f"{n} layers: {why}"
            row.prediction = predict(ctx, policy, n, cap)
            rows.append(row)
            if policy == "torch-adamw" and row.status == "OOM" and cap is not None:
                del model
                free(ctx)
                model = build_model(ctx, n, state)
                un = run_row(ctx, model, policy, None, checks, None)
                un.policy = "torch-adamw (uncapped)"
                un.note = "the whole GPU, for its step time"
                un.prediction = predict(ctx, policy, n, None)
                rows.append(un)
        finally:
            del model
            free(ctx)
    by = {r.policy: r for r in rows}
    if n != layers and "cpu-adamw" in by and cap is not None:
        ok = by["cpu-adamw"].status == "ok"
        checks.append(
            Check(
                "trains where torch AdamW's state does not fit",
                "cpu-adamw",
                ok,
                f"{n} layers ({by['cpu-adamw'].parameters:,} parameters) under "
                f"{cap:g} GiB: {'trained' if ok else by['cpu-adamw'].note or 'did not train'}"
                + (f"; torch AdamW: {by['torch-adamw'].status}" if "torch-adamw" in by else ""),
            )
        )
    if "cpu-adamw" in by and "torch-adamw" in by:
        if by["torch-adamw"].status == "OOM" and by["cpu-adamw"].status == "ok":
            by["torch-adamw"].note = f"OOM under {cap:g} GiB; CPUAdamW trains it ({n} layers)"
    return rows


# ---- output ----------------------------------------------------------------------------


def gib(n: Optional[int]) -> str:
    if n is None:
        return "-"
    if n >= 2**28:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def above_state(r: Row) -> Optional[int]:
    """The measured peak less the weights, gradients and torch optimizer state."""
    if r.peak_bytes is None or r.state_bytes is None:
        return None
    return r.peak_bytes - r.state_bytes


def same_model(a: Row, b: Row) -> bool:
    """Whether two rows trained the same model (the ratios compare only those)."""
    return a.parameters == b.parameters


def table(ctx: Context, rows: list[Row]) -> str:
    ckpt = next((r for r in rows if r.policy == "checkpoint" and r.status == "ok"), None)
    head = (
        f"{'policy':<24}{'tokens/s':>11}{'step ms':>10}{'pred ms':>10}{'peak':>12}"
        f"{'pred peak':>12}{'act':>12}{'pred act':>12}{'tok/s÷ckpt':>12}{'peak÷ckpt':>11}  note"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r.prediction
        pred_ms = f"{p.step_ms:.1f}" if p and p.step_ms is not None else "-"
        pred_peak = gib(p.peak_bytes) if p else "-"
        pred_act = gib(p.above_state_bytes) if p else "-"
        if r.status != "ok":
            lines.append(
                f"{r.policy:<24}{r.status:>11}{'':>10}{pred_ms:>10}{'':>12}{pred_peak:>12}"
                f"{'':>12}{pred_act:>12}{'':>12}{'':>11}  {r.note}"
            )
            continue
        act = gib(above_state(r))
        assert r.step_ms is not None and r.tokens_per_s is not None
        tr = pr = "-"
        if ckpt is not None and ckpt.tokens_per_s and ckpt.peak_bytes and same_model(r, ckpt):
            tr = f"{r.tokens_per_s / ckpt.tokens_per_s:.2f}x"
            pr = f"{(r.peak_bytes or 0) / ckpt.peak_bytes:.2f}x"
        note = r.note
        if r.offloaded_bytes:
            note = f"offloaded {gib(r.offloaded_bytes)}" + (f"; {note}" if note else "")
        if p and p.note:
            note += ("; " if note else "") + p.note
        lines.append(
            f"{r.policy:<24}{r.tokens_per_s:>11.0f}{r.step_ms:>10.1f}{pred_ms:>10}"
            f"{gib(r.peak_bytes):>12}{pred_peak:>12}{act:>12}{pred_act:>12}{tr:>12}{pr:>11}"
            f"  {note}"
        )
    return "\n".join(lines)


def row_json(r: Row, ckpt: Optional[Row]) -> dict[str, Any]:
    d: dict[str, Any] = {
        "policy": r.policy,
        "status": r.status,
        "note": r.note,
        "layers": r.layers,
        "parameters": r.parameters,
        "cap_gb": r.cap_gb,
        "step_ms": r.step_ms,
        "steps_ms": r.steps_ms,
        "tokens_per_s": r.tokens_per_s,
        "peak_bytes": r.peak_bytes,
        "state_bytes": r.state_bytes,
        "above_state_bytes": above_state(r),
        "offloaded_bytes": r.offloaded_bytes,
        "vs_checkpoint": None,
        "predicted": dataclasses.asdict(r.prediction) if r.prediction else None,
    }
    if (
        r.status == "ok"
        and ckpt is not None
        and same_model(r, ckpt)
        and ckpt.tokens_per_s
        and ckpt.peak_bytes
        and r.tokens_per_s
        and r.peak_bytes
    ):
        d["vs_checkpoint"] = {
            "tokens_per_s": r.tokens_per_s / ckpt.tokens_per_s,
            "peak": r.peak_bytes / ckpt.peak_bytes,
        }
    return d


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: the architectures shrunk")
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default 4; tiny 2)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 2048; tiny 64")
    ap.add_argument("--micro-batch", type=int, default=None, help="default 1; tiny 2")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; tiny 2)")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the timed ones (>= 1)")
    ap.add_argument(
        "--hbm-gb",
        type=float,
        default=None,
        help="CUDA: cap this process at this many GiB (an H200 standing for a smaller GPU);\n"
        "also the planner's hbm_budget_gb",
    )
    ap.add_argument(
        "--policies",
        default=",".join(ALL_POLICIES),
        help=f"comma list of {', '.join(ALL_POLICIES)} (default: all)",
    )
    ap.add_argument(
        "--optimizer-hbm-gb",
        type=float,
        default=None,
        help="CUDA: the optimizer rows' cap in GiB (default: --hbm-gb)",
    )
    ap.add_argument(
        "--optimizer-layers",
        default="auto",
        help="blocks of the optimizer rows' model; auto: on CUDA under a cap, sized so\n"
        "that torch AdamW cannot fit and CPUAdamW can; else the rows' model",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU: torch's threads (default: half the cores, the rest left to spillway's\n"
        "copy and CPU AdamW threads: torch's spinning threads otherwise starve them)",
    )
    ap.add_argument(
        "--hardware",
        default="",
        help="the planner's hardware profile (default on CUDA: by the GPU's name, h200-sxm,\n"
        "h100-sxm, h100-pcie, b200, gb200, else gh200; on the CPU: a profile of this host\n"
        "written from the probe and bench gemm of the run)",
    )
    ap.add_argument(
        "--probe",
        default="",
        help="a `spillway probe --json` of this machine to take the link\n"
        "from, instead of probing it again",
    )
    ap.add_argument("--spillway", default="", help="the spillway CLI (default: $SPILLWAY_BUILD)")
    ap.add_argument("--json", default="", help="write the table and checks to this file")
    ap.add_argument(
        "--inject-fault",
        default="",
        metavar="POLICY",
        help="self-test: perturb POLICY's first-step gradient (cpu-adamw: its reference's)\n"
        "so that its check fails and the run exits 1",
    )
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.layers = args.layers or (2 if tiny else 4)
    args.seq_len = args.seq_len or (64 if tiny else 2048)
    args.micro_batch = args.micro_batch or (2 if tiny else 1)
    args.steps = args.steps or (2 if tiny else 5)
    args.warmup = max(1, args.warmup)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in ALL_POLICIES]
    if bad:
        ap.error(f"--policies: unknown {', '.join(bad)}; known: {', '.join(ALL_POLICIES)}")
    args.policy_list = [p for p in ALL_POLICIES if p in policies]
    if args.inject_fault and args.inject_fault not in ALL_POLICIES:
        ap.error(f"--inject-fault: unknown policy {args.inject_fault!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        # Deterministic cuBLAS for the checked step (set before cuBLAS starts).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    else:
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // 2))
    # The offload policies' first step sizes their pool (by design here: a measuring step).
    warnings.filterwarnings("ignore", message="spillway: offload_activations sized")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t_start = time.perf_counter()
    cfg = model_config(args)
    workdir = tempfile.mkdtemp(prefix="spillway-bench-train-")
    try:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len), generator=g)
        ids = ids.to(device)
        ctx = Context(
            args=args,
            device=device,
            dtype=dtype,
            dtype_name="bf16" if dtype == torch.bfloat16 else "fp32",
            config=cfg,
            workdir=workdir,
            hardware="",
            hardware_label="",
            profile="",
            profile_note="",
            d2h_gbps=None,
            h2d_gbps=None,
            batch={"input_ids": ids, "labels": ids.clone(), "use_cache": False},
            tokens=args.micro_batch * args.seq_len,
            min_bytes=4096 if args.tiny else 64 * 1024,
        )
        (
            ctx.hardware,
            ctx.hardware_label,
            ctx.profile,
            ctx.d2h_gbps,
            ctx.h2d_gbps,
            ctx.profile_note,
        ) = make_profile(args, device, workdir, config_path(ctx, args.layers))
        return run(ctx, t_start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def where_of(ctx: Context) -> str:
    if ctx.device.type == "cuda":
        return torch.cuda.get_device_name(ctx.device)
    return f"CPU, {torch.get_num_threads()} threads"


def peak_measures(ctx: Context) -> str:
    if ctx.device.type == "cuda":
        return "torch.cuda.max_memory_allocated over the timed steps"
    return (
        "the peak of torch's CPU storages over one step (weights, gradients, torch "
        "optimizer state and what the step makes; not spillway's own host pools)"
    )


def progress(row: Row, t_start: float) -> None:
    """One line a row, on stderr, as it ends (a log of a run cut short says how far it got)."""
    what = f"{row.step_ms:.1f} ms a step" if row.step_ms is not None else row.status
    print(
        f"[bench_train] {row.policy}: {what} ({time.perf_counter() - t_start:.0f} s)",
        file=sys.stderr,
        flush=True,
    )


def write_json(
    ctx: Context, rows: list[Row], checks: list[Check], t_start: float, complete: bool
) -> None:
    """The run so far (written after every row: a run cut short leaves what it measured)."""
    args = ctx.args
    if not args.json:
        return
    ckpt = next((r for r in rows if r.policy == "checkpoint" and r.status == "ok"), None)
    out = {
        "schema": "spillway.bench-train/1",
        "complete": complete,
        "model": args.model,
        "tiny": bool(args.tiny),
        "layers": args.layers,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "dtype": ctx.dtype_name,
        "device": ctx.device.type,
        "experts_implementation": ctx.experts or None,
        "machine": {
            "where": where_of(ctx),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "spillway": spillway.__version__,
        },
        "saved_bytes_per_block": saved_per_block(ctx),
        "hbm_gb": args.hbm_gb,
        "optimizer_hbm_gb": optimizer_cap(args),
        "steps": args.steps,
        "warmup": args.warmup,
        "peak_measures": peak_measures(ctx),
        "hardware": ctx.hardware_label,
        "profile": ctx.profile_note,
        "recompute_tolerance": RECOMPUTE_TOLERANCE[ctx.device.type],
        "rows": [row_json(r, ckpt) for r in rows],
        "checks": [dataclasses.asdict(c) for c in checks],
        "passed": all(c.passed for c in checks),
        "failed": sorted({c.policy for c in checks if not c.passed}),
        "seconds": time.perf_counter() - t_start,
    }
    tmp = args.json + ".part"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    os.replace(tmp, args.json)


def run(ctx: Context, t_start: float) -> int:
    args = ctx.args
    checks: list[Check] = []
    rows: list[Row] = []
    model = build_model(ctx, args.layers)
    ctx.experts = str(getattr(model.config, "_experts_implementation", "") or "")
    seq = min(64, max(2, args.seq_len // 2))
    ctx.saved = st.measure_saved(model, seq_lens=(seq, 2 * seq))
    init_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    activation = [p for p in args.policy_list if p in ACTIVATION_POLICIES]
    reference = reference_step(ctx, model) if activation else None
    if activation and reference is None:
        checks.append(Check("reference", "keep", False, "keep's first step ran out of memory"))
    for policy in activation:
        model.load_state_dict(init_state)
        row = run_row(ctx, model, policy, reference, checks, args.hbm_gb)
        row.prediction = predict(ctx, policy, None, args.hbm_gb)
        rows.append(row)
        progress(row, t_start)
        write_json(ctx, rows, checks, t_start, False)
    optimizers = [p for p in args.policy_list if p in OPTIMIZER_POLICIES]
    per_layer = parameters_of(model.model.layers[0])
    sizes = (per_layer, parameters_of(model) - args.layers * per_layer)
    del model, reference
    free(ctx)
    if optimizers:
        for row in optimizer_rows(ctx, optimizers, init_state, sizes, checks):
            rows.append(row)
            progress(row, t_start)
        write_json(ctx, rows, checks, t_start, False)
    del init_state

    experts = ctx.experts if getattr(ctx.config, "num_experts", 0) else ""
    capped = f"; capped at {args.hbm_gb:g} GiB" if args.hbm_gb and ctx.device.type == "cuda" else ""
    print(
        f"{args.model}{' (tiny)' if args.tiny else ''}: {args.layers} layers, micro-batch "
        f"{args.micro_batch} x seq {args.seq_len}, {ctx.dtype_name}, {where_of(ctx)}"
        + (f", experts: {experts}" if experts else "")
        + capped
    )
    print(
        f"steps: median of {args.steps} timed after {args.warmup} warm-up; peak: "
        f"{peak_measures(ctx)}"
    )
    print(
        f"planner: hardware {ctx.hardware_label}; {ctx.profile_note}; saved tensors as run "
        f"(measure_saved: Note [A model as PyTorch runs it]; bytes per block "
        f"{saved_per_block(ctx)}), the loss in one chunk"
    )
    print()
    print(table(ctx, rows))
    print()
    print("checks:")
    for c in checks:
        print(f"  {'PASS' if c.passed else 'FAIL'} {c.policy:<14} {c.name}: {c.detail}")
    passed = all(c.passed for c in checks)
    failed = sorted({c.policy for c in checks if not c.passed})
    print(
        "all checks passed" if passed else f"checks FAILED: {', '.join(failed)}",
        f"({time.perf_counter() - t_start:.0f} s)",
    )
    write_json(ctx, rows, checks, t_start, True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

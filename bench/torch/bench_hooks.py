"""CPU cost of the saved-tensor hooks per saved tensor (docs/PERFORMANCE.md).

A model of L blocks of K sin() ops (each saves its input, 1 KiB: the copy is negligible, the
hooks' bookkeeping is what is timed) runs forward + backward with:
  - no hooks (the baseline, subtracted);
  - spillway.torch.offload_activations (the C++ engine through the socket's hooks);
  - torch.autograd.graph.save_on_cpu (torch's own: copies to CPU tensors);
  - a Python-only offload (pack: a copy into a new tensor; unpack: it back);
  - identity hooks (pack and unpack return their argument): the floor of any Python
    saved-tensor hooks, torch's own calls into them.
Prints the median per-tensor cost of each over the baseline, in microseconds, and the
ratio of spillway's to each peer's. Goals: 10 us per tensor, then 5 us. With
--device cuda the model runs on the GPU (each pass ends with torch.cuda.synchronize, the
peers' copies go to pinned CPU memory): the cost per tensor is then the hooks' host work
and the copies' waits together, as a training loop sees them.

  PYTHONPATH=build/python python bench/torch/bench_hooks.py [--layers 16 --ops 64 --repeats 15]
  PYTHONPATH=build/python python bench/torch/bench_hooks.py --device cuda --json hooks.json
  PYTHONPATH=build/python python bench/torch/bench_hooks.py --copy-batches 1,8

--copy-batches also times offload_activations with the engine's D2H copies enqueued in
batches of each size given (Note [Copies in batches]; the adapter uses 8), each on its own
copy of the model, in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

import spillway.torch as st


class Block(nn.Module):
    def __init__(self, ops: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ops):
            x = torch.sin(x)
        return x * self.scale


class Model(nn.Module):
    def __init__(self, layers: int, ops: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(ops) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x.sum()


def timed(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    timed_once(fn, device)  # warm-up (and the sizing of pools)
    return statistics.median(timed_once(fn, device) for _ in range(repeats))


def interleaved(
    base: Callable[[], None],
    fns: dict[str, Callable[[], None]],
    repeats: int,
    device: torch.device,
) -> tuple[float, dict[str, float]]:
    """The baseline's median step, and each variant's median excess over the baseline of
    the same round: one step of each per round, so the machine's drift (which moves this
    host's figures by 2x within an hour) shifts all of a round alike."""
    for fn in (base, *fns.values()):
        timed_once(fn, device)  # warm-up (and the sizing of pools)
    bases: list[float] = []
    over: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        b = timed_once(base, device)
        bases.append(b)
        for k, fn in fns.items():
            over[k].append(timed_once(fn, device) - b)
    return statistics.median(bases), {k: statistics.median(v) for k, v in over.items()}


def timed_once(fn: Callable[[], None], device: torch.device) -> float:
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ops", type=int, default=64)
    ap.add_argument("--elements", type=int, default=256, help="floats per saved tensor")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", help="write the figures as JSON to this file")
    ap.add_argument(
        "--copy-batches",
        default="",
        help="comma-separated copy batch sizes to time beside the default (e.g. 1,8)",
    )
    ap.add_argument(
        "--split",
        action="store_true",
        help="then time the engine's calls, per call name, and the adapter's hooks (pack, "
        "unpack, a block's reloads), each wrapped in a timer whose own cost is counted in",
    )
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_hooks: --device cuda: torch sees no CUDA device")
    device = torch.device(a.device)
    torch.set_num_threads(1)
    model = Model(a.layers, a.ops).to(device)
    x = torch.randn(a.elements, device=device, requires_grad=True)
    pinned = device.type == "cuda"
    saved = a.layers * (a.ops + 1)  # sin() saves its input, x * scale its x

    def plain() -> None:
        model(x).backward()

    offload = st.offload_activations(
        model, pinned_bytes=64 << 20, min_bytes=0, keep_last=0, max_tensors=saved + 64
    )

    def spillway_step() -> None:
        with offload:
            model(x).backward()

    def save_on_cpu() -> None:
        with torch.autograd.graph.save_on_cpu(pin_memory=pinned):
            model(x).backward()

    def pack(t: torch.Tensor) -> Any:
        if device.type == "cuda":  # to host memory and back, as an offload does
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t.detach(), non_blocking=True)
            return host
        return t.detach().clone()

    def unpack(c: torch.Tensor) -> torch.Tensor:
        return c.to(device, non_blocking=True) if device.type == "cuda" else c.clone()

    def python_only() -> None:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            model(x).backward()

    def identity(t: torch.Tensor) -> torch.Tensor:
        return t

    def identity_hooks() -> None:
        with torch.autograd.graph.saved_tensors_hooks(identity, identity):
            model(x).backward()

    variants: dict[str, Callable[[], None]] = {
        "spillway offload_activations": spillway_step,
        "torch save_on_cpu": save_on_cpu,
        "python-only pack/unpack": python_only,
        "identity hooks (the floor)": identity_hooks,
    }
    for size in (int(v) for v in a.copy_batches.split(",") if v.strip()):
        variants[f"spillway, copy batch {size}"] = batched_step(a, device, saved, size)
    base, over = interleaved(plain, variants, a.repeats, device)
    saved = offload.last_report()["tensors_offloaded"]  # sin()'s inputs and x * scale's
    print(
        f"{saved} saved tensors of {a.elements * 4} bytes per step on {a.device}; baseline "
        f"(no hooks) {base * 1e3:.2f} ms per step; each variant beside the baseline in every "
        "round"
    )
    per = {name: t / saved * 1e6 for name, t in over.items()}
    for name, us in per.items():
        print(f"  {name:32s} {us:7.2f} us per tensor over the baseline")
    ours = per["spillway offload_activations"]
    for name, us in per.items():
        if name.startswith("spillway"):
            continue
        print(f"  spillway / {name}: {ours / us:.2f}x the cost")
    for goal, issue in ((10.0, 15), (5.0, 31)):
        verdict = "met" if ours <= goal else "NOT met"
        print(f"  goal (issue {issue}): <= {goal:g} us per tensor: {verdict}")
    if a.split:
        split(offload, spillway_step, a.repeats, saved, device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "schema": "spillway.bench-hooks/1",
                    "device": a.device,
                    "saved_tensors": saved,
                    "tensor_bytes": a.elements * 4,
                    "baseline_ms": base * 1e3,
                    "us_per_tensor": per,
                    "target_us": 5.0,
                },
                f,
                indent=2,
            )


def batched_step(a: argparse.Namespace, device: torch.device, saved: int, size: int) -> Any:
    """A step of offload_activations on its own copy of the model, with the engine's D2H
    copies enqueued in batches of `size` (the adapter's private default is 8)."""
    model = Model(a.layers, a.ops).to(device)
    x = torch.randn(a.elements, device=device, requires_grad=True)
    offload = st.offload_activations(
        model, pinned_bytes=64 << 20, min_bytes=0, keep_last=0, max_tensors=saved + 64
    )
    offload._copy_batch = size  # read when its engine session is made, at its first step

    def step() -> None:
        with offload:
            model(x).backward()

    return step


def timer(f: Callable[..., Any], name: str, spent: dict[str, int]) -> Callable[..., Any]:
    """`f`, its time added to spent[name] at each call (perf_counter_ns)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return f(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0) + time.perf_counter_ns() - t0

    return call


def split(offload: Any, step: Callable[[], None], repeats: int, saved: int, device: Any) -> None:
    """Where a tensor's cost goes, each part timed for `repeats` more steps by a
    perf_counter_ns timer around it (its own cost counted in): the engine's session calls,
    per call name; then, in other steps, the adapter's hooks themselves (pack and unpack,
    and a block's reloads), the engine's calls inside them. The rest of a tensor's cost is
    torch's work around the hooks."""
    runs = repeats + 1  # timed() warms up once

    def report(title: str, spent: dict[str, int]) -> None:
        total = sum(spent.values()) / runs / saved / 1e3
        print(f"  {title} (timers included): {total:.2f} us per tensor")
        for name, ns in sorted(spent.items(), key=lambda kv: -kv[1]):
            print(f"    {name:16s} {ns / runs / saved / 1e3:6.2f} us per tensor")

    spent: dict[str, int] = {}
    inner = offload._session

    class Timed:
        def __getattr__(self, name: str) -> Any:
            f = getattr(inner, name)
            return timer(f, name, spent) if callable(f) else f

    offload._session = Timed()
    try:
        timed(step, repeats, device)
    finally:
        offload._session = inner
    report("inside the engine's calls", spent)

    hooks: dict[str, int] = {}
    names = ("_pack", "_unpack", "_reload_block")
    for name in names:  # instance attributes: the hooks are bound when a step begins
        setattr(offload, name, timer(getattr(offload, name), name.lstrip("_"), hooks))
    try:
        timed(step, repeats, device)
    finally:
        for name in names:
            delattr(offload, name)
    report("inside the adapter's hooks", hooks)


if __name__ == "__main__":
    main()

"""CPU cost of the saved-tensor hooks per saved tensor (docs/PERFORMANCE.md).

A model of L blocks of K sin() ops (each saves its input, 1 KiB: the copy is negligible, the
hooks' bookkeeping is what is timed) runs forward + backward with:
  - no hooks (the baseline, subtracted);
  - spillway.torch.offload_activations (the C++ engine through the socket's hooks);
  - torch.autograd.graph.save_on_cpu (torch's own: copies to CPU tensors);
  - a Python-only offload (pack: a copy into a new tensor; unpack: it back).
Prints the median per-tensor cost of each over the baseline, in microseconds, and the
ratio of spillway's to each peer's. Target (the issue): under 10 us per tensor.

  PYTHONPATH=build/python python bench/torch/bench_hooks.py [--layers 16 --ops 64 --repeats 15]
"""

from __future__ import annotations

import argparse
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


def timed(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up (and the sizing of pools)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ops", type=int, default=64)
    ap.add_argument("--elements", type=int, default=256, help="floats per saved tensor")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = Model(a.layers, a.ops)
    x = torch.randn(a.elements, requires_grad=True)
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
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            model(x).backward()

    def pack(t: torch.Tensor) -> Any:
        return t.detach().clone()

    def unpack(c: torch.Tensor) -> torch.Tensor:
        return c.clone()

    def python_only() -> None:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            model(x).backward()

    base = timed(plain, a.repeats)
    rows = [
        ("spillway offload_activations", timed(spillway_step, a.repeats)),
        ("torch save_on_cpu", timed(save_on_cpu, a.repeats)),
        ("python-only pack/unpack", timed(python_only, a.repeats)),
    ]
    saved = offload.last_report()["tensors_offloaded"]  # sin()'s inputs and x * scale's
    print(
        f"{saved} saved tensors of {a.elements * 4} bytes per step; baseline (no hooks) "
        f"{base * 1e3:.2f} ms per step"
    )
    per = {name: (t - base) / saved * 1e6 for name, t in rows}
    for name, us in per.items():
        print(f"  {name:32s} {us:7.2f} us per tensor over the baseline")
    ours = per["spillway offload_activations"]
    for name, us in per.items():
        if name.startswith("spillway"):
            continue
        print(f"  spillway / {name}: {ours / us:.2f}x the cost")
    print(f"  target: < 10 us per tensor: {'met' if ours < 10 else 'NOT met'}")


if __name__ == "__main__":
    main()

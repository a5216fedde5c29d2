"""CPU cost per block of spillway.torch.stream_weights' hooks (issue 16), against the same
model resident, same run (docs/PERFORMANCE.md); then training steps against the same
blocks under torch.utils.checkpoint (which recomputes in backward as streamed training does).

A stack of small blocks (a Linear each, 16 KiB of weights) on CPU under no_grad: the copies
are negligible at that size and the host backend's link is unthrottled, so what is timed
is the hooks' work per block: the two custom ops (dispatcher, Python), the streamer's
acquire/release and the host backend's stream operations. Medians of repeated passes.

  PYTHONPATH=build/python python bench/torch/bench_stream_hooks.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import spillway.torch as st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    resident = nn.Sequential(*[nn.Linear(a.width, a.width) for _ in range(a.blocks)])
    streamed = copy.deepcopy(resident)
    handle = st.stream_weights(streamed, depth=2, layers=list(streamed))
    x = torch.randn(4, a.width)

    def timed(model: nn.Module) -> float:
        times = []
        with torch.no_grad():
            model(x)
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                model(x)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    base, ours = [], []
    for _ in range(3):  # interleaved: the machine drifts
        base.append(timed(resident))
        ours.append(timed(streamed))
    with torch.no_grad():
        assert torch.equal(resident(x), streamed(x)), "the streamed blocks computed other bits"
    b, o = statistics.median(base), statistics.median(ours)
    per = (o - b) / a.blocks * 1e6
    rep = handle.report()
    print(
        f"{a.blocks} blocks of {a.width * a.width * 4 // 1024} KiB, batch 4, one thread: "
        f"resident {b * 1e3:.2f} ms per pass, streamed {o * 1e3:.2f} ms"
    )
    print(f"  stream_weights hooks: {per:.1f} us per block over the resident pass")
    print(f"  ({rep['loads']} loads, {rep['hits']} hits, copy stream {rep['gbps']:.2f} GB/s)")
    training(a, resident, x)


class _Checkpointed(nn.Module):
    """A block recomputed in backward by torch.utils.checkpoint (the baseline that also
    recomputes, as streamed training does)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return out


def training(a: argparse.Namespace, resident: nn.Module, x: torch.Tensor) -> None:
    """Training steps (forward, backward): streamed with training=True (each block re-streamed
    and recomputed in backward) against the same blocks under torch.utils.checkpoint, which
    recompute the same way, and against plain resident blocks."""
    plain = copy.deepcopy(resident)
    ckpt = nn.Sequential(*[_Checkpointed(b) for b in copy.deepcopy(resident)])
    streamed = copy.deepcopy(resident)
    handle = st.stream_weights(streamed, depth=2, layers=list(streamed), training=True)
    xg = x.clone().requires_grad_(True)

    def timed(model: nn.Module) -> float:
        times = []
        for i in range(a.repeats + 1):
            t0 = time.perf_counter()
            model(xg).sum().backward()
            if i > 0:
                times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        return statistics.median(times)

    t: dict[str, list[float]] = {"plain": [], "ckpt": [], "streamed": []}
    for _ in range(3):
        t["plain"].append(timed(plain))
        t["ckpt"].append(timed(ckpt))
        t["streamed"].append(timed(streamed))
    p, c, s = (statistics.median(t[k]) for k in ("plain", "ckpt", "streamed"))
    grads = [q.grad for q in streamed.parameters()]
    assert all(g is None for g in grads), "zero_grad left gradients"
    streamed(xg).sum().backward()
    plain(xg).sum().backward()
    for q, r in zip(streamed.parameters(), plain.parameters()):
        assert q.grad is not None and r.grad is not None and torch.equal(q.grad, r.grad)
    print(
        f"training step (forward + backward): resident {p * 1e3:.2f} ms, checkpointed "
        f"{c * 1e3:.2f} ms, streamed {s * 1e3:.2f} ms"
    )
    print(
        f"  stream_weights(training=True): {(s - c) / a.blocks * 1e6:.1f} us per block over "
        f"torch.utils.checkpoint, {(s - p) / a.blocks * 1e6:.1f} us over resident "
        f"({handle.report()['visits']} visits)"
    )


if __name__ == "__main__":
    main()

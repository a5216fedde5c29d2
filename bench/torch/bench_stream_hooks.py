"""CPU cost per block of spillway.torch.stream_weights' hooks, against the same
model resident, same run (docs/PERFORMANCE.md); then training steps against the same
blocks under torch.utils.checkpoint (which recomputes in backward as streamed training does).

A stack of small blocks (a Linear each, 16 KiB of weights) on CPU under no_grad: the copies
are negligible at that size and the host backend's link is unthrottled, so what is timed
is the hooks' work per block: the two custom ops (dispatcher, Python), the streamer's
acquire/release and the host backend's stream operations. Medians of repeated passes.

With --device cuda the blocks run on the GPU and their weights stream from pinned host
memory over the real link: a pass then costs at least the model's bytes over the link,
which is measured in the same run (a pinned host-to-device copy of one block's size), and
the report gives the streamed pass against that limit and against the resident pass
(e.g. --blocks 24 --width 8192 --dtype bfloat16: 1.6 B parameters).

  PYTHONPATH=build/python python bench/torch/bench_stream_hooks.py
  PYTHONPATH=build/python python bench/torch/bench_stream_hooks.py --device cuda \
      --dtype bfloat16 --blocks 24 --width 8192 --batch 8 --repeats 5 --no-training
"""

from __future__ import annotations

import argparse
import copy
import json
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
    ap.add_argument("--batch", type=int, default=4, help="rows of the input")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--no-training", action="store_true", help="inference passes only")
    ap.add_argument("--json", help="write the figures as JSON to this file")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_stream_hooks: --device cuda: torch sees no CUDA device")
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    resident = nn.Sequential(
        *[nn.Linear(a.width, a.width, device=device, dtype=dtype) for _ in range(a.blocks)]
    )
    streamed = copy.deepcopy(resident)
    handle = st.stream_weights(streamed, depth=2, layers=list(streamed))
    x = torch.randn(a.batch, a.width, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(model: nn.Module) -> float:
        times = []
        with torch.no_grad():
            model(x)
            sync()
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                model(x)
                sync()
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
    block_bytes = sum(p.numel() * p.element_size() for p in resident[0].parameters())
    model_bytes = block_bytes * a.blocks
    figures: dict[str, object] = {
        "schema": "spillway.bench-stream-hooks/1",
        "device": a.device,
        "dtype": a.dtype,
        "blocks": a.blocks,
        "parameters": sum(p.numel() for p in resident.parameters()),
        "model_bytes": model_bytes,
        "resident_ms": b * 1e3,
        "streamed_ms": o * 1e3,
        "ratio": o / b,
        "us_per_block": per,
        "copy_gbps": rep["gbps"],
    }
    print(
        f"{a.blocks} blocks of {block_bytes / 2**20:.1f} MiB ({a.dtype}, {a.device}), batch "
        f"{a.batch}, one thread: resident {b * 1e3:.2f} ms per pass, streamed {o * 1e3:.2f} ms "
        f"({o / b:.2f}x)"
    )
    print(f"  stream_weights hooks: {per:.1f} us per block over the resident pass")
    print(f"  ({rep['loads']} loads, {rep['hits']} hits, copy stream {rep['gbps']:.2f} GB/s)")
    if device.type == "cuda":
        link = link_gbps(block_bytes, device)
        limit_ms = model_bytes / (link * 1e6)
        figures.update({"link_gbps": link, "link_limit_ms": limit_ms})
        print(
            f"  the link, same run: {link:.1f} GB/s pinned host to device; the model's "
            f"{model_bytes / 1e9:.2f} GB take {limit_ms:.2f} ms: streamed pass at "
            f"{limit_ms / (o * 1e3):.2f} of the link's limit"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=2)
    if not a.no_training:
        training(a, resident, x)


def link_gbps(nbytes: int, device: torch.device) -> float:
    """Pinned host-to-device copies of nbytes, the median of 5 (the limit a streamed pass
    is held to)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


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
            if xg.is_cuda:
                torch.cuda.synchronize(xg.device)
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

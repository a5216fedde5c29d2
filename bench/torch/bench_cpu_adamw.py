"""CPUAdamW.step against torch.optim.AdamW (foreach and fused, on CPU) and DeepSpeed's
DeepSpeedCPUAdam on the same parameters, in the same run, 1 and 2 threads, beside the
memory-bandwidth limit (docs/PERFORMANCE.md). Targets (issue 15): >= 5x torch, >= 1.15x
DeepSpeed.

Every optimizer steps the same fp32 parameters (--elements in tensors of --tensor) from the
same gradients. Two figures for CPUAdamW:
  - its whole CPU work per step (the gradients are set, step() hands them over, the
    speculative steps run, step() validates and writes the weights): what the CPU spends;
  - its critical path: step() after the gradients were handed over and speculated during
    backward (here: handed over and waited for, as a backward long enough to hide them
    would), i.e. what a training step waits for after backward. Peers have no overlap:
    their whole step is on the critical path. Also with the clip transformers.Trainer runs
    every step (torch.nn.utils.clip_grad_norm_ under its bound), recognised (Note [Clips the
    speculation saw]) and not (recognize_clip=False: the speculation is redone, as before).
The limit: AdamW reads p, g, m, v and writes p, m, v: 28 bytes per element at the in-place
stream bandwidth measured here (a += b on two large tensors: 12 bytes per element).

  PYTHONPATH=build/python python bench/torch/bench_cpu_adamw.py [--elements 33554432]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

import spillway.torch as st


def timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_params(n: int, size: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    out = []
    left = n
    while left > 0:
        k = min(size, left)
        p = torch.nn.Parameter(torch.randn(k, generator=g))
        p.grad = torch.randn(k, generator=g) * 1e-2
        out.append(p)
        left -= k
    return out


def critical_path(
    opt: st.CPUAdamW, ps: list[torch.nn.Parameter], repeats: int, clip: bool = False
) -> float:
    """step() after backward handed every gradient over and the speculation finished
    (``clip``: after the Trainer's clip_grad_norm_, under its bound)."""

    def after_backward() -> float:
        for i, p in enumerate(ps):  # what the post-accumulate-grad hooks do in backward
            opt._hand_over(i, p)
        opt._core.sum_of_squares()  # the speculative steps are done: backward hid them
        t0 = time.perf_counter()
        if clip:
            torch.nn.utils.clip_grad_norm_(ps, 1e9)
        opt.step()
        return time.perf_counter() - t0

    after_backward()
    return statistics.median(after_backward() for _ in range(repeats))


def stream_gbps(n: int) -> float:
    """a += b over two arrays: 12 bytes per element (read a, b; write a in place, no
    write-allocate read), the access pattern of AdamW's in-place streams."""
    a = torch.randn(n)
    b = torch.randn(n)
    t = timed(lambda: a.add_(b), 5)
    return 12 * n / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 25)
    ap.add_argument("--tensor", type=int, default=1 << 21, help="elements per parameter")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--no-deepspeed", action="store_true")
    a = ap.parse_args()
    ds: Any = None
    if not a.no_deepspeed:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            ds = DeepSpeedCPUAdam
        except ImportError as e:
            print(f"DeepSpeed is not installed ({e}); `make bench-torch` installs it")
    n = a.elements
    print(f"{n} fp32 elements in tensors of {a.tensor}; median of {a.repeats} steps")
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        gbps = stream_gbps(n)
        limit = 28 * n / (gbps * 1e9)
        rows: list[tuple[str, float]] = []
        ps = make_params(n, a.tensor)
        opt = st.CPUAdamW(ps, lr=1e-3, weight_decay=0.01, threads=threads)

        # .grad stays set: each step() hands it over and steps it again
        rows.append(("spillway CPUAdamW", timed(opt.step, a.repeats)))

        critical = critical_path(opt, ps, a.repeats)
        clipped = critical_path(opt, ps, a.repeats, clip=True)
        del opt
        opt = st.CPUAdamW(ps, lr=1e-3, weight_decay=0.01, threads=threads, recognize_clip=False)
        unrecognised = critical_path(opt, ps, a.repeats, clip=True)
        del opt
        # Note [Early weights]: the weights written during backward, step() only validates.
        opt = st.CPUAdamW(ps, lr=1e-3, weight_decay=0.01, threads=threads, early_weights=True)
        early = critical_path(opt, ps, a.repeats)
        del opt, ps
        for name, kw in (
            ("torch AdamW foreach", {"foreach": True}),
            ("torch AdamW fused", {"fused": True}),
        ):
            ps = make_params(n, a.tensor)
            topt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw)
            rows.append((name, timed(topt.step, a.repeats)))
            del topt, ps
        if ds is not None:
            ps = make_params(n, a.tensor)
            dopt = ds(ps, lr=1e-3, weight_decay=0.01, adamw_mode=True)
            rows.append(("DeepSpeedCPUAdam", timed(dopt.step, a.repeats)))
            del dopt, ps
        ours_t = rows[0][1]
        print(
            f"threads {threads}: in-place stream bandwidth {gbps:.1f} GB/s, limit "
            f"(28 B/element) {limit * 1e3:.1f} ms"
        )
        print(
            f"  {'spillway CPUAdamW':22s} {ours_t * 1e3:8.1f} ms whole CPU work "
            f"({limit / ours_t:.2f} of the limit); {critical * 1e3:.1f} ms on the critical "
            f"path after backward, {early * 1e3:.1f} ms with early_weights"
        )
        print(
            f"  {'':22s} with the Trainer's clip_grad_norm_ (under its bound) before step(): "
            f"{clipped * 1e3:.1f} ms on the critical path; {unrecognised * 1e3:.1f} ms with "
            f"recognize_clip=False (the speculation redone): {unrecognised / clipped:.1f}x"
        )
        for name, t in rows[1:]:
            print(
                f"  {name:22s} {t * 1e3:8.1f} ms  ({limit / t:.2f} of the limit)   spillway "
                f"is {t / ours_t:.2f}x faster in CPU work, {t / critical:.1f}x on the "
                f"critical path ({t / early:.0f}x with early_weights)"
            )


if __name__ == "__main__":
    main()

"""CPUAdamW.step against DeepSpeed's DeepSpeedCPUAdam and torch.optim.AdamW (fused and
foreach, on CPU) on the same parameters, in the same run, runs interleaved, medians, beside
the memory-bandwidth limit (docs/PERFORMANCE.md). Targets: whole CPU work >= 1.15x
DeepSpeed's, with and without clipping; critical path >= 3x.

Every optimizer steps its own copy of the same fp32 parameters from the same gradients
(``--shape``: flat tensors of ``--tensor`` elements, or a Llama's 147 tensors). Figures:
  - whole CPU work per step: for CPUAdamW, step() with every gradient set and none handed
    over (it hands them over, the speculative steps run, it validates and writes the
    weights): what the CPU spends; for the peers, their step() (after torch's
    ``clip_grad_norm_`` with ``--clip``: DeepSpeed and torch clip that way);
  - CPUAdamW's critical path: step() after backward handed every gradient over and the
    speculation finished (as a backward long enough to hide it would), i.e. what a training
    step waits for after backward; with ``early_weights`` too. Peers have no overlap: their
    whole step is on the critical path.
With ``--clip C`` CPUAdamW runs with ``max_grad_norm=C`` (the gradients' norm is far above 1,
so every step clips). CPUAdamW runs twice, plain and with ``share_weights=True`` (the
parameters' storage is its master weights: no weight copy, commits swap buffers).
The limit: AdamW reads p, g, m, v and writes p, m, v: 28 bytes per element at the in-place
stream bandwidth measured here (a += b on two large tensors: 12 bytes per element).

  PYTHONPATH=build/python python bench/torch/bench_cpu_adamw.py [--shape llama-258m] [--clip 1]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Callable, Optional

import torch

import spillway.torch as st

# A Llama of 258M parameters: hidden 1024, 16 layers, MLP 2560, vocabulary 32000, untied
# head: 16 x 9 tensors per layer + embedding, final norm, head = 147 tensors.
LLAMA_258M = (1024, 16, 2560, 32000)


def llama_shapes(hidden: int, layers: int, mlp: int, vocab: int) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        out += [(hidden, hidden)] * 4 + [(mlp, hidden)] * 2 + [(hidden, mlp)]
        out += [(hidden,), (hidden,)]
    return out + [(hidden,), (vocab, hidden)]


def flat_shapes(n: int, size: int) -> list[tuple[int, ...]]:
    return [(min(size, n - at),) for at in range(0, n, size)]


def make_params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    out = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g))
        p.grad = torch.randn(s, generator=g) * 1e-2
        out.append(p)
    return out


def clipped(
    step: Callable[[], Any], ps: list[torch.nn.Parameter], clip: Optional[float]
) -> Callable[[], Any]:
    if clip is None:
        return step

    def run() -> None:
        torch.nn.utils.clip_grad_norm_(ps, clip)
        step()

    return run


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each, one call of each per round, after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def critical_path(
    opt: st.CPUAdamW, ps: list[torch.nn.Parameter], repeats: int, trainer_clip: bool = False
) -> float:
    """step() after backward handed every gradient over and the speculation finished
    (``trainer_clip``: after the Trainer's clip_grad_norm_, under its bound)."""

    def after_backward() -> float:
        for i, p in enumerate(ps):  # what the post-accumulate-grad hooks do in backward
            opt._hand_over(i, p)
        opt._core.sum_of_squares()  # the speculative steps are done: backward hid them
        t0 = time.perf_counter()
        if trainer_clip:
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
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - t0)
    return 12 * n / statistics.median(times[1:]) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["flat", "llama-258m"], default="flat")
    ap.add_argument("--elements", type=int, default=1 << 25, help="flat: elements in all")
    ap.add_argument("--tensor", type=int, default=1 << 21, help="flat: elements per parameter")
    ap.add_argument("--clip", type=float, default=None, help="max_grad_norm / clip_grad_norm_")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", default="2")
    ap.add_argument("--torch", action="store_true", help="also torch AdamW fused and foreach")
    ap.add_argument("--no-deepspeed", action="store_true")
    a = ap.parse_args()
    ds: Any = None
    if not a.no_deepspeed:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            ds = DeepSpeedCPUAdam
        except ImportError as e:
            print(f"DeepSpeed is not installed ({e}); `make bench-torch` installs it")
    shapes = (
        llama_shapes(*LLAMA_258M) if a.shape == "llama-258m" else flat_shapes(a.elements, a.tensor)
    )
    n = sum(torch.Size(s).numel() for s in shapes)
    clip = "" if a.clip is None else f", clipped at {a.clip}"
    print(f"{n} fp32 elements in {len(shapes)} tensors ({a.shape}{clip}); median of {a.repeats}")
    kw = {"lr": 1e-3, "weight_decay": 0.01}
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        gbps = stream_gbps(min(n, 1 << 26))
        limit = 28 * n / (gbps * 1e9)
        fns: dict[str, Callable[[], Any]] = {}
        keep: list[Any] = []
        ours_names = ("spillway CPUAdamW", "spillway share_weights")
        ps = make_params(shapes)
        ours = st.CPUAdamW(ps, threads=threads, max_grad_norm=a.clip, recognize_clip=True, **kw)
        fns["spillway CPUAdamW"] = ours.step  # .grad stays set: each step() hands it over
        sps = make_params(shapes)
        shared = st.CPUAdamW(sps, threads=threads, max_grad_norm=a.clip, share_weights=True, **kw)
        fns["spillway share_weights"] = shared.step
        if ds is not None:
            dps = make_params(shapes)
            dopt = ds(dps, adamw_mode=True, **kw)
            fns["DeepSpeedCPUAdam"] = clipped(dopt.step, dps, a.clip)
            keep += [dps, dopt]
        if a.torch:
            for name, extra in (
                ("torch AdamW fused", {"fused": True}),
                ("torch AdamW foreach", {"foreach": True}),
            ):
                tps = make_params(shapes)
                topt = torch.optim.AdamW(tps, **kw, **extra)
                fns[name] = clipped(topt.step, tps, a.clip)
                keep += [tps, topt]
        whole = interleaved(fns, a.repeats)
        del keep, fns
        gc.collect()
        critical = critical_path(ours, ps, a.repeats)
        shared_critical = critical_path(shared, sps, a.repeats)
        del shared, sps
        gc.collect()
        trainer = critical_path(ours, ps, a.repeats, trainer_clip=True)
        del ours
        gc.collect()
        # Note [Clips the speculation saw]: without the recognition the clip discards it.
        plain = st.CPUAdamW(ps, threads=threads, max_grad_norm=a.clip, recognize_clip=False, **kw)
        unrecognised = critical_path(plain, ps, a.repeats, trainer_clip=True)
        del plain
        early_opt = st.CPUAdamW(ps, threads=threads, max_grad_norm=a.clip, early_weights=True, **kw)
        early = critical_path(early_opt, ps, a.repeats)
        del early_opt, ps
        gc.collect()
        ours_t = whole["spillway CPUAdamW"]
        shared_t = whole["spillway share_weights"]
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
            f"{trainer * 1e3:.1f} ms on the critical path; {unrecognised * 1e3:.1f} ms with "
            f"recognize_clip=False (the speculation redone): {unrecognised / trainer:.1f}x"
        )
        print(
            f"  {'spillway share_weights':22s} {shared_t * 1e3:8.1f} ms whole CPU work "
            f"({limit / shared_t:.2f} of the limit); {shared_critical * 1e3:.1f} ms on the "
            "critical path after backward"
        )
        for name, t in whole.items():
            if name in ours_names:
                continue
            print(
                f"  {name:22s} {t * 1e3:8.1f} ms  ({limit / t:.2f} of the limit)   spillway "
                f"is {t / ours_t:.2f}x faster in CPU work ({t / shared_t:.2f}x with "
                f"share_weights), {t / critical:.1f}x on the critical path ({t / early:.0f}x "
                f"with early_weights, {t / shared_critical:.0f}x with share_weights)"
            )


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The train-e2e stage of scripts/gpu-check.sh reads bench/torch/bench_train.py's --json with
this.

Usage: gpu_check_train.py BENCH_TRAIN_JSON

Prints the run's figures as NAME<TAB>VALUE lines (per policy: tokens/s, step time, peak and
the peak above the weights, gradients and optimizer state, each beside the planner's
prediction, the ratios to full checkpointing; the checks), then one
line without a tab: the verdict. Exits 0 when the file (schema spillway.bench-train/1) has
rows, is complete (written at the run's end, not after a row of a run cut short) and every
check passed; else 1, the verdict naming the policies whose checks failed.
Tested on recorded runs: tests/scripts/gpu_check_train_test.sh.
"""

import json
import sys


def size(n):
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def ms(x):
    return "-" if x is None else f"{x:.1f} ms"


def main(argv):
    if len(argv) != 2:
        print("usage: gpu_check_train.py BENCH_TRAIN_JSON")
        return 2
    path = argv[1]
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        print(f"bench_train JSON {path} unreadable: {e}")
        return 1
    if d.get("schema") != "spillway.bench-train/1":
        print(f"bench_train JSON schema {d.get('schema')!r}, want 'spillway.bench-train/1'")
        return 1
    model = d.get("model", "?") + (" (tiny)" if d.get("tiny") else "")
    tag = f"train {model}"
    machine = d.get("machine") or {}
    print(
        f"{tag} workload\t{d.get('layers')} layers, micro-batch {d.get('micro_batch')} x seq "
        f"{d.get('seq_len')}, {d.get('dtype')}, {machine.get('where', '?')}"
        + (f", capped at {d['hbm_gb']:g} GiB" if d.get("hbm_gb") else "")
    )
    print(f"{tag} planner\t{d.get('hardware')}; {d.get('profile')}")
    rows = d.get("rows") or []
    for r in rows:
        p = r.get("predicted") or {}
        if r.get("status") != "ok":
            print(f"{tag} {r.get('policy')}\t{r.get('status')}: {r.get('note') or ''}".rstrip())
            continue
        vs = r.get("vs_checkpoint") or {}
        ratio = (
            f"; x{vs['tokens_per_s']:.2f} tokens/s, x{vs['peak']:.2f} peak of checkpoint"
            if vs
            else ""
        )
        print(
            f"{tag} {r.get('policy')}\t{r.get('tokens_per_s', 0):.0f} tokens/s, "
            f"{ms(r.get('step_ms'))} (predicted {ms(p.get('step_ms'))}), peak "
            f"{size(r.get('peak_bytes'))} (predicted {size(p.get('peak_bytes'))}), above the "
            f"weights, gradients and optimizer state {size(r.get('above_state_bytes'))} "
            f"(predicted {size(p.get('above_state_bytes'))}){ratio}"
        )
    checks = d.get("checks") or []
    passed = [c for c in checks if c.get("passed")]
    failed = [c for c in checks if not c.get("passed")]
    print(f"{tag} checks\t{len(passed)} passed, {len(failed)} failed")
    for c in failed:
        print(f"{tag} FAIL {c.get('policy')}\t{c.get('name')}: {c.get('detail')}")
    if not rows:
        print(f"{tag}: no rows")
        return 1
    if d.get("complete") is False:
        print(f"{tag}: cut short after {len(rows)} rows ({len(failed)} checks failed so far)")
        return 1
    if failed or not d.get("passed"):
        names = sorted({str(c.get("policy")) for c in failed}) or ["(the run says so)"]
        print(f"{tag}: checks failed for {', '.join(names)}")
        return 1
    ok = sum(1 for r in rows if r.get("status") == "ok")
    print(f"{tag}: {ok} of {len(rows)} rows trained, {len(checks)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

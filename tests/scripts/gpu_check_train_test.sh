#!/usr/bin/env bash
# The train-e2e stage's reading of bench/torch/bench_train.py --json (scripts/gpu_check_train.py,
# run by scripts/gpu-check.sh), on recorded runs: bench-train-cpu-tiny-llama.json and
# bench-train-cpu-tiny-qwen3.json are `bench_train.py --device cpu --tiny --model M --json F`
# on this project's 2-core machine (no GPU); the Qwen3 run's selective check failed there (the
# router's in-place normalization replayed), so it stands for a failing run.
# Usage: gpu_check_train_test.sh SOURCE_DIR PYTHON
set -uo pipefail
root=$1
python=${2:-python3}
check=$root/scripts/gpu_check_train.py
data=$root/tests/scripts/data
fail() { echo "FAIL: $*"; exit 1; }

out=$("$python" "$check" "$data/bench-train-cpu-tiny-llama.json")
rc=$?
echo "$out"
[ $rc -eq 0 ] || fail "the passing run did not pass (exit $rc)"
tag="train llama-3.1-8b (tiny)"
grep -q "^$tag workload"$'\t'"2 layers, micro-batch 2 x seq 64, fp32, CPU" <<<"$out" ||
  fail "no workload figure"
tag_re="train llama-3\\.1-8b \\(tiny\\)"
for p in keep checkpoint selective save_on_cpu offload-auto offload-mlp torch-adamw cpu-adamw; do
  grep -qE "^$tag_re $p"$'\t'"[0-9]+ tokens/s, [0-9.]+ ms \(predicted [0-9.]+ ms\), peak [0-9.]+ MiB \(predicted [0-9.]+ MiB\), above the weights, gradients and optimizer state [0-9.]+ MiB \(predicted [0-9.]+ MiB\); x[0-9.]+ tokens/s, x[0-9.]+ peak of checkpoint$" <<<"$out" ||
    fail "no figure for $p"
done
grep -q "^$tag checkpoint"$'\t'".*x1.00 tokens/s, x1.00 peak of checkpoint$" <<<"$out" ||
  fail "checkpoint is not its own baseline"
grep -q "^$tag checks"$'\t'"7 passed, 0 failed$" <<<"$out" || fail "checks figure"
[ "$(tail -n 1 <<<"$out")" = "$tag: 8 of 8 rows trained, 7 checks passed" ] ||
  fail "verdict: $(tail -n 1 <<<"$out")"

out=$("$python" "$check" "$data/bench-train-cpu-tiny-qwen3.json")
[ $? -eq 1 ] || fail "the failing run passed"
tag="train qwen3-30b-a3b (tiny)"
grep -qF "$tag FAIL selective"$'\t'"first step within tolerance: max |dgrad| / max |grad| = 0.0077" <<<"$out" ||
  fail "the failed check is not named: $out"
[ "$(tail -n 1 <<<"$out")" = "$tag: checks failed for selective" ] ||
  fail "verdict: $(tail -n 1 <<<"$out")"

# A row that ran out of memory is a figure, not a failure.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" - "$data/bench-train-cpu-tiny-llama.json" "$tmp/oom.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
r = next(r for r in d["rows"] if r["policy"] == "torch-adamw")
r.update(status="OOM", note="OOM under 16 GiB; CPUAdamW trains it (2 layers)", step_ms=None,
         tokens_per_s=None, peak_bytes=None, vs_checkpoint=None)
json.dump(d, open(sys.argv[2], "w"))
PY
out=$("$python" "$check" "$tmp/oom.json") || fail "an OOM row failed the run: $out"
grep -q $'^train llama-3.1-8b (tiny) torch-adamw\tOOM: OOM under 16 GiB; CPUAdamW trains it (2 layers)$' <<<"$out" ||
  fail "no OOM figure: $out"

# A run cut short (its JSON written after a row, "complete": false) does not pass.
"$python" - "$data/bench-train-cpu-tiny-llama.json" "$tmp/cut.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d.update(complete=False, rows=d["rows"][:3])
json.dump(d, open(sys.argv[2], "w"))
PY
out=$("$python" "$check" "$tmp/cut.json")
[ $? -eq 1 ] || fail "a run cut short passed"
[ "$(tail -n 1 <<<"$out")" = "train llama-3.1-8b (tiny): cut short after 3 rows (0 checks failed so far)" ] ||
  fail "verdict: $(tail -n 1 <<<"$out")"

out=$("$python" "$check" /nonexistent.json)
[ $? -eq 1 ] || fail "a missing file passed"
grep -q '^bench_train JSON /nonexistent.json unreadable' <<<"$out" || fail "missing file: $out"
echo "ok: the train-e2e stage reads recorded runs"

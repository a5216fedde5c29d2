#!/usr/bin/env bash
# scripts/gpu-check.sh without a GPU and without --prepare (docs/gpu.md): it runs to the end,
# writes gpu-report.md and gpu-report.json, skips every stage with a reason (saying what it
# would have run), unpacks and builds nothing. Where nvidia-smi exists, --no-gpu stands in.
# Usage: gpu_check_test.sh SOURCE_DIR PYTHON
set -euo pipefail
root=$1
python=${2:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--out "$work/report" --build-dir "$work/build")
command -v nvidia-smi >/dev/null 2>&1 && args+=(--no-gpu)

rc=0
bash "$root/scripts/gpu-check.sh" "${args[@]}" >"$work/stdout" 2>&1 || rc=$?
cat "$work/stdout"
[ $rc -eq 0 ] || { echo "FAIL: gpu-check.sh exited $rc without a GPU"; exit 1; }
for f in gpu-report.md gpu-report.json; do
  [ -s "$work/report/$f" ] || { echo "FAIL: no $f in the report folder"; exit 1; }
done
[ ! -e "$work/build/CMakeCache.txt" ] || { echo "FAIL: it configured without a GPU"; exit 1; }
[ ! -e "$work/build/deps-prefix" ] || { echo "FAIL: it unpacked .gpu-deps without a GPU"; exit 1; }

"$python" - "$work/report" <<'PY'
import json, os, sys
folder = sys.argv[1]
report = json.load(open(os.path.join(folder, "gpu-report.json")))
assert report["schema"] == "spillway.gpu-check/1", report["schema"]
names = [s["name"] for s in report["stages"]]
want = ["env", "deps", "configure", "build", "doctor", "ctest-cuda", "pytest-cuda", "bench",
        "build-extra", "gpu-paths", "memcheck", "racecheck", "train-e2e", "bench-torch"]
assert names == want, f"stages {names}, want {want}"
for s in report["stages"]:
    assert s["status"] == "skip", f"{s['name']}: {s['status']} ({s['reason']})"
    assert s["reason"].strip(), f"{s['name']}: no reason"
    assert s["reason"].startswith("no GPU"), f"{s['name']}: reason {s['reason']!r}"
# What each stage would have run, where it runs a command.
for name in ["configure", "build", "doctor", "ctest-cuda", "pytest-cuda", "bench", "memcheck",
             "train-e2e", "bench-torch"]:
    cmds = next(s for s in report["stages"] if s["name"] == name)["commands"]
    assert cmds.startswith("$ "), f"{name}: no command recorded: {cmds!r}"
assert report["summary"] == {"pass": 0, "fail": 0, "timeout": 0, "skip": len(want)}, report["summary"]
md = open(os.path.join(folder, "gpu-report.md")).read()
for name in want:
    assert f"## {name}: skip" in md, f"{name} missing from gpu-report.md"
print(f"ok: {len(want)} stages skipped, each with its reason; the report is valid JSON")
PY
grep -q 'ctest-cuda .*skip' "$work/stdout" || { echo "FAIL: the stages were not printed"; exit 1; }
echo "ok: gpu-check.sh ran to the end without a GPU"

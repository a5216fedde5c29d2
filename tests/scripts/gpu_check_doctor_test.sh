#!/usr/bin/env bash
# The doctor stage's reading of `spillway doctor --json` (scripts/gpu_check_doctor.py, run
# by scripts/gpu-check.sh), on recorded reports: doctor-no-gpu.json is this command's output
# on a machine without a GPU (the CUDA backend compiled, no driver); doctor-h200-constructed
# .json is that record with the CUDA fields an H200 would fill (constructed: doctor has not
# run on a GPU yet, docs/gpu.md). Usage: gpu_check_doctor_test.sh SOURCE_DIR PYTHON
set -uo pipefail
root=$1
python=${2:-python3}
check=$root/scripts/gpu_check_doctor.py
data=$root/tests/scripts/data
fail() { echo "FAIL: $*"; exit 1; }

out=$("$python" "$check" "$data/doctor-h200-constructed.json" "NVIDIA H200")
rc=$?
echo "$out"
[ $rc -eq 0 ] || fail "the H200 report did not pass (exit $rc)"
grep -q $'^doctor cuda:0\tNVIDIA H200 (compute 9.0, 150.1 GB' <<<"$out" || fail "no cuda:0 figure"
grep -q $'^doctor path device backend\tyes: CUDA: cuda:0 NVIDIA H200$' <<<"$out" ||
  fail "no device backend figure"
[ "$(tail -n 1 <<<"$out")" = "doctor names NVIDIA H200 and runs the CUDA backend" ] ||
  fail "verdict: $(tail -n 1 <<<"$out")"

# nvidia-smi's name may be longer or shorter than the runtime's.
"$python" "$check" "$data/doctor-h200-constructed.json" "H200" >/dev/null || fail "H200 alone"
out=$("$python" "$check" "$data/doctor-h200-constructed.json" "NVIDIA H100 80GB HBM3")
[ $? -eq 1 ] || fail "another GPU's name passed"
[ "$(tail -n 1 <<<"$out")" = "doctor names NVIDIA H200, not nvidia-smi's NVIDIA H100 80GB HBM3" ] ||
  fail "verdict: $(tail -n 1 <<<"$out")"

out=$("$python" "$check" "$data/doctor-no-gpu.json" "NVIDIA H200")
[ $? -eq 1 ] || fail "the no-GPU report passed"
tail -n 1 <<<"$out" | grep -q '^doctor names no GPU: cudaGetDeviceCount: ' ||
  fail "verdict: $(tail -n 1 <<<"$out")"

out=$("$python" "$check" /nonexistent.json "NVIDIA H200")
[ $? -eq 1 ] || fail "a missing file passed"
grep -q '^doctor JSON /nonexistent.json unreadable' <<<"$out" || fail "missing file: $out"
echo "ok: the doctor stage reads recorded reports"

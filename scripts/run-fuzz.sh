#!/usr/bin/env bash
# Runs a libFuzzer binary for a bounded time over a seed corpus made from the embedded
# catalogs (data/models, data/hardware), plus the seeds the fuzzer writes itself into
# SPILLWAY_FUZZ_SEED_DIR (fuzz_plan_json: the planner's plans for its model).
# Usage: run-fuzz.sh FUZZER SECONDS
set -euo pipefail
fuzzer=$(realpath "$1")
seconds=${2:-60}
root=$(cd "$(dirname "$0")/.." && pwd)
corpus=$(mktemp -d /tmp/spillway-fuzz.XXXXXX)
trap 'rm -rf "$corpus"' EXIT
cp "$root"/data/models/*.json "$root"/data/hardware/*.json "$corpus"/
export SPILLWAY_FUZZ_SEED_DIR="$corpus"
echo "fuzz: $(basename "$fuzzer") for ${seconds}s over $(ls "$corpus" | wc -l) catalog seeds (and those it writes itself)"
"$fuzzer" -artifact_prefix="$(dirname "$fuzzer")/" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 "$corpus" 2>&1 | tail -n 15

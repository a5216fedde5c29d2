#!/usr/bin/env bash
# The CPU AdamW on 64-bit Arm (Grace's CPU: Neoverse V2, SVE2 with 128-bit vectors): the
# optimizer's SIMD sources and their bitwise tests (tests/arm) cross-built with Debian's
# aarch64 compiler and run under qemu-user, once per emulated CPU, so that Highway's
# dispatch picks each Arm target in turn and every target it compiled in is checked against
# the scalar reference to the bit.
#
#   bash scripts/arm-check.sh [BUILD_DIR]     (default: build/arm64; `make test` runs it)
#
# Runs (each a qemu-aarch64 -cpu setting):
#   sve2-128   max with 128-bit vectors (Grace's width): SVE2_128, SVE2, SVE, NEON
#   neon       cortex-a72: no SVE, NEON only
#   sve-256    max with 256-bit vectors: SVE_256 too
#   sve-512    max with 512-bit vectors: the generic SVE and SVE2 targets
# Prints the targets each run tested and, at the end, which targets were executed and which
# were compiled but never dispatched to. Exit 0: every run passed; 1: a test failed or the
# build did; 77 (a skip, with the reason): the cross compiler, qemu or an arm64 library is
# missing, or a run outlasted its timeout (an emulator too slow is not a pass).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/build/arm64}
timeout_s=${SPILLWAY_ARM_TIMEOUT:-300}

skip() {
  echo "arm-check: SKIP: $*"
  exit 77
}

command -v aarch64-linux-gnu-g++ > /dev/null ||
  skip "no aarch64-linux-gnu-g++ (bash scripts/install-deps.sh --arm, which make test runs, installs g++-aarch64-linux-gnu)"
command -v qemu-aarch64 > /dev/null || skip "no qemu-aarch64 (bash scripts/install-deps.sh --arm installs qemu-user)"
for lib in libhwy.so libgtest.a libfmt.so libnuma.so; do
  [ -e "/usr/lib/aarch64-linux-gnu/$lib" ] ||
    skip "no arm64 $lib in /usr/lib/aarch64-linux-gnu (bash scripts/install-deps.sh --arm installs the arm64 -dev packages)"
done
[ -e /lib/ld-linux-aarch64.so.1 ] || skip "no arm64 loader /lib/ld-linux-aarch64.so.1 (libc6:arm64)"

mkdir -p "$out"
echo "arm-check: building tests/arm in $out (aarch64-linux-gnu-g++ $(aarch64-linux-gnu-g++ -dumpversion))"
if [ ! -f "$out/CMakeCache.txt" ]; then
  cmake -S "$root/tests/arm" -B "$out" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$root/cmake/aarch64-linux-gnu.cmake" > "$out.configure.log" 2>&1 || {
    cat "$out.configure.log"
    echo "arm-check: FAIL: configure"
    exit 1
  }
fi
cmake --build "$out" -j "${JOBS:-$(nproc)}" > "$out.build.log" 2>&1 || {
  tail -40 "$out.build.log"
  echo "arm-check: FAIL: build"
  exit 1
}
bin="$out/spillway_arm_tests"
file "$bin" 2> /dev/null | grep -q aarch64 || echo "arm-check: note: $bin is $(file -b "$bin" 2> /dev/null)"

# The first run (Grace's vectors) runs every test; the others skip those that do not depend
# on the dispatched target (the pool's tiling, the scalar reference, the conversions).
runs=(
  "sve2-128:max,sve-default-vector-length=16"
  "neon:cortex-a72"
  "sve-256:max,sve-default-vector-length=32"
  "sve-512:max,sve-default-vector-length=64"
)
target_independent="-AdamWPool.*:AdamWScalar.*:Bf16.*:Fp16.*"
tested=""
status=0
for run in "${runs[@]}"; do
  name=${run%%:*}
  cpu=${run#*:}
  log="$out/run-$name.log"
  echo "arm-check: run $name (qemu-aarch64 -cpu $cpu)"
  set +e
  filter="*"
  [ "$name" = sve2-128 ] || filter=$target_independent
  QEMU_CPU=$cpu timeout "$timeout_s" qemu-aarch64 "$bin" --gtest_brief=1 --gtest_filter="$filter" \
    > "$log" 2>&1
  rc=$?
  set -e
  line=$(grep -m1 "best target" "$log" || true)
  echo "  ${line:-"(no target line)"}"
  tested="$tested $(echo "$line" | sed -n 's/.*testing//p')"
  if [ $rc -eq 124 ]; then
    tail -5 "$log"
    skip "run $name outlasted ${timeout_s} s under qemu (SPILLWAY_ARM_TIMEOUT raises it); not a pass"
  fi
  if [ $rc -ne 0 ]; then
    tail -30 "$log"
    echo "arm-check: FAIL: run $name exited $rc"
    status=1
  else
    echo "  $(grep -E "PASSED|tests ran" "$log" | tail -1)"
  fi
done
executed=$(echo "$tested" | tr ' ' '\n' | sed '/^$/d' | sort -u | tr '\n' ' ')
echo "arm-check: targets executed and bitwise the scalar reference: ${executed:-none}"
[ $status -eq 0 ] && echo "arm-check: ok"
exit $status

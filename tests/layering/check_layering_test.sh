#!/usr/bin/env bash
# The layering check (scripts/check_layering.py) passes on the tree and fails, naming the
# file and the rule, on each kind of forbidden include: an engine including another
# part's src/ header, plan depending on an engine, anything depending on cli, a public
# header including a src/ header, a public header outside include/spillway/<part>/.
set -euo pipefail
root="$1"
check="$root/scripts/check_layering.py"
python3 "$check" "$root" || { echo "FAIL: the tree itself violates the layering"; exit 1; }

fixture=$(mktemp -d)
trap 'rm -rf "$fixture"' EXIT
expect_violation() {  # <file> <include> <words expected in the message>
  local file="$1" inc="$2" words="$3"
  rm -rf "$fixture"/*
  mkdir -p "$fixture"/include/spillway "$fixture"/src/{core,device,memory,offload,optim,plan,nn,tool,cli}
  mkdir -p "$(dirname "$fixture/$file")"
  printf '#include "%s"\n' "$inc" > "$fixture/$file"
  local out
  if out=$(python3 "$check" "$fixture" 2>&1); then
    echo "FAIL: $file including $inc passed the check"; exit 1
  fi
  if ! grep -q "$words" <<<"$out"; then
    echo "FAIL: $file including $inc: message lacks '$words': $out"; exit 1
  fi
  echo "ok: $file including $inc is refused ($words)"
}
expect_violation src/offload/x.cpp optim/stv_internal.hpp "optim's is private"
expect_violation src/plan/x.cpp spillway/offload/offload.hpp "plan may not depend on offload"
expect_violation src/plan/x.cpp spillway/optim/optim.hpp "plan may not depend on optim"
expect_violation src/core/x.cpp spillway/device/device.hpp "core may not depend on device"
expect_violation src/offload/x.cpp cli/commands.hpp "nothing depends on cli"
expect_violation include/spillway/offload/offload.hpp offload/engine_internal.hpp "a public header includes a src/ header"
expect_violation src/device/x.cpp spillway/memory/memory.hpp "device may not depend on memory"
expect_violation src/nn/x.cpp spillway/optim/optim.hpp "nn may not depend on optim"
expect_violation src/offload/x.cpp tool/output.hpp "tool's is private"
expect_violation src/offload/x.cpp spillway/device/device_backend.hpp "only device implements it"
# A public header lives in include/spillway/<part>/: a flat one (no part folder), an include
# of one, and a folder that is no part are refused.
expect_violation include/spillway/x.hpp spillway/core/error.hpp "include/spillway/x.hpp: a public header lives in include/spillway/<part>/"
expect_violation src/offload/x.cpp spillway/memory.hpp "a public header lives in include/spillway/<part>/"
expect_violation src/offload/x.cpp spillway/nopart/x.hpp "a public header lives in include/spillway/<part>/"
# bench/ is a leaf: a src/ file including a header that lives in bench/ is refused.
rm -rf "$fixture"/*
mkdir -p "$fixture"/include/spillway "$fixture"/src/cli "$fixture"/bench
: > "$fixture/bench/bench_adam.hpp"
printf '#include "bench_adam.hpp"\n' > "$fixture/src/cli/cmd.cpp"
if out=$(python3 "$check" "$fixture" 2>&1); then
  echo "FAIL: src/cli including bench/bench_adam.hpp passed the check"; exit 1
fi
grep -q "bench/ is a leaf" <<<"$out" || { echo "FAIL: message lacks 'bench/ is a leaf': $out"; exit 1; }
echo "ok: src/cli including a bench/ header is refused (bench/ is a leaf)"
# Allowed: an engine on the public headers below it, any part on core's private headers.
rm -rf "$fixture"/*
mkdir -p "$fixture"/include/spillway "$fixture"/src/{core,offload}
printf '#include "spillway/memory/memory.hpp"\n#include "core/arena.hpp"\n#include "offload/own.hpp"\n' \
  > "$fixture/src/offload/ok.cpp"
python3 "$check" "$fixture" || { echo "FAIL: allowed includes were refused"; exit 1; }
echo "ok: allowed includes pass"
# Note [The arrows]: docs/architecture.md's list of the arrows is cmake/arrows.txt's table; a
# list that differs, or none, fails the check, naming the file and what differs.
expect_docs() {  # <docs text> <words expected in the message>
  rm -rf "$fixture"/*
  mkdir -p "$fixture"/include/spillway "$fixture"/src/core "$fixture"/docs
  printf '%s\n' "$1" > "$fixture/docs/architecture.md"
  local out
  if out=$(python3 "$check" "$fixture" 2>&1); then
    echo "FAIL: docs/architecture.md ($2) passed the check"; exit 1
  fi
  grep -q "$2" <<<"$out" || { echo "FAIL: message lacks '$2': $out"; exit 1; }
  echo "ok: docs/architecture.md is refused ($2)"
}
mark="<!-- the arrows: cmake/arrows.txt, checked by scripts/check_layering.py -->"
expect_docs "# no list" "no list of the arrows"
table=$(sed -e 's/#.*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$root/cmake/arrows.txt")
expect_docs "$mark"$'\n```text\n'"${table/plan: catalog/plan: catalog sim}"$'\n```' \
  "shown, not in the table: \['plan: catalog sim'\]"
expect_docs "$mark"$'\n```text\n'"$(grep -v '^http:' <<<"$table")"$'\n```' \
  "in the table, not shown: \['http: inference'\]"
rm -rf "$fixture"/*
mkdir -p "$fixture"/include/spillway "$fixture"/src/core "$fixture"/docs
printf '%s\n```text\n%s\n```\n' "$mark" "$table" > "$fixture/docs/architecture.md"
python3 "$check" "$fixture" || { echo "FAIL: the table itself was refused"; exit 1; }
echo "ok: docs/architecture.md showing the table passes"

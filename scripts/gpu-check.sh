#!/usr/bin/env bash
# The GPU check (docs/gpu.md): one command that builds the CUDA backend on a lent
# GPU machine, runs every CUDA path spillway has, and writes gpu-report.md and
# gpu-report.json (plus four logs and the GEMM profile) into one folder.
#
#   scripts/gpu-check.sh --prepare [--force]   where apt works (here): the Debian -dev packages
#                                              the GPU machine lacks, unpacked with dpkg -x into
#                                              a private prefix, pruned, packed into .gpu-deps/
#   scripts/gpu-check.sh [--out DIR] [...]     on the GPU machine: unpack, configure, build,
#                                              test, benchmark, report (--help for the options)
#
# Invariants: a stage never stops the stages after it; every command runs under `timeout`
# inside its stage's budget, and every stage inside the run's (--budget); the report is
# rewritten after each stage and on exit, so a run killed from outside still leaves what it
# finished. Without a GPU (no nvidia-smi, or no device) every stage is skipped and says why
# and what it would have run. Nothing is installed outside the build folder.
#
# No `set -e` (a failed command is a stage's result, not the run's end) and no `set -u` (an
# unset variable in a path only a GPU machine takes must not end the run there).
set -o pipefail

caller_dir=$PWD   # relative --out and --build-dir are the caller's
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here" || exit 2

# The packages of scripts/install-deps.sh the build needs, the runtime libraries they link,
# and what their headers include (cpp-httplib's: OpenSSL, zlib, Brotli). Debian 12's names.
DEPS_PACKAGES=(
  nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libgtest-dev libgmock-dev
  libbenchmark-dev libbenchmark1debian libnuma-dev libnuma1
  libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0
  libhwy-dev libhwy1 libcpp-httplib-dev libcpp-httplib0.11
  libssl-dev libssl3 zlib1g-dev libbrotli-dev libbrotli1
  libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2
)
# What the device machine carries: the tree and .gpu-deps together (docs/gpu.md).
readonly CARRY_LIMIT_MIB=64
readonly REPORT_RESERVE_S=8   # kept back from every stage for the last report
readonly DEFAULT_BUDGET_S=450
deps_dir=$here/.gpu-deps
deps_tar=$deps_dir/deps.tar.gz
deps_manifest=$deps_dir/MANIFEST.txt

mode=run
force=0
out=""
build_dir=$here/build-gpu
archs=${SPILLWAY_CUDA_ARCHS:-}
budget=$DEFAULT_BUDGET_S
jobs=$(nproc 2>/dev/null || echo 4)
no_gpu=0
build_without_gpu=0
hide_system_deps=0

usage() {
  cat <<'EOF'
Usage:
  scripts/gpu-check.sh --prepare [--force]
      Here, where apt works: download the Debian -dev packages the GPU machine lacks, unpack
      them with dpkg -x into a private prefix, prune it and pack it into .gpu-deps/ (ignored
      by git; carry it to the GPU machine). Checks the tree plus .gpu-deps stays under 64 MiB.
  scripts/gpu-check.sh [options]
      On the GPU machine: unpack .gpu-deps, configure with SPILLWAY_CUDA=ON for the card
      found, build the CUDA targets, run the CUDA tests, the Python CUDA tests, the
      sanitizers and the GPU benchmarks, each stage under a time budget, and write
      gpu-report.md and gpu-report.json. Without a GPU every stage says why it skipped.
Options:
  --out DIR            where the report goes (default: $OUT, else ./gpu-report)
  --build-dir DIR      the build folder (default: build-gpu)
  --arch LIST          CUDA architectures, e.g. 90 or "90;100" (default: the cards' compute
                       capability from nvidia-smi; also SPILLWAY_CUDA_ARCHS)
  --budget SECONDS     the whole run's budget, build included (default: 450); every
                       stage's own budget scales with it
  --jobs N             build jobs (default: all cores)
  --no-gpu             act as if no GPU were present
  --build-without-gpu  unpack, configure and build even without a GPU (the GPU stages skip)
  --hide-system-deps   (root) run in a private mount namespace where the system's copies of
                       the prepared packages are hidden, so that only .gpu-deps can be used
EOF
}

die() {
  echo "gpu-check: $*" >&2
  exit 1
}

while [ $# -gt 0 ]; do
  case $1 in
    --prepare) mode=prepare ;;
    --force) force=1 ;;
    --out) out=${2:?--out needs a folder}; [[ $out == /* ]] || out=$caller_dir/$out; shift ;;
    --build-dir)
      build_dir=${2:?--build-dir needs a folder}
      [[ $build_dir == /* ]] || build_dir=$caller_dir/$build_dir
      shift ;;
    --arch) archs=${2:?--arch needs a list}; shift ;;
    --budget) budget=${2:?--budget needs seconds}; shift ;;
    --jobs) jobs=${2:?--jobs needs a number}; shift ;;
    --no-gpu) no_gpu=1 ;;
    --build-without-gpu) build_without_gpu=1 ;;
    --hide-system-deps) hide_system_deps=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case $budget in '' | *[!0-9]*) die "--budget must be whole seconds, not '$budget'" ;; esac
case $jobs in '' | *[!0-9]* | 0) die "--jobs must be a positive number, not '$jobs'" ;; esac

# --- the size of what travels ----------------------------------------------------------
# The bytes of the working tree as the device machine copies it (tracked and untracked files
# that .gitignore does not ignore), estimated without git: the top-level .gitignore's
# patterns, and folders whose own .gitignore ignores everything (tool caches), are left out.
tree_bytes() {
  python3 - "$here" <<'PY'
import fnmatch, os, sys
root = sys.argv[1]
pats = []
with open(os.path.join(root, ".gitignore")) as f:
    for line in f:
        line = line.strip()
        if line and not line.startswith(("#", "!")):
            pats.append(line)
def ignored(rel, is_dir):
    for p in pats:
        if p.endswith("/") and not is_dir:
            continue
        q = p.rstrip("/")
        if q.startswith("/") or "/" in q:
            if fnmatch.fnmatch(rel, q.lstrip("/")):
                return True
        elif fnmatch.fnmatch(os.path.basename(rel), q):
            return True
    return False
def ignores_all(folder):
    gi = os.path.join(folder, ".gitignore")
    try:
        with open(gi) as f:
            return "*" in (l.strip() for l in f)
    except OSError:
        return False
total = 0
for dirpath, dirs, files in os.walk(root):
    rel_dir = os.path.relpath(dirpath, root)
    rel_dir = "" if rel_dir == "." else rel_dir + "/"
    dirs[:] = [d for d in dirs if rel_dir + d != ".git" and not ignored(rel_dir + d, True)
               and not ignores_all(os.path.join(dirpath, d))]
    for name in files:
        if not ignored(rel_dir + name, False):
            total += os.lstat(os.path.join(dirpath, name)).st_size
print(total)
PY
}

mib() { echo $((($1 + 524288) / 1048576)); }

# --- --prepare ---------------------------------------------------------------------------
# Note [The carried prefix]: Debian 12's packages, unpacked with dpkg -x (no maintainer
# scripts run, so the BLAS alternatives are made here as relative links), pruned of docs,
# man pages and the archives no CMake package names, then packed with gzip: unpacked it is
# 55 MiB (OpenBLAS alone 35 MiB), which with the tree (5 MiB) and .git would leave next to
# nothing of the 64 MiB the device machine carries. The run unpacks it into the build folder. Debian 12's libraries need
# glibc >= 2.34 and the libstdc++ of GCC >= 12: Ubuntu 22.04 and 24.04 have both.
prepare() {
  if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    die "--prepare needs apt-get and dpkg (a Debian machine)"
  fi
  local want sha
  want=$(printf '%s\n' "${DEPS_PACKAGES[@]}")
  if [ $force -eq 0 ] && [ -f "$deps_tar" ] && [ -f "$deps_manifest" ]; then
    sha=$(sha256sum "$deps_tar" | cut -d' ' -f1)
    if grep -qx "sha256 $sha" "$deps_manifest" &&
       [ "$(sed -n 's/^package \([^ ]*\) .*/\1/p' "$deps_manifest")" = "$want" ]; then
      echo "gpu-check --prepare: $deps_tar is up to date (--force to make it again)"
      check_carry_size
      return
    fi
  fi
  local sudo="" tmp
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/spillway-gpu-deps.XXXXXX") || die "mktemp failed"
  # shellcheck disable=SC2064  # the folder is known now
  trap "rm -rf '$tmp'" EXIT
  mkdir -p "$tmp/debs" "$tmp/prefix"
  chmod 755 "$tmp" "$tmp/debs"   # apt's _apt user downloads into it
  # A fresh machine's package lists are empty, and stale ones name removed versions.
  if ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then
    echo "gpu-check --prepare: apt-get update (no package lists yet)"
    $sudo apt-get update -qq || die "apt-get update failed"
  fi
  if ! (cd "$tmp/debs" && apt-get download "${DEPS_PACKAGES[@]}") >"$tmp/download.log" 2>&1; then
    echo "gpu-check --prepare: apt-get download failed once; apt-get update, then again"
    $sudo apt-get update -qq || die "apt-get update failed"
    (cd "$tmp/debs" && apt-get download "${DEPS_PACKAGES[@]}") >"$tmp/download.log" 2>&1 || {
      cat "$tmp/download.log" >&2
      die "apt-get download failed (the package names are Debian 12's: scripts/gpu-check.sh DEPS_PACKAGES)"
    }
  fi
  local manifest_packages="" p deb v
  for p in "${DEPS_PACKAGES[@]}"; do
    for deb in "$tmp/debs/${p}"_*.deb; do break; done
    [ -f "$deb" ] || die "apt-get download left no .deb for $p"
    v=$(dpkg-deb -f "$deb" Version)
    dpkg-deb -x "$deb" "$tmp/prefix" || die "dpkg-deb -x $deb failed"
    manifest_packages+="package $p $v"$'\n'
  done
  rm -rf "$tmp/debs"

  local u=$tmp/prefix/usr tri ob
  for ob in "$u"/lib/*/openblas-pthread; do break; done
  [ -d "$ob" ] || die "libopenblas0-pthread unpacked no lib/<triplet>/openblas-pthread"
  tri=$(basename "$(dirname "$ob")")
  # The links update-alternatives would have made (libopenblas-pthread-dev's postinst).
  ln -sfn openblas-pthread/libopenblas.so "$u/lib/$tri/libopenblas.so"
  ln -sfn openblas-pthread/libopenblas.so.0 "$u/lib/$tri/libopenblas.so.0"
  local h
  for h in cblas.h openblas_config.h f77blas.h; do
    ln -sfn "openblas-pthread/$h" "$u/include/$tri/$h"
  done
  # Pruning: what the build, the tests and the run never read.
  rm -rf "$u/share/doc" "$u/share/man" "$u/share/lintian" "$u/share/bug" "$u/share/doc-base" \
    "$u/share/info" "$u/share/gdb" "$u/src" "$tmp/prefix/etc"
  rm -f "$u/lib/$tri/openblas-pthread/"liblapack* "$u/lib/$tri/openblas-pthread/"libblas*
  # Static archives no CMake package names (GoogleTest's are the only form Debian ships).
  local a
  while IFS= read -r a; do
    grep -rqsF --include='*.cmake' "$(basename "$a")" "$u" || rm -f "$a"
  done < <(find "$u" -name '*.a')
  find "$u" -xtype l -delete
  find "$tmp/prefix" -type d -empty -delete
  local unpacked files
  unpacked=$(du -sb "$tmp/prefix" | cut -f1)
  files=$(find "$tmp/prefix" -type f | wc -l)

  mkdir -p "$deps_dir"
  rm -f "$deps_dir"/*.part
  tar -C "$tmp/prefix" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . |
    gzip -9n >"$deps_tar.part" || die "packing the prefix failed"
  mv "$deps_tar.part" "$deps_tar"
  sha=$(sha256sum "$deps_tar" | cut -d' ' -f1)
  {
    echo "# .gpu-deps/deps.tar.gz: a prefix of Debian 12 packages for the GPU machine's build,"
    echo "# made by scripts/gpu-check.sh --prepare (docs/gpu.md). Unpack with tar -xzf."
    echo "sha256 $sha"
    echo "triplet $tri"
    echo "unpacked_bytes $unpacked"
    echo "files $files"
    printf '%s' "$manifest_packages"
  } >"$deps_manifest"
  rm -rf "$tmp"
  trap - EXIT
  echo "gpu-check --prepare: ${#DEPS_PACKAGES[@]} packages into $deps_tar" \
    "($(mib "$(stat -c %s "$deps_tar")") MiB packed, $(mib "$unpacked") MiB and $files files unpacked)"
  check_carry_size
}

check_carry_size() {
  local tree deps total
  tree=$(tree_bytes) || die "could not measure the tree"
  deps=$(du -sb "$deps_dir" | cut -f1)
  total=$((tree + deps))
  echo "gpu-check --prepare: .gpu-deps $(mib "$deps") MiB + the tree $(mib "$tree") MiB" \
    "= $(mib "$total") MiB of the $CARRY_LIMIT_MIB MiB the device machine carries"
  if [ "$total" -ge $((CARRY_LIMIT_MIB * 1048576)) ]; then
    echo "gpu-check --prepare: TOO LARGE: the tree and .gpu-deps are $(mib "$total") MiB;" \
      "the device machine carries at most $CARRY_LIMIT_MIB MiB (remove untracked files, or prune more)" >&2
    exit 1
  fi
}

# --- --hide-system-deps ------------------------------------------------------------------
# Runs this script again in a private mount namespace whose /usr is an overlay that hides
# the files of the prepared packages installed here (and the BLAS alternatives' links), so
# a build here can only find what .gpu-deps holds, as on the GPU machine. libssl3 and
# libbrotli1 stay: cmake itself links them (and an Ubuntu image has libssl3).
hide_and_rerun() {
  [ "$(id -u)" -eq 0 ] || die "--hide-system-deps needs root (unshare and mount)"
  command -v unshare >/dev/null || die "--hide-system-deps needs unshare (util-linux)"
  local ov=$build_dir/hidden-usr p f r n=0
  rm -rf "$ov"
  mkdir -p "$ov/up" "$ov/work"
  local hide=(googletest libblas-dev libblas3 liblapack-dev liblapack3 libgfortran-12-dev)
  for p in "${DEPS_PACKAGES[@]}"; do
    case $p in libssl3 | libbrotli1) ;; *) hide+=("$p") ;; esac
  done
  while IFS= read -r f; do
    [ -f "$f" ] || [ -L "$f" ] || continue
    r=${f#/usr/}
    mkdir -p "$ov/up/$(dirname "$r")"
    [ -e "$ov/up/$r" ] || { mknod "$ov/up/$r" c 0 0 && n=$((n + 1)); }
  done < <({ for p in "${hide[@]}"; do dpkg -L "$p" 2>/dev/null; done
             find /usr -lname '/etc/alternatives/*' 2>/dev/null | grep -E 'blas|lapack'; } |
           grep '^/usr/' | sort -u)
  echo "gpu-check: hiding $n files of the system's packages (${hide[*]})"
  local args=(--build-dir "$build_dir" --budget "$budget" --jobs "$jobs")
  [ -n "$out" ] && args+=(--out "$out")
  [ -n "$archs" ] && args+=(--arch "$archs")
  [ $no_gpu -eq 1 ] && args+=(--no-gpu)
  [ $build_without_gpu -eq 1 ] && args+=(--build-without-gpu)
  # shellcheck disable=SC2016  # expanded by the inner shell
  SPILLWAY_GPU_CHECK_HIDDEN=$n exec unshare -m -- bash -c \
    'mount -t overlay overlay -o "lowerdir=/usr,upperdir=$1/up,workdir=$1/work" /usr || exit 1
     shift; exec bash "$@"' _ "$ov" "$here/scripts/gpu-check.sh" "${args[@]}"
}

if [ "$mode" = prepare ]; then
  prepare
  exit 0
fi
mkdir -p "$build_dir" || die "cannot create the build folder $build_dir"
build_dir=$(cd "$build_dir" && pwd)
if [ $hide_system_deps -eq 1 ]; then
  hide_and_rerun
fi

# --- the run -------------------------------------------------------------------------------
start=$(date +%s)
started_iso=$(date -u +%Y-%m-%dT%H:%M:%SZ)
deadline=$((start + budget))
out=${out:-${OUT:-$here/gpu-report}}
mkdir -p "$out" || die "cannot create the report folder $out"
out=$(cd "$out" && pwd)
machine_line="not looked at yet"
gpu_name=""
gpu_reason=""
work=$build_dir/gpu-check   # the stages' records and logs, copied to $out by write_report
rm -rf "$work"
mkdir -p "$work/stages" || die "cannot write under $build_dir"
for c in build tests pytest bench; do : >"$work/$c.log"; done
log() { echo "[gpu-check] $*"; }

# One stage's record: $S.{name,category,budget,cmd,log,fig}; at its end $S.md and $S.json,
# its parts of the report, which never change after.
stage_n=0
S=""
S_NAME=""
S_CAT=""
S_T0=0
S_BUDGET=0
stage_begin() {  # NAME CATEGORY MAX_SECONDS [MIN_SECONDS]; false when no time is left
  stage_n=$((stage_n + 1))
  S=$work/stages/$(printf '%02d' "$stage_n")
  S_NAME=$1
  S_CAT=$2
  : >"$S.cmd"
  : >"$S.log"
  : >"$S.fig"
  S_T0=$(date +%s)
  local left=$((deadline - S_T0 - REPORT_RESERVE_S))
  S_BUDGET=$(($3 * budget / DEFAULT_BUDGET_S))   # the stages' budgets scale with --budget
  [ "$left" -lt "$S_BUDGET" ] && S_BUDGET=$left
  if [ "$S_BUDGET" -lt "${4:-10}" ]; then
    if [ "$left" -lt "${4:-10}" ]; then
      stage_end skip "no time left: $((left < 0 ? 0 : left)) s of the run's $budget s remain (--budget)"
    else
      stage_end skip "its budget at --budget $budget is $S_BUDGET s, under the ${4:-10} s it needs"
    fi
    return 1
  fi
  return 0
}
stage_left() { echo $((S_T0 + S_BUDGET - $(date +%s))); }
fig() { printf '%s\t%s\n' "$1" "$2" >>"$S.fig"; }
would_run() {  # the command as one line a shell takes back
  local a q line='$'
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./=:,+@%^-]+$ ]]; then
      line+=" $a"
    else
      printf -v q '%q' "$a"
      line+=" $q"
    fi
  done
  echo "$line" >>"$S.cmd"
}
# run_timed SECONDS CMD...: the command under timeout, its output in the stage's log; its
# exit status (124 or 137: it ran out of time).
run_timed() {
  local t=$1
  shift
  [ "$t" -lt 1 ] && t=1
  would_run "$@"
  # In the background and waited for, so that a signal to this script is handled at once
  # (the trap ends the command: Note [Interrupted runs]).
  timeout -k 10 "$t" "$@" >>"$S.log" 2>&1 </dev/null &
  child=$!
  wait "$child"
  local rc=$?
  child=""
  return $rc
}
child=""
status_of() {  # exit status -> pass | timeout | fail
  case $1 in 0) echo pass ;; 124 | 137) echo timeout ;; *) echo fail ;; esac
}
slurp() {  # VAR FILE: the file's text, without its last newline, no process started
  printf -v "$1" '%s' ""
  IFS= read -r -d '' "$1" 2>/dev/null <"$2"
  printf -v "$1" '%s' "${!1%$'\n'}"
}
stage_end() {  # STATUS REASON
  [ -n "$S" ] || return 0
  local status=$1 reason=$2 seconds cmds k v first=1 fence='```'
  seconds=$(($(date +%s) - S_T0))
  slurp cmds "$S.cmd"
  {
    echo "===== stage $S_NAME: $status in $seconds s (budget $S_BUDGET s): $reason"
    cat "$S.cmd" "$S.log"
    echo
  } >>"$work/$S_CAT.log"
  {
    echo
    echo "## $S_NAME: $status"
    echo
    echo "$reason"
    if [ -n "$cmds" ]; then
      printf '\n%s\n%s\n%s\n' "$fence" "$cmds" "$fence"
    fi
    if [ -s "$S.fig" ]; then
      echo
      while IFS=$'\t' read -r k v; do echo "- $k: $v"; done <"$S.fig"
    fi
    if [ "$status" = fail ] || [ "$status" = timeout ]; then
      if [ -s "$S.log" ]; then
        printf '\nLast lines of its log (%s.log):\n\n%s\n' "$S_CAT" "$fence"
        tail -n 25 "$S.log" | cut -c1-300
        echo "$fence"
      fi
    fi
  } >"$S.md"
  printf '| %s | %s | %s | %s |\n' "$S_NAME" "$status" "$seconds" "${reason//|//}" >"$S.row"
  {
    printf '    {"name": %s, "status": "%s", "seconds": %s, "budget_s": %s,\n' \
      "$(json_str "$S_NAME")" "$status" "$seconds" "$S_BUDGET"
    printf '     "reason": %s,\n     "commands": %s,\n     "figures": {' \
      "$(json_str "$reason")" "$(json_str "$cmds")"
    while IFS=$'\t' read -r k v; do
      [ $first -eq 1 ] || printf ', '
      first=0
      printf '%s: %s' "$(json_str "$k")" "$(json_str "$v")"
    done <"$S.fig"
    printf '},\n     "log": "%s.log",\n     "log_tail": %s}' "$S_CAT" \
      "$(json_str "$(tail -n 40 "$S.log" | cut -c1-400)")"
  } >"$S.json"
  echo "$status" >"$S.status"
  printf '[gpu-check] %-15s %-7s %4s s  %s\n' "$S_NAME" "$status" "$seconds" "$reason"
  S=""
  write_report
}

# --- the report ------------------------------------------------------------------------
json_str() {  # $1 as a JSON string: printable ASCII, tabs and newlines kept, the rest dropped
  printf '"'
  printf '%s' "$1" | LC_ALL=C tr -d '\000-\010\013\014\015\016-\037\177-\377' |
    LC_ALL=C sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/\t/\\t/g' |
    LC_ALL=C sed -e ':a' -e 'N' -e '$!ba' -e 's/\n/\\n/g' | tr -d '\n'
  printf '"'
}
# A copy of a log no larger than the device machine returns (16 MiB a file): its head and tail.
copy_capped() {
  local size
  size=$(stat -c %s "$1" 2>/dev/null || echo 0)
  if [ "$size" -le $((15 * 1048576)) ]; then
    cp "$1" "$2"
  else
    { head -c 1048576 "$1"; printf '\n\n[... %s bytes cut ...]\n\n' "$((size - 14 * 1048576))"
      tail -c $((13 * 1048576)) "$1"; } >"$2"
  fi
}
commit_of_tree() {  # read .git without running git; "unknown" where it is absent
  local head ref
  head=$(cat "$here/.git/HEAD" 2>/dev/null) || { echo unknown; return; }
  case $head in
    "ref: "*)
      ref=${head#ref: }
      cat "$here/.git/$ref" 2>/dev/null ||
        awk -v r="$ref" '$2 == r { print $1 }' "$here/.git/packed-refs" 2>/dev/null || echo unknown ;;
    *) echo "$head" ;;
  esac
}
tree_commit=$(commit_of_tree)
write_report() {
  local f pass=0 fail=0 skip=0 tmo=0 first=1 elapsed
  for f in "$work"/stages/*.status; do
    [ -f "$f" ] || continue
    case $(<"$f") in pass) pass=$((pass + 1)) ;; fail) fail=$((fail + 1)) ;;
      skip) skip=$((skip + 1)) ;; timeout) tmo=$((tmo + 1)) ;; esac
  done
  elapsed=$(($(date +%s) - start))
  {
    echo "# spillway GPU check"
    echo
    echo "- when: $started_iso, $elapsed s of a $budget s budget"
    echo "- machine: $machine_line"
    echo "- tree: $tree_commit (.git's HEAD where the copy has one; local changes not shown)"
    echo "- result: $pass passed, $fail failed, $tmo timed out, $skip skipped"
    echo
    echo "| stage | status | s | what it says |"
    echo "| --- | --- | --- | --- |"
    for f in "$work"/stages/*.status; do
      [ -f "$f" ] && cat "${f%.status}.row"
    done
    for f in "$work"/stages/*.status; do
      [ -f "$f" ] && cat "${f%.status}.md"
    done
  } >"$work/report.md"
  {
    printf '{\n  "schema": "spillway.gpu-check/1",\n'
    printf '  "started": "%s",\n  "seconds": %s,\n  "budget_s": %s,\n' "$started_iso" "$elapsed" "$budget"
    printf '  "gpu": %s,\n  "no_gpu_reason": %s,\n  "tree": %s,\n' "$(json_str "$gpu_name")" \
      "$(json_str "$gpu_reason")" "$(json_str "$tree_commit")"
    printf '  "summary": {"pass": %s, "fail": %s, "timeout": %s, "skip": %s},\n' "$pass" "$fail" "$tmo" "$skip"
    printf '  "stages": [\n'
    for f in "$work"/stages/*.status; do
      [ -f "$f" ] || continue
      [ $first -eq 1 ] || printf ',\n'
      first=0
      cat "${f%.status}.json"
    done
    printf '\n  ]\n}\n'
  } >"$work/report.json"
  cp "$work/report.md" "$out/gpu-report.md"
  cp "$work/report.json" "$out/gpu-report.json"
  local c
  for c in build tests pytest bench; do
    [ -s "$work/$c.log" ] && copy_capped "$work/$c.log" "$out/$c.log"
  done
  [ -s "$work/gemm-profile.json" ] && cp "$work/gemm-profile.json" "$out/gemm-profile.json"
  return 0
}
# shellcheck disable=SC2317  # run by the trap
on_exit() {
  local rc=$?
  if [ -n "$S" ]; then
    stage_end fail "interrupted (exit status $rc, or a signal) before the stage ended"
  fi
  write_report
  trap - EXIT
}
# Note [Interrupted runs]: on INT or TERM the command in flight is ended (timeout passes the
# signal on to its process group) and the stage in flight is recorded as interrupted; the
# report keeps every stage that ended. A SIGKILL leaves the report of the last stage that
# ended, since it is rewritten after each.
# shellcheck disable=SC2317  # run by the traps
on_signal() {
  [ -n "$child" ] && kill -TERM "$child" 2>/dev/null
  exit "$1"
}
trap on_exit EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

# --- the machine -------------------------------------------------------------------------
smi_list=""
if [ $no_gpu -eq 1 ]; then
  gpu_reason="--no-gpu was given"
elif ! command -v nvidia-smi >/dev/null 2>&1; then
  gpu_reason="nvidia-smi not found"
elif ! smi_list=$(timeout 30 nvidia-smi -L 2>&1); then
  gpu_reason="nvidia-smi failed: $(head -n 1 <<<"$smi_list")"
elif ! grep -q '^GPU ' <<<"$smi_list"; then
  gpu_reason="nvidia-smi lists no GPU"
fi
have_gpu=0
if [ -z "$gpu_reason" ]; then
  have_gpu=1
  gpu_name=$(timeout 30 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  machine_line="$gpu_name ($(grep -c '^GPU ' <<<"$smi_list") GPU(s)), $(nproc) cores"
else
  machine_line="no GPU ($gpu_reason), $(nproc) cores"
fi
no_gpu_why="no GPU: $gpu_reason"
do_build=$((have_gpu || build_without_gpu))
log "$machine_line; budget $budget s; report in $out"

# The tools: on PATH, else those of python3's pip packages (cmake, ninja), else CUDA's folder.
find_tools() {
  cmake_bin=$(command -v cmake || true)
  if [ -z "$cmake_bin" ]; then
    local d
    d=$(python3 -c 'import cmake, os; print(cmake.CMAKE_BIN_DIR)' 2>/dev/null) &&
      [ -x "$d/cmake" ] && cmake_bin=$d/cmake
  fi
  ctest_bin=""
  [ -n "$cmake_bin" ] && ctest_bin=$(dirname "$cmake_bin")/ctest
  [ -x "$ctest_bin" ] || ctest_bin=$(command -v ctest || true)
  generator="Unix Makefiles"
  if command -v ninja >/dev/null 2>&1; then
    generator=Ninja
  else
    local nd
    nd=$(python3 -c 'import ninja, os; print(ninja.BIN_DIR)' 2>/dev/null) &&
      [ -x "$nd/ninja" ] && PATH=$nd:$PATH && generator=Ninja
  fi
  nvcc_bin=$(command -v nvcc || true)
  if [ -z "$nvcc_bin" ]; then
    local c
    for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
      [ -x "$c" ] && { nvcc_bin=$c; break; }
    done
  fi
  sanitizer_bin=$(command -v compute-sanitizer || true)
  if [ -z "$sanitizer_bin" ] && [ -n "$nvcc_bin" ]; then
    local root
    root=$(dirname "$(dirname "$(readlink -f "$nvcc_bin")")")
    for c in "$root/bin/compute-sanitizer" "$root/compute-sanitizer/compute-sanitizer" \
      /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
      [ -x "$c" ] && { sanitizer_bin=$c; break; }
    done
  fi
}
find_tools

# The hardware profile that names this card's peak and link (spillway hardware).
hardware_profile() {
  case $gpu_name in
    *GH200*) echo gh200 ;;
    *GB200*) echo gb200 ;;
    *B200*) echo b200 ;;
    *H200*) echo h200-sxm ;;
    *H100*PCIe*) echo h100-pcie ;;
    *) echo h100-sxm ;;
  esac
}
hw=$(hardware_profile)

# --- stage: env -----------------------------------------------------------------------
stage_env() {
  stage_begin env build 40 5 || return 0
  fig cores "$(nproc)"
  fig kernel "$(uname -r)"
  fig cmake "${cmake_bin:-not found} $("${cmake_bin:-false}" --version 2>/dev/null | head -n 1 | awk '{print $3}')"
  fig generator "$generator"
  fig nvcc "${nvcc_bin:-not found} $("${nvcc_bin:-false}" --version 2>/dev/null | grep -o 'release [0-9.]*' | head -n 1)"
  fig compute-sanitizer "${sanitizer_bin:-not found}"
  fig python3 "$(command -v python3 || echo 'not found') $(python3 -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)"
  fig gcc "$(gcc -dumpfullversion 2>/dev/null || echo 'not found')"
  [ -n "$SPILLWAY_GPU_CHECK_HIDDEN" ] &&
    fig hide-system-deps "$SPILLWAY_GPU_CHECK_HIDDEN files of the system's copies hidden"
  # shellcheck disable=SC2054  # the commas are nvidia-smi's
  local q=(nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,pci.bus_id --format=csv,noheader)
  local py='import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
  if [ $have_gpu -eq 0 ]; then
    would_run "${q[@]}"
    would_run python3 -c "$py"
    stage_end skip "$no_gpu_why (this machine's tools are listed; torch is not imported)"
    return 0
  fi
  local rc=0 gpus t
  would_run "${q[@]}"
  gpus=$(timeout 20 "${q[@]}" 2>&1) || rc=$?
  echo "$gpus" >>"$S.log"
  fig gpus "$(paste -sd ';' <<<"$gpus")"
  run_timed 20 nvidia-smi
  would_run python3 -c "$py"
  t=$(timeout "$(stage_left)" python3 -c "$py" 2>&1 | tail -n 1)
  echo "$t" >>"$S.log"
  fig torch "$t"
  fig hardware-profile "$hw"
  if [ $rc -ne 0 ]; then
    stage_end "$(status_of $rc)" "nvidia-smi --query-gpu failed (exit $rc)"
  elif ! grep -q 'available True' <<<"$t"; then
    stage_end fail "torch does not see the GPU: $t"
  else
    stage_end pass "$gpus; $t"
  fi
}

# --- stage: deps ----------------------------------------------------------------------
# Sets deps_usr (empty: the system's packages) and the environment that makes the build
# and the binaries find the prefix: Note [The carried prefix].
deps_usr=""
stage_deps() {
  stage_begin deps build 60 10 || return 0
  if [ ! -f "$deps_tar" ]; then
    local none="no .gpu-deps/deps.tar.gz (scripts/gpu-check.sh --prepare makes it where apt works)"
    if [ $do_build -eq 0 ]; then
      stage_end skip "$no_gpu_why; $none"
    else
      stage_end skip "$none: the build uses the system's packages"
    fi
    return 0
  fi
  local sha want
  sha=$(sha256sum "$deps_tar" | cut -d' ' -f1)
  want=$(sed -n 's/^sha256 //p' "$deps_manifest" 2>/dev/null)
  fig packed-mib "$(mib "$(stat -c %s "$deps_tar")")"
  fig packages "$(grep -c '^package ' "$deps_manifest" 2>/dev/null)"
  # A mismatch (a broken copy, or MANIFEST.txt missing) fails the stage, but the archive is
  # still tried: what it holds may be enough for the build.
  local mismatch=""
  [ "$sha" != "$want" ] && mismatch="its sha256 is not MANIFEST.txt's (run --prepare again); "
  local dest=$build_dir/deps-prefix
  would_run tar -C "$dest" -xzf "$deps_tar"
  if [ $do_build -eq 0 ]; then
    local state="intact (its sha256 is the one MANIFEST.txt names)"
    [ -n "$mismatch" ] && state=${mismatch%; }
    stage_end skip "$no_gpu_why; .gpu-deps/deps.tar.gz: $state"
    return 0
  fi
  if [ "$(cat "$dest/.sha256" 2>/dev/null)" != "$sha" ]; then
    rm -rf "$dest"
    mkdir -p "$dest"
    local rc=0
    timeout 60 tar -C "$dest" -xzf "$deps_tar" >>"$S.log" 2>&1 || rc=$?
    if [ $rc -ne 0 ]; then
      stage_end "$(status_of $rc)" "unpacking .gpu-deps/deps.tar.gz failed (exit $rc)"
      return 0
    fi
    echo "$sha" >"$dest/.sha256"
  fi
  deps_usr=$dest/usr
  local tri
  tri=$(sed -n 's/^triplet //p' "$deps_manifest" 2>/dev/null)
  [ -n "$tri" ] || tri=x86_64-linux-gnu
  # Note [Fallback libraries]: the binaries find the prefix's libraries through their
  # RUNPATH (CMake's build tree default) and LD_LIBRARY_PATH; LD_LIBRARY_PATH gets one folder
  # of links to the prefix's shared libraries whose sonames the system lacks (ldconfig -p),
  # so a library the system has (OpenSSL, zlib, Brotli) is never shadowed by Debian's copy,
  # in python3 and torch too.
  local fb=$dest/fallback-lib sys_sonames="" lib name linked=()
  rm -rf "$fb"
  mkdir -p "$fb"
  # ldconfig's cache, less the entries whose file is gone (a stale cache, or files hidden
  # by --hide-system-deps)
  local so path
  while read -r so path; do
    [ -e "$path" ] && sys_sonames+="$so"$'\n'
  done < <(ldconfig -p 2>/dev/null | awk -F ' => ' '/x86-64/ { split($1, a, " "); print a[1], $2 }')
  while IFS= read -r lib; do
    name=$(basename "$lib")
    if [ -n "$sys_sonames" ]; then
      grep -qxF "$name" <<<"$sys_sonames" && continue
    else
      local d found=0
      for d in /lib/"$tri" /usr/lib/"$tri" /lib64 /usr/lib64 /usr/lib; do
        [ -e "$d/$name" ] && found=1
      done
      [ $found -eq 1 ] && continue
    fi
    [ -e "$fb/$name" ] && continue
    ln -sfn "$lib" "$fb/$name"
    linked+=("$name")
  done < <(find "$deps_usr/lib" \( -type f -o -type l \) -name '*.so.*' | sort)
  export LD_LIBRARY_PATH=$fb${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # Debian 12's OpenBLAS (0.3.21) predates some CPUs of these machines; Haswell's kernels
  # run on any x86-64 with AVX2 (the BLAS computes the host references, never timed here).
  [ -z "${OPENBLAS_CORETYPE:-}" ] && [ "$(uname -m)" = x86_64 ] && export OPENBLAS_CORETYPE=Haswell
  fig prefix "$dest"
  fig prefix-mib "$(mib "$(du -sb "$dest" | cut -f1)")"
  fig libraries-the-system-lacks "${linked[*]:-none}"
  fig OPENBLAS_CORETYPE "${OPENBLAS_CORETYPE:-}"
  if [ -n "$mismatch" ]; then
    stage_end fail "${mismatch}unpacked into $dest anyway; ${#linked[@]} libraries on LD_LIBRARY_PATH"
  else
    stage_end pass "unpacked into $dest; ${#linked[@]} libraries on LD_LIBRARY_PATH"
  fi
}

# --- stage: configure -------------------------------------------------------------------
configured_ok=0
python_module=0
stage_configure() {
  stage_begin configure build 90 20 || return 0
  local a=$archs
  if [ -z "$a" ] && [ $have_gpu -eq 1 ]; then
    # "9.0" -> 90, one entry per distinct card
    a=$(timeout 20 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
      tr -d ' .' | grep -E '^[0-9]+$' | sort -u | paste -sd ';')
  fi
  [ -n "$a" ] || a=90
  local inc="" py tri=""
  py=$(command -v python3 || echo python3)
  if [ -n "$deps_usr" ]; then
    tri=$(sed -n 's/^triplet //p' "$deps_manifest")
    # cblas.h, numa.h and OpenSSL's configuration headers come with no CMake target: the
    # prefix's include folders as system folders (their warnings are not ours).
    inc="-isystem $deps_usr/include/$tri -isystem $deps_usr/include"
  fi
  local cmd=("${cmake_bin:-cmake}" -S "$here" -B "$build_dir" -G "$generator"
    -DCMAKE_BUILD_TYPE=Release -DSPILLWAY_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$a"
    -DSPILLWAY_TESTS=ON -DSPILLWAY_BENCH=OFF -DSPILLWAY_PYTHON=AUTO "-DPython_EXECUTABLE=$py"
    "-DPython3_EXECUTABLE=$py")
  if [ -n "$nvcc_bin" ]; then
    cmd+=("-DCMAKE_CUDA_COMPILER=$nvcc_bin")
    # The toolkit of that nvcc, and its NCCL: CMake 4 may take another root for the toolkit
    # (a /usr/local/bin/nvcc wrapper makes it /usr/local) and then miss libnccl. Named only
    # where the folder has what CMake will look for.
    local root libdir
    root=$(dirname "$(dirname "$(readlink -f "$nvcc_bin")")")
    for libdir in "$root/lib64" "$root/lib"; do
      [ -e "$libdir/libcudart.so" ] && break
    done
    if [ -e "$root/include/cuda_runtime.h" ] && [ -e "$libdir/libcudart.so" ]; then
      cmd+=("-DCUDAToolkit_ROOT=$root")
      if [ -e "$root/include/nccl.h" ] && [ -e "$libdir/libnccl.so" ]; then
        cmd+=("-DSPILLWAY_NCCL_INCLUDE=$root/include" "-DSPILLWAY_NCCL_LIBRARY=$libdir/libnccl.so")
      fi
    fi
  fi
  [ -n "$deps_usr" ] && cmd+=("-DCMAKE_PREFIX_PATH=$deps_usr" "-DCMAKE_CXX_FLAGS=$inc" "-DCMAKE_CUDA_FLAGS=$inc")
  if [ $do_build -eq 0 ]; then
    would_run "${cmd[@]}"
    stage_end skip "$no_gpu_why (the CUDA architectures come from nvidia-smi's compute capability, or --arch)"
    return 0
  fi
  if [ -z "$cmake_bin" ]; then
    stage_end fail "no cmake on PATH or in python3's packages"
    return 0
  fi
  if [ -z "$nvcc_bin" ]; then
    stage_end fail "no nvcc on PATH or under /usr/local/cuda*/bin"
    return 0
  fi
  # A configure of another generator or another prefix cannot be reused: CMake keeps what
  # it found (fmt_DIR, NUMA_LIBRARY, ...) in its cache.
  local cache=$build_dir/CMakeCache.txt
  if [ -f "$cache" ] && { ! grep -qx "CMAKE_GENERATOR:INTERNAL=$generator" "$cache" ||
     [ "$(sed -n 's/^CMAKE_PREFIX_PATH:[A-Z]*=//p' "$cache")" != "$deps_usr" ]; }; then
    rm -rf "$cache" "$build_dir/CMakeFiles"
  fi
  local rc=0
  # CMake 4 refuses a package that still declares compatibility with CMake < 3.5.
  CMAKE_POLICY_VERSION_MINIMUM=3.5 run_timed "$(stage_left)" "${cmd[@]}" || rc=$?
  fig cuda-architectures "$a"
  if grep -q 'spillway: Python module ON' "$S.log"; then
    python_module=1
    fig python-module "on ($py)"
  else
    fig python-module "off: $(grep -m1 -E 'Python module|nanobind' "$S.log" || echo 'no Python with nanobind and its headers')"
  fi
  fig nccl "$(grep -m1 -oE 'NCCL (not found|/[^ ]+)' "$S.log" || echo unknown)"
  if [ -n "$deps_usr" ] && [ -f "$build_dir/CMakeCache.txt" ]; then
    # Which copy of each dependency the configure took: the prefix's, or the system's.
    local k v used=0 other=()
    for k in fmt_DIR GTest_DIR hwy_DIR nlohmann_json_DIR CLI11_DIR NUMA_LIBRARY OPENBLAS_LIBRARY \
      HTTPLIB_LIBRARY HTTPLIB_INCLUDE_DIR; do
      v=$(grep -m1 "^$k:" "$build_dir/CMakeCache.txt" | cut -d= -f2-)
      case $v in "$deps_usr"/*) used=$((used + 1)) ;; *) other+=("$k=${v:-unset}") ;; esac
    done
    fig from-prefix "$used of 9${other[*]:+; elsewhere: ${other[*]}}"
  fi
  if [ $rc -eq 0 ]; then
    configured_ok=1
    stage_end pass "CUDA architectures $a, $generator, Python module $([ $python_module -eq 1 ] && echo on || echo off)"
  else
    stage_end "$(status_of $rc)" "cmake exit $rc: see build.log"
  fi
}

# --- stages: build, build-extra ---------------------------------------------------------
# build: the CLI, every test target tests/CMakeLists.txt labels cuda, and the Python module;
# build-extra (later, when the budget allows): the test binaries whose GPU paths sit beside
# host tests. Ninja keeps going past a failed target (-k 0), so one broken target costs only
# the stages that need it (is_built).
cuda_test_targets() {
  sed -n 's/^ *spillway_add_test(\([A-Za-z0-9_]*\) cuda\( .*\)\{0,1\}$/\1/p' "$here/tests/CMakeLists.txt"
}
target_exists() {
  case $generator in
    Ninja) grep -qE "^build $1: phony" "$build_dir/build.ninja" 2>/dev/null ;;
    *) "$cmake_bin" --build "$build_dir" --target help 2>/dev/null | grep -qE "(^|[ .])$1( |$)" ;;
  esac
}
built_targets=" "
is_built() { [[ $built_targets == *" $1 "* ]]; }
stage_build() {  # NAME MAX_SECONDS MIN_SECONDS TARGETS...
  local name=$1 max=$2 min=$3
  shift 3
  stage_begin "$name" build "$max" "$min" || return 0
  local keep_going=(-- -k 0)
  [ "$generator" = Ninja ] || keep_going=(-- -k)
  local cmd=("${cmake_bin:-cmake}" --build "$build_dir" -j "$jobs" --target)
  if [ $do_build -eq 0 ]; then
    would_run "${cmd[@]}" "$@" "${keep_going[@]}"
    stage_end skip "$no_gpu_why"
    return 0
  fi
  if [ $configured_ok -eq 0 ]; then
    would_run "${cmd[@]}" "$@" "${keep_going[@]}"
    stage_end skip "the configure did not pass"
    return 0
  fi
  local t want=() missing=()
  for t in "$@"; do
    if target_exists "$t"; then want+=("$t"); else missing+=("$t"); fi
  done
  [ ${#missing[@]} -gt 0 ] && fig "targets this configure lacks" "${missing[*]}"
  if [ ${#want[@]} -eq 0 ]; then
    stage_end fail "none of the targets exist: $*"
    return 0
  fi
  local rc=0 t0
  t0=$(date +%s)
  : >"$S.started"
  sleep 1   # a file this build writes is newer than the stamp, to the second
  run_timed "$(stage_left)" "${cmd[@]}" "${want[@]}" "${keep_going[@]}" || rc=$?
  fig build-seconds "$(($(date +%s) - t0)) with -j $jobs"
  # Which targets stand: all, or (after a failure) each built alone again, which is quick
  # for those already built and names the ones that are not.
  local ok=() bad=() left f
  if [ $rc -eq 0 ]; then
    ok=("${want[@]}")
  elif [ "$(status_of $rc)" = timeout ]; then
    # Out of time: no second try; a target stands if its file is there.
    for t in "${want[@]}"; do
      case $t in
        spillway_cli) f=$build_dir/bin/spillway ;;
        _spillway) f=$(find "$build_dir/python/spillway" -maxdepth 1 -name '_spillway*.so' 2>/dev/null | head -n 1) ;;
        *) f=$build_dir/tests/$t ;;
      esac
      if [ -n "$f" ] && [ -x "$f" ] && [ "$f" -nt "$S.started" ]; then ok+=("$t"); else bad+=("$t"); fi
    done
  else
    for t in "${want[@]}"; do
      left=$(stage_left)
      [ "$left" -lt 15 ] && left=15
      if timeout -k 5 "$left" "$cmake_bin" --build "$build_dir" -j "$jobs" --target "$t" \
          >>"$S.log" 2>&1 </dev/null; then
        ok+=("$t")
      else
        bad+=("$t")
      fi
    done
  fi
  built_targets+="${ok[*]} "
  fig built "${ok[*]:-none}"
  [ ${#bad[@]} -gt 0 ] && fig "not built" "${bad[*]}"
  fig build-dir-mib "$(mib "$(du -sb "$build_dir" 2>/dev/null | cut -f1)")"
  local steps
  steps=$(grep -oE '^\[[0-9]+/[0-9]+\]' "$S.log" | tail -n 1)
  [ -n "$steps" ] && fig "last step" "$steps"
  [ -f "$build_dir/compile_commands.json" ] &&
    fig debug-info "$(grep -cE ' -g( |[0-9])' "$build_dir/compile_commands.json") compile commands with -g"
  if [ $rc -eq 0 ]; then
    stage_end pass "built ${ok[*]}${missing[*]:+ (this configure lacks ${missing[*]})}"
  else
    if [ "$(status_of $rc)" = timeout ]; then
      stage_end timeout "ran out of its $S_BUDGET s at step ${steps:-?}; not built: ${bad[*]:-?}"
    else
      stage_end fail "build exit $rc; not built: ${bad[*]:-?}; the first error: $(grep -m1 -E 'error:|FAILED:|Error [0-9]|CMake Error' "$S.log" | cut -c1-200)"
    fi
  fi
}

# --- test results ---------------------------------------------------------------------
ctest_counts() {  # LOG: figures, and "P passed, F failed, S skipped" on stdout
  local lines p f s names
  lines=$(grep -E '^ *[0-9]+/[0-9]+ +Test +#[0-9]+: ' "$1")
  p=$(grep -c -E ' Passed +[0-9.]+ sec' <<<"$lines")
  s=$(grep -c -E 'Skipped' <<<"$lines")
  f=$(($(grep -c . <<<"$lines") - p - s))
  fig passed "$p"
  fig failed "$f"
  fig skipped "$s"
  names=$(grep -v -E ' Passed +[0-9.]+ sec|Skipped' <<<"$lines" | sed -E 's/.*Test +#[0-9]+: ([^ ]+).*/\1/' | paste -sd ' ')
  [ -n "$names" ] && fig "failed tests" "$names"
  names=$(grep -E 'Skipped' <<<"$lines" | sed -E 's/.*Test +#[0-9]+: ([^ ]+).*/\1/' | head -n 30 | paste -sd ' ')
  [ -n "$names" ] && fig "skipped tests" "$names"
  echo "$p passed, $f failed, $s skipped"
}
# On a GPU machine, a CUDA test that skips for want of a device did not find the GPU: a
# failure. (Other skips stand: "fewer than 2 CUDA devices" on a one-GPU machine.)
NO_DEVICE_SKIP='no CUDA device|CUDA backend not exercised'
gpu_stage_guard() {  # TARGETS...: why a GPU stage cannot run (empty: it can)
  if [ $have_gpu -eq 0 ]; then echo "$no_gpu_why"; return; fi
  local t
  for t in "$@"; do
    is_built "$t" || { echo "$t was not built (see the build stages)"; return; }
  done
}
device_skips() {  # LOG: the skip messages that say no device was found (GoogleTest's, pytest's)
  { grep -A1 -E ': Skipped$' "$1" | grep -E "$NO_DEVICE_SKIP"
    grep -E "^SKIPPED .*($NO_DEVICE_SKIP)" "$1"; } | cut -c1-160
}
finish_test_stage() {  # EXIT_STATUS COUNTS
  local st skips
  st=$(status_of "$1")
  skips=$(device_skips "$S.log")
  if [ "$st" = pass ] && [ -n "$skips" ]; then
    st=fail
    fig "device not found by" "$(head -n 3 <<<"$skips" | paste -sd '|')"
  fi
  stage_end "$st" "$2 (exit $1)$([ "$st" = fail ] && [ "$1" = 0 ] && echo '; a test skipped for want of a device')"
}

# --- stage: ctest-cuda ----------------------------------------------------------------
stage_ctest_cuda() {
  stage_begin ctest-cuda tests 120 15 || return 0
  local targets
  mapfile -t targets < <(cuda_test_targets)
  # 45 s a test: a CUDA test takes seconds, and one that hangs must leave time for the rest.
  local cmd=("${ctest_bin:-ctest}" --test-dir "$build_dir" -L cuda --timeout 45 -V --no-tests=error)
  local why
  why=$(gpu_stage_guard "${targets[@]}")
  if [ -n "$why" ]; then
    would_run "${cmd[@]}"
    stage_end skip "$why (the CUDA-labelled targets: ${targets[*]})"
    return 0
  fi
  local rc=0
  run_timed "$(stage_left)" "${cmd[@]}" || rc=$?
  finish_test_stage $rc "$(ctest_counts "$S.log")"
}

# --- stage: gpu-paths -------------------------------------------------------------------
# The GPU paths in test binaries of other labels: every device operation and the device
# contract on every backend (host and CUDA), HybridGEMM's kernels against the host.
GPU_PATH_TESTS='DeviceParity|DeviceOpsParity|HybridGemmCuda'
stage_gpu_paths() {
  stage_begin gpu-paths tests 60 10 || return 0
  local cmd=("${ctest_bin:-ctest}" --test-dir "$build_dir" -R "$GPU_PATH_TESTS" --timeout 30 -V --no-tests=error)
  local why
  why=$(gpu_stage_guard spillway_tests_device spillway_tests_optim spillway_tests_serve)
  if [ -n "$why" ]; then
    would_run "${cmd[@]}"
    stage_end skip "$why"
    return 0
  fi
  local rc=0
  run_timed "$(stage_left)" "${cmd[@]}" || rc=$?
  finish_test_stage $rc "$(ctest_counts "$S.log")"
}

# --- stage: pytest-cuda -----------------------------------------------------------------
# python/tests/test_cuda.py and test_cpu_adamw_device.py, and every test file that asks
# torch.cuda.is_available() (the condition a CUDA-only test skips on).
python_test_files() {
  {
    echo python/tests/test_cuda.py
    echo python/tests/test_cpu_adamw_device.py
    grep -l 'cuda.is_available' python/tests/test_*.py 2>/dev/null
  } | awk '!seen[$0]++' | while IFS= read -r f; do [ -f "$f" ] && echo "$f"; done
}
stage_pytest() {
  stage_begin pytest-cuda pytest 120 15 || return 0
  local files
  mapfile -t files < <(python_test_files)
  local cmd=(env "PYTHONPATH=$build_dir/python" "SPILLWAY_BUILD=$build_dir" PYTHONUNBUFFERED=1
    python3 -m pytest -v -rs -p no:cacheprovider "${files[@]}")
  local why
  why=$(gpu_stage_guard _spillway)
  if [ -n "$why" ]; then
    would_run "${cmd[@]}"
    stage_end skip "$why"
    return 0
  fi
  local base=("${cmd[@]:0:${#cmd[@]}-${#files[@]}}")
  python3 -c 'import pytest_timeout' 2>/dev/null && base+=(--timeout=100)
  # One pytest per file: a crash (a segfault in a CUDA path) ends only its own file.
  local rc=0 frc f line n v summary="" crashed=""
  declare -A count=([passed]=0 [failed]=0 [skipped]=0 [error]=0)
  for f in "${files[@]}"; do
    [ "$(stage_left)" -gt 0 ] || { crashed+=" ${f##*/} (not run: no time left)"; rc=124; continue; }
    frc=0
    run_timed "$(stage_left)" "${base[@]}" "$f" || frc=$?
    line=$(grep -E '^=+ .*(passed|failed|error|skipped).* in [0-9.]+s' "$S.log" | tail -n 1)
    if [ "$frc" -ne 0 ] && [ "$frc" -ne 1 ]; then
      crashed+=" ${f##*/} (exit $frc)"
      [ "$rc" -eq 0 ] || [ "$rc" -eq 1 ] && rc=$frc
      continue
    fi
    [ "$frc" -ne 0 ] && [ "$rc" -eq 0 ] && rc=$frc
    for n in passed failed skipped error; do
      v=$(grep -oE "[0-9]+ $n" <<<"$line" | head -n 1 | cut -d' ' -f1)
      count[$n]=$((count[$n] + ${v:-0}))
    done
  done
  for n in passed failed skipped error; do fig "$n" "${count[$n]}"; done
  summary="${count[passed]} passed, ${count[failed]} failed, ${count[skipped]} skipped, ${count[error]} errors"
  [ -n "$crashed" ] && summary+="; crashed or cut:$crashed" && fig crashed "$crashed"
  finish_test_stage $rc "$summary"
}

# --- stage: bench-torch -----------------------------------------------------------------
# The PyTorch adapter's costs on the GPU, each against its baseline in the same run: the
# saved-tensor hooks' cost per tensor (offload_activations beside torch's save_on_cpu and a
# Python-only offload, and with the engine's D2H copies one at a time and in batches of 8:
# Note [Copies in batches]) and stream_weights on a 1.6 B-parameter bf16 stack of blocks against
# the same blocks resident and against the link's limit (a pinned copy measured there);
# then the same bench with 64 blocks of 16 KiB, where the copies are nothing and what a pass
# costs over the resident one is the streamed call's CPU work per block on the GPU.
stage_bench_torch() {
  stage_begin bench-torch bench 60 15 || return 0
  local py=(env "PYTHONPATH=$build_dir/python" PYTHONUNBUFFERED=1 python3)
  local hooks=("${py[@]}" bench/torch/bench_hooks.py --device cuda --repeats 9 --copy-batches 1,8
    --json "$work/bench-hooks.json")
  local stream=("${py[@]}" bench/torch/bench_stream_hooks.py --device cuda --dtype bfloat16
    --blocks 24 --width 8192 --batch 8 --repeats 5 --no-training --json "$work/bench-stream.json")
  local small=("${py[@]}" bench/torch/bench_stream_hooks.py --device cuda --blocks 64
    --width 64 --repeats 30 --no-training --json "$work/bench-stream-small.json")
  local why
  why=$(gpu_stage_guard _spillway)
  if [ -n "$why" ]; then
    would_run "${hooks[@]}"
    would_run "${stream[@]}"
    would_run "${small[@]}"
    stage_end skip "$why"
    return 0
  fi
  local rc1=0 rc2=0 rc3=0 failed=() k v
  run_timed $(($(stage_left) / 3)) "${hooks[@]}" || rc1=$?
  [ $rc1 -eq 0 ] || failed+=("bench_hooks.py exit $rc1")
  run_timed $(($(stage_left) * 2 / 3)) "${stream[@]}" || rc2=$?
  [ $rc2 -eq 0 ] || failed+=("bench_stream_hooks.py exit $rc2")
  run_timed "$(stage_left)" "${small[@]}" || rc3=$?
  [ $rc3 -eq 0 ] || failed+=("bench_stream_hooks.py (64 small blocks) exit $rc3")
  while IFS=$'\t' read -r k v; do [ -n "$k" ] && fig "$k" "$v"; done < <(python3 - "$work/bench-hooks.json" "$work/bench-stream.json" "$work/bench-stream-small.json" <<'PY' 2>/dev/null
import json, os, sys
h, s, small = sys.argv[1], sys.argv[2], sys.argv[3]
if os.path.exists(h):
    d = json.load(open(h))
    for name, us in d["us_per_tensor"].items():
        print(f"hooks us/tensor: {name}\t{us:.1f}")
if os.path.exists(s):
    d = json.load(open(s))
    print(f"stream_weights {d['parameters'] / 1e9:.2f} B {d['dtype']}: resident / streamed ms\t{d['resident_ms']:.2f} / {d['streamed_ms']:.2f} ({d['ratio']:.2f}x)")
    if "link_limit_ms" in d:
        print(f"stream_weights: the link's limit (pinned {d['link_gbps']:.1f} GB/s)\t{d['link_limit_ms']:.2f} ms: streamed at {d['link_limit_ms'] / d['streamed_ms']:.2f} of it")
if os.path.exists(small):
    d = json.load(open(small))
    print(f"stream_weights us per block, 64 blocks of 16 KiB\t{d['us_per_block']:.1f} (resident {d['resident_ms']:.2f} ms, streamed {d['streamed_ms']:.2f} ms a pass)")
PY
)
  if [ ${#failed[@]} -eq 0 ]; then
    stage_end pass "bench_hooks.py and bench_stream_hooks.py ran on the GPU"
  elif [[ " $rc1 $rc2 $rc3 " == *" 124 "* || " $rc1 $rc2 $rc3 " == *" 137 "* ]]; then
    stage_end timeout "$(printf '%s; ' "${failed[@]}" | sed 's/; $//')"
  else
    stage_end fail "$(printf '%s; ' "${failed[@]}" | sed 's/; $//')"
  fi
}

# --- stage: bench -----------------------------------------------------------------------
# The link (pinned and pageable H2D/D2H beside the profile's typical figure), cuBLAS bf16
# GEMMs at the planner's shapes written as a spillway.profile/1 file, the planner taking
# that file, the offload engine against the pinned link, and HybridGEMM's kernels: per alpha
# the bytes they count against the closed form, and their link GB/s against a pinned copy of
# the same weights.
stage_bench() {
  stage_begin bench bench 90 15 || return 0
  local bin=$build_dir/bin/spillway
  # shellcheck disable=SC2054  # the commas are probe's
  local probe=("$bin" probe --device cuda --hardware "$hw" --sizes 64K,1M,16M,256M --repeats 5
    --budget-s 15 --json "$work/probe.json")
  local gemm=("$bin" bench gemm --backend cuda --hardware "$hw" --seq-len 1024 --repeats 3
    --json "$work/gemm-profile.json")
  local plan=("$bin" plan --model Qwen3-30B-A3B --hardware "$hw" --micro-batch 2 --seq-len 8192
    --ep 8 --dp 8 --profile "$work/gemm-profile.json")
  local offload=("$bin" bench offload --backend cuda --layers 16 --tensor-mb 16 --steps 3
    --repeats 2 --json "$work/bench-offload.json")
  local hybrid=("$bin" bench hybrid-gemm --backend cuda --m 16 --n 8192 --k 8192 --repeats 5
    --json "$work/bench-hybrid-gemm.json")
  local why
  why=$(gpu_stage_guard spillway_cli spillway_bench_tool)
  if [ -n "$why" ]; then
    would_run "${probe[@]}"
    would_run "${gemm[@]}"
    would_run "${plan[@]}"
    would_run "${offload[@]}"
    would_run "${hybrid[@]}"
    stage_end skip "$why"
    return 0
  fi
  local rc1=0 rc2=0 rc3=0 rc4=0 rc5=0 failed=() k v
  run_timed 10 "$bin" hardware || true
  run_timed $(($(stage_left) * 2 / 5)) "${probe[@]}" || rc1=$?
  [ $rc1 -eq 0 ] || failed+=("probe exit $rc1")
  if [ -s "$work/probe.json" ]; then
    cat "$work/probe.json" >>"$S.log"
    while IFS=$'\t' read -r k v; do [ -n "$k" ] && fig "$k" "$v"; done < <(python3 - "$work/probe.json" <<'PY' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
print(f"probe backend\t{d.get('backend', '?')}")
pts = [p for p in d.get("points", []) if p.get("host_memory") == "pinned"]
if pts:
    top = max(p["bytes"] for p in pts)
    for p in pts:
        if p["bytes"] == top:
            print(f"pinned {p['direction']} GB/s at {top >> 20} MiB\t{p['gbps_median']:.1f} (best {p['gbps_best']:.1f})")
PY
)
  fi
  run_timed $(($(stage_left) * 2 / 3)) "${gemm[@]}" || rc2=$?
  [ $rc2 -eq 0 ] || failed+=("bench gemm exit $rc2")
  if [ -s "$work/gemm-profile.json" ]; then
    cat "$work/gemm-profile.json" >>"$S.log"
    fig gemm-profile "gemm-profile.json ($(stat -c %s "$work/gemm-profile.json") bytes)"
    run_timed "$(stage_left)" "${plan[@]}" || rc3=$?
    # 0: feasible, 3: infeasible; either way the planner took the profile.
    case $rc3 in
      0 | 3) fig "plan --profile" "took the profile (exit $rc3)" ;;
      *) failed+=("plan --profile exit $rc3") ;;
    esac
  else
    failed+=("bench gemm wrote no profile")
  fi
  # The offload engine over the real copy engines against the pinned link, same run.
  run_timed $(($(stage_left) * 2 / 3)) "${offload[@]}" || rc4=$?
  [ $rc4 -eq 0 ] || failed+=("bench offload --backend cuda exit $rc4")
  if [ -s "$work/bench-offload.json" ]; then
    while IFS=$'\t' read -r k v; do [ -n "$k" ] && fig "$k" "$v"; done < <(python3 - "$work/bench-offload.json" <<'PY' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
print(f"offload D2H GB/s (link)\t{d['offload_gbps']:.1f} ({d['limit_d2h_gbps']:.1f}: {d['offload_ratio']:.2f} of it)")
print(f"reload H2D GB/s (link)\t{d['reload_gbps']:.1f} ({d['limit_h2d_gbps']:.1f}: {d['reload_ratio']:.2f} of it)")
print(f"offload CPU us/tensor\t{d['overhead_us_per_tensor']:.2f}")
PY
)
  fi
  # HybridGEMM's kernels: counted bytes against the closed form (a difference exits 1), and
  # the link GB/s of the uncounted runs against a pinned copy of W, same run.
  run_timed "$(stage_left)" "${hybrid[@]}" || rc5=$?
  [ $rc5 -eq 0 ] || failed+=("bench hybrid-gemm --backend cuda exit $rc5")
  if [ -s "$work/bench-hybrid-gemm.json" ]; then
    cat "$work/bench-hybrid-gemm.json" >>"$S.log"
    while IFS=$'\t' read -r k v; do [ -n "$k" ] && fig "$k" "$v"; done < <(python3 - "$work/bench-hybrid-gemm.json" <<'PY' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
p = d["problem"]
print(f"hybrid-gemm {p['m']}x{p['n']}x{p['k']} {p['w_dtype']}: pinned copy of W GB/s\t{d['limit']['copy_gbps']:.1f}")
for a in d["alphas"]:
    same = "counted == closed form" if a["equal"] else "counted != closed form"
    print(f"hybrid-gemm alpha {a['alpha']:g}: link GB/s\t{a['link_gbps']:.1f} ({a['fraction_of_copy']:.2f} of the copy; {same})")
PY
)
  fi
  if [ ${#failed[@]} -eq 0 ]; then
    stage_end pass "probe, bench gemm --backend cuda, plan --profile, bench offload --backend cuda and bench hybrid-gemm --backend cuda ran"
  elif [[ " $rc1 $rc2 $rc3 $rc4 $rc5 " == *" 124 "* || " $rc1 $rc2 $rc3 $rc4 $rc5 " == *" 137 "* ]]; then
    stage_end timeout "$(printf '%s; ' "${failed[@]}" | sed 's/; $//')"
  else
    stage_end fail "$(printf '%s; ' "${failed[@]}" | sed 's/; $//')"
  fi
}

# --- stage: train-e2e ---------------------------------------------------------------------
# A whole training step on the GPU under every policy (bench/torch/bench_train.py): a
# Hugging Face model of the catalog's real widths (random weights) trains under keep,
# checkpoint, selective, save_on_cpu, offload-auto and offload-mlp with the process capped at
# 40 GiB, and torch AdamW against CPUAdamW on a model sized to a 16 GiB cap (torch AdamW runs
# out of it, CPUAdamW trains it; torch AdamW then uncapped for its time); each row's tokens/s,
# step time and peak beside the planner's prediction from a profile the bench makes in the
# same run, and its checks: every policy's first-step gradients against keep's, CPUAdamW
# against torch AdamW (scripts/gpu_check_train.py reads the JSON; its reading is tested on
# recorded runs: tests/scripts/gpu_check_train_test.sh). Qwen3-30B-A3B first (4 blocks:
# 1.2 GB of bf16 experts each), then Llama-3.1-8B's activation rows where time is left.
stage_train_e2e() {
  stage_begin train-e2e bench 120 30 || return 0
  local py=(env "PYTHONPATH=$build_dir/python" "SPILLWAY_BUILD=$build_dir" PYTHONUNBUFFERED=1
    python3 bench/torch/bench_train.py --device cuda --spillway "$build_dir/bin/spillway")
  local probe=()
  [ -s "$work/probe.json" ] && probe=(--probe "$work/probe.json")   # stage bench's link
  local qwen=("${py[@]}" "${probe[@]}" --model qwen3-30b-a3b --layers 4 --seq-len 4096
    --micro-batch 1 --steps 3 --warmup 2 --hbm-gb 40 --optimizer-hbm-gb 16
    --json "$work/bench-train.json")
  # shellcheck disable=SC2054  # the commas are --policies'
  local llama=("${py[@]}" "${probe[@]}" --model llama-3.1-8b --layers 8 --seq-len 4096
    --micro-batch 1 --steps 3 --warmup 2 --hbm-gb 40
    --policies keep,checkpoint,selective,save_on_cpu,offload-auto,offload-mlp
    --json "$work/bench-train-llama.json")
  local why
  why=$(gpu_stage_guard _spillway spillway_cli spillway_bench_tool)
  if [ -n "$why" ]; then
    would_run "${qwen[@]}"
    would_run "${llama[@]}"
    stage_end skip "$why"
    return 0
  fi
  local rc1=0 rc2=0 prc failed=() verdicts=() verdict k v f
  run_timed $(($(stage_left) * 3 / 5)) "${qwen[@]}" || rc1=$?
  if [ "$(stage_left)" -ge 35 ]; then
    run_timed "$(stage_left)" "${llama[@]}" || rc2=$?
  else
    rc2=-1
    fig "llama-3.1-8b" "not run: $(stage_left) s left of the stage's $S_BUDGET s"
  fi
  # The bench exits 1 when a check failed; the reader says which.
  for f in "$work/bench-train.json" "$work/bench-train-llama.json"; do
    [ -s "$f" ] || continue
    cat "$f" >>"$S.log"
    prc=0
    verdict=$(python3 "$here/scripts/gpu_check_train.py" "$f" 2>&1) || prc=$?
    while IFS=$'\t' read -r k v; do [ -n "$k" ] && [ -n "$v" ] && fig "$k" "$v"; done <<<"$verdict"
    verdicts+=("$(tail -n 1 <<<"$verdict")")
    [ $prc -eq 0 ] || failed+=("$(tail -n 1 <<<"$verdict")")
  done
  [ -s "$work/bench-train.json" ] || failed+=("bench_train.py (Qwen3-30B-A3B) exit $rc1, no JSON")
  if [ $rc2 -ge 0 ] && [ ! -s "$work/bench-train-llama.json" ]; then
    failed+=("bench_train.py (Llama-3.1-8B) exit $rc2, no JSON")
  fi
  if [ ${#failed[@]} -eq 0 ]; then
    stage_end pass "$(printf '%s; ' "${verdicts[@]}" | sed 's/; $//')"
  elif [[ " $rc1 $rc2 " == *" 124 "* || " $rc1 $rc2 " == *" 137 "* ]]; then
    stage_end timeout "$(printf '%s; ' "${failed[@]}" | sed 's/; $//')"
  else
    stage_end fail "$(printf '%s; ' "${failed[@]}" | sed 's/; $//')"
  fi
}

# --- stages: memcheck, racecheck --------------------------------------------------------
# compute-sanitizer over spillway's own kernels and copies: memcheck over the CUDA test
# binary (cuBLAS's GEMM test and NCCL left out: not ours, and slow under it) and HybridGEMM's
# kernels; racecheck (shared-memory hazards) over the kernels that use shared memory.
stage_sanitizer() {  # TOOL MAX_SECONDS CUDA_TESTS_FILTER SERVE_FILTER
  local tool=$1
  stage_begin "$tool" tests "$2" 20 || return 0
  local tbin=$build_dir/tests/spillway_tests_cuda sbin=$build_dir/tests/spillway_tests_serve
  # API errors are left out: tests provoke them on purpose (an allocation of 1 PiB, a
  # missing ordinal); the sanitizers are here for the kernels and the copies.
  local cmd=("${sanitizer_bin:-compute-sanitizer}" --tool "$tool" --error-exitcode 99
    --report-api-errors no)
  [ "$tool" = racecheck ] && cmd+=(--racecheck-report hazard)
  local a=("${cmd[@]}" "$tbin" --gtest_brief=1 "--gtest_filter=$3")
  local b=("${cmd[@]}" "$sbin" --gtest_brief=1 "--gtest_filter=$4")
  local why
  why=$(gpu_stage_guard spillway_tests_cuda)
  [ -z "$why" ] && [ -z "$sanitizer_bin" ] && why="compute-sanitizer not found"
  if [ -n "$why" ]; then
    would_run "${a[@]}"
    would_run "${b[@]}"
    stage_end skip "$why"
    return 0
  fi
  local rc1=0 rc2=0
  run_timed $(($(stage_left) * 2 / 3)) "${a[@]}" || rc1=$?
  if is_built spillway_tests_serve; then
    run_timed "$(stage_left)" "${b[@]}" || rc2=$?
  else
    fig "not run" "HybridGemmCuda (spillway_tests_serve was not built)"
  fi
  local summary
  summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$S.log" | sed -E 's/^=+ *//' | paste -sd ';' | sed 's/;/; /g')
  fig summary "${summary:-none printed}"
  if [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ]; then
    stage_end pass "${summary:-no errors}"
  elif [[ " $rc1 $rc2 " == *" 124 "* || " $rc1 $rc2 " == *" 137 "* ]]; then
    stage_end timeout "ran out of its budget (${summary:-no summary yet}); what it found so far is in tests.log"
  else
    stage_end fail "exit $rc1 / $rc2 (99: the sanitizer found errors; else a test failed): ${summary:-see tests.log}"
  fi
}

# --- stage: doctor -----------------------------------------------------------------------
# `spillway doctor --json` on the GPU machine: the report must list a CUDA device, name the
# card nvidia-smi names and run the CUDA backend (scripts/gpu_check_doctor.py reads it; its
# reading is tested on recorded reports: tests/scripts/gpu_check_doctor_test.sh).
stage_doctor() {
  stage_begin doctor tests 20 5 || return 0
  local bin=$build_dir/bin/spillway
  local cmd=("$bin" doctor --json "$work/doctor.json")
  local why
  why=$(gpu_stage_guard spillway_cli)
  if [ -n "$why" ]; then
    would_run "${cmd[@]}"
    stage_end skip "$why"
    return 0
  fi
  local rc=0 prc=0 verdict k v
  run_timed "$(stage_left)" "${cmd[@]}" || rc=$?
  if [ $rc -ne 0 ] || [ ! -s "$work/doctor.json" ]; then
    stage_end "$(status_of $rc)" "spillway doctor exited $rc$([ -s "$work/doctor.json" ] || echo ', no JSON written')"
    return 0
  fi
  cat "$work/doctor.json" >>"$S.log"
  verdict=$(python3 "$here/scripts/gpu_check_doctor.py" "$work/doctor.json" "$gpu_name" 2>&1) || prc=$?
  while IFS=$'\t' read -r k v; do [ -n "$k" ] && [ -n "$v" ] && fig "$k" "$v"; done <<<"$verdict"
  if [ $prc -eq 0 ]; then
    stage_end pass "$(tail -n 1 <<<"$verdict")"
  else
    stage_end fail "$(tail -n 1 <<<"$verdict")"
  fi
}

# --- the run, in order of what matters most -----------------------------------------------
stage_env
stage_deps
stage_configure
main_targets=(spillway_cli spillway_bench_tool)
mapfile -t -O 2 main_targets < <(cuda_test_targets)
main_targets+=(_spillway)
stage_build build 200 30 "${main_targets[@]}"
stage_doctor
stage_ctest_cuda
stage_pytest
stage_bench
stage_build build-extra 60 15 spillway_tests_device spillway_tests_optim spillway_tests_serve
stage_gpu_paths
stage_sanitizer memcheck 60 '-GemmCuda.*:*Nccl*:HybridGemmLimits.*' 'HybridGemmCuda.*'
stage_sanitizer racecheck 40 'AdamWCuda.*:OptimizerOffloadCuda.*' 'HybridGemmCuda.KernelsMatch*'
stage_train_e2e
stage_bench_torch

write_report
# The summary and the stages' table last, where the device tool's output tail keeps them
# (the whole report is in gpu-report.md).
echo
sed -n '1,/^| --- /p' "$out/gpu-report.md"
sed -n '/^| --- /,/^$/p' "$out/gpu-report.md" | sed '1d'
log "report: $out/gpu-report.md and gpu-report.json ($(($(date +%s) - start)) s)"
grep -qE '"(fail|timeout)": [1-9]' "$out/gpu-report.json" && exit 1
exit 0

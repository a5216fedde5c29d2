#!/usr/bin/env bash
# Installs the Debian packages spillway's build and tests need, only those missing
# (`--arm`: also those of the Arm check, which `make test` runs).
# Idempotent; silent when everything is present. Run as root (or with sudo available).
set -euo pipefail

packages=(
  cmake make g++ clang            # build; clang for the libFuzzer target
  libclang-rt-14-dev              # libFuzzer and sanitizer runtimes for clang
  nlohmann-json3-dev              # JSON
  libcli11-dev                    # command-line parsing
  libfmt-dev                      # formatting
  libgtest-dev libgmock-dev       # tests
  libbenchmark-dev                # benchmarks
  libnuma-dev                     # NUMA-local pinned memory (device layer)
  libopenblas-dev                 # BLAS for the reference model (src/nn)
  libhwy-dev                      # portable SIMD with run-time dispatch (optimizer offload)
  libcpp-httplib-dev              # HTTP server of `spillway serve`
  libpcre2-dev libutf8proc-dev    # the tokenizer: regexes with Unicode classes, normalization
  python3 python3-venv            # test helpers that read JSON output; the Python env
  file                            # scripts that name what a binary is
)
# --arm (`make test`, not `make run`): the CPU AdamW's Arm check (scripts/arm-check.sh):
# Debian's aarch64 cross compiler, the emulator, and the arm64 -dev packages it links
# (multiarch, beside the host's): about 92 MB to fetch on a fresh machine.
arm=0
[ "${1:-}" = "--arm" ] && arm=1
if [ $arm -eq 1 ]; then
  packages+=(g++-aarch64-linux-gnu qemu-user
             libhwy-dev:arm64 libgtest-dev:arm64 libfmt-dev:arm64 libnuma-dev:arm64)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  # The arm64 packages need the architecture known to dpkg (before the lists are fetched).
  if [ $arm -eq 1 ] && ! dpkg --print-foreign-architectures | grep -qx arm64; then
    $SUDO dpkg --add-architecture arm64
  fi
  # A fresh machine's package lists are empty: update before installing.
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "install-deps: done"
fi


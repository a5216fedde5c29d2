#!/usr/bin/env bash
# Installs the Debian packages spillway's build and tests need, only those missing.
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
  python3 python3-venv            # test helpers that read JSON output; the Python env
)

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
  # A fresh machine's package lists are empty: update before installing.
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "install-deps: done"
fi


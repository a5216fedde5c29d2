#!/usr/bin/env bash
# The Python environment of the adapter and its tests (python/requirements.txt, every
# package pinned, installed with --no-deps: the file is the whole closure), a virtual
# environment cached outside the repository:
#   ${SPILLWAY_VENV:-~/.cache/spillway/venv-<hash of the requirements and the Python>}
# Idempotent: an environment that finished installing is reused, silently.
#   scripts/install-python.sh            create it when missing
#   scripts/install-python.sh --print    print its path (creates nothing)
#   scripts/install-python.sh --bench    also the benchmarks' peers (python/requirements-bench.txt)
# The client layer (python/requirements-client.txt: the OpenAI client) is always added on top.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${SPILLWAY_PYTHON:-python3}
req=python/requirements.txt
key=$( { cat "$req"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-12)
venv=${SPILLWAY_VENV:-$HOME/.cache/spillway/venv-$key}

if [ "${1:-}" = "--print" ]; then
  echo "$venv"
  exit 0
fi
bench=0
[ "${1:-}" = "--bench" ] && bench=1
# The client layer (python/requirements-client.txt): on top, without changing the
# environment's key, added to an environment made before it existed.
client_layer() {
  [ -f "$venv/.client-complete" ] && cmp -s python/requirements-client.txt "$venv/.client-complete" && return 0
  echo "install-python: adding the client layer (python/requirements-client.txt) to $venv"
  "$venv/bin/python" -m pip install --quiet --no-deps --no-input --progress-bar off \
    -r python/requirements-client.txt
  "$venv/bin/python" -c 'import openai' >/dev/null
  cp python/requirements-client.txt "$venv/.client-complete"
}
if [ -f "$venv/.complete" ]; then
  client_layer
  [ $bench -eq 0 ] && exit 0
  [ -f "$venv/.bench-complete" ] && cmp -s python/requirements-bench.txt "$venv/.bench-complete" && exit 0
  echo "install-python: adding the benchmarks' peers (python/requirements-bench.txt) to $venv"
  "$venv/bin/python" -m pip install --quiet --no-deps --no-input --no-build-isolation \
    --progress-bar off -r python/requirements-bench.txt
  cp python/requirements-bench.txt "$venv/.bench-complete"
  exit 0
fi

start=$(date +%s)
echo "install-python: creating $venv (python/requirements.txt; ~2.7 GB of wheels, once)"
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$PY" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-deps --no-input --progress-bar off -r "$req"
# The environment must import what the tests import, on CPU, before it is called complete.
"$venv/bin/python" - <<'PY'
import warnings
warnings.simplefilter("ignore")
import accelerate, nanobind, numpy, pytest, torch, transformers  # noqa: F401
x = torch.ones(4, requires_grad=True)
(x * x).sum().backward()
assert torch.equal(x.grad, 2 * torch.ones(4))
PY
touch "$venv/.complete"
client_layer
echo "install-python: done in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))"
[ $bench -eq 1 ] && exec bash "$0" --bench
exit 0

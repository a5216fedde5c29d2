"""`pip install .` builds the extension module with scikit-build-core (pyproject.toml) and
installs a package that plans, without torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not os.environ.get("SPILLWAY_BUILD"), reason="run by make test-python")
def test_pip_install_builds_a_package_that_plans(tmp_path: Path) -> None:
    target = tmp_path / "site"
    # No build isolation: the pinned scikit-build-core and nanobind of this environment, and
    # no network. A scratch build directory, so the source tree stays clean.
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-build-isolation",
            "--no-deps",
            "--target",
            str(target),
            "--config-settings",
            f"build-dir={tmp_path / 'build'}",
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    assert (target / "spillway" / "py.typed").exists()
    code = (
        "import sys, spillway; p = spillway.plan('Llama-3.1-8B', 'h100-pcie'); "
        "print(p['schema'], 'torch' in sys.modules, spillway.__file__)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(target)),
        cwd=tmp_path,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    schema, torch_loaded, where = run.stdout.split()
    assert schema == "spillway.plan/1"
    assert torch_loaded == "False", "import spillway must not import torch"
    assert where.startswith(str(target))

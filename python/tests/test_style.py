"""The Python code is formatted (ruff format), lint-clean (ruff check) and typed (mypy
--strict on the package as built, with the extension module's stubs): pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = [
    "python",
    "bench/torch",
    "bench/text",
    "examples/torch",
    "examples/serve",
    "scripts/check_docs.py",
]
BIN = Path(sys.executable).parent


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, check=False)


def test_formatted() -> None:
    r = run(str(BIN / "ruff"), "format", "--check", *PATHS)
    assert r.returncode == 0, r.stdout + r.stderr


def test_lint_clean() -> None:
    r = run(str(BIN / "ruff"), "check", *PATHS)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(not os.environ.get("SPILLWAY_BUILD"), reason="run by make test-python")
def test_typed() -> None:
    package = Path(os.environ["SPILLWAY_BUILD"]) / "python"
    r = run(
        str(BIN / "mypy"),
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        os.devnull,
        "-p",
        "spillway",
        cwd=package,
    )
    assert r.returncode == 0, r.stdout + r.stderr

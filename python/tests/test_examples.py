"""examples/torch/train_hf.py runs and offloads (the PyTorch guide's example); quickstart.py
(the README's PyTorch start) trains, offloads and learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_example_trains_and_offloads() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples/torch/train_hf.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=False,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 3
    assert "offloading starts at step 2" in run.stderr  # the sizing step says so
    # One numbering: the log's step 1 is the sizing step, its step 2 the first offloading.
    assert [ln.split(":")[0] for ln in lines] == ["step 1", "step 2", "step 3"]
    moved = [
        float(m.group(1)) for m in map(re.compile(r"offloaded ([\d.]+) MB").search, lines) if m
    ]
    assert moved[0] == 0.0 and moved[1] > 0 and moved[2] == moved[1]


def test_the_example_with_cpu_adamw() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples/torch/train_hf.py"), "--steps", "2", "--cpu-adamw"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("CPUAdamW: ") == 2


def test_the_readme_quickstart_trains_offloads_and_learns() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples/torch/quickstart.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 4, run.stdout
    losses = [float(re.search(r"loss ([\d.]+)", line).group(1)) for line in lines]  # type: ignore[union-attr]
    assert losses[-1] < losses[0]  # one batch, learned
    assert all("offloaded 60.2 MB in 54 tensors, reloaded 60.2 MB" in line for line in lines)
    assert run.stderr == ""  # pinned_bytes= given: no sizing step, no warning


def test_the_readme_shows_the_quickstart_as_it_is() -> None:
    """The README's PyTorch start prints quickstart.py's code whole (after its docstring)."""
    code = (ROOT / "examples/torch/quickstart.py").read_text()
    code = code[code.index("import torch\n") :]
    readme = (ROOT / "README.md").read_text()
    assert "```python\n" + code + "```\n" in readme

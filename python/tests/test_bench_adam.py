"""`spillway bench adam` against this interpreter's torch: both of torch's CPU AdamWs, foreach
and fused (the stronger baseline, the one the docs quote), are measured in the same run."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

BUILD = os.environ.get("SPILLWAY_BUILD", "")


@pytest.mark.skipif(not BUILD, reason="needs SPILLWAY_BUILD (the CLI's build tree)")
def test_bench_adam_measures_torch_fused_beside_foreach(tmp_path: pathlib.Path) -> None:
    args = ["--elements", "65536", "--steps", "1", "--repeats", "1", "--threads", "1"]
    out = subprocess.run(
        [os.path.join(BUILD, "bin", "spillway"), "bench", "adam", *args]
        + ["--python", sys.executable, "--json", str(tmp_path / "adam.json")],
        check=False,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    j = json.loads((tmp_path / "adam.json").read_text())
    assert "vs torch fused" in out.stdout, out.stdout
    assert j["torch"]["ran"] is True, j["torch"]
    assert j["torch"]["version"] == torch.__version__
    fused = j["torch"]["fused"]
    assert fused["ran"] is True, fused
    assert fused["optimizer"] == "torch.optim.AdamW(fused=True), fp32, no low-precision copy"
    assert fused["elements_per_s"] > 0
    assert len(j["samples"]["torch_fused_elements_per_s"]) == 1
    assert j["torch_fused_ratio"] == pytest.approx(j["elements_per_s"] / fused["elements_per_s"])

"""bench/torch/bench_train.py on the CPU, scaled down (--tiny): every policy trains, its row
has its figures and the planner's prediction, and the correctness checks pass; a fault put
into one policy's gradient (--inject-fault) fails the run, naming that policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench/torch/bench_train.py"
POLICIES = [
    "keep",
    "checkpoint",
    "selective",
    "save_on_cpu",
    "offload-auto",
    "offload-mlp",
    "torch-adamw",
    "cpu-adamw",
]


def bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "train.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.exists(), run.stdout + run.stderr
    return run, json.loads(out.read_text())


def assert_rows(result: dict[str, Any]) -> None:
    rows = {r["policy"]: r for r in result["rows"]}
    assert sorted(rows) == sorted(POLICIES), sorted(rows)
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["status"], r["note"])
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["peak_bytes"] > 0, r
        assert len(r["steps_ms"]) == result["steps"]
        p = r["predicted"]
        assert p["step_ms"] > 0 and p["peak_bytes"] > 0, p
        if name != "checkpoint":
            assert r["vs_checkpoint"]["tokens_per_s"] > 0 and r["vs_checkpoint"]["peak"] > 0
    assert rows["checkpoint"]["vs_checkpoint"] == {"tokens_per_s": 1.0, "peak": 1.0}
    for name in ("selective", "offload-auto", "offload-mlp"):
        assert rows[name]["offloaded_bytes"] > 0, name  # the checked steps moved something
    if os.environ.get("SPILLWAY_BUILD"):  # the CLI is there: the profile was made in the run
        assert result["profile"].startswith("profile: bench gemm in this run"), result["profile"]


def test_every_policy_trains_llama_and_every_check_passes(tmp_path: Path) -> None:
    run, result = bench(tmp_path, "--model", "llama-3.1-8b")
    assert run.returncode == 0, run.stdout + run.stderr
    assert_rows(result)
    checked = {c["policy"] for c in result["checks"]}
    assert checked == set(POLICIES) - {"torch-adamw"}, checked
    assert all(c["passed"] for c in result["checks"]), result["checks"]
    assert result["passed"] and result["failed"] == []
    assert "all checks passed" in run.stdout


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any]]:
    run, result = bench(tmp_path_factory.mktemp("qwen3"), "--model", "qwen3-30b-a3b")
    return run.returncode, result


def test_every_policy_trains_qwen3_moe_and_its_checks_pass(
    qwen3: tuple[int, dict[str, Any]],
) -> None:
    _, result = qwen3
    assert_rows(result)
    assert len(result["checks"]) == 7 and all(c["passed"] for c in result["checks"]), result[
        "checks"
    ]


def test_selective_recompute_of_qwen3_moe_is_bitwise(qwen3: tuple[int, dict[str, Any]]) -> None:
    rc, result = qwen3
    selective = [c for c in result["checks"] if c["policy"] == "selective"]
    assert selective and selective[0]["passed"], selective
    assert rc == 0


def test_a_fault_in_one_policy_fails_the_run_naming_it(tmp_path: Path) -> None:
    run, result = bench(
        tmp_path,
        "--model",
        "llama-3.1-8b",
        "--policies",
        "keep,offload-mlp,cpu-adamw",
        "--inject-fault",
        "offload-mlp",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert result["failed"] == ["offload-mlp"], result["checks"]
    assert "checks FAILED: offload-mlp" in run.stdout
    bad = [c for c in result["checks"] if not c["passed"]]
    assert len(bad) == 1 and "gradients bitwise keep's (first differing:" in bad[0]["detail"]

"""spillway.plan(): the planner from Python, the CLI's JSON schema."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import spillway

BUILD = os.environ.get("SPILLWAY_BUILD", "")


def test_plan_returns_the_cli_schema() -> None:
    p = spillway.plan("Qwen3-30B-A3B", "gh200", micro_batch=2, seq_len=8192, ep=8, dp=8)
    assert p["schema"] == "spillway.plan/1"
    assert p["summary"]["feasible"] is True
    assert len(p["layers"]) == 48
    assert {t["action"] for layer in p["layers"] for t in layer["tensors"]} <= {
        "keep",
        "offload",
        "recompute",
    }


@pytest.mark.skipif(not BUILD, reason="needs SPILLWAY_BUILD (the CLI's build tree)")
def test_plan_equals_the_cli_json() -> None:
    args = [
        "--model",
        "Llama-3.1-8B",
        "--hardware",
        "h100-pcie",
        "--micro-batch",
        "1",
        "--seq-len",
        "4096",
        "--dp",
        "2",
        "--zero",
        "3",
        "--policy",
        "offload",
    ]
    out = subprocess.run(
        [os.path.join(BUILD, "bin", "spillway"), "plan", *args, "--json", "-"],
        check=False,
        capture_output=True,
        text=True,
    )
    cli = json.loads(out.stdout)
    py = spillway.plan(
        "Llama-3.1-8B", "h100-pcie", micro_batch=1, seq_len=4096, dp=2, zero=3, policy="offload"
    )
    assert py == cli


def test_bad_values_are_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match="micro_batch is 0"):
        spillway.plan(micro_batch=0)
    with pytest.raises(ValueError, match="optimizer"):
        spillway.plan(optimizer="gpu")
    with pytest.raises(ValueError, match="zero=2 contradicts"):
        spillway.plan(fsdp=True, zero=2)


def test_unknown_model_is_a_spillway_error() -> None:
    with pytest.raises(spillway.Error, match="neither a catalog model nor an existing file"):
        spillway.plan(model="no-such-model")


def test_infeasible_plan_is_returned_with_reasons() -> None:
    p = spillway.plan("Llama-3.1-70B", "h100-sxm", tp=8, policy="offload")
    assert p["summary"]["feasible"] is False
    assert p["summary"]["reasons"]


def test_offload_tensors_states_the_experiment() -> None:
    # Seed 000: exactly the three MLP activations in every layer that offloads.
    kw: dict[str, object] = dict(micro_batch=24, seq_len=4096, ep=8, dp=8, policy="offload")
    own = spillway.plan("Qwen3-30B-A3B", "gh200", **kw)  # type: ignore[arg-type]
    for names in ("mlp", ["mlp.gate_out", "mlp.up_out", "mlp.act"], "mlp.act,mlp.up_out,mlp"):
        p = spillway.plan("Qwen3-30B-A3B", "gh200", offload_tensors=names, **kw)  # type: ignore[arg-type]
        assert p["options"]["offload_tensors"] == ["mlp.gate_out", "mlp.up_out", "mlp.act"]
        for layer, mine in zip(p["layers"][:-1], own["layers"][:-1]):
            moved = {t["name"] for t in layer["tensors"] if t["action"] == "offload"}
            assert moved == {"mlp.gate_out", "mlp.up_out", "mlp.act"}
            assert layer["offload_bytes"] < mine["offload_bytes"]  # the planner adds expert_out
    assert "offload_tensors" not in own["options"]
    with pytest.raises(ValueError, match="offload_tensors is mlp.gate; no tensor of that name"):
        spillway.plan("Qwen3-30B-A3B", "gh200", offload_tensors=["mlp.gate"])
    with pytest.raises(ValueError, match="is selective; chooses its own tensors"):
        spillway.plan("Qwen3-30B-A3B", "gh200", policy="selective", offload_tensors="mlp")

"""`spillway checkpoint --out` writes what transformers loads (Note [Written checkpoints] in
src/inference/checkpoints.cpp): the config's architecture with every tensor under its name
(q_proj, k_proj and v_proj apart; Qwen3's q/k norms; a tied head left to the embedding), no
key missing or unexpected, and the logits `spillway serve` computes from it (the reference
model's, Note [Served outputs]) are transformers' within Note [Logprobs]'s tolerance."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from test_serve_hf import LOGPROB_TOL, complete, serve  # noqa: E402

BUILD = os.environ.get("SPILLWAY_BUILD", "")
pytestmark = pytest.mark.skipif(not BUILD, reason="needs SPILLWAY_BUILD (the CLI's build tree)")

PROMPT = [5, 17, 250, 3, 99, 42, 7, 7, 180, 64, 1, 200]


def tiny_moe(tmp: Path, **changes: Any) -> str:
    """data/nn/tiny-moe.json with `changes`, as a file."""
    cfg = json.loads((Path(__file__).parents[2] / "data" / "nn" / "tiny-moe.json").read_text())
    cfg.update(changes)
    path = tmp / f"cfg-{len(list(tmp.glob('cfg-*')))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def checkpoint(config: str, out: Path) -> None:
    """Writes the checkpoint, then scales its weights but the norms' by 15 (the reference
    model's init, normal(0, 0.02), gives near-uniform logits that would test little): both
    sides read the same file."""
    run = subprocess.run(
        [str(Path(BUILD) / "bin" / "spillway"), "checkpoint", "--config", config, "--seed", "3"]
        + ["--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    path = out / "model.safetensors"
    tensors = safetensors_torch.load_file(path)
    assert not any("qkv_proj" in k for k in tensors)
    scaled = {k: v if "norm" in k else v * 15.0 for k, v in tensors.items()}
    safetensors_torch.save_file(scaled, path, metadata={"format": "pt"})


def test_transformers_loads_spillway_checkpoints_with_no_key_missing_and_equal_logits(
    tmp_path: Path,
) -> None:
    qwen3 = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
    }
    qwen3_path = tmp_path / "qwen3.json"
    qwen3_path.write_text(json.dumps(qwen3))
    configs = {
        "tiny-moe": "tiny-moe",
        "tiny-moe-tied": tiny_moe(tmp_path, tie_word_embeddings=True),
        "qwen3-tied": str(qwen3_path),
    }
    models = tmp_path / "models"
    loaded: dict[str, Any] = {}
    for name, config in configs.items():
        checkpoint(config, models / name)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            models / name, output_loading_info=True, attn_implementation="eager"
        )
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            assert not info[kind], (name, kind, info[kind])
        keys = model.state_dict().keys()
        assert "model.layers.0.self_attn.q_norm.weight" in keys, name  # all Qwen3 families
        loaded[name] = model.eval()
    n_tied = sum(p.numel() for p in loaded["tiny-moe-tied"].parameters())
    n_untied = sum(p.numel() for p in loaded["tiny-moe"].parameters())
    assert n_untied - n_tied == 256 * 64  # one embedding matrix less
    proc, url = serve(models, tmp_path)
    try:
        for name, model in loaded.items():
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT])).logits[0, -1].double()
            hf = torch.log_softmax(logits, dim=-1)
            got = complete(
                url,
                {"model": name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 5},
            )
            lp = got["choices"][0]["logprobs"]
            token = got["choices"][0]["token_ids"][0]
            assert abs(lp["token_logprobs"][0] - hf[token].item()) <= LOGPROB_TOL, name
            for got_id, got_lp in lp["top_logprob_ids"][0]:
                assert abs(got_lp - hf[got_id].item()) <= LOGPROB_TOL, (name, got_id)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0

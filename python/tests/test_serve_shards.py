"""`spillway serve` on sharded checkpoints and on directories it must refuse (docs/serve.md,
Note [Sharded checkpoints], Note [Refused model directories]): a tiny transformers Llama saved
in several shards (model.safetensors.index.json and model-0000i-of-0000n.safetensors)
continues a prompt greedily as generate() does; a directory with one good and one bad model
serves the good one and names the bad one with its reason at startup; a missing shard is
named."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_serve_hf import BUILD, complete, serve, tiny

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not BUILD, reason="needs SPILLWAY_BUILD (the CLI's build tree)")


def save_sharded(model: Any, path: Path) -> list[str]:
    """Saves `model` in shards of at most 20 KB; returns the shard file names (several)."""
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2, shards
    assert not (path / "model.safetensors").exists()
    return shards


def greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], int]:
    """generate()'s greedy continuation, and how many of its tokens are clear of a tie."""
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    clear = 0
    for scores in ref.scores:
        top2 = torch.topk(scores[0], 2).values
        if (top2[0] - top2[1]).item() <= 2e-4 * max(1.0, scores[0].abs().max().item()):
            break
        clear += 1
    return ref.sequences[0, len(prompt) :].tolist(), clear


def run_serve(models: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(BUILD) / "bin" / "spillway"), "serve", "--models", str(models), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_sharded_llama_continues_as_transformers_generate(tmp_path: Path) -> None:
    model = tiny("llama", 3)
    save_sharded(model, tmp_path / "models" / "llama-sharded")
    prompt = [5, 17, 250, 3, 99, 42, 7, 7, 180]
    want, clear = greedy(model, prompt, 10)
    assert clear == 10
    proc, url = serve(tmp_path / "models", tmp_path)
    try:
        got = complete(
            url, {"model": "llama-sharded", "prompt": prompt, "max_tokens": 10, "temperature": 0}
        )
        assert got["choices"][0]["token_ids"] == want
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_a_bad_model_is_named_and_the_good_one_served(tmp_path: Path) -> None:
    models = tmp_path / "models"
    good = tiny("llama", 4)
    good.save_pretrained(models / "good", safe_serialization=True)
    tiny("llama", 0, mlp_bias=True).save_pretrained(models / "bad", safe_serialization=True)
    prompt = [1, 2, 3, 4, 5]
    want, clear = greedy(good, prompt, 6)
    assert clear == 6
    proc, url = serve(models, tmp_path)
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            listed = [m["id"] for m in json.loads(r.read())["data"]]
        assert listed == ["good"]
        got = complete(url, {"model": "good", "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert got["choices"][0]["token_ids"] == want
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out = proc.stdout.read().decode() if proc.stdout else ""
    assert proc.returncode == 0, out
    assert "  model good: llama" in out, out
    refused = [line for line in out.splitlines() if line.startswith("  refused bad: ")]
    assert len(refused) == 1 and "mlp_bias" in refused[0], out


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    models = tmp_path / "models"
    shards = save_sharded(tiny("llama", 5), models / "llama-x")
    (models / "llama-x" / shards[1]).unlink()
    r = run_serve(models)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refused llama-x:" in r.stderr, r.stderr
    assert shards[1] in r.stderr and "is missing" in r.stderr, r.stderr

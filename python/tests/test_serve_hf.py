"""`spillway serve` on Hugging Face's own checkpoints: a tiny LlamaForCausalLM with random
weights, saved by save_pretrained (q, k and v apart; the head tied or not), served over HTTP,
continues a prompt greedily as transformers' own generate() does (docs/serve.md, Note
[Checkpoint resolution]); a Qwen3 checkpoint (q/k norms the reference model does not run)
is refused at startup, naming the tensor."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BUILD = os.environ.get("SPILLWAY_BUILD", "")
pytestmark = pytest.mark.skipif(not BUILD, reason="needs SPILLWAY_BUILD (the CLI's build tree)")


def tiny_llama(seed: int, tied: bool) -> Any:
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        # Larger weights than the default 0.02: logits spread enough that greedy choices are
        # clear of the tolerance (the default init's top two are often within 1e-4).
        initializer_range=0.3,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def serve(models: Path, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tmp / "port"
    proc = subprocess.Popen(
        [
            str(Path(BUILD) / "bin" / "spillway"),
            "serve",
            "--models",
            str(models),
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--profile",
            "7g.96gb",
            "--rate-scale",
            "1e-2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    for _ in range(300):
        if port_file.exists():
            return proc, f"http://127.0.0.1:{port_file.read_text().strip()}"
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"spillway serve exited {proc.returncode}: {out}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("spillway serve did not listen")


def complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_served_llama_continues_as_transformers_generate(tmp_path: Path) -> None:
    models = tmp_path / "models"
    hf = {
        name: tiny_llama(seed, tied)
        for name, seed, tied in (("untied", 1, False), ("tied", 2, True))
    }
    for name, model in hf.items():
        model.save_pretrained(models / name, safe_serialization=True)
    proc, url = serve(models, tmp_path)
    try:
        prompt = [5, 17, 250, 3, 99, 42, 7, 7, 180]
        for name, model in hf.items():
            n = 10
            with torch.no_grad():
                ref = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=n,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
            want = ref.sequences[0, len(prompt) :].tolist()
            got = complete(
                url, {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0}
            )
            tokens = got["choices"][0]["token_ids"]
            assert len(tokens) == n
            # Token for token, up to a choice within the tolerance of a tie (Note [Served
            # outputs]): none here.
            compared = 0
            for t, scores in enumerate(ref.scores):
                top2 = torch.topk(scores[0], 2).values
                tol = 1e-4 * max(1.0, scores[0].abs().max().item())
                if (top2[0] - top2[1]).item() <= 2 * tol:
                    break
                assert tokens[t] == want[t], (name, t, tokens, want)
                compared += 1
            assert compared == n, (name, compared)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_a_qwen3_checkpoint_with_qk_norms_is_refused(tmp_path: Path) -> None:
    cfg = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(
        tmp_path / "models" / "qwen3", safe_serialization=True
    )
    r = subprocess.run(
        [
            str(Path(BUILD) / "bin" / "spillway"),
            "serve",
            "--models",
            str(tmp_path / "models"),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "_norm.weight" in r.stderr and "no use" in r.stderr, r.stderr

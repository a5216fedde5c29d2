"""`spillway serve` on Hugging Face's own checkpoints: tiny models with random weights, saved by
save_pretrained (q, k and v apart; the head tied or not), served over HTTP, continue a prompt
greedily as transformers' own generate() does (docs/serve.md, Note [Checkpoint resolution]):
Llama, Llama with attention biases, Qwen2 (q, k, v biases), Qwen3 (per-head q/k norms, a
head_dim that is not hidden / heads; Note [Served attention extras]). A checkpoint with what
the decoder does not compute (MLP biases, dynamic RoPE) is refused at startup, naming it.
RoPE as transformers scales it: llama3, linear, yarn (Note [RoPE scaling])."""

from __future__ import annotations

import copy
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


# Several prompts: 9 tokens, one, and 24 (each longer than the 4-key sliding windows but the
# one); 10 tokens generated after each.
PROMPTS = [[5, 17, 250, 3, 99, 42, 7, 7, 180], [42], [(37 * i + 11) % 300 for i in range(24)]]

# Note [Logprobs]: how far a served log-probability may be from transformers' (fp32 logits
# there, fp32 with double accumulations here; the largest seen is below 3e-5).
LOGPROB_TOL = 5e-5


def tiny(family: str, seed: int, tied: bool = False, **extra: Any) -> Any:
    """A tiny model of `family` (llama, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, mistral,
    gemma2, gemma3_text) with random weights, biases and norm weights included (transformers
    starts biases at 0 and norms at 1, Gemma's at 0: they would test nothing)."""
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[family]
    shape: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tied,
        # Larger weights than the default 0.02: logits spread enough that greedy choices are
        # clear of the tolerance (the default init's top two are often within 1e-4).
        "initializer_range": 0.3,
    }
    cfg = config_class(**{**shape, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.3)
            elif family.startswith("gemma") and "norm" in name:
                p.normal_(0.0, 0.3)  # Gemma's norms multiply by 1 + w
            elif family.startswith("gemma") and "embed_tokens" in name:
                # Scaled by sqrt(hidden) = 8, the default init would drown the layers' outputs
                # (each normed to ~1 by the sandwich) and the layers would not be tested.
                p.normal_(0.0, 0.04)
            elif "q_norm" in name or "k_norm" in name:
                p.normal_(1.0, 0.3)
    return model


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


def header(path: Path) -> bytes:
    """A safetensors file's JSON header."""
    with open(path, "rb") as f:
        return f.read(int.from_bytes(f.read(8), "little"))


def assert_served_as_generate(
    hf: dict[str, Any], tmp_path: Path, bf16: tuple[str, ...] = (), fused: tuple[str, ...] = ()
) -> None:
    """Each model of `hf`, saved and served, continues a prompt as generate() does. Those named
    in `bf16` are saved in bf16 and compared with transformers computing in fp32 from the
    same rounded weights (the decoder widens bf16 weights to fp32); those in `fused` keep
    transformers 5's fused experts (save_original_format=False)."""
    models = tmp_path / "models"
    for name, model in hf.items():
        saved = model
        if name in bf16:
            # Saved from a bf16 copy; the reference keeps its fp32 buffers (RoPE's inv_freq:
            # rounded to bf16 it would move the logits by ~5e-4) and its parameters rounded.
            saved = copy.deepcopy(model).to(torch.bfloat16)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).to(torch.float32))
        saved.save_pretrained(
            models / name, safe_serialization=True, save_original_format=name not in fused
        )
        h = header(models / name / "model.safetensors")
        if name in bf16:
            assert b'"BF16"' in h and b'"F32"' not in h, name
        assert (b"experts.gate_up_proj" in h) == (name in fused), name
    proc, url = serve(models, tmp_path)
    compared_of = dict.fromkeys(hf, 0)
    n = 10
    try:
        for name, model, prompt in ((k, m, p) for k, m in hf.items() for p in PROMPTS):
            with torch.no_grad():
                ref = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=n,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                    output_logits=True,
                )
            want = ref.sequences[0, len(prompt) :].tolist()
            got = complete(
                url,
                {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5},
            )
            tokens = got["choices"][0]["token_ids"]
            assert len(tokens) == n
            # Note [Logprobs]: each served token's log-probability and the top 5 (ids and
            # log-probabilities) are transformers' log-softmax of its logits, within
            # LOGPROB_TOL, while the tokens agree.
            lp = got["choices"][0]["logprobs"]
            for t, logits in enumerate(ref.logits):
                if tokens[: t + 1] != want[: t + 1]:
                    break
                hf = torch.log_softmax(logits[0].double(), dim=-1)
                assert abs(lp["token_logprobs"][t] - hf[tokens[t]].item()) <= LOGPROB_TOL, (name, t)
                for got_id, got_lp in lp["top_logprob_ids"][t]:
                    assert abs(got_lp - hf[got_id].item()) <= LOGPROB_TOL, (name, t, got_id)
                    assert (hf > hf[got_id] + LOGPROB_TOL).sum().item() < 5, (name, t, got_id)
            # Token for token, up to a choice within the tolerance of a tie (Note [Served
            # outputs]), which ends the prompt's comparison.
            compared = 0
            for t, scores in enumerate(ref.scores):
                top2 = torch.topk(scores[0], 2).values
                tol = 1e-4 * max(1.0, scores[0].abs().max().item())
                if (top2[0] - top2[1]).item() <= 2 * tol:
                    break
                assert tokens[t] == want[t], (name, prompt, t, tokens, want)
                compared += 1
            compared_of[name] += compared
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0
    # A near tie is rare: most of each model's tokens are compared.
    for name, compared in compared_of.items():
        assert compared >= 2 * n, (name, compared)


def test_served_llama_continues_as_transformers_generate(tmp_path: Path) -> None:
    assert_served_as_generate(
        {
            "untied": tiny("llama", 1),
            "tied": tiny("llama", 2, tied=True),
            "biased": tiny("llama", 3, attention_bias=True),  # q, k, v and o biases
            "llama-bf16": tiny("llama", 28, attention_bias=True),
        },
        tmp_path,
        bf16=("llama-bf16",),
    )


def test_served_qwen2_qwen3_and_qwen3_moe_continue_as_transformers_generate(tmp_path: Path) -> None:
    assert_served_as_generate(
        {
            "qwen2": tiny("qwen2", 4),  # biases on q, k and v
            # Per-head q/k norms before RoPE; head_dim 32, not hidden / heads (16).
            "qwen3": tiny("qwen3", 5, head_dim=32),
            "qwen3-tied": tiny("qwen3", 6, tied=True, head_dim=16),
            # Routed experts (transformers saves them one by one) under q/k norms; top-k
            # weights renormalized or not, as the config says.
            "qwen3-moe": tiny(
                "qwen3_moe", 11, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
            ),
            "qwen3-moe-norm": tiny(
                "qwen3_moe",
                12,
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                mlp_only_layers=[0],
            ),
            "qwen2-bf16": tiny("qwen2", 29),
            "qwen3-bf16": tiny("qwen3", 30, head_dim=32),
            "qwen3-moe-bf16": tiny(
                "qwen3_moe", 31, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
            ),
        },
        tmp_path,
        bf16=("qwen2-bf16", "qwen3-bf16", "qwen3-moe-bf16"),
    )


def test_served_mixtral_continues_as_transformers_generate(tmp_path: Path) -> None:
    """Mixtral's experts under block_sparse_moe (w1, w3, w2), its router renormalizing the
    top-k weights."""
    assert_served_as_generate({"mixtral": tiny("mixtral", 13, num_local_experts=4)}, tmp_path)


def test_served_fused_experts_continue_as_transformers_generate(tmp_path: Path) -> None:
    """Note [Checkpoint resolution]: transformers 5's own layout of the experts
    (mlp.experts.gate_up_proj, mlp.experts.down_proj: every expert in one tensor), which
    save_pretrained writes with save_original_format=False, for Qwen3-MoE, Qwen2-MoE (beside
    its shared expert) and Mixtral."""
    moe: dict[str, Any] = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
    assert_served_as_generate(
        {
            "qwen3-moe": tiny("qwen3_moe", 24, **moe),
            "qwen2-moe": tiny("qwen2_moe", 25, shared_expert_intermediate_size=48, **moe),
            "mixtral": tiny("mixtral", 26, num_local_experts=4),
            "mixtral-bf16": tiny("mixtral", 27, num_local_experts=4),
        },
        tmp_path,
        bf16=("mixtral-bf16",),
        fused=("qwen3-moe", "qwen2-moe", "mixtral", "mixtral-bf16"),
    )


def test_served_sliding_windows_continue_as_transformers_generate(tmp_path: Path) -> None:
    """Windows of 4 keys under a 9-token prompt and 10 new tokens: Mistral's in every layer,
    Qwen2's from max_window_layers on (its first layer full)."""
    assert_served_as_generate(
        {
            "mistral": tiny("mistral", 14, sliding_window=4),
            "mistral-bf16": tiny("mistral", 32, sliding_window=4),
            "qwen2-window": tiny(
                "qwen2", 15, use_sliding_window=True, sliding_window=4, max_window_layers=1
            ),
        },
        tmp_path,
        bf16=("mistral-bf16",),
    )


def test_served_rope_scaling_continues_as_transformers_generate(tmp_path: Path) -> None:
    """Note [RoPE scaling]: llama3, linear and yarn frequencies as transformers computes them,
    rope_theta read from rope_parameters (transformers 5 writes it there, not beside)."""
    assert_served_as_generate(
        {
            "theta": tiny("llama", 7, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
            "llama3": tiny(
                "llama",
                8,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            ),
            "linear": tiny(
                "qwen2",
                9,
                rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
            ),
            "yarn": tiny(
                "qwen3",
                10,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            ),
        },
        tmp_path,
    )


def test_served_dynamic_rope_continues_as_transformers_generate(tmp_path: Path) -> None:
    """Note [Dynamic RoPE]: past max_position_embeddings (12: the 9-token prompt and 10 new
    tokens cross it) each step rotates at the frequencies of the sequence's new length, the
    cached keys keeping theirs, as transformers' dynamic NTK RoPE does for one sequence."""
    assert_served_as_generate(
        {
            "dynamic": tiny(
                "llama",
                16,
                max_position_embeddings=12,
                rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 3.0},
            ),
        },
        tmp_path,
    )


def test_served_gemma_continues_as_transformers_generate(tmp_path: Path) -> None:
    """Note [Served Gemma]: (1 + w) norms (q/k norms too), the scaled embedding, sandwich
    norms, GeGLU, query_pre_attn_scalar, soft caps (Gemma 2's defaults, 50 and 30, or tight
    ones; Gemma 3's none), tied heads and not, sliding layers (Gemma 2: even layers; Gemma 3: as
    layer_types says, with their own RoPE beside the global layers' scaled one); bf16 and
    fp32 checkpoints."""
    gemma: dict[str, Any] = {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 4}
    gemma3 = {
        **gemma,
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    assert_served_as_generate(
        {
            "gemma2": tiny("gemma2", 17, tied=True, **gemma),
            "gemma2-bf16": tiny("gemma2", 18, tied=True, **gemma),
            "gemma3": tiny("gemma3_text", 19, tied=True, **gemma3),
            "gemma2-capped": tiny(
                "gemma2", 20, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, **gemma
            ),
            "gemma3-bf16": tiny("gemma3_text", 21, tied=True, **gemma3),
        },
        tmp_path,
        bf16=("gemma2-bf16", "gemma3-bf16"),
    )


def test_served_qwen2_moe_continues_as_transformers_generate(tmp_path: Path) -> None:
    """Qwen2-MoE: routed experts beside a shared expert under a sigmoid gate, q/k/v biases;
    in fp32 and bf16."""
    moe: dict[str, Any] = {
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    assert_served_as_generate(
        {
            "qwen2-moe": tiny("qwen2_moe", 22, **moe),
            "qwen2-moe-bf16": tiny("qwen2_moe", 23, norm_topk_prob=True, **moe),
        },
        tmp_path,
        bf16=("qwen2-moe-bf16",),
    )


@pytest.mark.parametrize(
    ("family", "extra", "named"),
    [
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        # transformers' Gemma 3 attention ignores it: what the checkpoint means is ambiguous.
        ("gemma3_text", {"attn_logit_softcapping": 3.0, "head_dim": 16}, "attn_logit_softcapping"),
    ],
)
def test_a_checkpoint_the_decoder_does_not_compute_is_refused(
    tmp_path: Path, family: str, extra: dict[str, Any], named: str
) -> None:
    tiny(family, 0, **extra).save_pretrained(
        tmp_path / "models" / "model-x", safe_serialization=True
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
    assert named in r.stderr, r.stderr

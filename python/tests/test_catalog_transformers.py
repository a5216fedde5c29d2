"""The planner's model catalog against transformers as ground truth.

For every decoder-only model type transformers offers a config class for, the default
config is written twice, by `save_pretrained` (config.json, without the generic
PretrainedConfig fields) and whole (`to_dict()`, use_diff=False, with them), and `spillway
plan --model <file>` must either accept it with exactly the parameter count transformers
builds on the meta device (the "params" of the plan's JSON), or refuse it with an error
naming the model type. Nothing is downloaded: the configs come from
transformers' config classes.

Decoder-only: the types of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES whose config is not an
encoder-decoder and that are not encoders with a causal-LM head (the types of
MODEL_FOR_MASKED_LM_MAPPING_NAMES: bert, roberta, ...). SUPPORTED lists the types spillway
plans; every other decoder-only type must be refused by name.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

BUILD = os.environ.get("SPILLWAY_BUILD", "")
pytestmark = pytest.mark.skipif(not BUILD, reason="needs SPILLWAY_BUILD (the CLI's build tree)")

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers.models.auto import modeling_auto  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

# The decoder-only types spillway plans (docs/models.md): accepted and exact to the parameter.
SUPPORTED = frozenset(
    {
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "falcon_h1",
        "falcon_mamba",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "glm4_moe",
        "got_ocr2",
        "gpt_oss",
        "granitemoehybrid",
        "jamba",
        "kimi_linear",
        "llama",
        "llama4",
        "llama4_text",
        "mamba",
        "mamba2",
        "minimax",
        "mistral",
        "mixtral",
        "moss_transcribe_diarize",
        "nemotron_h",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_moe",
        "qwen3_next",
        "recurrent_gemma",
        "zamba2",
    }
)

# Supported types whose transformers default config is refused, and the field named: the
# defaults are not models spillway can plan (DeepSeek-V2's leaves the routed top-k unset;
# GLM-4.5's has 96 heads on a 4096 hidden size without a head_dim, which transformers floors
# to 42).
REFUSED_DEFAULTS = {"deepseek_v2": "num_experts_per_tok", "glm4_moe": "num_attention_heads"}

# Submodules of a multimodal wrapper that spillway does not plan (a note says so).
_TOWERS = ("vision_tower", "audio_tower", "multi_modal_projector", "vision_model", "audio_model")


@functools.cache
def decoder_only_types() -> list[str]:
    """The decoder-only model types transformers offers a config class for."""
    masked = set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    out = []
    for t in sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if t in masked or t not in CONFIG_MAPPING:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                cfg = CONFIG_MAPPING[t]()
            except Exception:  # no valid default (gemma4_assistant): nothing to write
                continue
            if getattr(cfg, "is_encoder_decoder", False):
                continue
        out.append(t)
    return out


def meta_weights(model_type: str) -> int:
    """transformers' count of the language model's weights, built on the meta device: its
    parameters (tied ones once) and the routers' e_score_correction_bias (a buffer in
    transformers, a tensor of the checkpoint and of spillway's count: DeepSeek-V3,
    Kimi-Linear, Nemotron-H; other buffers, such as MiniMax's decay tables, are computed),
    the towers of a multimodal wrapper left out."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = CONFIG_MAPPING[model_type]()
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():  # tied parameters are listed once
        if any(part in _TOWERS for part in name.split(".")) or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    for name, module in model.named_modules():
        if any(part in _TOWERS for part in name.split(".")):
            continue
        bias = module._buffers.get("e_score_correction_bias")
        if bias is not None:
            total += bias.numel()
    return total


def write_configs(model_type: str, root: Path) -> dict[str, Path]:
    """The default config as save_pretrained writes it and whole (use_diff=False)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = CONFIG_MAPPING[model_type]()
        saved = root / model_type
        cfg.save_pretrained(saved)
        whole = root / f"{model_type}.whole.json"
        whole.write_text(cfg.to_json_string(use_diff=False))
    return {"save_pretrained": saved / "config.json", "to_dict": whole}


def plan(config: Path) -> tuple[int, dict[str, Any] | None, str]:
    out = subprocess.run(
        [os.path.join(BUILD, "bin", "spillway"), "plan", "--model", str(config), "--json", "-"],
        check=False,
        capture_output=True,
        text=True,
    )
    doc = json.loads(out.stdout) if out.returncode in (0, 3) else None
    return out.returncode, doc, out.stderr


def test_the_decoder_only_list_holds_every_supported_type() -> None:
    types = decoder_only_types()
    assert SUPPORTED <= set(types), sorted(SUPPORTED - set(types))
    assert "bert" not in types and "bart" not in types  # an encoder, an encoder-decoder
    assert "gpt2" in types and "llama" in types


def test_every_decoder_only_type_is_exact_or_refused_by_name(tmp_path: Path) -> None:
    types = decoder_only_types()
    configs = [(t, form, path) for t in types for form, path in write_configs(t, tmp_path).items()]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda c: plan(c[2]), configs))
    wrong: list[str] = []
    counts: dict[str, int] = {}
    for (t, form, path), (rc, doc, err) in zip(configs, results):
        # The type as written (gpt-sw3's config says "gpt2"; a wrapper's text_config its own).
        written = json.loads(path.read_text())
        names = {t, written.get("model_type", t), written.get("text_config", {}).get("model_type")}
        named = any(n and re.search(rf'"{re.escape(n)}"|\({re.escape(n)}\)', err) for n in names)
        if t in REFUSED_DEFAULTS:
            if rc != 1 or not named or f'"{REFUSED_DEFAULTS[t]}"' not in err:
                wrong.append(f"{t} ({form}): exit {rc}, not refused as expected: {err.strip()}")
        elif t in SUPPORTED:
            if doc is None:
                wrong.append(f"{t} ({form}): refused: {err.strip()}")
                continue
            if t not in counts:
                counts[t] = meta_weights(t)
            got = doc["model"]["params"]
            if got != counts[t]:
                wrong.append(
                    f"{t} ({form}): planned {got:,} parameters, transformers {counts[t]:,}"
                )
        elif rc != 1 or not named or "not supported" not in err:
            wrong.append(f"{t} ({form}): exit {rc}, not refused by name: {err.strip()[:300]}")
    assert not wrong, "\n".join(wrong)

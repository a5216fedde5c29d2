"""Note [Names of Hugging Face tensors]: the planner's name of each saved tensor of a decoder
block, from the Hugging Face module paths around it (the rules offload_activations names
tensors by with a plan or offload_tensors; docs/python.md lists them).
"""

from __future__ import annotations

import functools
import re

# Note [Names of Hugging Face tensors]: with a plan, a saved tensor of a decoder block gets
# the planner's name (docs/plan-schema.md) from the Hugging Face module paths around it:
# first by what produced it or was given it (the output of `input_layernorm` is
# attn.norm_out, the input of `post_attention_layernorm` is mlp.input), else by the
# innermost running module that names its saved tensors (what `o_proj` saves is
# attn.out_proj_in). A tensor no rule names is "block", which no plan offloads: kept.
# The rules match the last components of a path, so `mlp.experts.3.gate_proj` is an
# expert's gate projection; docs/python.md lists them.
_OUTPUT_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(input_layernorm|attention_norm|ln_1)$", "attn.norm_out"),
    (r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|c_attn|q_norm|k_norm)$", "attn.qkv_out"),
    (r"(^|\.)(post_attention_layernorm|ffn_norm|ln_2)$", "mlp.norm_out"),
    (r"(^|\.)(gate_proj|w1|gate_up_proj|act_fn|act)$", "mlp.gate_out"),
    (r"(^|\.)(up_proj|w3)$", "mlp.up_out"),
    (r"(^|\.)(router|gate)$", "moe.router_probs"),
    (r"experts\.(\d+\.)?(down_proj|w2)$", "moe.expert_out"),
)
_INPUT_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(input_layernorm|attention_norm|ln_1)$", "attn.input"),
    (r"(^|\.)(post_attention_layernorm|ffn_norm|ln_2)$", "mlp.input"),
    (r"(^|\.)(o_proj|out_proj|c_proj|dense)$", "attn.out_proj_in"),
    (r"(^|\.)(down_proj|w2)$", "mlp.act"),
)
_RUNNING_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(o_proj|out_proj)$", "attn.out_proj_in"),
    (r"(^|\.)(down_proj|w2)$", "mlp.act"),
    (r"(^|\.)(gate_proj|up_proj|gate_up_proj|w1|w3)$", "mlp.norm_out"),
    (r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj)$", "attn.norm_out"),
    (r"(^|\.)(input_layernorm|attention_norm)$", "attn.norm_out"),
    (r"(^|\.)(post_attention_layernorm|ffn_norm)$", "mlp.norm_out"),
    (r"(^|\.)experts$", "moe.dispatch_in"),
    (r"(^|\.)(router|gate)$", "moe.router_probs"),
    (r"(^|\.)(self_attn|attention|attn)$", "attn.qkv_out"),
)


# Every name the rules give a tensor: what offload_tensors may name.
_ADAPTER_NAMES: frozenset[str] = frozenset(
    name for rules in (_OUTPUT_RULES, _INPUT_RULES, _RUNNING_RULES) for _, name in rules
)


def _match(rules: tuple[tuple[str, str], ...], path: str) -> str:
    for pattern, name in rules:
        if re.search(pattern, path):
            return name
    return ""


@functools.lru_cache(maxsize=4096)
def _output_name(path: str) -> str:
    return _match(_OUTPUT_RULES, path)


@functools.lru_cache(maxsize=4096)
def _input_name(path: str) -> str:
    return _match(_INPUT_RULES, path)


@functools.lru_cache(maxsize=4096)
def _running_name(path: str) -> str:
    return _match(_RUNNING_RULES, path)

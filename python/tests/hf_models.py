"""Tiny Hugging Face models with random weights (no download): model code nobody here wrote."""

from __future__ import annotations

from typing import Any

import torch
import transformers


def tiny_llama(seed: int = 0, layers: int = 3, dtype: torch.dtype = torch.float32) -> Any:
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def tiny_qwen3_moe(
    seed: int = 0,
    layers: int = 3,
    dtype: torch.dtype = torch.float32,
    norm_topk_prob: bool = False,
) -> Any:
    cfg = transformers.Qwen3MoeConfig(
        norm_topk_prob=norm_topk_prob,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=128,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(cfg).to(dtype)


def tiny_jamba(seed: int = 0, layers: int = 4, dtype: torch.dtype = torch.float32) -> Any:
    """A Mamba hybrid: Mamba blocks on the slow path (no mamba kernels), an attention block
    every second layer, MoE every second layer."""
    cfg = transformers.JambaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
        vocab_size=128,
        max_position_embeddings=128,
        use_mamba_kernels=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.JambaForCausalLM(cfg).to(dtype)


def batch(
    seed: int = 1, batch_size: int = 2, seq_len: int = 32, vocab: int = 128
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}

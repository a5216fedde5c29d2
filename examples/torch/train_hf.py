"""Train a Hugging Face model with spillway's activation offload: two added lines.

A tiny Qwen3-MoE with random weights (no download) on CPU; on a GPU, move the model to
"cuda" and the same two lines offload to pinned host memory on the copy engines.

  PYTHONPATH=build/python python examples/torch/train_hf.py [--steps 5] [--plan] [--cpu-adamw]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import spillway
import spillway.torch  # added line 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--plan",
        action="store_true",
        help="offload what spillway.plan chooses for this model (else every "
        "saved tensor of the blocks but the last)",
    )
    ap.add_argument(
        "--cpu-adamw",
        action="store_true",
        help="step with spillway.torch.CPUAdamW (speculative, clipped at 1.0) instead of "
        "torch.optim.AdamW",
    )
    args = ap.parse_args()

    config = transformers.Qwen3MoeConfig(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    if args.cpu_adamw:  # the optimizer step on the CPU, speculated during backward
        opt: torch.optim.Optimizer = spillway.torch.CPUAdamW(
            model.parameters(), lr=1e-3, max_grad_norm=1.0
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    plan = None
    if args.plan:
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            config.to_json_file(f.name)
            plan = spillway.plan(f.name, "h100-pcie", micro_batch=4, seq_len=128, policy="hybrid")

    offload = spillway.torch.offload_activations(model, plan)  # added line 2 (once)
    for step in range(1, args.steps + 1):  # 1-based, as spillway's messages count steps
        ids = torch.randint(0, config.vocab_size, (4, 128))
        with offload:  # around forward and backward
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rep = offload.last_report()
        print(
            f"step {step}: loss {loss.item():.4f}, offloaded "
            f"{rep.get('d2h_bytes', 0) / 1e6:.1f} MB in {rep.get('tensors_offloaded', 0)} "
            f"tensors, reloaded {rep.get('h2d_bytes', 0) / 1e6:.1f} MB, stall "
            f"{rep.get('stall_ms', 0.0):.2f} ms"
        )
        if args.cpu_adamw:
            o = spillway.torch.report()["optimizer"]
            print(
                f"  CPUAdamW: {o['outcome']}, {o['cpu_optimizer_ms']:.1f} ms of CPU, "
                f"{o['step_call_ms']:.1f} ms in step()"
            )


if __name__ == "__main__":
    main()

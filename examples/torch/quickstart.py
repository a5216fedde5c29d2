"""The README's PyTorch start: a Hugging Face Llama trained with spillway's two added lines.

A tiny Llama with random weights (no download), on the GPU when there is one, else on the
CPU (where the "host memory" the activations go to is the same RAM: the run shows the
mechanism, not a saving). Its saved activations go to pinned host memory while the next
block computes and come back one block ahead of backward; the optimizer is spillway's
CPU AdamW, stepped on the CPU as backward makes each gradient final (on a GPU: bf16
parameters, fp32 master weights and moments in pinned host memory).

  pip install .            # from the repository root; needs torch and transformers
  python examples/torch/quickstart.py
"""

import torch
import transformers

import spillway.torch  # added line 1

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CPUAdamW keeps fp32 masters
config = transformers.LlamaConfig(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).to(device, dtype)
optimizer = spillway.torch.CPUAdamW(model.parameters(), lr=1e-3)

offload = spillway.torch.offload_activations(model, pinned_bytes=64 << 20)  # added line 2
ids = torch.randint(0, config.vocab_size, (4, 256), device=device)  # one batch, learned
for step in range(1, 5):  # 1-based, as spillway's messages count steps
    with offload:  # around forward and backward
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    r = offload.last_report()
    print(
        f"step {step}: loss {loss.item():.4f}, offloaded {r['d2h_bytes'] / 1e6:.1f} MB in "
        f"{r['tensors_offloaded']} tensors, reloaded {r['h2d_bytes'] / 1e6:.1f} MB"
    )

"""Write a tiny Hugging Face model directory for `spillway serve`: random weights.

A Qwen2 of 2 layers (hidden 64) saved by transformers' save_pretrained, beside Qwen2.5's
real tokenizer and chat template (data/tokenizers/qwen2.5): the files a downloaded model
directory holds, so the server serves it with text and chat. The weights are random, so
the replies are fluent in nothing; they are what transformers' generate() would say.

  python examples/serve/tiny_hf_model.py models/tiny-qwen
"""

import lzma
import shutil
import sys
from pathlib import Path

import torch
import transformers

TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "qwen2.5"

transformers.logging.disable_progress_bar()
out = Path(sys.argv[1] if len(sys.argv) > 1 else "models/tiny-qwen")
config = transformers.Qwen2Config(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=151936,  # Qwen2.5's tokenizer
    tie_word_embeddings=True,
    max_position_embeddings=512,
    initializer_range=0.3,  # wider logits than the default: a clearer greedy choice
)
torch.manual_seed(0)
model = transformers.Qwen2ForCausalLM(config)
model.generation_config.eos_token_id = [151645, 151643]  # <|im_end|>, <|endoftext|>
model.save_pretrained(out, safe_serialization=True)
(out / "tokenizer.json").write_bytes(
    lzma.decompress((TOKENIZER / "tokenizer.json.xz").read_bytes())
)
shutil.copy(TOKENIZER / "tokenizer_config.json", out / "tokenizer_config.json")
n = sum(p.numel() for p in model.parameters())
print(f"wrote {out}: Qwen2, 2 layers, hidden 64, {n / 1e6:.1f}M parameters (random),", end=" ")
print("Qwen2.5's tokenizer")

"""The cost of running a plan's block-policy layers by selective recompute
(Note [Selective recompute of a plan], docs/PERFORMANCE.md).

A Hugging Face Llama (random weights, nothing downloaded) trains a step (forward + backward)
three ways, alternated, medians over the repeats:
  - plain: every activation kept (the baseline);
  - checkpoint: torch.utils.checkpoint around every block but the last (torch's own full
    recompute: only each block's input kept);
  - spillway: offload_activations with the planner's recompute plan (the block policy:
    each block's input and mlp.input kept, the rest recomputed), run by selective
    recompute: two dispatch modes see every aten op of a recomputed block, in its forward
    and again in its backward.
Prints each step's time, the ratios to plain and to checkpoint, and the bytes each holds
between forward and backward, so the per-op Python cost of the dispatch modes is in numbers.

  PYTHONPATH=build/python python bench/torch/bench_selective.py [--hidden 512 --layers 4
      --seq-len 512 --micro-batch 2 --repeats 7]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import transformers

import spillway
import spillway.torch as st


def model_of(args: argparse.Namespace) -> Any:
    cfg = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        vocab_size=1024,
        max_position_embeddings=args.seq_len,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default="", help="write the figures as JSON to this file")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (args.micro_batch, args.seq_len), generator=g)
    data = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}

    plain = model_of(args)
    ckpt = copy.deepcopy(plain)
    ours = copy.deepcopy(plain)
    if hasattr(ckpt, "activation_checkpointing_enable"):  # transformers >= 5.x
        ckpt.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt.config.use_cache = False
    with tempfile.TemporaryDirectory() as d:
        config = os.path.join(d, "config.json")
        ours.config.to_json_file(config)
        plan = spillway.plan(
            config,
            "h100-pcie",
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            dtype="fp32",
            policy="recompute",
        )
    offload = st.offload_activations(ours, plan, pinned_bytes=16 << 20)

    def step(model: Any) -> Callable[[], None]:
        def run() -> None:
            model(**data).loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    def ours_step() -> None:
        with offload:
            ours(**data).loss.backward()
        ours.zero_grad(set_to_none=True)

    runs: dict[str, Callable[[], None]] = {
        "plain": step(plain),
        "checkpoint": step(ckpt),
        "spillway": ours_step,
    }
    for fn in runs.values():  # warm-up, alternated below
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    saved = offload.last_report().get("selective_saved_bytes", {})
    ops = offload.last_report()["counts"].get("selective_layers", 0)
    print(
        f"Llama hidden {args.hidden}, {args.layers} layers, micro-batch {args.micro_batch} x "
        f"seq {args.seq_len}, fp32, CPU, {torch.get_num_threads()} threads; medians of "
        f"{args.repeats}, alternated"
    )
    for name in runs:
        print(
            f"  {name:<11} {med[name]:9.1f} ms   x{med[name] / med['plain']:.3f} of plain   "
            f"x{med[name] / med['checkpoint']:.3f} of checkpoint"
        )
    print(f"  spillway: {ops} layers by selective recompute, held per layer: {saved}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_ms": med, "times_ms": times, "saved_bytes": saved}, f, indent=2)


if __name__ == "__main__":
    main()

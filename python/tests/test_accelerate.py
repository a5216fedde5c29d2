"""CPUAdamW under Hugging Face ``accelerate`` with its FSDP plugin (``fsdp_version=2``), 2
gloo processes on CPU, a tiny Llama, ``accelerator.clip_grad_norm_`` every step: the losses
equal those of the same loop with ``torch.optim.AdamW`` within fp32 tolerance.

What accelerate does with the plugin on CPU is recorded, not assumed: accelerate 1.15 turns
a plugin into FSDP only for accelerators (``AcceleratorState``: the FSDP branch is taken for
multi-GPU-like types), so CPU processes run as ``MULTI_CPU`` (DDP) and the plugin is
ignored. The test asserts the type it saw, so that an accelerate which shards on CPU makes
it fail here, where the FSDP2 case then runs (CPUAdamW on FSDP2's shards on CPU is tested
without accelerate in test_distributed.py)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from hf_models import batch, tiny_llama  # noqa: E402

pytest.importorskip("accelerate")

STEPS = 3
LR = 0.01
CLIP = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(rank: int, world: int, port: int, ours: bool, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    import spillway.torch as st

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = tiny_llama(dtype=torch.float32)
    opt: Any = (
        st.CPUAdamW(model.parameters(), lr=LR, threads=1, recognize_clip=True)
        if ours
        else torch.optim.AdamW(model.parameters(), lr=LR)
    )
    model, opt = acc.prepare(model, opt)
    losses = []
    for s in range(STEPS):
        data = batch(seed=10 + s, batch_size=2 * world)
        part = {
            "input_ids": data["input_ids"][2 * rank : 2 * rank + 2],
            "labels": data["labels"][2 * rank : 2 * rank + 2],
            "use_cache": False,
        }
        opt.zero_grad()
        loss = model(**part).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(acc.gather(loss.detach()).mean().item())
    if rank == 0:
        torch.save({"losses": losses, "type": str(acc.distributed_type)}, out)
    # As test_distributed.py: gloo's static destructors abort now and then at exit.
    os._exit(0)


def run(ours: bool, tmp_path: Path) -> dict[str, Any]:
    out = str(tmp_path / f"accelerate-{int(ours)}.pt")
    mp.start_processes(
        worker, args=(2, free_port(), ours, out), nprocs=2, join=True, start_method="spawn"
    )
    got: dict[str, Any] = torch.load(out)
    return got


def test_cpu_adamw_under_accelerate_matches_torch_adamw(tmp_path: Path) -> None:
    theirs = run(False, tmp_path)
    ours = run(True, tmp_path)
    assert ours["type"] == theirs["type"] == "DistributedType.MULTI_CPU", (
        f"accelerate ran {ours['type']} with the FSDP plugin on CPU: FSDP on CPU is here, "
        "make this test check FSDP2's shards"
    )
    for a, b in zip(ours["losses"], theirs["losses"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert len(ours["losses"]) == STEPS

"""The CUDA path of offload_activations (skips without a GPU: none here). The adapter adopts
torch's current stream, offloads on the engine's D2H stream into pinned memory and reloads
into tensors allocated on the current stream; the loss and every gradient stay bitwise."""

from __future__ import annotations

import copy

import pytest
import torch

import spillway.torch as st
from hf_models import batch, tiny_llama, tiny_qwen3_moe
from test_offload_activations import assert_bitwise, step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3_moe])
def test_cuda_offload_is_bitwise(make: object) -> None:
    torch.use_deterministic_algorithms(True)
    model = make().cuda()  # type: ignore[operator]
    ref = copy.deepcopy(model)
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024, verify=True)
    for s in range(2):
        data = {
            k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in batch(seed=s).items()
        }
        want = step(ref, data)
        with offload:
            got = step(model, data)
        assert_bitwise(want, got)
        rep = offload.last_report()
        assert rep["d2h_bytes"] == rep["h2d_bytes"] > 0


def test_cuda_cpu_adamw_steps_bf16_parameters_as_the_emulated_device_path() -> None:
    # The device path on the CUDA backend against the same path on the host backend. The
    # loss is linear in the weights (sum of w * c), so every device computes the same
    # gradients (c in bf16): the same host step on them gives the same bits, with clipping
    # (large c) and a NaN step.
    runs = []
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(*shape).to(device=device, dtype=torch.bfloat16))
            for shape in ((256, 64), (64,), (8, 256))
        ]
        opt = st.CPUAdamW(params, lr=1e-2, max_grad_norm=0.5, device_emulation=device == "cpu")
        assert opt._flat_w is not None and opt._flat_w.device.type == device
        outcomes = []
        for s in range(5):
            g = torch.Generator().manual_seed(s)
            loss = torch.zeros((), device=device)
            for p in params:
                c = (torch.randn(p.shape, generator=g) * (30.0 if s == 2 else 0.001)).to(device)
                if s == 3:
                    c.view(-1)[0] = float("nan")
                loss = loss + (p.float() * c).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            outcomes.append(opt.last_step()["outcome"])
        assert outcomes == ["commit", "commit", "replay", "skip", "commit"]
        runs.append([p.detach().cpu() for p in params])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _cuda_batch(seed: int) -> dict[str, object]:
    return {
        k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in batch(seed=seed).items()
    }


def test_cuda_cpu_adamw_keeps_its_speculation_under_the_trainers_clip() -> None:
    # Note [Clips the speculation saw] and Note [Gradients that share a version counter] on
    # the CUDA device path: a clip under its bound every step (as transformers.Trainer
    # does) keeps the speculative step, bitwise the non-speculative optimizer's weights.
    runs = []
    for speculative in (True, False):
        model = tiny_llama(seed=25, dtype=torch.bfloat16).cuda()
        opt = st.CPUAdamW(model.parameters(), lr=3e-3, speculative=speculative, recognize_clip=True)
        why = []
        for s in range(3):
            model(**_cuda_batch(s)).loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
            assert norm.device.type == "cuda"  # where torch's own norm would be
            opt.step()
            opt.zero_grad()
            why.append(opt.last_step()["discarded_by"])
        if speculative:
            assert why == [None, None, None], why
        runs.append([p.detach().cpu() for p in model.parameters()])
        opt.close()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("depth", [1, 2])
def test_cuda_stream_weights_logits_are_the_resident_models(depth: int) -> None:
    # Weight streaming on the CUDA backend: pinned slabs, a ring of device slots filled on
    # the copy stream, torch's stream ordered after each copy by an event.
    model = tiny_llama(seed=3, layers=5).cuda()
    ref = copy.deepcopy(model)
    handle = st.stream_weights(model, depth=depth)
    with torch.no_grad():
        for s in (1, 2, 3):
            ids = batch(seed=s)["input_ids"].cuda()
            got = model(input_ids=ids, use_cache=False).logits
            want = ref(input_ids=ids, use_cache=False).logits
            assert torch.equal(got, want), f"pass {s}"
    rep = handle.report()
    assert rep["visits"] == 3 * 5 and rep["bytes"] >= sum(handle.layer_bytes)
    # Weights loaded after streaming are the ones streamed (Note [Weights written after
    # streaming]), on the CUDA ring too.
    other = tiny_llama(seed=4, layers=5).cuda()
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        ids = batch(seed=4)["input_ids"].cuda()
        assert torch.equal(
            model(input_ids=ids, use_cache=False).logits,
            other(input_ids=ids, use_cache=False).logits,
        )


def test_cuda_stream_weights_compiles_with_fullgraph() -> None:
    model = tiny_llama(seed=5, layers=4).cuda()
    ref = copy.deepcopy(model)
    st.stream_weights(model, depth=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    compiled_ref = torch.compile(ref, fullgraph=True)
    with torch.no_grad():
        for s in (1, 2):
            ids = batch(seed=s)["input_ids"].cuda()
            got = compiled(input_ids=ids, use_cache=False).logits
            want = compiled_ref(input_ids=ids, use_cache=False).logits
            assert torch.equal(got, want), f"pass {s}"


def two_linears() -> torch.nn.Sequential:
    """Two bf16 Linears on the GPU, seeded: the device path's small model."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256, bias=False), torch.nn.Linear(256, 64, bias=False)
    ).to(device="cuda", dtype=torch.bfloat16)


def clipped_at_step_2(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step s's input and loss weights: (model(x).float() * c).sum() clips at 0.5 in step 2
    only (a replay), not in the others."""
    g = torch.Generator().manual_seed(s)
    x = torch.randn(8, 64, generator=g).to("cuda", torch.bfloat16)
    c = torch.randn(8, 64, generator=g).to("cuda") * (30.0 if s == 2 else 0.01)
    return x, c


def test_cuda_cpu_adamw_takes_gradients_whose_hooks_run_on_another_stream() -> None:
    # Note [Gradients on a side stream]: the optimizer made on the default stream, forward and
    # backward on another one (their gradients' hooks run there, as FSDP2's run on its reduce
    # stream): the same bits as the run all on the default stream.
    runs = []
    for side in (False, True):
        model = two_linears()
        opt = st.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5)
        default = torch.cuda.current_stream()
        stream = torch.cuda.Stream() if side else default
        hooked: list[int] = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(
                lambda _p, seen=hooked: seen.append(torch.cuda.current_stream().cuda_stream)
            )
        outcomes = []
        for s in range(4):
            x, c = clipped_at_step_2(s)
            stream.wait_stream(default)
            with torch.cuda.stream(stream):
                (model(x).float() * c).sum().backward()
            default.wait_stream(stream)
            opt.step()
            opt.zero_grad()
            outcomes.append(opt.last_step()["outcome"])
        assert "replay" in outcomes
        if side:
            assert stream.cuda_stream in hooked, "no gradient hook ran on the side stream"
        runs.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_cuda_cpu_adamw_device_path_under_fsdp2_is_the_plain_device_path() -> None:
    # Note [FSDP2 on the device path], its CUDA twin (2 gloo processes test it emulated, in
    # test_distributed.py): one NCCL rank, so FSDP2's DTensor parameters hold the whole
    # tensors and its collectives move nothing; the same steps with clipping give the plain
    # (unsharded) device path's bits.
    import os
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        runs = []
        for sharded in (False, True):
            model = two_linears()
            if sharded:
                for layer in model:
                    fully_shard(layer)
                fully_shard(model)
            opt = st.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5)
            outcomes = []
            for s in range(4):
                x, c = clipped_at_step_2(s)
                (model(x).float() * c).sum().backward()
                opt.step()
                opt.zero_grad()
                outcomes.append(opt.last_step()["outcome"])
            assert "replay" in outcomes
            full = [getattr(p, "full_tensor", lambda p=p: p)() for p in model.parameters()]
            runs.append([p.detach().cpu() for p in full])
        for a, b in zip(*runs):
            assert torch.equal(a, b)
    finally:
        dist.destroy_process_group()

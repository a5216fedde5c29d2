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

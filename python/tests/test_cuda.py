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

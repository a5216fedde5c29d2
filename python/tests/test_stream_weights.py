"""spillway.torch.stream_weights: Hugging Face models whose decoder blocks compute from a ring
of slots the weight streamer fills from pinned host memory (here the host backend emulates
the device). Logits bitwise those of the resident model, pass after pass; a slow link only
makes compute wait; what is not supported (gradients, torch.compile) raises."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

import spillway.torch as st
from hf_models import batch, tiny_llama, tiny_qwen3_moe


def logits(model: nn.Module, seed: int) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=batch(seed=seed)["input_ids"], use_cache=False).logits
    return out


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3_moe])
@pytest.mark.parametrize("depth", [1, 2])
def test_eager_logits_are_bitwise_the_resident_models(make: Callable[..., Any], depth: int) -> None:
    model = make(seed=3, layers=5)
    ref = copy.deepcopy(model)
    handle = st.stream_weights(model, depth=depth)
    for seed in (1, 2, 3):  # the ring wraps around from pass to pass
        assert torch.equal(logits(model, seed), logits(ref, seed)), f"pass {seed}"
    rep = handle.report()
    assert rep["visits"] == 3 * 5
    # Every visit is a load or a hit (a block alone in its slot stays there: block 2 of 5
    # with 3 slots); at most `depth` loads are the next pass's, prefetched.
    assert 0 <= rep["loads"] + rep["hits"] - rep["visits"] <= depth
    assert rep["bytes"] >= sum(handle.layer_bytes)
    assert st.report()["stream"]["loads"] == rep["loads"]
    # The blocks' parameters live in the slots: depth + 1 buffers for 5 blocks.
    storages = {p.untyped_storage().data_ptr() for b in handle.blocks for p in b.parameters()}
    assert len(storages) == depth + 1


def test_a_slow_link_only_makes_compute_wait() -> None:
    model = tiny_llama(seed=4, layers=4)
    ref = copy.deepcopy(model)
    handle = st.stream_weights(model, depth=1, h2d_gbps=0.05)  # ~5 ms per block
    assert torch.equal(logits(model, 1), logits(ref, 1))
    assert handle.report()["stall_ms"] > 0


def test_torch_compile_over_streamed_blocks_is_refused_loudly() -> None:
    # Note [Compiled streaming]: traced, the ops break no graph, but the compiled graph would
    # write each slot's functional value back after it (stale weights in pass 2): refused
    # while tracing, for every backend, never a silent wrong answer.
    model = tiny_llama(seed=6, layers=3)
    st.stream_weights(model, depth=1)
    for backend in ("inductor", "aot_eager"):
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        with pytest.raises(Exception, match="torch.compile over streamed blocks"):
            logits(compiled, 1)
    torch._dynamo.reset()
    assert logits(model, 1).shape[-1] == 128  # eager still runs


def test_gradients_through_streamed_blocks_are_refused_loudly() -> None:
    model = tiny_llama(seed=7, layers=3)
    st.stream_weights(model, depth=1)
    with pytest.raises(RuntimeError, match="streams inference"):
        model(input_ids=batch(seed=1)["input_ids"], use_cache=False)


def test_remove_gives_the_parameters_back() -> None:
    model = tiny_llama(seed=8, layers=3)
    ref = copy.deepcopy(model)
    handle = st.stream_weights(model, depth=1)
    logits(model, 1)
    handle.remove()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach())
    storages = {p.untyped_storage().data_ptr() for b in handle.blocks for p in b.parameters()}
    assert len(storages) > 2  # each parameter its own memory again
    assert torch.equal(logits(model, 2), logits(ref, 2))


def test_bad_arguments_and_tied_blocks_are_refused() -> None:
    model = tiny_llama(seed=9, layers=3)
    with pytest.raises(ValueError, match="depth is 0"):
        st.stream_weights(model, depth=0)
    with pytest.raises(ValueError, match="needs >= 2"):
        st.stream_weights(model, layers=[model.model.layers[0]])
    layers = model.model.layers
    layers[1].mlp.up_proj.weight = layers[0].mlp.up_proj.weight
    with pytest.raises(ValueError, match="tied weights"):
        st.stream_weights(model)

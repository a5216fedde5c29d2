"""spillway.torch.stream_weights and what a user does to a streamed model's weights: its
state_dict is the resident model's (keys, order, values), load_state_dict writes new
weights that the next forward streams (never the ring's old copies), and a dropped model
frees its session (Note [A streamed model's state dict], Note [Weights written after
streaming], Note [Stream session lifetime])."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn

import spillway.torch as st
from hf_models import batch, tiny_llama
from spillway.torch import stream


def logits(model: nn.Module, seed: int) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=batch(seed=seed)["input_ids"], use_cache=False).logits
    return out


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].cpu(), b[k].cpu()), k


@pytest.mark.parametrize("training", [False, True])
def test_the_state_dict_is_the_resident_models(training: bool) -> None:
    model = tiny_llama(seed=5, layers=4)
    ref = copy.deepcopy(model)
    st.stream_weights(model, depth=1, training=training)
    same_state(model.state_dict(), ref.state_dict())
    buf = io.BytesIO()  # saved and loaded into a model that never streamed
    torch.save(model.state_dict(), buf)
    fresh = tiny_llama(seed=6, layers=4)
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    same_state(fresh.state_dict(), ref.state_dict())


@pytest.mark.parametrize("layers,depth", [(5, 1), (3, 2)])  # ring wraps / every block stays
def test_weights_loaded_after_streaming_are_the_ones_streamed(layers: int, depth: int) -> None:
    model = tiny_llama(seed=7, layers=layers)
    other = tiny_llama(seed=8, layers=layers)
    handle = st.stream_weights(model, depth=depth)
    logits(model, 1)  # the next pass's first blocks are prefetched, or all stay resident
    result = model.load_state_dict(other.state_dict())  # strict: nothing missing
    assert not result.missing_keys and not result.unexpected_keys
    for seed in (2, 3):
        assert torch.equal(logits(model, seed), logits(other, seed)), f"pass {seed}"
    assert handle.reloads == 1
    same_state(model.state_dict(), other.state_dict())
    handle.remove()
    assert torch.equal(logits(model, 4), logits(other, 4))


def test_a_load_of_the_wrong_shape_is_refused_as_torch_refuses_it() -> None:
    model = tiny_llama(seed=9, layers=3)
    st.stream_weights(model, depth=1)
    state = model.state_dict()
    key = "model.layers.1.mlp.up_proj.weight"
    state[key] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=f"size mismatch for {key}"):
        model.load_state_dict(state)


def test_a_dropped_model_frees_its_session() -> None:
    model = tiny_llama(seed=10, layers=3)
    ref = copy.deepcopy(model)
    st.stream_weights(model, depth=1)  # the handle is not kept: the model holds its session
    gc.collect()
    assert torch.equal(logits(model, 1), logits(ref, 1))
    (session,) = [s for s in stream._SESSIONS.values() if s.model is model]
    gone = weakref.ref(session)
    del session, model
    gc.collect()
    assert gone() is None  # with its pinned slabs and its slots

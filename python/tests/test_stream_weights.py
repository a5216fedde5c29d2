"""spillway.torch.stream_weights: Hugging Face models whose decoder blocks compute from a ring
of slots the weight streamer fills from pinned host memory (here the host backend emulates
the device). Logits bitwise those of the resident model, pass after pass, eager and compiled
with ``fullgraph=True`` (no graph break); a slow link only makes compute wait; training
(blocks re-streamed in backward) gives the resident losses, gradients and weights bitwise,
with torch's AdamW and spillway's CPUAdamW; tied blocks are refused."""

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
    # The blocks' weights live in the slabs and the depth + 1 slots only.
    assert all(p.numel() == 0 for b in handle.blocks for p in b.parameters())


def test_eager_calls_lend_the_slot_views_for_the_call_only() -> None:
    # Note [Eager streamed calls]: during a block's call its parameters are the streamed
    # weights (a hook inside sees them), under inference_mode too (the views were made
    # outside it); before and after, and after a call that raised, the empty placeholders.
    model = tiny_llama(seed=6, layers=3)
    ref = copy.deepcopy(model)
    handle = st.stream_weights(model, depth=1)
    proj = handle.blocks[1].mlp.down_proj
    want = ref.model.layers[1].mlp.down_proj.weight
    seen: list[bool] = []
    proj.register_forward_hook(lambda m, i, o: seen.append(torch.equal(m.weight, want)))
    ids = batch(seed=1)["input_ids"]
    with torch.inference_mode():
        got = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, logits(ref, 1)) and seen == [True]
    assert proj.weight.numel() == 0 and isinstance(proj.weight, nn.Parameter)

    def boom(m: nn.Module, i: Any) -> None:
        raise RuntimeError("boom")

    proj.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        logits(model, 2)
    assert all(
        isinstance(p, nn.Parameter) and p.numel() == 0
        for b in handle.blocks
        for p in b.parameters()
    )


def test_a_slow_link_only_makes_compute_wait() -> None:
    model = tiny_llama(seed=4, layers=4)
    ref = copy.deepcopy(model)
    handle = st.stream_weights(model, depth=1, h2d_gbps=0.05)  # ~5 ms per block
    assert torch.equal(logits(model, 1), logits(ref, 1))
    assert handle.report()["stall_ms"] > 0


def test_compiled_with_fullgraph_has_no_graph_break_and_the_same_bits() -> None:
    # Note [Streamed blocks]: the slot comes out of spillway::stream_acquire as a value, so
    # the compiled graph never writes weights back into the ring: pass after pass, inductor
    # gives the bits of the same model compiled resident, aot_eager those of eager.
    model = tiny_llama(seed=5, layers=4)
    ref = copy.deepcopy(model)
    handle = st.stream_weights(model, depth=1)
    ids = batch(seed=1)["input_ids"]
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(input_ids=ids, use_cache=False)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(model, fullgraph=True)
    compiled_ref = torch.compile(ref, fullgraph=True)
    for seed in (1, 2, 3):
        assert torch.equal(logits(compiled, seed), logits(compiled_ref, seed)), f"pass {seed}"
    torch._dynamo.reset()
    aot = torch.compile(model, fullgraph=True, backend="aot_eager")
    for seed in (1, 2):
        assert torch.equal(logits(aot, seed), logits(ref, seed)), f"aot_eager pass {seed}"
    assert handle.report()["visits"] >= 4 * 5


def test_gradients_in_an_inference_session_are_refused_loudly() -> None:
    model = tiny_llama(seed=7, layers=3)
    st.stream_weights(model, depth=1)
    with pytest.raises(RuntimeError, match="streams inference.*training=True"):
        model(input_ids=batch(seed=1)["input_ids"], use_cache=False)


def train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, accumulate: int = 1
) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Losses and, after each step's backward, every parameter's gradient."""
    losses, grads = [], []
    for s in range(steps):
        for a in range(accumulate):
            loss = model(**batch(seed=10 * s + a)).loss
            loss.backward()
            losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    return losses, grads


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3_moe])
@pytest.mark.parametrize("depth", [1, 2])
def test_training_steps_are_bitwise_the_resident_models(
    make: Callable[..., Any], depth: int
) -> None:
    # Note [Training through streamed blocks]: forward streams blocks 0..L-1, backward
    # re-streams them L-1..0 and recomputes each from its saved inputs; losses, gradients and
    # updated weights are the resident model's to the bit, step after step.
    L = 5
    model = make(seed=11, layers=L)
    ref = copy.deepcopy(model)
    handle = st.stream_weights(model, depth=depth, training=True)
    assert all(
        p.device.type == "cpu" and p.numel() > 0 for b in handle.blocks for p in b.parameters()
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    got = train(model, opt, 3)
    want = train(ref, opt_ref, 3)
    assert got[0] == want[0]
    for s, (g, w) in enumerate(zip(got[1], want[1])):
        assert same(g, w), f"gradients of step {s}"
    assert same(list(model.parameters()), list(ref.parameters()))
    rep = handle.report()
    assert rep["visits"] == 3 * 2 * L
    # Per step: L forward loads, and backward's past the turn (its depth + 1 blocks are hits).
    assert rep["loads"] == 3 * (L + L - (depth + 1))
    assert rep["hits"] == 3 * (depth + 1)
    # The updated weights reach the slabs: removing gives the trained model back.
    handle.remove()
    assert same(list(model.parameters()), list(ref.parameters()))
    with torch.no_grad():
        assert torch.equal(logits(model, 5), logits(ref, 5))


def test_training_accumulates_and_keeps_frozen_parameters_and_dropout_bitwise() -> None:
    model = tiny_llama(seed=12, layers=4)
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.model.layers[1].mlp.requires_grad_(False)
    model.model.embed_tokens.requires_grad_(False)  # block 0's input needs no gradient
    model.train()
    ref = copy.deepcopy(model)
    handle = st.stream_weights(model, depth=1, training=True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    torch.manual_seed(5)
    got = train(model, opt, 2, accumulate=2)
    torch.manual_seed(5)
    want = train(ref, opt_ref, 2, accumulate=2)
    assert got[0] == want[0]
    assert all(same(g, w) for g, w in zip(got[1], want[1]))
    assert same(list(model.parameters()), list(ref.parameters()))
    assert all(p.grad is None for p in handle.blocks[1].mlp.parameters())


def test_training_with_spillways_cpu_adamw_is_bitwise_its_resident_run() -> None:
    # The optimizer offloaded to the CPU beside streamed weights: CPUAdamW steps the
    # parameters where they live, in the pinned slabs.
    model = tiny_llama(seed=13, layers=4)
    ref = copy.deepcopy(model)
    st.stream_weights(model, depth=2, training=True)
    got = train(model, st.CPUAdamW(model.parameters(), lr=1e-2), 3)
    want = train(ref, st.CPUAdamW(ref.parameters(), lr=1e-2), 3)
    assert got[0] == want[0]
    assert same(list(model.parameters()), list(ref.parameters()))


def test_training_sessions_refuse_what_their_schedule_cannot_do() -> None:
    model = tiny_llama(seed=14, layers=3)
    st.stream_weights(model, depth=1, training=True)
    with pytest.raises(RuntimeError, match="without gradients would leave it waiting"):
        logits(model, 1)
    with pytest.raises(ValueError, match="sharded=True streams inference"):
        st.stream_weights(tiny_llama(seed=1, layers=3), training=True, sharded=True)
    # A forward whose backward never ran: the next forward is out of the schedule.
    model(**batch(seed=1))
    with pytest.raises(Exception, match="block|layer"):
        model(**batch(seed=2))


def test_remove_gives_the_parameters_back() -> None:
    model = tiny_llama(seed=8, layers=3)
    ref = copy.deepcopy(model)
    handle = st.stream_weights(model, depth=1)
    logits(model, 1)
    handle.remove()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert all(b is w for b, w in zip(model.model.layers, handle.blocks))  # back in place
    assert all(p.numel() > 0 for b in handle.blocks for p in b.parameters())
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
    # Note [Streamed calls without tie detection]: one block reaching a Linear twice.
    for training in (False, True):
        blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        blocks[1].append(blocks[1][0])
        with pytest.raises(
            ValueError,
            match=r"block 1 reaches a parameter under two names \(2\.weight, 2\.bias again\)",
        ):
            st.stream_weights(blocks, layers=list(blocks), training=training)

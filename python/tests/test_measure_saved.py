"""Note [A model as PyTorch runs it]: spillway.torch.measure_saved counts what each decoder
block of an eager Hugging Face model saves for backward, and spillway.plan(saved=...) plans
from it: per block within 5% of what autograd saves at another shape, for a Llama, a
Qwen3-MoE and a Mamba hybrid (Jamba), where the planner's own inventory (fused kernels)
says less."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any, Callable

import pytest
import torch

import spillway
import spillway.torch as st
from hf_models import batch, tiny_jamba, tiny_llama, tiny_qwen3_moe

MODELS: dict[str, Callable[[], Any]] = {
    "llama": tiny_llama,
    "qwen3-moe": tiny_qwen3_moe,
    "jamba": tiny_jamba,
}


def autograd_saved(model: Any, micro_batch: int, seq_len: int) -> list[int]:
    """Per decoder block, the bytes autograd holds for backward after one forward: every
    storage a pack hook sees while the block runs, once, the parameters' left out. Written
    apart from the adapter's census, on purpose."""
    blocks = list(model.model.layers)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where: list[int] = []
    seen: set[int] = set()
    totals = [0] * len(blocks)
    handles = []

    def enter(i: int) -> Callable[..., None]:
        return lambda m, a: where.append(i)

    def leave(m: Any, a: Any, o: Any) -> None:
        where.pop()

    for i, b in enumerate(blocks):
        handles.append(b.register_forward_pre_hook(enter(i)))
        handles.append(b.register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if where and not (t.is_leaf and t.requires_grad):
            s = t.untyped_storage()
            if s.data_ptr() not in params and s.data_ptr() not in seen and s.data_ptr():
                seen.add(s.data_ptr())
                totals[where[-1]] += s.nbytes()
        return t

    vocab = model.config.vocab_size
    args = batch(seed=7, batch_size=micro_batch, seq_len=seq_len, vocab=vocab)
    args.pop("labels")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(**args)
        del out
    finally:
        for h in handles:
            h.remove()
    return totals


def config_of(model: Any, tmp: str) -> str:
    path = os.path.join(tmp, "config.json")
    model.config.to_json_file(path)
    return path


def quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' slow-path notes (Mamba)
        return fn()


@pytest.mark.parametrize("name", list(MODELS))
def test_each_block_within_5_percent_of_what_autograd_saves(name: str) -> None:
    model = quiet(MODELS[name])
    measured = quiet(lambda: st.measure_saved(model, seq_lens=(16, 32)))
    assert len(measured.layers) == len(model.model.layers)
    # Another shape than the measured ones: two sequences of 48 tokens.
    truth = quiet(lambda: autograd_saved(model, 2, 48))
    predicted = measured.totals(2, 48)
    for i, (p, t) in enumerate(zip(predicted, truth)):
        assert t > 0
        assert abs(p - t) <= 0.05 * t, f"{name} block {i}: measured {p} bytes, autograd {t}"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_of(model, tmp)
        common: dict[str, Any] = dict(
            micro_batch=2, seq_len=48, dtype="fp32", policy="keep", hbm_budget_gb=1000.0
        )
        plan = spillway.plan(cfg, "gh200", saved=measured, **common)
        own = spillway.plan(cfg, "gh200", **common)
    assert plan["options"]["saved_as_run"] is True
    assert "saved_as_run" not in own["options"]
    for i, (layer, base, t) in enumerate(zip(plan["layers"], own["layers"], truth)):
        kept = sum(x["bytes"] for x in layer["tensors"] if x["action"] == "keep")
        assert abs(kept - t) <= 0.05 * t, f"{name} block {i}: the plan keeps {kept}, autograd {t}"
        fused = sum(x["bytes"] for x in base["tensors"])
        # The inventory assumes fused kernels: the eager block saves more than it says.
        assert t > 1.1 * fused, f"{name} block {i}: autograd {t} bytes, inventory {fused}"


def test_a_quadratic_attention_is_fitted_as_one() -> None:
    # The tiny Llama runs eager attention: its probabilities are seq_len x seq_len.
    model = tiny_llama()
    assert model.config._attn_implementation == "eager"
    measured = st.measure_saved(model, seq_lens=(16, 32))
    long = autograd_saved(model, 1, 128)  # 4x the longest measured
    for i, (p, t) in enumerate(zip(measured.totals(1, 128), long)):
        assert abs(p - t) <= 0.05 * t, f"block {i}: measured {p}, autograd {t}"


def test_auto_plans_from_what_its_first_step_saved() -> None:
    model = tiny_llama()
    args = batch(seq_len=32)
    off = st.offload_activations(model, "auto", hbm_budget_gb=1000.0, layer_fwd_ms=1.0)
    with off:
        model(**args).loss.backward()
    rep = off.last_report()
    assert rep["measured_step"]
    truth = autograd_saved(model, 2, 32)
    assert rep["saved_bytes"] == truth
    assert off.plan is not None and off.plan["options"]["saved_as_run"] is True
    kept = [sum(t["bytes"] for t in layer["tensors"]) for layer in off.plan["layers"]]
    for i, (k, t) in enumerate(zip(kept, truth)):
        assert abs(k - t) <= 0.05 * t, f"block {i}: the plan has {k} bytes, autograd {t}"
    off.remove()


def test_bad_measurements_are_refused() -> None:
    model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="seq_lens"):
        st.measure_saved(model, seq_lens=(32, 16))
    measured = st.measure_saved(model, seq_lens=(8, 16))
    with pytest.raises(ValueError, match="micro_batch=0"):
        measured.at(0, 16)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_of(model, tmp)
        with pytest.raises(ValueError, match="saved.*tp=2"):
            spillway.plan(cfg, "gh200", tp=2, saved=measured)
        with pytest.raises(ValueError, match="saved.*1 layers"):
            spillway.plan(cfg, "gh200", saved=measured.at(1, 16)[:1])
        with pytest.raises(ValueError, match=r"saved\[0\] is a int"):
            spillway.plan(cfg, "gh200", saved=[1, 2])
    with pytest.raises(ValueError, match="vocab_size"):
        st.measure_saved(torch.nn.Sequential(torch.nn.Linear(4, 4)), layers=[torch.nn.Linear(4, 4)])

"""spillway.torch.offload_activations on Hugging Face models (CPU, the host backend).

Every test that compares checks bitwise equality of the loss and of every gradient with
and without offload, and that the engine really moved bytes (else it could not fail)."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch

import spillway
import spillway.torch as st
from hf_models import batch, tiny_llama, tiny_qwen3_moe
from spillway.torch.adaptive import LINK_DRIFT

MODELS: dict[str, Callable[..., Any]] = {"llama": tiny_llama, "qwen3_moe": tiny_qwen3_moe}


def step(model: Any, data: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**data).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_bitwise(
    a: tuple[torch.Tensor, dict[str, torch.Tensor]], b: tuple[torch.Tensor, dict[str, torch.Tensor]]
) -> None:
    assert torch.equal(a[0], b[0]), f"loss {a[0].item()!r} != {b[0].item()!r}"
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), f"gradient of {name} differs"


def plan_of(model: Any, tmp_path: Any, **kwargs: Any) -> dict[str, Any]:
    """spillway.plan() of `model`'s config (h100-pcie, micro-batch 2 x seq 32 unless given)."""
    config = tmp_path / "config.json"
    model.config.to_json_file(str(config))
    kwargs = {"micro_batch": 2, "seq_len": 32, **kwargs}
    return spillway.plan(str(config), "h100-pcie", **kwargs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_loss_and_every_gradient_are_bitwise_equal(name: str) -> None:
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024, verify=True)
    for s in range(3):  # the pool is reused step after step
        data = batch(seed=s)
        want = step(ref, data)
        with offload:
            got = step(model, data)
        assert_bitwise(want, got)
        rep = offload.last_report()
        assert rep["tensors_offloaded"] > 0 and rep["d2h_bytes"] > 0
        assert rep["h2d_bytes"] == rep["d2h_bytes"], "every offloaded byte comes back"
        assert rep["counts"]["offloaded"] == rep["tensors_offloaded"]
        assert rep["fallback_kept"] == 0
    assert st.report()["offload"]["step"] == offload.last_report()["step"]


def test_backward_after_the_with_block_also_works() -> None:
    model = tiny_llama()
    ref = copy.deepcopy(model)
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024)
    data = batch()
    want = step(ref, data)
    model.zero_grad(set_to_none=True)
    with offload:
        loss = model(**data).loss
    loss.backward()  # the step ends when backward does
    got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert_bitwise(want, got)
    assert offload.last_report()["tensors_offloaded"] > 0


def test_bf16_model() -> None:
    model = tiny_llama(dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024)
    data = batch()
    want = step(ref, data)
    with offload:
        got = step(model, data)
    assert_bitwise(want, got)
    assert offload.last_report()["d2h_bytes"] > 0


def test_prefetch_depth_throttled_links_and_backpressure_keep_every_byte() -> None:
    model = tiny_qwen3_moe()
    ref = copy.deepcopy(model)
    offload = st.offload_activations(
        model,
        pinned_bytes=64 << 20,
        min_bytes=1024,
        prefetch_depth=2,
        inflight_bound_bytes=64 << 10,
        d2h_gbps=0.5,
        h2d_gbps=0.5,
        verify=True,
    )
    data = batch()
    want = step(ref, data)
    with offload:
        got = step(model, data)
    assert_bitwise(want, got)
    rep = offload.last_report()
    assert rep["backpressure_ms"] > 0.0, "a 64 KiB bound at 0.5 GB/s must hold offloads back"
    assert rep["d2h_bytes"] == rep["h2d_bytes"] > 0


def test_parameters_small_tensors_and_the_last_block_stay() -> None:
    model = tiny_llama(layers=3)
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024, keep_last=1)
    with offload:
        step(model, batch())
    rep = offload.last_report()
    counts = rep["counts"]
    assert counts.get("kept_parameters", 0) > 0  # the weights Linear saves
    assert counts.get("kept_small", 0) > 0  # the norms' [T, 1] statistics
    assert counts.get("kept_last_layers", 0) > 0
    offloaded_layers = {x["layer"] for x in rep["layers"] if x["d2h_bytes"] > 0}
    assert offloaded_layers == {0, 1}


def test_a_full_pinned_pool_keeps_tensors_on_the_device_and_says_so() -> None:
    model = tiny_llama()
    ref = copy.deepcopy(model)
    offload = st.offload_activations(model, pinned_bytes=64 << 10, min_bytes=1024)
    data = batch()
    want = step(ref, data)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with offload:
            got = step(model, data)
    assert_bitwise(want, got)
    rep = offload.last_report()
    assert rep["counts"]["kept_pinned_pool_full"] > 0
    assert any("pinned pool" in str(x.message) and "full" in str(x.message) for x in w)


def test_without_pinned_bytes_the_first_step_sizes_the_pool_and_says_so() -> None:
    model = tiny_llama()
    ref = copy.deepcopy(model)
    offload = st.offload_activations(model, min_bytes=1024)
    with pytest.warns(RuntimeWarning, match="offloading starts at step 2"):
        with offload:
            step(model, batch(seed=0))
    first = offload.last_report()
    assert first["sizing_step"] and first["would_offload_bytes"] > 0
    step(ref, batch(seed=0))
    data = batch(seed=1)
    want = step(ref, data)
    with offload:
        got = step(model, data)
    assert_bitwise(want, got)
    assert offload.last_report()["d2h_bytes"] > 0
    assert offload.pinned_bytes >= first["would_offload_bytes"]


def test_offloading_nothing_warns() -> None:
    model = tiny_llama()
    offload = st.offload_activations(model, pinned_bytes=1 << 20, min_bytes=1 << 40)
    with pytest.warns(RuntimeWarning, match="offloaded nothing"):
        with offload:
            step(model, batch())


def test_a_pool_larger_than_the_host_is_refused_with_the_numbers() -> None:
    model = tiny_llama()
    offload = st.offload_activations(model, pinned_bytes=1 << 50, min_bytes=1024)
    with pytest.raises(ValueError, match=r"pinned pool would be .* GB but the host has .* GB"):
        with offload:
            pass


def test_a_compiled_model_is_refused() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="compiled"):
        st.offload_activations(torch.compile(model))


def test_bad_arguments_name_the_argument() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="prefetch_depth is 0"):
        st.offload_activations(model, prefetch_depth=0)
    with pytest.raises(ValueError, match="min_bytes is -1"):
        st.offload_activations(model, min_bytes=-1)
    with pytest.raises(ValueError, match="no decoder blocks"):
        st.offload_activations(torch.nn.Linear(4, 4, bias=False).requires_grad_(False))


def test_retain_graph_second_backward_is_refused_loudly() -> None:
    model = tiny_llama()
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024)
    with offload:
        loss = model(**batch()).loss
        loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="offloaded in a step that has ended"):
        loss.backward()


@pytest.mark.parametrize("policy", ["offload", "selective", "hybrid", "recompute"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_plan_offloads_only_its_tensors_and_checkpoints_its_recompute_layers(
    name: str, policy: str, tmp_path: Any
) -> None:
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    plan = plan_of(model, tmp_path, policy=policy)
    planned = [
        {t["name"] for t in layer["tensors"] if t["action"] == "offload"}
        for layer in plan["layers"]
    ]
    # Layers that recompute anything run under checkpointing (a partial one selectively:
    # Note [Selective recompute of a plan]).
    recomputed = [
        i
        for i, layer in enumerate(plan["layers"])
        if layer["policy"] == "checkpoint"
        or any(t["action"] == "recompute" for t in layer["tensors"])
    ]
    assert recomputed, "the planner recomputes the last layer at least"
    runs = [0] * len(model.model.layers)
    for i, block in enumerate(model.model.layers):  # inside the block: seen by a recompute
        block.mlp.register_forward_pre_hook(lambda m, a, i=i: runs.__setitem__(i, runs[i] + 1))
    offload = st.offload_activations(model, plan, pinned_bytes=64 << 20, min_bytes=1024)
    data = batch()
    want = step(ref, data)
    with offload:
        got = step(model, data)
    assert_bitwise(want, got)
    rep = offload.last_report()
    # Every layer runs its forward once, and a recomputed one once more in backward.
    assert runs == [2 if i in recomputed else 1 for i in range(len(runs))]
    assert rep["counts"]["checkpointed_layers"] == len(recomputed)
    offloaded = {
        k.split(":", 1)[1]
        for k in rep["counts"]
        if k.startswith(("offloaded:", "selective_offloaded:"))
    }
    assert offloaded <= set().union(*planned)
    for layer in rep["layers"]:
        if layer["d2h_bytes"]:
            assert planned[layer["layer"]], f"layer {layer['layer']} offloads off-plan"
    if any(planned):
        assert rep["d2h_bytes"] > 0 and offloaded, "the plan's tensors must be found and moved"
    offload.remove()
    assert all(getattr(b.forward, "__self__", None) is b for b in model.model.layers)


def test_a_plan_of_another_model_is_refused() -> None:
    plan = spillway.plan("Llama-3.1-8B", "h100-pcie", policy="offload")
    with pytest.raises(ValueError, match="the plan has 32 layers, the model 3 decoder blocks"):
        st.offload_activations(tiny_llama(), plan)
    with pytest.raises(ValueError, match="schema spillway.plan/1"):
        st.offload_activations(tiny_llama(), {"layers": []})


def test_blocks_compiled_one_by_one_are_offloaded_and_stay_bitwise() -> None:
    # What torch.compile does with these hooks on this version (docs/python.md): a compiled
    # block's saved tensors (AOTAutograd's) still go through saved_tensors_hooks. aot_eager
    # keeps eager kernels, so the result is bitwise the eager one.
    model = tiny_llama()
    ref = copy.deepcopy(model)
    for block in model.model.layers:
        block.compile(backend="aot_eager")
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024)
    data = batch()
    want = step(ref, data)
    with offload:
        got = step(model, data)
    assert_bitwise(want, got)
    assert offload.last_report()["tensors_offloaded"] > 0


def test_an_evaluation_under_no_grad_ends_its_step_quietly() -> None:
    model = tiny_llama()
    ref = copy.deepcopy(model)
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "offloaded nothing" warning for an evaluation
        with offload, torch.no_grad():
            model(**batch())
    assert not offload._open
    data = batch(seed=3)
    want = step(ref, data)
    with offload:
        got = step(model, data)
    assert_bitwise(want, got)
    assert offload.last_report()["tensors_offloaded"] > 0


def test_a_nested_with_is_refused_by_name() -> None:
    model = tiny_llama()
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024)
    with pytest.raises(RuntimeError, match="already open"):
        with offload:
            with offload:
                pass
    # The offload is usable again after the refused step.
    with offload:
        loss = model(**batch()).loss
    loss.backward()
    assert offload.last_report()["tensors_offloaded"] > 0


def test_hugging_face_gradient_checkpointing_is_named_with_the_fix() -> None:
    model = tiny_llama()
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    model.train()
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024)
    with pytest.warns(RuntimeWarning, match="gradient checkpointing is on"):
        with offload:
            loss = model(**batch()).loss
        loss.backward()


def test_compiling_the_model_after_offload_is_said() -> None:
    model = tiny_llama()
    offload = st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024)
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.warns(RuntimeWarning, match="ran under torch.compile after offload_activations"):
        with offload:
            loss = compiled(**batch()).loss
        loss.backward()
    # In place (model.compile()): refused at the next step, before anything runs.
    model.compile(backend="aot_eager")
    with pytest.raises(ValueError, match="compiled in place"):
        with offload:
            pass


@pytest.mark.parametrize("name", sorted(MODELS))
def test_offload_tensors_offloads_exactly_the_named_tensors(name: str) -> None:
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    offload = st.offload_activations(
        model, offload_tensors="mlp", pinned_bytes=64 << 20, min_bytes=1024
    )
    data = batch()
    want = step(ref, data)
    with offload:
        got = step(model, data)
    assert_bitwise(want, got)
    rep = offload.last_report()
    offloaded = {k.split(":", 1)[1] for k in rep["counts"] if k.startswith("offloaded:")}
    assert offloaded and offloaded <= {"mlp.gate_out", "mlp.up_out", "mlp.act"}, offloaded
    assert rep["counts"]["kept_not_named"] > 0  # attention's tensors stayed
    last = len(model.model.layers) - 1
    assert all(layer["d2h_bytes"] == 0 for layer in rep["layers"] if layer["layer"] == last)
    offload.remove()
    with pytest.raises(ValueError, match="names 'mlp.gate', which the adapter never gives"):
        st.offload_activations(model, offload_tensors=["mlp.gate"])
    plan = spillway.plan("Llama-3.1-8B", "h100-pcie", policy="offload")
    with pytest.raises(ValueError, match="plan and offload_tensors both say"):
        st.offload_activations(model, plan, offload_tensors="mlp")


def test_selective_recompute_never_replays_an_output_written_in_place(tmp_path: Any) -> None:
    """Note [Selective recompute of a plan]: Qwen3-30B-A3B's router normalizes its top-k
    weights in place (norm_topk_prob) after topk; a cache of topk's output would hold the
    normalized weights, and the replay would normalize them again (the router's gradient
    0.8% off). Such an output is recomputed, said in the counts; gradients stay bitwise."""
    model = tiny_qwen3_moe(norm_topk_prob=True)
    ref = copy.deepcopy(model)
    plan = plan_of(model, tmp_path, policy="selective", dtype="fp32")
    offload = st.offload_activations(model, plan, pinned_bytes=64 << 20, min_bytes=1024)
    data = batch()
    want = step(ref, data)
    with offload:
        got = step(model, data)
    assert_bitwise(want, got)
    counts = offload.last_report()["counts"]
    assert any(k.startswith("selective_stale:") for k in counts), counts
    offload.remove()


@pytest.mark.parametrize("policy", ["recompute", "offload", "hybrid"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_partial_plan_runs_as_planned_by_selective_recompute(
    name: str, policy: str, tmp_path: Any
) -> None:
    """Note [Selective recompute of a plan]: a layer that keeps some tensors, offloads some
    and recomputes the rest holds, from its forward to its backward, its input plus what the
    plan keeps and offloads; gradients bitwise those of the plain model. Tolerance: the plan
    counts attn.core_lse, which eager attention does not make, and int32 routing indices,
    which PyTorch holds as int64; the rest within 2%."""
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    plan = plan_of(model, tmp_path, policy=policy, dtype="fp32")
    offload = st.offload_activations(model, plan, pinned_bytes=64 << 20, min_bytes=1024)
    data = batch()
    want = step(ref, data)
    with offload:
        got = step(model, data)
    assert_bitwise(want, got)
    rep = offload.last_report()
    measured = rep["selective_saved_bytes"]
    partial = 0
    for i, layer in enumerate(plan["layers"]):
        actions = {t["name"]: t["action"] for t in layer["tensors"]}
        if "recompute" not in actions.values():
            assert i not in measured
            continue
        partial += 1
        held = sum(
            t["bytes"]
            for t in layer["tensors"]
            if t["action"] in ("keep", "offload")
            and t["name"] not in ("attn.input", "attn.core_lse")
        )
        assert abs(measured[i] - held) <= 0.02 * held, (i, measured[i], held, actions)
    assert partial and rep["counts"]["selective_layers"] == partial
    if policy in ("offload", "hybrid"):
        assert any(k.startswith("selective_offloaded:") for k in rep["counts"]), rep["counts"]
        assert rep["d2h_bytes"] > 0
    offload.remove()


def _auto_run(tmp_path: Any, **kwargs: Any) -> tuple[list[int], list[str], list[float]]:
    """12 steps of tiny Llama under plan="auto" on a 20 GB/s link, throttled to 0.02 GB/s
    from step 5 and back to 20 from step 9 (set_link); every step's gradients bitwise the
    plain model's. Returns the bytes each step offloaded, the plan's notes, and each step's
    measured layer forward time (ms)."""
    model = tiny_llama(layers=4)
    ref = copy.deepcopy(model)
    # Planned, as auto plans, from what the blocks save (Note [A model as PyTorch runs it]).
    saved = st.measure_saved(model, seq_lens=(16, 32))
    keep = plan_of(model, tmp_path, policy="keep", dtype="fp32", saved=saved)
    rec = plan_of(model, tmp_path, policy="recompute", dtype="fp32", saved=saved)
    # A budget keep does not fit and recompute does: auto offloads on a fast link.
    budget = (keep["summary"]["peak_hbm_bytes"] + rec["summary"]["peak_hbm_bytes"]) / 2 / 1e9
    offload = st.offload_activations(
        model,
        "auto",
        hardware="h100-pcie",
        hbm_budget_gb=budget,
        d2h_gbps=20,
        h2d_gbps=20,
        pinned_bytes=64 << 20,
        min_bytes=1024,
        **kwargs,
    )
    data = batch()
    moved, fwd_ms = [], []
    for s in range(1, 13):
        if s == 5:
            offload.set_link(0.02, 0.02)
        if s == 9:
            offload.set_link(20, 20)
        want = step(ref, data)
        with offload:
            got = step(model, data)
        assert_bitwise(want, got)
        rep = offload.last_report()
        moved.append(rep.get("d2h_bytes", 0))
        fwd_ms.append(rep["layer_fwd_ms"])
    replans = offload.last_report()["replans"]
    offload.remove()
    return moved, replans, fwd_ms


def test_plan_auto_with_a_fixed_calibration_replans_the_same_on_every_run(tmp_path: Any) -> None:
    """Note [A fixed calibration]: with layer_fwd_ms, the re-plans follow the link set_link
    set (as scheduled), the layers at the time given, no lateness: the plan offloads less
    right after the step the link slowed in and as much as before right after the step it
    recovered in, and two runs re-plan at the same steps to the same plans and move the
    same bytes each step, whatever the machine's load."""
    moved, replans, _ = _auto_run(tmp_path, layer_fwd_ms=2.0)
    print("\n".join(replans))  # docs/python.md quotes these (pytest -s)
    assert replans == [
        "planned after step 1: micro-batch 2 x seq 32 fp32, layer forward 2.000 ms given, "
        "link 20.000 GB/s; offloaded tensors per layer [9, 9, 9, 0]",
        "re-planned after step 5: link 0.020 GB/s as scheduled, the plan assumed 20.000 (off "
        "by 100%; margin 10%); offloaded tensors per layer [9, 9, 9, 0] -> [1, 1, 1, 0]",
        "re-planned after step 9: link 20.000 GB/s as scheduled, the plan assumed 0.020 (off "
        "by 99900%; margin 10%); offloaded tensors per layer [1, 1, 1, 0] -> [9, 9, 9, 0]",
    ], replans
    assert moved[0] == 0 and moved[1] > 0, moved  # the measured step, then the first plan
    assert moved[1:5] == [moved[1]] * 4, moved  # steps 2-5: the fast link's plan
    assert 0 < moved[5] < moved[4] and moved[5:9] == [moved[5]] * 4, moved  # steps 6-9
    assert moved[9:] == [moved[1]] * 3, moved  # steps 10-12: the fast link's plan again
    again, replans_again, _ = _auto_run(tmp_path, layer_fwd_ms=2.0)
    assert replans_again == replans
    assert again == moved
    model = tiny_llama(layers=2)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=f"layer_fwd_ms is {bad!r}; must be a layer"):
            st.offload_activations(model, "auto", layer_fwd_ms=bad)
    with pytest.raises(ValueError, match="layer_fwd_ms is 2.0, which calibrates plan=.auto."):
        st.offload_activations(model, layer_fwd_ms=2.0)


def test_plan_auto_replans_when_the_link_slows_and_again_when_it_recovers(tmp_path: Any) -> None:
    """Note [Re-planning while training], measured: the first step measures; the planner's
    plan runs from step 2; a link throttled mid-run makes the late layers offload less
    within two steps, and more again within two steps after it recovers; every step's
    gradients are bitwise the plain model's; each change is in the report. What it measures
    moves with the machine's load: where that made the verdict meaningless (copies late on
    the fast link; or, the verdict failing, the layers' forward time off by more than the
    planner's quarter), it skips, saying so; the test above is the one whose verdict does
    not depend on it."""
    moved, replans, fwd_ms = _auto_run(tmp_path)
    print("\n".join(replans))  # pytest -s
    for r in replans:
        if any(r.startswith(f"re-planned after step {k}:") for k in (2, 3)) and "late" in r:
            pytest.skip(f"copies were late on the fast link (a loaded machine): {r}")
    assert moved[0] == 0 and replans[0].startswith("planned after step 1: micro-batch 2 x seq 32")
    expected = (
        moved[3] > 0  # the fast link: the plan offloads
        and moved[6] < moved[3]  # throttled from step 5
        and moved[10] > moved[7]  # lifted from step 9
        and any(
            r.startswith(("re-planned after step 5", "re-planned after step 6")) for r in replans
        )
        and any(
            r.startswith(("re-planned after step 9", "re-planned after step 10")) for r in replans
        )
    )
    calibrated = fwd_ms[0]
    if not expected and any(abs(ms - calibrated) > LINK_DRIFT * calibrated for ms in fwd_ms):
        pytest.skip(
            "the layers' measured forward time, which each re-plan calibrates with, moved by "
            "more than a quarter from step 1's (the machine's load, or the slowed copies "
            f"holding up the host's forward): {[round(ms, 3) for ms in fwd_ms]} ms; re-plans "
            f"{replans}, bytes {moved}"
        )
    assert expected, (moved, replans, fwd_ms)
    with pytest.raises(ValueError, match="plan is 'fast'; a plan is a dict"):
        st.offload_activations(tiny_llama(layers=2), "fast")


class _Stack(torch.nn.Module):
    """Blocks in a row (its `layers`, as offload_activations finds them) under a squared
    mean."""

    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x.square().mean()


def _loss_and_grads(
    model: torch.nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class _MixedBlock(torch.nn.Module):
    """Saves tensors of several shapes and dtypes: 2-D and 3-D of different trailing
    shapes, bf16 beside fp32, and a 0-d sum (Note [Reloads in slabs])."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sin(x @ self.w)  # (4, 8) saved twice: x and x @ w
        b = torch.sin(a.reshape(2, 2, 8))  # (2, 2, 8)
        c = b.to(torch.bfloat16).sin().float().reshape(4, 8)  # bf16 (2, 2, 8)
        d = c * c.sum()  # (4, 8) and a 0-d tensor
        e = torch.sin(d[:2].contiguous())  # (2, 8): a slab's parts of different lengths
        f = torch.sin(d[:, :3].contiguous()).sum(dim=1, keepdim=True)  # (4, 3)
        return f.expand(4, 8) + d + e.sum()


def test_reloads_in_slabs_come_back_bitwise_whatever_their_shapes_and_dtypes() -> None:
    """Note [Reloads in slabs]: the prefetched destinations of a block are parts of a few
    tensors; every gradient is bitwise the one without offload."""

    model = _Stack([_MixedBlock(i) for i in range(4)])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
    want = _loss_and_grads(model, x)
    offload = st.offload_activations(model, pinned_bytes=1 << 20, min_bytes=0, keep_last=0)
    with offload:
        _loss_and_grads(model, x)  # sizes the pool
    for _ in range(2):
        with offload:
            got = _loss_and_grads(model, x)
        assert_bitwise(want, got)
        report = offload.last_report()
        assert report["tensors_offloaded"] >= 4 * 6
        assert report["h2d_bytes"] == report["d2h_bytes"] > 0
    offload.remove()


def test_a_tensor_saved_by_several_ops_is_offloaded_once() -> None:
    """Note [Hook cost per tensor]: a tensor saved again is found by id() (alive, unchanged,
    at the same address) and offloaded once: here each block's h is saved by three matmuls,
    as a block's input is by its q, k and v projections. Every gradient is bitwise the one
    without offload."""

    class QKV(torch.nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.q, self.k, self.v = (
                torch.nn.Parameter(torch.randn(16, 16, generator=g) * 0.25) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.sin(x)  # sin saves x; the three projections save h
            return (h @ self.q) * (h @ self.k) + h @ self.v  # the product saves both sides

    model = _Stack([QKV(i) for i in range(3)])
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    want = _loss_and_grads(model, x)
    offload = st.offload_activations(model, pinned_bytes=1 << 20, min_bytes=0, keep_last=0)
    for _ in range(2):
        with offload:
            got = _loss_and_grads(model, x)
        assert_bitwise(want, got)
        report = offload.last_report()
        # Per block: x (not in the first: the model's input needs no gradient), h (once),
        # h @ q and h @ k, 256 bytes each; h found again twice.
        assert report["counts"]["deduplicated"] == 3 * 2
        assert report["counts"]["offloaded"] == report["tensors_offloaded"] == 3 + 4 + 4
        assert report["counts"]["offloaded_bytes"] == report["d2h_bytes"] == 11 * 256
        assert report["h2d_bytes"] == report["d2h_bytes"]
    offload.remove()

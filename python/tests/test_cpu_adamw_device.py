"""CPUAdamW's device path (Note [The device path of CPUAdamW]): bfloat16 parameters stepped
through the optimizer-offload pipeline, run here on spillway's host backend, which emulates
a GPU (``device_emulation=True``: copy streams, pinned staging, events; on a GPU the same
code runs on the CUDA backend). Bitwise the C++ reference and the CPU path, with clipping,
NaN/Inf, schedules, groups, accumulation, absent gradients, ``set_to_none`` and
checkpoints."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import spillway.torch as st
from hf_models import batch, tiny_llama
from test_cpu_adamw import SCALES, Ref, assert_params, loss_of, mlp, poison_hook


@pytest.mark.parametrize("speculative", [True, False])
def test_bitwise_the_cpp_reference_with_clipping_and_nan_inf(speculative: bool) -> None:
    model = mlp(seed=21, dtype=torch.bfloat16)
    params = list(model.parameters())
    ref = Ref(params)
    opt = st.CPUAdamW(
        params,
        lr=1e-2,
        weight_decay=0.05,
        max_grad_norm=1.0,
        speculative=speculative,
        device_emulation=True,
    )
    assert opt._flat_w is not None and opt._flat_g is not None
    state = {"step": 0}
    params[2].register_hook(poison_hook(state))
    outcomes = []
    for s, scale in enumerate(SCALES):
        state["step"] = s
        loss_of(model, s, scale).backward()
        # The gradients are views of the optimizer's flat buffer, torch accumulated there.
        assert all(p.grad is not None and p.grad._base is opt._flat_g for p in params)
        grads = [p.grad.clone() for p in params if p.grad is not None]
        want = ref.step(grads, 1e-2, 0.05, 1.0)
        opt.step()
        opt.zero_grad()
        outcomes.append(opt.last_step()["outcome"])
        assert outcomes[-1] == want, f"step {s}"
        assert_params(model, ref.params(params), f"step {s}")
    assert outcomes.count("skip") == 2 and outcomes.count("replay") >= 2
    deferred = opt.last_step()["deferred"]
    assert deferred == 0 if speculative else deferred >= len(params) * (len(SCALES) - 2)
    # The parameters are views of the flat weights the pipeline writes.
    flat = opt._flat_w.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == flat for p in params)


def run(device_emulation: bool, set_to_none: bool) -> list[torch.Tensor]:
    """Groups, a schedule, accumulation, clipping and a frozen parameter (no gradient)."""
    model = mlp(seed=22, dtype=torch.bfloat16)
    model[4].bias.requires_grad_(False)
    groups = [
        {"params": list(model[0].parameters()), "lr": 2e-2, "weight_decay": 0.0},
        {"params": list(model[2].parameters()) + list(model[4].parameters())},
    ]
    opt = st.CPUAdamW(
        groups,
        lr=1e-2,
        max_grad_norm=0.5,
        accumulation_steps=2,
        device_emulation=device_emulation,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for s in range(6):
        for micro in range(2):
            loss_of(model, 10 * s + micro, 3.0).backward()
        opt.step()
        if set_to_none:
            model.zero_grad(set_to_none=True)  # torch allocates new gradients next time
        opt.zero_grad()
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("set_to_none", [False, True])
def test_groups_schedules_accumulation_and_absent_gradients_equal_the_cpu_path(
    set_to_none: bool,
) -> None:
    want = run(device_emulation=False, set_to_none=False)
    got = run(device_emulation=True, set_to_none=set_to_none)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"parameter {i}"


def test_a_checkpoint_round_trip_resumes_bitwise_across_paths() -> None:
    def steps(model: nn.Module, opt: st.CPUAdamW, first: int) -> None:
        for s in range(first, first + 3):
            loss_of(model, s, 10.0).backward()
            opt.step()
            opt.zero_grad()

    model = mlp(seed=23, dtype=torch.bfloat16)
    opt = st.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, device_emulation=True)
    steps(model, opt, 0)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    steps(model, opt, 3)
    want = [p.detach().clone() for p in model.parameters()]
    # Into the device path and into the CPU path: both resume to the same bits.
    for emulate in (True, False):
        resumed = mlp(seed=99, dtype=torch.bfloat16)
        opt2 = st.CPUAdamW(resumed.parameters(), lr=1.0, device_emulation=emulate)
        resumed.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
        assert opt2.param_groups[0]["lr"] == 1e-2
        steps(resumed, opt2, 3)
        assert_params(resumed, want, f"resumed (device_emulation={emulate})")


def test_gradients_changed_after_hand_over_are_the_ones_stepped() -> None:
    model = mlp(seed=24, dtype=torch.bfloat16)
    params = list(model.parameters())
    ref = Ref(params)
    opt = st.CPUAdamW(params, lr=1e-2, device_emulation=True)
    loss_of(model, 0, 50.0).backward()
    torch.nn.utils.clip_grad_norm_(params, 0.1)  # in place, after the speculative uploads
    ref.step([p.grad for p in params if p.grad is not None], 1e-2, 0.01, 0.0)
    opt.step()
    assert opt.last_step()["regathered"]
    assert_params(model, ref.params(params), "after an in-place clip")


def test_a_hugging_face_llama_in_bf16_trains_as_on_the_cpu_path() -> None:
    runs: list[Any] = []
    for emulate in (False, True):
        model = tiny_llama(seed=25, dtype=torch.bfloat16)
        opt = st.CPUAdamW(model.parameters(), lr=3e-3, max_grad_norm=1.0, device_emulation=emulate)
        losses = []
        for s in range(3):
            with st.offload_activations(model, pinned_bytes=64 << 20, min_bytes=1024):
                loss = model(**batch(seed=s)).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    rep = st.report()["optimizer"]
    assert rep["step"] == 3 and rep["cpu_optimizer_ms"] > 0


def test_what_the_device_path_refuses_names_the_cause() -> None:
    with pytest.raises(ValueError, match=r"parameter 0 is torch.float32 .* bfloat16"):
        st.CPUAdamW([nn.Parameter(torch.zeros(4))], device_emulation=True)
    p = [nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="early_weights=False with speculative=True"):
        st.CPUAdamW(p, early_weights=False, device_emulation=True)
    opt = st.CPUAdamW(p, early_weights=False, speculative=False, device_emulation=True)
    assert opt.early_weights  # the pipeline writes them; nothing is speculated early

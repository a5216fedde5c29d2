"""CPUAdamW(share_weights=True) (Note [Weights shared with the parameters]): the parameters'
storage is the optimizer's fp32 master weights and a commit swaps buffers. Every step is
bitwise the plain CPUAdamW's (itself tested against the C++ reference in
test_cpu_adamw.py), whatever the step did (commit, clip, skip, in-place edit, p.data
replaced, checkpoint); a parameter always views the optimizer's current buffer; close()
gives it its own storage back; what cannot be shared is refused at construction."""

from __future__ import annotations

import gc
from typing import Optional

import pytest
import torch
from torch import nn

import spillway.torch as st


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 8)
    )


def loss_of(model: nn.Module, s: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + s)
    return model(torch.randn(16, 32, generator=g)).pow(2).mean() * scale


# Per step, the loss scale: steps 3 and 7 clip at max_grad_norm=0.5 (a large gradient), step
# 5 has an Inf (skipped), step 9 a NaN (skipped); the rest commit.
SCALES = [1.0, 1.0, 1.0, 300.0, 1.0, float("inf"), 1.0, 300.0, 1.0, float("nan"), 1.0, 1.0]


def train(
    share: bool, speculative: bool = True, clip: Optional[float] = 0.5, steps: int = 12
) -> tuple[nn.Module, st.CPUAdamW, list[float]]:
    model = mlp()
    opt = st.CPUAdamW(
        model.parameters(),
        lr=1e-2,
        max_grad_norm=clip,
        speculative=speculative,
        threads=2,
        share_weights=share,
    )
    losses = []
    for s in range(steps):
        loss = loss_of(model, s, SCALES[s % len(SCALES)])
        loss.backward()  # the hooks hand each gradient over: speculated during backward
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            losses.append(float(loss_of(model, s)))
    return model, opt, losses


def buffers(opt: st.CPUAdamW, i: int) -> tuple[int, int]:
    first, second = opt._core.weight_buffers(i)
    return int(first), int(second)


def assert_same(a: nn.Module, b: nn.Module, where: str) -> None:
    for i, (p, q) in enumerate(zip(a.parameters(), b.parameters())):
        assert torch.equal(p.detach(), q.detach()), f"{where}: parameter {i} differs"


def assert_same_state(a: st.CPUAdamW, b: st.CPUAdamW) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k][name], sb[k][name]), f"state {k} {name} differs"


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("clip", [0.5, None])
def test_shared_weights_are_bitwise_the_plain_optimizer(
    speculative: bool, clip: Optional[float]
) -> None:
    plain, popt, plosses = train(False, speculative, clip)
    shared, sopt, slosses = train(True, speculative, clip)
    assert [repr(x) for x in plosses] == [repr(x) for x in slosses]
    assert_same(plain, shared, "after 12 steps")
    assert_same_state(popt, sopt)
    counters = sopt.last_step()
    assert counters["skips"] == 2
    if clip is not None:
        assert counters["replays"] + counters["unspeculated_steps"] >= 2
    # Every parameter views the optimizer's current weight buffer, not storage of its own.
    current = sopt._core.current_buffers()
    for i, p in enumerate(shared.parameters()):
        assert p.data_ptr() == buffers(sopt, i)[current[i]]


def test_a_commit_swaps_the_parameters_storage_and_copies_nothing() -> None:
    model = mlp()
    opt = st.CPUAdamW(model.parameters(), lr=1e-2, threads=2, share_weights=True)
    before = [p.data_ptr() for p in model.parameters()]
    assert before == [buffers(opt, i)[0] for i in range(len(before))]
    seen = []
    for s in range(3):
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
        assert opt.last_step()["outcome"] == "commit"
        seen.append([p.data_ptr() for p in model.parameters()])
    # Speculated and committed: each step's results are in the other buffer, which the
    # parameter now views; the step after, the first again.
    assert seen[0] == [buffers(opt, i)[1] for i in range(len(before))]
    assert seen[1] == before and seen[2] == seen[0]


def test_edits_between_steps_are_the_next_steps_start() -> None:
    """Note [Parameters changed under the optimizer]: an in-place edit writes the master
    weights themselves; ``p.data = t`` is read into them and the parameter views them again."""
    models, opts = [], []
    for share in (False, True):
        model = mlp()
        opts.append(st.CPUAdamW(model.parameters(), lr=1e-2, threads=2, share_weights=share))
        models.append(model)
    for s in range(4):
        for model, opt in zip(models, opts):
            p0, p2 = list(model.parameters())[0], list(model.parameters())[2]
            if s == 1:
                with torch.no_grad():
                    p0.mul_(0.5)
            if s == 2:
                p2.data = torch.full_like(p2, 0.25)
            loss_of(model, s).backward()
            opt.step()
            opt.zero_grad()
        assert_same(models[0], models[1], f"step {s}")
    shared_opt = opts[1]
    current = shared_opt._core.current_buffers()
    p2 = list(models[1].parameters())[2]
    assert p2.data_ptr() == buffers(shared_opt, 2)[current[2]]


def test_model_load_state_dict_and_optimizer_checkpoints_round_trip() -> None:
    model, opt, _ = train(True, steps=5)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    cont_model, cont_opt, _ = train(True, steps=5)
    for s in range(5, 8):  # the reference: continue the first run
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
    # A fresh model and shared optimizer from the checkpoint continue bitwise.
    fresh = mlp(seed=1)
    fresh.load_state_dict(saved_model)
    fopt = st.CPUAdamW(
        fresh.parameters(), lr=1e-2, max_grad_norm=0.5, threads=2, share_weights=True
    )
    fopt.load_state_dict(saved_opt)
    for s in range(5, 8):
        loss_of(fresh, s).backward()
        fopt.step()
        fopt.zero_grad()
    assert_same(model, fresh, "resumed from the checkpoint")
    del cont_model, cont_opt


def test_close_gives_the_parameters_their_own_storage() -> None:
    model, opt, _ = train(True, steps=3)
    values = [p.detach().clone() for p in model.parameters()]
    ours = {b for i in range(len(values)) for b in buffers(opt, i)}
    opt.close()
    for p, v in zip(model.parameters(), values):
        assert p.data_ptr() not in ours
        assert torch.equal(p.detach(), v)
    del opt
    gc.collect()
    loss_of(model, 0).backward()  # the model trains on, its storage its own
    assert all(p.grad is not None for p in model.parameters())


def test_a_dropped_optimizer_leaves_the_parameters_valid() -> None:
    model, opt, _ = train(True, steps=3)
    values = [p.detach().clone() for p in model.parameters()]
    del opt  # __del__ closes it
    gc.collect()
    torch.randn(1 << 20).mul_(2)  # reuse freed memory, if any was freed under the parameters
    for p, v in zip(model.parameters(), values):
        assert torch.equal(p.detach(), v)


def test_a_new_optimizer_over_shared_parameters_takes_them_over() -> None:
    model, opt, _ = train(True, steps=3)
    values = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="stepped by another CPUAdamW"):
        new = st.CPUAdamW(model.parameters(), lr=1e-2, threads=2, share_weights=True)
    for i, (p, v) in enumerate(zip(model.parameters(), values)):
        assert torch.equal(p.detach(), v)
        assert p.data_ptr() == buffers(new, i)[0]
    del opt


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: dict(params=[nn.Parameter(torch.ones(4, dtype=torch.bfloat16))]),
            "torch.bfloat16",
        ),
        (lambda: dict(params=[nn.Parameter(torch.ones(4))], early_weights=True), "early_weights"),
        (
            lambda: dict(
                params=[nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], device_emulation=True
            ),
            "device path",
        ),
    ],
)
def test_what_cannot_share_is_refused_at_construction(make, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        st.CPUAdamW(**make(), share_weights=True)


def test_a_compiled_model_trains_on_the_swapped_storage_without_recompiling() -> None:
    """torch.compile takes parameters as graph inputs: a step that moves them to the other
    buffer changes no guard (``error_on_recompile``) and the results are the eager plain
    optimizer's, bitwise."""
    import torch._dynamo

    results = []
    for share, compiled in ((False, False), (True, True)):
        torch._dynamo.reset()
        model = mlp()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        opt = st.CPUAdamW(model.parameters(), lr=1e-2, threads=2, share_weights=share)
        losses = []
        with torch._dynamo.config.patch(error_on_recompile=compiled):
            for s in range(4):
                loss = loss_of(run, s)  # type: ignore[arg-type]
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(repr(float(loss.detach())))
        results.append((losses, model))
    assert results[0][0] == results[1][0]
    assert_same(results[0][1], results[1][1], "compiled, shared")


def test_a_parameter_converted_under_shared_weights_is_refused_at_the_next_step() -> None:
    model = mlp()
    opt = st.CPUAdamW(model.parameters(), lr=1e-2, threads=2, share_weights=True)
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="became torch.bfloat16 on cpu under share_weights"):
        model(torch.randn(2, 32, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()


def test_saved_and_loaded_with_torch_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, opt, _ = train(True, steps=3)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    fresh = mlp(seed=1)
    fresh.load_state_dict(torch.load(tmp_path / "m.pt"))
    assert_same(model, fresh, "torch.save / torch.load")

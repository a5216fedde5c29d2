"""spillway.torch.CPUAdamW and the parameters it does not own: weights written after the
optimizer was made are the ones stepped (Note [Parameters changed under the optimizer]); a
deleted or closed optimizer neither writes nor holds memory (Note [Hook lifetime]); a second
CPUAdamW over the same parameters takes them over (Note [One optimizer per parameter])."""

from __future__ import annotations

import copy
import gc
import os
import warnings

import pytest
import torch
from torch import nn

import spillway.torch as st


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dtype)


def loss_of(model: nn.Module, s: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + s)
    x = torch.randn(16, 32, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


def torch_step(model: nn.Module, s: int, lr: float) -> nn.Module:
    """The same step by torch's AdamW on a copy, for comparison."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    loss_of(ref, s).backward()
    opt.step()
    return ref


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        float((x.detach().float() - y.detach().float()).abs().max())
        for x, y in zip(a.parameters(), b.parameters())
    )


@pytest.mark.parametrize("early", [False, True])
def test_weights_loaded_after_the_optimizer_are_the_ones_stepped(early: bool) -> None:
    model = mlp(seed=1)
    opt = st.CPUAdamW(model.parameters(), lr=1e-3, early_weights=early)
    pretrained = mlp(seed=2).state_dict()
    model.load_state_dict(pretrained)  # after the optimizer took its copy
    want = torch_step(model, 0, 1e-3)
    loss_of(model, 0).backward()
    opt.step()
    # One AdamW step moves a weight by about lr; from the stale copy it moved by ~0.1.
    assert max_diff(model, want) < 1e-5, max_diff(model, want)


def test_a_parameter_replaced_by_data_assignment_is_read_again() -> None:
    model = mlp(seed=3)
    opt = st.CPUAdamW(model.parameters(), lr=1e-3)
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    fresh = mlp(seed=4)
    for p, q in zip(model.parameters(), fresh.parameters()):
        p.data = q.detach().clone()  # new storage
    want = torch_step(model, 1, 1e-3)
    loss_of(model, 1).backward()
    opt.step()
    # The moments carry over from step 1, so not torch's first step exactly: close to it,
    # and far from the stale copy's step.
    assert max_diff(model, want) < 2e-3, max_diff(model, want)
    assert max_diff(model, fresh) < 2e-3


def test_a_frozen_parameter_loaded_after_the_optimizer_keeps_its_load() -> None:
    model = mlp(seed=5)
    params = list(model.parameters())
    opt = st.CPUAdamW(params, lr=1e-3)
    params[0].requires_grad_(False)
    with torch.no_grad():
        params[0].copy_(torch.full_like(params[0], 0.25))
    loss_of(model, 0).backward()
    opt.step()  # writes every master back: not the stale one over the load
    assert torch.equal(params[0].detach(), torch.full_like(params[0], 0.25))


def test_an_in_place_write_that_changes_nothing_keeps_the_fp32_master() -> None:
    model = mlp(seed=6, dtype=torch.bfloat16)
    opt = st.CPUAdamW(model.parameters(), lr=1e-3)
    for s in range(2):
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()
    master = [t.clone() for t in (opt.state_dict()["state"][i]["master_param"] for i in range(4))]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0)  # the version moves, the values do not
    loss_of(model, 2).backward()
    opt.step()
    # The master was not replaced by the bf16 weights (which would round it).
    after = [opt.state_dict()["state"][i]["master_param"] for i in range(4)]
    for i, (a, b) in enumerate(zip(master, after)):
        assert not torch.equal(a, b.to(torch.bfloat16).float()) or torch.equal(a, b), i


def test_a_deleted_optimizer_no_longer_writes_the_weights() -> None:
    model = mlp(seed=7)
    opt = st.CPUAdamW(model.parameters(), lr=1e-2, early_weights=True)
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    del opt
    gc.collect()
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    for s in range(2):
        loss_of(model, s).backward()
        sgd.step()
        sgd.zero_grad()
    for i, (p, b) in enumerate(zip(model.parameters(), before)):
        assert torch.equal(p.detach(), b), f"parameter {i} was written after its optimizer died"


def test_a_closed_optimizer_no_longer_writes_and_refuses_to_step() -> None:
    model = mlp(seed=8)
    before = [p.detach().clone() for p in model.parameters()]
    with st.CPUAdamW(model.parameters(), lr=1e-2, early_weights=True) as opt:
        pass
    loss_of(model, 0).backward()
    for i, (p, b) in enumerate(zip(model.parameters(), before)):
        assert torch.equal(p.detach(), b), f"parameter {i} was written by a closed optimizer"
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


def test_a_second_optimizer_over_the_same_parameters_takes_them_over() -> None:
    model = mlp(seed=9)
    first = st.CPUAdamW(model.parameters(), lr=1e-2, early_weights=True)
    with pytest.warns(UserWarning, match="another CPUAdamW"):
        second = st.CPUAdamW(model.parameters(), lr=1e-3)
    want = torch_step(model, 0, 1e-3)
    loss_of(model, 0).backward()  # one hook per parameter steps it: the second's
    second.step()
    assert max_diff(model, want) < 1e-5
    with pytest.raises(RuntimeError, match="closed"):
        first.step()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_optimizers_made_and_dropped_free_their_host_state() -> None:
    big = nn.Linear(2048, 2048)  # 4.2M elements: ~100 MB of state with undo buffers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st.CPUAdamW(big.parameters())  # the first: allocator warm-up
        gc.collect()
        start = rss_bytes()
        for _ in range(4):
            opt = st.CPUAdamW(big.parameters())
            del opt
            gc.collect()
    grown = rss_bytes() - start
    # Held, four would keep ~400 MB; freed, the RSS stays within one's state.
    assert grown < 60e6, f"RSS grew {grown / 1e6:.0f} MB over 4 dropped optimizers"


def test_a_sparse_gradient_is_refused_by_name() -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    opt = st.CPUAdamW(emb.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="sparse gradient"):
        emb(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()

"""CPUAdamW and the clips of the loops people run (Note [Clips the speculation saw], Note
[Backward passes per step]): ``torch.nn.utils.clip_grad_norm_`` that scales nothing keeps
the speculative step, one that scales drops it before writing, and every outcome is
bitwise the non-speculative optimizer's after the same clip; the backward passes per step
are learned when not given."""

from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch
from torch import nn

import spillway.torch as st


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dtype)


def loss_of(model: nn.Module, s: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + s)
    x = torch.randn(16, 32, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean() * scale


def torch_norm(model: nn.Module) -> float:
    """torch's own norm of the gradients, read before anything clips them."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))


def run(
    model: nn.Module,
    clips: list[Optional[float]],
    scales: list[float],
    passes: int = 1,
    recognize_clip: bool = True,
    **kw: object,
) -> tuple[list[dict[str, object]], list[torch.Tensor]]:
    """Steps with a torch clip of max_norm clips[s] (None: no clip); per step telemetry,
    and the norms the clips returned. The optimizer opts in to the recognition of torch's
    clip unless told not to."""
    opt = st.CPUAdamW(model.parameters(), lr=1e-2, recognize_clip=recognize_clip, **kw)  # type: ignore[arg-type]
    telemetry, norms = [], []
    for s, (clip, scale) in enumerate(zip(clips, scales)):
        for k in range(passes):
            loss_of(model, 10 * s + k, scale).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        telemetry.append(opt.last_step())
    opt.close()
    return telemetry, norms


# The paths: float32 and bfloat16 parameters on the CPU path, and the device path (its
# pipeline on spillway's host backend, which emulates a GPU).
PATHS = {
    "cpu-fp32": (torch.float32, False),
    "cpu-bf16": (torch.bfloat16, False),
    "device": (torch.bfloat16, True),
}


def same_weights(a: nn.Module, b: nn.Module, where: str) -> None:
    for i, (x, y) in enumerate(zip(a.parameters(), b.parameters())):
        assert torch.equal(x.detach(), y.detach()), f"{where}: parameter {i} differs"


@pytest.mark.parametrize("path", PATHS)
def test_a_clip_that_scales_nothing_keeps_the_speculation(path: str) -> None:
    # transformers.Trainer clips every step (max_grad_norm, or inf to log the norm): a clip
    # under its bound answers from the speculation's norm and writes nothing.
    dtype, emulate = PATHS[path]
    model = mlp(1, dtype)
    opt = st.CPUAdamW(model.parameters(), lr=1e-2, device_emulation=emulate, recognize_clip=True)
    loss_of(model, 0).backward()
    want = torch_norm(model)
    versions = [p.grad._version for p in model.parameters()]  # type: ignore[union-attr]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
    assert norm.dtype == dtype and norm.shape == ()
    assert float(norm) == pytest.approx(want, rel=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert [p.grad._version for p in model.parameters()] == versions  # type: ignore[union-attr]
    opt.step()
    last = opt.last_step()
    assert last["regathered"] is False and last["discarded_by"] is None
    assert last["outcome"] == "commit" and last["clip_norm"] == pytest.approx(want, rel=1e-2)

    opt.zero_grad()
    loss_of(model, 1).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # the Trainer's log
    opt.step()
    assert opt.last_step()["regathered"] is False
    opt.zero_grad()
    loss_of(model, 2).backward()  # no clip at all
    opt.step()
    assert opt.last_step()["regathered"] is False


@pytest.mark.parametrize("path", PATHS)
def test_every_clip_outcome_is_bitwise_the_non_speculative_step(path: str) -> None:
    # Steps that clip (scale 50 on a bound of 0.5), steps under the bound, no clip, a clip at
    # inf: the speculative optimizer after torch's clip is the non-speculative one, bitwise.
    dtype, emulate = PATHS[path]
    clips: list[Optional[float]] = [0.5, 100.0, None, float("inf"), 0.5, 100.0]
    scales = [50.0, 1.0, 1.0, 1.0, 50.0, 1.0]
    spec, plain = mlp(2, dtype), mlp(2, dtype)
    got, norms = run(spec, clips, scales, device_emulation=emulate)
    _, want_norms = run(plain, clips, scales, speculative=False, device_emulation=emulate)
    same_weights(spec, plain, "speculative vs not")
    assert [t["discarded_by"] for t in got] == ["clip", None, None, None, "clip", None]
    for a, b in zip(norms, want_norms):  # the norm returned: torch's, or the speculation's
        assert float(a) == pytest.approx(float(b), rel=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_a_clip_of_other_gradients_too_drops_the_speculation_before_writing() -> None:
    # A clip over more than this optimizer's gradients (a second optimizer's, say): the norm
    # is not the speculation's; the speculation is dropped, torch's clip runs, the step is
    # bitwise the non-speculative one.
    def go(speculative: bool) -> tuple[nn.Module, nn.Module, dict[str, object]]:
        a, b = mlp(3), mlp(4)
        opt = st.CPUAdamW(a.parameters(), lr=1e-2, speculative=speculative, recognize_clip=True)
        other = torch.optim.SGD(b.parameters(), lr=0.1)
        (loss_of(a, 0) + loss_of(b, 1)).backward()
        torch.nn.utils.clip_grad_norm_([*a.parameters(), *b.parameters()], 1e6)
        opt.step()
        other.step()
        return a, b, opt.last_step()

    a1, b1, last = go(True)
    a2, b2, _ = go(False)
    assert last["discarded_by"] == "clip"
    same_weights(a1, a2, "clip over two models")
    same_weights(b1, b2, "the other model")


def test_a_gradient_edited_in_place_is_said_once_and_stepped_as_it_is() -> None:
    def go(speculative: bool) -> tuple[nn.Module, list[dict[str, object]]]:
        model = mlp(5)
        opt = st.CPUAdamW(model.parameters(), lr=1e-2, speculative=speculative)
        out = []
        for s in range(2):
            loss_of(model, s).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.clamp_(-1e-3, 1e-3)  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
            out.append(opt.last_step())
        return model, out

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        spec, got = go(True)
    said = [str(x.message) for x in w if "changed after they were handed over" in str(x.message)]
    assert len(said) == 1, said
    assert [t["discarded_by"] for t in got] == ["changed", "changed"]
    plain, _ = go(False)
    same_weights(spec, plain, "edited gradients")


def test_backward_passes_per_step_are_learned_when_not_given() -> None:
    # Gradient accumulation (2 passes per step) with accumulation_steps left out: the first
    # step speculated on the first pass and is redone; from then on the speculation waits
    # for the second pass and commits. Bitwise the non-speculative optimizer throughout.
    clips: list[Optional[float]] = [100.0] * 4
    spec, plain = mlp(6), mlp(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # learning is silent
        got, _ = run(spec, clips, [1.0] * 4, passes=2)
    run(plain, clips, [1.0] * 4, passes=2, speculative=False)
    same_weights(spec, plain, "accumulation learned")
    assert [t["discarded_by"] for t in got] == ["accumulation", None, None, None]
    assert [t["accumulation_steps"] for t in got] == [2, 2, 2, 2]


def test_accumulation_steps_given_and_wrong_are_said() -> None:
    model = mlp(7)
    with pytest.warns(UserWarning, match="pass accumulation_steps=2"):
        run(model, [None] * 2, [1.0] * 2, passes=2, accumulation_steps=1)
    with pytest.warns(UserWarning, match="nothing is speculated; pass accumulation_steps=1"):
        run(model, [None] * 3, [1.0] * 3, passes=1, accumulation_steps=2)


def test_recognize_clip_false_runs_torchs_clip() -> None:
    # The wrapper installed by another optimizer's opt-in: this one answers no clip.
    st.CPUAdamW(mlp(9).parameters(), recognize_clip=True).close()
    model = mlp(8)
    got, _ = run(model, [1e6, 1e6], [1.0, 1.0], recognize_clip=False)
    assert [t["discarded_by"] for t in got] == ["clip", "clip"]


def test_the_wrapper_is_torchs_function_for_everything_else() -> None:
    import copy

    import torch.nn.utils.clip_grad as clip_grad

    from spillway.torch import _clip

    st.CPUAdamW(mlp(9).parameters(), recognize_clip=True)  # installs it
    assert torch.nn.utils.clip_grad_norm_ is st.clip_grad_norm_
    assert clip_grad.clip_grad_norm_ is st.clip_grad_norm_
    model = mlp(10)  # no CPUAdamW: torch's function, bitwise
    twin = copy.deepcopy(model)
    loss_of(model, 0, 50.0).backward()
    loss_of(twin, 0, 50.0).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    want = _clip._torch_clip_grad_norm_(twin.parameters(), 0.5)
    assert torch.equal(norm, want) and float(norm) > 0.5
    same_weights(model, twin, "weights")
    for i, (a, b) in enumerate(zip(model.parameters(), twin.parameters())):
        assert torch.equal(a.grad, b.grad), f"gradient {i}"  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="empty generator"):
        torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)


def test_the_device_path_alone_installs_the_wrapper() -> None:
    # In a fresh process whose only CPUAdamW takes the device path (as on a GPU machine),
    # torch's clip is wrapped all the same (the first GPU run found it was not).
    import subprocess
    import sys

    code = (
        "import torch, spillway.torch as st\n"
        "p = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))\n"
        "st.CPUAdamW([p], device_emulation=True, recognize_clip=True)\n"
        "assert torch.nn.utils.clip_grad_norm_ is st.clip_grad_norm_\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_without_the_opt_in_torchs_clip_is_left_alone() -> None:
    # torch's clip_grad_norm_ is never replaced behind the user's back: a CPUAdamW made
    # without recognize_clip=True (either path) leaves it as it is, and says nothing; a
    # clip then writes the gradients and the step runs again from them, bitwise.
    import subprocess
    import sys

    code = (
        "import copy, warnings, torch\n"
        "import torch.nn.utils.clip_grad as clip_grad\n"
        "torchs = torch.nn.utils.clip_grad_norm_\n"
        "import spillway.torch as st\n"
        "warnings.simplefilter('error')\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
        "twin = copy.deepcopy(model)\n"
        "opt = st.CPUAdamW(model.parameters(), lr=1e-2)\n"
        "plain = st.CPUAdamW(twin.parameters(), lr=1e-2, speculative=False)\n"
        "p = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))\n"
        "st.CPUAdamW([p], device_emulation=True)\n"
        "assert torch.nn.utils.clip_grad_norm_ is torchs\n"
        "assert clip_grad.clip_grad_norm_ is torchs\n"
        "warnings.simplefilter('ignore')  # the step says once that it ran again\n"
        "for m, o in ((model, opt), (twin, plain)):\n"
        "    m(torch.ones(4, 8)).pow(2).mean().backward()\n"
        "    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e6)\n"
        "    o.step()\n"
        "assert opt.last_step()['discarded_by'] == 'changed', opt.last_step()\n"
        "for a, b in zip(model.parameters(), twin.parameters()):\n"
        "    assert torch.equal(a, b)\n"
        "assert torch.nn.utils.clip_grad_norm_ is torchs\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr

"""CPUAdamW under ``transformers.Trainer`` (with accelerate), as a fine-tuning script runs
it: the Trainer clips every step (``max_grad_norm``, or ``inf`` to log the norm) and
accumulates gradients; the speculative step must survive both (Note [Clips the speculation
saw], Note [Backward passes per step]) and end bitwise where the non-speculative optimizer
ends."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import transformers

import spillway.torch as st
from hf_models import tiny_llama

STEPS = 6


class Telemetry(transformers.TrainerCallback):
    """Each optimizer step's telemetry (CPUAdamW.last_step), read after the step."""

    def __init__(self, opt: st.CPUAdamW) -> None:
        self.opt = opt
        self.steps: list[dict[str, Any]] = []

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps.append(self.opt.last_step())


def train(
    max_grad_norm: float, speculative: bool, device: bool, tmp: str
) -> tuple[Any, list[dict[str, Any]]]:
    """Trains; ``device``: bfloat16 through the device path (its pipeline on spillway's
    host backend, which emulates a GPU), else float32 on the CPU path."""
    model = tiny_llama(seed=3, layers=2, dtype=torch.bfloat16 if device else torch.float32)
    g = torch.Generator().manual_seed(7)
    data = [
        {"input_ids": ids, "labels": ids.clone()}
        for ids in torch.randint(0, 128, (2 * 2 * STEPS, 16), generator=g)
    ]
    opt = st.CPUAdamW(
        model.parameters(),
        lr=1e-3,
        speculative=speculative,
        device_emulation=device,
        recognize_clip=True,  # the Trainer's clip answered from the speculation
    )
    seen = Telemetry(opt)
    args = transformers.TrainingArguments(
        output_dir=tmp,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        max_grad_norm=max_grad_norm,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, optimizers=(opt, None), callbacks=[seen]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    opt.close()
    return model, seen.steps


@pytest.mark.parametrize(
    "max_grad_norm,device",
    [
        (0.0, False),  # no clipping: the Trainer still clips at inf to log the norm
        (1e3, False),  # a bound the norm stays under
        (1e-3, False),  # a bound every step goes over: each clip scales, the step is redone
        (0.0, True),
        (1e-3, True),
    ],
)
def test_trainer_keeps_the_speculation_and_matches_the_plain_step(
    max_grad_norm: float, device: bool, tmp_path: Any
) -> None:
    model, steps = train(max_grad_norm, True, device, str(tmp_path / "spec"))
    assert len(steps) == STEPS
    why = [s["discarded_by"] for s in steps]
    if max_grad_norm == 1e-3:
        assert why[1:] == ["clip"] * (STEPS - 1), why
    else:
        # The first step learns the two backward passes per step (gradient accumulation);
        # every later one commits what was speculated during backward.
        assert why == ["accumulation"] + [None] * (STEPS - 1), why
        assert all(s["outcome"] == "commit" and s["clip_norm"] > 0 for s in steps[1:]), steps
    plain, _ = train(max_grad_norm, False, device, str(tmp_path / "plain"))
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a.detach(), b.detach()), f"{name} differs from the plain step"

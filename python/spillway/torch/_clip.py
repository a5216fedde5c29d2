"""Note [Clips the speculation saw]: ``torch.nn.utils.clip_grad_norm_`` answered by CPUAdamW.

``transformers.Trainer`` (through ``accelerate``) clips the gradients every step, also
with ``max_grad_norm=0`` (with ``inf``, to log the norm), and most hand-written loops clip
before ``step()``: torch's function rescales every gradient in place, even by exactly 1,
after CPUAdamW's speculative step read them, so the step would have to be dropped every
time. CPUAdamW already knows the norm: its speculative pass summed the squares of the very
gradients torch would read. So, once a speculative CPUAdamW is made with
``recognize_clip=True`` (the opt-in: torch's function is never replaced otherwise),
torch's function is wrapped: a call whose gradients are exactly the ones one CPUAdamW
speculated on (every one it was handed, nothing else, unchanged since) is answered from
that sum when the clip would scale by 1 (the norm clearly under ``max_norm``): nothing is
written, the returned norm is the speculation's, and ``step()`` commits. Any other call
runs torch's function as it is; when it would scale gradients CPUAdamW speculated on, the
speculation is dropped first (its reads are over before torch writes) and ``step()`` runs
from ``.grad`` as it is, bitwise what a non-speculative step after the clip computes. The
wrapper is installed once, by the first such CPUAdamW (``spillway.torch.clip_grad_norm_``
is the same function, for code that imported torch's before spillway).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Optional, Union

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

__all__ = ["clip_grad_norm_"]

_torch_clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_


@functools.wraps(_torch_clip_grad_norm_)
def clip_grad_norm_(
    parameters: Union[torch.Tensor, Any],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        was_generator = isinstance(parameters, types.GeneratorType)
        params = list(parameters)
        if was_generator and not params:  # torch warns about an empty generator
            return _torch_clip_grad_norm_(
                parameters, max_norm, norm_type, error_if_nonfinite, foreach
            )
    owners = _owners(params)
    for opt in owners:
        norm: Optional[torch.Tensor] = opt._clip_speculated(
            params, float(max_norm), float(norm_type), len(owners) == 1
        )
        if norm is not None:
            return norm
    return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)


def _owners(params: list[torch.Tensor]) -> list[Any]:
    """The live CPUAdamWs owning a parameter with a gradient (usually none or one)."""
    owners: list[Any] = []
    for p in params:
        ref = getattr(p, "_spillway_cpu_adamw", None) if p.grad is not None else None
        opt = ref() if ref is not None else None
        if opt is not None and all(opt is not o for o in owners):
            owners.append(opt)
    return owners


def install() -> None:
    """Wraps torch's ``clip_grad_norm_`` where callers find it (once; idempotent)."""
    if torch.nn.utils.clip_grad_norm_ is not clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    if torch.nn.utils.clip_grad.clip_grad_norm_ is not clip_grad_norm_:
        torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_

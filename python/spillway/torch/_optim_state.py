"""The state of a CPUAdamW, declared for the pieces that read it.

CPUAdamW (optim.py) makes this state in its ``__init__``; its hand-over
(_optim_handover.py), device path (_optim_device.py), validation (_optim_validate.py) and
checkpoints (_optim_checkpoints.py) are the classes it is made of, and read and write it
through ``self``. Declared here, with the methods one piece calls in another, so that each
piece is typed alone; at run time the class adds nothing to ``torch.optim.Optimizer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

__all__ = ["AdamWState"]


class AdamWState(torch.optim.Optimizer):
    """What CPUAdamW.__init__ makes (see there for what each is)."""

    accumulation_steps: int
    early_weights: bool
    recognize_clip: bool
    _learn_accumulation: bool
    _short_steps: int
    _params: list[torch.Tensor]
    _index: dict[int, int]
    _device: Optional[torch.device]
    _closed: bool
    _sharded: bool
    _core: Any
    _flat_w: Optional[torch.Tensor]
    _flat_g: Optional[torch.Tensor]
    _offsets: list[int]
    _adopted: Optional[torch.cuda.Stream]
    _shared: Optional[list[tuple[torch.Tensor, Optional[torch.Tensor]]]]
    _handed: list[Optional[tuple[torch.Tensor, torch.Tensor, int]]]
    _seen: list[int]
    _view_versions: dict[int, int]
    _stamps: list[tuple[int, int, int]]
    _synced: Optional[list[tuple[float, ...]]]
    _discarded: Optional[str]
    _clip_norm: Optional[float]
    _warned_changed: bool

    if TYPE_CHECKING:  # defined by one piece, called by another

        def _sync_hparams(self) -> None:  # optim.py
            raise NotImplementedError

        def _into_flat_grad(  # _optim_device.py
            self, i: int, p: torch.Tensor, grad: torch.Tensor
        ) -> torch.Tensor:
            raise NotImplementedError

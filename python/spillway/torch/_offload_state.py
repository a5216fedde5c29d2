"""The state of an OffloadActivations, declared for the pieces that read it.

OffloadActivations (offload.py) makes this state in its ``__init__``; its plan mode
(_offload_plan.py) and its engine hooks (_offload_engine.py) are the classes it is made of,
and read and write it through ``self``. Declared here, with the methods one piece calls in
another (or selective.py's layers call), so that each piece is typed alone; at run time
the class holds nothing.
"""

from __future__ import annotations

import collections
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from ._offload_engine import Saved
    from .adaptive import AutoPlanner
    from .selective import SelectiveLayer

__all__ = ["OffloadState"]


class OffloadState:
    """What OffloadActivations.__init__ makes (see there for what each is)."""

    model: nn.Module
    layers: list[nn.Module]
    plan: Optional[dict[str, Any]]
    pinned_bytes: Optional[int]
    min_bytes: int
    keep_last: int
    prefetch_depth: int
    inflight_bound_bytes: int
    max_tensors: int
    verify: bool
    d2h_gbps: float
    h2d_gbps: float
    on_step: Optional[Callable[[dict[str, Any]], None]]
    _copy_batch: int
    # plan="auto" (Note [Re-planning while training])
    _auto: Optional[AutoPlanner]
    _fwd_ms: list[float]
    _shape: Optional[tuple[int, int, str]]
    # plan mode
    _offload_names: Optional[list[frozenset[str]]]
    _checkpointed: list[int]
    _selective: dict[int, SelectiveLayer]
    _originals: dict[int, Any]
    _plan_mode: bool
    _running: list[str]
    _named: dict[int, tuple[weakref.ref[torch.Tensor], str]]
    # the engine and the step
    _session: Optional[Any]
    _device: Optional[torch.device]
    _device_index: Optional[int]
    _layer: Optional[int]
    _step: int
    _open: bool
    _in_backward: bool
    _param_storages: set[int]
    _pending: collections.deque[torch.Tensor]
    _released: int
    _release_at: int
    _offload_below: int
    _by_layer: list[list[Saved]]
    _dedup: dict[int, tuple[Saved, weakref.ref[torch.Tensor], int, int]]
    _counts: collections.Counter[str]
    _sizing_bytes: int
    _grad_forwards: int
    _traced: bool
    _census: Optional[list[dict[str, int]]]
    _census_seen: set[int]
    _last: dict[str, Any]

    if TYPE_CHECKING:  # defined by one piece, called by another

        def _warn_once(self, key: str, message: str) -> None:  # offload.py
            raise NotImplementedError

        def _plan_name(self, t: torch.Tensor) -> str:  # _offload_plan.py
            raise NotImplementedError

        def _replan(self, rep: dict[str, Any]) -> None:  # _offload_plan.py
            raise NotImplementedError

        def _make_session(self, pinned_bytes: int) -> None:  # _offload_engine.py
            raise NotImplementedError

        # _offload_engine.py, called by selective.py's layers
        def _offload(self, t: torch.Tensor, layer: int, name: str, uses: int = 0) -> Any:
            raise NotImplementedError

        def _unpack(self, packed: Any) -> torch.Tensor:
            raise NotImplementedError

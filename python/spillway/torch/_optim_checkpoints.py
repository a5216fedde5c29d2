"""CPUAdamW's checkpoints: ``state_dict()`` in torch's layout from the host state, and
``load_state_dict`` restoring it bitwise (FSDP2's state as DTensors: Note [Optimizer state
of sharded parameters]).
"""

from __future__ import annotations

from typing import Any, Union

import torch

from ._common import _DTYPES, _local
from ._optim_state import AdamWState

__all__ = ["Checkpoints"]


def _like_dtensor(p: Any, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this process's shard of a state of p) as a DTensor laid out like p."""
    from torch.distributed.tensor import DTensor

    shard = local.view(_local(p).shape).to(_local(p).device)
    out: torch.Tensor = DTensor.from_local(
        shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    return out


class Checkpoints(AdamWState):
    """CPUAdamW's checkpoints (its state: AdamWState, made by CPUAdamW)."""

    # ---- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``state[i] = {step, exp_avg, exp_avg_sq, master_param}``."""
        self._sync_state_out()
        out = super().state_dict()
        self._sync_state_out(full=False)  # the copies live in `out` alone
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the master weights, moments, steps and hyperparameters, bitwise."""
        if any(h is not None for h in self._handed):  # a step in flight: dropped
            self._core.abort()
            self._handed = [None] * len(self._params)
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"CPUAdamW.load_state_dict: {len(groups)} parameter groups, the optimizer "
                f"has {len(self.param_groups)}"
            )
        order = [i for g in groups for i in g["params"]]
        if len(order) != len(self._params):
            raise ValueError(
                f"CPUAdamW.load_state_dict: {len(order)} parameters, the optimizer has "
                f"{len(self._params)}"
            )
        for mine, theirs in zip(self.param_groups, groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v
        for i, key in enumerate(order):
            st = state_dict["state"].get(key)
            if st is None:
                continue
            p = self._params[i]
            master = _local(st.get("master_param", p.detach())).to(torch.float32).contiguous()
            m = _local(st["exp_avg"]).to(torch.float32).contiguous()
            v = _local(st["exp_avg_sq"]).to(torch.float32).contiguous()
            for name, t in (("master_param", master), ("exp_avg", m), ("exp_avg_sq", v)):
                if t.numel() != _local(p).numel():
                    raise ValueError(
                        f"CPUAdamW.load_state_dict: parameter {i}: {name} has {t.numel()} "
                        f"elements, the parameter {_local(p).numel()}"
                    )
            if self._device is not None:
                self._core.write_state(
                    i, master.data_ptr(), m.data_ptr(), v.data_ptr(), int(st["step"])
                )
                continue
            self._core.write_state(i, master.data_ptr(), m.data_ptr(), v.data_ptr())
            self._core.set_bucket_step(i, int(st["step"]))
            self._core.store_weights(i, _local(p).data_ptr(), _DTYPES[p.dtype])
        self._synced = None

    def _sync_state_out(self, full: bool = True) -> None:
        """``self.state`` from the host state: whole (full), or each parameter's step."""
        for i, p in enumerate(self._params):
            t = self._core.bucket_step(i)
            if t == 0:
                continue
            if not full:
                self.state[p] = {"step": torch.tensor(float(t))}
                continue
            master = torch.empty(_local(p).shape, dtype=torch.float32)
            m = torch.empty_like(master)
            v = torch.empty_like(master)
            self._core.read_state(i, master.data_ptr(), m.data_ptr(), v.data_ptr())
            st: dict[str, Union[torch.Tensor, float]] = {
                "step": torch.tensor(float(t)),
                "exp_avg": m,
                "exp_avg_sq": v,
            }
            if p.dtype != torch.float32:
                st["master_param"] = master
            if hasattr(p, "to_local"):
                # Note [Optimizer state of sharded parameters]: FSDP2's parameters are
                # DTensors; so is their state, as torch's AdamW keeps it, so that DCP saves
                # every process's shard (a plain tensor would be taken as replicated: one
                # process's copy saved for all).
                for k in ("exp_avg", "exp_avg_sq", "master_param"):
                    t = st.get(k)
                    if isinstance(t, torch.Tensor):
                        st[k] = _like_dtensor(p, t)
            self.state[p] = st

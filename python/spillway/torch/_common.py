"""What the torch adapters share: the telemetry of each engine (report()), the model's
decoder blocks and device, its parameters' storages, and small helpers of the modules of
spillway.torch (offload, optim, stream, measure), which import them from here alone.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

_MiB = 1 << 20

_last_reports: dict[str, dict[str, Any]] = {}


def report() -> dict[str, Any]:
    """The last step's telemetry of each spillway engine used in this process.

    ``report()["offload"]``: bytes offloaded and reloaded, stall ms, overlap, tensors
    offloaded and kept (and why), per layer; ``report()["optimizer"]``: the CPU AdamW's
    last step (when a :class:`CPUAdamW` stepped). Empty before the first step ends.
    """
    return {k: dict(v) for k, v in _last_reports.items()}


def _record_report(engine: str, value: dict[str, Any]) -> None:
    _last_reports[engine] = value


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder blocks: the largest ``nn.ModuleList`` of blocks of one class.

    Hugging Face models keep them in ``model.model.layers`` (``transformer.h``, ...); any
    ModuleList whose children share a class qualifies, and so does one of as many blocks
    as ``model.config.num_hidden_layers`` (a hybrid's Mamba and attention blocks, Jamba's,
    are of two classes); the one holding the most parameters wins. Raises ValueError when
    there is none (pass ``layers=`` then).
    """
    config = getattr(model, "config", None)
    n_layers = getattr(config, "num_hidden_layers", None)
    best: Optional[nn.ModuleList] = None
    best_params = -1
    for _, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 1:
            continue
        kinds = {type(m) for m in mod}
        if len(kinds) != 1 and len(mod) != n_layers:
            continue
        n = sum(p.numel() for p in mod.parameters())
        if n > best_params:
            best, best_params = mod, n
    if best is None or best_params <= 0:
        raise ValueError(
            f"offload_activations: no decoder blocks found in {type(model).__name__} (no "
            "nn.ModuleList of same-class blocks with parameters); pass layers=[...] with the "
            "blocks in forward order"
        )
    return list(best)


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for o in output:
            if isinstance(o, torch.Tensor):
                return o
    if isinstance(output, dict):
        for o in output.values():
            if isinstance(o, torch.Tensor):
                return o
    return None


def _parameter_storages(model: nn.Module) -> set[int]:
    """The storage addresses of the model's parameters (a DTensor's local shard; a
    parameter whose storage is freed, as FSDP2's unsharded ones between uses, has none)."""
    ptrs: set[int] = set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        try:
            ptr = local.untyped_storage().data_ptr()
        except RuntimeError:
            continue
        if ptr:
            ptrs.add(ptr)
    return ptrs


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _hf_checkpointing(model: torch.nn.Module) -> bool:
    """Whether a Hugging Face model has its own gradient (activation) checkpointing on; read
    through the property its transformers version has, without the deprecated one."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _compiled_in_place(model: torch.nn.Module) -> bool:
    """Whether ``model.compile()`` compiled the model's own call (torch 2.2+)."""
    return getattr(model, "_compiled_call_impl", None) is not None


# ---- CPUAdamW's (optim.py and its pieces) -------------------------------------------

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _stamp(p: torch.Tensor) -> tuple[int, int, int]:
    """What a parameter is now: its storage and its version counters (bumped by every
    in-place write through torch). A DTensor (FSDP2) has two: an in-place write through it
    (``load_state_dict``, DCP's ``set_state_dict``) bumps the wrapper's, not its local
    tensor's, which only writes to the local tensor bump."""
    lp = _local(p)
    return (lp.data_ptr(), lp._version, p._version)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    if to_local is None:
        return t
    local: torch.Tensor = to_local()
    return local

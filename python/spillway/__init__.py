"""spillway: move what does not fit in GPU memory to CPU memory, and bring it back in time.

The planner (:func:`plan`) and, in :mod:`spillway.torch`, the engines inside a PyTorch
training step. ``import spillway`` does not import torch; ``import spillway.torch`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from . import _spillway
from ._spillway import Error

__version__: str = _spillway.version()
__all__ = ["Error", "plan", "__version__"]


def plan(
    model: str = "Qwen3-30B-A3B",
    hardware: str = "gh200",
    *,
    micro_batch: int = 1,
    seq_len: int = 4096,
    dtype: str = "bf16",
    tp: int = 1,
    ep: int = 1,
    cp: int = 1,
    pp: int = 1,
    dp: int = 1,
    grad_accum: int = 1,
    fused_swiglu: bool = False,
    mtp: bool = False,
    policy: str = "auto",
    margin: float = 0.10,
    layer_fwd_ms: Optional[float] = None,
    profile: str = "",
    hbm_budget_gb: Optional[float] = None,
    d2h_gbps: Optional[float] = None,
    h2d_gbps: Optional[float] = None,
    keep_last: int = 1,
    prefetch_depth: int = 1,
    zero: int = 1,
    fsdp: bool = False,
    optimizer: str = "device",
    grad_offload: bool = False,
    loss_chunk: int = 0,
    cpu_adam_gbps: Optional[float] = None,
    offload_tensors: Optional[Sequence[str] | str] = None,
    saved: Optional[Any] = None,
) -> dict[str, Any]:
    """Plan what to keep, offload or recompute, as ``spillway plan`` does.

    Returns the plan as a dict in the CLI's JSON schema (``spillway plan --json``,
    schema ``spillway.plan/1``, docs/plan-schema.md): ``plan["summary"]["feasible"]``,
    ``plan["layers"][i]["tensors"]`` with each saved tensor's ``action``, and so on.
    An infeasible plan is returned too (``feasible`` is False, ``reasons`` say why).

    Args:
        model: a catalog name (``spillway catalog``) or the path of a Hugging Face
            ``config.json``.
        hardware: a hardware profile name (``gh200``, ``h100-pcie``, ...) or a JSON path.
        micro_batch, seq_len, dtype, tp, ep, cp, pp, dp, grad_accum: the workload, as the
            CLI's flags of the same names.
        policy: ``auto``, ``keep``, ``recompute``, ``offload``, ``selective``, ``hybrid``
            or ``checkpoint``.
        margin: transfers must fit their window divided by ``1 + margin`` (0.10 = 10%).
        zero, fsdp: ZeRO stage over ``dp`` (``fsdp=True`` is ``zero=3``).
        optimizer: ``device`` or ``offload`` (CPU AdamW, state in host memory).
        offload_tensors: state the experiment: exactly these saved tensors (names of
            docs/plan-schema.md, or the groups ``attn``, ``mlp``, ``moe``, ``ssm``, ``lin``,
            ``rec``; a list, or one comma-separated string) are offloaded in every layer
            that offloads; the rest follows ``policy`` (``keep`` keeps it; ``recompute``,
            ``offload`` recompute it; ``auto`` chooses per layer). None: the planner
            chooses. ``plan["options"]["offload_tensors"]`` lists the names resolved.
        saved: the saved tensors as the model really runs (Note [A model as PyTorch runs
            it], docs/planner.md): what :func:`spillway.torch.measure_saved` returns (scaled
            here to ``micro_batch`` x ``seq_len``), or one mapping per layer of the model from
            a tensor's planner name to its bytes. They replace the inventory's sizes, which
            assume fused kernels; ``plan["options"]["saved_as_run"]`` is then True. Needs
            ``tp=1`` and ``cp=1``. None: the inventory.

    Raises:
        ValueError: a value out of range, naming the field and the value.
        spillway.Error: a model or hardware file that cannot be read.
    """
    if fsdp:
        if zero not in (1, 3):
            raise ValueError(f"fsdp is True, which is zero=3; zero={zero} contradicts it")
        zero = 3
    text = _spillway.plan_json(
        model,
        hardware,
        micro_batch,
        seq_len,
        dtype,
        tp,
        ep,
        cp,
        pp,
        dp,
        grad_accum,
        fused_swiglu,
        mtp,
        policy,
        float(margin),
        layer_fwd_ms,
        profile,
        hbm_budget_gb,
        d2h_gbps,
        h2d_gbps,
        keep_last,
        prefetch_depth,
        zero,
        optimizer,
        grad_offload,
        loss_chunk,
        cpu_adam_gbps,
        _names(offload_tensors),
        _saved(saved, micro_batch, seq_len),
    )
    result: dict[str, Any] = json.loads(text)
    return result


def _saved(saved: Optional[Any], micro_batch: int, seq_len: int) -> list[list[tuple[str, int]]]:
    """Per layer, (name, bytes) of the saved tensors as measured (Note [A model as PyTorch
    runs it]): a measurement scaled to the job, or the mappings given."""
    if saved is None:
        return []
    at = getattr(saved, "at", None)
    layers = at(micro_batch, seq_len) if callable(at) else saved
    if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Sequence):
        raise ValueError(
            f"saved is a {type(saved).__name__}; give spillway.torch.measure_saved(model) or "
            "one mapping per layer from a tensor's name to its bytes"
        )
    out: list[list[tuple[str, int]]] = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, Mapping):
            raise ValueError(
                f"saved[{i}] is a {type(layer).__name__}; each layer is a mapping from a "
                "tensor's name to its bytes"
            )
        out.append([(str(k), int(v)) for k, v in layer.items()])
    return out


def _names(names: Optional[Sequence[str] | str]) -> list[str]:
    """Names given as a sequence, or as one comma-separated string (as the CLI's flag)."""
    if names is None:
        return []
    if isinstance(names, str):
        return names.split(",")
    return [str(n) for n in names]

"""spillway inside a PyTorch training step, with two added lines.

- :func:`offload_activations`: saved activations go to host memory in forward and come
  back ahead of their use in backward (the activation offload engine, docs/offload.md).
- :class:`CPUAdamW`: the optimizer step on the CPU with speculation then validation
  (the optimizer offload pipeline, docs/optim.md).
- :func:`stream_weights`: each decoder block's weights streamed from pinned host memory
  into a ring of device slots, compile-visible (weight streaming, docs/stream.md).
- :func:`measure_saved`: what the model's blocks save for backward as PyTorch runs them,
  by planner name, for ``spillway.plan(saved=...)`` (Note [A model as PyTorch runs it]).
- :func:`clip_grad_norm_`: ``torch.nn.utils.clip_grad_norm_``, answered from CPUAdamW's
  speculation when the clip scales nothing (installed in torch's place only when a
  speculative ``CPUAdamW(recognize_clip=True)`` is made; this name is for code that
  imported torch's earlier).

This module imports torch; ``import spillway`` alone does not.
"""

from __future__ import annotations

from ._clip import clip_grad_norm_
from .measure import SavedTensors, measure_saved
from .offload import OffloadActivations, offload_activations, report

# CPUAdamW (spillway.torch.optim)
from .optim import CPUAdamW
from .stream import StreamedWeights, stream_weights

__all__ = [
    "CPUAdamW",
    "OffloadActivations",
    "SavedTensors",
    "StreamedWeights",
    "clip_grad_norm_",
    "measure_saved",
    "offload_activations",
    "report",
    "stream_weights",
]

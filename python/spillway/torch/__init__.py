"""spillway inside a PyTorch training step, with two added lines.

- :func:`offload_activations`: saved activations go to host memory in forward and come
  back ahead of their use in backward (the activation offload engine, docs/offload.md).
- :class:`CPUAdamW`: the optimizer step on the CPU with speculation then validation
  (the optimizer offload pipeline, docs/optim.md).
- :func:`stream_weights`: each decoder block's weights streamed from pinned host memory
  into a ring of device slots, compile-visible (weight streaming, docs/stream.md).

This module imports torch; ``import spillway`` alone does not.
"""

from __future__ import annotations

from .offload import OffloadActivations, offload_activations, report

# CPUAdamW (spillway.torch.optim)
from .optim import CPUAdamW
from .stream import StreamedWeights, stream_weights

__all__ = [
    "CPUAdamW",
    "OffloadActivations",
    "StreamedWeights",
    "offload_activations",
    "report",
    "stream_weights",
]

"""What a model's decoder blocks save for backward as PyTorch runs them, for the planner.

Note [A model as PyTorch runs it] (the planner's side: src/plan/saved_as_run.cpp): the
planner's inventory assumes fused kernels; an eager Hugging Face block saves more (each
RMSNorm's fp32 copy and pre-weight product, SiLU's output beside SwiGLU's, int64 router
indices; a Mamba block on its slow path several times more). :func:`measure_saved` runs two
small forwards of the user's own model under ``saved_tensors_hooks``, counts what each
block saves (each storage once, parameters left out) by the names the offload adapter gives
its tensors (Note [Names of Hugging Face tensors]), and fits each name's bytes to
``a * seq_len + b * seq_len**2`` per sequence (linear for SDPA attention, quadratic for an
eager one); :meth:`SavedTensors.at` scales them to a job, and ``spillway.plan(saved=...)``
plans from them. ``offload_activations(model, plan="auto")`` counts its measured first step
the same way (at the job's own shape, nothing to scale) and plans from that.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

__all__ = ["SavedTensors", "measure_saved"]


class SavedTensors:
    """Per decoder block, the bytes autograd saves under each planner name, measured at two
    sequence lengths of one sequence; :meth:`at` gives them for a job.

    ``layers[i][name]`` is ``(bytes at seq_lens[0], bytes at seq_lens[1])``.
    """

    def __init__(self, seq_lens: tuple[int, int], layers: list[dict[str, tuple[int, int]]]):
        self.seq_lens = seq_lens
        self.layers = layers

    def _fit(self, b1: int, b2: int) -> tuple[float, float]:
        """(a, b) of bytes(s) = a*s + b*s^2 through the two measurements; never negative."""
        s1, s2 = self.seq_lens
        den = s1 * s2 * (s2 - s1)
        a = (b1 * s2 * s2 - b2 * s1 * s1) / den
        b = (b2 * s1 - b1 * s2) / den
        if b < 0.0:  # not quadratic: linear through the longer measurement
            return b2 / s2, 0.0
        if a < 0.0:
            return 0.0, b2 / (s2 * s2)
        return a, b

    def at(self, micro_batch: int, seq_len: int) -> list[dict[str, int]]:
        """Per block, the bytes each name saves for ``micro_batch`` sequences of
        ``seq_len`` tokens: what ``spillway.plan(saved=...)`` takes."""
        if micro_batch < 1 or seq_len < 1:
            raise ValueError(
                f"SavedTensors.at: micro_batch={micro_batch}, seq_len={seq_len}; both >= 1"
            )
        out: list[dict[str, int]] = []
        for layer in self.layers:
            sizes: dict[str, int] = {}
            for name, (b1, b2) in layer.items():
                a, b = self._fit(b1, b2)
                sizes[name] = int(round(micro_batch * (a * seq_len + b * seq_len * seq_len)))
            out.append(sizes)
        return out

    def totals(self, micro_batch: int, seq_len: int) -> list[int]:
        """Per block, all its saved bytes for the job."""
        return [sum(layer.values()) for layer in self.at(micro_batch, seq_len)]

    def __repr__(self) -> str:
        s1, s2 = self.seq_lens
        per = [sum(b for _, b in layer.values()) for layer in self.layers]
        return f"SavedTensors({len(self.layers)} blocks, bytes per block at seq {s2}: {per})"


def _token_batch(model: nn.Module, seq_len: int, device: torch.device) -> dict[str, Any]:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(
            "measure_saved: the model has no config.vocab_size (not a Hugging Face causal LM); "
            "pass inputs=lambda seq_len: <the forward's arguments> for seq_len tokens"
        )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g).to(device)
    return {"input_ids": ids, "use_cache": False}


def measure_saved(
    model: nn.Module,
    *,
    seq_lens: tuple[int, int] = (64, 128),
    layers: Optional[Sequence[nn.Module]] = None,
    inputs: Optional[Callable[[int], Any]] = None,
) -> SavedTensors:
    """Measures what ``model``'s decoder blocks save for backward, by planner name.

    Two forwards of one sequence (``seq_lens`` tokens; random token ids for a Hugging Face
    causal LM, else ``inputs(seq_len)``: a dict of keyword arguments or one tensor), with
    grad enabled, no backward; the model is left as it was. Run it in the mode the model
    trains in (``model.train()``: dropout saves its masks) and on its device (the kernels,
    hence what they save, are the device's).

    Returns a :class:`SavedTensors`; ``spillway.plan(..., saved=measured)`` plans from it.
    """
    from ._common import _model_device
    from .offload import OffloadActivations

    s1, s2 = seq_lens
    if not (isinstance(s1, int) and isinstance(s2, int) and 1 <= s1 < s2):
        raise ValueError(f"measure_saved: seq_lens is {seq_lens!r}; two ints, 1 <= first < second")
    off = OffloadActivations(model, layers=layers, offload_tensors="attn", min_bytes=1 << 62)
    off._census = [{} for _ in off.layers]  # counts; offloads nothing (min_bytes)
    device = _model_device(model)
    runs: list[list[dict[str, int]]] = []
    try:
        for s in (s1, s2):
            args = inputs(s) if inputs is not None else _token_batch(model, s, device)
            with torch.enable_grad(), off:
                out = model(**args) if isinstance(args, dict) else model(args)
            off._end_step(quiet=True)
            del out
            assert off._census is not None
            runs.append(off._census)
    finally:
        off.remove()
    names = [sorted(set(a) | set(b), key=lambda n: (n not in a, n)) for a, b in zip(*runs)]
    measured = [
        {n: (a.get(n, 0), b.get(n, 0)) for n in order}
        for order, a, b in zip(names, runs[0], runs[1])
    ]
    if not any(b for layer in measured for _, b in layer.values()):
        raise ValueError(
            "measure_saved: the blocks saved nothing for backward (do their parameters require "
            "grad? is the forward compiled?)"
        )
    return SavedTensors((s1, s2), measured)

"""CPUAdamW's validation of its speculation: a gradient unchanged since its hand-over
(Note [Gradients that share a version counter]), the speculation dropped and why, the
backward passes per step (Note [Backward passes per step]), and a torch clip answered from
the speculation's norm (Note [Clips the speculation saw], _clip.py).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Optional

import torch

from ._optim_state import AdamWState

__all__ = ["Validation"]


_INTERNAL = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def _warn_user(message: str) -> None:
    """A UserWarning attributed to the first caller outside spillway and torch (the
    training loop, or the library that runs it)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(message, UserWarning, stacklevel=level + 1)


class Validation(AdamWState):
    """CPUAdamW's validation (its state: AdamWState, made by CPUAdamW)."""

    def _unchanged(self, i: int, grad: Optional[torch.Tensor]) -> bool:
        """Parameter i's gradient is still the one handed over, unwritten since.

        Note [Gradients that share a version counter]: views of one buffer (the device
        path's flat gradients, DDP's ``gradient_as_bucket_view``) share their base's
        counter, which every later accumulation into another view bumps: a view is
        unchanged when the counter is where the buffer's last hand-over left it (backward
        writes no gradient after the last hand-over of the step; a clip or an edit does)."""
        h = self._handed[i]
        if h is None or grad is not h[1]:
            return False
        base = grad._base
        want = h[2] if base is None else self._view_versions.get(id(base), -1)
        return grad._version == want

    def _discard(self, why: str) -> None:
        """Drops the speculative work of this step (its reads of the gradients are done
        when this returns); the step then runs from ``.grad`` as it is."""
        self._synced = None
        if all(h is None for h in self._handed):
            return
        self._core.abort()
        self._handed = [None] * len(self._params)
        if self._discarded is None:
            self._discarded = why
        if why == "changed" and not self._warned_changed:
            self._warned_changed = True
            _warn_user(
                "CPUAdamW: gradients changed after they were handed over (edited in place, "
                "or clipped: torch.nn.utils.clip_grad_norm_ writes them unless the optimizer "
                "was made with recognize_clip=True); the speculative step was dropped and the "
                "step ran from .grad as it is. Clip with torch.nn.utils.clip_grad_norm_ and "
                "CPUAdamW(recognize_clip=True), or with CPUAdamW(max_grad_norm=...), to keep "
                'the overlap (docs/python.md, "Clipping")'
            )

    def _check_passes(self, passes: int) -> None:
        """Note [Backward passes per step]: the passes seen since the last step against
        ``accumulation_steps``: learned when it was not given, said when it was."""
        if passes > self.accumulation_steps:
            if self._learn_accumulation:
                self.accumulation_steps = passes
            else:
                _warn_user(
                    f"CPUAdamW: {passes} backward passes before this step, but "
                    f"accumulation_steps={self.accumulation_steps}: gradients were handed "
                    "over before they were final and the speculation was dropped; pass "
                    f"accumulation_steps={passes} (or None to learn it)"
                )
        short = 0 < passes < self.accumulation_steps
        self._short_steps = self._short_steps + 1 if short else 0
        if self._short_steps == 2 and not self._learn_accumulation:
            _warn_user(
                f"CPUAdamW: {passes} backward passes per step, but accumulation_steps="
                f"{self.accumulation_steps}: no gradient is handed over during backward, so "
                f"nothing is speculated; pass accumulation_steps={passes}"
            )

    def _clip_speculated(
        self, params: list[torch.Tensor], max_norm: float, norm_type: float, alone: bool
    ) -> Optional[torch.Tensor]:
        """Note [Clips the speculation saw]: ``clip_grad_norm_(params, max_norm)`` answered
        from the speculation's norm when the clip scales nothing, or None: torch's function
        runs, after the speculation is dropped if it read any of these gradients. ``alone``:
        no other CPUAdamW owns a parameter of the call."""
        if self._closed or all(h is None for h in self._handed):
            return None
        seen: set[int] = set()
        foreign = not alone
        changed = False
        dtype = None
        device = None
        for p in params:
            g = p.grad
            if g is None:
                continue
            device = g.device if device is None else device
            i = self._index.get(id(p))
            if i is None or i in seen:
                foreign = True  # a gradient the norm adds that the speculation did not sum
            elif not self._unchanged(i, g):
                changed = True  # accumulated again, or edited, since it was handed over
            else:
                seen.add(i)
                dtype = g.dtype if dtype is None else torch.promote_types(dtype, g.dtype)
        if not seen and not changed:
            return None  # none of the gradients it speculated on
        if changed:
            passes = max(self._seen, default=0)
            self._discard("accumulation" if passes > self.accumulation_steps else "changed")
            return None
        every = len(seen) == sum(h is not None for h in self._handed)
        if self.recognize_clip and every and not foreign:
            norm = math.sqrt(self._core.arrived_sum_of_squares()) if norm_type == 2 else math.nan
            # torch scales by min(max_norm / (norm + 1e-6), 1) from its own norm (float32,
            # or rounded to bfloat16 for bfloat16 gradients): a clear margin says it is 1.
            margin = 1 / 64 if dtype == torch.bfloat16 else 1e-3
            if math.isfinite(norm) and norm + 1e-6 <= max_norm * (1 - margin):
                self._clip_norm = norm
                return torch.tensor(norm, dtype=dtype, device=device)  # where torch's would be
        self._discard("clip")  # it may scale them: the speculation read them unscaled
        return None

"""The engine side of offload_activations: the saved-tensor hooks (pack: a saved tensor
handed to the C++ offload engine; unpack: reloaded where it is used), the reloads of a
block started ahead of its backward, and each step's begin, engine session and end
(telemetry, the pool sized by the first step, what is said once).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from .. import _spillway
from ._common import _MiB, _model_device, _parameter_storages, _record_report
from ._offload_state import OffloadState

__all__ = ["EngineHooks", "Saved"]


class Saved:
    """One offloaded saved tensor: its ticket, how to rebuild it (on the offload's device),
    its reload."""

    __slots__ = (
        "ticket",
        "layer",
        "shape",
        "dtype",
        "nbytes",
        "name",
        "uses",
        "dst",
        "tensor",
        "step",
    )

    def __init__(
        self,
        ticket: int,
        layer: int,
        shape: torch.Size,
        dtype: torch.dtype,
        nbytes: int,
        name: str,
        step: int,
    ) -> None:
        self.ticket = ticket
        self.layer = layer
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.name = name  # counted at the step's end (Note [Hook cost per tensor])
        self.uses = 1  # unpacks still to come (a tensor saved twice is offloaded once)
        self.dst: Optional[torch.Tensor] = None  # prefetch destination
        self.tensor: Optional[torch.Tensor] = None  # reloaded, until its last use
        self.step = step


class EngineHooks(OffloadState):
    """OffloadActivations' engine hooks (their state: OffloadState, made by OffloadActivations)."""

    # ---- reloads ahead of backward -----------------------------------------------------

    def _reload_block(self, layer: int) -> None:
        """Starts the reloads of block `layer`'s offloaded tensors not started yet.

        Note [Reloads in slabs]: their destinations are allocated a few at a time, not one
        by one: the tensors of one dtype, device and trailing shape are the parts of one
        tensor split along its first dimension (one allocation and one split instead of an
        allocation each, about 2 us of torch's argument parsing per tensor), and the
        engine hears of them in one call. Each part is contiguous, shaped as its tensor
        was. A slab lives until its last part is released: at the start of the block's
        backward all of them are live in either scheme, so the peak is the same."""
        todo = [s for s in self._by_layer[layer] if s.dst is None and s.tensor is None]
        if not todo:
            return
        device = self._device
        groups: dict[tuple[Any, ...], list[Saved]] = {}
        for s in todo:
            if s.shape:
                groups.setdefault((s.dtype, s.shape[1:]), []).append(s)
            else:  # a 0-d tensor has no first dimension to split
                s.dst = torch.empty(s.shape, dtype=s.dtype, device=device)
        for (dtype, rest), members in groups.items():
            firsts = [s.shape[0] for s in members]
            slab = torch.empty((sum(firsts), *rest), dtype=dtype, device=device)
            for s, part in zip(members, slab.split_with_sizes(firsts)):
                s.dst = part
        assert self._session is not None
        self._session.will_need_many(
            [s.ticket for s in todo],
            [s.dst.data_ptr() for s in todo],  # type: ignore[union-attr]
        )

    # ---- the saved-tensor hooks ------------------------------------------------------

    # Note [Hook cost per tensor]: the pack and unpack hooks run for every tensor autograd
    # saves, on the training step's CPU path. Each asks what it must and builds little: the
    # cheapest questions first, none that makes a Python object it need not (t.device does:
    # get_device() is an int; the device is the offload's), a tensor saved again found by
    # id() (checked alive, unchanged and at the same address), the engine told once a few
    # tensors which copies are done (copies_done), and the counts of offloaded tensors
    # summed at the step's end from what was offloaded, not counted one by one.

    def _pack(self, t: torch.Tensor) -> Any:
        layer = self._layer
        if layer is None or self._in_backward:
            return t
        if self._census is not None:
            self._count(t, layer)
        if self._stays(t, layer):
            return t
        name = "saved"
        if self._offload_names is not None:
            name = self._plan_name(t)
            if name not in self._offload_names[layer]:
                self._counts["kept_by_plan" if self._plan_mode else "kept_not_named"] += 1
                return t
        return self._offload(t, layer, name)

    def _count(self, t: torch.Tensor, layer: int) -> None:
        """Note [A model as PyTorch runs it]: `t`'s storage counted once, by `t`'s name, in
        block `layer` (parameters and their views left out: they are the weights')."""
        assert self._census is not None
        if t.layout is not torch.strided or (t.is_leaf and t.requires_grad):
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr or ptr in self._param_storages or ptr in self._census_seen:
            return
        self._census_seen.add(ptr)  # alive: autograd holds it until backward
        counts = self._census[layer]
        name = self._plan_name(t)
        counts[name] = counts.get(name, 0) + storage.nbytes()

    def _stays(self, t: torch.Tensor, layer: int) -> bool:
        """Whether `t` of block `layer` stays where it is whatever its name (a last block, an
        ineligible tensor), counted by why."""
        if layer >= self._offload_below:
            self._counts["kept_last_layers"] += 1
            return True
        reason = self._ineligible(t)
        if reason:
            self._counts[reason] += 1
            return True
        return False

    def _offload(self, t: torch.Tensor, layer: int, name: str, uses: int = 0) -> Any:
        """Hands `t` (of block `layer`, named `name`) to the engine: a Saved to unpack, or
        `t` itself when it stays (ineligible, the sizing step, a full pool). `uses`: a fixed
        count of unpacks (a selective layer's cached output: one replay), 0 for autograd's
        saved tensors (counted as they are saved again)."""
        if uses and self._stays(t, layer):
            return t
        # A tensor saved again (the input of q, k and v projections) is offloaded once: the
        # same tensor object, alive (a freed tensor's id may come back for another), not
        # written in place since, at the same address.
        key = id(t)
        ptr = t.data_ptr()
        dup = self._dedup.get(key)
        if dup is not None and dup[1]() is t and dup[2] == t._version and dup[3] == ptr:
            if self._session is None:
                return t
            dup[0].uses += 1
            self._counts["deduplicated"] += 1
            return dup[0]
        nbytes = t.nbytes
        session = self._session
        if session is None:  # the sizing step
            s = Saved(-1, layer, t.shape, t.dtype, nbytes, name, self._step)
            self._dedup[key] = (s, weakref.ref(t), t._version, ptr)
            self._sizing_bytes += nbytes
            return t
        ticket = session.saved(layer, name, ptr, nbytes)
        if ticket < 0:
            self._counts["kept_pinned_pool_full"] += 1
            return t
        pending = self._pending
        pending.append(t)
        s = Saved(ticket, layer, t.shape, t.dtype, nbytes, name, self._step)
        if uses:
            s.uses = uses
        self._dedup[key] = (s, weakref.ref(t), t._version, ptr)
        self._by_layer[layer].append(s)
        if len(pending) > self._release_at:
            self._release_copied()
            self._release_at = len(pending) + 8  # asked again after 8 more
        return s

    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is not Saved:
            return packed  # type: ignore[no-any-return]
        s: Saved = packed
        out = s.tensor
        if s.step != self._step or (out is None and not self._open):
            raise RuntimeError(
                "spillway: a saved tensor offloaded in a step that has ended is needed again "
                "(backward run twice with retain_graph=True, or after the step ended); "
                "offload_activations supports one backward per forward"
            )
        if out is None:
            assert self._session is not None
            out = s.dst
            if out is None:
                out = torch.empty(s.shape, dtype=s.dtype, device=self._device)
            self._session.needed(s.ticket, out.data_ptr())
            s.dst = None
        s.uses -= 1
        # Kept for the uses to come; at its last, the memory goes back once autograd is done.
        s.tensor = out if s.uses > 0 else None
        return out

    def _ineligible(self, t: torch.Tensor) -> str:
        # Note [Hook cost per tensor].
        if t.layout is not torch.strided or t.is_quantized:
            return "kept_not_strided"
        if self._device_index is not None and t.get_device() != self._device_index:
            return "kept_other_device"
        # Parameters (their storages are the model's), views of them, and leaves that
        # require grad (FSDP2's unsharded parameters live only while their block runs: they
        # are leaves too, as a Parameter outside the model is).
        if (t.is_leaf and t.requires_grad) or (
            t.untyped_storage().data_ptr() in self._param_storages
        ):
            return "kept_parameters"
        if t.nbytes < self.min_bytes:
            return "kept_small"
        if not t.is_contiguous():
            return "kept_not_contiguous"
        return ""

    def _release_copied(self) -> None:
        session = self._session
        if session is None:
            return
        done = session.copies_done()
        pending = self._pending
        for _ in range(done - self._released):
            pending.popleft()
        self._released = done

    # ---- steps (OffloadActivations.__enter__ begins one, the end of backward ends it) --

    def _begin_step(self) -> None:
        self._step += 1
        if self._device is None:
            self._device = _model_device(self.model)
        self._device_index = (
            -1 if self._device.type == "cpu" else torch.empty(0, device=self._device).get_device()
        )
        if self._session is None and self.pinned_bytes is not None:
            self._make_session(self.pinned_bytes)
        self._param_storages = _parameter_storages(self.model)
        self._offload_below = len(self.layers) - self.keep_last
        self._census_seen.clear()
        if self._census is not None or (self._auto is not None and self._auto.plan is None):
            self._census = [{} for _ in self.layers]  # counted afresh (auto: its measured step)
        self._counts.clear()
        self._dedup.clear()
        self._sizing_bytes = 0
        self._grad_forwards = 0
        self._named.clear()
        self._running.clear()
        for lst in self._by_layer:
            lst.clear()
        self._in_backward = False
        self._open = True
        if self._session is not None:
            self._session.step_begin()

    def _make_session(self, pinned_bytes: int) -> None:
        available = _spillway.host_available_bytes()
        if available >= 0 and pinned_bytes > 0.9 * available:
            raise ValueError(
                f"offload_activations: the pinned pool would be {pinned_bytes / 1e9:.2f} GB but "
                f"the host has {available / 1e9:.2f} GB available (MemAvailable); at most 90% "
                f"of it, {0.9 * available / 1e9:.2f} GB, may be pinned. Offload fewer tensors "
                "(a plan, a larger min_bytes) or free host memory"
            )
        device = self._device or torch.device("cpu")
        layers: list[list[tuple[str, str]]] = []
        for i in range(len(self.layers)):
            if self._offload_names is not None:
                layers.append([(n, "offload") for n in sorted(self._offload_names[i])])
                continue
            offloaded = i < len(self.layers) - self.keep_last
            layers.append([("saved", "offload")] if offloaded else [])
        if device.type == "cuda":
            kind, ordinal = "cuda", device.index or 0
            stream = torch.cuda.current_stream(device).cuda_stream
        elif device.type == "cpu":
            kind, ordinal, stream = "host", 0, 0
        else:
            raise ValueError(
                f"offload_activations: device {device} is not supported (cpu and cuda are)"
            )
        self._session = _spillway.OffloadSession(
            kind,
            ordinal,
            stream,
            layers,
            self.prefetch_depth,
            pinned_bytes,
            64 * _MiB,
            self.inflight_bound_bytes,
            self.max_tensors,
            self.verify,
            float(self.d2h_gbps),
            float(self.h2d_gbps),
            copy_batch=min(self._copy_batch, self.max_tensors),
        )
        self.pinned_bytes = pinned_bytes

    def _end_step(self, failed: bool = False, quiet: bool = False) -> None:
        if not self._open:
            return
        self._open = False
        self._in_backward = False
        self._layer = None
        rep: dict[str, Any] = {"step": self._step}
        if self._session is not None:
            rep.update(self._session.step_end())
        self._pending.clear()
        self._released = 0
        self._release_at = 8
        # Note [Hook cost per tensor]: the offloaded tensors counted here, not one by one.
        offloaded = [s for lst in self._by_layer for s in lst]
        if offloaded:
            self._counts["offloaded"] += len(offloaded)
            self._counts["offloaded_bytes"] += sum(s.nbytes for s in offloaded)
            if self._offload_names is not None:
                self._counts.update("offloaded:" + s.name for s in offloaded)
        for lst in self._by_layer:
            lst.clear()
        self._dedup.clear()
        self._named.clear()
        counts = dict(self._counts)
        if self._checkpointed:
            counts["checkpointed_layers"] = len(self._checkpointed)
        if self._selective:
            counts["selective_layers"] = len(self._selective)
            # Note [Selective recompute of a plan]: what each layer held from its forward
            # to its backward besides its input (kept on the device or offloaded).
            rep["selective_saved_bytes"] = {
                i: sel.saved_bytes for i, sel in sorted(self._selective.items())
            }
            for sel in self._selective.values():
                sel.cached.clear()
        rep["counts"] = counts
        if self._auto is not None:
            if not failed and not quiet:
                self._replan(rep)
        elif self._session is None and not failed and not quiet:
            # The sizing step: nothing was offloaded; the pool is sized from what would
            # have been, with room to spare, and allocated once.
            rep["sizing_step"] = True
            rep["would_offload_bytes"] = self._sizing_bytes
            if self._sizing_bytes > 0:
                size = max(int(self._sizing_bytes * 1.25), 16 * _MiB)
                self._make_session(size)
                self._warn_once(
                    "sizing",
                    f"spillway: offload_activations sized its pinned pool from step 1: "
                    f"{self._sizing_bytes / 1e6:.1f} MB of saved tensors would be offloaded, "
                    f"pool {size / 1e6:.1f} MB; offloading starts at step 2 (pass "
                    "pinned_bytes= to start at step 1)",
                )
        if counts.get("kept_pinned_pool_full", 0):
            self._warn_once(
                "pool_full",
                f"spillway: the pinned pool ({self.pinned_bytes} bytes) was full: "
                f"{counts['kept_pinned_pool_full']} saved tensors stayed on the device this step "
                "(raise pinned_bytes)",
            )
        moved = (
            counts.get("offloaded", 0) + (1 if self._sizing_bytes else 0) + len(self._checkpointed)
        )
        if self._traced:
            self._warn_once(
                "compiled",
                "spillway: the model ran under torch.compile after offload_activations: the "
                "offload hooks break its graph at every block and see only what the compiled "
                f"pieces save ({counts.get('offloaded', 0)} tensors offloaded in step "
                f"{self._step}). Compile the blocks one by one instead (block.compile()), whose "
                "saved tensors the hooks see (docs/python.md)",
            )
        if not failed and not quiet and moved == 0 and not rep.get("measured_step"):
            why = (
                ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
                or "no tensor was saved inside the decoder blocks"
            )
            self._warn_once(
                "nothing",
                f"spillway: offload_activations offloaded nothing in step {self._step} ({why}); "
                "it frees no memory. Is the forward compiled, under no_grad, or are the "
                "blocks not the ones that run?",
            )
        self._last = rep
        _record_report("offload", rep)
        if self.on_step is not None:
            self.on_step(rep)

// The activation offload engine's reloads (include/spillway/offload/offload.hpp): prefetch,
// reload, reload_into and the reloads' destinations, and the H2D copies under them.
//
// Note [Reload into caller memory]: reload_into(h, dst) has three paths.
//   direct   the destination is known before the reload is issued (set_reload_target(),
//            or reload_into() of a reload not prefetched): the slot's H event is first
//            recorded on compute when the target is set (the fence: compute work
//            enqueued until then may still use dst), the H2D copy waits on it and writes
//            dst, then H is recorded again on H2D after the copy (a wait captures the
//            record current when it is made: Note [Event targets] in the host backend,
//            cudaStreamWaitEvent on CUDA). No extra event, no pool block.
//   staged   prefetch() issued the reload into a pool block before anyone knew dst:
//            compute waits on H (Note [One wait per layer]), copies the block to dst, and
//            the block goes back like a free() (Note [Batched frees]).
//   kept     the pinned pool was full: compute copies from the engine's block (owned,
//            then freed as above) or from the caller's source (borrowed) into dst.
// In each, compute is ordered after the bytes land in dst and the host never waits.
//
// Note [One fence per batch]: set_reload_targets() sets the destinations of several
// reloads in one call, between which no compute work can be enqueued: the first slot's H
// is recorded on compute as the fence of all of them, and each of the others refers to
// it (its own H is recorded only after its copy). The H2D stream waits on a fence only
// once, and not at all for a fence recorded before one it already waits on (compute is
// one stream: a later fence covers an earlier one). Per reload into caller memory that is
// one record on compute and one wait on H2D fewer for all but the first of a batch (two
// runtime calls on CUDA).
#include "offload/offload_engine_impl.hpp"

namespace spillway {

using offload::checksum;

// The direct path's fence (Note [Reload into caller memory]): recorded now, or the one
// slot `fence` recorded in the same batch (Note [One fence per batch]).
void OffloadEngine::Impl::set_target(int id, void* dst, int fence) {
  Slot& s = slots[static_cast<size_t>(id)];
  s.target = dst;
  s.h2d_done = take_event();
  s.owns_h2d = true;
  if (fence < 0) {
    dev.record(s.h2d_done, compute);
    s.fence_seq = ++fences_recorded;
    s.fence_slot = id;
  } else {
    s.fence_seq = slots[static_cast<size_t>(fence)].fence_seq;
    s.fence_slot = fence;
  }
}

// Compute waits for the reload of `s` (issued): Note [One wait per layer].
void OffloadEngine::Impl::order_compute_after(const Slot& s) {
  if (LayerMarks* mk = layer_marks(s.layer); mk != nullptr && !mk->reached) {
    mk->reached = true;
    LayerTimes* lt = &times[static_cast<size_t>(s.layer)];
    dev.host_callback(compute, [lt] { lt->compute_reached = now_ms(); });
  }
  // Note [One wait per layer]: the H2D stream is FIFO, so ordering compute after the
  // layer's last reload issued so far orders it after every earlier one: the first
  // reload of a layer makes compute wait once for the layer's batch, the others need
  // no wait. (Each wait may cost the copy engine a wake-up of the compute stream: ~40 us
  // per tensor on this VM, 7% of an 8 MiB copy's time.) Never the next layer's reloads:
  // compute would wait for the prefetch.
  if (LayerMarks* mk = layer_marks(s.layer); mk != nullptr) {
    if (mk->compute_waited_seq < s.h2d_seq) {
      const Slot& last = slots[static_cast<size_t>(mk->last_h2d_slot)];
      dev.wait(compute, last.h2d_done);
      mk->compute_waited_seq = last.h2d_seq;
    }
  } else {
    dev.wait(compute, s.h2d_done);
  }
}

// After the reloads issued for `layer`: its last H2D copy's end (Note [Layer timestamps]).
void OffloadEngine::Impl::mark_h2d_end(int layer) {
  if (layer < 0 || static_cast<size_t>(layer) >= times.size()) return;
  LayerTimes* lt = &times[static_cast<size_t>(layer)];
  dev.host_callback(h2d, [lt] { lt->h2d_end = now_ms(); });
}

// Issues every reload of `layer` not issued yet.
//
// Note [One event per layer]: the reloads issued together share one event, recorded on
// the H2D stream after the last of them, where each recorded its own: the stream is
// FIFO, so that event completing means every copy before it is done, which is all the
// slots' events are asked (the pinned block's release in poll(), compute's one wait per
// layer). A slot's own event (taken by set_target: its fence, which the H2D stream has
// waited on by then, or taken for nothing) goes back. The slots join h2d_pending only
// once the event is recorded: poll() must not ask an event not recorded yet. One
// runtime call per reload fewer on CUDA, but one per layer.
void OffloadEngine::Impl::issue_layer(int layer) {
  issuing.clear();
  for (int id : layer_slots[static_cast<size_t>(layer)]) {
    Slot& s = slots[static_cast<size_t>(id)];
    if (offload::is_kept(s.state) || offload::reload_issued(s.state)) continue;
    transition(s, s.state, offload::after_reload_issued(s.state));
    issue_reload(id, /*alone=*/false);
    issuing.push_back(id);
  }
  if (issuing.empty()) return;
  const Event done = take_event();
  dev.record(done, h2d);
  for (int id : issuing) {
    Slot& s = slots[static_cast<size_t>(id)];
    if (s.owns_h2d) give_event(s.h2d_done);
    s.h2d_done = done;
    s.owns_h2d = false;
    h2d_pending.push_back(id);
  }
  slots[static_cast<size_t>(issuing.back())].owns_h2d = true;
  mark_h2d_end(layer);
}

// `alone`: the reload records its own event and joins h2d_pending; else issue_layer()
// does both for its layer (Note [One event per layer]). The caller has moved the slot on
// (Note [The life of a slot]: issued, or taken).
void OffloadEngine::Impl::issue_reload(int id, bool alone) {
  Slot& s = slots[static_cast<size_t>(id)];
  SPILLWAY_CHECK(offload::reload_issued(s.state), "offload: slot {} reloaded in state '{}'", id,
                 offload::to_string(s.state));
  void* dst = s.target;
  if (dst != nullptr) {
    // The fence (Note [Reload into caller memory]), once per fence at most: Note [One
    // fence per batch]. A fence slot's H still holds the fence here unless its own
    // reload was issued, and then the H2D stream already waits on that fence.
    if (s.fence_seq > h2d_waited_fence) {
      dev.wait(h2d, slots[static_cast<size_t>(s.fence_slot)].h2d_done);
      h2d_waited_fence = s.fence_seq;
    }
  } else {
    s.reloaded = device_block(s.bytes);
    dst = s.reloaded.ptr;
    if (alone) {
      s.h2d_done = take_event();
      s.owns_h2d = true;
    }
  }
  // Never before the offload finished. Note [One H2D wait]: D2H copies complete in the
  // order they were issued on their one stream, so the reload waits for its layer's last
  // copy (its own or a later one), and not at all when the H2D stream already waits for
  // a copy issued after that: one wait per layer at most, where it was one per tensor
  // (a runtime call each on CUDA). Waiting for the layer's last copy rather than its own
  // delays a reload only while its layer's later copies are still on the link.
  const Slot* last = &s;
  if (const LayerMarks* mk = layer_marks(s.layer); mk != nullptr && mk->last_d2h_slot >= 0)
    last = &slots[static_cast<size_t>(mk->last_d2h_slot)];
  if (last->d2h_seq > h2d_waited_d2h) {
    dev.wait(h2d, last->d2h_done);
    h2d_waited_d2h = last->d2h_seq;
  }
  Slot* sp = &s;
  if (opt.verify) {
    dev.host_callback(h2d, [this, sp, id] {
      if (checksum(sp->pinned.ptr, sp->bytes) != sp->sum) {
        int expected = -1;
        verify_first_slot.compare_exchange_strong(expected, id);
        ++verify_failures;
      }
    });
  }
  if (LayerMarks* mk = layer_marks(s.layer); mk != nullptr && !mk->h2d_started) {
    mk->h2d_started = true;
    LayerTimes* lt = &times[static_cast<size_t>(s.layer)];
    dev.host_callback(h2d, [lt] { lt->h2d_start = now_ms(); });
  }
  dev.copy_async(dst, s.pinned.ptr, s.bytes, h2d);
  if (alone) {
    dev.record(s.h2d_done, h2d);
    h2d_pending.push_back(id);
  }
  s.h2d_seq = ++h2d_issued;
  if (LayerMarks* mk = layer_marks(s.layer); mk != nullptr) mk->last_h2d_slot = id;
}

void OffloadEngine::prefetch(int layer) {
  Impl& m = *impl_;
  m.flush();
  m.poll();
  if (layer < 0 || static_cast<size_t>(layer) >= m.layer_slots.size()) return;
  // Backward needs the layers above `layer` first: their reloads not issued yet go ahead
  // of it on the H2D stream (the copy order is the order of need, and the first reload
  // does not start while the last offloads still hold the link).
  if (m.issue_cursor < 0) m.issue_cursor = static_cast<int>(m.layer_slots.size()) - 1;
  for (; m.issue_cursor > layer; --m.issue_cursor) m.issue_layer(m.issue_cursor);
  m.issue_layer(layer);
}

DeviceTensor OffloadEngine::reload(OffloadHandle h) {
  Impl& m = *impl_;
  m.flush();
  Impl::Slot& s = m.unreloaded(h, "reload()");
  SPILLWAY_CHECK(s.target == nullptr,
                 "reload(): handle {} ({} of layer {}) has a destination (set_reload_target); "
                 "use reload_into()",
                 h, s.name, s.layer);
  const bool issued = offload::reload_issued(s.state);  // before it is taken
  m.transition(s, s.state, offload::after_reload_taken(s.state));
  if (offload::is_kept(s.state)) {
    if (!s.borrowed) {
      DeviceTensor t = s.device;
      s.device = DeviceTensor{};
      return t;
    }
    DeviceTensor t = m.device_block(s.bytes);  // the caller still holds the source
    m.dev.copy_async(t.ptr, s.source, s.bytes, m.compute);
    return t;
  }
  if (!issued) {
    m.issue_reload(h);
    m.mark_h2d_end(s.layer);
  }
  m.order_compute_after(s);
  DeviceTensor t = s.reloaded;
  s.reloaded = DeviceTensor{};
  m.poll();
  return t;
}

void OffloadEngine::reload_into(OffloadHandle h, void* dst) {
  Impl& m = *impl_;
  m.flush();
  SPILLWAY_CHECK(dst != nullptr, "reload_into(): handle {} into a null pointer", h);
  Impl::Slot& s = m.unreloaded(h, "reload_into()");
  SPILLWAY_CHECK(s.target == nullptr || s.target == dst,
                 "reload_into(): handle {} ({} of layer {}) was given the destination {} by "
                 "set_reload_target, not {}",
                 h, s.name, s.layer, s.target, dst);
  const bool issued = offload::reload_issued(s.state);  // before it is taken
  m.transition(s, s.state, offload::after_reload_taken(s.state));
  // Note [Reload into caller memory].
  if (offload::is_kept(s.state)) {
    const void* from = s.borrowed ? s.source : s.device.ptr;
    if (from != dst) m.dev.copy_async(dst, from, s.bytes, m.compute);
    if (!s.borrowed) {
      m.deferred.push_back({s.device, Event{-1}});  // Note [Batched frees]
      s.device = DeviceTensor{};
    }
    m.poll();
    return;
  }
  if (!issued) {
    if (s.target == nullptr) m.set_target(h, dst);
    m.issue_reload(h);
    m.mark_h2d_end(s.layer);
  }
  m.order_compute_after(s);
  if (s.target == nullptr) {  // staged
    m.dev.copy_async(dst, s.reloaded.ptr, s.bytes, m.compute);
    m.deferred.push_back({s.reloaded, Event{-1}});  // Note [Batched frees]
    s.reloaded = DeviceTensor{};
    ++m.tel.reloads_staged;
  }
  m.poll();
}

bool OffloadEngine::set_reload_target(OffloadHandle h, void* dst) {
  return set_reload_targets(&h, &dst, 1) == 1;  // a batch of one: its own fence
}

size_t OffloadEngine::set_reload_targets(const OffloadHandle* h, void* const* dst, size_t n) {
  Impl& m = *impl_;
  size_t set = 0;
  int fence = -1;  // Note [One fence per batch]
  for (size_t i = 0; i < n; ++i) {
    SPILLWAY_CHECK(dst[i] != nullptr, "set_reload_target(s): handle {} to a null pointer", h[i]);
    Impl::Slot& s = m.unreloaded(h[i], "set_reload_target(s)");
    SPILLWAY_CHECK(s.target == nullptr || s.target == dst[i],
                   "set_reload_target(s): handle {} ({} of layer {}) already goes to {}, not {}",
                   h[i], s.name, s.layer, s.target, dst[i]);
    if (s.target == dst[i]) {
      ++set;
      continue;
    }
    if (offload::is_kept(s.state) || offload::reload_issued(s.state)) continue;
    m.set_target(h[i], dst[i], fence);
    if (fence < 0) fence = h[i];
    ++set;
  }
  return set;
}

}  // namespace spillway

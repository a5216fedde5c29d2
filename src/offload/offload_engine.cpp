// The activation offload engine (see include/spillway/offload.hpp for its guarantees).
//
// Note [Offload lifecycle]: a tensor's slot lives for one step.
//   forward   offload(): event P on compute, D2H waits on P, copy device -> pinned, event
//             D on D2H. poll(): when D completes, the device block returns to the pool.
//   backward  issue_reload(): H2D waits on D, copy pinned -> device block, event H on H2D;
//             poll(): when H completes, the pinned block returns to the pool. reload():
//             compute waits on H, the caller owns the device block, free() gives it back
//             once compute reaches that point (an event, polled).
// Everything is polled on the calling thread: host callbacks only record timestamps and
// checksums, never call the Device (CUDA forbids it). Slots, events and the pending
// lists are sized at construction: no allocation per tensor in steady state.
//
// Note [Caller-owned memory]: a borrowed tensor (offload_borrowed) follows the same
// forward protocol with no device block to release: its D2H done event D is handed to the
// caller, who waits on it before reusing the source. D belongs to the slot until
// end_step() (issue_reload waits on it too), so it refers to this copy for that long.
// When the pinned pool is full the engine cannot wait for room (pinned blocks only come
// back as backward reloads them: in forward it would wait forever) and must not copy the
// tensor into its own device pool (twice the device memory at the moment memory is
// shortest), so the tensor stays where it is, in the caller's hands (`kept`), exactly
// like an owned tensor kept on the device; its reload is a device-to-device copy from the
// source on the compute stream.
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
// Note [Copies in batches]: with OffloadOptions::copy_batch = n > 1, an offload takes its
// pinned block at once (so that a full pool still leaves the tensor with its owner, on the
// spot) and queues its copy; the queue is enqueued when it holds n copies, when a layer's
// forward ends, and before anything that waits for or reloads an offloaded tensor (a
// back-pressure wait, a full device pool, prefetch, reload, end_step): one event P on
// compute recorded after the last of them was produced, one D2H wait on it, the n copies,
// one event D after them, which the n slots share (the last one owns it). Per tensor that
// is the copy alone, where it was four stream operations (four runtime calls on CUDA); the
// copies start later, at the latest when their layer's forward ends, which is the window
// the plan gives them (the next layer's forward). A borrowed tensor's event is then not
// known when offload_borrowed() returns: the caller asks copied(h) or copy_event(h). With
// n = 1 (the default) each copy is enqueued at once, exactly as before.
//
// Note [One fence per batch]: set_reload_targets() sets the destinations of several
// reloads in one call, between which no compute work can be enqueued: the first slot's H
// is recorded on compute as the fence of all of them, and each of the others refers to
// it (its own H is recorded only after its copy). The H2D stream waits on a fence only
// once, and not at all for a fence recorded before one it already waits on (compute is
// one stream: a later fence covers an earlier one). Per reload into caller memory that is
// one record on compute and one wait on H2D fewer for all but the first of a batch (two
// runtime calls on CUDA).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include "core/arena.hpp"
#include "core/stats.hpp"
#include "spillway/error.hpp"
#include "spillway/memory.hpp"
#include "spillway/offload.hpp"

namespace spillway {

namespace {

uint64_t checksum(const void* p, size_t n) {  // FNV-1a over 8-byte words, then the tail
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t h = 1469598103934665603ULL;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    h = (h ^ w) * 1099511628211ULL;
  }
  for (; i < n; ++i) h = (h ^ b[i]) * 1099511628211ULL;
  return h;
}

}  // namespace

struct OffloadEngine::Impl {
  struct Slot {
    int layer = -1;
    std::string name;
    size_t bytes = 0;
    DeviceTensor device;           // forward copy, until its D2H is done (owned tensors only)
    const void* source = nullptr;  // what the D2H copy reads: device.ptr, or the caller's
    bool borrowed = false;         // offload_borrowed(): the caller owns `source`
    void* target = nullptr;        // reload destination in caller memory (direct path)
    PinnedBlock pinned;
    bool kept = false;      // pinned pool full: stayed on the device
    Event d2h_done{-1};     // after its copy (shared by a batch: Note [Copies in batches])
    bool owns_d2h = false;  // d2h_done is this slot's to give back (a batch's last slot)
    Event h2d_done{-1};     // its reload's (shared by a layer's: Note [One event per layer])
    bool owns_h2d = false;  // h2d_done is this slot's to give back
    bool device_released = false;
    bool hold = false;    // OffloadHold::kUntilLayerEnd: released at end_forward_layer at most
    bool copied = false;  // its D2H copy is known complete
    bool reload_issued = false;
    int h2d_seq = 0;        // issue order of its reload in the step (1, 2, ...)
    int64_t d2h_seq = 0;    // issue order of its D2H copy, never reset (0: no copy)
    int64_t fence_seq = 0;  // Note [One fence per batch]: its fence's order (0: none)
    int fence_slot = -1;    // the slot whose H holds that fence until its copy is issued
    bool reload_taken = false;
    bool pinned_released = false;
    DeviceTensor reloaded;
    bool verify = false;  // checksum this tensor (OffloadOptions::verify)
    uint64_t sum = 0;     // verify mode: written by a D2H callback, read by an H2D one
  };
  // Note [Layer timestamps]: host callbacks take timestamps per layer, not per tensor
  // (each stream op costs host time): the first copy's start in each direction, the
  // compute stream reaching the layer's first reload, the end of the reloads issued
  // together, and the end of the layer's D2H copies (a callback queued by
  // end_forward_layer, after the layer's last copy). Written by callbacks, read after
  // end_step's synchronize.
  struct LayerTimes {
    double d2h_start = 0, d2h_end = 0, h2d_start = 0, h2d_end = 0, compute_reached = 0;
  };
  struct LayerMarks {  // calling thread only
    bool d2h_started = false, h2d_started = false, reached = false, forward_ended = false;
    int last_h2d_slot = -1;      // the layer's last reload issued (Note [One wait per layer])
    int last_d2h_slot = -1;      // the layer's last D2H copy issued (Note [One H2D wait])
    int compute_waited_seq = 0;  // compute is ordered after this layer's reloads up to here
  };
  std::vector<LayerTimes> times;
  std::vector<LayerMarks> marks;

  Device& dev;
  Stream compute;  // the caller's
  UniqueStream d2h;
  UniqueStream h2d;
  OffloadOptions opt;
  PinnedPool pinned;
  PinnedPool device_pool;
  std::vector<Slot> slots;
  size_t slots_used = 0;
  std::vector<UniqueEvent> events;  // every event the engine made (sized once)
  std::vector<Event> free_events;   // those not held by a slot or a deferred free
  std::vector<int> d2h_pending;     // slots whose device block is not yet released (FIFO)
  size_t d2h_head = 0;
  std::vector<int> h2d_pending;  // slots whose pinned block is not yet released (FIFO)
  size_t h2d_head = 0;
  std::vector<int> queued;   // slots whose copies wait for the batch (Note [Copies in batches])
  std::vector<int> issuing;  // the reloads issue_layer() issues (Note [One event per layer])
  struct Deferred {
    DeviceTensor t;
    Event e;
  };
  // Note [Batched frees]: free() only queues the block; the next engine call records one
  // compute event for every block queued since (it covers all compute work enqueued
  // before it). [deferred_head, deferred_recorded) wait for their event; the rest wait
  // for one to be recorded. Entries sharing an event are contiguous.
  std::vector<Deferred> deferred;
  size_t deferred_head = 0;
  size_t deferred_recorded = 0;
  // One bit per alignment unit of the device pool: set while free() has queued the block
  // starting there, so a second free() of it is refused on the caller's thread (the pool
  // would catch it only when poll() releases it, after the tensor's first life).
  std::vector<bool> free_queued;

  void record_frees() {
    if (deferred_recorded == deferred.size()) return;
    const Event e = take_event();
    dev.record(e, compute);
    for (size_t i = deferred_recorded; i < deferred.size(); ++i) deferred[i].e = e;
    deferred_recorded = deferred.size();
  }
  std::vector<std::vector<int>> layer_slots;
  int64_t inflight = 0;
  std::atomic<int> verify_failures{0};
  std::atomic<int> verify_first_slot{-1};
  StepTelemetry tel;
  int64_t allocations_at_begin = 0;
  bool in_step = false;
  int issue_cursor = -1;  // prefetch(): the highest layer whose reloads may be unissued
  int h2d_issued = 0;     // reloads issued this step (Slot::h2d_seq)
  // Note [One H2D wait]: D2H copies issued (Slot::d2h_seq), and the latest of them the H2D
  // stream is ordered after. Never reset: a copy of an earlier step is done.
  int64_t d2h_issued = 0;
  int64_t h2d_waited_d2h = 0;
  // Note [One fence per batch]: fences recorded on compute, and the latest the H2D stream
  // waits on (never reset).
  int64_t fences_recorded = 0;
  int64_t h2d_waited_fence = 0;

  Impl(Device& device, Stream compute_stream, const MemoryPolicy& policy, const OffloadOptions& o)
      : dev(device),
        compute(compute_stream),
        d2h(device, StreamRole::kD2H),
        h2d(device, StreamRole::kH2D),
        opt(o),
        pinned(device,
               PinnedPoolOptions{o.pinned_bytes, o.pinned_slabs, MemoryKind::kPinnedHost, -1}),
        device_pool(device, PinnedPoolOptions{o.device_pool_bytes, 1, MemoryKind::kDevice, -1}) {
    if (o.max_tensors < 1) SPILLWAY_FIELD_ERROR("max_tensors", o.max_tensors, "must be >= 1");
    if (o.inflight_bound_bytes < 0) {
      SPILLWAY_FIELD_ERROR("inflight_bound_bytes", o.inflight_bound_bytes,
                           "must be >= 0 (0: no bound)");
    }
    const size_t n = static_cast<size_t>(o.max_tensors);
    slots.resize(n);
    for (Slot& s : slots) s.name.reserve(32);
    // Two events per slot plus one per deferred free.
    events.reserve(3 * n);
    free_events.reserve(3 * n);
    for (size_t i = 0; i < 3 * n; ++i) free_events.push_back(events.emplace_back(dev).get());
    if (o.copy_batch < 1 || o.copy_batch > o.max_tensors) {
      SPILLWAY_FIELD_ERROR("copy_batch", o.copy_batch, "must be in [1, max_tensors = {}]",
                           o.max_tensors);
    }
    d2h_pending.reserve(n);
    h2d_pending.reserve(n);
    queued.reserve(static_cast<size_t>(o.copy_batch));
    issuing.reserve(n);
    deferred.reserve(n);
    free_queued.assign(static_cast<size_t>(o.device_pool_bytes) / Arena::kAlignment + 1, false);
    layer_slots.resize(policy.layers.size());
    times.resize(policy.layers.size());
    marks.resize(policy.layers.size());
    for (auto& v : layer_slots) v.reserve(16);
    tel.layers.reserve(policy.layers.size());
  }

  ~Impl() {
    dev.synchronize(compute);
    dev.synchronize(d2h);
    dev.synchronize(h2d);
    poll();
    for (size_t i = deferred_head; i < deferred.size(); ++i) release_device(deferred[i].t);
    for (size_t i = 0; i < slots_used; ++i) release_slot(slots[i]);
  }

  Event take_event() {
    SPILLWAY_CHECK(!free_events.empty(),
                   "offload: out of events (raise OffloadOptions::max_tensors)");
    const Event e = free_events.back();
    free_events.pop_back();
    return e;
  }
  void give_event(Event& e) {
    if (e.id >= 0) {
      // A batch's shared event is given back by its owner only (Note [Copies in batches]):
      // one given twice would be handed to two uses at once.
      SPILLWAY_CHECK(free_events.size() < events.size(), "offload: event {} given back twice",
                     e.id);
      free_events.push_back(e);
    }
    e = Event{-1};
  }

  void release_device(DeviceTensor& t) {
    if (!t) return;
    if (t.direct) {
      dev.free(t.ptr, MemoryKind::kDevice);
    } else {
      device_pool.release(PinnedBlock{t.ptr, t.bytes, t.block_slab, t.block_offset});
    }
    t = DeviceTensor{};
  }

  void release_slot(Slot& s) {
    release_device(s.device);
    release_device(s.reloaded);  // prefetched but never taken by reload()
    if (s.pinned) pinned.release(s.pinned);
    s.pinned = PinnedBlock{};
    if (s.owns_d2h) give_event(s.d2h_done);
    s.d2h_done = Event{-1};
    s.owns_d2h = false;
    if (s.owns_h2d) give_event(s.h2d_done);
    s.h2d_done = Event{-1};
    s.owns_h2d = false;
  }

  // Releases whatever finished: device blocks of completed offloads, pinned blocks of
  // completed reloads, deferred frees the compute stream has passed.
  void poll() {
    while (d2h_head < d2h_pending.size()) {
      Slot& s = slots[static_cast<size_t>(d2h_pending[d2h_head])];
      if (!dev.query(s.d2h_done)) break;  // FIFO: later ones cannot be done before
      inflight -= static_cast<int64_t>(s.bytes);
      s.copied = true;
      if (!s.hold || forward_ended(s.layer)) release_copied(s);
      ++d2h_head;
    }
    // Reloads end in H2D stream order and frees pass in compute stream order: both lists
    // are FIFO, so each poll stops at the first one not done (O(1) amortized).
    while (h2d_head < h2d_pending.size()) {
      Slot& s = slots[static_cast<size_t>(h2d_pending[h2d_head])];
      if (!dev.query(s.h2d_done)) break;
      pinned.release(s.pinned);
      s.pinned = PinnedBlock{};
      s.pinned_released = true;
      ++h2d_head;
    }
    if (h2d_head == h2d_pending.size()) {
      h2d_pending.clear();
      h2d_head = 0;
    }
    record_frees();
    while (deferred_head < deferred_recorded) {
      Deferred& d = deferred[deferred_head];
      if (!dev.query(d.e)) break;
      if (!d.t.direct) free_queued[d.t.block_offset / Arena::kAlignment] = false;
      release_device(d.t);
      const bool last_of_event =
          deferred_head + 1 == deferred_recorded || deferred[deferred_head + 1].e.id != d.e.id;
      if (last_of_event) give_event(d.e);
      ++deferred_head;
    }
    if (deferred_head == deferred.size()) {
      deferred.clear();
      deferred_head = 0;
      deferred_recorded = 0;
    }
  }

  // Back-pressure: before a copy of `bytes` is enqueued, waits until the copies in flight
  // leave room for it under the bound (with none left in flight it goes, even if larger).
  //
  // Note [Back-pressure and the snowball]: a copy of layer l that must wait for room holds
  // the host back, not necessarily the device: while the compute stream still has work
  // (the layer's kernels), the wait costs nothing. When the compute stream runs dry during
  // the wait (an event recorded on it before the wait is complete after it), the forward
  // is held back to the link's pace: the oldest copy in flight, of an earlier layer, did
  // not leave the link in its window. Its layer is late, and the first such layer is where
  // the backlog starts (end_forward_layer's window test cannot see it: the held-back
  // forward ends after the copies).
  void make_room(size_t bytes, int layer) {
    if (opt.inflight_bound_bytes <= 0) return;
    const int64_t need = static_cast<int64_t>(bytes);
    if (inflight + need <= opt.inflight_bound_bytes) return;
    flush();  // queued copies count as in flight; only enqueued ones can be waited for
    const double t0 = now_ms();
    const Event busy = take_event();
    dev.record(busy, compute);
    int oldest_layer = -1;
    while (inflight + need > opt.inflight_bound_bytes && d2h_head < d2h_pending.size()) {
      const Slot& oldest = slots[static_cast<size_t>(d2h_pending[d2h_head])];
      if (oldest_layer < 0) oldest_layer = oldest.layer;
      dev.synchronize(oldest.d2h_done);
      poll();
    }
    if (oldest_layer >= 0 && oldest_layer < layer && dev.query(busy)) mark_late(oldest_layer);
    Event e = busy;
    give_event(e);
    tel.backpressure_ms += now_ms() - t0;
  }

  void mark_late(int layer) {
    if (static_cast<size_t>(layer) >= tel.layers.size()) return;
    tel.layers[static_cast<size_t>(layer)].late = true;
    if (!tel.snowball || layer < *tel.snowball_first_layer) {
      tel.snowball = true;
      tel.snowball_first_layer = layer;
    }
  }

  // Forward, both modes: a pinned block and the D2H copy of slot `id` after the compute
  // work enqueued so far; false when the pinned pool is full (the slot is kept).
  bool start_copy(int id) {
    Slot& s = slots[static_cast<size_t>(id)];
    s.pinned = pinned.acquire(s.bytes);
    if (!s.pinned) {
      // Fallback: the pinned pool is full (its blocks wait for backward): keep it here.
      s.kept = true;
      ++tel.fallback_kept;
      return false;
    }
    ++tel.tensors_offloaded;
    make_room(s.bytes, s.layer);
    inflight += static_cast<int64_t>(s.bytes);
    if (s.layer >= 0 && static_cast<size_t>(s.layer) < tel.layers.size()) {
      tel.layers[static_cast<size_t>(s.layer)].d2h_bytes += static_cast<int64_t>(s.bytes);
    }
    tel.d2h_bytes += static_cast<int64_t>(s.bytes);
    queued.push_back(id);
    if (queued.size() >= static_cast<size_t>(opt.copy_batch)) flush();
    return true;
  }

  // Enqueues the queued copies after one fence on compute, and one event after them
  // (Note [Copies in batches]).
  void flush() {
    if (queued.empty()) return;
    Event produced = take_event();
    dev.record(produced, compute);
    dev.wait(d2h, produced);
    give_event(produced);  // the wait captured its target: reusable at once
    for (int id : queued) {
      Slot& s = slots[static_cast<size_t>(id)];
      Slot* sp = &s;
      if (LayerMarks* mk = layer_marks(s.layer); mk != nullptr && !mk->d2h_started) {
        mk->d2h_started = true;
        LayerTimes* lt = &times[static_cast<size_t>(s.layer)];
        dev.host_callback(d2h, [lt] { lt->d2h_start = now_ms(); });
      }
      dev.copy_async(s.pinned.ptr, s.source, s.bytes, d2h);
      // Verify mode: the checksum of what landed on the host, right after its copy. (The
      // layer's copy end is stamped once, by end_forward_layer: Note [Layer timestamps].)
      // One pointer: fits std::function's local buffer, so no allocation per tensor.
      sp->verify = opt.verify;
      if (sp->verify)
        dev.host_callback(d2h, [sp] { sp->sum = checksum(sp->pinned.ptr, sp->bytes); });
      s.d2h_seq = ++d2h_issued;
      if (LayerMarks* mk = layer_marks(s.layer); mk != nullptr) mk->last_d2h_slot = id;
      d2h_pending.push_back(id);
    }
    const Event done = take_event();
    dev.record(done, d2h);
    for (int id : queued) slots[static_cast<size_t>(id)].d2h_done = done;
    slots[static_cast<size_t>(queued.back())].owns_d2h = true;
    queued.clear();
  }

  // The direct path's fence (Note [Reload into caller memory]): recorded now, or the one
  // slot `fence` recorded in the same batch (Note [One fence per batch]).
  void set_target(int id, void* dst, int fence = -1) {
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

  // The slot of a handle not reloaded yet (reload, reload_into, set_reload_target).
  const Slot& offloaded(OffloadHandle h, const char* what) const {
    SPILLWAY_CHECK(h >= 0 && static_cast<size_t>(h) < slots_used,
                   "{}: unknown handle {} (not offloaded in this step)", what, h);
    return slots[static_cast<size_t>(h)];
  }
  Slot& unreloaded(OffloadHandle h, const char* what) {
    SPILLWAY_CHECK(h >= 0 && static_cast<size_t>(h) < slots_used, "{}: unknown handle {}", what, h);
    Slot& s = slots[static_cast<size_t>(h)];
    SPILLWAY_CHECK(!s.reload_taken, "{}: handle {} ({} of layer {}) was already reloaded", what, h,
                   s.name, s.layer);
    return s;
  }

  // Compute waits for the reload of `s` (issued): Note [One wait per layer].
  void order_compute_after(const Slot& s) {
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

  DeviceTensor device_block(size_t bytes) {
    for (;;) {
      const PinnedBlock b = device_pool.acquire(bytes);
      if (b) return DeviceTensor{b.ptr, bytes, b.slab, b.offset, false};
      poll();
      const PinnedBlock again = device_pool.acquire(bytes);
      if (again) return DeviceTensor{again.ptr, bytes, again.slab, again.offset, false};
      // Back-pressure: wait for the oldest offload copy (it frees a block as soon as it
      // ends), else for the oldest pending free.
      flush();
      if (d2h_head < d2h_pending.size()) {
        dev.synchronize(slots[static_cast<size_t>(d2h_pending[d2h_head])].d2h_done);
        continue;
      }
      if (deferred_head < deferred.size()) {
        record_frees();
        dev.synchronize(deferred[deferred_head].e);
        continue;
      }
      // Fallback: a direct allocation (counted); out of device memory is an error.
      const AllocResult a = dev.allocate(bytes, MemoryKind::kDevice);
      if (!a) SPILLWAY_INPUT_ERROR("offload: the device pool is full and {}", a.reason);
      ++tel.fallback_direct;
      return DeviceTensor{a.ptr, bytes, -1, 0, true};
    }
  }

  Slot& new_slot(int layer, std::string_view name, size_t bytes) {
    if (slots_used >= slots.size()) {
      SPILLWAY_INPUT_ERROR("offload: more than {} tensors offloaded in one step; raise max_tensors",
                           slots.size());
    }
    const int id = static_cast<int>(slots_used++);
    Slot& s = slots[static_cast<size_t>(id)];
    std::string keep_name = std::move(s.name);  // keeps its capacity: no allocation
    s = Slot{};
    s.name = std::move(keep_name);
    s.layer = layer;
    s.name.assign(name.data(), name.size());
    s.bytes = bytes;
    if (layer >= 0 && static_cast<size_t>(layer) < layer_slots.size())
      layer_slots[static_cast<size_t>(layer)].push_back(id);
    return s;
  }

  // Note [Offload hold]: a tensor offloaded with OffloadHold::kUntilLayerEnd is still read
  // by its layer's forward after its copy starts, so its device memory goes back when
  // both its copy is done and its layer's forward has ended, whichever is later.
  bool forward_ended(int layer) {
    const LayerMarks* mk = layer_marks(layer);
    return mk == nullptr || mk->forward_ended;
  }
  void release_copied(Slot& s) {
    release_device(s.device);
    s.device_released = true;
  }

  // offload() and offload_borrowed() of a layer the policy has: its telemetry, its window
  // test and its reloads' order are per layer of the policy.
  void check_layer(int layer, std::string_view name) const {
    if (layer < 0 || static_cast<size_t>(layer) >= layer_slots.size()) {
      SPILLWAY_FIELD_ERROR("layer", layer, "must be in [0, {}), the policy's layers ({})",
                           layer_slots.size(), name);
    }
  }

  LayerMarks* layer_marks(int layer) {
    return layer >= 0 && static_cast<size_t>(layer) < marks.size()
               ? &marks[static_cast<size_t>(layer)]
               : nullptr;
  }
  // After the reloads issued for `layer`: its last H2D copy's end (Note [Layer timestamps]).
  void mark_h2d_end(int layer) {
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
  void issue_layer(int layer) {
    issuing.clear();
    for (int id : layer_slots[static_cast<size_t>(layer)]) {
      const Slot& s = slots[static_cast<size_t>(id)];
      if (s.kept || s.reload_issued) continue;
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
  // does both for its layer (Note [One event per layer]).
  void issue_reload(int id, bool alone = true) {
    Slot& s = slots[static_cast<size_t>(id)];
    if (s.kept || s.reload_issued) return;
    s.reload_issued = true;
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
};

OffloadEngine::OffloadEngine(Device& device, Stream compute, MemoryPolicy policy,
                             OffloadOptions options)
    : impl_(std::make_unique<Impl>(device, compute, policy, options)), policy_(std::move(policy)) {
  if (policy_.prefetch_depth < 0)
    SPILLWAY_FIELD_ERROR("prefetch_depth", policy_.prefetch_depth, "must be >= 0");
}

OffloadEngine::~OffloadEngine() = default;

Stream OffloadEngine::d2h_stream() const {
  return impl_->d2h;
}
int64_t OffloadEngine::inflight_bytes() const {
  return impl_->inflight;
}
Stream OffloadEngine::h2d_stream() const {
  return impl_->h2d;
}

DeviceTensor OffloadEngine::allocate(size_t bytes) {
  return impl_->device_block(bytes);
}

void OffloadEngine::free(DeviceTensor t) {
  if (!t) return;
  Impl& m = *impl_;
  // A second free() would release the block twice when poll() gets to it, on whichever
  // engine call (or the destructor) that is: refused here, naming the tensor.
  bool twice = false;
  if (t.direct) {
    for (size_t i = m.deferred_head; i < m.deferred.size() && !twice; ++i)
      twice = m.deferred[i].t.ptr == t.ptr;
  } else {
    const PinnedBlock b{t.ptr, t.bytes, t.block_slab, t.block_offset};
    twice = !m.device_pool.acquired(b) || m.free_queued[t.block_offset / Arena::kAlignment];
  }
  if (twice) {
    SPILLWAY_FIELD_ERROR("t", t.ptr,
                         "freed twice: free() already gave this tensor ({} bytes) back, or it "
                         "is not one of the engine's",
                         t.bytes);
  }
  if (!t.direct) m.free_queued[t.block_offset / Arena::kAlignment] = true;
  m.deferred.push_back({t, Event{-1}});  // Note [Batched frees]
}

void OffloadEngine::begin_step() {
  Impl& m = *impl_;
  SPILLWAY_CHECK(!m.in_step, "begin_step() twice without end_step()");
  m.in_step = true;
  m.issue_cursor = -1;
  m.h2d_issued = 0;
  m.tel = StepTelemetry{};
  m.tel.layers.clear();
  for (size_t l = 0; l < policy_.layers.size(); ++l) {
    LayerTelemetry lt;
    lt.layer = static_cast<int>(l);
    m.tel.layers.push_back(lt);
  }
  std::fill(m.times.begin(), m.times.end(), Impl::LayerTimes{});
  std::fill(m.marks.begin(), m.marks.end(), Impl::LayerMarks{});
  const MemoryStats ms = m.dev.memory_stats();
  m.allocations_at_begin = 0;
  for (int k = 0; k < kMemoryKinds; ++k) m.allocations_at_begin += ms.allocations[k];
}

OffloadHandle OffloadEngine::offload(DeviceTensor t, int layer, std::string_view name,
                                     OffloadHold hold) {
  Impl& m = *impl_;
  SPILLWAY_CHECK(m.in_step, "offload() outside begin_step()/end_step()");
  SPILLWAY_CHECK(t, "offload() of an empty tensor ({} of layer {})", name, layer);
  m.check_layer(layer, name);
  m.poll();
  const int id = static_cast<int>(m.slots_used);
  Impl::Slot& s = m.new_slot(layer, name, t.bytes);
  s.device = t;
  s.source = t.ptr;
  s.hold = hold == OffloadHold::kUntilLayerEnd;
  m.start_copy(id);
  return id;
}

BorrowedOffload OffloadEngine::offload_borrowed(const void* src, size_t bytes, int layer,
                                                std::string_view name) {
  Impl& m = *impl_;
  SPILLWAY_CHECK(m.in_step, "offload_borrowed() outside begin_step()/end_step()");
  SPILLWAY_CHECK(src != nullptr, "offload_borrowed() of a null pointer ({} of layer {})", name,
                 layer);
  m.check_layer(layer, name);
  m.poll();
  const int id = static_cast<int>(m.slots_used);
  Impl::Slot& s = m.new_slot(layer, name, bytes);
  s.source = src;
  s.borrowed = true;
  BorrowedOffload b;
  b.handle = id;
  if (m.start_copy(id)) {
    b.copied = s.d2h_done;  // Note [Caller-owned memory]; none yet while queued
  } else {
    b.kept = true;
  }
  return b;
}

void OffloadEngine::end_forward_layer(int layer) {
  Impl& m = *impl_;
  m.flush();  // Note [Copies in batches]: at the latest when the layer's forward ends
  if (Impl::LayerMarks* mk = m.layer_marks(layer); mk != nullptr) {
    if (mk->d2h_started && !mk->forward_ended) {
      // After the layer's last copy in stream order: its end (Note [Layer timestamps]).
      Impl::LayerTimes* lt = &m.times[static_cast<size_t>(layer)];
      m.dev.host_callback(m.d2h, [lt] { lt->d2h_end = now_ms(); });
    }
    mk->forward_ended = true;  // Note [Offload hold]
    for (int id : m.layer_slots[static_cast<size_t>(layer)]) {
      Impl::Slot& s = m.slots[static_cast<size_t>(id)];
      if (s.copied && !s.device_released) m.release_copied(s);
    }
  }
  m.poll();
  if (layer < 0 || static_cast<size_t>(layer) >= m.tel.layers.size()) return;
  m.tel.layers[static_cast<size_t>(layer)].backlog_bytes = m.inflight;
  // The previous layer's copies had this layer's forward as their window.
  if (layer >= 1) {
    LayerTelemetry& prev = m.tel.layers[static_cast<size_t>(layer - 1)];
    for (int id : m.layer_slots[static_cast<size_t>(layer - 1)]) {
      const Impl::Slot& s = m.slots[static_cast<size_t>(id)];
      if (!s.kept && !s.device_released) prev.late = true;
    }
    if (prev.late && !m.tel.snowball) {
      m.tel.snowball = true;
      m.tel.snowball_first_layer = layer - 1;
    }
  }
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
  s.reload_taken = true;
  if (s.kept) {
    if (!s.borrowed) {
      DeviceTensor t = s.device;
      s.device = DeviceTensor{};
      return t;
    }
    DeviceTensor t = m.device_block(s.bytes);  // the caller still holds the source
    m.dev.copy_async(t.ptr, s.source, s.bytes, m.compute);
    return t;
  }
  if (!s.reload_issued) {
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
  s.reload_taken = true;
  // Note [Reload into caller memory].
  if (s.kept) {
    const void* from = s.borrowed ? s.source : s.device.ptr;
    if (from != dst) m.dev.copy_async(dst, from, s.bytes, m.compute);
    if (!s.borrowed) {
      m.deferred.push_back({s.device, Event{-1}});  // Note [Batched frees]
      s.device = DeviceTensor{};
    }
    m.poll();
    return;
  }
  if (!s.reload_issued) {
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
    if (s.kept || s.reload_issued) continue;
    m.set_target(h[i], dst[i], fence);
    if (fence < 0) fence = h[i];
    ++set;
  }
  return set;
}

int OffloadEngine::max_tensors() const {
  return impl_->opt.max_tensors;
}

bool OffloadEngine::copied(OffloadHandle h) const {
  const Impl::Slot& s = impl_->offloaded(h, "copied()");
  if (s.kept || s.d2h_done.id < 0) return false;  // kept, or queued (Note [Copies in batches])
  return s.copied || impl_->dev.query(s.d2h_done);
}

Event OffloadEngine::copy_event(OffloadHandle h) const {
  const Impl::Slot& s = impl_->offloaded(h, "copy_event()");
  return s.kept ? Event{-1} : s.d2h_done;
}

StepTelemetry OffloadEngine::end_step() {
  Impl& m = *impl_;
  SPILLWAY_CHECK(m.in_step, "end_step() without begin_step()");
  m.flush();
  m.record_frees();  // before the synchronize, so that the step's frees complete with it
  m.dev.synchronize(m.compute);
  m.dev.synchronize(m.d2h);
  m.dev.synchronize(m.h2d);
  m.poll();
  StepTelemetry& t = m.tel;
  for (size_t i = 0; i < m.slots_used; ++i) {
    const Impl::Slot& s = m.slots[i];
    if (s.kept || !s.reload_issued) continue;
    t.h2d_bytes += static_cast<int64_t>(s.bytes);
    if (s.layer >= 0 && static_cast<size_t>(s.layer) < t.layers.size()) {
      t.layers[static_cast<size_t>(s.layer)].h2d_bytes += static_cast<int64_t>(s.bytes);
    }
  }
  // Achieved bandwidth: bytes over the time the copy engine was busy with them, the sum of
  // the layers' copy intervals (one stream each way: the intervals do not overlap).
  double d2h_busy = 0, h2d_busy = 0;
  for (LayerTelemetry& lt : t.layers) {
    const Impl::LayerTimes& tm = m.times[static_cast<size_t>(lt.layer)];
    if (tm.d2h_end > tm.d2h_start && tm.d2h_start > 0) {
      lt.d2h_gbps = static_cast<double>(lt.d2h_bytes) / ((tm.d2h_end - tm.d2h_start) * 1e6);
      d2h_busy += tm.d2h_end - tm.d2h_start;
    }
    if (tm.h2d_end > tm.h2d_start && tm.h2d_start > 0) {
      lt.h2d_gbps = static_cast<double>(lt.h2d_bytes) / ((tm.h2d_end - tm.h2d_start) * 1e6);
      h2d_busy += tm.h2d_end - tm.h2d_start;
      if (tm.compute_reached > 0) lt.stall_ms = std::max(0.0, tm.h2d_end - tm.compute_reached);
      t.stall_ms += lt.stall_ms;
    }
  }
  if (d2h_busy > 0) t.d2h_gbps = static_cast<double>(t.d2h_bytes) / (d2h_busy * 1e6);
  if (h2d_busy > 0) t.h2d_gbps = static_cast<double>(t.h2d_bytes) / (h2d_busy * 1e6);
  const double copy_ms = d2h_busy + h2d_busy;
  t.stall_ms += t.backpressure_ms;
  t.overlap_ratio = copy_ms > 0 ? std::clamp(1.0 - t.stall_ms / copy_ms, 0.0, 1.0) : 1.0;
  const MemoryStats ms = m.dev.memory_stats();
  int64_t allocs = 0;
  for (int k = 0; k < kMemoryKinds; ++k) allocs += ms.allocations[k];
  t.device_allocations = allocs - m.allocations_at_begin;
  const int failures = m.verify_failures.exchange(0);
  std::string failed;
  if (failures > 0) {
    const Impl::Slot& s = m.slots[static_cast<size_t>(m.verify_first_slot.load())];
    failed = fmt::format(
        "offload verify: {} tensor(s) changed while on the host; first: {} of layer {} ({} bytes)",
        failures, s.name, s.layer, s.bytes);
  }
  // Slots not reloaded this step are dropped here (their pinned blocks return).
  for (size_t i = 0; i < m.slots_used; ++i) m.release_slot(m.slots[i]);
  m.slots_used = 0;
  m.d2h_pending.clear();
  m.d2h_head = 0;
  m.h2d_pending.clear();
  m.h2d_head = 0;
  m.inflight = 0;
  for (auto& v : m.layer_slots) v.clear();
  m.in_step = false;
  m.verify_first_slot = -1;
  if (!failed.empty()) throw Error(failed);
  return t;
}

}  // namespace spillway

// The activation offload engine (see include/spillway/offload/offload.hpp for its guarantees).
// Its first half: the copies out, the pools, the step (begin, layers, end); the reloads are
// offload_reload.cpp's, the state offload_engine_impl.hpp's.
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
// lists are sized at construction: no allocation per tensor in steady state. Where a slot
// is in this, its state: Note [The life of a slot] (slot_state.hpp).
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
#include <algorithm>
#include <chrono>

#include "offload/offload_engine_impl.hpp"

namespace spillway {

using offload::checksum;
using offload::SlotState;

OffloadEngine::Impl::Impl(Device& device, Stream compute_stream, const MemoryPolicy& policy,
                          const OffloadOptions& o)
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

OffloadEngine::Impl::~Impl() {
  dev.synchronize(compute);
  dev.synchronize(d2h);
  dev.synchronize(h2d);
  poll();
  for (size_t i = deferred_head; i < deferred.size(); ++i) release_device(deferred[i].t);
  for (size_t i = 0; i < slots_used; ++i) release_slot(slots[i]);
}

void OffloadEngine::Impl::release_slot(Slot& s) {
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
void OffloadEngine::Impl::poll() {
  while (d2h_head < d2h_pending.size()) {
    Slot& s = slots[static_cast<size_t>(d2h_pending[d2h_head])];
    if (!dev.query(s.d2h_done)) break;  // FIFO: later ones cannot be done before
    inflight -= static_cast<int64_t>(s.bytes);
    transition(s, s.state, offload::after_copy_seen(s.state));
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
void OffloadEngine::Impl::make_room(size_t bytes, int layer) {
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

void OffloadEngine::Impl::mark_late(int layer) {
  if (static_cast<size_t>(layer) >= tel.layers.size()) return;
  tel.layers[static_cast<size_t>(layer)].late = true;
  if (!tel.snowball || layer < *tel.snowball_first_layer) {
    tel.snowball = true;
    tel.snowball_first_layer = layer;
  }
}

// Forward, both modes: a pinned block and the D2H copy of slot `id` after the compute
// work enqueued so far; false when the pinned pool is full (the slot is kept).
bool OffloadEngine::Impl::start_copy(int id) {
  Slot& s = slots[static_cast<size_t>(id)];
  s.pinned = pinned.acquire(s.bytes);
  if (!s.pinned) {
    // Fallback: the pinned pool is full (its blocks wait for backward): keep it here.
    transition(s, SlotState::kFree, SlotState::kKept);
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
  transition(s, SlotState::kFree, SlotState::kQueued);
  queued.push_back(id);
  if (queued.size() >= static_cast<size_t>(opt.copy_batch)) flush();
  return true;
}

// Enqueues the queued copies after one fence on compute, and one event after them
// (Note [Copies in batches]).
void OffloadEngine::Impl::flush() {
  if (queued.empty()) return;
  Event produced = take_event();
  dev.record(produced, compute);
  dev.wait(d2h, produced);
  give_event(produced);  // the wait captured its target: reusable at once
  for (int id : queued) {
    Slot& s = slots[static_cast<size_t>(id)];
    Slot* sp = &s;
    transition(s, SlotState::kQueued, SlotState::kCopying);
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
    if (sp->verify) dev.host_callback(d2h, [sp] { sp->sum = checksum(sp->pinned.ptr, sp->bytes); });
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

DeviceTensor OffloadEngine::Impl::device_block(size_t bytes) {
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

OffloadEngine::Impl::Slot& OffloadEngine::Impl::new_slot(int layer, std::string_view name,
                                                         size_t bytes) {
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
      if (offload::copy_seen(s.state) && !offload::device_released(s.state)) m.release_copied(s);
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
      if (!offload::is_kept(s.state) && !offload::device_released(s.state)) prev.late = true;
    }
    if (prev.late && !m.tel.snowball) {
      m.tel.snowball = true;
      m.tel.snowball_first_layer = layer - 1;
    }
  }
}

int OffloadEngine::max_tensors() const {
  return impl_->opt.max_tensors;
}

bool OffloadEngine::copied(OffloadHandle h) const {
  const Impl::Slot& s = impl_->offloaded(h, "copied()");
  if (offload::is_kept(s.state) || s.d2h_done.id < 0)
    return false;  // kept, or queued (Note [Copies in batches])
  return offload::copy_seen(s.state) || impl_->dev.query(s.d2h_done);
}

Event OffloadEngine::copy_event(OffloadHandle h) const {
  const Impl::Slot& s = impl_->offloaded(h, "copy_event()");
  return offload::is_kept(s.state) ? Event{-1} : s.d2h_done;
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
    if (offload::is_kept(s.state) || !offload::reload_issued(s.state)) continue;
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
  for (size_t i = 0; i < m.slots_used; ++i) {
    m.release_slot(m.slots[i]);
    m.transition(m.slots[i], m.slots[i].state, SlotState::kFree);
  }
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

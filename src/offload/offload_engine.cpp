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
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include "spillway/error.hpp"
#include "spillway/memory.hpp"
#include "spillway/offload.hpp"

namespace spillway {

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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
    DeviceTensor device;  // forward copy, until its D2H is done
    PinnedBlock pinned;
    bool kept = false;  // pinned pool full: stayed on the device
    Event d2h_done{-1};
    Event h2d_done{-1};
    bool device_released = false;
    bool hold = false;    // OffloadHold::kUntilLayerEnd: released at end_forward_layer at most
    bool copied = false;  // its D2H copy is known complete
    bool reload_issued = false;
    int h2d_seq = 0;  // issue order of its reload in the step (1, 2, ...)
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
    int compute_waited_seq = 0;  // compute is ordered after this layer's reloads up to here
  };
  std::vector<LayerTimes> times;
  std::vector<LayerMarks> marks;

  Device& dev;
  Stream compute;
  Stream d2h;
  Stream h2d;
  OffloadOptions opt;
  PinnedPool pinned;
  PinnedPool device_pool;
  std::vector<Slot> slots;
  size_t slots_used = 0;
  std::vector<Event> free_events;
  std::vector<int> d2h_pending;  // slots whose device block is not yet released (FIFO)
  size_t d2h_head = 0;
  std::vector<int> h2d_pending;  // slots whose pinned block is not yet released (FIFO)
  size_t h2d_head = 0;
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

  Impl(Device& device, Stream compute_stream, const MemoryPolicy& policy, const OffloadOptions& o)
      : dev(device),
        compute(compute_stream),
        d2h(device.create_stream(StreamRole::kD2H)),
        h2d(device.create_stream(StreamRole::kH2D)),
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
    free_events.reserve(3 * n);
    for (size_t i = 0; i < 3 * n; ++i) free_events.push_back(dev.create_event());
    d2h_pending.reserve(n);
    h2d_pending.reserve(n);
    deferred.reserve(n);
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
    for (Event e : free_events) dev.destroy_event(e);
    dev.destroy_stream(d2h);
    dev.destroy_stream(h2d);
  }

  Event take_event() {
    SPILLWAY_CHECK(!free_events.empty(),
                   "offload: out of events (raise OffloadOptions::max_tensors)");
    const Event e = free_events.back();
    free_events.pop_back();
    return e;
  }
  void give_event(Event& e) {
    if (e.id >= 0) free_events.push_back(e);
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
    give_event(s.d2h_done);
    give_event(s.h2d_done);
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

  DeviceTensor device_block(size_t bytes) {
    for (;;) {
      const PinnedBlock b = device_pool.acquire(bytes);
      if (b) return DeviceTensor{b.ptr, bytes, b.slab, b.offset, false};
      poll();
      const PinnedBlock again = device_pool.acquire(bytes);
      if (again) return DeviceTensor{again.ptr, bytes, again.slab, again.offset, false};
      // Back-pressure: wait for the oldest offload copy (it frees a block as soon as it
      // ends), else for the oldest pending free.
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
  void issue_layer(int layer) {
    bool issued = false;
    for (int id : layer_slots[static_cast<size_t>(layer)]) {
      const Slot& s = slots[static_cast<size_t>(id)];
      issued = issued || (!s.kept && !s.reload_issued);
      issue_reload(id);
    }
    if (issued) mark_h2d_end(layer);
  }

  void issue_reload(int id) {
    Slot& s = slots[static_cast<size_t>(id)];
    if (s.kept || s.reload_issued) return;
    s.reload_issued = true;
    s.reloaded = device_block(s.bytes);
    s.h2d_done = take_event();
    dev.wait(h2d, s.d2h_done);  // never before the offload finished
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
    dev.copy_async(s.reloaded.ptr, s.pinned.ptr, s.bytes, h2d);
    dev.record(s.h2d_done, h2d);
    h2d_pending.push_back(id);
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
  m.poll();
  const int id = static_cast<int>(m.slots_used);
  Impl::Slot& s = m.new_slot(layer, name, t.bytes);
  s.device = t;
  s.hold = hold == OffloadHold::kUntilLayerEnd;
  s.pinned = m.pinned.acquire(t.bytes);
  if (!s.pinned) {
    // Fallback: the pinned pool is full (its blocks wait for backward): keep it here.
    s.kept = true;
    ++m.tel.fallback_kept;
    return id;
  }
  ++m.tel.tensors_offloaded;
  // Back-pressure: before the copy is enqueued, wait until the copies in flight leave room
  // for it under the bound (with none left in flight it goes, even if larger).
  if (m.opt.inflight_bound_bytes > 0) {
    const int64_t need = static_cast<int64_t>(t.bytes);
    if (m.inflight + need > m.opt.inflight_bound_bytes) {
      const double t0 = now_ms();
      while (m.inflight + need > m.opt.inflight_bound_bytes && m.d2h_head < m.d2h_pending.size()) {
        m.dev.synchronize(m.slots[static_cast<size_t>(m.d2h_pending[m.d2h_head])].d2h_done);
        m.poll();
      }
      m.tel.backpressure_ms += now_ms() - t0;
    }
  }
  Event produced = m.take_event();
  m.dev.record(produced, m.compute);
  m.dev.wait(m.d2h, produced);
  m.give_event(produced);  // the wait captured its target: reusable at once
  s.d2h_done = m.take_event();
  Impl::Slot* sp = &s;
  Impl::LayerTimes* lt = nullptr;
  if (Impl::LayerMarks* mk = m.layer_marks(layer); mk != nullptr) {
    lt = &m.times[static_cast<size_t>(layer)];
    if (!mk->d2h_started) {
      mk->d2h_started = true;
      m.dev.host_callback(m.d2h, [lt] { lt->d2h_start = now_ms(); });
    }
  }
  m.dev.copy_async(s.pinned.ptr, s.device.ptr, s.bytes, m.d2h);
  // Verify mode: the checksum of what landed on the host, right after its copy. (The
  // layer's copy end is stamped once, by end_forward_layer: Note [Layer timestamps].)
  // Two pointers: fits std::function's local buffer, so no allocation per tensor.
  sp->verify = m.opt.verify;
  if (sp->verify)
    m.dev.host_callback(m.d2h, [sp] { sp->sum = checksum(sp->pinned.ptr, sp->bytes); });
  m.dev.record(s.d2h_done, m.d2h);
  m.d2h_pending.push_back(id);
  m.inflight += static_cast<int64_t>(s.bytes);
  if (layer >= 0 && static_cast<size_t>(layer) < m.tel.layers.size()) {
    m.tel.layers[static_cast<size_t>(layer)].d2h_bytes += static_cast<int64_t>(s.bytes);
  }
  m.tel.d2h_bytes += static_cast<int64_t>(s.bytes);
  return id;
}

void OffloadEngine::end_forward_layer(int layer) {
  Impl& m = *impl_;
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
  SPILLWAY_CHECK(h >= 0 && static_cast<size_t>(h) < m.slots_used, "reload(): unknown handle {}", h);
  Impl::Slot& s = m.slots[static_cast<size_t>(h)];
  SPILLWAY_CHECK(!s.reload_taken, "reload(): handle {} ({} of layer {}) was already reloaded", h,
                 s.name, s.layer);
  s.reload_taken = true;
  if (s.kept) {
    DeviceTensor t = s.device;
    s.device = DeviceTensor{};
    return t;
  }
  if (!s.reload_issued) {
    m.issue_reload(h);
    m.mark_h2d_end(s.layer);
  }
  if (Impl::LayerMarks* mk = m.layer_marks(s.layer); mk != nullptr && !mk->reached) {
    mk->reached = true;
    Impl::LayerTimes* lt = &m.times[static_cast<size_t>(s.layer)];
    m.dev.host_callback(m.compute, [lt] { lt->compute_reached = now_ms(); });
  }
  // Note [One wait per layer]: the H2D stream is FIFO, so ordering compute after the
  // layer's last reload issued so far orders it after every earlier one: the first
  // reload() of a layer makes compute wait once for the layer's batch, the others need
  // no wait. (Each wait may cost the copy engine a wake-up of the compute stream: ~40 us
  // per tensor on this VM, 7% of an 8 MiB copy's time.) Never the next layer's reloads:
  // compute would wait for the prefetch.
  if (Impl::LayerMarks* mk = m.layer_marks(s.layer); mk != nullptr) {
    if (mk->compute_waited_seq < s.h2d_seq) {
      const Impl::Slot& last = m.slots[static_cast<size_t>(mk->last_h2d_slot)];
      m.dev.wait(m.compute, last.h2d_done);
      mk->compute_waited_seq = last.h2d_seq;
    }
  } else {
    m.dev.wait(m.compute, s.h2d_done);
  }
  DeviceTensor t = s.reloaded;
  s.reloaded = DeviceTensor{};
  m.poll();
  return t;
}

int OffloadEngine::max_tensors() const {
  return impl_->opt.max_tensors;
}

StepTelemetry OffloadEngine::end_step() {
  Impl& m = *impl_;
  SPILLWAY_CHECK(m.in_step, "end_step() without begin_step()");
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

// The activation offload engine's state (OffloadEngine::Impl,
// include/spillway/offload/offload.hpp), shared by its two halves: offload_engine.cpp (the copies
// out, the pools, the step) and offload_reload.cpp (the reloads). A slot's place in its life is its
// state (Note [The life of a slot], slot_state.hpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "core/arena.hpp"
#include "core/stats.hpp"
#include "offload/slot_state.hpp"
#include "spillway/core/error.hpp"
#include "spillway/memory/memory.hpp"
#include "spillway/offload/offload.hpp"

namespace spillway {
namespace offload {

// Verify mode (OffloadOptions::verify): a copy's checksum, after the D2H copy (flush) and
// the H2D one (issue_reload).
inline uint64_t checksum(const void* p, size_t n) {  // FNV-1a over 8-byte words, then the tail
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

}  // namespace offload

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
    // Note [The life of a slot] (slot_state.hpp): where it is in its life.
    offload::SlotState state = offload::SlotState::kFree;
    Event d2h_done{-1};     // after its copy (shared by a batch: Note [Copies in batches])
    bool owns_d2h = false;  // d2h_done is this slot's to give back (a batch's last slot)
    Event h2d_done{-1};     // its reload's (shared by a layer's: Note [One event per layer])
    bool owns_h2d = false;  // h2d_done is this slot's to give back
    bool hold = false;      // OffloadHold::kUntilLayerEnd: released at end_forward_layer at most
    int h2d_seq = 0;        // issue order of its reload in the step (1, 2, ...)
    int64_t d2h_seq = 0;    // issue order of its D2H copy, never reset (0: no copy)
    int64_t fence_seq = 0;  // Note [One fence per batch]: its fence's order (0: none)
    int fence_slot = -1;    // the slot whose H holds that fence until its copy is issued
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
  // Note [The life of a slot]: every change of a slot's state, checked against the diagram.
  void transition(Slot& s, offload::SlotState from, offload::SlotState to) {
    offload::transition(s.state, from, to, static_cast<int>(&s - slots.data()));
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

  Impl(Device& device, Stream compute_stream, const MemoryPolicy& policy, const OffloadOptions& o);
  ~Impl();
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

  // offload_engine.cpp: a slot given back, the copies out (their completions polled, the
  // back-pressure, the batches) and the device pool.
  void release_slot(Slot& s);
  void poll();
  void make_room(size_t bytes, int layer);
  void mark_late(int layer);
  bool start_copy(int id);
  void flush();
  // offload_reload.cpp: a reload's destination and fence (Note [Reload into caller memory]).
  void set_target(int id, void* dst, int fence = -1);
  // The slot of a handle not reloaded yet (reload, reload_into, set_reload_target).
  const Slot& offloaded(OffloadHandle h, const char* what) const {
    SPILLWAY_CHECK(h >= 0 && static_cast<size_t>(h) < slots_used,
                   "{}: unknown handle {} (not offloaded in this step)", what, h);
    return slots[static_cast<size_t>(h)];
  }
  Slot& unreloaded(OffloadHandle h, const char* what) {
    SPILLWAY_CHECK(h >= 0 && static_cast<size_t>(h) < slots_used, "{}: unknown handle {}", what, h);
    Slot& s = slots[static_cast<size_t>(h)];
    SPILLWAY_CHECK(!offload::reload_taken(s.state),
                   "{}: handle {} ({} of layer {}) was already reloaded", what, h, s.name, s.layer);
    return s;
  }

  void order_compute_after(const Slot& s);  // offload_reload.cpp
  // offload_engine.cpp: a block of the device pool (or a direct allocation), a new slot.
  DeviceTensor device_block(size_t bytes);
  Slot& new_slot(int layer, std::string_view name, size_t bytes);
  // Note [Offload hold]: a tensor offloaded with OffloadHold::kUntilLayerEnd is still read
  // by its layer's forward after its copy starts, so its device memory goes back when
  // both its copy is done and its layer's forward has ended, whichever is later.
  bool forward_ended(int layer) {
    const LayerMarks* mk = layer_marks(layer);
    return mk == nullptr || mk->forward_ended;
  }
  void release_copied(Slot& s) {
    release_device(s.device);
    transition(s, s.state, offload::after_device_released(s.state));
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
  // offload_reload.cpp: the reloads issued (Note [One event per layer], Note [One H2D wait]).
  void mark_h2d_end(int layer);
  void issue_layer(int layer);
  void issue_reload(int id, bool alone = true);
};

}  // namespace spillway

// Layerwise weight streaming: see spillway/stream/weight_streamer.hpp (Note [Ring ordering], Note
// [Streaming across steps]).
#include "spillway/stream/weight_streamer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/stats.hpp"
#include "spillway/core/error.hpp"

namespace spillway {

struct WeightStreamer::Impl {
  Device& dev;
  Stream compute;
  UniqueStream h2d;
  UniqueStream comm;               // sharded: the all-gathers' stream
  std::vector<size_t> bytes;       // per layer
  std::vector<size_t> host_bytes;  // per layer: its host slab (the layer, or its shard)
  AllGather* group = nullptr;
  int ranks = 1;
  int rank = 0;
  WeightStreamOptions opt;
  int L = 0;
  int n = 0;  // visits per step
  int slots = 0;
  size_t slot_bytes = 0;
  std::vector<void*> host;  // per layer
  bool owns_host = true;
  bool owns_slots = true;
  std::vector<UniqueEvent> slab_read;  // per layer: recorded on h2d after each copy from its slab

  struct Slot {
    void* ptr = nullptr;
    int layer = -1;         // the layer it holds (or is loading); -1: empty or stale
    int64_t last_use = -1;  // the latest decided visit reading it
    UniqueEvent ready;      // recorded after its last copy (sharded: after the all-gather)
    UniqueEvent copied;     // sharded: recorded on h2d after the copy of this rank's shard
    UniqueEvent free;       // recorded on compute at the release of each visit reading it
  };
  std::vector<Slot> ring;

  // Decisions per visit in flight (absolute visit index a -> plan[a % plan.size()]).
  struct Decision {
    int slot = -1;
    bool load = false;
  };
  std::vector<Decision> plan;
  int64_t decided = 0;      // visits [0, decided) are decided (and their loads issued)
  int64_t next = 0;         // the next visit to acquire
  bool in_visit = false;    // between acquire and release
  int64_t steps_ended = 0;  // step_end() calls

  // Telemetry: counted on the caller's thread...
  std::vector<int64_t> loads, hits, copied;
  int64_t late = 0;
  double slots_ahead_sum = 0.0;
  int64_t visits = 0;
  // ...and timed on the streams' threads (host callbacks; read after synchronizing them).
  std::vector<double> copy_ms, stall_ms;
  std::vector<double> copy_start;  // per layer, h2d thread
  std::vector<double> reached;     // per layer, compute thread

  Impl(Device& d, Stream c) : dev(d), compute(c) {}

  int layer_of(int64_t a) const {
    const int v = static_cast<int>(a % n);
    return v < L ? v : 2 * L - 1 - v;
  }
  int64_t step_of(int64_t a) const { return a / n; }

  // The visit after `a` that reads `layer` next, within one cycle (none: far away).
  int64_t next_use(int layer, int64_t a) const {
    for (int64_t j = a + 1; j <= a + n; ++j)
      if (layer_of(j) == layer) return j;
    return a + int64_t{2} * n;
  }

  bool decide(int64_t a);  // false: not yet (static slots)
  void load(int64_t a, int slot, int layer);
  void decide_up_to(int64_t last);
};

bool WeightStreamer::Impl::decide(int64_t a) {
  const int layer = layer_of(a);
  Decision& d = plan[static_cast<size_t>(a % static_cast<int64_t>(plan.size()))];
  if (opt.static_slots) {
    // Note [Static slots]: layer l always in slot l % slots; a load waits (is decided
    // later) until the slot's last reader has been released.
    const int s = layer % slots;
    Slot& k = ring[static_cast<size_t>(s)];
    if (k.layer == layer) {
      d = {s, false};
      k.last_use = a;
      return true;
    }
    if (k.last_use >= next) return false;
    load(a, s, layer);
    d = {s, true};
    return true;
  }
  // A hit: the layer is in a slot (loaded, or loading for an earlier decided visit).
  for (int s = 0; s < slots; ++s) {
    if (ring[static_cast<size_t>(s)].layer == layer) {
      d = {s, false};
      ring[static_cast<size_t>(s)].last_use = a;
      return true;
    }
  }
  // A load: into a slot no visit in [a - depth, a) reads, the one needed again the latest.
  const int64_t window = a - opt.depth;
  int best = -1;
  int64_t best_next = -1;
  for (int s = 0; s < slots; ++s) {
    const Slot& k = ring[static_cast<size_t>(s)];
    if (k.last_use >= 0 && k.last_use >= window) continue;  // read by a visit in flight
    const int64_t nu = k.layer < 0 ? a + int64_t{3} * n : next_use(k.layer, a);
    if (nu > best_next) {
      best = s;
      best_next = nu;
    }
  }
  SPILLWAY_CHECK(best >= 0, "weight streaming: no free slot for visit {} (layer {})", a, layer);
  load(a, best, layer);
  d = {best, true};
  return true;
}

void WeightStreamer::Impl::load(int64_t a, int slot, int layer) {
  Slot& k = ring[static_cast<size_t>(slot)];
  // Note [Ring ordering]: the previous occupant's last visit is released (it is before the
  // window, and visits are released in order), so its `free` event is recorded.
  SPILLWAY_CHECK(k.last_use < next,
                 "weight streaming: slot {} reused before its reader {} was released", slot,
                 k.last_use);
  if (k.last_use >= 0) dev.wait(h2d, k.free);
  const auto l = static_cast<size_t>(layer);
  if (opt.timing)
    dev.host_callback(h2d, [this, layer] { copy_start[static_cast<size_t>(layer)] = now_ms(); });
  const size_t hb = host_bytes[l];
  dev.copy_async(static_cast<std::byte*>(k.ptr) + static_cast<size_t>(rank) * (group ? hb : 0),
                 host[l], hb, h2d);
  if (opt.timing)
    dev.host_callback(h2d, [this, layer] {
      const auto i = static_cast<size_t>(layer);
      copy_ms[i] += now_ms() - copy_start[i];
    });
  if (group != nullptr) {
    // Note [Sharded streaming]: the all-gather after this rank's shard has landed.
    dev.record(k.copied, h2d);
    dev.wait(comm, k.copied);
    group->all_gather_in_place(k.ptr, hb, comm);
    dev.record(k.ready, comm);
  } else {
    dev.record(k.ready, h2d);
  }
  dev.record(slab_read[l], h2d);
  k.layer = layer;
  k.last_use = a;
  ++loads[l];
  copied[l] += static_cast<int64_t>(hb);
}

void WeightStreamer::Impl::decide_up_to(int64_t last) {
  // Training: the next step's visits wait for step_end() (Note [Streaming across steps]).
  if (opt.training) last = std::min(last, (steps_ended + 1) * n - 1);
  for (; decided <= last; ++decided)
    if (!decide(decided)) return;  // Note [Static slots]: issued after a later release
}

WeightStreamer::WeightStreamer(Device& dev, Stream compute, std::vector<size_t> layer_bytes,
                               const WeightStreamOptions& options)
    : impl_(std::make_unique<Impl>(dev, compute)) {
  Impl& s = *impl_;
  s.opt = options;
  s.bytes = std::move(layer_bytes);
  s.L = static_cast<int>(s.bytes.size());
  if (s.L < 1) SPILLWAY_FIELD_ERROR("layers", s.L, "must be >= 1");
  if (options.depth < 1 || options.depth > 64)
    SPILLWAY_FIELD_ERROR("depth", options.depth, "must be in [1, 64]");
  for (int i = 0; i < s.L; ++i)
    if (s.bytes[static_cast<size_t>(i)] == 0)
      SPILLWAY_FIELD_ERROR("layer_bytes", 0, "must be > 0 (layer {})", i);
  if (!options.host_slabs.empty() && static_cast<int>(options.host_slabs.size()) != s.L)
    SPILLWAY_FIELD_ERROR("host_slabs", options.host_slabs.size(),
                         "must be empty or one per layer ({})", s.L);
  s.n = options.training ? 2 * s.L : s.L;
  s.slots = options.depth + 1;
  s.group = options.group;
  if (s.group != nullptr) {
    s.ranks = s.group->ranks();
    s.rank = s.group->rank();
    size_t largest = 0;
    for (size_t b : s.bytes) {
      const size_t shard = (b + static_cast<size_t>(s.ranks) - 1) / static_cast<size_t>(s.ranks);
      s.host_bytes.push_back((shard + 255) / 256 * 256);
      largest = std::max(largest, s.host_bytes.back());
    }
    s.slot_bytes = largest * static_cast<size_t>(s.ranks);
  } else {
    s.host_bytes = s.bytes;
    s.slot_bytes = *std::max_element(s.bytes.begin(), s.bytes.end());
  }
  s.h2d = UniqueStream(dev, StreamRole::kH2D);
  if (s.group != nullptr) s.comm = UniqueStream(dev, StreamRole::kCompute);
  s.owns_host = options.host_slabs.empty();
  s.host = options.host_slabs;
  if (s.owns_host) {
    for (int i = 0; i < s.L; ++i) {
      const AllocResult r =
          dev.allocate(s.host_bytes[static_cast<size_t>(i)], MemoryKind::kPinnedHost);
      if (!r)
        SPILLWAY_INPUT_ERROR(
            "weight streaming: cannot allocate the host slab of layer {} ({} bytes): {}", i,
            s.bytes[static_cast<size_t>(i)], r.reason);
      s.host.push_back(r.ptr);
    }
  }
  s.ring.resize(static_cast<size_t>(s.slots));
  s.owns_slots = options.device_slots.empty();
  if (!s.owns_slots && static_cast<int>(options.device_slots.size()) != s.slots)
    SPILLWAY_FIELD_ERROR("device_slots", options.device_slots.size(),
                         "must be empty or depth + 1 ({})", s.slots);
  for (int i = 0; i < s.slots; ++i) {
    if (!s.owns_slots) {
      Impl::Slot& k = s.ring[static_cast<size_t>(i)];
      k.ptr = options.device_slots[static_cast<size_t>(i)];
      if (k.ptr == nullptr) SPILLWAY_FIELD_ERROR("device_slots", "null", "slot {} is null", i);
      k.ready = UniqueEvent(dev);
      k.free = UniqueEvent(dev);
      k.copied = UniqueEvent(dev);
      continue;
    }
    const AllocResult r = dev.allocate(s.slot_bytes, MemoryKind::kDevice);
    if (!r)
      SPILLWAY_INPUT_ERROR(
          "weight streaming: cannot allocate device slot {} of {} ({} bytes, the largest "
          "layer): {}",
          i, s.slots, s.slot_bytes, r.reason);
    Impl::Slot& k = s.ring[static_cast<size_t>(i)];
    k.ptr = r.ptr;
    k.ready = UniqueEvent(dev);
    k.free = UniqueEvent(dev);
    k.copied = UniqueEvent(dev);
  }
  s.slab_read.reserve(static_cast<size_t>(s.L));
  for (int i = 0; i < s.L; ++i) s.slab_read.emplace_back(dev);
  s.plan.resize((2 * static_cast<size_t>(s.slots)) + 2);
  const auto nl = static_cast<size_t>(s.L);
  s.loads.assign(nl, 0);
  s.hits.assign(nl, 0);
  s.copied.assign(nl, 0);
  s.copy_ms.assign(nl, 0.0);
  s.stall_ms.assign(nl, 0.0);
  s.copy_start.assign(nl, 0.0);
  s.reached.assign(nl, 0.0);
}

WeightStreamer::~WeightStreamer() {
  Impl& s = *impl_;
  s.dev.synchronize(s.h2d);
  if (s.group != nullptr) s.dev.synchronize(s.comm);
  s.dev.synchronize(s.compute);
  for (Impl::Slot& k : s.ring)
    if (s.owns_slots) s.dev.free(k.ptr, MemoryKind::kDevice);
  if (s.owns_host)
    for (void* p : s.host) s.dev.free(p, MemoryKind::kPinnedHost);
}

int WeightStreamer::layers() const {
  return impl_->L;
}
int WeightStreamer::depth() const {
  return impl_->opt.depth;
}
size_t WeightStreamer::slot_bytes() const {
  return impl_->slot_bytes;
}

size_t WeightStreamer::host_slab_bytes(int layer) const {
  (void)host_slab(layer);  // checks the layer
  return impl_->host_bytes[static_cast<size_t>(layer)];
}

size_t WeightStreamer::host_slab_offset(int layer) const {
  (void)host_slab(layer);
  return impl_->group != nullptr
             ? static_cast<size_t>(impl_->rank) * impl_->host_bytes[static_cast<size_t>(layer)]
             : 0;
}

void* WeightStreamer::host_slab(int layer) const {
  if (layer < 0 || layer >= impl_->L)
    SPILLWAY_FIELD_ERROR("layer", layer, "must be in [0, {})", impl_->L);
  return impl_->host[static_cast<size_t>(layer)];
}

Event WeightStreamer::host_slab_read(int layer) const {
  if (layer < 0 || layer >= impl_->L)
    SPILLWAY_FIELD_ERROR("layer", layer, "must be in [0, {})", impl_->L);
  return impl_->slab_read[static_cast<size_t>(layer)];
}

const void* WeightStreamer::acquire(int layer) {
  Impl& s = *impl_;
  const int64_t a = s.next;
  if (s.in_visit)
    SPILLWAY_INPUT_ERROR("weight streaming: acquire({}) before release({})", layer, s.layer_of(a));
  if (s.opt.training && s.step_of(a) > s.steps_ended)
    SPILLWAY_INPUT_ERROR(
        "weight streaming: acquire({}) starts step {} before step_end() of step {} (training: "
        "the next step's weights are streamed after the optimizer wrote them)",
        layer, s.step_of(a), s.step_of(a) - 1);
  if (layer != s.layer_of(a))
    SPILLWAY_INPUT_ERROR(
        "weight streaming: acquire({}) out of schedule: visit {} of the step is layer {} "
        "({})",
        layer, a % s.n, s.layer_of(a), s.opt.training ? "forward then backward" : "forward");
  s.decide_up_to(a + s.opt.depth);
  SPILLWAY_CHECK(s.decided > a, "weight streaming: visit {} could not be decided", a);
  const Impl::Decision d = s.plan[static_cast<size_t>(a % static_cast<int64_t>(s.plan.size()))];
  Impl::Slot& k = s.ring[static_cast<size_t>(d.slot)];
  const auto l = static_cast<size_t>(layer);
  if (!d.load) ++s.hits[l];
  if (!s.dev.query(k.ready)) ++s.late;
  // Occupancy: the slots read by the visits in flight, their loads issued.
  int ahead = 0;
  for (int sl = 0; sl < s.slots; ++sl) {
    const Impl::Slot& o = s.ring[static_cast<size_t>(sl)];
    if (o.last_use >= a && o.last_use <= a + s.opt.depth) ++ahead;
  }
  s.slots_ahead_sum += ahead;
  ++s.visits;
  if (s.opt.timing)
    s.dev.host_callback(s.compute,
                        [&s, layer] { s.reached[static_cast<size_t>(layer)] = now_ms(); });
  s.dev.wait(s.compute, k.ready);
  if (s.opt.timing)
    s.dev.host_callback(s.compute, [&s, layer] {
      const auto i = static_cast<size_t>(layer);
      s.stall_ms[i] += now_ms() - s.reached[i];
    });
  s.in_visit = true;
  return k.ptr;
}

void WeightStreamer::release(int layer) {
  Impl& s = *impl_;
  const int64_t a = s.next;
  if (!s.in_visit || layer != s.layer_of(a))
    SPILLWAY_INPUT_ERROR(
        "weight streaming: release({}) without its acquire (the visit in "
        "progress is {})",
        layer, s.in_visit ? std::to_string(s.layer_of(a)) : "none");
  const Impl::Decision d = s.plan[static_cast<size_t>(a % static_cast<int64_t>(s.plan.size()))];
  s.dev.record(s.ring[static_cast<size_t>(d.slot)].free, s.compute);
  s.in_visit = false;
  ++s.next;
  if (s.opt.static_slots) s.decide_up_to(s.next - 1 + s.opt.depth);  // deferred loads
}

WeightStreamer::Upcoming WeightStreamer::upcoming(int ahead) const {
  const Impl& s = *impl_;
  if (ahead < 1) SPILLWAY_FIELD_ERROR("ahead", ahead, "must be >= 1");
  // The last visit acquired: the one in progress, or the one before the next.
  const int64_t a = (s.in_visit ? s.next : s.next - 1) + ahead;
  if (a < 0 || a >= s.decided) return {};
  const Impl::Decision d = s.plan[static_cast<size_t>(a % static_cast<int64_t>(s.plan.size()))];
  const Impl::Slot& k = s.ring[static_cast<size_t>(d.slot)];
  return {s.layer_of(a), k.ready, k.ptr};
}

void WeightStreamer::step_end() {
  Impl& s = *impl_;
  if (s.in_visit) SPILLWAY_INPUT_ERROR("weight streaming: step_end() inside a visit");
  if (s.opt.training) {
    if (s.next != (s.steps_ended + 1) * s.n)
      SPILLWAY_INPUT_ERROR(
          "weight streaming: step_end() after {} of the step's {} visits (forward then "
          "backward)",
          s.next - s.steps_ended * s.n, s.n);
    // The weights changed: nothing resident is reused (the slots keep their last readers).
    for (Impl::Slot& k : s.ring) k.layer = -1;
  }
  ++s.steps_ended;
}

WeightStreamTelemetry WeightStreamer::telemetry() {
  Impl& s = *impl_;
  if (s.opt.timing) {
    s.dev.synchronize(s.h2d);
    s.dev.synchronize(s.compute);
  }
  WeightStreamTelemetry t;
  for (int i = 0; i < s.L; ++i) {
    const auto l = static_cast<size_t>(i);
    LayerStreamStats ls;
    ls.loads = s.loads[l];
    ls.hits = s.hits[l];
    ls.bytes = s.copied[l];
    ls.copy_ms = s.copy_ms[l];
    ls.stall_ms = s.stall_ms[l];
    ls.gbps = ls.copy_ms > 0 ? static_cast<double>(ls.bytes) / (ls.copy_ms * 1e6) : 0.0;
    t.loads += ls.loads;
    t.hits += ls.hits;
    t.bytes += ls.bytes;
    t.copy_ms += ls.copy_ms;
    t.stall_ms += ls.stall_ms;
    t.layers.push_back(ls);
  }
  t.gbps = t.copy_ms > 0 ? static_cast<double>(t.bytes) / (t.copy_ms * 1e6) : 0.0;
  t.visits = s.visits;
  t.mean_slots_ahead = s.visits > 0 ? s.slots_ahead_sum / static_cast<double>(s.visits) : 0.0;
  t.late_acquires = s.late;
  t.steps = s.steps_ended;
  return t;
}

void WeightStreamer::reset_telemetry() {
  Impl& s = *impl_;
  s.dev.synchronize(s.h2d);
  s.dev.synchronize(s.compute);
  std::fill(s.loads.begin(), s.loads.end(), 0);
  std::fill(s.hits.begin(), s.hits.end(), 0);
  std::fill(s.copied.begin(), s.copied.end(), 0);
  std::fill(s.copy_ms.begin(), s.copy_ms.end(), 0.0);
  std::fill(s.stall_ms.begin(), s.stall_ms.end(), 0.0);
  s.late = 0;
  s.slots_ahead_sum = 0.0;
  s.visits = 0;
}

}  // namespace spillway

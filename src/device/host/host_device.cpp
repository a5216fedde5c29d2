// The host backend: an emulated device that moves real bytes with CUDA's ordering rules.
//
// - Device memory is one arena of fixed capacity (an HBM budget, enforced and measured).
// - Each stream is a queue (detail::HostQueue, host_queue.cpp) run in order by its worker
//   thread; copies on a D2H or H2D stream may be throttled to a bandwidth: a copy of n
//   bytes takes at least n / B of wall time, its bytes landing as it streams (Note
//   [Throttled copies land as they stream]), so link ratios of real hardware can be
//   reproduced. A queue is not tied to a device: a caller makes one as a
//   HostStream and a device adopts it (Note [Adopted streams], Note [Host stream registry]).
// - Events are real synchronization objects: record(e, s) bumps e's target and enqueues
//   "complete up to target" on s; wait(s, e) enqueues "block until e reaches the target it
//   had when wait was called"; a never-recorded event is complete. A record on an idle
//   stream and a wait on a reached event enqueue nothing (Note [Idle record]).
// - The device operations (Note [Device operations]) are ops too: their arguments are
//   held by value and host_ops.cpp runs them on the worker, in stream order.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>

#include "core/arena.hpp"
#include "core/enum_names.hpp"
#include "device/host/host_ops.hpp"
#include "device/host/host_queue.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"
#include "spillway/device/device.hpp"
#include "spillway/device/device_backend.hpp"

namespace spillway {

constexpr EnumNames<MemoryKind, 4> kMemoryKindNames = {{{MemoryKind::kDevice, "device"},
                                                        {MemoryKind::kPinnedHost, "pinned host"},
                                                        {MemoryKind::kMappedHost, "mapped host"},
                                                        {MemoryKind::kHost, "host"}}};

std::string to_string(MemoryKind k) {
  return std::string(name_of(kMemoryKindNames, k));
}

namespace {

using detail::EventState;
using detail::HostQueue;
using detail::Op;

// A device's stream: its queue (shared with the caller when adopted) and the throttle of
// its copies.
struct StreamSlot {
  std::shared_ptr<HostQueue> queue;
  double gbps = 0.0;
  bool adopted = false;
  HostLink* link = nullptr;  // the shared link of the stream's copies, if any
  bool h2d = false;
  explicit operator bool() const { return queue != nullptr; }
};

class HostDevice final : public DeviceBackend {
 public:
  explicit HostDevice(const HostDeviceOptions& o)
      : options_(o), arena_(static_cast<size_t>(std::max<int64_t>(o.device_bytes, 0))) {
    if (o.device_bytes <= 0) SPILLWAY_FIELD_ERROR("device_bytes", o.device_bytes, "must be > 0");
    if (!(o.d2h_gbps == 0.0 || (o.d2h_gbps >= kMinThrottleGbps && std::isfinite(o.d2h_gbps))))
      SPILLWAY_FIELD_ERROR("d2h_gbps", o.d2h_gbps, "must be 0 (no throttle) or in [{}, inf)",
                           kMinThrottleGbps);
    if (!(o.h2d_gbps == 0.0 || (o.h2d_gbps >= kMinThrottleGbps && std::isfinite(o.h2d_gbps))))
      SPILLWAY_FIELD_ERROR("h2d_gbps", o.h2d_gbps, "must be 0 (no throttle) or in [{}, inf)",
                           kMinThrottleGbps);
    // Page-aligned like a GPU's allocations (2 MiB granules): with a base only 256-aligned,
    // copies between it and page-aligned host memory run at a fixed misalignment modulo
    // 4 KiB, which costs memmove ~10% in one direction (4K aliasing) and not the other.
    constexpr size_t kGranule = size_t{2} << 20;
    base_ = static_cast<std::byte*>(
        std::aligned_alloc(kGranule, (arena_.capacity() + kGranule - 1) / kGranule * kGranule));
    if (base_ == nullptr) {
      SPILLWAY_INPUT_ERROR("host device: cannot reserve the {} device arena in host memory",
                           to_string(Bytes(static_cast<int64_t>(arena_.capacity()))));
    }
  }
  ~HostDevice() override {
    std::vector<StreamSlot> streams;
    {
      std::lock_guard<std::mutex> lock(table_mu_);
      streams.swap(streams_);
    }
    // The work on adopted streams may name this device's events and memory: it runs first.
    for (StreamSlot& s : streams)
      if (s) s.queue->synchronize();
    streams.clear();  // joins the workers of the streams the device made
    std::lock_guard<std::mutex> lock(mem_mu_);
    for (auto& [ptr, a] : host_allocs_) std::free(ptr);
    std::free(base_);
  }

  std::string name() const override {
    return "host (emulated device, " + to_string(Bytes(static_cast<int64_t>(arena_.capacity()))) +
           " arena)";
  }
  bool emulated() const override { return true; }

  AllocResult allocate(size_t bytes, MemoryKind kind) override {
    std::lock_guard<std::mutex> lock(mem_mu_);
    AllocResult r;
    if (kind == MemoryKind::kDevice) {
      const std::optional<size_t> off = arena_.allocate(bytes);
      if (!off) {
        r.reason = "device arena: " + to_string(Bytes(static_cast<int64_t>(bytes))) +
                   " requested, " +
                   to_string(Bytes(static_cast<int64_t>(arena_.capacity() - arena_.used()))) +
                   " free of " + to_string(Bytes(static_cast<int64_t>(arena_.capacity()))) +
                   " (largest free block " +
                   to_string(Bytes(static_cast<int64_t>(arena_.largest_free()))) + ")";
        return r;
      }
      r.ptr = base_ + *off;
      make_resident(*off, arena_.block_size(*off));
      account(kind, static_cast<int64_t>(arena_.block_size(*off)));
      return r;
    }
    const size_t rounded = std::max<size_t>((bytes + 4095) / 4096 * 4096, 4096);
    r.ptr = std::aligned_alloc(4096, rounded);
    if (r.ptr == nullptr) {
      r.reason = to_string(kind) + " memory: " + to_string(Bytes(static_cast<int64_t>(bytes))) +
                 " not available";
      return r;
    }
    host_allocs_.emplace(r.ptr, std::make_pair(kind, rounded));
    account(kind, static_cast<int64_t>(rounded));
    return r;
  }

  void free(void* ptr, MemoryKind kind) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mem_mu_);
    if (kind == MemoryKind::kDevice) {
      auto* p = static_cast<std::byte*>(ptr);
      SPILLWAY_CHECK(p >= base_ && p < base_ + arena_.capacity(), "free: {} is not device memory",
                     ptr);
      const size_t off = static_cast<size_t>(p - base_);
      const size_t size = arena_.block_size(off);
      SPILLWAY_CHECK(size > 0, "free: device pointer {} is not allocated", ptr);
      arena_.free(off);
      stats_.current[0] -= static_cast<int64_t>(size);
      return;
    }
    auto it = host_allocs_.find(ptr);
    SPILLWAY_CHECK(it != host_allocs_.end() && it->second.first == kind,
                   "free: {} is not {} memory", ptr, to_string(kind));
    stats_.current[static_cast<int>(kind)] -= static_cast<int64_t>(it->second.second);
    std::free(ptr);
    host_allocs_.erase(it);
  }

  MemoryStats memory_stats() const override {
    std::lock_guard<std::mutex> lock(mem_mu_);
    return stats_;
  }

  void reset_peaks() override {
    std::lock_guard<std::mutex> lock(mem_mu_);
    for (int k = 0; k < kMemoryKinds; ++k) stats_.peak[k] = stats_.current[k];
  }

  Stream create_stream(StreamRole role, int /*priority*/) override {
    return add_stream(with_link(StreamSlot{HostQueue::create(), throttle(role), false}, role));
  }

  Stream adopt_stream(void* native, StreamRole role) override {
    std::shared_ptr<HostQueue> q = HostQueue::find(native);
    SPILLWAY_CHECK(q != nullptr,
                   "host device: adopt_stream: {} is not a live host stream (a HostStream's "
                   "native() or a host device's native_stream())",
                   native);
    return add_stream(with_link(StreamSlot{std::move(q), throttle(role), true}, role));
  }

  void destroy_stream(Stream s) override {
    StreamSlot victim;
    {
      std::lock_guard<std::mutex> lock(table_mu_);
      victim = std::move(slot(s));
      slot_reset(s);
    }
    // Pending work completes (like cudaStreamDestroy); an adopted queue lives on with its
    // owner, without this device's work in it (Note [Adopted streams]).
    victim.queue->synchronize();
  }

  Event create_event() override {
    std::lock_guard<std::mutex> lock(table_mu_);
    auto e = std::make_shared<EventState>();
    for (size_t i = 0; i < events_.size(); ++i) {
      if (!events_[i]) {
        events_[i] = std::move(e);
        return Event{static_cast<int>(i)};
      }
    }
    events_.push_back(std::move(e));
    return Event{static_cast<int>(events_.size() - 1)};
  }

  void destroy_event(Event e) override {
    std::lock_guard<std::mutex> lock(table_mu_);
    // Pending ops may still point at it: keep it alive until the device dies.
    retired_events_.push_back(std::move(event_slot(e)));
  }

  void record(Event e, Stream s) override {
    EventState* ev = event(e);
    uint64_t target = 0;
    {
      std::lock_guard<std::mutex> lock(ev->mu);
      target = ++ev->recorded;
    }
    queue(s)->record(ev, target);
  }

  void wait(Stream s, Event e) override {
    auto ev = event(e);
    Op op;
    op.kind = Op::kWait;
    {
      std::lock_guard<std::mutex> lock(ev->mu);
      // Never recorded, or already reached: nothing to wait for, nothing to enqueue.
      if (ev->reached(ev->recorded)) return;
      op.target = ev->recorded;
    }
    op.event = ev;
    queue(s)->push(std::move(op));
  }

  bool query(Event e) override {
    auto ev = event(e);
    std::lock_guard<std::mutex> lock(ev->mu);
    return ev->reached(ev->recorded);
  }

  void synchronize(Event e) override {
    auto ev = event(e);
    std::unique_lock<std::mutex> lock(ev->mu);
    const uint64_t target = ev->recorded;
    ++ev->waiters;
    ev->cv.wait(lock, [&] { return ev->reached(target); });
    --ev->waiters;
  }

  void synchronize(Stream s) override { queue(s)->synchronize(); }

  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    SPILLWAY_CHECK(bytes == 0 || (dst != nullptr && src != nullptr),
                   "copy_async: null pointer for {} bytes", bytes);
    Op op;
    op.kind = Op::kCopy;
    op.dst = dst;
    op.src = src;
    op.bytes = bytes;
    HostQueue* q = nullptr;
    {
      std::lock_guard<std::mutex> lock(table_mu_);
      const StreamSlot& target = slot(s);
      q = target.queue.get();
      op.gbps = target.gbps;
      op.link = target.link;
      op.h2d = target.h2d;
    }
    // Note [Checked rate durations]: refused here, on the caller's thread, not on the worker.
    if (op.link != nullptr) {
      (void)transfer_duration(static_cast<double>(bytes),
                              op.h2d ? op.link->h2d_gbps() : op.link->d2h_gbps());
    } else if (op.gbps > 0.0) {
      op.duration = transfer_duration(static_cast<double>(bytes), op.gbps);
    }
    q->push(std::move(op));
  }

  void host_callback(Stream s, std::function<void()> fn) override {
    Op op;
    op.kind = Op::kCallback;
    op.fn = std::move(fn);
    queue(s)->push(std::move(op));
  }

  void* native_stream(Stream s) override { return queue(s); }

  bool adamw_step(const DeviceAdamW& a, Stream s) override { return device_op(a, s); }
  bool norm_lanes_bf16(const DeviceNormLanes& a, Stream s) override { return device_op(a, s); }
  bool widen_bf16(const DeviceWidenBf16& a, Stream s) override { return device_op(a, s); }

 private:
  void account(MemoryKind kind, int64_t bytes) {
    const int k = static_cast<int>(kind);
    stats_.current[k] += bytes;
    stats_.peak[k] = std::max(stats_.peak[k], stats_.current[k]);
    ++stats_.allocations[k];
  }
  StreamSlot with_link(StreamSlot s, StreamRole role) const {
    if (options_.link && (role == StreamRole::kD2H || role == StreamRole::kH2D)) {
      s.link = options_.link.get();
      s.h2d = role == StreamRole::kH2D;
      s.gbps = 0.0;
    }
    return s;
  }
  double throttle(StreamRole role) const {
    return role == StreamRole::kD2H   ? options_.d2h_gbps
           : role == StreamRole::kH2D ? options_.h2d_gbps
                                      : 0.0;
  }
  Stream add_stream(StreamSlot s) {
    std::lock_guard<std::mutex> lock(table_mu_);
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (!streams_[i]) {
        streams_[i] = std::move(s);
        return Stream{static_cast<int>(i)};
      }
    }
    streams_.push_back(std::move(s));
    return Stream{static_cast<int>(streams_.size() - 1)};
  }
  // Note [Device operations]: checked here, run by the stream's worker (host_ops.cpp).
  template <typename Args>
  bool device_op(const Args& a, Stream s) {
    HostQueue* q = queue(s);
    host_ops::check(a);
    if (a.n == 0) return true;
    Op op;
    op.kind = Op::kDeviceOp;
    op.args = a;
    q->push(std::move(op));
    return true;
  }
  // Callers hold table_mu_.
  StreamSlot& slot(Stream s) {
    SPILLWAY_CHECK(s.id >= 0 && static_cast<size_t>(s.id) < streams_.size() &&
                       streams_[static_cast<size_t>(s.id)],
                   "unknown or destroyed stream {}", s.id);
    return streams_[static_cast<size_t>(s.id)];
  }
  void slot_reset(Stream s) { streams_[static_cast<size_t>(s.id)] = StreamSlot{}; }
  std::shared_ptr<EventState>& event_slot(Event e) {
    SPILLWAY_CHECK(e.id >= 0 && static_cast<size_t>(e.id) < events_.size() &&
                       events_[static_cast<size_t>(e.id)],
                   "unknown or destroyed event {}", e.id);
    return events_[static_cast<size_t>(e.id)];
  }
  // A raw pointer: using a stream while another thread destroys it is misuse (as in
  // CUDA), and skipping the reference count keeps an enqueue cheap.
  HostQueue* queue(Stream s) {
    std::lock_guard<std::mutex> lock(table_mu_);
    return slot(s).queue.get();
  }
  EventState* event(Event e) {
    std::lock_guard<std::mutex> lock(table_mu_);
    return event_slot(e).get();
  }

  HostDeviceOptions options_;
  mutable std::mutex mem_mu_;
  Arena arena_;
  std::byte* base_ = nullptr;
  // Note [Resident arena]: GPU memory is resident once allocated; host memory is not
  // until first touched, and a first-touch page fault costs far more than the copy of
  // the page. So the arena's 2 MiB granules are touched when an allocation first covers
  // them (never again: a touched granule may hold live data), and copies into device
  // memory run at memory speed from the first step, not at page-fault speed.
  std::vector<bool> resident_;
  void make_resident(size_t off, size_t bytes) {
    constexpr size_t kGranule = size_t{2} << 20;
    if (resident_.empty()) resident_.assign(arena_.capacity() / kGranule + 1, false);
    for (size_t g = off / kGranule; g <= (off + bytes - 1) / kGranule; ++g) {
      if (resident_[g]) continue;
      const size_t begin = g * kGranule;
      std::memset(base_ + begin, 0, std::min(kGranule, arena_.capacity() - begin));
      resident_[g] = true;
    }
  }
  std::unordered_map<void*, std::pair<MemoryKind, size_t>> host_allocs_;
  MemoryStats stats_;
  std::mutex table_mu_;
  std::vector<StreamSlot> streams_;
  std::vector<std::shared_ptr<EventState>> events_;
  std::vector<std::shared_ptr<EventState>> retired_events_;
};

}  // namespace

std::chrono::steady_clock::duration transfer_duration(double bytes, double gbps) {
  if (!(gbps > 0.0) || !std::isfinite(gbps))
    SPILLWAY_FIELD_ERROR("gbps", gbps, "must be a finite rate > 0 (moving {:.0f} bytes)", bytes);
  const double s = bytes / (gbps * 1e9);
  if (!(s >= 0.0) || !std::isfinite(s) || s > kMaxRateSeconds)
    SPILLWAY_FIELD_ERROR("gbps", gbps,
                         "{:.0f} bytes at this rate take {:.3g} s, more than the {:.0f} s one "
                         "emulated transfer may take (Note [Checked rate durations])",
                         bytes, s, kMaxRateSeconds);
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(s));
}

std::chrono::steady_clock::duration checked_duration_ms(double ms, const char* what) {
  if (!(ms >= 0.0) || !std::isfinite(ms) || ms > kMaxRateSeconds * 1e3)
    SPILLWAY_FIELD_ERROR(what, fmt::format("{:.6g} ms", ms),
                         "must be a finite time in [0, {:.0f} s] (Note [Checked rate durations])",
                         kMaxRateSeconds);
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double, std::milli>(ms));
}

namespace {
void check_link_gbps(double h2d_gbps, double d2h_gbps) {
  if (!(h2d_gbps >= kMinThrottleGbps) || !std::isfinite(h2d_gbps))
    SPILLWAY_FIELD_ERROR("h2d_gbps", h2d_gbps, "must be in [{}, inf) (a shared link)",
                         kMinThrottleGbps);
  if (!(d2h_gbps >= kMinThrottleGbps) || !std::isfinite(d2h_gbps))
    SPILLWAY_FIELD_ERROR("d2h_gbps", d2h_gbps, "must be in [{}, inf) (a shared link)",
                         kMinThrottleGbps);
}
}  // namespace

HostLink::HostLink(double h2d_gbps, double d2h_gbps) : gbps_{h2d_gbps, d2h_gbps} {
  check_link_gbps(h2d_gbps, d2h_gbps);
}

void HostLink::set_gbps(double h2d_gbps, double d2h_gbps) {
  check_link_gbps(h2d_gbps, d2h_gbps);
  gbps_[0].store(h2d_gbps, std::memory_order_relaxed);
  gbps_[1].store(d2h_gbps, std::memory_order_relaxed);
}

std::chrono::steady_clock::time_point HostLink::book(bool h2d, size_t bytes,
                                                     std::chrono::steady_clock::time_point start) {
  const int d = h2d ? 0 : 1;
  const auto duration =
      transfer_duration(static_cast<double>(bytes), gbps_[d].load(std::memory_order_relaxed));
  std::lock_guard<std::mutex> lock(mu_);
  const auto begin = std::max(start, deadline_[d]);
  deadline_[d] = begin + duration;
  booked_[d] += static_cast<int64_t>(bytes);
  return deadline_[d];
}

int64_t HostLink::h2d_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return booked_[0];
}
int64_t HostLink::d2h_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return booked_[1];
}

std::unique_ptr<Device> make_host_device(const HostDeviceOptions& options) {
  return std::make_unique<Device>(std::make_unique<HostDevice>(options));
}

}  // namespace spillway

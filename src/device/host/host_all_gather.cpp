// The host backend's all-gather (Note [Device groups], spillway/device/device.hpp): N emulated
// devices of one process gather in place. Each rank's call enqueues, on its stream, one
// host callback that meets the other ranks' callbacks of the same call (a rendezvous),
// copies their parts out of their buffers into its own, and meets them again, so that no
// rank's stream goes on (and may overwrite its part) while a peer still reads it.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"

namespace spillway {
namespace {

// Calls enqueued and not yet run, per rank (a caller such as the weight streamer keeps a
// bounded number in flight); the rounds reuse the same slots.
constexpr int kSlots = 128;

struct Group {
  int n = 0;
  double peer_gbps = 0.0;
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;  // AllGather::abort: every wait gives up
  struct Round {
    std::vector<void*> buffer;  // per rank
    size_t bytes = 0;
    int64_t arrived = 0;  // monotonic: N per use of the slot
    int64_t left = 0;
  };
  Round rounds[kSlots];
};

class HostAllGather final : public AllGather {
 public:
  HostAllGather(std::shared_ptr<Group> g, Device* dev, int rank)
      : group_(std::move(g)), dev_(dev), rank_(rank) {
    for (Job& j : jobs_) j.self = this;
  }
  int rank() const override { return rank_; }
  int ranks() const override { return group_->n; }

  void abort() override {
    std::lock_guard<std::mutex> lock(group_->mu);
    group_->aborted = true;
    group_->cv.notify_all();
  }

  void all_gather_in_place(void* buffer, size_t bytes, Stream s) override {
    SPILLWAY_CHECK(buffer != nullptr || bytes == 0, "all_gather: null buffer for {} bytes", bytes);
    const int64_t seq = calls_;
    SPILLWAY_CHECK(seq - ran_.load(std::memory_order_acquire) < kSlots,
                   "all_gather: more than {} calls in flight on rank {}", kSlots, rank_);
    ++calls_;
    Job& j = jobs_[seq % kSlots];
    j.seq = seq;
    j.buffer = buffer;
    j.bytes = bytes;
    dev_->host_callback(s, [jp = &j] { jp->self->run(*jp); });
  }

 private:
  struct Job {
    HostAllGather* self = nullptr;
    int64_t seq = 0;
    void* buffer = nullptr;
    size_t bytes = 0;
  };

  void run(const Job& j) {
    Group& g = *group_;
    Group::Round& r = g.rounds[j.seq % kSlots];
    const int64_t use = j.seq / kSlots + 1;  // this slot's use number
    {
      std::unique_lock<std::mutex> lock(g.mu);
      // The slot's previous round must be over for every rank before it is reused.
      g.cv.wait(lock, [&] { return g.aborted || r.left >= (use - 1) * g.n; });
      if (g.aborted) {
        ran_.fetch_add(1, std::memory_order_release);
        return;
      }
      if (r.arrived == (use - 1) * g.n) r.bytes = j.bytes;
      SPILLWAY_CHECK(r.bytes == j.bytes, "all_gather: rank {} gathers {} bytes, a peer {}", rank_,
                     j.bytes, r.bytes);
      r.buffer[static_cast<size_t>(rank_)] = j.buffer;
      ++r.arrived;
      g.cv.notify_all();
      g.cv.wait(lock, [&] { return g.aborted || r.arrived >= use * g.n; });
      if (g.aborted) {
        ran_.fetch_add(1, std::memory_order_release);
        return;
      }
    }
    const auto start = std::chrono::steady_clock::now();
    auto* mine = static_cast<std::byte*>(j.buffer);
    for (int q = 0; q < g.n; ++q) {
      if (q == rank_) continue;
      const auto off = static_cast<size_t>(q) * j.bytes;
      std::memcpy(mine + off, static_cast<const std::byte*>(r.buffer[static_cast<size_t>(q)]) + off,
                  j.bytes);
    }
    if (g.peer_gbps > 0.0) {
      const double secs = static_cast<double>(j.bytes) * (g.n - 1) / (g.peer_gbps * 1e9);
      std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                std::chrono::duration<double>(secs)));
    }
    std::unique_lock<std::mutex> lock(g.mu);
    ++r.left;
    g.cv.notify_all();
    g.cv.wait(lock, [&] { return g.aborted || r.left >= use * g.n; });  // peers read my part
    ran_.fetch_add(1, std::memory_order_release);
  }

  std::shared_ptr<Group> group_;
  Device* dev_;
  int rank_;
  int64_t calls_ = 0;            // the caller's thread
  std::atomic<int64_t> ran_{0};  // the stream's thread
  Job jobs_[kSlots];
};

}  // namespace

std::vector<std::unique_ptr<AllGather>> make_host_all_gather(const std::vector<Device*>& devices,
                                                             double peer_gbps) {
  if (devices.empty()) SPILLWAY_FIELD_ERROR("devices", 0, "must be >= 1 (one per rank)");
  if (peer_gbps < 0.0)
    SPILLWAY_FIELD_ERROR("peer_gbps", peer_gbps, "must be >= 0 (0: no throttle)");
  auto g = std::make_shared<Group>();
  g->n = static_cast<int>(devices.size());
  g->peer_gbps = peer_gbps;
  for (Group::Round& r : g->rounds) r.buffer.assign(devices.size(), nullptr);
  std::vector<std::unique_ptr<AllGather>> out;
  for (size_t i = 0; i < devices.size(); ++i) {
    SPILLWAY_CHECK(devices[i] != nullptr && devices[i]->emulated(),
                   "make_host_all_gather: rank {} is not a host device", i);
    out.push_back(std::make_unique<HostAllGather>(g, devices[i], static_cast<int>(i)));
  }
  return out;
}

}  // namespace spillway

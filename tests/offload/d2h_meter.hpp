// A Device that measures the D2H bytes the link has queued, independently of the offload
// engine's own accounting: a copy counts from its enqueue until a callback right after it
// on the same stream (so it stops counting no later than the engine's event completes).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "forwarding_device.hpp"

namespace spillway::testing {

class D2HMeter final : public ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  Stream create_stream(StreamRole role, int priority) override {
    const Stream s = inner().create_stream(role, priority);
    if (role == StreamRole::kD2H) d2h_ = s.id;
    return s;
  }
  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    if (s.id == d2h_) {
      const int64_t now = inflight_ += static_cast<int64_t>(bytes);
      max_inflight_ = std::max(max_inflight_, now);
    }
    inner().copy_async(dst, src, bytes, s);
    if (s.id == d2h_) {
      std::atomic<int64_t>* f = &inflight_;
      inner().host_callback(s, [f, bytes] { *f -= static_cast<int64_t>(bytes); });
    }
  }
  // The most D2H bytes queued at once, as seen at each enqueue (the calling thread's).
  int64_t max_inflight() const { return max_inflight_; }

 private:
  int d2h_ = -1;
  std::atomic<int64_t> inflight_{0};
  int64_t max_inflight_ = 0;
};

}  // namespace spillway::testing

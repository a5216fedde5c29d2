// A Device whose compute and copies run on a clock the test owns, so that whether a copy
// fits its window is decided by the test's numbers, never by the machine's scheduler.
//
// Note [A virtual clock for windows]: an engine's verdicts that compare copies with
// compute (end_forward_layer's window test, make_room's "did compute run dry during the
// back-pressure wait", Note [Back-pressure and the snowball]) depend, on the throttled
// host backend, on how the copy thread and the sleeping compute are scheduled: on a
// loaded machine a copy thread descheduled for 20 ms makes a false snowball. This
// wrapper replaces wall time by a virtual one:
//   - every stream made or adopted through it has a tail, the virtual time its work
//     enqueued so far ends; a kernel (kernel()) of `ms` enqueued at virtual time `now`
//     ends at max(now, tail) + ms, a copy on a throttled stream at max(now, tail) +
//     bytes / B; a record gives its event the stream's tail, a wait raises the waiting
//     stream's tail to the event's time (stream order and events, as on the device);
//   - each kernel and throttled copy is held by a gate on its stream (a host callback
//     that blocks the stream's worker) until the virtual clock reaches its end;
//   - the clock only moves when the host waits: synchronize(event or stream) advances it
//     to the time that work ends, and returns once every op due by then has really run;
//   - query() first settles (the same "every op due by now has really run"), so its
//     answer is whether the event's virtual time has been reached: an event recorded just
//     after a gate opened is never seen incomplete because its worker had not got to it
//     yet (the record-then-query race), and an event after a closed gate is never
//     complete, however the threads are scheduled.
// The host's own work takes no virtual time. Every op forwarded to the inner device (an
// unthrottled host device) moves the real bytes in the real order, so data checks still
// hold. A marker after each op counts what has run; the wrapper never changes what the
// engine enqueues, only when it may complete.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "forwarding_device.hpp"

namespace spillway::testing {

class VirtualClockDevice final : public ForwardingDevice {
 public:
  // `inner`: an unthrottled device. Copies on D2H (H2D) streams take bytes / d2h_gbps
  // (h2d_gbps) of virtual time; 0: none.
  VirtualClockDevice(Device& inner, double d2h_gbps, double h2d_gbps = 0.0)
      : ForwardingDevice(inner), d2h_gbps_(d2h_gbps), h2d_gbps_(h2d_gbps) {}
  ~VirtualClockDevice() override {
    // Opens every gate, and waits for the markers that name this wrapper.
    advance(std::numeric_limits<double>::infinity());
  }

  // A kernel of `ms` virtual ms on `s` (then `fn`, stream-ordered, when it ends).
  void kernel(Stream s, double ms, std::function<void()> fn = {}) { gated(s, ms, std::move(fn)); }
  double now_ms() const {
    std::lock_guard<std::mutex> lk(mu_);
    return now_;
  }

  Stream create_stream(StreamRole role, int priority) override {
    return track(inner().create_stream(role, priority), role);
  }
  Stream adopt_stream(void* native, StreamRole role) override {
    return track(inner().adopt_stream(native, role), role);
  }
  void destroy_stream(Stream s) override {
    synchronize(s);  // the inner device waits for the stream's work: none may be gated
    {
      std::lock_guard<std::mutex> lk(mu_);
      streams_.erase(s.id);
    }
    inner().destroy_stream(s);
  }
  void record(Event e, Stream s) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      event_ms_[e.id] = state(s).tail;
    }
    inner().record(e, s);
    mark(s);
  }
  void wait(Stream s, Event e) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      StreamState& st = state(s);
      st.tail = std::max(st.tail, event_time(e));
    }
    inner().wait(s, e);
    mark(s);
  }
  bool query(Event e) override {
    settle();
    return inner().query(e);
  }
  void synchronize(Event e) override {
    double t = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      t = event_time(e);
    }
    advance(t);
    inner().synchronize(e);
  }
  void synchronize(Stream s) override {
    double t = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      t = state(s).tail;
    }
    advance(t);
    inner().synchronize(s);
  }
  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    double gbps = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      const StreamRole role = state(s).role;
      gbps = role == StreamRole::kD2H ? d2h_gbps_ : role == StreamRole::kH2D ? h2d_gbps_ : 0.0;
    }
    if (gbps > 0) gated(s, static_cast<double>(bytes) / (gbps * 1e6), {});
    inner().copy_async(dst, src, bytes, s);
    mark(s);
  }
  void host_callback(Stream s, std::function<void()> fn) override {
    const int64_t seq = enqueue(s, 0.0, /*gate=*/false);
    inner().host_callback(s, [this, id = s.id, seq, fn = std::move(fn)] {
      fn();
      done(id, seq);
    });
  }

 private:
  struct StreamState {
    StreamRole role = StreamRole::kCompute;
    double tail = 0;             // virtual time its work enqueued so far ends
    std::vector<double> due_ms;  // per op enqueued, its virtual end (non-decreasing)
    int64_t ran = 0;             // ops that have really run (markers)
  };

  Stream track(Stream s, StreamRole role) {
    std::lock_guard<std::mutex> lk(mu_);
    streams_[s.id] = StreamState{role, now_, {}, 0};
    return s;
  }
  StreamState& state(Stream s) {  // under mu_
    auto it = streams_.find(s.id);
    if (it == streams_.end()) it = streams_.emplace(s.id, StreamState{}).first;
    return it->second;
  }
  double event_time(Event e) const {  // under mu_; never recorded: complete
    const auto it = event_ms_.find(e.id);
    return it == event_ms_.end() ? 0.0 : it->second;
  }
  // Books an op on `s` taking `ms` from max(now, tail); returns its sequence number.
  int64_t enqueue(Stream s, double ms, bool gate, double* end = nullptr) {
    std::lock_guard<std::mutex> lk(mu_);
    StreamState& st = state(s);
    if (gate) st.tail = std::max(st.tail, now_) + ms;
    st.due_ms.push_back(st.tail);
    if (end != nullptr) *end = st.tail;
    return static_cast<int64_t>(st.due_ms.size());
  }
  void gated(Stream s, double ms, std::function<void()> fn) {
    double end = 0;
    const int64_t seq = enqueue(s, ms, /*gate=*/true, &end);
    inner().host_callback(s, [this, id = s.id, seq, end, fn = std::move(fn)] {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return now_ >= end; });
      }
      if (fn) fn();
      done(id, seq);
    });
  }
  void mark(Stream s) {  // after an op forwarded to the inner device
    const int64_t seq = enqueue(s, 0.0, /*gate=*/false);
    inner().host_callback(s, [this, id = s.id, seq] { done(id, seq); });
  }
  void done(int id, int64_t seq) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      StreamState& st = streams_[id];
      st.ran = std::max(st.ran, seq);
    }
    cv_.notify_all();
  }
  // The host waits until virtual time t: the gates due by then open, and it returns once
  // every op due by then has run.
  void advance(double t) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      now_ = std::max(now_, t);
    }
    cv_.notify_all();
    settle();
  }
  void settle() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] {
      for (const auto& [id, st] : streams_) {
        const auto due = std::upper_bound(st.due_ms.begin(), st.due_ms.end(), now_);
        if (st.ran < due - st.due_ms.begin()) return false;
      }
      return true;
    });
  }

  const double d2h_gbps_;
  const double h2d_gbps_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  double now_ = 0;
  std::unordered_map<int, StreamState> streams_;
  std::unordered_map<int, double> event_ms_;
};

}  // namespace spillway::testing

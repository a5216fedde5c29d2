// The host backend's streams (host_device.cpp): each a queue of ops run in order by its
// worker thread (detail::HostQueue), and the events its ops record and wait on. The queue
// itself is host_queue.cpp's; the device that enqueues on it, host_device.cpp's.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <variant>
#include <vector>

#include "spillway/device/device.hpp"

namespace spillway::detail {

// Note [Event targets]: each record of an event gets the next target; a wait captures the
// latest target at the time it is called and is released when that record completes, not
// a later one. Records on one stream complete in order; records of one event on several
// streams can complete out of order, and those early ones are kept aside (rare: a small
// list) so that a waiter on an earlier record is never released early.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;        // target of the latest record
  uint64_t completed = 0;       // every target up to this one has completed
  std::vector<uint64_t> early;  // completed targets above completed + 1
  int waiters = 0;              // threads blocked on cv (Note [Host stream wake-ups])

  // Callers hold mu.
  bool reached(uint64_t target) const {
    return target <= completed || std::find(early.begin(), early.end(), target) != early.end();
  }
  // Returns whether a waiter may have been released.
  bool complete(uint64_t target) {
    if (target != completed + 1) {
      early.push_back(target);
      return waiters > 0;
    }
    completed = target;
    for (auto it = std::find(early.begin(), early.end(), completed + 1); it != early.end();
         it = std::find(early.begin(), early.end(), completed + 1)) {
      early.erase(it);
      ++completed;
    }
    return waiters > 0;
  }
};

// Note [Host stream ops]: an op is a small struct (copy, record, wait, callback, device
// operation), so enqueueing one allocates nothing but the queue's amortized growth.
struct Op {
  enum Kind { kCopy, kRecord, kWait, kCallback, kDeviceOp } kind = kCopy;
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
  double gbps = 0.0;  // a copy's throttle (0: none), the device's for the stream's role
  std::chrono::steady_clock::duration duration{};  // bytes at gbps (Note [Checked rate durations])
  HostLink* link = nullptr;     // or the shared link's (Note [Shared host links])
  bool h2d = false;             // the link's direction
  EventState* event = nullptr;  // alive until the device dies (destroyed ones too)
  uint64_t target = 0;
  std::function<void()> fn;
  std::variant<DeviceAdamW, DeviceNormLanes, DeviceWidenBf16> args;  // a device operation's
};

// A FIFO of ops in one growable ring: unlike std::deque, which allocates and frees a
// chunk every few elements, it allocates only when it grows (never in steady state).
class OpRing {
 public:
  bool empty() const { return size_ == 0; }
  void push(Op op) {
    if (size_ == ring_.size()) grow();
    ring_[(head_ + size_) % ring_.size()] = std::move(op);
    ++size_;
  }
  Op pop() {
    Op op = std::move(ring_[head_]);
    ring_[head_] = Op{};  // drop what the op held (a callback's captures)
    head_ = (head_ + 1) % ring_.size();
    --size_;
    return op;
  }

 private:
  void grow() {
    std::vector<Op> bigger(std::max<size_t>(64, ring_.size() * 2));
    for (size_t i = 0; i < size_; ++i) bigger[i] = std::move(ring_[(head_ + i) % ring_.size()]);
    ring_ = std::move(bigger);
    head_ = 0;
  }
  std::vector<Op> ring_;
  size_t head_ = 0;
  size_t size_ = 0;
};

// Completes `target` of `e` now if every earlier record of it has completed (so that the
// caller's stream, idle, adds nothing after them; Note [Idle record]).
inline bool complete_in_order(EventState* e, uint64_t target) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    if (e->completed + 1 != target) return false;
    wake = e->complete(target);
  }
  if (wake) e->cv.notify_all();
  return true;
}

// One stream's queue and its worker. Made by HostQueue::create only, so that it is in the
// registry for its whole life (Note [Host stream registry]).
class HostQueue {
 public:
  // `inline_work`: Note [Inline host streams].
  static std::shared_ptr<HostQueue> create(bool inline_work = false);
  ~HostQueue();
  HostQueue(const HostQueue&) = delete;
  HostQueue& operator=(const HostQueue&) = delete;

  // Note [Host stream wake-ups]: the condition variables are signalled only when a thread
  // sleeps on them, so a busy stream costs a lock and a push per op, no system call.
  void push(Op op) {
    if (inline_) {
      run_inline(op);
      return;
    }
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push(std::move(op));
      ++enqueued_;
      pushed_.store(enqueued_, std::memory_order_release);
      wake = worker_sleeping_;
      worker_sleeping_ = false;  // one notification per sleep, not one per op pushed
    }
    if (wake) cv_.notify_one();
  }

  // Records `target` of `event` at the end of this stream's queue. Note [Idle record]:
  // when the stream has nothing pending and no earlier record of the event is pending,
  // the event completes here, on the caller's thread: no op, no wake-up of the worker (as
  // an event recorded on an idle CUDA stream completes at once).
  void record(EventState* event, uint64_t target) {
    if (inline_) {  // everything enqueued before has run: the record completes now
      Op op;
      op.kind = Op::kRecord;
      op.event = event;
      op.target = target;
      run_inline(op);
      return;
    }
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_ == enqueued_ && complete_in_order(event, target)) return;
      Op op;
      op.kind = Op::kRecord;
      op.event = event;
      op.target = target;
      queue_.push(std::move(op));
      ++enqueued_;
      pushed_.store(enqueued_, std::memory_order_release);
      wake = worker_sleeping_;
      worker_sleeping_ = false;
    }
    if (wake) cv_.notify_one();
  }

  void synchronize() {
    if (inline_) return;  // nothing is ever pending
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = enqueued_;
    ++sync_waiters_;
    done_cv_.wait(lock, [&] { return done_ >= target; });
    --sync_waiters_;
  }

  // Looks `native` up among the live queues; null when it is none of them.
  static std::shared_ptr<HostQueue> find(const void* native);

 private:
  explicit HostQueue(bool inline_work) : inline_(inline_work) {
    if (!inline_) worker_ = std::thread([this] { run(); });
  }

  // Note [Inline host streams] (host_queue.cpp).
  void run_inline(Op& op);
  // The worker (Note [Host stream spin]) and an op run (host_queue.cpp).
  void run();
  void execute(Op& op);
  std::chrono::steady_clock::time_point deadline_{};  // worker thread only
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  OpRing queue_;
  uint64_t enqueued_ = 0;
  uint64_t done_ = 0;
  int sync_waiters_ = 0;
  bool worker_sleeping_ = false;
  std::atomic<uint64_t> pushed_{0};  // enqueued_, for the worker's spin without the lock
  bool stop_ = false;
  const bool inline_;
  std::thread worker_;  // last: starts after the members it uses (none when inline)
};

}  // namespace spillway::detail

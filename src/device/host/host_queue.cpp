// The host backend's stream queues (host_queue.hpp): a queue's worker and what it runs
// (copies throttled to a bandwidth, records, waits, callbacks, device operations), the
// registry of live queues, and HostStream, a queue made by a caller.
#include "device/host/host_queue.hpp"

#include <cstring>
#include <unordered_map>

#include "device/host/host_ops.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"
#include "spillway/device/device_backend.hpp"

namespace spillway {
namespace detail {

// Pieces a throttled copy lands in (Note [Throttled copies land as they stream]).
constexpr size_t kCopyChunks = 16;

// Note [Inline host streams]: the work of an inline queue runs on the thread that
// enqueues it, at once: a wait blocks that thread until its event completes, a record
// completes, a copy is done when the call returns. It is the host twin of a CPU
// framework's "stream" (PyTorch runs CPU ops on the calling thread), so that an engine
// adopting it orders its work against the caller's by the same calls it uses on a GPU,
// with no worker thread to hand work to and no round trip to wait for. One thread at a
// time enqueues on it (the caller's).
void HostQueue::run_inline(Op& op) {
  execute(op);
  std::lock_guard<std::mutex> lock(mu_);
  ++enqueued_;
  ++done_;
}

void HostQueue::run() {
  uint64_t popped = 0;  // ops taken from the queue
  for (;;) {
    Op op;
    // Note [Host stream spin]: an idle worker watches the queue for up to 50 us (yielding
    // its core to any runnable thread) before it sleeps: work enqueued op by op, a
    // framework's saved tensors microseconds apart, then costs its producer no wake-up
    // system call (bench_hooks.py: 8.5-8.8 us per saved tensor with the spin, 11.9-12.2
    // without, same machine). An idle stream sleeps after the 50 us as before.
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
    while (pushed_.load(std::memory_order_acquire) == popped &&
           std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    {
      std::unique_lock<std::mutex> lock(mu_);
      worker_sleeping_ = true;
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      worker_sleeping_ = false;
      if (queue_.empty()) return;  // stop requested and drained
      op = queue_.pop();
      ++popped;
    }
    execute(op);
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++done_;
      wake = sync_waiters_ > 0;
    }
    if (wake) done_cv_.notify_all();
  }
}

void HostQueue::execute(Op& op) {
  switch (op.kind) {
    case Op::kCopy: {
      // The throttle is a schedule, not a per-copy sleep: each copy ends no earlier than
      // max(its start, the previous copy's deadline) + n / B, so wake-up lateness does
      // not accumulate over back-to-back copies. Note [Throttled copies land as they
      // stream]: within its slot [end - n / B, end] the copy moves its bytes in
      // kCopyChunks pieces, each when its share of the slot begins, and the op ends at
      // the slot's end: the last bytes land in the copy's last 1/kCopyChunks, as a real
      // copy's do, so a reader that does not wait for the copy's event reads a stale
      // tail (the tests of every engine's ordering rely on it), and the copy takes
      // max(n / B, the memcpy) rather than their sum.
      const auto start = std::chrono::steady_clock::now();
      double gbps = 0.0;
      std::chrono::steady_clock::time_point end = start;
      if (op.link != nullptr) {
        gbps = op.h2d ? op.link->h2d_gbps() : op.link->d2h_gbps();
        end = op.link->book(op.h2d, op.bytes, start);
      } else if (op.gbps > 0.0) {
        gbps = op.gbps;
        end = std::max(start, deadline_) + op.duration;
        deadline_ = end;
      }
      const auto* src = static_cast<const std::byte*>(op.src);
      auto* dst = static_cast<std::byte*>(op.dst);
      const bool overlap = dst < src + op.bytes && src < dst + op.bytes;
      if (gbps <= 0.0 || overlap || op.bytes < kCopyChunks) {
        if (gbps > 0.0) std::this_thread::sleep_until(end);
        if (op.bytes > 0) std::memmove(op.dst, op.src, op.bytes);
        break;
      }
      // Checked when the copy was enqueued: cannot throw here.
      const auto slot =
          op.link != nullptr ? transfer_duration(static_cast<double>(op.bytes), gbps) : op.duration;
      const auto begin = end - slot;
      const size_t chunk = (op.bytes + kCopyChunks - 1) / kCopyChunks;
      for (size_t off = 0; off < op.bytes; off += chunk) {
        std::this_thread::sleep_until(
            begin + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        slot * (static_cast<double>(off) / static_cast<double>(op.bytes))));
        std::memcpy(dst + off, src + off, std::min(chunk, op.bytes - off));
      }
      std::this_thread::sleep_until(end);
      break;
    }
    case Op::kRecord: {
      bool wake = false;
      {
        std::lock_guard<std::mutex> lock(op.event->mu);
        wake = op.event->complete(op.target);
      }
      if (wake) op.event->cv.notify_all();
      break;
    }
    case Op::kWait: {
      std::unique_lock<std::mutex> lock(op.event->mu);
      ++op.event->waiters;
      op.event->cv.wait(lock, [&] { return op.event->reached(op.target); });
      --op.event->waiters;
      break;
    }
    case Op::kCallback:
      op.fn();
      break;
    case Op::kDeviceOp:
      std::visit([](const auto& a) { host_ops::run(a); }, op.args);
      break;
  }
}

namespace {

// Note [Host stream registry]: every live queue by its address. adopt_stream takes a void*
// (as CUDA takes a cudaStream_t); the registry tells a host stream from any other pointer
// without dereferencing it, and hands out shared ownership, so that a queue adopted by a
// device outlives the HostStream that made it until the device forgets it. Never
// destroyed: a queue may die during static destruction.
struct QueueRegistry {
  std::mutex mu;
  std::unordered_map<const void*, std::weak_ptr<HostQueue>> live;
};
QueueRegistry& registry() {
  static auto* r = new QueueRegistry;
  return *r;
}

}  // namespace

std::shared_ptr<HostQueue> HostQueue::create(bool inline_work) {
  std::shared_ptr<HostQueue> q(new HostQueue(inline_work));
  QueueRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.live[q.get()] = q;
  return q;
}

std::shared_ptr<HostQueue> HostQueue::find(const void* native) {
  QueueRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto it = r.live.find(native);
  return it == r.live.end() ? nullptr : it->second.lock();
}

// Pending work still runs: the worker stops once the queue is drained.
HostQueue::~HostQueue() {
  {
    QueueRegistry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.live.erase(this);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

}  // namespace detail

using detail::Op;

HostStream::HostStream(Mode mode) : queue_(detail::HostQueue::create(mode == Mode::kInline)) {}
HostStream::~HostStream() = default;

void HostStream::launch(std::function<void()> fn) {
  SPILLWAY_CHECK(static_cast<bool>(fn), "host stream: launch of an empty function");
  Op op;
  op.kind = Op::kCallback;
  op.fn = std::move(fn);
  queue_->push(std::move(op));
}

void HostStream::synchronize() {
  queue_->synchronize();
}

void* HostStream::native() const {
  return queue_.get();
}

}  // namespace spillway

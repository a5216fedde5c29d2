// The pinned host pool: page-locked host memory allocated once, in a few large slabs,
// and sub-allocated with no system call in steady state (docs/offload.md: pageable
// memory makes cudaMemcpyAsync synchronous, and pinning per tensor costs milliseconds).
//
// Thread-safe (one mutex around the slabs' arenas; the critical section is a map lookup).
// Exhaustion is a value: acquire() returns an empty block and the caller applies
// back-pressure (waits for releases) or falls back (e.g. recompute); it never crashes and
// never drops data. When libnuma reports more than one node, the slabs are bound to the
// requested node (the GPU's), else to the node of the calling thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "spillway/device/device.hpp"

namespace spillway {

// The NUMA nodes libnuma reports (`spillway doctor`): the pinned pool binds its slabs to
// a node only when there are several. A value: a machine without NUMA support is an answer.
struct NumaInfo {
  bool available = false;  // numa_available() succeeded
  int nodes = 1;           // configured nodes (1 when not available)
  std::string note;        // why not available, e.g. "libnuma: numa_available() < 0 (...)"
};
NumaInfo numa_info();

struct PinnedBlock {
  void* ptr = nullptr;
  size_t bytes = 0;  // as requested
  int slab = -1;
  size_t offset = 0;
  explicit operator bool() const { return ptr != nullptr; }
};

struct PinnedPoolOptions {
  int64_t bytes = int64_t{1} << 30;  // total capacity
  int slabs = 4;                     // allocated up front
  MemoryKind kind = MemoryKind::kPinnedHost;
  int numa_node = -1;  // -1: the calling thread's node (only with > 1 node)
};

class PinnedPool {
 public:
  // Allocates every slab now; throws spillway::Error naming the size when the device
  // cannot provide them.
  PinnedPool(Device& device, const PinnedPoolOptions& options);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A block of `bytes`, or an empty block when no slab has room right now.
  PinnedBlock acquire(size_t bytes);
  void release(const PinnedBlock& block);
  // Whether `block` is one acquire() handed out and release() has not taken back since
  // (a caller's check before it queues a release: a second one is caught on its thread).
  bool acquired(const PinnedBlock& block) const;

  int64_t capacity() const { return capacity_; }
  int64_t used() const;
  int64_t peak_used() const;
  int64_t failed_acquires() const;
  bool numa_bound() const { return numa_bound_; }

 private:
  struct Slab;  // one allocation carved by a best-fit arena (pinned_pool.cpp)
  Device& device_;
  MemoryKind kind_;
  int64_t capacity_ = 0;
  bool numa_bound_ = false;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Slab>> slabs_;
  int64_t used_ = 0;
  int64_t peak_ = 0;
  int64_t failed_ = 0;
  // Note [Block cache]: released blocks are kept by rounded size and handed out again for
  // the same size without touching the arenas (no map update, no malloc): a training loop
  // asks for the same sizes every step. When the arenas cannot serve a request, the cache
  // goes back to them first (they coalesce) and the request is retried.
  std::unordered_map<size_t, std::vector<PinnedBlock>> cache_;
  void flush_cache();
};

}  // namespace spillway

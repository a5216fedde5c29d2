// The pinned host pool (see pinned_pool.hpp).
#include <numa.h>
#include <numaif.h>
#include <sched.h>

#include <algorithm>

#include "core/arena.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"
#include "spillway/memory/memory.hpp"

namespace spillway {

struct PinnedPool::Slab {
  void* base = nullptr;
  Arena arena;
  // One bit per alignment unit: set while a block starting there is in the cache, so a
  // double release is caught (the arena would have caught it; the cache must too).
  std::vector<bool> cached;
  explicit Slab(size_t bytes) : arena(bytes), cached(bytes / Arena::kAlignment + 1, false) {}
};

namespace {

// Binds [p, p + bytes) to `node` when the machine has more than one NUMA node.
bool bind_to_node(void* p, size_t bytes, int node) {
  if (numa_available() < 0 || numa_num_configured_nodes() <= 1) return false;
  if (node < 0) node = numa_node_of_cpu(sched_getcpu());
  if (node < 0) return false;
  numa_tonode_memory(p, bytes, node);
  return true;
}

}  // namespace

NumaInfo numa_info() {
  NumaInfo info;
  if (numa_available() < 0) {
    info.note =
        "libnuma: numa_available() < 0 (the kernel has no NUMA support, or it is not exposed "
        "here)";
    return info;
  }
  info.available = true;
  info.nodes = numa_num_configured_nodes();
  return info;
}

PinnedPool::PinnedPool(Device& device, const PinnedPoolOptions& o)
    : device_(device), kind_(o.kind) {
  if (o.bytes <= 0) SPILLWAY_INPUT_ERROR("pinned pool: size is {} bytes; must be > 0", o.bytes);
  if (o.slabs < 1) SPILLWAY_INPUT_ERROR("pinned pool: {} slabs; must be >= 1", o.slabs);
  const size_t per_slab =
      (static_cast<size_t>(o.bytes) / static_cast<size_t>(o.slabs) + Arena::kAlignment - 1) /
      Arena::kAlignment * Arena::kAlignment;
  for (int i = 0; i < o.slabs; ++i) {
    auto slab = std::make_unique<Slab>(per_slab);
    const AllocResult a = device_.allocate(per_slab, kind_);
    if (!a) {
      for (auto& s : slabs_) device_.free(s->base, kind_);
      SPILLWAY_INPUT_ERROR("pinned pool: cannot allocate slab {} of {} ({}): {}", i + 1, o.slabs,
                           to_string(Bytes(static_cast<int64_t>(per_slab))), a.reason);
    }
    slab->base = a.ptr;
    numa_bound_ = bind_to_node(a.ptr, per_slab, o.numa_node) || numa_bound_;
    capacity_ += static_cast<int64_t>(slab->arena.capacity());
    slabs_.push_back(std::move(slab));
  }
}

PinnedPool::~PinnedPool() {
  SPILLWAY_CHECK_WARN(used_ == 0, "pinned pool destroyed with {} bytes still acquired", used_);
  flush_cache();
  for (auto& s : slabs_) device_.free(s->base, kind_);
}

namespace {
size_t rounded(size_t bytes) {
  return (std::max<size_t>(bytes, 1) + Arena::kAlignment - 1) / Arena::kAlignment *
         Arena::kAlignment;
}
}  // namespace

void PinnedPool::flush_cache() {
  for (auto& [size, blocks] : cache_) {
    for (const PinnedBlock& b : blocks) {
      Slab& s = *slabs_[static_cast<size_t>(b.slab)];
      s.cached[b.offset / Arena::kAlignment] = false;
      s.arena.free(b.offset);
    }
    blocks.clear();
  }
}

PinnedBlock PinnedPool::acquire(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t size = rounded(bytes);
  if (auto it = cache_.find(size); it != cache_.end() && !it->second.empty()) {
    PinnedBlock b = it->second.back();
    slabs_[static_cast<size_t>(b.slab)]->cached[b.offset / Arena::kAlignment] = false;
    it->second.pop_back();
    b.bytes = bytes;
    used_ += static_cast<int64_t>(size);
    peak_ = std::max(peak_, used_);
    return b;
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (size_t i = 0; i < slabs_.size(); ++i) {
      Slab& s = *slabs_[i];
      const std::optional<size_t> off = s.arena.allocate(bytes);
      if (!off) continue;
      used_ += static_cast<int64_t>(size);
      peak_ = std::max(peak_, used_);
      return PinnedBlock{static_cast<std::byte*>(s.base) + *off, bytes, static_cast<int>(i), *off};
    }
    flush_cache();  // Note [Block cache]: give the arenas everything back, then retry
  }
  ++failed_;
  return PinnedBlock{};
}

void PinnedPool::release(const PinnedBlock& b) {
  if (!b) return;
  std::lock_guard<std::mutex> lock(mu_);
  SPILLWAY_CHECK(b.slab >= 0 && static_cast<size_t>(b.slab) < slabs_.size(),
                 "pinned pool: block from slab {} is not ours", b.slab);
  const size_t size = rounded(b.bytes);
  Slab& s = *slabs_[static_cast<size_t>(b.slab)];
  SPILLWAY_CHECK(b.offset % Arena::kAlignment == 0 && s.arena.block_size(b.offset) > 0 &&
                     !s.cached[b.offset / Arena::kAlignment],
                 "pinned pool: block at offset {} of slab {} released twice or never acquired",
                 b.offset, b.slab);
  used_ -= static_cast<int64_t>(size);
  s.cached[b.offset / Arena::kAlignment] = true;
  cache_[size].push_back(b);
}

bool PinnedPool::acquired(const PinnedBlock& b) const {
  if (!b) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (b.slab < 0 || static_cast<size_t>(b.slab) >= slabs_.size()) return false;
  const Slab& s = *slabs_[static_cast<size_t>(b.slab)];
  return b.offset % Arena::kAlignment == 0 && b.offset / Arena::kAlignment < s.cached.size() &&
         static_cast<const unsigned char*>(s.base) + b.offset == b.ptr &&
         s.arena.block_size(b.offset) > 0 && !s.cached[b.offset / Arena::kAlignment];
}

int64_t PinnedPool::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

int64_t PinnedPool::peak_used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

int64_t PinnedPool::failed_acquires() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

}  // namespace spillway

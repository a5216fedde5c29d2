// A best-fit sub-allocator over one contiguous range [0, capacity): the host backend's
// device memory and the pinned pool's slabs both use it. It hands out offsets, never
// touches the memory, makes no system call, and coalesces freed neighbours. Not
// thread-safe: its owner locks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>

namespace spillway {

class Arena {
 public:
  static constexpr size_t kAlignment = 256;  // as cudaMalloc's

  explicit Arena(size_t capacity);

  // The offset of a free block of at least `bytes` (rounded up to kAlignment), or nullopt.
  std::optional<size_t> allocate(size_t bytes);
  // Returns a block; `offset` must come from allocate and not be freed twice.
  void free(size_t offset);

  size_t capacity() const { return capacity_; }
  size_t used() const { return used_; }
  size_t largest_free() const;
  size_t block_size(size_t offset) const;  // 0 when not allocated

 private:
  size_t capacity_;
  size_t used_ = 0;
  std::multimap<size_t, size_t> free_by_size_;  // size -> offset
  std::map<size_t, size_t> free_by_offset_;     // offset -> size
  std::map<size_t, size_t> used_by_offset_;     // offset -> size
  void insert_free(size_t offset, size_t size);
  void erase_free(std::map<size_t, size_t>::iterator it);
};

}  // namespace spillway

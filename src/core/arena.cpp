// Best-fit sub-allocation with coalescing (see arena.hpp).
#include "core/arena.hpp"

#include "spillway/core/error.hpp"

namespace spillway {

Arena::Arena(size_t capacity) : capacity_(capacity / kAlignment * kAlignment) {
  if (capacity_ > 0) insert_free(0, capacity_);
}

void Arena::insert_free(size_t offset, size_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void Arena::erase_free(std::map<size_t, size_t>::iterator it) {
  auto range = free_by_size_.equal_range(it->second);
  for (auto s = range.first; s != range.second; ++s) {
    if (s->second == it->first) {
      free_by_size_.erase(s);
      break;
    }
  }
  free_by_offset_.erase(it);
}

std::optional<size_t> Arena::allocate(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes > capacity_) return std::nullopt;
  const size_t size = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  auto fit = free_by_size_.lower_bound(size);
  if (fit == free_by_size_.end()) return std::nullopt;
  const size_t offset = fit->second;
  const size_t block = fit->first;
  erase_free(free_by_offset_.find(offset));
  if (block > size) insert_free(offset + size, block - size);
  used_by_offset_.emplace(offset, size);
  used_ += size;
  return offset;
}

void Arena::free(size_t offset) {
  auto it = used_by_offset_.find(offset);
  SPILLWAY_CHECK(it != used_by_offset_.end(), "arena: offset {} is not allocated (double free?)",
                 offset);
  size_t start = offset;
  size_t size = it->second;
  used_ -= size;
  used_by_offset_.erase(it);
  // Coalesce with the free neighbours.
  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.end() && next->first == start + size) {
    size += next->second;
    erase_free(next);
  }
  auto prev = free_by_offset_.lower_bound(start);
  if (prev != free_by_offset_.begin()) {
    --prev;
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      erase_free(prev);
    }
  }
  insert_free(start, size);
}

size_t Arena::largest_free() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

size_t Arena::block_size(size_t offset) const {
  auto it = used_by_offset_.find(offset);
  return it == used_by_offset_.end() ? 0 : it->second;
}

}  // namespace spillway

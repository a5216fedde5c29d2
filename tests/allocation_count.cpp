// The global operator new of the test binaries that count allocations: see
// allocation_count.hpp. Kept in its own file so that no caller inlines it.
#include "allocation_count.hpp"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
std::atomic<int64_t> g_allocations{0};
}  // namespace

void* operator new(std::size_t bytes) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

// The nothrow forms too (std::stable_sort's buffer uses them): every new of the binary and
// its delete must come from the same allocator (AddressSanitizer checks the pairs).
void* operator new(std::size_t bytes, const std::nothrow_t& /*tag*/) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(bytes == 0 ? 1 : bytes);
}

void operator delete(void* p, const std::nothrow_t& /*tag*/) noexcept {
  std::free(p);
}

void operator delete(void* p) noexcept {
  std::free(p);
}

void operator delete(void* p, std::size_t /*bytes*/) noexcept {
  std::free(p);
}

namespace spillway::testing {

int64_t heap_allocations() {
  return g_allocations.load(std::memory_order_relaxed);
}

}  // namespace spillway::testing

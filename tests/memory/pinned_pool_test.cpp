// The pinned pool (spillway/memory/memory.hpp) on the host backend: slabs sub-allocated once,
// exhaustion reported, thread safety, a double release caught, a pool too large for the
// device refused clearly.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "spillway/memory/memory.hpp"

namespace spillway {
namespace {

TEST(PinnedPool, SubAllocatesOnceReportsExhaustionAndIsThreadSafe) {
  auto dev = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  PinnedPoolOptions o;
  o.bytes = int64_t{8} << 20;
  o.slabs = 2;
  PinnedPool pool(*dev, o);
  EXPECT_EQ(dev->memory_stats().allocations[1], 2) << "slabs are allocated once, up front";
  EXPECT_EQ(pool.capacity(), int64_t{8} << 20);
  std::vector<PinnedBlock> held;
  for (;;) {
    PinnedBlock b = pool.acquire(1 << 20);
    if (!b) break;
    held.push_back(b);
  }
  EXPECT_EQ(held.size(), 8u);
  EXPECT_EQ(pool.failed_acquires(), 1);
  for (const PinnedBlock& b : held) pool.release(b);
  EXPECT_EQ(pool.used(), 0);
  // Many threads acquire, write their own pattern, check it, release.
  std::atomic<int> corrupt{0};
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        PinnedBlock b = pool.acquire(1000 + (37 * static_cast<size_t>(i)));
        if (!b) continue;  // full: a real caller would wait
        std::memset(b.ptr, t + 1, b.bytes);
        for (size_t k = 0; k < b.bytes; ++k) {
          if (static_cast<unsigned char*>(b.ptr)[k] != t + 1) ++corrupt;
        }
        pool.release(b);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_EQ(pool.used(), 0);
  EXPECT_EQ(dev->memory_stats().allocations[1], 2) << "no allocation after construction";
}

TEST(PinnedPool, ADoubleReleaseIsCaught) {
  auto dev = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  PinnedPoolOptions o;
  o.bytes = int64_t{1} << 20;
  o.slabs = 1;
  PinnedPool pool(*dev, o);
  const PinnedBlock b = pool.acquire(4096);
  ASSERT_TRUE(b);
  pool.release(b);
  EXPECT_THROW(pool.release(b), Error);
  const PinnedBlock again = pool.acquire(4096);  // served from the cache
  ASSERT_TRUE(again);
  EXPECT_EQ(again.ptr, b.ptr);
  pool.release(again);
}

TEST(PinnedPool, TooLargeForTheDeviceIsAClearError) {
  auto dev = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  PinnedPoolOptions o;
  o.kind = MemoryKind::kDevice;  // a device-side pool larger than the arena
  o.bytes = int64_t{4} << 20;
  try {
    PinnedPool pool(*dev, o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot allocate slab"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace spillway

// The model pool (spillway/serve/serve.hpp): models load once from safetensors into mapped host
// memory and are handed out in place; switching between resident models copies nothing to
// the device (Note [Pool switches copy nothing], counted through a forwarding device); the
// host budget evicts the least recently used idle model, never one in use, and answers
// kFull when the models in use leave no room; cold loads are counted and timed.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>

#include "forwarding_device.hpp"
#include "spillway/core/error.hpp"
#include "spillway/serve/serve.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::TempDir;

// A model of `n` fp32 weights whose values identify it (seed), in one tensor "w" and a
// bf16 "b" of 8 elements.
std::string model_file(const TempDir& dir, const std::string& name, int64_t n, float seed) {
  std::vector<std::byte> w(static_cast<size_t>(n) * 4), b(16);
  for (int64_t i = 0; i < n; ++i) {
    const float v = seed + static_cast<float>(i);
    std::memcpy(w.data() + i * 4, &v, 4);
  }
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>(static_cast<int>(seed) + i);
  const std::string path = dir.file(name + ".safetensors");
  write_safetensors(path, {{"w", DType::kFp32, {n}, w}, {"b", DType::kBf16, {8}, b}});
  return path;
}

// A forwarding host device that counts the copies and device allocations asked of it.
struct CountingDevice : spillway::testing::ForwardingDevice {
  using ForwardingDevice::ForwardingDevice;
  int copies = 0;
  int device_allocations = 0;
  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    ++copies;
    ForwardingDevice::copy_async(dst, src, bytes, s);
  }
  AllocResult allocate(size_t bytes, MemoryKind kind) override {
    if (kind == MemoryKind::kDevice) ++device_allocations;
    return ForwardingDevice::allocate(bytes, kind);
  }
};

float first_weight(const ModelHandle& h) {
  float v = 0;
  std::memcpy(&v, h.tensor("w").host, 4);
  return v;
}

TEST(ModelPool, SwitchingBetweenResidentModelsCopiesNothing) {
  TempDir dir;
  auto host = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  CountingDevice dev(*host);
  ModelPool pool(dev, ModelPoolOptions{int64_t{1} << 20});
  pool.add("a", model_file(dir, "a", 1000, 10.0f));
  pool.add("b", model_file(dir, "b", 2000, 20.0f));
  {
    PoolAcquire a = pool.acquire("a");
    ASSERT_EQ(a.status, PoolStatus::kOk);
    EXPECT_TRUE(a.cold);
    EXPECT_EQ(first_weight(a.handle), 10.0f);
    EXPECT_EQ(a.handle.tensor("w").shape, (std::vector<int64_t>{1000}));
    EXPECT_EQ(a.handle.tensor("b").dtype, DType::kBf16);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.handle.tensor("w").host) % 64, 0u);
  }
  (void)pool.acquire("b");
  const int copies = dev.copies;
  const ModelPoolStats before = pool.stats();
  for (int i = 0; i < 10; ++i) {  // switches: both resident
    PoolAcquire h = pool.acquire(i % 2 == 0 ? "a" : "b");
    ASSERT_EQ(h.status, PoolStatus::kOk);
    EXPECT_FALSE(h.cold);
    EXPECT_EQ(first_weight(h.handle), i % 2 == 0 ? 10.0f : 20.0f);
  }
  const ModelPoolStats after = pool.stats();
  EXPECT_EQ(dev.copies, copies);
  EXPECT_EQ(dev.device_allocations, 0);
  EXPECT_EQ(after.cold_loads, before.cold_loads);
  EXPECT_EQ(after.hits, before.hits + 10);
  EXPECT_EQ(after.cold_loads, 2);
  EXPECT_EQ(after.cold_load_bytes, (1000 * 4 + 16) + (2000 * 4 + 16));
  EXPECT_GT(after.cold_load_ms, 0.0);
  EXPECT_EQ(after.resident_models, 2);
}

TEST(ModelPool, TheBudgetEvictsTheLeastRecentlyUsedIdleModelNeverOneInUse) {
  TempDir dir;
  auto dev = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  // Each model: 4000 + 16 bytes, each tensor 64-byte aligned: 4096 bytes packed; room for
  // two.
  ModelPool pool(*dev, ModelPoolOptions{2 * 4096 + 100});
  for (const char* m : {"a", "b", "c"}) pool.add(m, model_file(dir, m, 1000, m[0] * 1.0f));
  PoolAcquire a = pool.acquire("a");
  (void)pool.acquire("b");            // released at once
  PoolAcquire c = pool.acquire("c");  // evicts b (idle), not a (in use)
  ASSERT_EQ(c.status, PoolStatus::kOk);
  EXPECT_TRUE(pool.resident("a"));
  EXPECT_FALSE(pool.resident("b"));
  EXPECT_TRUE(pool.resident("c"));
  // Both resident models in use: b cannot come back; the answer says why.
  PoolAcquire b = pool.acquire("b");
  EXPECT_EQ(b.status, PoolStatus::kFull);
  EXPECT_FALSE(b.handle);
  EXPECT_NE(b.why.find("'b' needs 4096 bytes"), std::string::npos) << b.why;
  EXPECT_NE(b.why.find("a (4096 bytes, 1 in use)"), std::string::npos) << b.why;
  EXPECT_EQ(first_weight(a.handle), 'a' * 1.0f);  // still there, unchanged
  a.handle.release();
  // a is idle now and the least recent: b comes back in its place, from disk.
  b = pool.acquire("b");
  ASSERT_EQ(b.status, PoolStatus::kOk);
  EXPECT_TRUE(b.cold);
  EXPECT_FALSE(pool.resident("a"));
  EXPECT_EQ(first_weight(b.handle), 'b' * 1.0f);
  const ModelPoolStats st = pool.stats();
  EXPECT_EQ(st.evictions, 2);
  EXPECT_EQ(st.refused, 1);
  EXPECT_EQ(st.cold_loads, 4);
  EXPECT_LE(st.resident_bytes, 2 * 4096 + 100);
}

TEST(ModelPool, AFileChangedOnDiskIsNotLoadedUntilRefreshed) {
  // A load reads the file add() checked or nothing: another file renamed over it, or the
  // file cut short, answers kChanged naming the model and what changed; refresh() with the
  // new file (checked by the caller) makes the next load read it.
  namespace fs = std::filesystem;
  TempDir dir;
  auto dev = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  ModelPool pool(*dev, ModelPoolOptions{int64_t{1} << 20});
  const std::string path = model_file(dir, "a", 1000, 10.0f);
  pool.add("a", path);
  fs::rename(model_file(dir, "a2", 1000, 30.0f), path);  // the same size, other values
  PoolAcquire a = pool.acquire("a");
  EXPECT_EQ(a.status, PoolStatus::kChanged);
  EXPECT_FALSE(a.handle);
  for (const char* needle : {"model 'a'", "changed on disk", "another file was put in its place"})
    EXPECT_NE(a.why.find(needle), std::string::npos) << needle << " in: " << a.why;
  EXPECT_FALSE(pool.resident("a"));
  EXPECT_EQ(pool.stats().refused, 1);
  {
    const SafetensorsFile f(path);
    pool.refresh("a", f);
  }
  a = pool.acquire("a");
  ASSERT_EQ(a.status, PoolStatus::kOk) << a.why;
  EXPECT_EQ(first_weight(a.handle), 30.0f);
  a.handle.release();
  // Cut short in place: the resident copy stays; a pool that must load it says why.
  fs::resize_file(path, fs::file_size(path) - 100);
  EXPECT_EQ(first_weight(pool.acquire("a").handle), 30.0f);
  ModelPool other(*dev, ModelPoolOptions{int64_t{1} << 20});
  const std::string b = model_file(dir, "b", 1000, 40.0f);
  other.add("b", b);
  fs::resize_file(b, 200);
  PoolAcquire x = other.acquire("b");
  EXPECT_EQ(x.status, PoolStatus::kChanged);
  for (const char* needle : {"model 'b'", "cannot be read", "truncated"})
    EXPECT_NE(x.why.find(needle), std::string::npos) << needle << " in: " << x.why;
  // A file truncated after it was opened: read() says so instead of faulting.
  const std::string c = model_file(dir, "c", 1000, 50.0f);
  const SafetensorsFile f(c);
  fs::resize_file(c, 100);
  std::vector<std::byte> buf(4000);
  spillway::testing::expect_error([&] { f.read(*f.find("w"), buf.data()); },
                                  {"c.safetensors", "tensor 'w'", "truncated"});
}

TEST(ModelPool, BadModelsAndNamesAreRefusedWithTheReason) {
  TempDir dir;
  auto dev = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  ModelPool pool(*dev, ModelPoolOptions{4096});
  try {
    pool.add("big", model_file(dir, "big", 2000, 1.0f));
    FAIL() << "a model larger than the budget was added";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("budget is 4096"), std::string::npos) << e.what();
  }
  pool.add("small", model_file(dir, "small", 10, 1.0f));
  EXPECT_THROW(pool.add("small", model_file(dir, "small", 10, 1.0f)), Error);
  EXPECT_THROW(pool.add("broken", dir.file("absent.safetensors")), Error);
  try {
    (void)pool.acquire("nope");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no model 'nope' (the pool has: small)"),
              std::string::npos)
        << e.what();
  }
  PoolAcquire s = pool.acquire("small");
  EXPECT_THROW((void)s.handle.tensor("absent"), Error);
}

TEST(ModelPool, ConcurrentAcquiresKeepEveryModelIntact) {
  TempDir dir;
  auto dev = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  ModelPool pool(*dev, ModelPoolOptions{3 * 4096});
  for (int m = 0; m < 5; ++m)
    pool.add("m" + std::to_string(m),
             model_file(dir, "m" + std::to_string(m), 1000, static_cast<float>(m) * 100.0f));
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0}, ok{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const int m = (i * 7 + t) % 5;
        PoolAcquire h = pool.acquire("m" + std::to_string(m));
        if (h.status != PoolStatus::kOk) continue;  // full: every resident model in use
        ++ok;
        const auto* w = reinterpret_cast<const float*>(h.handle.tensor("w").host);
        for (int k = 0; k < 1000; k += 97)
          if (w[k] != static_cast<float>(m) * 100.0f + static_cast<float>(k)) ++wrong;
      }
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(ok.load(), 400);
  EXPECT_LE(pool.stats().resident_bytes, 3 * 4096);
}

}  // namespace
}  // namespace spillway

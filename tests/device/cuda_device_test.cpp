// The CUDA backend against the Device contract (include/spillway/device/device.hpp). The
// CudaCheck and CudaDeviceFactory tests run anywhere; the CudaDeviceTest ones need a GPU:
// without one they skip and say why. Byte checks are bitwise, on random bytes from a fixed,
// printed seed, into poisoned destinations.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <iostream>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "device/cuda/cuda_check.hpp"
#include "device/cuda/hybrid_gemm_kernels.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::expect_error;

constexpr uint64_t kSeed = 20250611;
constexpr size_t kRoundTripBytes = size_t{64} << 20;  // 64 MB
constexpr unsigned char kPoison = 0xA5;

const MemoryKind kAllKinds[] = {MemoryKind::kDevice, MemoryKind::kPinnedHost,
                                MemoryKind::kMappedHost, MemoryKind::kHost};

int idx(MemoryKind k) {
  return static_cast<int>(k);
}

// HybridGEMM's kernel limits are checked on the host before a launch (no GPU needed).
TEST(HybridGemmLimits, TilesBeyondSharedMemoryOrOutputsPerBlockAreNamed) {
  DeviceHybridGemm a;
  a.symmetric = {16, 32, 32};
  a.asymmetric = {16, 16, 32};
  EXPECT_EQ(cuda::hybrid_gemm_tiles_refusal(a).tiles, "");
  a.symmetric = {256, 256, 64};  // 128 KiB of shared memory
  cuda::HybridGemmTilesRefusal r = cuda::hybrid_gemm_tiles_refusal(a);
  EXPECT_EQ(r.tiles, "256x256x64");
  EXPECT_NE(r.rule.find("(m + n) * k * 4: 131072"), std::string::npos) << r.rule;
  a.symmetric = {16, 32, 32};
  a.asymmetric = {128, 64, 4};  // few bytes, 8192 outputs > 16 x 256
  r = cuda::hybrid_gemm_tiles_refusal(a);
  EXPECT_EQ(r.tiles, "128x64x4");
  EXPECT_NE(r.rule.find("(m * n: 8192)"), std::string::npos) << r.rule;
  a.asymmetric = {0, 16, 16};
  EXPECT_NE(cuda::hybrid_gemm_tiles_refusal(a).rule.find("each side > 0"), std::string::npos);
}

// An allocation freed on scope exit (the device must outlive it).
class Buffer {
 public:
  Buffer(Device& device, size_t bytes, MemoryKind kind) : device_(device), kind_(kind) {
    AllocResult r = device.allocate(bytes, kind);
    reason_ = r.reason;
    ptr_ = r.ptr;
  }
  ~Buffer() {
    if (ptr_ != nullptr) device_.free(ptr_, kind_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  unsigned char* bytes() const { return static_cast<unsigned char*>(ptr_); }
  void* get() const { return ptr_; }
  const std::string& reason() const { return reason_; }

 private:
  Device& device_;
  MemoryKind kind_;
  void* ptr_ = nullptr;
  std::string reason_;
};

void fill_random(unsigned char* p, size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const uint64_t w = rng();
    std::memcpy(p + i, &w, 8);
  }
  for (; i < bytes; ++i) p[i] = static_cast<unsigned char>(rng());
}

// The first differing offset, or -1.
int64_t first_difference(const unsigned char* a, const unsigned char* b, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    device_ = make_cuda_device(0, &why);
    if (!device_) GTEST_SKIP() << why;  // why reads "no CUDA device: ..."
  }
  void TearDown() override { device_.reset(); }

  Device& dev() { return *device_; }

  std::unique_ptr<Device> device_;
};

cudaError_t fails_with_invalid_value() {
  return cudaErrorInvalidValue;
}
cudaError_t succeeds() {
  return cudaSuccess;
}

// Runs here too (no device needed): the macros name the call, the error and the place.
TEST(CudaCheck, ThrowsNamingTheCallTheErrorAndThePlace) {
  EXPECT_NO_THROW(SPILLWAY_CUDA_CHECK(succeeds()));
  expect_error([] { SPILLWAY_CUDA_CHECK(fails_with_invalid_value()); },
               {"fails_with_invalid_value()", "cudaErrorInvalidValue", "cuda_device_test.cpp:"});
  ::testing::internal::CaptureStderr();
  EXPECT_NO_THROW(SPILLWAY_CUDA_CHECK_WARN(fails_with_invalid_value()));
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("fails_with_invalid_value()"), std::string::npos) << warned;
  EXPECT_NE(warned.find("cudaErrorInvalidValue"), std::string::npos) << warned;
}

// Runs here too: a missing ordinal is a value, with the reason, on any machine.
TEST(CudaDeviceFactory, AMissingOrdinalIsNullWithAReason) {
  for (const int ordinal : {-1, 1 << 20}) {
    std::string why;
    const std::unique_ptr<Device> d = make_cuda_device(ordinal, &why);
    EXPECT_TRUE(d == nullptr) << "ordinal " << ordinal;
    EXPECT_NE(why.find("no CUDA device"), std::string::npos) << why;
  }
  EXPECT_TRUE(make_cuda_device(1 << 20, nullptr) == nullptr);  // why is optional
}

TEST_F(CudaDeviceTest, NamesItselfAndIsNotEmulated) {
  EXPECT_EQ(dev().name().rfind("cuda:0 ", 0), 0u) << dev().name();
  EXPECT_GT(dev().name().size(), std::string("cuda:0 ").size());
  EXPECT_FALSE(dev().emulated());
}

// Each kind: allocated, accounted (a pinned request that fell back to pageable memory is
// accounted as host memory), host kinds writable, and unaccounted again after free.
TEST_F(CudaDeviceTest, AllocatesEveryKindAndAccountsIt) {
  constexpr size_t kBytes = size_t{1} << 20;
  for (const MemoryKind kind : kAllKinds) {
    SCOPED_TRACE(to_string(kind));
    const MemoryStats before = dev().memory_stats();
    AllocResult r = dev().allocate(kBytes, kind);
    ASSERT_TRUE(r) << r.reason;
    const MemoryStats during = dev().memory_stats();
    MemoryKind accounted = kind;
    if (during.current[idx(kind)] == before.current[idx(kind)]) accounted = MemoryKind::kHost;
    if (kind == MemoryKind::kDevice || kind == MemoryKind::kHost) {
      EXPECT_EQ(accounted, kind);
    }
    const int a = idx(accounted);
    EXPECT_EQ(during.current[a] - before.current[a], static_cast<int64_t>(kBytes));
    EXPECT_EQ(during.allocations[a] - before.allocations[a], 1);
    EXPECT_GE(during.peak[a], during.current[a]);
    if (kind != MemoryKind::kDevice) {
      std::memset(r.ptr, 0x5A, kBytes);
      const auto* p = static_cast<const unsigned char*>(r.ptr);
      EXPECT_EQ(p[0], 0x5A);
      EXPECT_EQ(p[kBytes - 1], 0x5A);
    }
    dev().free(r.ptr, kind);
    const MemoryStats after = dev().memory_stats();
    EXPECT_EQ(after.current[a], before.current[a]);
    EXPECT_EQ(after.allocations[a], during.allocations[a]);  // a count of allocations ever
    EXPECT_EQ(after.peak[a], during.peak[a]);
  }
}

TEST_F(CudaDeviceTest, FreeOfNullIsANoOpAndOfAForeignPointerThrows) {
  for (const MemoryKind kind : kAllKinds) dev().free(nullptr, kind);
  int not_ours = 0;
  expect_error([&] { dev().free(&not_ours, MemoryKind::kDevice); },
               {"cuda:0", "not allocated by this device"});
  Buffer b(dev(), 4096, MemoryKind::kDevice);
  ASSERT_NE(b.get(), nullptr) << b.reason();
  expect_error([&] { dev().free(b.get(), MemoryKind::kMappedHost); },
               {"is device memory", "not mapped host"});
}

// 64 MB host -> device on an H2D stream, then device -> host on a D2H stream ordered by
// an event, through pinned and through pageable host buffers: bitwise equal.
TEST_F(CudaDeviceTest, RoundTrips64MBBitwiseThroughTheCopyStreams) {
  std::cout << "[ seed     ] " << kSeed << "\n";
  SCOPED_TRACE(::testing::Message() << "seed " << kSeed);
  for (const MemoryKind host_kind : {MemoryKind::kPinnedHost, MemoryKind::kHost}) {
    SCOPED_TRACE(to_string(host_kind));
    Buffer src(dev(), kRoundTripBytes, host_kind);
    Buffer dst(dev(), kRoundTripBytes, host_kind);
    Buffer on_device(dev(), kRoundTripBytes, MemoryKind::kDevice);
    ASSERT_NE(src.get(), nullptr) << src.reason();
    ASSERT_NE(dst.get(), nullptr) << dst.reason();
    ASSERT_NE(on_device.get(), nullptr) << on_device.reason();
    fill_random(src.bytes(), kRoundTripBytes, kSeed);
    std::memset(dst.get(), kPoison, kRoundTripBytes);

    const Stream h2d = dev().create_stream(StreamRole::kH2D);
    const Stream d2h = dev().create_stream(StreamRole::kD2H);
    const Event uploaded = dev().create_event();
    const Event downloaded = dev().create_event();
    dev().copy_async(on_device.get(), src.get(), kRoundTripBytes, h2d);
    dev().record(uploaded, h2d);
    dev().wait(d2h, uploaded);
    dev().copy_async(dst.get(), on_device.get(), kRoundTripBytes, d2h);
    dev().record(downloaded, d2h);
    dev().synchronize(downloaded);
    EXPECT_TRUE(dev().query(downloaded));
    EXPECT_TRUE(dev().query(uploaded));
    EXPECT_EQ(first_difference(src.bytes(), dst.bytes(), kRoundTripBytes), -1);

    dev().destroy_event(downloaded);
    dev().destroy_event(uploaded);
    dev().destroy_stream(d2h);
    dev().destroy_stream(h2d);
  }
}

// Mapped host memory is written by a device-to-host copy like any other host memory.
TEST_F(CudaDeviceTest, CopiesIntoMappedHostMemory) {
  constexpr size_t kBytes = size_t{4} << 20;
  Buffer src(dev(), kBytes, MemoryKind::kPinnedHost);
  Buffer on_device(dev(), kBytes, MemoryKind::kDevice);
  Buffer mapped(dev(), kBytes, MemoryKind::kMappedHost);
  ASSERT_NE(src.get(), nullptr) << src.reason();
  ASSERT_NE(on_device.get(), nullptr) << on_device.reason();
  ASSERT_NE(mapped.get(), nullptr) << mapped.reason();
  fill_random(src.bytes(), kBytes, kSeed + 1);
  std::memset(mapped.get(), kPoison, kBytes);
  const Stream s = dev().create_stream(StreamRole::kCompute);
  dev().copy_async(on_device.get(), src.get(), kBytes, s);
  dev().copy_async(mapped.get(), on_device.get(), kBytes, s);
  dev().synchronize(s);
  EXPECT_EQ(first_difference(src.bytes(), mapped.bytes(), kBytes), -1);
  dev().destroy_stream(s);
}

// Accounting from several threads at once adds up.
TEST_F(CudaDeviceTest, AccountingIsThreadSafe) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 50;
  constexpr size_t kBytes = 4096;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const MemoryKind kind = t % 2 == 0 ? MemoryKind::kDevice : MemoryKind::kHost;
      for (int i = 0; i < kRounds; ++i) {
        AllocResult r = dev().allocate(kBytes, kind);
        if (!r) {
          ++failures;
          continue;
        }
        dev().free(r.ptr, kind);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  const MemoryStats s = dev().memory_stats();
  for (const MemoryKind kind : {MemoryKind::kDevice, MemoryKind::kHost}) {
    EXPECT_EQ(s.current[idx(kind)], 0) << to_string(kind);
    EXPECT_EQ(s.allocations[idx(kind)], kThreads / 2 * kRounds) << to_string(kind);
    EXPECT_GE(s.peak[idx(kind)], static_cast<int64_t>(kBytes)) << to_string(kind);
    EXPECT_LE(s.peak[idx(kind)], static_cast<int64_t>(kThreads / 2 * kBytes)) << to_string(kind);
  }
}

TEST_F(CudaDeviceTest, StatsTrackCurrentAndPeak) {
  constexpr int64_t kMB = int64_t{1} << 20;
  const int d = idx(MemoryKind::kDevice);
  const MemoryStats fresh = dev().memory_stats();
  for (int k = 0; k < kMemoryKinds; ++k) {
    EXPECT_EQ(fresh.current[k], 0);
    EXPECT_EQ(fresh.peak[k], 0);
    EXPECT_EQ(fresh.allocations[k], 0);
  }
  AllocResult a = dev().allocate(16 * kMB, MemoryKind::kDevice);
  AllocResult b = dev().allocate(32 * kMB, MemoryKind::kDevice);
  ASSERT_TRUE(a) << a.reason;
  ASSERT_TRUE(b) << b.reason;
  MemoryStats s = dev().memory_stats();
  EXPECT_EQ(s.current[d], 48 * kMB);
  EXPECT_EQ(s.peak[d], 48 * kMB);
  EXPECT_EQ(s.allocations[d], 2);
  dev().free(a.ptr, MemoryKind::kDevice);
  s = dev().memory_stats();
  EXPECT_EQ(s.current[d], 32 * kMB);
  EXPECT_EQ(s.peak[d], 48 * kMB);
  AllocResult c = dev().allocate(8 * kMB, MemoryKind::kDevice);
  ASSERT_TRUE(c) << c.reason;
  s = dev().memory_stats();
  EXPECT_EQ(s.current[d], 40 * kMB);
  EXPECT_EQ(s.peak[d], 48 * kMB);  // 40 < 48: the peak stays
  EXPECT_EQ(s.allocations[d], 3);
  dev().free(b.ptr, MemoryKind::kDevice);
  dev().free(c.ptr, MemoryKind::kDevice);
  s = dev().memory_stats();
  EXPECT_EQ(s.current[d], 0);
  EXPECT_EQ(s.peak[d], 48 * kMB);
  for (int k = 0; k < kMemoryKinds; ++k) {
    if (k != d) {
      EXPECT_EQ(s.current[k], 0) << k;
    }
  }
}

// 1 PiB: a null pointer and a reason, no exception, nothing accounted, and the device
// still works afterwards (no error left behind for the next call).
TEST_F(CudaDeviceTest, OutOfMemoryIsAValueNotAnException) {
  constexpr size_t kPiB = size_t{1} << 50;
  const MemoryStats before = dev().memory_stats();
  for (const MemoryKind kind : {MemoryKind::kDevice, MemoryKind::kPinnedHost, MemoryKind::kHost}) {
    SCOPED_TRACE(to_string(kind));
    AllocResult r;
    EXPECT_NO_THROW(r = dev().allocate(kPiB, kind));
    EXPECT_FALSE(r);
    EXPECT_EQ(r.ptr, nullptr);
    EXPECT_NE(r.reason.find("requested"), std::string::npos) << r.reason;
  }
  const MemoryStats after = dev().memory_stats();
  for (int k = 0; k < kMemoryKinds; ++k) {
    EXPECT_EQ(after.current[k], before.current[k]) << k;
    EXPECT_EQ(after.allocations[k], before.allocations[k]) << k;
  }
  Buffer small(dev(), 1 << 20, MemoryKind::kDevice);
  EXPECT_NE(small.get(), nullptr) << small.reason();
  const Stream s = dev().create_stream(StreamRole::kCompute);
  Buffer host(dev(), 1 << 20, MemoryKind::kPinnedHost);
  ASSERT_NE(host.get(), nullptr) << host.reason();
  dev().copy_async(small.get(), host.get(), 1 << 20, s);
  EXPECT_NO_THROW(dev().synchronize(s));
  dev().destroy_stream(s);
}

// A never-recorded event is complete; an event behind a blocked host callback is not,
// until the callback is released.
TEST_F(CudaDeviceTest, EventsQueryAndSynchronize) {
  const Event e = dev().create_event();
  EXPECT_TRUE(dev().query(e));
  dev().synchronize(e);

  const Stream s = dev().create_stream(StreamRole::kCompute);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  dev().host_callback(s, [released] { released.wait(); });
  dev().record(e, s);
  EXPECT_FALSE(dev().query(e));  // the callback cannot return before release
  release.set_value();
  dev().synchronize(e);
  EXPECT_TRUE(dev().query(e));

  // A second stream waiting on e runs only after it.
  const Stream other = dev().create_stream(StreamRole::kD2H);
  std::promise<void> release2;
  std::shared_future<void> released2 = release2.get_future().share();
  std::atomic<bool> first_done{false};
  std::atomic<bool> second_saw_first{false};
  dev().host_callback(s, [released2, &first_done] {
    released2.wait();
    first_done = true;
  });
  dev().record(e, s);
  dev().wait(other, e);
  dev().host_callback(other, [&] { second_saw_first = first_done.load(); });
  const Event e_other = dev().create_event();
  dev().record(e_other, other);
  EXPECT_FALSE(dev().query(e_other));
  release2.set_value();
  dev().synchronize(other);
  EXPECT_TRUE(dev().query(e_other));
  EXPECT_TRUE(second_saw_first);

  dev().destroy_event(e_other);
  dev().destroy_stream(other);
  dev().destroy_stream(s);
  dev().destroy_event(e);
}

// A callback after a copy sees the copied bytes (stream order includes host work), and
// callbacks on one stream run in the order they were enqueued.
TEST_F(CudaDeviceTest, HostCallbacksRunInStreamOrder) {
  std::cout << "[ seed     ] " << kSeed + 2 << "\n";
  constexpr size_t kBytes = size_t{16} << 20;
  Buffer src(dev(), kBytes, MemoryKind::kPinnedHost);
  Buffer dst(dev(), kBytes, MemoryKind::kPinnedHost);
  Buffer on_device(dev(), kBytes, MemoryKind::kDevice);
  ASSERT_NE(src.get(), nullptr) << src.reason();
  ASSERT_NE(dst.get(), nullptr) << dst.reason();
  ASSERT_NE(on_device.get(), nullptr) << on_device.reason();
  fill_random(src.bytes(), kBytes, kSeed + 2);
  std::memset(dst.get(), kPoison, kBytes);

  const Stream h2d = dev().create_stream(StreamRole::kH2D);
  const Stream d2h = dev().create_stream(StreamRole::kD2H);
  const Event uploaded = dev().create_event();
  dev().copy_async(on_device.get(), src.get(), kBytes, h2d);
  dev().record(uploaded, h2d);
  dev().wait(d2h, uploaded);
  dev().copy_async(dst.get(), on_device.get(), kBytes, d2h);
  std::atomic<int64_t> difference{-2};  // -2: the callback never ran
  dev().host_callback(d2h,
                      [&] { difference = first_difference(src.bytes(), dst.bytes(), kBytes); });

  std::mutex mu;
  std::vector<int> order;
  for (int i = 0; i < 16; ++i) {
    dev().host_callback(d2h, [&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
    });
  }
  dev().synchronize(d2h);
  EXPECT_EQ(difference.load(), -1);
  std::vector<int> expected;
  for (int i = 0; i < 16; ++i) expected.push_back(i);
  EXPECT_EQ(order, expected);

  dev().destroy_event(uploaded);
  dev().destroy_stream(d2h);
  dev().destroy_stream(h2d);
}

// Note [Adopted streams]: a cudaStream_t the caller created (as PyTorch's current stream
// is), adopted: the caller's slow host work on it writes the source, the device's copies
// on the adopted stream and, by an event, on its own D2H stream carry the written bytes;
// destroy_stream forgets the handle and the caller's stream is still alive afterwards.
TEST_F(CudaDeviceTest, AnAdoptedStreamOrdersTheDevicesWorkAfterTheCallers) {
  std::cout << "[ seed     ] " << kSeed + 3 << "\n";
  constexpr size_t kBytes = size_t{8} << 20;
  Buffer written(dev(), kBytes, MemoryKind::kPinnedHost);
  Buffer src(dev(), kBytes, MemoryKind::kPinnedHost);
  Buffer back(dev(), kBytes, MemoryKind::kPinnedHost);
  Buffer on_device(dev(), kBytes, MemoryKind::kDevice);
  ASSERT_NE(written.get(), nullptr) << written.reason();
  ASSERT_NE(src.get(), nullptr) << src.reason();
  ASSERT_NE(back.get(), nullptr) << back.reason();
  ASSERT_NE(on_device.get(), nullptr) << on_device.reason();
  fill_random(written.bytes(), kBytes, kSeed + 3);
  std::memset(src.get(), kPoison, kBytes);
  std::memset(back.get(), kPoison, kBytes);

  cudaStream_t native = nullptr;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&native, cudaStreamNonBlocking), cudaSuccess);
  struct Job {
    const void* from;
    void* to;
    size_t bytes;
  } job{written.get(), src.get(), kBytes};
  ASSERT_EQ(cudaLaunchHostFunc(
                native,
                [](void* p) {
                  const auto* j = static_cast<const Job*>(p);
                  std::this_thread::sleep_for(std::chrono::milliseconds(30));
                  std::memcpy(j->to, j->from, j->bytes);
                },
                &job),
            cudaSuccess);
  const Stream adopted = dev().adopt_stream(native, StreamRole::kCompute);
  const Stream d2h = dev().create_stream(StreamRole::kD2H);
  const Event uploaded = dev().create_event();
  dev().copy_async(on_device.get(), src.get(), kBytes, adopted);
  dev().record(uploaded, adopted);
  dev().wait(d2h, uploaded);
  dev().copy_async(back.get(), on_device.get(), kBytes, d2h);
  EXPECT_EQ(dev().native_stream(adopted), static_cast<void*>(native));
  dev().synchronize(d2h);
  EXPECT_EQ(first_difference(written.bytes(), back.bytes(), kBytes), -1);

  dev().destroy_event(uploaded);
  dev().destroy_stream(d2h);
  dev().destroy_stream(adopted);
  expect_error([&] { dev().synchronize(adopted); }, {"stream"});
  EXPECT_EQ(cudaStreamQuery(native), cudaSuccess);  // forgotten, not destroyed
  EXPECT_EQ(cudaStreamDestroy(native), cudaSuccess);

  // The legacy default stream (a null handle) can be adopted too.
  const Stream legacy = dev().adopt_stream(nullptr, StreamRole::kCompute);
  dev().copy_async(back.get(), on_device.get(), 4096, legacy);
  dev().synchronize(legacy);
  dev().destroy_stream(legacy);
}

TEST_F(CudaDeviceTest, DestroyedHandlesAreReused) {
  const Stream s1 = dev().create_stream(StreamRole::kCompute);
  const Stream s2 = dev().create_stream(StreamRole::kD2H);
  EXPECT_NE(s1.id, s2.id);
  dev().destroy_stream(s1);
  const Stream s3 = dev().create_stream(StreamRole::kH2D);
  EXPECT_EQ(s3.id, s1.id);
  dev().synchronize(s3);  // the reused slot holds a live stream

  const Event e1 = dev().create_event();
  const Event e2 = dev().create_event();
  EXPECT_NE(e1.id, e2.id);
  dev().destroy_event(e1);
  const Event e3 = dev().create_event();
  EXPECT_EQ(e3.id, e1.id);
  dev().record(e3, s3);
  dev().synchronize(e3);
  EXPECT_TRUE(dev().query(e3));

  dev().destroy_event(e3);
  dev().destroy_event(e2);
  dev().destroy_stream(s3);
  dev().destroy_stream(s2);
}

TEST_F(CudaDeviceTest, UnknownOrDestroyedHandlesThrow) {
  const Stream live = dev().create_stream(StreamRole::kCompute);
  const Event live_event = dev().create_event();
  const Stream dead = dev().create_stream(StreamRole::kCompute);
  const Event dead_event = dev().create_event();
  dev().destroy_stream(dead);
  dev().destroy_event(dead_event);

  for (const Stream bad : {Stream{-1}, Stream{12345}, dead}) {
    const std::string id = std::to_string(bad.id);
    SCOPED_TRACE("stream " + id);
    expect_error([&] { dev().synchronize(bad); }, {"stream " + id});
    expect_error([&] { dev().record(live_event, bad); }, {"stream " + id});
    expect_error([&] { dev().wait(bad, live_event); }, {"stream " + id});
    expect_error([&] { dev().copy_async(nullptr, nullptr, 0, bad); }, {"stream " + id});
    expect_error([&] { dev().host_callback(bad, [] {}); }, {"stream " + id});
    expect_error([&] { dev().destroy_stream(bad); }, {"stream " + id});
  }
  for (const Event bad : {Event{-1}, Event{777}, dead_event}) {
    const std::string id = std::to_string(bad.id);
    SCOPED_TRACE("event " + id);
    expect_error([&] { dev().query(bad); }, {"event " + id});
    expect_error([&] { dev().synchronize(bad); }, {"event " + id});
    expect_error([&] { dev().record(bad, live); }, {"event " + id});
    expect_error([&] { dev().wait(live, bad); }, {"event " + id});
    expect_error([&] { dev().destroy_event(bad); }, {"event " + id});
  }
  expect_error([&] { dev().host_callback(live, std::function<void()>()); }, {"empty function"});
  expect_error([&] { dev().copy_async(nullptr, nullptr, 16, live); }, {"null pointer"});
  // The live handles are untouched by the failures.
  dev().record(live_event, live);
  dev().synchronize(live_event);
  dev().destroy_event(live_event);
  dev().destroy_stream(live);
}

TEST_F(CudaDeviceTest, StreamPrioritiesAreClampedToTheDeviceRange) {
  for (const int priority : {-1000, -1, 0, 1, 1000}) {
    SCOPED_TRACE(priority);
    const Stream s = dev().create_stream(StreamRole::kCompute, priority);
    dev().synchronize(s);
    dev().destroy_stream(s);
  }
}

// Memory, streams, events and queued work left behind are cleaned up by the destructor
// without an exception; a new device starts from zero.
TEST_F(CudaDeviceTest, TheDestructorReleasesWhatIsLeft) {
  constexpr size_t kBytes = size_t{8} << 20;
  AllocResult host = dev().allocate(kBytes, MemoryKind::kPinnedHost);
  AllocResult on_device = dev().allocate(kBytes, MemoryKind::kDevice);
  ASSERT_TRUE(host) << host.reason;
  ASSERT_TRUE(on_device) << on_device.reason;
  ASSERT_TRUE(dev().allocate(kBytes, MemoryKind::kMappedHost));
  ASSERT_TRUE(dev().allocate(kBytes, MemoryKind::kHost));
  const Stream s = dev().create_stream(StreamRole::kH2D);
  const Event e = dev().create_event();
  dev().copy_async(on_device.ptr, host.ptr, kBytes, s);
  dev().record(e, s);
  EXPECT_NO_THROW(device_.reset());

  std::string why;
  device_ = make_cuda_device(0, &why);
  ASSERT_TRUE(device_ != nullptr) << why;
  const MemoryStats fresh = dev().memory_stats();
  for (int k = 0; k < kMemoryKinds; ++k) EXPECT_EQ(fresh.current[k], 0) << k;
}

// NCCL with one rank (Note [Device groups]): the group is made, says rank 0 of 1, and an
// in-place all-gather on its stream leaves the rank's own part as it was.
TEST(NcclCuda, OneRankAllGatherLeavesItsPartAsItWas) {
  std::string why;
  const std::unique_ptr<Device> dev = make_cuda_device(0, &why);
  if (!dev) GTEST_SKIP() << why;
  std::vector<std::unique_ptr<AllGather>> group = make_nccl_all_gather({dev.get()}, &why);
  if (group.empty() && why.find("built without NCCL") != std::string::npos) GTEST_SKIP() << why;
  ASSERT_EQ(group.size(), 1U) << why;
  EXPECT_EQ(group[0]->rank(), 0);
  EXPECT_EQ(group[0]->ranks(), 1);
  constexpr size_t kBytes = (size_t{1} << 20) + 12;
  std::vector<unsigned char> part(kBytes), back(kBytes, 0);
  std::mt19937 rng(kSeed);
  for (unsigned char& b : part) b = static_cast<unsigned char>(rng());
  const AllocResult buf = dev->allocate(kBytes, MemoryKind::kDevice);
  ASSERT_TRUE(buf) << buf.reason;
  const UniqueStream s(*dev, StreamRole::kCompute);
  dev->copy_async(buf.ptr, part.data(), kBytes, s);
  group[0]->all_gather_in_place(buf.ptr, kBytes, s);
  dev->copy_async(back.data(), buf.ptr, kBytes, s);
  dev->synchronize(s);
  EXPECT_EQ(std::memcmp(back.data(), part.data(), kBytes), 0);
  dev->free(buf.ptr, MemoryKind::kDevice);
}

}  // namespace
}  // namespace spillway

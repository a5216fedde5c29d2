// The activation offload engine on the CUDA backend (skips, saying why, without a GPU): a
// training step's tensors, several layers of ragged sizes, offloaded over the real copy
// engines with an in-flight bound small enough that back-pressure engages, then reloaded in
// backward order with prefetch, into the engine's pool and into caller memory: every byte
// comes back equal, and the D2H queue never holds more than the bound (measured at the
// device by D2HMeter, not by the engine's own accounting).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "offload/d2h_meter.hpp"
#include "spillway/core/policy.hpp"
#include "spillway/device/device.hpp"
#include "spillway/offload/offload.hpp"

namespace spillway {
namespace {

struct Produced {
  OffloadHandle handle;
  size_t offset = 0;  // the tensor holds source[offset, offset + bytes)
  size_t bytes = 0;
};

TEST(OffloadEngineCuda, AStepsTensorsComeBackBitwiseUnderTheInflightBound) {
  std::string why;
  const std::unique_ptr<Device> inner = make_cuda_device(0, &why);
  if (!inner) GTEST_SKIP() << why;
  testing::D2HMeter meter(*inner);
  Device& dev = meter.device();
  const UniqueStream compute(dev, StreamRole::kCompute);
  constexpr int kLayers = 4;
  constexpr int kPerLayer = 6;
  OffloadOptions o;
  o.pinned_bytes = int64_t{512} << 20;
  o.device_pool_bytes = int64_t{512} << 20;
  o.inflight_bound_bytes = int64_t{16} << 20;
  OffloadEngine e(dev, compute, MemoryPolicy::uniform(kLayers, {"x"}), o);
  std::mt19937 rng(20261127);
  // The "kernels" that produce the tensors are device-to-device copies from one random
  // source at HBM speed, far faster than the link: the bound must hold them back.
  constexpr size_t kSourceBytes = size_t{64} << 20;
  constexpr size_t kMaxTensor = size_t{8} << 20;
  std::vector<unsigned char> source(kSourceBytes);
  for (unsigned char& b : source) b = static_cast<unsigned char>(rng());
  const AllocResult source_dev = dev.allocate(kSourceBytes, MemoryKind::kDevice);
  ASSERT_TRUE(source_dev) << source_dev.reason;
  dev.copy_async(source_dev.ptr, source.data(), kSourceBytes, compute);
  dev.synchronize(compute);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(step);
    e.begin_step();
    std::vector<std::vector<Produced>> layers(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      for (int k = 0; k < kPerLayer; ++k) {
        Produced p;
        p.bytes = 1 + rng() % kMaxTensor;  // odd sizes
        p.offset = rng() % (kSourceBytes - p.bytes);
        DeviceTensor t = e.allocate(p.bytes);
        ASSERT_TRUE(t) << "device pool";
        dev.copy_async(t.ptr, static_cast<const unsigned char*>(source_dev.ptr) + p.offset, p.bytes,
                       compute);
        p.handle = e.offload(t, l, "x");
        EXPECT_LE(e.inflight_bytes(), o.inflight_bound_bytes);
        layers[static_cast<size_t>(l)].push_back(p);
      }
      e.end_forward_layer(l);
    }
    std::vector<unsigned char> back;
    for (int l = kLayers - 1; l >= 0; --l) {
      e.prefetch(l);
      if (l > 0) e.prefetch(l - 1);
      for (size_t k = 0; k < layers[static_cast<size_t>(l)].size(); ++k) {
        Produced& p = layers[static_cast<size_t>(l)][k];
        back.assign(p.bytes, 0);
        if (k % 2 == 0) {  // into the engine's pool
          DeviceTensor r = e.reload(p.handle);
          dev.copy_async(back.data(), r.ptr, back.size(), compute);
          dev.synchronize(compute);
          e.free(r);
        } else {  // into memory the caller allocated
          const AllocResult dst = dev.allocate(back.size(), MemoryKind::kDevice);
          ASSERT_TRUE(dst) << dst.reason;
          e.reload_into(p.handle, dst.ptr);
          dev.copy_async(back.data(), dst.ptr, back.size(), compute);
          dev.synchronize(compute);
          dev.free(dst.ptr, MemoryKind::kDevice);
        }
        ASSERT_EQ(std::memcmp(back.data(), source.data() + p.offset, back.size()), 0)
            << "layer " << l << " tensor " << k << " (" << back.size() << " bytes)";
      }
    }
    const StepTelemetry tel = e.end_step();
    EXPECT_EQ(tel.tensors_offloaded, kLayers * kPerLayer);
    EXPECT_GT(tel.backpressure_ms, 0.0) << "the bound engaged";
  }
  EXPECT_LE(meter.max_inflight(), o.inflight_bound_bytes);
  dev.free(source_dev.ptr, MemoryKind::kDevice);
}

}  // namespace
}  // namespace spillway

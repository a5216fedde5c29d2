// The socket's will_need (include/spillway/device/hooks.hpp): a loop that names, before backward,
// the caller memory each saved tensor will be needed in gets its prefetched reloads there
// directly (no staging copy: StepTelemetry::reloads_staged stays 0); without it, prefetched
// reloads are staged and copied. Both bitwise, through CompositeHooks.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "spillway/core/policy.hpp"
#include "spillway/device/device.hpp"
#include "spillway/device/hooks.hpp"
#include "spillway/offload/offload.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

struct Outcome {
  int staged = 0;
  bool bitwise = true;
};

Outcome run(bool name_destinations) {
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 4.0, 4.0});
  const Stream compute = dev->create_stream(StreamRole::kCompute);
  const int layers = 4;
  MemoryPolicy p = MemoryPolicy::uniform(layers, {"mlp.act"});
  p.prefetch_depth = 1;
  OffloadOptions o;
  o.pinned_bytes = int64_t{8} << 20;
  o.device_pool_bytes = int64_t{8} << 20;
  OffloadEngine engine(*dev, compute, p, o);
  OffloadHooks offload(engine);
  CompositeHooks hooks({&offload});
  const size_t bytes = (size_t{256} << 10) + 7;
  std::mt19937 rng = spillway::testing::make_rng();
  std::vector<std::vector<unsigned char>> data(layers, std::vector<unsigned char>(bytes));
  std::vector<void*> src(layers), dst(layers);
  for (int l = 0; l < layers; ++l) {
    src[l] = dev->allocate(bytes, MemoryKind::kDevice).ptr;
    dst[l] = dev->allocate(bytes, MemoryKind::kDevice).ptr;
    for (unsigned char& b : data[l]) b = static_cast<unsigned char>(rng());
  }
  Outcome r;
  for (int step = 0; step < 2; ++step) {
    std::vector<SavedTicket> t(layers);
    hooks.step_begin();
    for (int l = 0; l < layers; ++l) {
      hooks.forward_begin(l);
      dev->copy_async(src[l], data[l].data(), bytes, compute);  // the producer
      std::vector<unsigned char> poison(bytes);
      for (size_t i = 0; i < bytes; ++i) poison[i] = static_cast<unsigned char>(~data[l][i]);
      dev->copy_async(dst[l], poison.data(), bytes, compute);
      dev->synchronize(compute);
      t[l] = hooks.saved(l, "mlp.act", SavedTensor{src[l], bytes, false, false});
      if (t[l] && name_destinations) hooks.will_need(t[l], dst[l]);
      hooks.forward_end(l);
    }
    for (int l = layers - 1; l >= 0; --l) {
      hooks.backward_begin(l);
      std::vector<unsigned char> back(bytes);
      if (t[l]) {
        EXPECT_EQ(hooks.needed(t[l], dst[l]), dst[l]);
        dev->copy_async(back.data(), dst[l], bytes, compute);
        hooks.done(t[l]);
      } else {
        dev->copy_async(back.data(), src[l], bytes, compute);  // the last layer: kept
      }
      dev->synchronize(compute);
      r.bitwise = r.bitwise && std::memcmp(back.data(), data[l].data(), bytes) == 0;
    }
    hooks.step_end();
    r.staged += offload.telemetry().reloads_staged;
  }
  for (int l = 0; l < layers; ++l) {
    dev->free(src[l], MemoryKind::kDevice);
    dev->free(dst[l], MemoryKind::kDevice);
  }
  return r;
}

TEST(HooksPrefetch, WillNeedLandsPrefetchedReloadsInCallerMemoryWithoutStaging) {
  const Outcome named = run(true);
  EXPECT_TRUE(named.bitwise);
  EXPECT_EQ(named.staged, 0);
  const Outcome unnamed = run(false);
  EXPECT_TRUE(unnamed.bitwise);
  EXPECT_GT(unnamed.staged, 0) << "prefetched reloads without a destination are staged";
}

}  // namespace
}  // namespace spillway

// Activation offload engine tests on the host backend: bitwise round trips, ordering under
// throttled copies, back-pressure at the bound, fallbacks, steady-state allocations,
// verify mode, and the snowball against the planner's prediction.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "d2h_meter.hpp"
#include "forwarding_device.hpp"
#include "spillway/core/error.hpp"
#include "spillway/offload/offload.hpp"
#include "spillway/plan/plan.hpp"
#include "test_support.hpp"
#include "virtual_clock_device.hpp"

namespace spillway {
namespace {

struct Rig {
  std::unique_ptr<Device> dev;
  Stream compute;
  explicit Rig(double d2h_gbps = 0.0, double h2d_gbps = 0.0, int64_t arena = int64_t{256} << 20) {
    dev = make_host_device(HostDeviceOptions{arena, d2h_gbps, h2d_gbps});
    compute = dev->create_stream(StreamRole::kCompute);
  }
};

// "Compute" that produces a tensor: a callback on the compute stream filling it with a
// pattern derived from (seed, layer, index); the engine only sees stream order.
void produce(Device& dev, Stream compute, DeviceTensor t, uint32_t tag, double sleep_ms = 0.0) {
  dev.host_callback(compute, [t, tag, sleep_ms] {
    if (sleep_ms > 0)
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(sleep_ms));
    std::mt19937 g(tag);
    auto* p = static_cast<unsigned char*>(t.ptr);
    for (size_t i = 0; i < t.bytes; ++i) p[i] = static_cast<unsigned char>(g());
  });
}
void produce(Rig& r, DeviceTensor t, uint32_t tag, double sleep_ms = 0.0) {
  produce(*r.dev, r.compute, t, tag, sleep_ms);
}

// A consumer on the compute stream: checks the reloaded bytes in stream order.
void consume(Device& dev, Stream compute, DeviceTensor t, uint32_t tag, std::atomic<int>* bad) {
  dev.host_callback(compute, [t, tag, bad] {
    std::mt19937 g(tag);
    const auto* p = static_cast<const unsigned char*>(t.ptr);
    for (size_t i = 0; i < t.bytes; ++i) {
      if (p[i] != static_cast<unsigned char>(g())) {
        ++*bad;
        return;
      }
    }
  });
}
void consume(Rig& r, DeviceTensor t, uint32_t tag, std::atomic<int>* bad) {
  consume(*r.dev, r.compute, t, tag, bad);
}

// The emulated device on a clock the test owns (Note [A virtual clock for windows] in
// virtual_clock_device.hpp): layer times and copy times are the test's numbers, so whether
// a copy fits its window is decided here, not by how the machine schedules the copy
// thread against compute.
struct VirtualRig {
  std::unique_ptr<Device> inner;
  std::unique_ptr<spillway::testing::VirtualClockDevice> clock;
  Stream compute;
  VirtualRig(double d2h_gbps, int64_t arena = int64_t{256} << 20) {
    inner = make_host_device(HostDeviceOptions{arena, 0.0, 0.0});
    clock = std::make_unique<spillway::testing::VirtualClockDevice>(*inner, d2h_gbps);
    compute = dev().create_stream(StreamRole::kCompute);
  }
  Device& dev() { return *clock; }
  // A layer's kernel of `ms` virtual ms that produces t (filled from tag when it ends).
  void produce(DeviceTensor t, uint32_t tag, double ms) {
    clock->kernel(compute, ms, [t, tag] {
      std::mt19937 g(tag);
      auto* p = static_cast<unsigned char*>(t.ptr);
      for (size_t i = 0; i < t.bytes; ++i) p[i] = static_cast<unsigned char>(g());
    });
  }
};

// One training step over `layers` layers with `per_layer` tensors of random sizes.
StepTelemetry run_step(Rig& r, OffloadEngine& e, int layers, int per_layer, uint32_t seed,
                       std::atomic<int>* bad, double compute_ms = 0.0,
                       std::vector<size_t>* sizes_out = nullptr) {
  std::mt19937 rng(seed);
  e.begin_step();
  std::vector<std::vector<std::pair<OffloadHandle, uint32_t>>> handles(static_cast<size_t>(layers));
  std::vector<std::vector<std::pair<DeviceTensor, uint32_t>>> kept(static_cast<size_t>(layers));
  const char* names[] = {"mlp.gate_out", "mlp.up_out", "mlp.act", "attn.input"};
  for (int l = 0; l < layers; ++l) {
    for (int k = 0; k < per_layer; ++k) {
      // Sizes from 1 byte to ~1 MB, odd ones included (alignment), like bf16/fp32/int8 tensors.
      const size_t elem = size_t{1} << (rng() % 3);
      const size_t bytes = elem * (1 + rng() % (size_t{256} * 1024));
      if (sizes_out) sizes_out->push_back(bytes);
      DeviceTensor t = e.allocate(bytes);
      const uint32_t tag = seed * 7919u + static_cast<uint32_t>(l * 131 + k);
      produce(r, t, tag, k == 0 ? compute_ms : 0.0);
      const char* name = names[k % 4];
      if (e.wants(l, name)) {
        handles[static_cast<size_t>(l)].emplace_back(e.offload(t, l, name), tag);
      } else {
        kept[static_cast<size_t>(l)].emplace_back(t, tag);
      }
    }
    e.end_forward_layer(l);
  }
  const int depth = e.policy().prefetch_depth;
  for (int l = layers - 1; l >= 0; --l) {
    for (int p = 1; p <= depth; ++p) e.prefetch(l - p);
    for (auto& [h, tag] : handles[static_cast<size_t>(l)]) {
      DeviceTensor t = e.reload(h);
      consume(r, t, tag, bad);
      e.free(t);
    }
    for (auto& [t, tag] : kept[static_cast<size_t>(l)]) {
      consume(r, t, tag, bad);
      e.free(t);
    }
  }
  return e.end_step();
}

MemoryPolicy all_names(int layers) {
  return MemoryPolicy::uniform(layers, {"mlp.gate_out", "mlp.up_out", "mlp.act", "attn.input"});
}

TEST(OffloadEngine, RoundTripsAreBitwiseEqualWithManyTensorsInFlight) {
  const uint32_t seed = 1234;
  std::cout << "seed " << seed << "\n";
  for (double gbps : {0.0, 8.0}) {
    SCOPED_TRACE(gbps);
    Rig r(gbps, gbps);
    OffloadOptions o;
    o.pinned_bytes = int64_t{256} << 20;
    o.device_pool_bytes = int64_t{128} << 20;
    OffloadEngine e(*r.dev, r.compute, all_names(12), o);
    std::atomic<int> bad{0};
    const StepTelemetry t = run_step(r, e, 12, 4, seed, &bad);
    EXPECT_EQ(bad.load(), 0);
    EXPECT_EQ(t.tensors_offloaded, 11 * 4);  // the last layer keeps its tensors
    EXPECT_EQ(t.d2h_bytes, t.h2d_bytes);
    EXPECT_GT(t.d2h_bytes, 0);
    EXPECT_EQ(t.fallback_kept, 0);
  }
}

// A device that forwards to another and logs the destination of every copy, in the order
// the copies were enqueued.
class CopyLog final : public spillway::testing::ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  std::vector<void*> dsts;
  std::vector<int> wait_streams;  // the stream of every wait, in order
  void wait(Stream s, Event e) override {
    wait_streams.push_back(s.id);
    inner().wait(s, e);
  }
  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    dsts.push_back(dst);
    inner().copy_async(dst, src, bytes, s);
  }
};

TEST(OffloadEngine, PrefetchIssuesTheLayersBackwardNeedsFirst) {
  // prefetch(l - 1) at the start of layer l's backward, before reload() of layer l: the
  // reloads of l go to the H2D stream ahead of those of l - 1 (the order of need).
  Rig r;
  CopyLog log(*r.dev);
  OffloadEngine e(log, r.compute, all_names(4), OffloadOptions{});
  e.begin_step();
  std::vector<OffloadHandle> h;
  for (int l = 0; l < 4; ++l) {
    DeviceTensor t = e.allocate(4096);
    produce(r, t, static_cast<uint32_t>(l));
    if (e.wants(l, "mlp.act"))
      h.push_back(e.offload(t, l, "mlp.act"));
    else
      e.free(t);
    e.end_forward_layer(l);
  }
  ASSERT_EQ(h.size(), 3u);  // layers 0..2; the last layer keeps its tensors
  const size_t forward_copies = log.dsts.size();
  e.prefetch(1);  // at layer 2's backward: 2 is needed first, then 1
  std::atomic<int> bad{0};
  std::vector<void*> reloaded;
  for (int l = 2; l >= 0; --l) {
    if (l >= 1) e.prefetch(l - 1);
    DeviceTensor t = e.reload(h[static_cast<size_t>(l)]);
    consume(r, t, static_cast<uint32_t>(l), &bad);
    reloaded.push_back(t.ptr);
    e.free(t);
  }
  e.end_step();
  EXPECT_EQ(bad.load(), 0);
  const std::vector<void*> h2d(log.dsts.begin() + static_cast<std::ptrdiff_t>(forward_copies),
                               log.dsts.end());
  EXPECT_EQ(h2d, reloaded);  // layer 2, then 1, then 0
}

// One step's forward over `layers` layers of three 64 KiB tensors, each filled from its tag
// (seed + layer * 10 + index): the first `offloaded` layers' tensors are offloaded, the
// others freed. Their handles, by layer.
std::vector<std::vector<OffloadHandle>> forward_threes(Rig& r, OffloadEngine& e, int layers,
                                                       int offloaded, uint32_t seed) {
  std::vector<std::vector<OffloadHandle>> h(static_cast<size_t>(offloaded));
  const char* names[] = {"mlp.gate_out", "mlp.up_out", "mlp.act"};
  for (int l = 0; l < layers; ++l) {
    for (int k = 0; k < 3; ++k) {
      DeviceTensor t = e.allocate(64 << 10);
      produce(r, t, seed + static_cast<uint32_t>(l * 10 + k));
      if (l < offloaded) {
        h[static_cast<size_t>(l)].push_back(e.offload(t, l, names[k]));
      } else {
        e.free(t);
      }
    }
    e.end_forward_layer(l);
  }
  return h;
}

// Its backward: at each layer, last first, prefetch(l - 1), then every tensor of l reloaded,
// checked against its tag on the compute stream (mismatches counted in *bad) and freed.
void backward_threes(Rig& r, OffloadEngine& e, const std::vector<std::vector<OffloadHandle>>& h,
                     uint32_t seed, std::atomic<int>* bad) {
  for (int l = static_cast<int>(h.size()) - 1; l >= 0; --l) {
    e.prefetch(l - 1);
    for (int k = 0; k < 3; ++k) {
      DeviceTensor t = e.reload(h[static_cast<size_t>(l)][static_cast<size_t>(k)]);
      consume(r, t, seed + static_cast<uint32_t>(l * 10 + k), bad);
      e.free(t);
    }
  }
}

TEST(OffloadEngine, ComputeWaitsOncePerLayerOfReloads) {
  // Note [One wait per layer]: reload() of a layer's first tensor orders compute after
  // the layer's last issued reload; its other tensors need no wait of their own.
  Rig r(0.5, 0.5);  // slow copies: the waits are needed, and the data must still be right
  CopyLog log(*r.dev);
  OffloadOptions o;
  o.device_pool_bytes = int64_t{8} << 20;
  OffloadEngine e(log, r.compute, all_names(3), o);
  e.begin_step();
  const std::vector<std::vector<OffloadHandle>> h = forward_threes(r, e, 3, 2, 0);
  log.wait_streams.clear();
  std::atomic<int> bad{0};
  backward_threes(r, e, h, 0, &bad);
  e.end_step();
  EXPECT_EQ(bad.load(), 0);
  const auto compute_waits =
      std::count(log.wait_streams.begin(), log.wait_streams.end(), r.compute.id);
  EXPECT_EQ(compute_waits, 2) << "one per layer reloaded";
}

TEST(OffloadEngine, TheH2DStreamWaitsForTheOffloadsOnceNotPerTensor) {
  // Note [One H2D wait]: the D2H copies complete in issue order, so the first reload
  // issued (the last offloaded layer's, through prefetch) waits for that layer's last copy,
  // which orders every reload of the step after its own copy: one H2D wait where there
  // were 3 x 3. Slow copies, so the waits matter, and every byte is checked.
  Rig r(0.5, 0.5);
  CopyLog log(*r.dev);
  OffloadOptions o;
  o.device_pool_bytes = int64_t{8} << 20;
  OffloadEngine e(log, r.compute, all_names(4), o);
  for (int step = 0; step < 2; ++step) {
    const auto seed = static_cast<uint32_t>(step * 100);
    e.begin_step();
    const std::vector<std::vector<OffloadHandle>> h = forward_threes(r, e, 4, 3, seed);
    log.wait_streams.clear();
    std::atomic<int> bad{0};
    backward_threes(r, e, h, seed, &bad);
    const auto compute_waits =
        std::count(log.wait_streams.begin(), log.wait_streams.end(), r.compute.id);
    EXPECT_EQ(static_cast<long>(log.wait_streams.size() - compute_waits), 1)
        << "step " << step << ": the H2D stream's waits for the offload copies";
    e.end_step();
    EXPECT_EQ(bad.load(), 0) << "step " << step;
  }
}

TEST(OffloadEngine, AHeldTensorStaysOnTheDeviceUntilItsLayerEnds) {
  // Note [Offload hold]: with kUntilLayerEnd the forward may still read the tensor after
  // offload(): its device memory goes back only once the copy is done and the layer ended.
  Rig r;
  OffloadOptions o;
  o.pinned_bytes = int64_t{16} << 20;
  o.device_pool_bytes = int64_t{16} << 20;
  OffloadEngine e(*r.dev, r.compute, all_names(3), o);
  e.begin_step();
  const size_t bytes = size_t{1} << 20;
  auto direct = [&] {
    DeviceTensor t;
    t.ptr = r.dev->allocate(bytes, MemoryKind::kDevice).ptr;
    EXPECT_NE(t.ptr, nullptr);
    t.bytes = bytes;
    t.direct = true;
    return t;
  };
  const int64_t before = r.dev->memory_stats().current[0];
  DeviceTensor held = direct();
  DeviceTensor plain = direct();
  produce(r, held, 1);
  produce(r, plain, 2);
  const OffloadHandle h = e.offload(held, 0, "mlp.act", OffloadHold::kUntilLayerEnd);
  const OffloadHandle p = e.offload(plain, 0, "mlp.up_out");
  r.dev->synchronize(e.d2h_stream());  // both copies done
  e.prefetch(-1);                      // any engine call polls
  EXPECT_EQ(r.dev->memory_stats().current[0] - before, static_cast<int64_t>(bytes))
      << "the plain tensor goes back, the held one stays";
  std::atomic<int> bad{0};
  consume(r, held, 1, &bad);  // the forward still reads it: intact
  r.dev->synchronize(r.compute);
  EXPECT_EQ(bad.load(), 0);
  e.end_forward_layer(0);
  EXPECT_EQ(r.dev->memory_stats().current[0], before);
  const DeviceTensor a = e.reload(h);
  const DeviceTensor b = e.reload(p);
  consume(r, a, 1, &bad);
  consume(r, b, 2, &bad);
  e.free(a);
  e.free(b);
  e.end_step();
  EXPECT_EQ(bad.load(), 0);
}

TEST(OffloadEngine, ReloadConsumersNeverSeeStaleDataWhenCopiesAreSlowerThanCompute) {
  // 0.5 GB/s copies, near-free compute: every reload is still in flight when its consumer
  // is enqueued; the consumer must wait for it, and the device blocks (recycled from the
  // pool, holding other tensors' bytes) must not leak into what it reads.
  Rig r(0.5, 0.5);
  OffloadOptions o;
  o.device_pool_bytes = int64_t{8} << 20;  // small: blocks are reused across tensors
  OffloadEngine e(*r.dev, r.compute, all_names(6), o);
  std::atomic<int> bad{0};
  for (uint32_t step = 0; step < 2; ++step) run_step(r, e, 6, 3, 99 + step, &bad);
  EXPECT_EQ(bad.load(), 0);
}

// Note [Adopted streams]: the engine on a compute stream the caller made (a HostStream,
// as a PyTorch adapter on CPU would hand over), adopted by the device. The caller's own
// work on that stream writes each tensor slowly, after the engine allocated it poisoned
// and before offload() is called; the engine's D2H copy is ordered after it by an event,
// never by the host, so the bytes reloaded in backward are the written ones, bitwise.
TEST(OffloadEngine, OnAnAdoptedComputeStreamCopiesFollowTheCallersWork) {
  const uint32_t seed = 2718;
  std::cout << "seed " << seed << "\n";
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 2.0, 2.0});
  HostStream caller;
  const Stream compute = dev->adopt_stream(caller.native(), StreamRole::kCompute);
  constexpr int kLayers = 3;
  constexpr int kPerLayer = 2;
  std::atomic<int> bad{0};
  {
    OffloadOptions o;
    o.pinned_bytes = int64_t{8} << 20;
    o.device_pool_bytes = int64_t{8} << 20;
    OffloadEngine e(*dev, compute, all_names(kLayers + 1), o);
    e.begin_step();
    std::vector<std::pair<OffloadHandle, uint32_t>> handles;
    std::mt19937 rng(seed);
    for (int l = 0; l < kLayers; ++l) {
      for (int k = 0; k < kPerLayer; ++k) {
        const size_t bytes = 1 + rng() % (size_t{512} << 10);
        DeviceTensor t = e.allocate(bytes);
        std::memset(t.ptr, 0xA5, bytes);  // poison: a copy that ran early would carry it
        const uint32_t tag = seed + static_cast<uint32_t>(l * 16 + k);
        caller.launch([t, tag] {
          std::this_thread::sleep_for(std::chrono::milliseconds(15));
          std::mt19937 g(tag);
          auto* p = static_cast<unsigned char*>(t.ptr);
          for (size_t i = 0; i < t.bytes; ++i) p[i] = static_cast<unsigned char>(g());
        });
        handles.emplace_back(e.offload(t, l, "mlp.act"), tag);
      }
      e.end_forward_layer(l);
    }
    for (int l = kLayers - 1; l >= 0; --l) {
      e.prefetch(l);
      for (int k = 0; k < kPerLayer; ++k) {
        const auto [h, tag] = handles[static_cast<size_t>(l * kPerLayer + k)];
        DeviceTensor t = e.reload(h);
        // The caller's consumer, on its own stream: ordered after the reload by the engine.
        caller.launch([t, tag = tag, &bad] {
          std::mt19937 g(tag);
          const auto* p = static_cast<const unsigned char*>(t.ptr);
          for (size_t i = 0; i < t.bytes; ++i) {
            if (p[i] != static_cast<unsigned char>(g())) {
              ++bad;
              return;
            }
          }
        });
        e.free(t);
      }
    }
    const StepTelemetry tel = e.end_step();
    EXPECT_EQ(tel.tensors_offloaded, kLayers * kPerLayer);
    EXPECT_EQ(tel.fallback_kept, 0);
  }
  caller.synchronize();
  EXPECT_EQ(bad.load(), 0);
  dev->destroy_stream(compute);
  caller.launch([] {});  // the caller's stream lives on
  caller.synchronize();
}

TEST(OffloadEngine, BackPressureEngagesExactlyAtTheBound) {
  VirtualRig r(0.25);  // 1 MB takes 4 ms of the test's clock: nothing lands unless waited for
  OffloadOptions o;
  const size_t mb = 1 << 20;
  o.inflight_bound_bytes = 3 * static_cast<int64_t>(mb);
  OffloadEngine e(r.dev(), r.compute, MemoryPolicy::uniform(2, {"x"}), o);
  e.begin_step();
  std::vector<OffloadHandle> hs;
  for (int k = 0; k < 3; ++k) {
    DeviceTensor t = e.allocate(mb);
    r.produce(t, static_cast<uint32_t>(k), 0.0);
    hs.push_back(e.offload(t, 0, "x"));
  }
  // At the bound, not over it: no waiting yet, all three in flight.
  EXPECT_EQ(e.inflight_bytes(), 3 * static_cast<int64_t>(mb));
  DeviceTensor t = e.allocate(mb);
  r.produce(t, 3, 0.0);
  hs.push_back(e.offload(t, 0, "x"));
  // One over: the engine waited until the oldest finished.
  EXPECT_LE(e.inflight_bytes(), 3 * static_cast<int64_t>(mb));
  e.end_forward_layer(0);
  std::atomic<int> bad{0};
  for (size_t k = 0; k < hs.size(); ++k) {
    DeviceTensor back = e.reload(hs[k]);
    consume(r.dev(), r.compute, back, static_cast<uint32_t>(k), &bad);
    e.free(back);
  }
  const StepTelemetry tel = e.end_step();
  EXPECT_GT(tel.backpressure_ms, 0.0);
  EXPECT_EQ(bad.load(), 0);
}

TEST(OffloadEngine, TheLinkNeverQueuesMoreThanTheBound) {
  // Measured by the device, not by the engine: the wait comes before the enqueue, so the
  // queue never holds more than the bound (a copy enqueued, then waited for, would
  // overshoot it by one tensor).
  std::mt19937 rng = spillway::testing::make_rng();
  // On the test's clock (Note [A virtual clock for windows]): the bound engages however
  // the copy thread is scheduled.
  auto inner = make_host_device(HostDeviceOptions{int64_t{256} << 20, 0.0, 0.0});
  spillway::testing::VirtualClockDevice clock(*inner, 0.1);
  spillway::testing::D2HMeter dev(clock);
  const Stream compute = dev.create_stream(StreamRole::kCompute, 0);
  OffloadOptions o;
  o.pinned_bytes = int64_t{64} << 20;
  o.device_pool_bytes = int64_t{64} << 20;
  o.inflight_bound_bytes = int64_t{1} << 20;
  OffloadEngine e(dev, compute, MemoryPolicy::uniform(2, {"x"}), o);
  e.begin_step();
  std::vector<std::pair<OffloadHandle, uint32_t>> hs;
  for (int k = 0; k < 24; ++k) {
    DeviceTensor t = e.allocate(1 + rng() % (size_t{512} << 10));
    const auto tag = static_cast<uint32_t>(rng());
    produce(dev, compute, t, tag);
    hs.emplace_back(e.offload(t, 0, "x"), tag);
    EXPECT_LE(e.inflight_bytes(), o.inflight_bound_bytes);
  }
  e.end_forward_layer(0);
  std::atomic<int> bad{0};
  for (auto& [h, tag] : hs) {
    DeviceTensor back = e.reload(h);
    consume(dev, compute, back, tag, &bad);
    e.free(back);
  }
  const StepTelemetry tel = e.end_step();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(tel.backpressure_ms, 0.0) << "the bound engaged";
  EXPECT_LE(dev.max_inflight(), o.inflight_bound_bytes);
}

TEST(OffloadEngine, NoAllocationPerTensorInSteadyState) {
  Rig r;
  OffloadOptions o;
  o.device_pool_bytes = int64_t{96} << 20;
  OffloadEngine e(*r.dev, r.compute, all_names(8), o);
  const int64_t after_construction = [&] {
    const MemoryStats s = r.dev->memory_stats();
    return s.allocations[0] + s.allocations[1] + s.allocations[2] + s.allocations[3];
  }();
  std::atomic<int> bad{0};
  for (uint32_t step = 0; step < 4; ++step) {
    const StepTelemetry t = run_step(r, e, 8, 3, 7, &bad);
    EXPECT_EQ(t.device_allocations, 0) << "step " << step;
    EXPECT_EQ(t.fallback_direct, 0) << "step " << step;
  }
  const MemoryStats s = r.dev->memory_stats();
  EXPECT_EQ(s.allocations[0] + s.allocations[1] + s.allocations[2] + s.allocations[3],
            after_construction);
  EXPECT_EQ(bad.load(), 0);
}

TEST(OffloadEngine, FullPoolsFallBackWithoutLosingData) {
  Rig r;
  OffloadOptions o;
  o.pinned_bytes = int64_t{2} << 20;  // far too small: most tensors stay on the device
  o.pinned_slabs = 1;
  o.device_pool_bytes = int64_t{4} << 20;  // too small too: direct allocations
  OffloadEngine e(*r.dev, r.compute, all_names(6), o);
  std::atomic<int> bad{0};
  const StepTelemetry t = run_step(r, e, 6, 3, 5, &bad);
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(t.fallback_kept, 0);
  EXPECT_GT(t.fallback_direct, 0);
}

TEST(OffloadEngine, VerifyModeChecksumsEveryTensor) {
  Rig r(4.0, 4.0);
  OffloadOptions o;
  o.verify = true;
  OffloadEngine e(*r.dev, r.compute, all_names(5), o);
  std::atomic<int> bad{0};
  EXPECT_NO_THROW(run_step(r, e, 5, 3, 11, &bad));
  EXPECT_EQ(bad.load(), 0);
}

TEST(OffloadEngine, MisuseIsAnError) {
  Rig r;
  OffloadEngine e(*r.dev, r.compute, all_names(2), OffloadOptions{});
  EXPECT_THROW(e.offload(DeviceTensor{}, 0, "x"), Error);  // outside a step
  e.begin_step();
  EXPECT_THROW(e.reload(42), Error);
  DeviceTensor t = e.allocate(64);
  produce(r, t, 1);
  const OffloadHandle h = e.offload(t, 0, "mlp.act");
  DeviceTensor back = e.reload(h);
  EXPECT_THROW(e.reload(h), Error);
  e.free(back);
  e.end_step();
}

// Bad calls of the C++ API are InputErrors on the caller's thread, naming the value.
TEST(OffloadEngine, ALayerOutsideThePolicyIsAnInputError) {
  Rig r;
  OffloadEngine e(*r.dev, r.compute, all_names(2), OffloadOptions{});
  e.begin_step();
  for (int layer : {2, 5, -1, 1000000}) {
    SCOPED_TRACE(layer);
    DeviceTensor t = e.allocate(64);
    produce(r, t, 1);
    try {
      e.offload(t, layer, "mlp.act");
      ADD_FAILURE() << "accepted";
    } catch (const InputError& err) {
      EXPECT_EQ(err.field(), "layer");
      EXPECT_EQ(err.value(), std::to_string(layer));
      EXPECT_NE(std::string(err.what()).find("[0, 2)"), std::string::npos) << err.what();
    }
    e.free(t);  // not taken: still the caller's
    std::vector<unsigned char> src(64);
    EXPECT_THROW(e.offload_borrowed(src.data(), src.size(), layer, "mlp.act"), InputError);
  }
  // Nothing was taken: the layers in the policy still work, and nothing is in flight.
  EXPECT_EQ(e.inflight_bytes(), 0);
  DeviceTensor t = e.allocate(64);
  produce(r, t, 2);
  const OffloadHandle h = e.offload(t, 1, "mlp.act");
  e.end_forward_layer(0);
  e.end_forward_layer(1);
  std::atomic<int> bad{0};
  DeviceTensor back = e.reload(h);
  consume(r, back, 2, &bad);
  e.free(back);
  const StepTelemetry tel = e.end_step();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(tel.tensors_offloaded, 1);
  EXPECT_EQ(tel.layers[1].d2h_bytes, 64);
}

TEST(OffloadEngine, ASecondFreeIsAnInputError) {
  Rig r;
  OffloadEngine e(*r.dev, r.compute, all_names(2), OffloadOptions{});
  e.begin_step();
  // Twice before the engine gave the first back (both still queued: Note [Batched
  // frees]), and twice after it did.
  DeviceTensor a = e.allocate(4096);
  e.free(a);
  testing::expect_error([&] { e.free(a); }, {"t is ", "freed twice"});
  DeviceTensor b = e.allocate(4096);
  produce(r, b, 3);
  const OffloadHandle h = e.offload(b, 0, "mlp.act");
  e.end_forward_layer(0);
  DeviceTensor back = e.reload(h);
  e.free(back);
  r.dev->synchronize(r.compute);
  e.prefetch(-1);  // any engine call polls: the block goes back to the pool
  try {
    e.free(back);
    ADD_FAILURE() << "a second free() accepted";
  } catch (const InputError& err) {
    EXPECT_EQ(err.field(), "t");
    EXPECT_NE(std::string(err.what()).find("freed twice"), std::string::npos) << err.what();
  }
  e.end_step();
  // The engine is still usable: a step after the refused calls.
  std::atomic<int> bad{0};
  run_step(r, e, 2, 2, 9, &bad);
  EXPECT_EQ(bad.load(), 0);
}

// The test device itself (Note [A virtual clock for windows]): an event completes exactly
// when the clock reaches it, and the clock moves only when the host waits. The pause
// gives a wrong device (one that let the copy run on wall time) every chance to show it.
TEST(VirtualClockDevice, EventsCompleteExactlyWhenTheClockReachesThem) {
  auto inner = make_host_device(HostDeviceOptions{int64_t{16} << 20, 0.0, 0.0});
  spillway::testing::VirtualClockDevice clock(*inner, 1.0);
  Device& dev = clock;
  const Stream compute = dev.create_stream(StreamRole::kCompute);
  const Stream d2h = dev.create_stream(StreamRole::kD2H);
  const Event produced = dev.create_event();
  const Event copied = dev.create_event();
  const size_t bytes = 1000000;  // 1 ms at 1 GB/s
  std::vector<unsigned char> src(bytes, 0x5A), dst(bytes, 0);
  clock.kernel(compute, 8.0, [&] { std::fill(src.begin(), src.end(), 0xA5); });
  dev.record(produced, compute);
  dev.wait(d2h, produced);
  dev.copy_async(dst.data(), src.data(), bytes, d2h);
  dev.record(copied, d2h);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(dev.query(produced));
  EXPECT_FALSE(dev.query(copied));
  dev.synchronize(produced);  // the host waits 8 ms of the clock
  EXPECT_EQ(clock.now_ms(), 8.0);
  EXPECT_TRUE(dev.query(produced));
  EXPECT_FALSE(dev.query(copied)) << "due at 9 ms";
  EXPECT_EQ(dst[0], 0);
  dev.synchronize(d2h);
  EXPECT_EQ(clock.now_ms(), 9.0);
  EXPECT_TRUE(dev.query(copied));
  EXPECT_EQ(dst, std::vector<unsigned char>(bytes, 0xA5));  // after the kernel, in order
  dev.destroy_event(produced);
  dev.destroy_event(copied);
  dev.destroy_stream(d2h);
  dev.destroy_stream(compute);
}

// Layers of `compute_ms` each, layer l producing bytes[l]; copies at `gbps` on the virtual
// clock. Layer l is late iff its copies do not fit the next layer's forward (the
// no-snowball condition, docs/offload.md: V / B > T_fwd(l + 1)), the first late layer is
// the snowball; every reloaded byte is checked.
StepTelemetry window_run(double gbps, const std::vector<size_t>& bytes, double compute_ms,
                         int64_t inflight_bound = 0) {
  const int layers = static_cast<int>(bytes.size());
  int64_t total = 0;
  for (size_t b : bytes) total += static_cast<int64_t>(b);
  VirtualRig r(gbps, 2 * total + (int64_t{32} << 20));
  OffloadOptions o;
  o.inflight_bound_bytes = inflight_bound;
  o.pinned_bytes = total + (int64_t{8} << 20);
  o.pinned_slabs = 1;  // room for every tensor, the largest included
  o.device_pool_bytes = total + (int64_t{8} << 20);
  OffloadEngine e(r.dev(), r.compute, MemoryPolicy::uniform(layers, {"mlp.act"}), o);
  e.begin_step();
  std::vector<std::pair<OffloadHandle, uint32_t>> hs;
  for (int l = 0; l < layers; ++l) {
    DeviceTensor t = e.allocate(bytes[static_cast<size_t>(l)]);
    const auto tag = static_cast<uint32_t>(l);
    r.produce(t, tag, compute_ms);
    if (e.wants(l, "mlp.act")) {
      hs.emplace_back(e.offload(t, l, "mlp.act"), tag);
    } else {
      e.free(t);
    }
    // The host runs ahead of the device by design; pace it like a framework whose next
    // layer's kernels are issued once this layer's are (the clock moves to its end).
    r.dev().synchronize(r.compute);
    e.end_forward_layer(l);
  }
  std::atomic<int> bad{0};
  for (auto it = hs.rbegin(); it != hs.rend(); ++it) {
    DeviceTensor back = e.reload(it->first);
    consume(r.dev(), r.compute, back, it->second, &bad);
    e.free(back);
  }
  StepTelemetry tel = e.end_step();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(tel.fallback_kept, 0) << "a kept tensor is never late: the window test is moot";
  return tel;
}

TEST(OffloadEngine, SnowballReportedAtTheFirstLayerAsThePlannerPredicts) {
  const size_t mb = 1000000;      // V = 1 MB
  const double compute_ms = 8.0;  // T_fwd = 8 ms
  // V / B = 1 ms at 1 GB/s against an 8 ms forward: fits.
  const StepTelemetry fits = window_run(1.0, std::vector<size_t>(12, mb), compute_ms);
  EXPECT_FALSE(fits.snowball);
  int64_t worst = 0;
  for (const LayerTelemetry& l : fits.layers) worst = std::max(worst, l.backlog_bytes);
  EXPECT_EQ(worst, static_cast<int64_t>(mb)) << "bounded: the ending layer's copy alone";
  // 32 ms at 1/32 GB/s against 8 ms: 4x over, from layer 0.
  const StepTelemetry over = window_run(1.0 / 32.0, std::vector<size_t>(12, mb), compute_ms);
  ASSERT_TRUE(over.snowball);
  EXPECT_EQ(*over.snowball_first_layer, 0);
  EXPECT_TRUE(over.layers[0].late);
  // The backlog grows layer over layer.
  EXPECT_GT(over.layers[8].backlog_bytes, over.layers[2].backlog_bytes);
  // Exactly at the window (8 MB at 1 GB/s: 8 ms) still fits; one layer of 9 MB (9 ms) is
  // the first late one, though its neighbours fit: the snowball names it, not layer 0.
  std::vector<size_t> one_big(12, mb);
  one_big[4] = 8 * mb;
  EXPECT_FALSE(window_run(1.0, one_big, compute_ms).snowball);
  one_big[4] = 9 * mb;
  const StepTelemetry big = window_run(1.0, one_big, compute_ms);
  ASSERT_TRUE(big.snowball);
  EXPECT_EQ(*big.snowball_first_layer, 4);
  EXPECT_FALSE(big.layers[3].late);
  EXPECT_TRUE(big.layers[4].late);
}

TEST(OffloadEngine, UnderBackPressureTheSnowballIsTheLayerWhereTheBacklogStarts) {
  // Note [Back-pressure and the snowball]: with copies in flight bounded at one layer, a
  // link 4x too slow holds the forward back at each offload, so every copy ends before the
  // next layer's forward does; the snowball is still there (the forward runs at the link's
  // pace) and starts at layer 0, as the planner says, not at the last offloading layer.
  const size_t mb = 1000000;
  const auto bound = static_cast<int64_t>(mb);
  const StepTelemetry over = window_run(1.0 / 32.0, std::vector<size_t>(8, mb), 8.0, bound);
  ASSERT_TRUE(over.snowball);
  EXPECT_EQ(*over.snowball_first_layer, 0);
  EXPECT_GT(over.backpressure_ms, 0.0);
  // A link with room to spare (1 ms copies in 8 ms windows) waits only while compute is
  // busy and reports nothing.
  const StepTelemetry fits = window_run(1.0, std::vector<size_t>(8, mb), 8.0, bound);
  EXPECT_FALSE(fits.snowball);
  EXPECT_GT(fits.backpressure_ms, 0.0) << "the bound engaged";
  // The backlog starts at layer 3 (a 24 ms copy, 3x its window): the snowball names it.
  std::vector<size_t> one_big(8, mb);
  one_big[3] = 24 * mb;
  const StepTelemetry big = window_run(1.0, one_big, 8.0, 24 * bound);
  ASSERT_TRUE(big.snowball);
  EXPECT_EQ(*big.snowball_first_layer, 3);
}

}  // namespace
}  // namespace spillway

namespace spillway {
namespace {

// The engine against the planner: the same tiny model planned with `--policy offload`,
// calibrated to the layer time the engine's "compute" takes, at a link speed the planner
// judges clean or snowballing; the engine, throttled to that speed and driven by the
// plan's policy, must agree, naming the same first layer.
Plan tiny_plan(double d2h_gbps, double layer_ms, PlanRequest* out) {
  const nlohmann::json cfg = {{"model_type", "llama"},    {"hidden_size", 128},
                              {"num_hidden_layers", 24},  {"num_attention_heads", 4},
                              {"num_key_value_heads", 4}, {"intermediate_size", 512},
                              {"vocab_size", 1000}};
  PlanRequest r;
  r.model = parse_model_config(cfg, "tiny", "test");
  r.hardware = load_hardware("gh200");
  r.work.shape.micro_batch = 1;
  r.work.shape.seq_len = 64;
  r.strategy = Policy::kOffload;
  r.margin = 0.0;
  r.layer_fwd_ms = layer_ms;
  r.d2h_gbps = d2h_gbps;
  r.h2d_gbps = 10.0;
  r.hbm_budget_gb = 1e4;
  *out = r;
  return make_plan(r);
}

StepTelemetry run_plan_on_engine(const Plan& plan, double d2h_gbps, double layer_ms) {
  VirtualRig r(d2h_gbps);  // Note [A virtual clock for windows]
  OffloadEngine e(r.dev(), r.compute, memory_policy(plan, "plan", 1), OffloadOptions{});
  e.begin_step();
  std::vector<std::pair<OffloadHandle, uint32_t>> hs;
  for (size_t l = 0; l < plan.layers.size(); ++l) {
    r.clock->kernel(r.compute, layer_ms);
    for (const TensorPlan& t : plan.layers[l].tensors) {
      if (!e.wants(static_cast<int>(l), t.name)) continue;
      DeviceTensor d = e.allocate(static_cast<size_t>(t.bytes));
      const uint32_t tag = static_cast<uint32_t>(l * 100 + hs.size());
      r.produce(d, tag, 0.0);
      hs.emplace_back(e.offload(d, static_cast<int>(l), t.name), tag);
    }
    r.dev().synchronize(r.compute);  // pace the host like a framework issuing layer by layer
    e.end_forward_layer(static_cast<int>(l));
  }
  std::atomic<int> bad{0};
  for (auto it = hs.rbegin(); it != hs.rend(); ++it) {
    DeviceTensor back = e.reload(it->first);
    consume(r.dev(), r.compute, back, it->second, &bad);
    e.free(back);
  }
  StepTelemetry t = e.end_step();
  EXPECT_EQ(bad.load(), 0);
  return t;
}

TEST(OffloadEngineVsPlanner, SnowballVerdictAndFirstLayerAgree) {
  const double layer_ms = 8.0;
  for (double gbps : {0.2, 0.006}) {  // V/B = 1 ms (clean) and 32 ms (4x the window)
    SCOPED_TRACE(gbps);
    PlanRequest req;
    const Plan plan = tiny_plan(gbps, layer_ms, &req);
    int first = -1;
    for (const LayerPlan& l : plan.layers) {
      if (l.snowball && first < 0) first = l.index;
    }
    // The two speeds straddle the window, or the comparison proves nothing.
    EXPECT_EQ(first >= 0, gbps < 0.1) << "planner verdict";
    const StepTelemetry t = run_plan_on_engine(plan, gbps, layer_ms);
    EXPECT_EQ(t.snowball, first >= 0);
    if (first >= 0 && t.snowball) {
      EXPECT_EQ(*t.snowball_first_layer, first);
    }
    EXPECT_GT(t.tensors_offloaded, 0);
  }
}

}  // namespace
}  // namespace spillway

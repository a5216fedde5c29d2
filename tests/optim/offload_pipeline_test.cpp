// The optimizer-offload pipeline on the host backend: bitwise the non-speculative AdamW
// for both cast sites, any GPU/CPU split and any undo memory limit, with clipping and
// NaN/Inf steps; a training loop whose gradients depend on the weights gives the same
// result for every split; copy failures retried or reported without a stale update.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <thread>

#include "allocation_count.hpp"
#include "forwarding_device.hpp"
#include "spillway/core/error.hpp"
#include "spillway/optim/optim.hpp"

namespace spillway::optim {
namespace {

// Forwards to a device; a device-to-host copy of `fail_bytes` bytes throws while
// `fail_next` > 0, or always with `fail_always` (the injected fault).
class FaultyDevice final : public spillway::testing::ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  int fail_next = 0;
  bool fail_always = false;
  size_t fail_bytes = 0;
  Stream create_stream(StreamRole role, int priority) override {
    const Stream s = inner().create_stream(role, priority);
    if (role == StreamRole::kD2H) d2h_ = s.id;
    return s;
  }
  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    if (s.id == d2h_ && bytes == fail_bytes && (fail_always || fail_next > 0)) {
      if (fail_next > 0) --fail_next;
      throw Error("injected copy failure");
    }
    inner().copy_async(dst, src, bytes, s);
  }

 private:
  int d2h_ = -1;
};

const std::vector<Bucket> kBuckets = {{0, 1000},   {1000, 3000}, {4000, 2500},
                                      {6500, 500}, {7000, 3001}, {10001, 1999}};
constexpr size_t kN = 12000;

struct Reference {
  std::vector<float> p, m, v;
  int64_t step = 0;
};

std::vector<uint16_t> bf16_grads(std::mt19937& g, int regime) {
  std::normal_distribution<float> d(0.0f, regime == 0 ? 1e-3f : 0.3f);
  std::vector<uint16_t> out(kN);
  for (uint16_t& x : out) x = float_to_bf16(d(g));
  if (regime == 2) out[g() % kN] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  return out;
}

// One training step: the "backward" writes the bf16 gradients on the compute stream, then
// hands the buckets over, last first.
void backward(Device& dev, Stream compute, OptimizerOffload& o, const std::vector<uint16_t>& g) {
  uint16_t* dst = o.device_grads();
  const uint16_t* src = g.data();
  dev.host_callback(compute, [dst, src] { std::memcpy(dst, src, kN * 2); });
  for (int b = static_cast<int>(kBuckets.size()) - 1; b >= 0; --b) o.on_bucket_grad(b);
}

void reference_step(const AdamWParams& hp, double clip, Reference& r,
                    const std::vector<uint16_t>& g) {
  std::vector<float> g32(kN);
  for (size_t i = 0; i < kN; ++i) g32[i] = bf16_to_float(g[i]);
  reference_adamw_step(hp, clip, r.p.data(), r.m.data(), r.v.data(), g32.data(), kBuckets, &r.step);
}

// Bitwise equality of n floats (NaN payloads included).
bool same_bits(const float* a, const float* b, size_t n) {
  return std::memcmp(static_cast<const void*>(a), static_cast<const void*>(b), n * sizeof(float)) ==
         0;
}

// The whole optimizer state, bitwise.
void expect_state(const OptimizerOffload& off, const Reference& ref, int step) {
  const OptimState st = off.read_state();
  ASSERT_TRUE(same_bits(st.p.data(), ref.p.data(), kN)) << "weights, step " << step;
  ASSERT_TRUE(same_bits(st.m.data(), ref.m.data(), kN)) << "first moments, step " << step;
  ASSERT_TRUE(same_bits(st.v.data(), ref.v.data(), kN)) << "second moments, step " << step;
}

std::vector<float> initial_weights() {
  std::mt19937 g(5);
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<float> w(kN);
  for (float& x : w) x = d(g);
  return w;
}

TEST(OptimizerOffload, BitwiseTheNonSpeculativeOptimizerForEveryCastSiteAndSplit) {
  const uint32_t seed = 77;
  std::cout << "seed " << seed << "\n";
  AdamWParams hp;
  hp.lr = 1e-2;
  const double clip = 1.0;
  struct Variant {
    int split;
    int64_t undo_limit;
  };
  // Splits of none, two and all buckets; undo memory for all, some, and none of the CPU
  // buckets (Note [Bounded undo]).
  const Variant variants[] = {{0, -1}, {2, -1}, {6, -1}, {0, int64_t{5000} * 12}, {1, 0}};
  for (CastSite site : {CastSite::kDevice, CastSite::kHost}) {
    for (const Variant& var : variants) {
      const int split = var.split;
      SCOPED_TRACE(::testing::Message() << "site " << static_cast<int>(site) << " split " << split
                                        << " undo limit " << var.undo_limit);
      auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
      const Stream compute = dev->create_stream(StreamRole::kCompute);
      const std::vector<float> w0 = initial_weights();
      OptimOffloadOptions o;
      o.hp = hp;
      o.clip = clip;
      o.cast = site;
      o.device_buckets = split;
      o.undo_limit_bytes = var.undo_limit;
      OptimizerOffload off(*dev, compute, w0.data(), kN, kBuckets, o);
      Reference ref{w0, std::vector<float>(kN, 0.0f), std::vector<float>(kN, 0.0f), 0};
      std::mt19937 g(seed);
      int seen[3] = {0, 0, 0};
      for (int step = 0; step < 60; ++step) {
        const int regime = static_cast<int>(g() % 5) < 3 ? 0 : static_cast<int>(g() % 2) + 1;
        const std::vector<uint16_t> grads = bf16_grads(g, regime);
        backward(*dev, compute, off, grads);
        ++seen[static_cast<int>(off.end_step())];
        reference_step(hp, clip, ref, grads);
        expect_state(off, ref, step);
        ASSERT_EQ(off.step(), ref.step);
        dev->synchronize(compute);  // ordered after the uploads
        for (size_t i = 0; i < kN; i += 97)
          ASSERT_EQ(off.device_weights()[i], float_to_bf16(ref.p[i])) << "element " << i;
      }
      EXPECT_GT(seen[0], 0);
      EXPECT_GT(seen[1], 0);
      EXPECT_GT(seen[2], 0);
      if (var.undo_limit >= 0) {
        EXPECT_GT(off.counters().deferred, 0);
      } else {
        EXPECT_EQ(off.counters().deferred, 0);
      }
    }
  }
}

// Note [Clips the speculation saw]: between backward and end_step, the sum of squares of
// the buckets handed over is the one end_step validates with (every bucket a CPU bucket).
TEST(OptimizerOffload, TheArrivedSumOfSquaresIsTheNormTheStepValidates) {
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  const Stream compute = dev->create_stream(StreamRole::kCompute);
  const std::vector<float> w0 = initial_weights();
  OptimOffloadOptions o;
  o.clip = 1.0;
  o.cast = CastSite::kHost;
  OptimizerOffload off(*dev, compute, w0.data(), kN, kBuckets, o);
  std::mt19937 g(9);
  for (int regime : {1, 0}) {
    const std::vector<uint16_t> grads = bf16_grads(g, regime);
    EXPECT_EQ(off.arrived_cpu_sum_of_squares(), 0.0);
    backward(*dev, compute, off, grads);
    double want = 0.0;
    std::vector<float> g32(kN);
    for (size_t i = 0; i < kN; ++i) g32[i] = bf16_to_float(grads[i]);
    for (const Bucket& b : kBuckets) want += bucket_sum_of_squares(g32.data() + b.offset, b.n);
    EXPECT_EQ(off.arrived_cpu_sum_of_squares(), want);
    const StvOutcome outcome = off.end_step();
    const double norm = std::sqrt(want);
    EXPECT_EQ(outcome, norm > 1.0 ? StvOutcome::kReplay : StvOutcome::kCommit) << norm;
    EXPECT_EQ(off.last_scale(), clip_coefficient(norm, 1.0));
  }
}

// A training loop: least squares y = X w on the device's bf16 weights, so every step's
// gradient depends on the weights the pipeline wrote back. The loss after each step and
// the final state are bitwise the same for every split and undo limit as for split 0.
TEST(OptimizerOffload, ATrainingLoopEndsTheSameForEverySplit) {
  AdamWParams hp;
  hp.lr = 3e-3;
  constexpr int kRows = 8;
  std::mt19937 g(123);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(kRows * kN), target(kRows);
  for (float& e : x) e = d(g) * 0.01f;
  for (float& e : target) e = d(g);
  auto train = [&](int split, int64_t undo_limit, std::vector<double>* losses) {
    auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
    const Stream compute = dev->create_stream(StreamRole::kCompute);
    OptimOffloadOptions o;
    o.hp = hp;
    o.clip = 0.5;  // some steps clip
    o.device_buckets = split;
    o.undo_limit_bytes = undo_limit;
    const std::vector<float> w0 = initial_weights();
    OptimizerOffload off(*dev, compute, w0.data(), kN, kBuckets, o);
    losses->reserve(30);  // the callbacks hold pointers into it
    for (int step = 0; step < 30; ++step) {
      // "Forward and backward" on the compute stream, from the bf16 weights.
      double* loss = &losses->emplace_back(0.0);
      const uint16_t* w = off.device_weights();
      uint16_t* gw = off.device_grads();
      dev->host_callback(compute, [&x, &target, w, gw, loss] {
        std::vector<float> grad(kN, 0.0f);
        for (int r = 0; r < kRows; ++r) {
          float y = 0.0f;
          for (size_t i = 0; i < kN; ++i) y += x[r * kN + i] * bf16_to_float(w[i]);
          const float err = y - target[static_cast<size_t>(r)];
          *loss += 0.5 * err * err;
          for (size_t i = 0; i < kN; ++i) grad[i] += err * x[r * kN + i];
        }
        for (size_t i = 0; i < kN; ++i) gw[i] = float_to_bf16(grad[i]);
      });
      for (int b = static_cast<int>(kBuckets.size()) - 1; b >= 0; --b) off.on_bucket_grad(b);
      off.end_step();
    }
    dev->synchronize(compute);
    EXPECT_GT(off.counters().replays, 0) << "the test wants some clipped steps";
    return off.read_state();
  };
  std::vector<double> base_losses;
  const OptimState base = train(0, -1, &base_losses);
  EXPECT_LT(base_losses.back(), base_losses.front()) << "the loop trains";
  for (int split : {1, 3, 6}) {
    for (int64_t undo_limit : {int64_t{-1}, int64_t{0}}) {
      SCOPED_TRACE(::testing::Message() << "split " << split << " undo limit " << undo_limit);
      std::vector<double> losses;
      const OptimState st = train(split, undo_limit, &losses);
      ASSERT_EQ(losses, base_losses);
      EXPECT_TRUE(same_bits(st.p.data(), base.p.data(), kN));
      EXPECT_TRUE(same_bits(st.m.data(), base.m.data(), kN));
      EXPECT_TRUE(same_bits(st.v.data(), base.v.data(), kN));
    }
  }
}

// A pipeline (default AdamW, host cast) on a FaultyDevice, and the reference it must match.
struct FaultRig {
  std::unique_ptr<Device> inner = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  FaultyDevice dev{*inner};
  Stream compute = dev.create_stream(StreamRole::kCompute, 0);
  std::vector<float> w0 = initial_weights();
  Reference ref{w0, std::vector<float>(kN, 0.0f), std::vector<float>(kN, 0.0f), 0};
  OptimizerOffload off;
  explicit FaultRig(int device_buckets)
      : off(dev, compute, w0.data(), kN, kBuckets, options(device_buckets)) {}
  static OptimOffloadOptions options(int device_buckets) {
    OptimOffloadOptions o;
    o.cast = CastSite::kHost;
    o.device_buckets = device_buckets;
    return o;
  }
  // One step of fresh gradients through the pipeline and the reference.
  void step(std::mt19937& g) {
    const std::vector<uint16_t> grads = bf16_grads(g, 0);
    backward(dev, compute, off, grads);
    off.end_step();
    reference_step(AdamWParams{}, 1.0, ref, grads);
  }
  // After an abandoned step: the state and every device weight are the reference's.
  void expect_untouched(int step) {
    expect_state(off, ref, step);
    dev.synchronize(compute);
    for (size_t i = 0; i < kN; ++i)
      ASSERT_EQ(off.device_weights()[i], float_to_bf16(ref.p[i])) << "device weight " << i;
  }
};

TEST(OptimizerOffload, AFailedGradientCopyIsRetriedOrReportedNeverAppliedStale) {
  FaultRig rig(0);
  std::mt19937 g(9);
  // A transient failure of bucket 3's copy (500 bf16 = 1000 bytes): retried, no trace.
  rig.dev.fail_bytes = kBuckets[3].n * 2;
  rig.dev.fail_next = 2;
  rig.step(g);
  EXPECT_EQ(rig.off.retries(), 2);
  expect_state(rig.off, rig.ref, 1);
  // A permanent one: reported naming the bucket, and nothing of the step applied.
  rig.dev.fail_always = true;
  const std::vector<uint16_t> lost = bf16_grads(g, 0);  // read by the compute stream
  try {
    backward(rig.dev, rig.compute, rig.off, lost);
    FAIL() << "expected the copy failure to be reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bucket 3"), std::string::npos) << e.what();
  }
  {
    SCOPED_TRACE("the buckets stepped before the failure were undone");
    rig.expect_untouched(2);
  }
  EXPECT_EQ(rig.off.step(), 1);
  // The next step goes through as if the failed one never happened.
  rig.dev.fail_always = false;
  rig.step(g);
  expect_state(rig.off, rig.ref, 3);
  EXPECT_EQ(rig.off.step(), 2);
}

// The split's device buckets send only their norm lane sums down (8 bytes per lane); a
// failure there is retried, or abandons the step like a gradient copy failure.
TEST(OptimizerOffload, AFailedNormCopyOfADeviceBucketIsRetriedOrReported) {
  FaultRig rig(1);  // bucket 0 on the device: 1000 elements, 1000 lanes
  std::mt19937 g(10);
  rig.dev.fail_bytes = kBuckets[0].n * sizeof(double);
  rig.dev.fail_next = 1;
  rig.step(g);
  EXPECT_EQ(rig.off.retries(), 1);
  expect_state(rig.off, rig.ref, 1);
  rig.dev.fail_always = true;
  const std::vector<uint16_t> lost = bf16_grads(g, 0);  // read by the compute stream
  EXPECT_THROW(backward(rig.dev, rig.compute, rig.off, lost), Error);
  rig.expect_untouched(2);
  rig.dev.fail_always = false;
  rig.step(g);
  expect_state(rig.off, rig.ref, 3);
}

TEST(OptimizerOffload, BadSplitIsAnInputError) {
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  const Stream compute = dev->create_stream(StreamRole::kCompute);
  const std::vector<float> w0 = initial_weights();
  OptimOffloadOptions o;
  o.device_buckets = 7;
  try {
    OptimizerOffload off(*dev, compute, w0.data(), kN, kBuckets, o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("device_buckets is 7; must be in [0, "), std::string::npos)
        << e.what();
  }
}

// A backend without the device operations (Note [Device operations]): the device cast
// and the split are input errors naming what is missing; the host cast without a split
// needs none and stays bitwise the non-speculative optimizer.
// The interface's own defaults ("not offered") on purpose, not the forwarding ones.
class NoOpsDevice final : public spillway::testing::ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  bool adamw_step(const DeviceAdamW& a, Stream s) override {
    return DeviceBackend::adamw_step(a, s);  // NOLINT(bugprone-parent-virtual-call)
  }
  bool norm_lanes_bf16(const DeviceNormLanes& a, Stream s) override {
    return DeviceBackend::norm_lanes_bf16(a, s);  // NOLINT(bugprone-parent-virtual-call)
  }
  bool widen_bf16(const DeviceWidenBf16& a, Stream s) override {
    return DeviceBackend::widen_bf16(a, s);  // NOLINT(bugprone-parent-virtual-call)
  }
};

TEST(OptimizerOffload, ABackendWithoutDeviceOperationsNeedsTheHostCastAndNoSplit) {
  auto host = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  NoOpsDevice dev(*host);
  const Stream compute = dev.create_stream(StreamRole::kCompute, 0);
  const std::vector<float> w0 = initial_weights();
  for (const auto& [site, split] :
       {std::pair{CastSite::kDevice, 0}, std::pair{CastSite::kHost, 1}}) {
    OptimOffloadOptions o;
    o.cast = site;
    o.device_buckets = split;
    try {
      OptimizerOffload off(dev, compute, w0.data(), kN, kBuckets, o);
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("device operations"), std::string::npos) << e.what();
    }
  }
  OptimOffloadOptions o;
  o.cast = CastSite::kHost;
  OptimizerOffload off(dev, compute, w0.data(), kN, kBuckets, o);
  Reference ref{w0, std::vector<float>(kN, 0.0f), std::vector<float>(kN, 0.0f), 0};
  std::mt19937 g(12);
  for (int step = 0; step < 3; ++step) {
    const std::vector<uint16_t> grads = bf16_grads(g, step % 2);
    backward(dev, compute, off, grads);
    off.end_step();
    reference_step(o.hp, o.clip, ref, grads);
    expect_state(off, ref, step);
  }
  dev.synchronize(compute);
}

// The steady state allocates nothing: no heap allocation per bucket or step, in the
// pipeline, STV, the AdamW pool or the host backend's queues (the bf16 gradients are made
// before counting), for both cast sites, a split, and limited undo memory.
TEST(OptimizerOffload, TheSteadyStateAllocatesNothing) {
  for (CastSite site : {CastSite::kDevice, CastSite::kHost}) {
    SCOPED_TRACE(static_cast<int>(site));
    auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
    const Stream compute = dev->create_stream(StreamRole::kCompute);
    const std::vector<float> w0 = initial_weights();
    AdamW pool(2);
    OptimOffloadOptions o;
    o.cast = site;
    o.device_buckets = 2;
    o.undo_limit_bytes = int64_t{6000} * 12;  // some buckets deferred
    OptimizerOffload off(*dev, compute, w0.data(), kN, kBuckets, o, &pool);
    std::mt19937 g(3);
    std::vector<std::vector<uint16_t>> grads;
    for (int regime : {0, 1, 2, 0, 1, 2}) grads.push_back(bf16_grads(g, regime));
    for (int i = 0; i < 3; ++i) {  // warm-up: the queues reach their size
      backward(*dev, compute, off, grads[static_cast<size_t>(i)]);
      off.end_step();
    }
    dev->synchronize(compute);
    const int64_t before = spillway::testing::heap_allocations();
    for (int i = 3; i < 6; ++i) {  // a commit, a replay, a skip
      backward(*dev, compute, off, grads[static_cast<size_t>(i)]);
      off.end_step();
    }
    dev->synchronize(compute);
    EXPECT_EQ(spillway::testing::heap_allocations() - before, 0);
    EXPECT_GT(off.counters().deferred, 0);
  }
}

TEST(OptimizerOffload, CastSiteFollowsLinkAgainstCpuWidening) {
  EXPECT_EQ(choose_cast_site(26.0, 100.0), CastSite::kHost);     // PCIe: move bf16
  EXPECT_EQ(choose_cast_site(400.0, 100.0), CastSite::kDevice);  // NVLink-C2C: move fp32
  EXPECT_EQ(choose_cast_site(0.0, 100.0), CastSite::kDevice);    // unknown: no guess
}

}  // namespace
}  // namespace spillway::optim

namespace spillway::optim {
namespace {

TEST(OptimizerOffload, CallerOwnedDeviceBuffersStepBitwiseAndAllocateNothingInSteadyState) {
  // The pipeline on device buffers the caller allocated (OptimOffloadOptions::device_weights
  // / device_grads) against one on its own, through the hooks (OptimizerHooks): the same
  // optimizer state and bf16 weights to the bit, with clipping and NaN steps; the caller's
  // weights are written (poisoned first); no device allocation after construction; the
  // caller's buffers survive the pipeline (it frees only its own).
  const uint32_t seed = 4242;
  std::cout << "seed " << seed << "\n";
  for (int split : {0, 2}) {
    SCOPED_TRACE(::testing::Message() << "split " << split);
    auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
    const Stream compute = dev->create_stream(StreamRole::kCompute);
    const AllocResult wa = dev->allocate(kN * 2, MemoryKind::kDevice);
    const AllocResult ga = dev->allocate(kN * 2, MemoryKind::kDevice);
    ASSERT_TRUE(wa && ga);
    auto* w16 = static_cast<uint16_t*>(wa.ptr);
    auto* g16 = static_cast<uint16_t*>(ga.ptr);
    std::fill(w16, w16 + kN, uint16_t{0xFFFF});  // NaN bits: an unwritten element shows
    const std::vector<float> w0 = initial_weights();
    OptimOffloadOptions o;
    o.hp.lr = 1e-2;
    o.device_buckets = split;
    OptimizerOffload own(*dev, compute, w0.data(), kN, kBuckets, o);
    OptimOffloadOptions oc = o;
    oc.device_weights = w16;
    oc.device_grads = g16;
    {
      OptimizerOffload caller(*dev, compute, w0.data(), kN, kBuckets, oc);
      EXPECT_EQ(caller.device_weights(), w16);
      EXPECT_EQ(caller.device_grads(), g16);
      OptimizerHooks own_hooks(own), caller_hooks(caller);
      std::mt19937 g(seed);
      int64_t allocations_after_first = -1;
      for (int step = 0; step < 12; ++step) {
        const std::vector<uint16_t> grads = bf16_grads(g, step % 4 == 3 ? 2 : step % 2);
        // The loop writes the bf16 gradients into each pipeline's buffer, then the hooks.
        for (auto [pipe, hooks] : {std::pair<OptimizerOffload*, TrainingHooks*>{&own, &own_hooks},
                                   {&caller, &caller_hooks}}) {
          uint16_t* dst = pipe->device_grads();
          const uint16_t* src = grads.data();
          dev->host_callback(compute, [dst, src] { std::memcpy(dst, src, kN * 2); });
          hooks->step_begin();
          for (int b = static_cast<int>(kBuckets.size()) - 1; b >= 0; --b) hooks->grad_ready(b);
          hooks->step_end();
        }
        EXPECT_EQ(own_hooks.outcome(), caller_hooks.outcome()) << "step " << step;
        dev->synchronize(compute);
        const OptimState a = own.read_state(), b = caller.read_state();
        ASSERT_TRUE(same_bits(a.p.data(), b.p.data(), kN)) << "weights, step " << step;
        ASSERT_TRUE(same_bits(a.m.data(), b.m.data(), kN)) << "first moments, step " << step;
        ASSERT_TRUE(same_bits(a.v.data(), b.v.data(), kN)) << "second moments, step " << step;
        ASSERT_EQ(std::memcmp(own.device_weights(), w16, kN * 2), 0)
            << "bf16 weights, step " << step;
        const int64_t allocs =
            dev->memory_stats().allocations[0] + dev->memory_stats().allocations[1] +
            dev->memory_stats().allocations[2] + dev->memory_stats().allocations[3];
        if (step == 0) allocations_after_first = allocs;
        EXPECT_EQ(allocs, allocations_after_first) << "a device allocation in step " << step;
      }
    }
    // The pipeline is gone; the caller's buffers are still the caller's to free.
    const int64_t device_bytes = dev->memory_stats().current[0];
    dev->free(w16, MemoryKind::kDevice);
    dev->free(g16, MemoryKind::kDevice);
    EXPECT_EQ(dev->memory_stats().current[0],
              device_bytes - 2 * static_cast<int64_t>((kN * 2 + 255) / 256 * 256));
  }
}

}  // namespace
}  // namespace spillway::optim

namespace spillway::optim {
namespace {

TEST(OptimizerOffload, OnAnAdoptedComputeStreamItStepsTheGradientsTheCallersWorkWrote) {
  // The caller's compute stream is its own (a HostStream adopted by the device): its slow
  // "backward" writes each step's gradients there, after poison; the pipeline's copies are
  // ordered after that work by events only, so the state equals the non-speculative
  // reference bitwise, and the next step's weights are ordered before the caller's next
  // work on its stream.
  const uint32_t seed = 1618;
  std::cout << "seed " << seed << "\n";
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 2.0, 2.0});
  HostStream caller;
  const Stream compute = dev->adopt_stream(caller.native(), StreamRole::kCompute);
  const std::vector<float> w0 = initial_weights();
  OptimOffloadOptions o;
  o.hp.lr = 1e-2;
  o.device_buckets = 1;
  Reference ref{w0, std::vector<float>(kN, 0.0f), std::vector<float>(kN, 0.0f), 0};
  {
    OptimizerOffload off(*dev, compute, w0.data(), kN, kBuckets, o);
    OptimizerHooks hooks(off);
    std::mt19937 g(seed);
    for (int step = 0; step < 6; ++step) {
      const std::vector<uint16_t> grads = bf16_grads(g, step % 3 == 2 ? 1 : 0);
      uint16_t* dst = off.device_grads();
      std::fill(dst, dst + kN, uint16_t{0x7FC0});  // NaN: a copy that ran early skips the step
      caller.launch([dst, &grads] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        std::memcpy(dst, grads.data(), kN * 2);
      });
      hooks.step_begin();
      for (int b = static_cast<int>(kBuckets.size()) - 1; b >= 0; --b) hooks.grad_ready(b);
      hooks.step_end();
      // Small gradients commit; large ones are clipped (replayed); none is skipped (the
      // poison's NaN would be, had a copy run before the caller's work).
      EXPECT_EQ(hooks.outcome(), step % 3 == 2 ? StvOutcome::kReplay : StvOutcome::kCommit)
          << "step " << step;
      reference_step(o.hp, o.clip, ref, grads);
      expect_state(off, ref, step);
      // The next step's bf16 weights are the updated ones, in order on the caller's stream.
      std::vector<uint16_t> seen(kN);
      const uint16_t* w = off.device_weights();
      caller.launch([w, &seen] { std::memcpy(seen.data(), w, kN * 2); });
      caller.synchronize();
      const OptimState st = off.read_state();
      for (size_t i = 0; i < kN; ++i)
        ASSERT_EQ(seen[i], float_to_bf16(st.p[i])) << "element " << i << ", step " << step;
    }
  }
  dev->destroy_stream(compute);
}

}  // namespace
}  // namespace spillway::optim

namespace spillway::optim {
namespace {

TEST(OptimizerOffload, PerBucketHyperparametersAbsentBucketsAbortsAndCheckpoints) {
  // What a framework's optimizer needs of the pipeline (spillway.torch.CPUAdamW on GPU
  // parameters): per-bucket learning rates changed between steps, a bucket without a
  // gradient (its state and step counter stay), a step dropped after its speculative
  // uploads (the weights on the device are the old ones again), and a checkpoint read from
  // one pipeline and written into a fresh one that then steps identically. Without
  // clipping each bucket is independent, so the reference steps bucket by bucket.
  const uint32_t seed = 909;
  std::cout << "seed " << seed << "\n";
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  const Stream compute = dev->create_stream(StreamRole::kCompute);
  const std::vector<float> w0 = initial_weights();
  OptimOffloadOptions o;
  o.clip = 0.0;
  o.cast = CastSite::kHost;
  const int nb = static_cast<int>(kBuckets.size());
  OptimizerOffload off(*dev, compute, w0.data(), kN, kBuckets, o);
  Reference ref{w0, std::vector<float>(kN, 0.0f), std::vector<float>(kN, 0.0f), 0};
  std::vector<int64_t> steps(kBuckets.size(), 0);
  auto lr_of = [](int b, int step) { return 1e-3 * (b + 1) / (1.0 + step); };
  auto reference = [&](const std::vector<uint16_t>& grads, int step, int absent) {
    for (int b = 0; b < nb; ++b) {
      if (b == absent) continue;
      const Bucket& k = kBuckets[static_cast<size_t>(b)];
      AdamWParams hp = o.hp;
      hp.lr = lr_of(b, step);
      std::vector<float> g32(k.n);
      for (size_t i = 0; i < k.n; ++i) g32[i] = bf16_to_float(grads[k.offset + i]);
      reference_adamw_step(hp, 0.0, ref.p.data() + k.offset, ref.m.data() + k.offset,
                           ref.v.data() + k.offset, g32.data(), {{0, k.n}},
                           &steps[static_cast<size_t>(b)]);
    }
  };
  auto expect_device_weights = [&](const char* when, int step) {
    dev->synchronize(compute);
    for (size_t i = 0; i < kN; ++i)
      ASSERT_EQ(off.device_weights()[i], float_to_bf16(ref.p[i]))
          << when << ", element " << i << ", step " << step;
  };
  std::mt19937 g(seed);
  for (int step = 0; step < 8; ++step) {
    for (int b = 0; b < nb; ++b) {
      AdamWParams hp = o.hp;
      hp.lr = lr_of(b, step);
      off.set_hparams(b, hp);
    }
    const std::vector<uint16_t> grads = bf16_grads(g, 0);
    if (step == 3) {  // handed over, speculated and uploaded, then dropped
      backward(*dev, compute, off, grads);
      off.abort_step();
      expect_state(off, ref, step);
      expect_device_weights("after an abort", step);
    }
    const int absent = step % 3 == 1 ? 4 : -1;
    uint16_t* dst = off.device_grads();
    dev->host_callback(compute, [dst, &grads] { std::memcpy(dst, grads.data(), kN * 2); });
    for (int b = nb - 1; b >= 0; --b) {
      if (b == absent) {
        off.on_bucket_absent(b);
      } else {
        off.on_bucket_grad(b);
      }
    }
    EXPECT_EQ(off.end_step(), StvOutcome::kCommit);
    EXPECT_GT(off.last_cpu_ms(), 0.0);  // its bucket steps ran and were timed
    reference(grads, step, absent);
    expect_state(off, ref, step);
    expect_device_weights("after the step", step);
    for (int b = 0; b < nb; ++b) ASSERT_EQ(off.bucket_step(b), steps[static_cast<size_t>(b)]);
  }
  // The checkpoint: every bucket's state and step into a fresh pipeline, whose device
  // weights are then those of the state; both step the same gradients to the same bits.
  OptimizerOffload copy(*dev, compute, initial_weights().data(), kN, kBuckets, o);
  for (int b = 0; b < nb; ++b) {
    const size_t n = kBuckets[static_cast<size_t>(b)].n;
    std::vector<float> p(n), m(n), v(n);
    off.read_bucket(b, p.data(), m.data(), v.data());
    copy.write_bucket(b, p.data(), m.data(), v.data(), off.bucket_step(b));
    copy.set_hparams(b, o.hp);
    off.set_hparams(b, o.hp);
  }
  dev->synchronize(compute);
  ASSERT_EQ(std::memcmp(copy.device_weights(), off.device_weights(), kN * 2), 0);
  const std::vector<uint16_t> grads = bf16_grads(g, 0);
  for (OptimizerOffload* pipe : {&off, &copy}) {
    uint16_t* dst = pipe->device_grads();
    dev->host_callback(compute, [dst, &grads] { std::memcpy(dst, grads.data(), kN * 2); });
    for (int b = nb - 1; b >= 0; --b) pipe->on_bucket_grad(b);
    pipe->end_step();
  }
  const OptimState a = off.read_state(), b = copy.read_state();
  EXPECT_TRUE(same_bits(a.p.data(), b.p.data(), kN));
  EXPECT_TRUE(same_bits(a.m.data(), b.m.data(), kN));
  EXPECT_TRUE(same_bits(a.v.data(), b.v.data(), kN));
  for (int bk = 0; bk < nb; ++bk) EXPECT_EQ(off.bucket_step(bk), copy.bucket_step(bk));
  EXPECT_THROW(off.set_hparams(nb, o.hp), Error);
}

}  // namespace
}  // namespace spillway::optim

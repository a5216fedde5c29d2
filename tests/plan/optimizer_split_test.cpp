// The planned GPU/CPU split of optimizer offload: a CPU that keeps up leaves every layer
// on it; a slower one hands the last-arriving layers to the GPU while HBM allows.
#include <gtest/gtest.h>

#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {
namespace {

PlanRequest llama8b_on_gh200() {
  PlanRequest r;
  r.model = load_model("Llama-3.1-8B");
  r.hardware = load_hardware("gh200");
  r.work.shape.micro_batch = 1;
  r.work.shape.seq_len = 8192;
  r.work.dp = 8;
  r.strategy = Policy::kRecompute;
  return r;
}

TEST(OptimizerSplit, TheGpuTakesTheLastLayersOnlyWhenTheCpuFallsBehind) {
  const PlanRequest req = llama8b_on_gh200();
  const Plan plan = make_plan(req);
  const OptimizerSplit fast = plan_optimizer_split(plan, req, 1e6);  // a CPU of 1 PB/s
  EXPECT_EQ(fast.layers, 32);
  EXPECT_LE(fast.end_ms, fast.backward_ms * 1.01);
  const OptimizerSplit slow = plan_optimizer_split(plan, req, 400.0);
  EXPECT_GT(slow.layers_on_device, 0);
  EXPECT_LT(slow.end_ms, slow.cpu_only_ms);
  EXPECT_LE(slow.device_state_bytes, slow.free_hbm_bytes);
  EXPECT_GT(slow.free_hbm_bytes, plan.summary.hbm_budget_bytes - plan.summary.peak.total())
      << "the offloaded optimizer states free HBM";
  EXPECT_THROW(plan_optimizer_split(plan, req, 0.0), Error);
}

TEST(SplitChoice, MovesTheLastBucketsToTheDeviceWhenTheCpuWouldTrailBackward) {
  // 8 buckets arriving every 10 ms over an 80 ms backward; the CPU needs 12 ms each (it
  // falls behind), the device 1 ms each.
  std::vector<BucketTiming> t;
  t.reserve(8);
  for (int i = 0; i < 8; ++i) t.push_back({10.0 * (i + 1), 12.0, 1.0, 1000});
  const SplitChoice c = choose_device_buckets(t, 80.0, 1 << 20);
  // CPU only: the last bucket arrives at 80, the CPU is done at 10 + 8 * 12 = 106.
  EXPECT_DOUBLE_EQ(c.cpu_only_ms, 106.0);
  EXPECT_GT(c.device_buckets, 0);
  EXPECT_LT(c.end_ms, c.cpu_only_ms);
  // No room in HBM: nothing moves.
  EXPECT_EQ(choose_device_buckets(t, 80.0, 999).device_buckets, 0);
  // The last bucket always trails backward by its CPU time (5 ms here, the CPU keeping
  // up otherwise): the device takes it when its own step is shorter (1 ms), not when it
  // is longer (8 ms).
  for (BucketTiming& b : t) b.cpu_ms = 5.0;
  EXPECT_EQ(choose_device_buckets(t, 80.0, 1 << 20).device_buckets, 1);
  for (BucketTiming& b : t) b.device_ms = 8.0;
  EXPECT_EQ(choose_device_buckets(t, 80.0, 1 << 20).device_buckets, 0);
}

}  // namespace
}  // namespace spillway

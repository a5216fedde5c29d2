// The planned GPU/CPU split of optimizer offload: a CPU that keeps up leaves every layer
// on it; a slower one hands the last-arriving layers to the GPU while HBM allows.
#include "plan/optimizer_split.hpp"

#include <gtest/gtest.h>

#include "spillway/error.hpp"

namespace spillway {
namespace {

PlanRequest llama8b_on_gh200() {
  PlanRequest r;
  r.model = load_model("Llama-3.1-8B");
  r.hardware = load_hardware("gh200");
  r.work.shape.micro_batch = 1;
  r.work.shape.seq_len = 8192;
  r.work.dp = 8;
  r.strategy = Strategy::kRecompute;
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

}  // namespace
}  // namespace spillway

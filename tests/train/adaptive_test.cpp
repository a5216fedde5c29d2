// The adaptive planner of `spillway train --policy adaptive` (src/train/adaptive.cpp), on
// its own, with the link it measured given: a re-plan keeps its planned peak plus its
// reload staging within the first plan's (Note [Re-plans within the measured budget]).
#include "train/adaptive.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>

#include "spillway/nn/nn.hpp"
#include "spillway/plan/plan.hpp"
#include "spillway/train/train.hpp"

namespace spillway::train {
namespace {

int64_t peak_and_staging(const Plan& p, int depth) {
  return p.summary.peak.total() + AdaptivePlanner::staging_bytes(p, depth);
}

int64_t offloaded_bytes(const Plan& p) {
  int64_t n = 0;
  for (const LayerPlan& l : p.layers) n += l.offload_bytes;
  return n;
}

TEST(AdaptivePlanner, AReplanKeepsItsPeakAndStagingWithinTheFirstPlans) {
  // The run starts on a 0.5 GB/s link: its first plan offloads little. The link then
  // measures 10 GB/s: the plan the planner makes for it within the first plan's peak
  // offloads more, and its staging (two layers of its offloads) does not fit beside it.
  TrainOptions o;
  o.device_memory_mb = 22;
  o.d2h_gbps = 0.5;
  o.h2d_gbps = 0.5;
  const int depth = o.prefetch_depth;
  const nn::RefConfig c = nn::load_reference_config(o.model);
  PlanRequest req = plan_request(c, o, Policy::kAuto, 1.0);
  const Plan first = make_plan(req);
  ASSERT_TRUE(first.summary.feasible);
  req.hbm_budget_gb = static_cast<double>(first.summary.peak.total()) / 1e9;
  MemoryPolicy pol = nn::policy_from_plan(c, first, "adaptive");
  pol.prefetch_depth = depth;
  const int64_t budget = peak_and_staging(first, depth);
  PlanRequest fast = req;
  fast.d2h_gbps = 10.0;
  fast.h2d_gbps = 10.0;
  const Plan alone = make_plan(fast);
  ASSERT_GT(peak_and_staging(alone, depth), budget) << "the case this test is about";
  ASSERT_GT(offloaded_bytes(alone), offloaded_bytes(first));

  AdaptivePlanner a(c, req, pol, first, depth);
  nn::StepStats st;
  st.layer_fwd_ms.assign(static_cast<size_t>(c.layers()), 1.0);
  const std::optional<MemoryPolicy> next = a.after_step(0, st, StepTelemetry{}, 10.0);
  ASSERT_TRUE(next.has_value()) << "the link is 20x what the plan assumed: a new plan";
  EXPECT_TRUE(next->note.find("re-planned after step 1: link 10.000 GB/s") != std::string::npos)
      << next->note;
  EXPECT_LE(peak_and_staging(a.plan(), depth), budget)
      << "planned peak " << a.plan().summary.peak.total() << ", staging "
      << AdaptivePlanner::staging_bytes(a.plan(), depth) << ", the first plan's " << budget;
  EXPECT_GT(offloaded_bytes(a.plan()), offloaded_bytes(first)) << "it still uses the link";
  // The same link again: the plan stays.
  EXPECT_FALSE(a.after_step(1, st, StepTelemetry{}, 10.0).has_value());
}

}  // namespace
}  // namespace spillway::train

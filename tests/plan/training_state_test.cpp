// Note [Training state] and Note [Loss chunks] (src/plan/stage.cpp): what each ZeRO
// stage shards, what the optimizer and gradient offload take out of HBM and put in host
// memory and in the step time, and the loss in chunks; and the published full fine-tunes
// docs/planner.md asks about, which fit.
#include <gtest/gtest.h>

#include "plan_helpers.hpp"
#include "spillway/core/error.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::request;

PlanRequest llama8b_dp8(int zero) {
  PlanRequest r = request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute);
  r.work.dp = 8;
  r.zero = zero;
  r.loss_chunk = 4096;  // unchunked: the logits are not the point here
  return r;
}

// The largest of the layers' and the embedding's parameters on this GPU.
int64_t largest_params(const Plan& p, const PlanRequest& r) {
  int64_t largest = r.model.vocab * r.model.hidden / r.work.shape.tp;
  for (const LayerPlan& l : p.layers) largest = std::max(largest, l.params);
  return largest;
}

TEST(TrainingState, EachZeroStageShardsWhatItSays) {
  const Plan z0 = make_plan(llama8b_dp8(0));
  const int64_t P = z0.params_per_gpu;
  const int64_t L = largest_params(z0, llama8b_dp8(0));
  const auto up = [](int64_t b) { return (b + 7) / 8; };
  EXPECT_EQ(z0.summary.peak.weights, 2 * P);
  EXPECT_EQ(z0.summary.peak.gradients, 2 * P);
  EXPECT_EQ(z0.summary.peak.optimizer_states, 12 * P);
  EXPECT_EQ(z0.summary.peak.buffers, 0);
  const Plan z1 = make_plan(llama8b_dp8(1));
  EXPECT_EQ(z1.summary.peak.weights, 2 * P);
  EXPECT_EQ(z1.summary.peak.gradients, 2 * P);
  EXPECT_EQ(z1.summary.peak.optimizer_states, 12 * up(P));
  EXPECT_EQ(z1.summary.peak.buffers, 0);
  const Plan z2 = make_plan(llama8b_dp8(2));
  EXPECT_EQ(z2.summary.peak.weights, 2 * P);
  EXPECT_EQ(z2.summary.peak.gradients, up(2 * P));
  EXPECT_EQ(z2.summary.peak.optimizer_states, 12 * up(P));
  EXPECT_EQ(z2.summary.peak.buffers, 2 * 2 * L) << "two gradient buckets";
  const Plan z3 = make_plan(llama8b_dp8(3));
  EXPECT_EQ(z3.summary.peak.weights, up(2 * P));
  EXPECT_EQ(z3.summary.peak.gradients, up(2 * P));
  EXPECT_EQ(z3.summary.peak.buffers, 4 * 2 * L) << "two gathered layers and two buckets";
  // Sharding moves nothing but the training state: the activations are the same.
  EXPECT_EQ(z3.summary.peak.activations, z0.summary.peak.activations);
  EXPECT_LT(z3.summary.peak.total(), z2.summary.peak.total());
  EXPECT_LT(z2.summary.peak.total(), z1.summary.peak.total());
  EXPECT_LT(z1.summary.peak.total(), z0.summary.peak.total());
  // dp 1: nothing to shard, whatever the stage.
  PlanRequest one = llama8b_dp8(3);
  one.work.dp = 1;
  const Plan p1 = make_plan(one);
  EXPECT_EQ(p1.summary.peak.weights, 2 * P);
  EXPECT_EQ(p1.summary.peak.buffers, 0);
}

TEST(TrainingState, OptimizerOffloadMovesTheStateToTheHostAndTimesTheCpu) {
  PlanRequest r = llama8b_dp8(1);
  r.hbm_budget_gb = 60;  // little free HBM: no layer's state goes back to the GPU
  const Plan dev = make_plan(r);
  r.optimizer_offload = true;
  r.cpu_adam_gbps = 100.0;
  const Plan off = make_plan(r);
  const TrainingStatePlan& ts = off.summary.state;
  const int64_t state_params = (off.params_per_gpu + 7) / 8;
  EXPECT_EQ(ts.state_params, state_params);
  EXPECT_EQ(ts.host_state_bytes, 14 * state_params) << "12 bytes of state, 2 of gradients";
  EXPECT_GE(off.summary.host_pinned_bytes, ts.host_state_bytes);
  EXPECT_EQ(off.summary.peak.optimizer_states,
            12 * ts.device_buckets * ((off.layers[0].params + 7) / 8))
      << "only the split's layers keep their state in HBM";
  EXPECT_LT(off.summary.peak.total(), dev.summary.peak.total());
  // The CPU's work: per layer, 2 bytes down, 28 through the CPU AdamW, 2 up.
  EXPECT_GT(ts.optimizer_total_ms, 0.0);
  EXPECT_GE(ts.optimizer_ms, 0.0);
  EXPECT_LE(ts.optimizer_ms, ts.optimizer_total_ms + 1e-9)
      << "only the tail past backward is on the critical path";
  EXPECT_FALSE(ts.cpu_adam_assumed);
  // A faster CPU shortens the tail; the default is said to be assumed.
  r.cpu_adam_gbps = 1000.0;
  EXPECT_LE(make_plan(r).summary.state.optimizer_ms, ts.optimizer_ms);
  r.cpu_adam_gbps.reset();
  const Plan assumed = make_plan(r);
  EXPECT_TRUE(assumed.summary.state.cpu_adam_assumed);
  EXPECT_DOUBLE_EQ(assumed.summary.state.cpu_adam_gbps, kDefaultCpuAdamGbps);
  // The device optimizer: 28 bytes per parameter of its shard at HBM speed, in the step.
  EXPECT_NEAR(dev.summary.state.optimizer_ms,
              static_cast<double>(state_params) * 28.0 /
                  (r.hardware.hbm_tbps * r.efficiency.hbm * 1e12) * 1e3,
              1e-9);
}

TEST(TrainingState, GradientOffloadKeepsOnlyBucketsInHbm) {
  PlanRequest r = llama8b_dp8(1);
  r.optimizer_offload = true;
  const Plan held = make_plan(r);
  r.grad_offload = true;
  const Plan streamed = make_plan(r);
  EXPECT_GT(held.summary.peak.gradients, 0);
  EXPECT_EQ(streamed.summary.peak.gradients, 0);
  EXPECT_EQ(streamed.summary.peak.buffers, 2 * 2 * largest_params(streamed, r));
  // Without the optimizer on the host the gradients have nowhere to go.
  PlanRequest bad = llama8b_dp8(1);
  bad.grad_offload = true;
  spillway::testing::expect_error([&] { (void)make_plan(bad); },
                                  {"grad_offload is true; needs optimizer_offload"});
  PlanRequest z = llama8b_dp8(4);
  spillway::testing::expect_error([&] { (void)make_plan(z); }, {"zero is 4; must be 0, 1, 2 or 3"});
}

TEST(LossChunks, TheLogitsOfOneChunkAndTheirRecompute) {
  PlanRequest r = request("Qwen3-30B-A3B", "gh200", 2, 8192, Policy::kRecompute);
  const int64_t T = 2 * 8192;
  const int64_t per_token = r.model.vocab * 8;
  r.loss_chunk = T;
  const Plan whole = make_plan(r);
  EXPECT_EQ(whole.summary.logits_bytes, T * per_token) << "~20 GB unchunked";
  EXPECT_EQ(whole.summary.state.loss_chunk_tokens, T);
  EXPECT_EQ(whole.summary.state.loss_recompute_ms, 0.0);
  r.loss_chunk = 2048;
  const Plan chunked = make_plan(r);
  EXPECT_EQ(chunked.summary.logits_bytes, 2048 * per_token);
  EXPECT_GT(chunked.summary.state.loss_recompute_ms, 0.0);
  // One more head forward per micro-batch: a third of forward + backward.
  EXPECT_NEAR(chunked.summary.head_ms, whole.summary.head_ms * 4.0 / 3.0,
              1e-9 * whole.summary.head_ms);
  EXPECT_LT(chunked.summary.peak.total(), whole.summary.peak.total());
  // The planner's choice: the largest power of two whose logits take <= 2% of the budget.
  r.loss_chunk = 0;
  const Plan chosen = make_plan(r);
  const int64_t c = chosen.summary.state.loss_chunk_tokens;
  EXPECT_LE(c * per_token, chosen.summary.hbm_budget_bytes / 50);
  EXPECT_GT(2 * c * per_token, chosen.summary.hbm_budget_bytes / 50);
  EXPECT_EQ(c & (c - 1), 0) << c;
  // Small logits stay whole.
  PlanRequest small = request("Llama-3.1-8B", "gh200", 1, 256, Policy::kRecompute);
  EXPECT_EQ(make_plan(small).summary.state.loss_chunk_tokens, 256);
}

// docs/planner.md: "does GPT-OSS-20B fit on one GH200 with the optimizer on the CPU?" and
// the published runs beside it (seq 4096, micro-batch 4): GPT-OSS-20B and Qwen3-14B on one
// GH200, Qwen3-30B-A3B on two, Llama-3-70B on four.
TEST(TrainingState, PublishedFullFineTunesFitWithTheOptimizerOnTheCpu) {
  struct Case {
    const char* model;
    int64_t dp;
    int zero;
    bool grad_offload;
  };
  for (const Case& c : {Case{"GPT-OSS-20B", 1, 1, true}, Case{"Qwen3-14B", 1, 1, false},
                        Case{"Qwen3-30B-A3B", 2, 3, true}, Case{"Llama-3.1-70B", 4, 3, true}}) {
    SCOPED_TRACE(c.model);
    PlanRequest r = request(c.model, "gh200", 4, 4096, Policy::kAuto);
    r.work.dp = c.dp;
    r.zero = c.zero;
    r.optimizer_offload = true;
    r.grad_offload = c.grad_offload;
    const Plan p = make_plan(r);
    EXPECT_TRUE(p.summary.feasible) << (p.summary.reasons.empty() ? "" : p.summary.reasons[0]);
    // The same on the GPU alone does not fit: the 12 bytes per parameter are the point.
    r.optimizer_offload = false;
    r.grad_offload = false;
    const Plan on_gpu = make_plan(r);
    EXPECT_FALSE(on_gpu.summary.feasible);
    EXPECT_GT(on_gpu.summary.peak.optimizer_states, p.summary.peak.optimizer_states);
  }
}

}  // namespace
}  // namespace spillway

namespace spillway {
namespace {

// Note [FP8 recompute]: a layer recomputing fp8 GEMMs keeps their forward's scaling state.
TEST(Fp8, RecomputedGemmsKeepTheForwardsScalingState) {
  PlanRequest r = spillway::testing::request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute);
  r.work.shape.dtype = DType::kFp8;
  const Plan rec = make_plan(r);
  for (const LayerPlan& l : rec.layers) {
    // The block policy of a dense layer recomputes the qkv, gate and up GEMMs.
    EXPECT_EQ(l.fp8_recomputed_gemms, 3) << l.index;
    EXPECT_EQ(l.fp8_scaling_state_bytes, 3 * kFp8ScalingStateBytesPerGemm);
  }
  r.strategy = Policy::kKeep;
  const Plan keep = make_plan(r);
  for (const LayerPlan& l : keep.layers) EXPECT_EQ(l.fp8_scaling_state_bytes, 0);
  // bf16: no fp8 state at all; fp8 GEMMs run at the fp8 peak (faster than bf16).
  r.strategy = Policy::kRecompute;
  r.work.shape.dtype = DType::kBf16;
  const Plan bf16 = make_plan(r);
  for (const LayerPlan& l : bf16.layers) EXPECT_EQ(l.fp8_scaling_state_bytes, 0);
  EXPECT_LT(rec.layers[0].fwd_ms, bf16.layers[0].fwd_ms);
  EXPECT_LT(rec.summary.peak.activations, bf16.summary.peak.activations)
      << "activations saved in fp8 (1 byte) rather than bf16";
}

}  // namespace
}  // namespace spillway

namespace spillway {
namespace {

// docs/optim.md, where to cast: fp32 over a fast link (casts on the GPU), bf16 over a
// slow one (casts on the CPU), whichever moves a parameter sooner.
TEST(TrainingState, TheCastSiteFollowsTheLinkAgainstTheCpu) {
  PlanRequest r = spillway::testing::request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute);
  r.optimizer_offload = true;
  r.cpu_adam_gbps = 100.0;
  const Plan fast = make_plan(r);  // C2C: 170 / 415 GB/s
  EXPECT_FALSE(fast.summary.state.cast_on_host);
  r.d2h_gbps = 10.0;
  r.h2d_gbps = 10.0;
  const Plan slow = make_plan(r);
  EXPECT_TRUE(slow.summary.state.cast_on_host);
  // The CPU pipeline's work per parameter: 28 bytes of AdamW plus the cheaper of the casts.
  double params = 0.0;
  for (const LayerPlan& l : slow.layers) params += static_cast<double>(l.params);
  const double per_param_ms = 28.0 / 100e6 + 2.0 / 10e6 + 2.0 / 10e6 + 4.0 / 100e6;
  EXPECT_NEAR(slow.summary.state.optimizer_total_ms, params * per_param_ms,
              1e-9 * slow.summary.state.optimizer_total_ms);
}

}  // namespace
}  // namespace spillway

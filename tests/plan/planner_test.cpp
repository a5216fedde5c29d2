// The planner's strategies do what they say per tensor, and its summary fields follow from
// the request: link and budget defaults, static memory, calibration, gradient accumulation,
// pipeline stages, and the last layers that never offload.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "plan_helpers.hpp"
#include "spillway/catalog/inventory.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::generous;
using spillway::testing::model;
using spillway::testing::request;

const std::set<std::string> kMlp = {"mlp.gate_out", "mlp.up_out", "mlp.act"};

const TensorPlan* find_tensor(const LayerPlan& l, const std::string& name) {
  for (const TensorPlan& t : l.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

TEST(Strategies, KeepKeepsEverything) {
  const PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kKeep));
  const Plan p = make_plan(r);
  ASSERT_EQ(p.layers.size(), 32u);
  for (const LayerPlan& l : p.layers) {
    EXPECT_EQ(l.policy, Policy::kKeep);
    EXPECT_EQ(l.offload_bytes, 0);
    EXPECT_EQ(l.recompute_ms, 0.0);
    EXPECT_FALSE(l.snowball);
    int64_t kept = 0;
    for (const TensorPlan& t : l.tensors) {
      EXPECT_EQ(t.action, Action::kKeep) << t.name;
      kept += t.bytes;
    }
    EXPECT_EQ(l.kept_bytes, kept);
  }
  EXPECT_TRUE(p.summary.feasible);
  EXPECT_DOUBLE_EQ(p.summary.step_ms, p.summary.keep_step_ms);
  EXPECT_EQ(p.summary.host_pinned_bytes, 0);
}

TEST(Strategies, RecomputeIsTheBlockPolicy) {
  for (const char* name : {"Llama-3.1-8B", "Qwen3-30B-A3B"}) {
    SCOPED_TRACE(name);
    const PlanRequest r = generous(request(name, "gh200", 1, 4096, Policy::kRecompute));
    const Plan p = make_plan(r);
    const bool moe = model(name).layers[0].mlp.kind == MlpKind::kMoe;
    for (const LayerPlan& l : p.layers) {
      EXPECT_EQ(l.policy, Policy::kRecompute);
      EXPECT_EQ(l.offload_bytes, 0);
      EXPECT_GT(l.recompute_ms, 0.0);
      for (const TensorPlan& t : l.tensors) {
        const bool block_input = t.name == "attn.input" || t.name == "mlp.input";
        const bool moe_kept = moe && (t.name == "mlp.norm_out" || t.name.rfind("moe.", 0) == 0) &&
                              t.name != "moe.expert_out";
        EXPECT_EQ(t.action, block_input || moe_kept ? Action::kKeep : Action::kRecompute) << t.name;
      }
    }
    EXPECT_DOUBLE_EQ(p.summary.step_ms, p.summary.recompute_step_ms);
    EXPECT_DOUBLE_EQ(p.summary.speedup_vs_recompute, 1.0);
    EXPECT_GT(p.summary.recompute_step_ms, p.summary.keep_step_ms);
  }
}

TEST(Strategies, OffloadMovesTheMlpTensorsOfAllButTheLastLayer) {
  const PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kOffload));
  const Plan p = make_plan(r);
  const Plan rec =
      make_plan(generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute)));
  ASSERT_EQ(p.layers.size(), 32u);
  for (size_t i = 0; i < p.layers.size(); ++i) {
    const LayerPlan& l = p.layers[i];
    SCOPED_TRACE(i);
    const bool last = i + 1 == p.layers.size();
    EXPECT_EQ(l.policy, last ? Policy::kRecompute : Policy::kOffload);
    int64_t off = 0;
    ASSERT_EQ(l.tensors.size(), rec.layers[i].tensors.size());
    for (size_t k = 0; k < l.tensors.size(); ++k) {
      const TensorPlan& t = l.tensors[k];
      if (!last && kMlp.count(t.name)) {
        EXPECT_EQ(t.action, Action::kOffload) << t.name;
        off += t.bytes;
      } else {
        EXPECT_EQ(t.action, rec.layers[i].tensors[k].action) << t.name;
      }
    }
    EXPECT_EQ(l.offload_bytes, off);
    // Offloading avoids the MLP recompute: less recompute than the block policy.
    if (!last) {
      EXPECT_LT(l.recompute_ms, rec.layers[i].recompute_ms);
    }
    EXPECT_NEAR(l.recompute_avoided_ms, rec.layers[i].recompute_ms - l.recompute_ms, 1e-12);
    // Transfer times at the per-GPU figures.
    EXPECT_NEAR(l.d2h_ms, static_cast<double>(l.offload_bytes) / (170.0 * 1e6), 1e-9);
    EXPECT_NEAR(l.h2d_ms, static_cast<double>(l.offload_bytes) / (415.0 * 1e6), 1e-9);
    if (l.offload_bytes > 0) {
      EXPECT_NEAR(l.margin, l.window_ms / l.d2h_ms - 1.0, 1e-12);
    }
  }
  int64_t pinned = 0;
  for (const LayerPlan& l : p.layers) pinned += l.offload_bytes;
  EXPECT_EQ(p.summary.host_pinned_bytes, pinned);
}

TEST(Strategies, TheLastLayersNeverOffload) {
  for (Policy s : {Policy::kAuto, Policy::kOffload, Policy::kSelective, Policy::kHybrid}) {
    for (int keep_last : {1, 3}) {
      PlanRequest r = generous(request("Qwen3-30B-A3B", "gb200", 1, 4096, s));
      r.keep_last_layers = keep_last;
      const Plan p = make_plan(r);
      SCOPED_TRACE(to_string(s) + " keep_last " + std::to_string(keep_last));
      const size_t n = p.layers.size();
      for (size_t i = n - static_cast<size_t>(keep_last); i < n; ++i) {
        EXPECT_EQ(p.layers[i].offload_bytes, 0) << "layer " << i;
        for (const TensorPlan& t : p.layers[i].tensors)
          EXPECT_NE(t.action, Action::kOffload) << t.name;
      }
      if (s != Policy::kAuto) {
        EXPECT_GT(p.layers[0].offload_bytes, 0);
      }
    }
  }
}

TEST(Strategies, TensorNamesInPlans) {
  const Plan dense =
      make_plan(generous(request("Llama-3.1-8B", "gh200", 1, 2048, Policy::kOffload)));
  for (const char* n : {"attn.input", "attn.qkv_out", "attn.out_proj_in", "mlp.gate_out",
                        "mlp.up_out", "mlp.act"}) {
    EXPECT_NE(find_tensor(dense.layers[0], n), nullptr) << n;
  }
  for (const TensorPlan& t : dense.layers[0].tensors)
    EXPECT_NE(t.name.rfind("moe.", 0), 0u) << t.name;

  PlanRequest fr = generous(request("Llama-3.1-8B", "gh200", 1, 2048, Policy::kOffload));
  fr.work.shape.fused_swiglu = true;
  const Plan fused = make_plan(fr);
  EXPECT_EQ(find_tensor(fused.layers[0], "mlp.act"), nullptr) << "act is not saved when fused";
  EXPECT_NE(find_tensor(fused.layers[0], "mlp.gate_out"), nullptr);
  EXPECT_NE(find_tensor(fused.layers[0], "mlp.up_out"), nullptr);

  PlanRequest ds = generous(request("DeepSeek-V3", "gb200", 1, 2048, Policy::kOffload));
  ds.work.pp = 8;  // the first stage: 3 dense layers and 5 MoE layers
  ds.work.shape.tp = 8;
  ds.work.shape.ep = 8;
  const Plan dsp = make_plan(ds);
  ASSERT_EQ(dsp.layers.size(), 8u);
  for (size_t i = 0; i < dsp.layers.size(); ++i) {
    const bool moe = i >= 3;
    EXPECT_EQ(dsp.layers[i].block, moe ? "mla+moe" : "mla+dense");
    for (const char* n : {"moe.router_probs", "moe.topk_idx", "moe.topk_weights", "moe.dispatch_in",
                          "moe.expert_out"}) {
      EXPECT_EQ(find_tensor(dsp.layers[i], n) != nullptr, moe) << "layer " << i << " " << n;
    }
    EXPECT_NE(find_tensor(dsp.layers[i], "mlp.act"), nullptr);
  }
}

TEST(Summary, LinkAndBudgetDefaults) {
  const Plan h100 = make_plan(request("Llama-3.1-8B", "h100-sxm", 1, 4096, Policy::kRecompute));
  EXPECT_DOUBLE_EQ(h100.summary.d2h_gbps, 52.0 / 2);  // typical, shared by 2 GPUs per link
  EXPECT_DOUBLE_EQ(h100.summary.h2d_gbps, 55.0 / 2);
  EXPECT_EQ(h100.summary.hbm_budget_bytes,
            static_cast<int64_t>(80.0 * (1.0 - kHbmReserveFraction) * 1e9));
  const Plan gh = make_plan(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute));
  EXPECT_DOUBLE_EQ(gh.summary.d2h_gbps, 170.0);
  EXPECT_DOUBLE_EQ(gh.summary.h2d_gbps, 415.0);
  EXPECT_EQ(gh.summary.calibration, "roofline");
  EXPECT_DOUBLE_EQ(gh.summary.time_scale, 1.0);

  PlanRequest r = request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute);
  r.d2h_gbps = 33.0;
  r.h2d_gbps = 44.0;
  r.hbm_budget_gb = 50.5;
  const Plan given = make_plan(r);
  EXPECT_DOUBLE_EQ(given.summary.d2h_gbps, 33.0);
  EXPECT_DOUBLE_EQ(given.summary.h2d_gbps, 44.0);
  EXPECT_EQ(given.summary.hbm_budget_bytes, 50'500'000'000);
}

// At tp = ep = pp = 1 one GPU holds the whole model: embeddings, every layer, the final
// norm and an untied head (the final norm used to be missing).
TEST(Summary, OneGpuHoldsEveryParameterOfEveryCatalogModel) {
  for (const ModelCatalogEntry& e : model_catalog()) {
    PlanRequest r = request(e.name, "gh200", 1, 256, Policy::kRecompute);
    const Plan p = make_plan(r);
    EXPECT_EQ(p.params_per_gpu, p.params_total) << e.name;
  }
}

TEST(Summary, StaticMemoryFollowsParameters) {
  for (int64_t dp : {1, 8}) {
    PlanRequest r = request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute);
    r.work.dp = dp;
    const Plan p = make_plan(r);
    EXPECT_EQ(p.params_total, parameter_count(model("Llama-3.1-8B")));
    // tp 1, pp 1: everything on one GPU, the final norm included.
    EXPECT_EQ(p.params_per_gpu, p.params_total);
    EXPECT_EQ(p.summary.peak.weights, 2 * p.params_per_gpu);
    EXPECT_EQ(p.summary.peak.gradients, 2 * p.params_per_gpu);
    EXPECT_EQ(p.summary.peak.optimizer_states, 12 * p.params_per_gpu / dp);
    EXPECT_EQ(p.tokens_per_gpu, 4096);
  }
  PlanRequest tp = request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute);
  tp.work.shape.tp = 4;
  const Plan p4 = make_plan(tp);
  EXPECT_NEAR(static_cast<double>(p4.params_per_gpu),
              static_cast<double>(parameter_count(model("Llama-3.1-8B"))) / 4.0, 1e4);
  // Experts are spread over ep as well.
  PlanRequest ep = request("Qwen3-30B-A3B", "gh200", 1, 4096, Policy::kRecompute);
  const Plan e1 = make_plan(ep);
  ep.work.shape.ep = 8;
  const Plan e8 = make_plan(ep);
  EXPECT_LT(e8.params_per_gpu, e1.params_per_gpu / 4);
}

TEST(Summary, GradientAccumulationScalesStepTime) {
  PlanRequest r = generous(request("Qwen3-30B-A3B", "gh200", 1, 4096, Policy::kAuto));
  const Plan one = make_plan(r);
  r.work.grad_accum = 4;
  const Plan four = make_plan(r);
  // The micro-batches repeat; the optimizer steps once (Note [Training state]).
  const double opt = one.summary.state.optimizer_ms;
  ASSERT_GT(opt, 0.0);
  EXPECT_DOUBLE_EQ(four.summary.state.optimizer_ms, opt);
  EXPECT_NEAR(four.summary.step_ms, 4.0 * (one.summary.step_ms - opt) + opt,
              1e-9 * four.summary.step_ms);
  EXPECT_NEAR(four.summary.recompute_step_ms, 4.0 * (one.summary.recompute_step_ms - opt) + opt,
              1e-9 * four.summary.step_ms);
  EXPECT_NEAR(four.summary.keep_step_ms, 4.0 * (one.summary.keep_step_ms - opt) + opt,
              1e-9 * four.summary.step_ms);
  EXPECT_EQ(four.summary.peak.total(), one.summary.peak.total());
}

TEST(Summary, PipelineStagePlansTheFirstStage) {
  PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kOffload));
  r.work.pp = 3;
  const Plan p = make_plan(r);
  EXPECT_EQ(p.layers.size(), 11u);  // ceil(32 / 3)
  int64_t off = 0;
  for (const LayerPlan& l : p.layers) off += l.offload_bytes;
  EXPECT_EQ(p.summary.host_pinned_bytes, 3 * off) << "1F1B: the first stage holds pp micro-batches";
  EXPECT_LT(p.params_per_gpu, p.params_total / 2);
}

TEST(Summary, CalibrationScalesLayerTimes) {
  PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute));
  r.layer_fwd_ms = 12.5;
  const Plan p = make_plan(r);
  EXPECT_EQ(p.summary.calibration, "layer-fwd-ms");
  for (const LayerPlan& l : p.layers) EXPECT_NEAR(l.fwd_ms, 12.5, 1e-9);
  const Plan roof =
      make_plan(generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute)));
  EXPECT_NEAR(p.summary.time_scale, 12.5 / roof.layers[0].fwd_ms, 1e-12);
  EXPECT_NEAR(p.layers[0].bwd_ms, roof.layers[0].bwd_ms * p.summary.time_scale, 1e-9);

  PlanRequest pr = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute));
  for (int i = 0; i < 32; ++i) pr.profile.push_back(LayerTiming{i, 1.0 + i * 0.1, 2.0 + i * 0.2});
  const Plan pp = make_plan(pr);
  EXPECT_EQ(pp.summary.calibration, "profile");
  for (int i = 0; i < 32; ++i) {
    EXPECT_NEAR(pp.layers[static_cast<size_t>(i)].fwd_ms, 1.0 + i * 0.1, 1e-9);
    EXPECT_NEAR(pp.layers[static_cast<size_t>(i)].bwd_ms, 2.0 + i * 0.2, 1e-9);
  }
}

TEST(Summary, PlansAreDeterministic) {
  const PlanRequest r = request("Mixtral-8x7B", "h100-sxm", 2, 4096, Policy::kAuto);
  EXPECT_EQ(plan_to_json(make_plan(r), r), plan_to_json(make_plan(r), r));
}

TEST(Summary, InfeasibleBudgetIsExplained) {
  // The default (Qwen3-30B-A3B on one GH200, no sharding) cannot hold its optimizer states.
  const PlanRequest r = request("Qwen3-30B-A3B", "gh200", 1, 4096, Policy::kAuto);
  const Plan p = make_plan(r);
  EXPECT_FALSE(p.summary.feasible);
  ASSERT_FALSE(p.summary.reasons.empty());
  bool budget = false;
  for (const std::string& s : p.summary.reasons) budget |= s.find("peak HBM") != std::string::npos;
  EXPECT_TRUE(budget);
  EXPECT_GT(p.summary.peak.total(), p.summary.hbm_budget_bytes);
  // Host memory too small for the pinned copies is a reason as well.
  PlanRequest host = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kOffload));
  host.hardware.host_memory_gb = 1.0;
  const Plan hp = make_plan(host);
  EXPECT_FALSE(hp.summary.feasible);
  bool pinned = false;
  for (const std::string& s : hp.summary.reasons)
    pinned |= s.find("pinned host memory") != std::string::npos;
  EXPECT_TRUE(pinned);
}

}  // namespace
}  // namespace spillway

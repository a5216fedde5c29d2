// Note [Collectives in the plan] (src/plan/plan_collectives.cpp): the collectives each layer
// carries for its parallelism, which of them are on the critical path, and the planner's step time
// against the simulator's, which schedules the same collectives as tasks.
#include <gtest/gtest.h>

#include <map>

#include "plan_helpers.hpp"
#include "spillway/plan/collectives.hpp"
#include "spillway/sim/sim.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::generous;
using spillway::testing::request;

std::map<std::string, int> count_by_what(const LayerPlan& l) {
  std::map<std::string, int> m;
  for (const CollectivePlan& c : l.collectives) ++m[c.what + (c.backward ? " bwd" : " fwd")];
  return m;
}

TEST(PlanCollectives, EachParallelismBringsItsCollectives) {
  // No parallelism, no collectives.
  const Plan alone =
      make_plan(generous(request("Llama-3.1-8B", "h100-sxm", 1, 4096, Policy::kRecompute)));
  for (const LayerPlan& l : alone.layers) EXPECT_TRUE(l.collectives.empty());
  EXPECT_EQ(alone.summary.collective_total_ms, 0.0);

  // TP 8: a gather and a scatter around attention and the MLP, forward and backward, on
  // NVLink, exposed.
  PlanRequest tp = generous(request("Llama-3.1-8B", "h100-sxm", 1, 4096, Policy::kRecompute));
  tp.work.shape.tp = 8;
  const Plan ptp = make_plan(tp);
  const std::map<std::string, int> want_tp = {{"tp.attn_gather fwd", 1}, {"tp.attn_scatter fwd", 1},
                                              {"tp.mlp_gather fwd", 1},  {"tp.mlp_scatter fwd", 1},
                                              {"tp.attn_gather bwd", 1}, {"tp.attn_scatter bwd", 1},
                                              {"tp.mlp_gather bwd", 1},  {"tp.mlp_scatter bwd", 1}};
  EXPECT_EQ(count_by_what(ptp.layers[3]), want_tp);
  const int64_t tokens_bytes = ptp.tokens_per_gpu * tp.model.hidden * 2;
  for (const CollectivePlan& c : ptp.layers[3].collectives) {
    EXPECT_EQ(c.link, "nvlink");
    EXPECT_TRUE(c.exposed);
    EXPECT_EQ(c.group, 8);
    EXPECT_EQ(c.bytes, tokens_bytes);
    EXPECT_DOUBLE_EQ(
        c.ms, ring_ms(c.kind, c.bytes, 8, c.gbps, tp.hardware.interconnect.collective_latency_us));
  }

  // EP 8 on an MoE: dispatch and combine all-to-alls, forward and backward, exposed.
  PlanRequest ep = generous(request("Qwen3-30B-A3B", "h100-sxm", 1, 4096, Policy::kRecompute));
  ep.work.shape.ep = 8;
  const Plan pep = make_plan(ep);
  const std::map<std::string, int> want_ep = {
      {"ep.dispatch fwd", 1}, {"ep.combine fwd", 1}, {"ep.dispatch bwd", 1}, {"ep.combine bwd", 1}};
  EXPECT_EQ(count_by_what(pep.layers[0]), want_ep);
  for (const CollectivePlan& c : pep.layers[0].collectives) {
    EXPECT_EQ(c.kind, CollectiveKind::kAllToAll);
    EXPECT_EQ(c.bytes, pep.tokens_per_gpu * 8 * ep.model.hidden * 2) << "T x top_k rows of d";
  }

  // DP 8: ZeRO-1 gathers the updated weights and all-reduces the gradients; ZeRO-3 gathers
  // each layer twice and reduce-scatters; a group of 16 leaves the NVLink domain.
  PlanRequest dp = generous(request("Llama-3.1-8B", "h100-sxm", 1, 4096, Policy::kRecompute));
  dp.work.dp = 8;
  const Plan z1 = make_plan(dp);
  EXPECT_EQ(count_by_what(z1.layers[5]),
            (std::map<std::string, int>{{"zero.param_gather fwd", 1}, {"dp.grad_reduce bwd", 1}}));
  for (const CollectivePlan& c : z1.layers[5].collectives) {
    EXPECT_FALSE(c.exposed);
    EXPECT_EQ(c.bytes, z1.layers[5].params * 2);
    EXPECT_EQ(c.link, "nvlink");
    // ZeRO-1: each GPU steps its shard: reduce-scatter, then the weights gathered.
    if (c.what == "dp.grad_reduce") {
      EXPECT_EQ(c.kind, CollectiveKind::kReduceScatter);
    }
  }
  dp.zero = 0;
  const Plan z0 = make_plan(dp);
  EXPECT_EQ(count_by_what(z0.layers[5]), (std::map<std::string, int>{{"dp.grad_reduce bwd", 1}}));
  EXPECT_EQ(z0.layers[5].collectives[0].kind, CollectiveKind::kAllReduce);
  dp.zero = 3;
  dp.work.dp = 16;
  const Plan z3 = make_plan(dp);
  EXPECT_EQ(count_by_what(z3.layers[5]), (std::map<std::string, int>{{"zero.weight_gather fwd", 1},
                                                                     {"zero.weight_gather bwd", 1},
                                                                     {"dp.grad_reduce bwd", 1}}));
  for (const CollectivePlan& c : z3.layers[5].collectives) {
    EXPECT_EQ(c.link, "network");
    if (c.what == "dp.grad_reduce") {
      EXPECT_EQ(c.kind, CollectiveKind::kReduceScatter);
    }
  }
}

TEST(PlanCollectives, ExposedOnesLengthenTheStepOverlappedOnesHide) {
  // All-to-alls over a slow network: the step grows by about their time.
  PlanRequest r = generous(request("Qwen3-30B-A3B", "gh200", 1, 4096, Policy::kRecompute));
  r.work.shape.ep = 8;
  const Plan slow = make_plan(r);
  PlanRequest fast_req = r;
  fast_req.hardware.interconnect.network_gbps = 1e6;
  fast_req.hardware.interconnect.collective_latency_us = 0.0;
  const Plan fast = make_plan(fast_req);
  double exposed = 0.0;
  for (const LayerPlan& l : slow.layers)
    for (const CollectivePlan& c : l.collectives) exposed += c.exposed ? c.ms : 0.0;
  ASSERT_GT(exposed, 100.0);
  EXPECT_NEAR(slow.summary.step_ms - fast.summary.step_ms, exposed, 0.02 * exposed);
  EXPECT_NEAR(slow.summary.collective_ms, exposed, 0.02 * exposed);
  // Gradient reductions on NVLink hide under the next layer's backward but for the last.
  PlanRequest d = generous(request("Llama-3.1-8B", "h100-sxm", 1, 4096, Policy::kRecompute));
  d.work.dp = 8;
  const Plan p = make_plan(d);
  EXPECT_GT(p.summary.collective_total_ms, 0.0);
  EXPECT_LT(p.summary.collective_ms, 0.2 * p.summary.collective_total_ms);
}

TEST(PlanCollectives, PlannerAndSimulatorAgreeOnTheStep) {
  struct Case {
    const char* model;
    const char* hw;
    int64_t tp, ep, dp;
    int zero;
    int64_t grad_accum;
    Policy policy = Policy::kRecompute;
    int64_t seq = 2048;
    int64_t micro_batch = 1;
  };
  // ZeRO-3 on PCIe: the gathers and the reductions share the host link, more than the
  // compute hides; with gradient accumulation the reductions run in the last micro-batch.
  for (const Case& c :
       {Case{"Qwen3-30B-A3B", "h100-sxm", 1, 8, 1, 1, 1},
        Case{"Llama-3.1-70B", "h100-sxm", 8, 1, 1, 1, 1},
        Case{"Llama-3.1-8B", "h100-sxm", 1, 1, 8, 3, 1},
        Case{"Llama-3.1-8B", "h100-sxm", 1, 1, 8, 3, 3},
        Case{"Llama-3.1-8B", "h100-pcie", 1, 1, 4, 1, 1},
        Case{"Llama-3.1-8B", "h100-pcie", 1, 1, 4, 3, 1},
        Case{"Llama-3.1-8B", "h100-pcie", 1, 1, 4, 3, 2},
        // Auto on PCIe: the copies share the host link with the rings.
        Case{"Qwen3-14B", "h100-pcie", 1, 1, 2, 3, 1, Policy::kAuto, 4096},
        Case{"Llama-3.1-8B", "h100-pcie", 1, 1, 4, 1, 1, Policy::kAuto, 4096},
        Case{"Llama-3.1-8B", "h100-pcie", 1, 1, 2, 1, 2, Policy::kAuto, 4096},
        // The planning guide's worked example (docs/guide/planning.md): the all-to-alls queue
        // behind the overlapped gathers and reductions on the one comm stream.
        Case{"Qwen3-30B-A3B", "gh200", 1, 8, 8, 1, 1, Policy::kAuto, 8192, 2}}) {
    PlanRequest r = generous(request(c.model, c.hw, c.micro_batch, c.seq, c.policy));
    r.work.shape.tp = c.tp;
    r.work.shape.ep = c.ep;
    r.work.dp = c.dp;
    r.zero = c.zero;
    r.work.grad_accum = c.grad_accum;
    const Plan p = make_plan(r);
    SimOptions o;
    o.gpus = 1;
    o.hbm_contention = false;
    const SimResult sim = simulate_training_step(p, r, o);
    SCOPED_TRACE(spillway::testing::describe(r));
    EXPECT_GT(p.summary.collective_total_ms, 0.0);
    EXPECT_NEAR(sim.summary.step_ms, p.summary.step_ms, 0.02 * p.summary.step_ms);
  }
}

// Note [The host link is shared]: a layer's forward copies share the host link with the
// ring issued as the layer starts (the next layer's ZeRO-3 weight gather), and lose
// min(copies, ring) to it; its reload shares the link with the rings issued as the layer
// it is prefetched for starts its backward. On NVLink the copies have the link alone.
TEST(PlanCollectives, HostLinkCollectivesSlowTheCopiesBesideThem) {
  PlanRequest r = generous(request("Llama-3.1-8B", "h100-pcie", 1, 4096, Policy::kOffload));
  r.work.dp = 2;
  r.zero = 3;
  const Plan p = make_plan(r);
  const size_t n = p.layers.size();
  const double d2h = p.summary.d2h_gbps * 1e6;
  const double h2d = p.summary.h2d_gbps * 1e6;
  auto ring = [&](size_t l, const char* what, bool backward) {
    double ms = 0.0;
    for (const CollectivePlan& c : p.layers[l].collectives) {
      if (c.what == what && c.backward == backward) {
        EXPECT_EQ(c.link, "host");
        ms += c.ms;
      }
    }
    return ms;
  };
  int checked = 0;
  for (size_t l = 1; l + 3 < n; ++l) {
    const LayerPlan& lp = p.layers[l];
    ASSERT_GT(lp.offload_bytes, 0);
    const double alone_d2h = static_cast<double>(lp.offload_bytes) / d2h;
    const double gather = ring(l + 1, "zero.weight_gather", false);
    ASSERT_GT(gather, 0.0);
    EXPECT_NEAR(lp.d2h_ms, alone_d2h + std::min(alone_d2h, gather), 1e-9 * alone_d2h);
    EXPECT_GT(lp.d2h_ms, alone_d2h);
    // Reloaded as layer l + 1 starts its backward, beside layer l's backward gather and
    // layer l + 2's gradient reduction (prefetch depth 1).
    const double alone_h2d = static_cast<double>(lp.offload_bytes) / h2d;
    const double rings = ring(l, "zero.weight_gather", true) + ring(l + 2, "dp.grad_reduce", true);
    EXPECT_NEAR(lp.h2d_ms, alone_h2d + std::min(alone_h2d, rings), 1e-9 * alone_h2d);
    ++checked;
  }
  EXPECT_GT(checked, 20);

  // The same on NVLink: the copies have the host link alone.
  PlanRequest nv = generous(request("Llama-3.1-8B", "h100-sxm", 1, 4096, Policy::kOffload));
  nv.work.dp = 8;
  nv.zero = 3;
  const Plan pn = make_plan(nv);
  for (const LayerPlan& lp : pn.layers) {
    if (lp.offload_bytes == 0) continue;
    EXPECT_EQ(lp.collectives.back().link, "nvlink");
    EXPECT_NEAR(lp.d2h_ms, static_cast<double>(lp.offload_bytes) / (pn.summary.d2h_gbps * 1e6),
                1e-9 * lp.d2h_ms);
  }
}

// Note [Auto is never slower than recompute]: the planner's own step for auto is at most
// the all-recompute step, also where the host-link rings make offloading a loss.
TEST(PlanCollectives, AutoIsNeverSlowerThanRecompute) {
  for (const char* model : {"Llama-3.1-8B", "Qwen3-14B"}) {
    for (const char* hw : {"h100-pcie", "h100-sxm"}) {
      for (int64_t dp : {1, 2, 4}) {
        for (int zero : {0, 1, 3}) {
          PlanRequest r = request(model, hw, 1, 4096, Policy::kAuto);
          r.work.dp = dp;
          r.zero = zero;
          const Plan p = make_plan(r);
          SCOPED_TRACE(spillway::testing::describe(r));
          EXPECT_LE(p.summary.step_ms, p.summary.recompute_step_ms * (1.0 + 1e-12));
        }
      }
    }
  }
}

}  // namespace
}  // namespace spillway

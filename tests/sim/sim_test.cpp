// Simulator tests: agreement with the planner, conservation and ordering invariants,
// link sharing, back-pressure, memory, the trace/summary formats, and the engine's fixed
// tasks and clients (Note [Fixed tasks], Note [Engine clients]).
#include "spillway/sim/sim.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "plan/plan_helpers.hpp"
#include "spillway/core/error.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using testing::generous;
using testing::request;

SimOptions exact() {  // the planner's assumptions: no HBM sharing
  SimOptions o;
  o.hbm_contention = false;
  return o;
}

// ---- agreement with the planner ---------------------------------------------------------

TEST(SimAgreement, SnowballIffPlannerWindowMissedAndStepTimesAgree) {
  const unsigned seed = 20261122;
  std::cout << "seed " << seed << "\n";
  std::mt19937 rng(seed);
  const std::vector<std::string> models = {"Qwen3-30B-A3B", "Llama-3.1-8B", "Mixtral-8x7B",
                                           "GPT-OSS-20B",   "Qwen3-14B",    "DeepSeek-V3"};
  const std::vector<std::string> hws = {"gh200", "gb200", "h100-pcie", "h100-sxm"};
  // Named offload strategies snowball on slow links; auto/selective/hybrid adapt to them.
  const std::vector<Policy> strategies = {Policy::kOffload, Policy::kOffload, Policy::kHybrid,
                                          Policy::kSelective, Policy::kAuto};
  std::uniform_real_distribution<double> log_bw(std::log(1.0), std::log(400.0));
  auto bw = [&](std::mt19937& g) { return std::exp(log_bw(g)); };
  int snowballs = 0;
  int clean = 0;
  for (int i = 0; i < 80; ++i) {
    const std::string m = models[rng() % models.size()];
    PlanRequest r =
        generous(request(m, hws[rng() % hws.size()], 1 + rng() % 2, int64_t{1024} << (rng() % 4),
                         strategies[rng() % strategies.size()]));
    if (m == "DeepSeek-V3") {
      r.work.shape.ep = 32;
      r.work.pp = 4;
    }
    r.margin = 0.0;
    r.d2h_gbps = bw(rng);
    r.h2d_gbps = bw(rng);
    const Plan plan = make_plan(r);
    const SimResult sim = simulate_training_step(plan, r, exact());
    SCOPED_TRACE(testing::describe(r) + " d2h " + std::to_string(*r.d2h_gbps));
    // The planner's verdict at margin 0, skipping verdicts within rounding of the window.
    bool planner = false;
    bool borderline = false;
    for (const LayerPlan& l : plan.layers) {
      planner |= l.snowball;
      if (l.offload_bytes > 0 && std::abs(l.late_ms) < 1e-6 * std::max(1.0, l.window_ms) &&
          l.snowball)
        borderline = true;
    }
    if (borderline) continue;
    EXPECT_EQ(sim.summary.snowball, planner);
    if (planner) {
      ++snowballs;
      size_t first = 0;
      while (!plan.layers[first].snowball) ++first;
      ASSERT_TRUE(sim.summary.snowball_first_layer.has_value());
      EXPECT_EQ(*sim.summary.snowball_first_layer, static_cast<int>(first));
    } else {
      ++clean;
      // Where the planner's assumptions hold (no snowball), the step times agree within 5%.
      EXPECT_NEAR(sim.summary.step_ms, plan.summary.step_ms, 0.05 * plan.summary.step_ms);
    }
  }
  // The sweep must exercise both verdicts, or it proves nothing.
  EXPECT_GT(snowballs, 5);
  EXPECT_GT(clean, 5);
}

// Note [Micro-batches in flight]: a pipeline plan is the first 1F1B stage, holding pp
// micro-batches; the simulator counts the pp - 1 beside GPU 0's as the planner does, so the
// two agree on the peak and on the memory verdict at every pp (the planner's peak is a sum
// of maxima at the start of backward, the simulator's the curve's maximum: within 3%).
TEST(SimAgreement, PipelinePeakAndVerdictAgreeWithThePlanner) {
  struct Case {
    std::string model;
    std::string hw;
    int64_t seq;
  };
  const std::vector<Case> cases = {{"Llama-3.1-8B", "gh200", 8192},
                                   {"Qwen3-14B", "h100-sxm", 4096},
                                   {"Qwen3-30B-A3B", "gh200", 4096},
                                   {"Mixtral-8x7B", "gb200", 4096}};
  int fits = 0;
  int over = 0;
  for (const Case& c : cases) {
    for (Policy s : {Policy::kKeep, Policy::kRecompute, Policy::kOffload}) {
      for (int pp : {1, 2, 4}) {
        PlanRequest r = request(c.model, c.hw, 1, c.seq, s);
        r.work.pp = pp;
        r.margin = 0.0;
        const Plan plan = make_plan(r);
        const SimResult sim = simulate_training_step(plan, r, exact());
        SCOPED_TRACE(testing::describe(r) + " pp " + std::to_string(pp));
        const double planned = static_cast<double>(plan.summary.peak.total());
        const double simulated = static_cast<double>(sim.summary.peak_hbm_bytes);
        EXPECT_NEAR(simulated, planned, 0.03 * planned);
        const double budget = static_cast<double>(plan.summary.hbm_budget_bytes);
        if (std::abs(planned - budget) < 0.03 * budget) continue;  // within the tolerance
        const bool planner_fits = planned <= budget;
        EXPECT_EQ(sim.summary.feasible, planner_fits);
        ++(planner_fits ? fits : over);
      }
    }
  }
  // Both verdicts, or the sweep proves nothing.
  EXPECT_GT(fits, 3);
  EXPECT_GT(over, 3);
}

// ---- conservation and ordering ---------------------------------------------------------------

TEST(SimInvariants, ConservationOrderingAndBusyTime) {
  for (Policy s : {Policy::kOffload, Policy::kSelective, Policy::kRecompute}) {
    PlanRequest r = generous(request("Qwen3-30B-A3B", "h100-sxm", 1, 4096, s));
    r.work.shape.ep = 8;
    r.work.grad_accum = 2;
    const Plan plan = make_plan(r);
    SimOptions o;  // contention on, 2 GPUs per link (the profile's)
    const SimResult sim = simulate_training_step(plan, r, o);
    SCOPED_TRACE(to_string(s));
    int64_t planned = 0;
    for (const LayerPlan& l : plan.layers) planned += l.offload_bytes;
    const int64_t expect = planned * sim.gpus * r.work.grad_accum;
    EXPECT_EQ(sim.summary.d2h_bytes, expect);
    EXPECT_EQ(sim.summary.h2d_bytes, expect);
    // Every task ran once, forward in time, after it was ready.
    std::map<std::pair<int, int>, std::vector<const TaskRecord*>> by_resource;
    for (const TaskRecord& t : sim.tasks) {
      EXPECT_GE(t.ready_ms, 0.0);
      EXPECT_GE(t.start_ms, t.ready_ms - 1e-9);
      EXPECT_GE(t.end_ms, t.start_ms);
      EXPECT_LE(t.end_ms, sim.summary.step_ms + 1e-9);
      const int res = t.kind == TaskKind::kD2H          ? 1
                      : t.kind == TaskKind::kH2D        ? 2
                      : t.kind == TaskKind::kCollective ? 3
                                                        : 0;
      by_resource[{t.gpu, res}].push_back(&t);
    }
    // No resource runs two tasks at once; busy time <= makespan.
    for (auto& [key, tasks] : by_resource) {
      std::sort(tasks.begin(), tasks.end(),
                [](auto* a, auto* b) { return a->start_ms < b->start_ms; });
      double busy = 0.0;
      for (size_t i = 0; i < tasks.size(); ++i) {
        busy += tasks[i]->end_ms - tasks[i]->start_ms;
        if (i > 0) {
          EXPECT_GE(tasks[i]->start_ms, tasks[i - 1]->end_ms - 1e-9);
        }
      }
      EXPECT_LE(busy, sim.summary.step_ms + 1e-9);
    }
    // A reload never starts before its offload ended.
    std::map<std::tuple<int, int, int, std::string>, double> d2h_end;
    for (const TaskRecord& t : sim.tasks) {
      if (t.kind == TaskKind::kD2H) d2h_end[{t.gpu, t.micro_batch, t.layer, t.name}] = t.end_ms;
    }
    for (const TaskRecord& t : sim.tasks) {
      if (t.kind != TaskKind::kH2D) continue;
      auto it = d2h_end.find({t.gpu, t.micro_batch, t.layer, t.name});
      ASSERT_NE(it, d2h_end.end()) << t.name;
      EXPECT_GE(t.start_ms, it->second - 1e-9) << t.name;
    }
    // The memory curve never runs backwards in time, and its peak is what is reported.
    int64_t peak = 0;
    for (size_t i = 0; i < sim.memory.size(); ++i) {
      if (i > 0) {
        EXPECT_GE(sim.memory[i].t_ms, sim.memory[i - 1].t_ms);
      }
      peak = std::max(peak, sim.memory[i].bytes);
    }
    EXPECT_EQ(peak, sim.summary.peak_hbm_bytes);
    // Split: compute + recompute + stall + collective wait + idle covers GPU 0's step
    // (ep 8: the all-to-alls block compute).
    EXPECT_GT(sim.summary.collective_wait_ms, 0.0);
    EXPECT_NEAR(sim.summary.compute_ms + sim.summary.recompute_ms + sim.summary.stall_ms +
                    sim.summary.collective_wait_ms + sim.summary.idle_ms,
                sim.summary.gpu_step_ms[0], 1e-6 * sim.summary.gpu_step_ms[0]);
  }
}

TEST(SimInvariants, MemoryFallsWithRecomputeAndReturnsToStatic) {
  PlanRequest keep = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kKeep));
  PlanRequest rec = keep;
  rec.strategy = Policy::kRecompute;
  const SimResult a = simulate_training_step(make_plan(keep), keep, exact());
  const Plan prec = make_plan(rec);
  const SimResult b = simulate_training_step(prec, rec, exact());
  EXPECT_GT(a.summary.peak_hbm_bytes, b.summary.peak_hbm_bytes);
  const MemoryBreakdown& pk = prec.summary.peak;
  // Every activation allocated in the step is freed by its end.
  EXPECT_EQ(b.memory.back().bytes, pk.weights + pk.gradients + pk.optimizer_states);
  EXPECT_GT(b.summary.recompute_ms, 0.0);
  EXPECT_EQ(a.summary.recompute_ms, 0.0);
}

// ---- shared links ----------------------------------------------------------------------------

TEST(SimLinks, SharedLinkTakesNTimesAsLongOneLinkEachDoesNot) {
  // Weight streaming with negligible compute: the link is the bottleneck.
  PlanRequest r = generous(request("Llama-3.1-8B", "h100-pcie", 1, 128, Policy::kKeep));
  r.layer_fwd_ms = 0.001;
  const Plan plan = make_plan(r);
  StreamOptions one;
  one.depth = 2;
  const double t1 = simulate_weight_streaming(plan, r, one).summary.step_ms;
  for (int n : {2, 4, 8}) {
    StreamOptions shared = one;
    shared.gpus = n;
    shared.gpus_per_link = n;
    StreamOptions separate = one;
    separate.gpus = n;
    separate.gpus_per_link = 1;
    const SimResult s = simulate_weight_streaming(plan, r, shared);
    const SimResult p = simulate_weight_streaming(plan, r, separate);
    EXPECT_NEAR(s.summary.step_ms, n * t1, 0.02 * n * t1) << n << " GPUs on one link";
    EXPECT_NEAR(p.summary.step_ms, t1, 0.02 * t1) << n << " GPUs, one link each";
    EXPECT_NEAR(s.summary.link_h2d_gbps, plan.summary.h2d_gbps * plan.summary.gpus_per_link,
                0.02 * s.summary.link_h2d_gbps);
  }
}

TEST(SimLinks, ShardedStreamingCarriesEachLayerOnceOverTheSharedLink) {
  // Note [Sharded streaming]: copy-bound, N GPUs on one link each copying 1/N of every
  // layer move one GPU's bytes in one GPU's time; full copy moves N times the bytes.
  PlanRequest r = generous(request("Llama-3.1-8B", "h100-pcie", 1, 128, Policy::kKeep));
  r.layer_fwd_ms = 0.001;
  const Plan plan = make_plan(r);
  StreamOptions one;
  one.depth = 2;
  const SimResult alone = simulate_weight_streaming(plan, r, one);
  for (int n : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << n << " GPUs on one link");
    StreamOptions full = one;
    full.gpus = n;
    full.gpus_per_link = n;
    StreamOptions sharded = full;
    sharded.sharded = true;
    sharded.peer_gbps = 1e6;  // peers far faster than the link
    const SimResult f = simulate_weight_streaming(plan, r, full);
    const SimResult s = simulate_weight_streaming(plan, r, sharded);
    EXPECT_NEAR(static_cast<double>(s.summary.h2d_bytes),
                static_cast<double>(alone.summary.h2d_bytes),
                256.0 * n * static_cast<double>(plan.layers.size()));
    EXPECT_EQ(f.summary.h2d_bytes, n * alone.summary.h2d_bytes);
    EXPECT_NEAR(s.summary.step_ms, alone.summary.step_ms, 0.03 * alone.summary.step_ms);
    EXPECT_LT(s.summary.step_ms * (n - 0.5), f.summary.step_ms);
    EXPECT_EQ(s.summary.collectives, n * static_cast<int64_t>(plan.layers.size()));
    // Slow peers make the all-gathers the bottleneck: each GPU receives (N-1)/N of every
    // layer over them.
    StreamOptions slow = sharded;
    slow.peer_gbps = plan.summary.h2d_gbps * plan.summary.gpus_per_link / 4;
    const SimResult w = simulate_weight_streaming(plan, r, slow);
    const double gather_ms =
        static_cast<double>(alone.summary.h2d_bytes) * (n - 1) / n / (slow.peer_gbps * 1e6);
    EXPECT_NEAR(w.summary.step_ms, gather_ms, 0.1 * gather_ms);
  }
  StreamOptions bad = one;
  bad.sharded = true;
  try {
    (void)simulate_weight_streaming(plan, r, bad);
    FAIL() << "sharded streaming without a peer bandwidth was accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), "peer_gbps");
  }
}

TEST(SimLinks, StreamedTrainingReStreamsBackwardButTheTurnsLayers) {
  // Note [Streaming across steps]: a training step visits the layers forward then in
  // reverse; backward re-streams all but the depth + 1 still in their buffers at the turn.
  PlanRequest r = generous(request("Llama-3.1-8B", "h100-pcie", 1, 128, Policy::kKeep));
  r.layer_fwd_ms = 0.001;  // copy-bound
  const Plan plan = make_plan(r);
  const auto n = static_cast<int64_t>(plan.layers.size());
  for (int depth : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    StreamOptions fwd;
    fwd.depth = depth;
    StreamOptions train = fwd;
    train.training = true;
    const SimResult f = simulate_weight_streaming(plan, r, fwd);
    const SimResult t = simulate_weight_streaming(plan, r, train);
    const int64_t layer = f.summary.h2d_bytes / n;  // the layers are alike
    EXPECT_EQ(t.summary.h2d_bytes, (2 * n - depth - 1) * layer);
    EXPECT_NEAR(t.summary.step_ms,
                f.summary.step_ms * static_cast<double>(2 * n - depth - 1) / static_cast<double>(n),
                0.03 * t.summary.step_ms);
  }
  // Compute-bound (a slow backward): the step is the forward and backward compute.
  PlanRequest slow = r;
  slow.layer_fwd_ms = 50.0;
  const Plan p2 = make_plan(slow);
  StreamOptions train;
  train.depth = 2;
  train.training = true;
  const SimResult t = simulate_weight_streaming(p2, slow, train);
  double compute = 0.0;
  for (const LayerPlan& lp : p2.layers) compute += lp.fwd_ms + lp.bwd_ms;
  EXPECT_GT(p2.layers[0].bwd_ms, 0.0);
  EXPECT_NEAR(t.summary.step_ms, compute, 0.05 * compute);
  EXPECT_GE(t.summary.step_ms, compute);
}

TEST(SimLinks, TwoGpusOnOneLinkSlowTheTrainingStepWhenCopyBound) {
  PlanRequest r = generous(request("Qwen3-30B-A3B", "h100-sxm", 1, 4096, Policy::kOffload));
  r.work.shape.ep = 8;
  const Plan plan = make_plan(r);
  SimOptions shared = exact();
  shared.gpus = 2;
  shared.gpus_per_link = 2;
  SimOptions separate = shared;
  separate.gpus_per_link = 1;
  const SimResult a = simulate_training_step(plan, r, shared);
  const SimResult b = simulate_training_step(plan, r, separate);
  EXPECT_GT(a.summary.step_ms, b.summary.step_ms);
  EXPECT_GE(a.summary.stall_ms, b.summary.stall_ms);
}

// ---- back-pressure and HBM sharing -----------------------------------------------------------

TEST(SimBackPressure, InFlightBytesStayWithinTheBoundPlusOneTensor) {
  PlanRequest r = generous(request("Llama-3.1-8B", "h100-pcie", 2, 4096, Policy::kOffload));
  const Plan plan = make_plan(r);
  int64_t largest = 0;
  for (const LayerPlan& l : plan.layers) {
    for (const TensorPlan& t : l.tensors) {
      if (t.action == Action::kOffload) largest = std::max(largest, t.bytes);
    }
  }
  ASSERT_GT(largest, 0);
  const int64_t bound = 2 * largest;
  SimOptions o = exact();
  o.inflight_bound_bytes = bound;
  const SimResult sim = simulate_training_step(plan, r, o);
  EXPECT_GT(sim.summary.backpressure_ms, 0.0);
  const SimResult unbounded = simulate_training_step(plan, r, exact());
  EXPECT_EQ(unbounded.summary.backpressure_ms, 0.0);
  EXPECT_GE(sim.summary.step_ms, unbounded.summary.step_ms - 1e-6);
  // The backlog at every layer boundary respects the bound (plus the tensor in hand).
  for (int64_t b : sim.summary.backlog_bytes) EXPECT_LE(b, bound + largest);
  const int64_t worst = *std::max_element(unbounded.summary.backlog_bytes.begin(),
                                          unbounded.summary.backlog_bytes.end());
  EXPECT_GT(worst, bound + largest)
      << "the unbounded run must exceed the bound, or the test proves nothing";
}

TEST(SimHbm, SharingSlowsMemoryBoundWorkNeverSpeedsItUp) {
  PlanRequest r = generous(request("Qwen3-30B-A3B", "gh200", 2, 8192, Policy::kOffload));
  r.work.shape.ep = 8;
  const Plan plan = make_plan(r);
  SimOptions on;
  const SimResult a = simulate_training_step(plan, r, on);
  const SimResult b = simulate_training_step(plan, r, exact());
  EXPECT_GT(a.summary.hbm_slowdown, 1.0);
  EXPECT_EQ(b.summary.hbm_slowdown, 1.0);
  EXPECT_GE(a.summary.step_ms, b.summary.step_ms);
}

// ---- the memory verdict ----------------------------------------------------------------------

// The planning guide's H100 example (docs/guide/planning.md): GPU 0 peaks above the 80 GB card and
// the 76 GB budget; the result says so with a reason per limit, in GB; the same plan under a budget
// it fits is feasible.
TEST(SimVerdict, PeakOverHbmAndBudgetIsInfeasibleWithReasonsInGb) {
  PlanRequest r = request("Qwen3-30B-A3B", "h100-sxm", 2, 8192, Policy::kOffload);
  r.work.shape.ep = 8;
  r.work.dp = 8;
  const Plan plan = make_plan(r);
  const SimResult sim = simulate_training_step(plan, r, SimOptions{});
  const SimSummary& s = sim.summary;
  EXPECT_EQ(s.hbm_capacity_bytes, 80'000'000'000);
  EXPECT_EQ(s.hbm_budget_bytes, plan.summary.hbm_budget_bytes);
  ASSERT_GT(s.peak_hbm_bytes, s.hbm_capacity_bytes);
  EXPECT_FALSE(s.feasible);
  ASSERT_EQ(s.reasons.size(), 2u);
  EXPECT_NE(s.reasons[0].find(
                fmt::format("peak HBM {:.2f} GB", static_cast<double>(s.peak_hbm_bytes) / 1e9)),
            std::string::npos)
      << s.reasons[0];
  EXPECT_NE(s.reasons[0].find("80.00 GB of HBM on h100-sxm"), std::string::npos) << s.reasons[0];
  EXPECT_NE(s.reasons[1].find(
                fmt::format("budget {:.2f} GB", static_cast<double>(s.hbm_budget_bytes) / 1e9)),
            std::string::npos)
      << s.reasons[1];
  // The peak's time is a point of the curve holding the peak.
  bool found = false;
  for (const MemoryPoint& m : sim.memory)
    found |= m.t_ms == s.peak_hbm_ms && m.bytes == s.peak_hbm_bytes;
  EXPECT_TRUE(found);
  const nlohmann::json j = nlohmann::json::parse(sim_summary_json(sim));
  EXPECT_FALSE(j["feasible"].get<bool>());
  EXPECT_EQ(j["reasons"].size(), 2u);
  EXPECT_EQ(j["hbm_capacity_bytes"].get<int64_t>(), s.hbm_capacity_bytes);
  EXPECT_EQ(j["hbm_budget_bytes"].get<int64_t>(), s.hbm_budget_bytes);
  EXPECT_NE(format_sim_report(sim, r).find("feasible         NO"), std::string::npos);
  const std::string svg = sim_plot_svg(sim, "t");
  EXPECT_NE(svg.find("GPU HBM 80.0 GB"), std::string::npos);
  EXPECT_NE(
      svg.find(fmt::format("budget {:.1f} GB", static_cast<double>(s.hbm_budget_bytes) / 1e9)),
      std::string::npos);

  // Over the budget alone (a budget below the card) is infeasible too, with one reason.
  PlanRequest tight = request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kAuto);
  tight.work.dp = 8;
  const Plan fits_plan = make_plan(tight);
  const SimResult fits = simulate_training_step(fits_plan, tight, SimOptions{});
  EXPECT_TRUE(fits.summary.feasible);
  EXPECT_TRUE(fits.summary.reasons.empty());
  Plan small_budget = fits_plan;
  small_budget.summary.hbm_budget_bytes = fits.summary.peak_hbm_bytes - 1;
  const SimResult over = simulate_training_step(small_budget, tight, SimOptions{});
  EXPECT_FALSE(over.summary.feasible);
  ASSERT_EQ(over.summary.reasons.size(), 1u);
  EXPECT_NE(over.summary.reasons[0].find("> budget"), std::string::npos);
}

// ---- formats ---------------------------------------------------------------------------------

TEST(SimFormats, TraceIsChromeJsonWithRequiredFieldsOnEveryEvent) {
  PlanRequest r = generous(request("Qwen3-30B-A3B", "h100-sxm", 1, 4096, Policy::kOffload));
  r.work.shape.ep = 8;
  const SimResult sim = simulate_training_step(make_plan(r), r, SimOptions{});
  const nlohmann::json t = nlohmann::json::parse(sim_trace_json(sim));
  ASSERT_TRUE(t.contains("traceEvents"));
  size_t complete = 0;
  for (const auto& e : t["traceEvents"]) {
    for (const char* f : {"name", "ph", "ts", "pid", "tid"})
      EXPECT_TRUE(e.contains(f)) << f << " in " << e.dump();
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_TRUE(e.contains("dur"));
      EXPECT_GE(e["dur"].get<double>(), 0.0);
      for (const char* f : {"layer", "bytes"}) EXPECT_TRUE(e["args"].contains(f)) << e.dump();
    }
  }
  EXPECT_EQ(complete, sim.tasks.size());
  const nlohmann::json s = nlohmann::json::parse(sim_summary_json(sim));
  for (const char* f : {"step_ms", "peak_hbm_bytes", "snowball", "snowball_first_layer",
                        "backlog_bytes", "stall_ms", "link_gbps_achieved"}) {
    EXPECT_TRUE(s.contains(f)) << f;
  }
  EXPECT_EQ(s["backlog_bytes"].size(), sim.summary.backlog_bytes.size());
  const std::string svg = sim_plot_svg(sim, "test");
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("time (ms)"), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
}

// Every complete event of every GPU carries its task's name; with the same plan on every
// GPU, each GPU's events have the same names in the same order as GPU 0's.
TEST(SimFormats, TraceNamesEveryEventOfEveryGpu) {
  PlanRequest r = generous(request("Qwen3-30B-A3B", "h100-sxm", 1, 4096, Policy::kOffload));
  r.work.shape.ep = 8;
  SimOptions o;
  o.gpus = 4;
  o.gpus_per_link = 2;
  StreamOptions so;
  so.gpus = 3;
  so.gpus_per_link = 3;
  const Plan plan = make_plan(r);
  for (const SimResult& sim :
       {simulate_training_step(plan, r, o), simulate_weight_streaming(plan, r, so)}) {
    SCOPED_TRACE(sim.scenario);
    const nlohmann::json t = nlohmann::json::parse(sim_trace_json(sim));
    std::map<int, std::vector<std::string>> names;  // per GPU, in trace order
    for (const auto& e : t["traceEvents"]) {
      ASSERT_TRUE(e["name"].is_string()) << e.dump();
      EXPECT_FALSE(e["name"].get<std::string>().empty()) << e.dump();
      if (e["ph"] == "X") names[e["pid"].get<int>()].push_back(e["name"].get<std::string>());
    }
    ASSERT_EQ(static_cast<int>(names.size()), sim.gpus);
    for (const auto& [gpu, n] : names) {
      EXPECT_FALSE(n.empty());
      EXPECT_EQ(n, names[0]) << "GPU " << gpu;
    }
    for (const TaskRecord& task : sim.tasks) {
      EXPECT_FALSE(task.name.empty()) << "GPU " << task.gpu << " layer " << task.layer;
    }
  }
}

TEST(SimFormats, PlanJsonRoundTripSimulatesTheSame) {
  PlanRequest r = generous(request("Mixtral-8x7B", "gb200", 1, 4096, Policy::kAuto));
  r.work.shape.ep = 8;
  const Plan plan = make_plan(r);
  testing::TempDir dir;
  const std::string path = (dir.path() / "plan.json").string();
  {
    std::ofstream out(path);
    out << plan_to_json(plan, r);
  }
  PlanRequest r2;
  const Plan back = load_plan_json(path, &r2);
  ASSERT_EQ(back.layers.size(), plan.layers.size());
  const SimResult a = simulate_training_step(plan, r, exact());
  const SimResult b = simulate_training_step(back, r2, exact());
  EXPECT_NEAR(a.summary.step_ms, b.summary.step_ms, 1e-6 * a.summary.step_ms);
  EXPECT_EQ(a.summary.d2h_bytes, b.summary.d2h_bytes);
  EXPECT_EQ(a.summary.peak_hbm_bytes, b.summary.peak_hbm_bytes);
}

// ---- the engine: fixed tasks and clients ------------------------------------------------

// Note [Fixed tasks]: each ends at exactly its start plus its work; equal ends come one at
// a time in the order the tasks were added (not the order they started); a timer waits for
// its not_before_ms alone.
TEST(SimEngine, FixedTasksEndExactlyAndEqualEndsInAddOrder) {
  sim::Engine e;
  const int s = e.add_stream(0, ResourceKind::kCompute);
  auto fixed = [&](int stream, double not_before, double ms) {
    sim::Task t;
    t.fixed = true;
    t.stream = stream;
    t.not_before_ms = not_before;
    t.work = ms;
    return e.add_task(t);
  };
  const int first = fixed(s, 0.0, 0.1);
  const int second = fixed(s, 0.0, 0.2);  // after the first: ends at 0.1 + 0.2 exactly
  const int late = fixed(s, 2.0, 1.0);    // heads the stream at 0.1 + 0.2, starts at 2
  const int t3a = fixed(-1, 3.0, 0.0);
  const int t15 = fixed(-1, 1.0, 0.5);
  const int t3b = fixed(-1, 3.0, 0.0);  // ends at 3 with late and t3a, after both
  std::vector<std::pair<int, double>> seen;
  e.run([&](int task) { seen.emplace_back(task, e.now_ms()); });
  const std::vector<std::pair<int, double>> expect = {
      {first, 0.1}, {second, 0.1 + 0.2}, {t15, 1.5}, {late, 3.0}, {t3a, 3.0}, {t3b, 3.0}};
  EXPECT_EQ(seen, expect);
  const sim::Task& l = e.tasks()[static_cast<size_t>(late)];
  EXPECT_EQ(l.ready_ms, 0.1 + 0.2);
  EXPECT_EQ(l.start_ms, 2.0);
  EXPECT_EQ(e.stream_busy_ms(s), 0.1 + (0.1 + 0.2 - 0.1) + 1.0);
  EXPECT_EQ(e.makespan_ms(), 3.0);
}

// Note [Engine clients]: a task added from on_finish starts at once; a recycled id is
// reused, so a long chain keeps one record; tasks added at the same time end in the order
// they were added.
TEST(SimEngine, AClientAddsTasksFromOnFinishAndRecyclesThem) {
  sim::Engine e;
  const int s = e.add_stream(0, ResourceKind::kCompute);
  sim::Task timer;
  timer.fixed = true;
  timer.not_before_ms = 1.0;
  const int first = e.add_task(timer);
  std::vector<std::pair<int, double>> seen;
  int chained = 0;
  e.run([&](int task) {
    seen.emplace_back(task, e.now_ms());
    e.recycle(task);
    if (chained < 1000) {
      ++chained;
      sim::Task next;
      next.fixed = true;
      next.stream = s;
      next.work = 0.25;
      EXPECT_EQ(e.add_task(next), first);  // the id just recycled
    }
  });
  ASSERT_EQ(seen.size(), 1001u);
  double t = 1.0;
  for (const auto& [task, at] : seen) {
    EXPECT_EQ(at, t);
    t += 0.25;
  }
  EXPECT_EQ(e.tasks().size(), 1u);
  EXPECT_EQ(e.stream_busy_ms(s), 1000 * 0.25);
  EXPECT_THROW(e.recycle(first), Error);  // only during run()
}

// A fixed task beside fluid ones: the copy is timed as without it, the timer ends exactly at
// its time and the client sees the two in order.
TEST(SimEngine, ATimerBesideAFluidCopyLeavesTheCopyAlone) {
  auto copy_end = [](bool with_timer, std::vector<double>* seen) {
    sim::Engine e;
    const int link = e.add_link(100.0);  // bytes per ms
    const int d2h = e.add_stream(0, ResourceKind::kD2H);
    sim::Task c;
    c.kind = TaskKind::kD2H;
    c.stream = d2h;
    c.link = link;
    c.work = 1000.0;
    const int copy = e.add_task(c);
    if (with_timer) {
      sim::Task t;
      t.fixed = true;
      t.not_before_ms = 4.0;
      e.add_task(t);
    }
    e.run([&](int) { seen->push_back(e.now_ms()); });
    EXPECT_NEAR(e.link_busy_ms(link), 10.0, 1e-12);
    return e.tasks()[static_cast<size_t>(copy)].end_ms;
  };
  std::vector<double> alone;
  std::vector<double> beside;
  EXPECT_NEAR(copy_end(true, &beside), copy_end(false, &alone), 1e-12);
  ASSERT_EQ(beside.size(), 2u);
  EXPECT_EQ(beside[0], 4.0);
  EXPECT_NEAR(beside[1], 10.0, 1e-12);
}

}  // namespace
}  // namespace spillway

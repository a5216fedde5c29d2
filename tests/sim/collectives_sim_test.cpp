// Collectives in the simulator (Note [Collectives in the simulator], src/sim/scenarios.cpp):
// a collective through the host link shares it with the offload copies (and is slower for
// it), one over NVLink does not touch them; ring bytes are conserved; exposed all-to-alls
// block compute by exactly their time; every collective is a named trace event.
// Plans come from make_plan with CollectivePlan entries appended, or from the planner's
// own (--ep, --dp). No HBM sharing here, so times are exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "plan/plan_helpers.hpp"
#include "spillway/plan/collectives.hpp"
#include "spillway/sim/sim.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using testing::generous;
using testing::request;

SimOptions exact() {
  SimOptions o;
  o.hbm_contention = false;
  return o;
}

// Every layer's gradient (bf16) reduced in its backward over `group` GPUs on `link`.
Plan with_grad_reduce(Plan p, int64_t group, const CollectiveLink& link) {
  for (LayerPlan& l : p.layers) {
    l.collectives.push_back(make_collective(CollectiveKind::kAllReduce, "dp.grad_reduce", true,
                                            l.params * 2, group, link, 0.0));
  }
  return p;
}

std::vector<const TaskRecord*> of_kind(const SimResult& r, TaskKind k, int gpu = 0) {
  std::vector<const TaskRecord*> out;
  for (const TaskRecord& t : r.tasks)
    if (t.kind == k && t.gpu == gpu) out.push_back(&t);
  return out;
}

double busy_ms(const std::vector<const TaskRecord*>& ts) {
  double sum = 0.0;
  for (const TaskRecord* t : ts) sum += t->end_ms - t->start_ms;
  return sum;
}

// H100 PCIe with 4 GPUs behind one switch uplink: the offload copies and the gradient
// all-reduce of all four cross the same root complex.
PlanRequest pcie4(Policy policy) {
  PlanRequest r = generous(request("Llama-3.1-8B", "h100-pcie", 1, 2048, policy));
  r.hardware.gpus_per_link = 4;
  return r;
}

TEST(SimCollectives, HostCollectiveIsSlowerWhenOffloadCopiesShareTheLink) {
  const PlanRequest quiet_req = pcie4(Policy::kRecompute);  // no copies
  const PlanRequest busy_req = pcie4(Policy::kOffload);     // copies in both directions
  const CollectiveLink host = collective_link(quiet_req.hardware, 4, 1);
  ASSERT_EQ(host.link, "host");
  ASSERT_DOUBLE_EQ(host.gbps, std::min(52.0, 55.0) / 4.0);
  const Plan quiet = with_grad_reduce(make_plan(quiet_req), 4, host);
  const Plan busy = with_grad_reduce(make_plan(busy_req), 4, host);
  const SimResult alone = simulate_training_step(quiet, quiet_req, exact());
  const SimResult shared = simulate_training_step(busy, busy_req, exact());
  ASSERT_EQ(alone.gpus, 4);
  ASSERT_EQ(alone.gpus_per_link, 4);
  EXPECT_EQ(alone.summary.d2h_bytes + alone.summary.h2d_bytes, 0);
  ASSERT_GT(shared.summary.h2d_bytes, 0);

  // Alone, the four GPUs' rings split the link four ways: each collective takes exactly
  // its planned time (ring bytes at the per-GPU share).
  const auto alone_c = of_kind(alone, TaskKind::kCollective);
  ASSERT_EQ(alone_c.size(), quiet.layers.size());
  double planned_ms = 0.0;
  for (const LayerPlan& l : quiet.layers) planned_ms += l.collectives[0].ms;
  EXPECT_NEAR(busy_ms(alone_c), planned_ms, 1e-9 * planned_ms);
  EXPECT_NEAR(alone.summary.collective_ms, planned_ms, 1e-9 * planned_ms);
  for (const TaskRecord* t : alone_c) EXPECT_EQ(t->link, "host");

  // Beside the reloads, the same rings take longer (fair share of the same directions).
  const double shared_ms = busy_ms(of_kind(shared, TaskKind::kCollective));
  EXPECT_GT(shared_ms, planned_ms * 1.05) << "alone " << planned_ms << " ms, shared " << shared_ms;
  EXPECT_EQ(shared.summary.collective_host_bytes, shared.summary.collective_bytes);

  // And the copies are slower for it: the same plan without the collectives.
  const SimResult copies_alone = simulate_training_step(make_plan(busy_req), busy_req, exact());
  EXPECT_GT(busy_ms(of_kind(shared, TaskKind::kH2D)),
            busy_ms(of_kind(copies_alone, TaskKind::kH2D)) * 1.01);
  EXPECT_GT(shared.summary.step_ms, copies_alone.summary.step_ms);
}

TEST(SimCollectives, NvlinkCollectiveLeavesTheCopiesAlone) {
  const PlanRequest r = generous(request("Llama-3.1-8B", "h100-sxm", 1, 2048, Policy::kOffload));
  const CollectiveLink nvl = collective_link(r.hardware, 8, 1);
  ASSERT_EQ(nvl.link, "nvlink");
  const Plan base = make_plan(r);
  const SimResult without = simulate_training_step(base, r, exact());
  const SimResult with = simulate_training_step(with_grad_reduce(base, 8, nvl), r, exact());
  ASSERT_GT(without.summary.d2h_bytes, 0);
  // Every copy runs exactly as without the collectives.
  for (TaskKind k : {TaskKind::kD2H, TaskKind::kH2D}) {
    for (int g = 0; g < with.gpus; ++g) {
      const auto a = of_kind(without, k, g);
      const auto b = of_kind(with, k, g);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i]->name, b[i]->name);
        EXPECT_DOUBLE_EQ(a[i]->start_ms, b[i]->start_ms) << a[i]->name;
        EXPECT_DOUBLE_EQ(a[i]->end_ms, b[i]->end_ms) << a[i]->name;
      }
    }
  }
  // Each ring runs at its own link's bandwidth.
  for (const TaskRecord* t : of_kind(with, TaskKind::kCollective)) {
    EXPECT_EQ(t->link, "nvlink");
    EXPECT_NEAR(t->end_ms - t->start_ms, static_cast<double>(t->bytes) / (nvl.gbps * 1e6), 1e-9);
  }
  EXPECT_EQ(with.summary.collective_host_bytes, 0);
  // Overlapped: only the optimizer waits, for the last reduction (it steps reduced
  // gradients), and only by the reductions' tail past backward.
  EXPECT_NEAR(with.summary.collective_wait_ms, with.summary.collective_tail_ms, 1e-9);
  // The same rings forced through the host link do slow the reloads.
  const SimResult host = simulate_training_step(
      with_grad_reduce(base, 8, {"host", r.hardware.d2h_typical.value / 2}), r, exact());
  EXPECT_GT(busy_ms(of_kind(host, TaskKind::kH2D)), busy_ms(of_kind(without, TaskKind::kH2D)));
}

// A MoE plan with every placement of Note [Collectives in the simulator]: weight gathers
// in forward and backward, all-to-alls in both, gradient reduce-scatters.
Plan moe_with_everything(const PlanRequest& r, const CollectiveLink& link) {
  Plan p = make_plan(r);
  for (LayerPlan& l : p.layers) {
    const int64_t w = l.params * 2;
    const int64_t tokens = int64_t{1} << 24;
    l.collectives.push_back(
        make_collective(CollectiveKind::kAllGather, "zero.weight_gather", false, w, 8, link, 0.0));
    l.collectives.push_back(
        make_collective(CollectiveKind::kAllToAll, "ep.dispatch", false, tokens, 8, link, 0.0));
    l.collectives.push_back(
        make_collective(CollectiveKind::kAllToAll, "ep.combine", false, tokens, 8, link, 0.0));
    l.collectives.push_back(
        make_collective(CollectiveKind::kAllGather, "zero.weight_gather", true, w, 8, link, 0.0));
    l.collectives.push_back(
        make_collective(CollectiveKind::kAllToAll, "ep.combine", true, tokens, 8, link, 0.0));
    l.collectives.push_back(
        make_collective(CollectiveKind::kAllToAll, "ep.dispatch", true, tokens, 8, link, 0.0));
    l.collectives.push_back(
        make_collective(CollectiveKind::kReduceScatter, "zero.grad_reduce", true, w, 8, link, 0.0));
  }
  return p;
}

TEST(SimCollectives, RingBytesAreConservedAndReductionsRunOncePerStep) {
  PlanRequest r = generous(request("Qwen3-30B-A3B", "h100-pcie", 1, 1024, Policy::kOffload));
  r.work.grad_accum = 2;
  for (const char* link : {"host", "network"}) {
    SCOPED_TRACE(link);
    const Plan p = moe_with_everything(r, {link, 25.0});
    SimOptions o = exact();
    o.gpus = 2;
    o.gpus_per_link = 2;
    const SimResult sim = simulate_training_step(p, r, o);
    int64_t per_step = 0;
    int tasks = 0;
    for (const LayerPlan& l : p.layers) {
      for (const CollectivePlan& c : l.collectives) {
        const bool once = c.backward && !c.exposed && c.kind != CollectiveKind::kAllGather;
        const int64_t times = once ? 1 : r.work.grad_accum;
        per_step += ring_bytes(c) * times;
        tasks += static_cast<int>(times);
      }
    }
    EXPECT_EQ(sim.summary.collective_bytes, per_step * sim.gpus);
    EXPECT_EQ(sim.summary.collectives, tasks * sim.gpus);
    int64_t recorded = 0;
    for (const TaskRecord& t : sim.tasks)
      if (t.kind == TaskKind::kCollective) recorded += t.bytes;
    EXPECT_EQ(recorded, sim.summary.collective_bytes);
    EXPECT_EQ(sim.summary.collective_host_bytes,
              std::string(link) == "host" ? sim.summary.collective_bytes : 0);
    // The copies are conserved too.
    int64_t planned = 0;
    for (const LayerPlan& l : p.layers) planned += l.offload_bytes;
    EXPECT_EQ(sim.summary.d2h_bytes, planned * sim.gpus * r.work.grad_accum);
    EXPECT_EQ(sim.summary.h2d_bytes, sim.summary.d2h_bytes);
    // One comm stream per GPU: its collectives never overlap.
    for (int g = 0; g < sim.gpus; ++g) {
      auto cs = of_kind(sim, TaskKind::kCollective, g);
      std::sort(cs.begin(), cs.end(), [](auto* a, auto* b) { return a->start_ms < b->start_ms; });
      for (size_t i = 1; i < cs.size(); ++i) EXPECT_GE(cs[i]->start_ms, cs[i - 1]->end_ms - 1e-9);
    }
    EXPECT_GT(sim.summary.collective_wait_ms, 0.0);
  }
}

TEST(SimCollectives, ExposedAllToAllDelaysTheStepByItsTime) {
  const PlanRequest r = generous(request("Qwen3-30B-A3B", "h100-sxm", 1, 1024, Policy::kKeep));
  const Plan base = make_plan(r);
  Plan p = base;
  const CollectiveLink nvl = collective_link(r.hardware, 8, 1);
  for (LayerPlan& l : p.layers) {
    l.collectives.push_back(
        make_collective(CollectiveKind::kAllToAll, "ep.dispatch", false, 64 << 20, 8, nvl, 0.0));
    l.collectives.push_back(
        make_collective(CollectiveKind::kAllToAll, "ep.combine", false, 64 << 20, 8, nvl, 0.0));
    l.collectives.push_back(
        make_collective(CollectiveKind::kAllToAll, "ep.combine", true, 64 << 20, 8, nvl, 0.0));
  }
  const SimResult a = simulate_training_step(base, r, exact());
  const SimResult b = simulate_training_step(p, r, exact());
  double planned = 0.0;
  for (const LayerPlan& l : p.layers)
    for (const CollectivePlan& c : l.collectives) planned += c.ms;
  EXPECT_NEAR(b.summary.step_ms - a.summary.step_ms, planned, 1e-9 * b.summary.step_ms);
  EXPECT_NEAR(b.summary.collective_wait_ms, planned, 1e-9 * b.summary.step_ms);
  EXPECT_NEAR(b.summary.compute_ms, a.summary.compute_ms, 1e-9 * a.summary.compute_ms);
  EXPECT_NEAR(b.summary.compute_ms + b.summary.recompute_ms + b.summary.stall_ms +
                  b.summary.collective_wait_ms + b.summary.idle_ms,
              b.summary.gpu_step_ms[0], 1e-6 * b.summary.step_ms);
  // The dispatch sits between moe.dispatch and the expert GEMMs, the combine before
  // moe.combine: each starts when the op before it ends.
  std::map<std::string, const TaskRecord*> l0;  // the forward's: the first of each name
  for (const TaskRecord& t : b.tasks)
    if (t.gpu == 0 && t.layer == 0) l0.emplace(t.name, &t);
  ASSERT_TRUE(l0.count("L0 ep.dispatch") && l0.count("L0 moe.dispatch") && l0.count("L0 mlp.gate"));
  EXPECT_DOUBLE_EQ(l0["L0 ep.dispatch"]->start_ms, l0["L0 moe.dispatch"]->end_ms);
  EXPECT_DOUBLE_EQ(l0["L0 mlp.gate"]->start_ms, l0["L0 ep.dispatch"]->end_ms);
  EXPECT_DOUBLE_EQ(l0["L0 ep.combine"]->start_ms, l0["L0 mlp.down"]->end_ms);
  EXPECT_DOUBLE_EQ(l0["L0 moe.combine"]->start_ms, l0["L0 ep.combine"]->end_ms);
}

TEST(SimCollectives, GradientReductionsOverlapTheBackward) {
  const PlanRequest r = generous(request("Llama-3.1-8B", "h100-sxm", 1, 2048, Policy::kKeep));
  const Plan base = make_plan(r);
  const Plan p = with_grad_reduce(base, 8, collective_link(r.hardware, 8, 1));
  const SimResult a = simulate_training_step(base, r, exact());
  const SimResult b = simulate_training_step(p, r, exact());
  // Backward never waits; the optimizer waits for the last reduction: the step grows by
  // the reductions' tail only.
  EXPECT_NEAR(b.summary.collective_wait_ms, b.summary.collective_tail_ms, 1e-9);
  EXPECT_GT(b.summary.collective_tail_ms, 0.0);
  EXPECT_NEAR(b.summary.step_ms, a.summary.step_ms + b.summary.collective_tail_ms,
              1e-9 * b.summary.step_ms);
  EXPECT_LT(b.summary.collective_tail_ms, b.summary.collective_ms);
}

TEST(SimCollectives, TraceNamesEveryCollective) {
  const PlanRequest r = generous(request("Qwen3-30B-A3B", "h100-pcie", 1, 1024, Policy::kOffload));
  const Plan p = moe_with_everything(r, {"host", 13.0});
  SimOptions o = exact();
  o.gpus = 2;
  o.gpus_per_link = 2;
  const SimResult sim = simulate_training_step(p, r, o);
  const nlohmann::json trace = nlohmann::json::parse(sim_trace_json(sim));
  std::set<int> comm_threads;
  int events = 0;
  for (const nlohmann::json& ev : trace["traceEvents"]) {
    if (ev["ph"] == "M" && ev["name"] == "thread_name" && ev["args"]["name"] == "comm")
      comm_threads.insert(ev["pid"].get<int>());
    if (ev["ph"] != "X" || ev["cat"] != "collective") continue;
    ++events;
    const std::string name = ev["name"];
    EXPECT_EQ(name.rfind('L', 0), 0u) << name;
    EXPECT_NE(name.find(std::string(ev["args"]["collective"])), std::string::npos) << name;
    EXPECT_EQ(ev["tid"], 3);
    EXPECT_EQ(ev["args"]["link"], "host");
    EXPECT_GT(ev["args"]["bytes"].get<int64_t>(), 0);
  }
  EXPECT_EQ(events, sim.summary.collectives);
  EXPECT_EQ(comm_threads, (std::set<int>{0, 1}));
  const nlohmann::json summary = nlohmann::json::parse(sim_summary_json(sim));
  EXPECT_EQ(summary["collective_bytes"].get<int64_t>(), sim.summary.collective_bytes);
  EXPECT_EQ(summary["collectives"].get<int>(), sim.summary.collectives);
  for (const char* k :
       {"collective_ms", "collective_wait_ms", "collective_tail_ms", "collective_host_bytes"})
    EXPECT_TRUE(summary.contains(k)) << k;
  EXPECT_NE(format_sim_report(sim, r).find("collectives"), std::string::npos);
  // A plan without collectives has no comm track.
  const SimResult none = simulate_training_step(make_plan(r), r, o);
  EXPECT_EQ(sim_trace_json(none).find("\"comm\""), std::string::npos);
}

// The engine: a transfer on two link directions runs at the smaller of its two fair shares.
TEST(SimCollectives, EngineTwoDirectionTransferTakesTheSmallerShare) {
  sim::Engine e;
  const int d2h = e.add_link(100.0);  // bytes per ms
  const int h2d = e.add_link(60.0);
  const int comm = e.add_stream(0, ResourceKind::kComm);
  const int copy = e.add_stream(1, ResourceKind::kD2H);
  sim::Task ring;
  ring.kind = TaskKind::kCollective;
  ring.stream = comm;
  ring.link = d2h;
  ring.link2 = h2d;
  ring.work = 600.0;
  const int r = e.add_task(ring);
  sim::Task c;
  c.kind = TaskKind::kD2H;
  c.gpu = 1;
  c.stream = copy;
  c.link = d2h;
  c.work = 500.0;
  const int k = e.add_task(c);
  e.run();
  // Both on D2H: the ring gets min(100 / 2, 60) = 50 and the copy 50 until the copy ends
  // at 10 ms (500 bytes); the ring then has 100 bytes left at min(100, 60) = 60.
  EXPECT_DOUBLE_EQ(e.tasks()[static_cast<size_t>(k)].end_ms, 10.0);
  EXPECT_NEAR(e.tasks()[static_cast<size_t>(r)].end_ms, 10.0 + 100.0 / 60.0, 1e-12);
  EXPECT_NEAR(e.link_busy_ms(h2d), 10.0 + 100.0 / 60.0, 1e-12);
}

// A ring's latency (ring_steps x L) holds its stream but not its link: a copy beside it has
// the link alone until the bytes start moving.
TEST(SimCollectives, EngineLatencyHoldsTheStreamNotTheLink) {
  sim::Engine e;
  const int d2h = e.add_link(100.0);  // bytes per ms
  const int comm = e.add_stream(0, ResourceKind::kComm);
  const int copy = e.add_stream(1, ResourceKind::kD2H);
  sim::Task ring;
  ring.kind = TaskKind::kCollective;
  ring.stream = comm;
  ring.link = d2h;
  ring.work = 400.0;
  ring.latency_ms = 2.0;
  const int r = e.add_task(ring);
  const int r2 = e.add_task(ring);  // queued behind the first on the stream
  sim::Task c;
  c.kind = TaskKind::kD2H;
  c.gpu = 1;
  c.stream = copy;
  c.link = d2h;
  c.work = 400.0;
  const int k = e.add_task(c);
  e.run();
  // 0-2 ms: the copy alone at 100 (200 bytes); 2-6 ms: both at 50 (the copy's other 200
  // bytes, the ring's first 200); 6-8 ms: the ring alone at 100. The second ring's
  // latency runs 8-10 ms, its bytes 10-14 ms.
  EXPECT_NEAR(e.tasks()[static_cast<size_t>(k)].end_ms, 6.0, 1e-12);
  EXPECT_NEAR(e.tasks()[static_cast<size_t>(r)].end_ms, 8.0, 1e-12);
  EXPECT_NEAR(e.tasks()[static_cast<size_t>(r2)].start_ms, 8.0, 1e-12);
  EXPECT_NEAR(e.tasks()[static_cast<size_t>(r2)].end_ms, 14.0, 1e-12);
  EXPECT_NEAR(e.link_busy_ms(d2h), 12.0, 1e-12);
  EXPECT_NEAR(e.stream_busy_ms(comm), 14.0, 1e-12);
}

// The simulated collective is the plan's: its ring bytes at its link's rate plus its
// latency, ring_ms to the last digit when it has its link alone.
TEST(SimCollectives, SimulatedRingTakesThePlannedTime) {
  PlanRequest r = generous(request("Qwen3-30B-A3B", "h100-sxm", 1, 1024, Policy::kKeep));
  r.work.shape.ep = 8;
  ASSERT_GT(r.hardware.interconnect.collective_latency_us, 0.0);
  const Plan p = make_plan(r);
  const SimResult sim = simulate_training_step(p, r, exact());
  int checked = 0;
  for (const TaskRecord& t : sim.tasks) {
    if (t.kind != TaskKind::kCollective || t.layer != 3) continue;
    for (const CollectivePlan& c : p.layers[3].collectives) {
      if ("L3 " + c.what != t.name) continue;
      EXPECT_GT(ring_latency_ms(c), 0.0);
      EXPECT_NEAR(t.end_ms - t.start_ms, c.ms, 1e-9 * c.ms) << t.name;
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

// Weight streaming: the plan's exposed forward collectives (EP all-to-alls) run after each
// layer's compute and the next layer waits for them; on a host link they share it with
// the weight copies, which then take longer; on NVLink they leave the copies alone.
TEST(SimCollectives, WeightStreamingSharesTheHostLinkWithTheCollectives) {
  for (const char* hw : {"h100-pcie", "h100-sxm"}) {
    PlanRequest r = generous(request("Qwen3-30B-A3B", hw, 1, 4096, Policy::kKeep));
    r.work.shape.ep = 4;
    const Plan p = make_plan(r);
    Plan bare = p;
    for (LayerPlan& l : bare.layers) l.collectives.clear();
    StreamOptions o;
    o.gpus = 4;
    o.gpus_per_link = 2;
    const SimResult with = simulate_weight_streaming(p, r, o);
    const SimResult without = simulate_weight_streaming(bare, r, o);
    SCOPED_TRACE(hw);
    // Per GPU per layer: dispatch and combine (the forward's exposed ones).
    EXPECT_EQ(with.summary.collectives, 4 * 2 * static_cast<int64_t>(p.layers.size()));
    EXPECT_EQ(without.summary.collectives, 0);
    double copy_with = 0.0;
    double copy_without = 0.0;
    for (const TaskRecord& t : with.tasks)
      if (t.kind == TaskKind::kH2D) copy_with += t.end_ms - t.start_ms;
    for (const TaskRecord& t : without.tasks)
      if (t.kind == TaskKind::kH2D) copy_without += t.end_ms - t.start_ms;
    const bool host = p.layers[0].collectives.front().link == "host";
    EXPECT_EQ(host, std::string(hw) == "h100-pcie");
    EXPECT_EQ(with.summary.collective_host_bytes > 0, host);
    if (host) {
      EXPECT_GT(copy_with, copy_without * 1.01);
    } else {
      EXPECT_NEAR(copy_with, copy_without, 1e-9 * copy_without);
    }
    EXPECT_GT(with.summary.step_ms, without.summary.step_ms);
    // Each layer's compute starts after the previous layer's last collective.
    std::map<int, double> last_comm;
    for (const TaskRecord& t : with.tasks)
      if (t.gpu == 0 && t.kind == TaskKind::kCollective)
        last_comm[t.layer] = std::max(last_comm[t.layer], t.end_ms);
    for (const TaskRecord& t : with.tasks) {
      if (t.gpu == 0 && t.kind == TaskKind::kForward && t.layer > 0) {
        EXPECT_GE(t.start_ms, last_comm[t.layer - 1] - 1e-9);
      }
    }
  }
}

// docs/simulator.md "Agreement with the planner" with data parallelism: the ZeRO gathers
// pace the forward on the communication stream (Note [Forward paced by the gathers] in
// src/plan/timeline.cpp), so the planner at margin 0 sees a snowball iff the simulator does,
// at the same first layer, over models x GPUs x policies x ZeRO stages. Mixtral-8x7B on
// h100-pcie (ep 8 dp 8, offload) is the case where the planner alone saw one: each layer's
// 14.84 ms of copies outran its 13.4 ms forward, which the 15.3 ms gathers stretch.
TEST(SimCollectives, PlannerAndSimulatorAgreeOnSnowballsUnderZeroGathers) {
  struct Case {
    std::string model;
    int64_t ep;
  };
  const std::vector<Case> models = {
      {"Mixtral-8x7B", 8}, {"Qwen3-30B-A3B", 8}, {"Llama-3.1-8B", 1}, {"Qwen3-14B", 1}};
  const std::vector<std::string> hws = {"h100-pcie", "h100-sxm", "gh200"};
  const std::vector<Policy> policies = {Policy::kOffload, Policy::kHybrid, Policy::kSelective,
                                        Policy::kAuto};
  int snowballs = 0;
  int clean = 0;
  for (const Case& m : models) {
    for (const std::string& hw : hws) {
      for (Policy s : policies) {
        for (int zero : {1, 3}) {
          for (int64_t dp : {int64_t{4}, int64_t{8}}) {
            // ZeRO-1's gathers pace only the first micro-batch: with grad_accum 2 the second
            // is the one that snowballs. Not over a host link: there the planner shares a
            // window's copies with the rings of an average micro-batch (Note [The host link
            // is shared]), which neither micro-batch is.
            const int64_t ga = dp == 4 && hw != "h100-pcie" ? 2 : 1;
            PlanRequest r = generous(request(m.model, hw, 1, 4096, s));
            r.work.shape.ep = m.ep;
            r.work.dp = dp;
            r.work.grad_accum = ga;
            r.zero = zero;
            r.margin = 0.0;
            const Plan plan = make_plan(r);
            const SimResult sim = simulate_training_step(plan, r, exact());
            SCOPED_TRACE(testing::describe(r) + " dp " + std::to_string(dp) + " zero " +
                         std::to_string(zero) + " grad-accum " + std::to_string(ga));
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
            // Over a host link the planner shares each window's ring with that window's
            // copies only, not with a backlog spilling into it (docs/planner.md "The host
            // link is shared"), so there the verdict agrees but not always the first layer.
            bool host = false;
            for (const LayerPlan& l : plan.layers) {
              for (const CollectivePlan& c : l.collectives) host |= c.link == "host";
            }
            if (planner && sim.summary.snowball && !host) {
              size_t first = 0;
              while (!plan.layers[first].snowball) ++first;
              EXPECT_EQ(sim.summary.snowball_first_layer.value_or(-1), static_cast<int>(first));
            }
            ++(planner ? snowballs : clean);
          }
        }
      }
    }
  }
  // Both verdicts, or the sweep proves nothing.
  EXPECT_GT(snowballs, 3);
  EXPECT_GT(clean, 3);
}

TEST(SimCollectives, BadCollectivesAreNamed) {
  const PlanRequest r = generous(request("Llama-3.1-8B", "h100-sxm", 1, 1024, Policy::kKeep));
  Plan p = make_plan(r);
  CollectivePlan c;
  c.what = "dp.grad_reduce";
  c.link = "pcie";
  c.gbps = 10.0;
  p.layers[2].collectives.push_back(c);
  testing::expect_error([&] { (void)simulate_training_step(p, r, exact()); },
                        {"layers[2].collectives[0].link is \"pcie\""});
  p.layers[2].collectives[0].link = "nvlink";
  p.layers[2].collectives[0].gbps = 0.0;
  testing::expect_error([&] { (void)simulate_training_step(p, r, exact()); },
                        {"layers[2].collectives[0].gbps is 0"});
  p.layers[2].collectives[0].gbps = 10.0;
  p.layers[2].collectives[0].group = 0;
  testing::expect_error([&] { (void)simulate_training_step(p, r, exact()); },
                        {"layers[2].collectives[0].group is 0"});
}

}  // namespace
}  // namespace spillway

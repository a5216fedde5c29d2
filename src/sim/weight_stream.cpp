// The simulator's weight-streaming scenario (simulate_weight_streaming): a forward pass,
// or a training step's forward and backward visits, whose layers' weights are copied in
// depth layers ahead into depth + 1 buffers, sharded over a link's GPUs or not, with each
// layer's exposed collectives after its compute (Note [Collectives in the simulator],
// scenarios.cpp).
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "sim/scenario_parts.hpp"
#include "spillway/core/error.hpp"
#include "spillway/sim/sim.hpp"

namespace spillway {

using sim::Engine;
using sim::Task;
using sim::detail::add_collective;
using sim::detail::Built;
using sim::detail::check_collectives;
using sim::detail::check_topology;
using sim::detail::compute_stats;
using sim::detail::fill_records;
using sim::detail::judge_memory;
using sim::detail::make_task;
using sim::detail::make_topology;
using sim::detail::memory_curve;
using sim::detail::Topology;

SimResult simulate_weight_streaming(const Plan& plan, const PlanRequest& req,
                                    const StreamOptions& o) {
  check_topology(o.gpus, o.gpus_per_link);
  if (o.depth < 1 || o.depth > 64) SPILLWAY_FIELD_ERROR("depth", o.depth, "must be in [1, 64]");
  const size_t n = plan.layers.size();
  const double link_h2d = plan.summary.h2d_gbps * plan.summary.gpus_per_link;
  const double link_d2h = plan.summary.d2h_gbps * plan.summary.gpus_per_link;
  Engine e;
  Topology topo = make_topology(e, o.gpus, o.gpus_per_link, link_d2h * 1e6, link_h2d * 1e6, 0.0);
  Built b;
  const int64_t wbytes = req.work.shape.dtype == DType::kFp32 ? 4 : 2;
  int64_t max_layer = 0;
  std::vector<int> comp0(n);
  check_collectives(plan);
  const bool sharded = o.sharded && o.gpus_per_link > 1;
  if (o.sharded && !(o.peer_gbps > 0))
    SPILLWAY_FIELD_ERROR("peer_gbps", o.peer_gbps, "must be > 0 for sharded streaming");
  if (sharded) {
    topo.comm.clear();
    topo.fabric.resize(static_cast<size_t>(o.gpus));
    for (int k = 0; k < o.gpus; ++k) topo.comm.push_back(e.add_stream(k, ResourceKind::kComm));
  }
  const auto per = static_cast<int64_t>(o.gpus_per_link);
  const auto gpus = static_cast<size_t>(o.gpus);
  // The visits (Note [Streaming across steps]): layers 0..n-1, and in training n-1..0
  // again, the first depth + 1 of backward hits (those layers are still in their buffers).
  const size_t visits = o.training ? 2 * n : n;
  const auto d = static_cast<size_t>(o.depth);
  auto layer_of = [&](size_t v) { return v < n ? v : 2 * n - 1 - v; };
  auto is_hit = [&](size_t v) { return v >= n && v - n <= d; };
  std::vector<std::vector<int>> comp(gpus, std::vector<int>(visits, -1));
  std::vector<int> copy(gpus, -1);        // the visit's copy on each GPU (its shard: sharded)
  std::vector<int> after_comm(gpus, -1);  // the last collective of the previous visit
  std::vector<int> peer(gpus, -1);        // sharded: each GPU's link from its peers
  if (sharded)
    for (int& p : peer) p = e.add_link(o.peer_gbps * 1e6);
  auto shard_of = [&](size_t l) {
    const int64_t bytes = checked_mul(plan.layers[l].params, wbytes, "layer weight bytes");
    return sharded ? ((bytes + per - 1) / per + 255) / 256 * 256 : bytes;
  };
  auto add_copy = [&](size_t gi, size_t v) {
    const size_t l = layer_of(v);
    const int64_t shard = shard_of(l);
    max_layer = std::max(max_layer, sharded ? shard * per : shard);
    copy[gi] = e.add_task(
        make_task(TaskKind::kH2D, static_cast<int>(gi), static_cast<int>(l), 0, topo.h2d[gi],
                  static_cast<double>(shard), topo.link_h2d[gi], o.keep_tasks, b,
                  [&] { return fmt::format("W{} weights{}", l, sharded ? " (shard)" : ""); }));
    // Buffer reuse: depth + 1 buffers, each visit holding one, so a visit's copy waits for
    // the visit depth + 1 before it (in forward: layer l waits for layer l - depth - 1).
    if (v >= d + 1) e.add_dep(copy[gi], comp[gi][v - d - 1]);
  };
  auto add_compute = [&](size_t gi, size_t v) {
    const int g = static_cast<int>(gi);
    const size_t l = layer_of(v);
    const bool backward = v >= n;
    const LayerPlan& lp = plan.layers[l];
    int ready = is_hit(v) ? -1 : copy[gi];
    if (sharded && ready >= 0) {
      // The all-gather of the layer's other shards, once every GPU of the link has copied
      // its own.
      ready =
          e.add_task(make_task(TaskKind::kCollective, g, static_cast<int>(l), 0, topo.comm[gi],
                               static_cast<double>(shard_of(l) * (per - 1)), peer[gi], o.keep_tasks,
                               b, [&] { return fmt::format("W{} all-gather", l); }));
      if (o.keep_tasks) b.link_of[ready] = "peer";
      const size_t first = gi - gi % static_cast<size_t>(per);
      for (size_t k = first; k < first + static_cast<size_t>(per); ++k) e.add_dep(ready, copy[k]);
    }
    comp[gi][v] = e.add_task(
        make_task(backward ? TaskKind::kBackward : TaskKind::kForward, g, static_cast<int>(l), 0,
                  topo.compute[gi], backward ? lp.bwd_ms : lp.fwd_ms, -1, o.keep_tasks, b,
                  [&] { return fmt::format("L{} {}", l, backward ? "backward" : "forward"); }));
    if (ready >= 0) e.add_dep(comp[gi][v], ready);
    if (v > 0 && after_comm[gi] >= 0) e.add_dep(comp[gi][v], after_comm[gi]);
    after_comm[gi] = -1;
    // The layer's exposed collectives of this direction (TP gathers and scatters, EP
    // all-to-alls) after its compute; the next visit waits for them (Note [Collectives in
    // the simulator]). A host-link one shares the link with the weight copies.
    for (const CollectivePlan& c : lp.collectives) {
      if (c.backward != backward || !c.exposed) continue;
      after_comm[gi] = add_collective(e, topo, b, o.keep_tasks, l, c, g, 0, {comp[gi][v]});
    }
    if (gi == 0 && !backward) comp0[l] = comp[gi][v];
  };
  // Tasks are added after their dependencies: GPU by GPU, or (sharded: the all-gathers
  // need every GPU's copy) visit by visit.
  if (sharded) {
    for (size_t v = 0; v < visits; ++v) {
      if (!is_hit(v))
        for (size_t gi = 0; gi < gpus; ++gi) add_copy(gi, v);
      for (size_t gi = 0; gi < gpus; ++gi) add_compute(gi, v);
    }
  } else {
    for (size_t gi = 0; gi < gpus; ++gi)
      for (size_t v = 0; v < visits; ++v) {
        if (!is_hit(v)) add_copy(gi, v);
        add_compute(gi, v);
      }
  }
  e.run();
  SimResult r;
  r.scenario = "weight-stream";
  r.gpus = o.gpus;
  r.gpus_per_link = o.gpus_per_link;
  r.link_d2h_gbps = link_d2h;
  r.link_h2d_gbps = link_h2d;
  SimSummary& s = r.summary;
  s.events = e.events();
  s.step_ms = e.makespan_ms();
  s.gpu_step_ms.assign(static_cast<size_t>(o.gpus), 0.0);
  for (const Task& t : e.tasks()) {
    s.gpu_step_ms[static_cast<size_t>(t.gpu)] =
        std::max(s.gpu_step_ms[static_cast<size_t>(t.gpu)], t.end_ms);
    if (t.kind == TaskKind::kH2D) s.h2d_bytes += static_cast<int64_t>(t.work);
    if (t.kind == TaskKind::kCollective) {
      ++s.collectives;
      s.collective_bytes += static_cast<int64_t>(t.work);
      if (t.link2 >= 0) s.collective_host_bytes += static_cast<int64_t>(t.work);
    }
  }
  compute_stats(e, topo.compute[0], s);
  if (!topo.comm.empty()) s.collective_ms = e.stream_busy_ms(topo.comm[0]);
  s.idle_ms = std::max(0.0, s.gpu_step_ms[0] - s.compute_ms - s.stall_ms - s.collective_wait_ms);
  const double busy = e.link_busy_ms(topo.link_h2d[0]);
  int64_t link0 = 0;
  for (const Task& t : e.tasks()) {
    if (t.link == topo.link_h2d[0] || t.link2 == topo.link_h2d[0])
      link0 += static_cast<int64_t>(t.work);
  }
  s.link_h2d_gbps = busy > 0.0 ? static_cast<double>(link0) / busy / 1e6 : 0.0;
  s.link_gbps_achieved = s.link_h2d_gbps;
  const std::vector<Task>& tk = e.tasks();
  r.layer_fwd_end_ms.resize(n);
  for (size_t l = 0; l < n; ++l) r.layer_fwd_end_ms[l] = tk[static_cast<size_t>(comp0[l])].end_ms;
  // Memory: static weights are not resident; the d + 1 buffers are allocated once.
  const int64_t buffers = max_layer * (o.depth + 1);
  std::vector<std::pair<double, int64_t>> ev;
  r.memory = memory_curve(std::move(ev), buffers, &s.peak_hbm_bytes);
  r.memory.push_back({s.step_ms, buffers});
  judge_memory(r, plan, req);
  fill_records(e, b, o.keep_tasks, r);
  return r;
}

}  // namespace spillway

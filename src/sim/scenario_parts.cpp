// The parts both simulated scenarios are built of (scenario_parts.hpp): the names of the
// resource and task kinds, the topology's streams and links, tasks and collectives, the
// memory curve, the stall accounting, the memory verdict (Note [Simulated memory
// verdict]) and the plan's collectives checked.
#include "sim/scenario_parts.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "core/enum_names.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/collectives.hpp"
#include "spillway/sim/sim.hpp"

namespace spillway {

constexpr EnumNames<ResourceKind, 4> kResourceKindNames = {{{ResourceKind::kCompute, "compute"},
                                                            {ResourceKind::kD2H, "D2H copy"},
                                                            {ResourceKind::kH2D, "H2D copy"},
                                                            {ResourceKind::kComm, "comm"}}};
constexpr EnumNames<TaskKind, 8> kTaskKindNames = {{{TaskKind::kForward, "forward"},
                                                    {TaskKind::kBackward, "backward"},
                                                    {TaskKind::kRecompute, "recompute"},
                                                    {TaskKind::kHead, "head"},
                                                    {TaskKind::kOptimizer, "optimizer"},
                                                    {TaskKind::kD2H, "d2h"},
                                                    {TaskKind::kH2D, "h2d"},
                                                    {TaskKind::kCollective, "collective"}}};

std::string to_string(ResourceKind k) {
  return std::string(name_of(kResourceKindNames, k));
}

std::string to_string(TaskKind k) {
  return std::string(name_of(kTaskKindNames, k));
}

namespace sim::detail {

Topology make_topology(Engine& e, int gpus, int per_link, double d2h_bytes_per_ms,
                       double h2d_bytes_per_ms, double hbm_bytes_per_ms) {
  Topology t;
  t.gpus = gpus;
  t.per_link = per_link;
  int ld = -1;
  int lh = -1;
  for (int g = 0; g < gpus; ++g) {
    t.compute.push_back(e.add_stream(g, ResourceKind::kCompute));
    t.d2h.push_back(e.add_stream(g, ResourceKind::kD2H));
    t.h2d.push_back(e.add_stream(g, ResourceKind::kH2D));
    if (g % per_link == 0) {
      ld = e.add_link(d2h_bytes_per_ms);
      lh = e.add_link(h2d_bytes_per_ms);
    }
    t.link_d2h.push_back(ld);
    t.link_h2d.push_back(lh);
    e.set_hbm(g, hbm_bytes_per_ms);
  }
  return t;
}

void check_topology(int gpus, int per_link) {
  if (gpus < 1 || gpus > 1024) SPILLWAY_FIELD_ERROR("gpus", gpus, "must be in [1, 1024]");
  if (per_link < 1 || gpus % per_link != 0) {
    SPILLWAY_FIELD_ERROR("gpus_per_link", per_link, "must be >= 1 and divide gpus ({})", gpus);
  }
}

namespace {

int label(Built& b, std::string s) {
  b.labels.push_back(std::move(s));
  return static_cast<int>(b.labels.size() - 1);
}

}  // namespace

// A task of GPU `gpu`, micro-batch `mb`, on `stream` (a copy also names its link); its
// label is made when task records are kept, for every GPU (the trace names every event).
Task make_task(TaskKind kind, int gpu, int layer, int mb, int stream, double work, int link,
               bool labelled, Built& b, const std::function<std::string()>& name) {
  Task t;
  t.kind = kind;
  t.gpu = gpu;
  t.layer = layer;
  t.micro_batch = mb;
  t.stream = stream;
  t.link = link;
  t.work = work;
  t.label = labelled ? label(b, name()) : -1;
  return t;
}

// A collective of layer l on GPU g as a task (Note [Collectives in the simulator]),
// waiting for `deps` (-1 entries ignored); makes the communication streams on first use.
int add_collective(Engine& e, Topology& topo, Built& b, bool keep_tasks, size_t l,
                   const CollectivePlan& c, int g, int mbi, std::initializer_list<int> deps) {
  const size_t gi = static_cast<size_t>(g);
  if (topo.comm.empty()) {
    topo.fabric.resize(static_cast<size_t>(topo.gpus));
    for (int k = 0; k < topo.gpus; ++k) topo.comm.push_back(e.add_stream(k, ResourceKind::kComm));
  }
  Task t = make_task(TaskKind::kCollective, g, static_cast<int>(l), mbi, topo.comm[gi],
                     static_cast<double>(ring_bytes(c)), -1, keep_tasks, b,
                     [&] { return fmt::format("L{} {}", l, c.what); });
  t.latency_ms = ring_latency_ms(c);
  if (c.link == "host") {
    t.link = topo.link_d2h[gi];
    t.link2 = topo.link_h2d[gi];
  } else {
    auto [it, fresh] = topo.fabric[gi].try_emplace({c.link, c.gbps}, -1);
    if (fresh) it->second = e.add_link(c.gbps * 1e6);
    t.link = it->second;
  }
  const int id = e.add_task(t);
  for (int d : deps)
    if (d >= 0) e.add_dep(id, d);
  if (keep_tasks) b.link_of[id] = c.link;
  return id;
}

// Memory curve from (time, delta) events.
std::vector<MemoryPoint> memory_curve(std::vector<std::pair<double, int64_t>> ev, int64_t base,
                                      int64_t* peak) {
  std::stable_sort(ev.begin(), ev.end(), [](const auto& a, const auto& b) {
    // At equal times, frees before allocations (a buffer is reused the moment it is freed).
    return a.first < b.first || (a.first == b.first && a.second < b.second);
  });
  std::vector<MemoryPoint> out;
  int64_t cur = base;
  *peak = base;
  out.push_back({0.0, base});
  for (const auto& [t, d] : ev) {
    cur += d;
    *peak = std::max(*peak, cur);
    if (!out.empty() && out.back().t_ms == t) {
      out.back().bytes = cur;
    } else {
      out.push_back({t, cur});
    }
  }
  return out;
}

void fill_records(const Engine& e, const Built& b, bool keep, SimResult& r) {
  if (!keep) return;
  r.tasks.reserve(e.tasks().size());
  for (const Task& t : e.tasks()) {
    TaskRecord rec;
    rec.name = t.label >= 0 ? b.labels[static_cast<size_t>(t.label)] : std::string();
    rec.kind = t.kind;
    rec.gpu = t.gpu;
    rec.layer = t.layer;
    rec.micro_batch = t.micro_batch;
    const bool moves =
        t.kind == TaskKind::kD2H || t.kind == TaskKind::kH2D || t.kind == TaskKind::kCollective;
    rec.bytes = moves ? static_cast<int64_t>(t.work) : 0;
    if (t.kind == TaskKind::kCollective) {
      const auto it = b.link_of.find(static_cast<int>(&t - e.tasks().data()));
      if (it != b.link_of.end()) rec.link = it->second;
    }
    rec.start_ms = t.start_ms;
    rec.end_ms = t.end_ms;
    rec.ready_ms = t.ready_ms;
    r.tasks.push_back(std::move(rec));
  }
}

// Stall accounting on GPU 0's compute stream: time its head waited on another stream (a
// copy: stall; a collective: collective_wait).
void compute_stats(const Engine& e, int compute_stream, SimSummary& s) {
  double prev_end = 0.0;
  for (const Task& t : e.tasks()) {
    if (t.stream != compute_stream) continue;
    const double wait = t.start_ms - prev_end;
    if (wait > 1e-12) {
      const bool on_copy =
          t.last_dep >= 0 && e.tasks()[static_cast<size_t>(t.last_dep)].stream != compute_stream;
      const int dep_stream = on_copy ? e.tasks()[static_cast<size_t>(t.last_dep)].stream : -1;
      if (on_copy && e.stream_kind(dep_stream) == ResourceKind::kComm) {
        s.collective_wait_ms += wait;
      } else if (on_copy) {
        s.stall_ms += wait;
        if (e.tasks()[static_cast<size_t>(t.last_dep)].kind == TaskKind::kD2H)
          s.backpressure_ms += wait;
      }
    }
    if (t.kind == TaskKind::kRecompute) {
      s.recompute_ms += t.end_ms - t.start_ms;
    } else {
      s.compute_ms += t.end_ms - t.start_ms;
    }
    prev_end = t.end_ms;
  }
}

// Note [Simulated memory verdict]: the simulated peak (GPU 0's; every GPU runs the same
// plan) is judged against the GPU's HBM (the hardware profile) and the plan's budget
// (the profile's HBM minus the reserve, or --hbm-budget-gb); either one exceeded makes
// the result infeasible, with one reason each naming the peak, the limit and when the
// peak happens. A snowball is reported beside it: it makes a step slow, and the memory
// it holds is already in the curve. A limit of 0 (unknown) is not judged.
void judge_memory(SimResult& r, const Plan& plan, const PlanRequest& req) {
  SimSummary& s = r.summary;
  s.hbm_capacity_bytes = static_cast<int64_t>(std::llround(req.hardware.hbm_gb * 1e9));
  s.hbm_budget_bytes = plan.summary.hbm_budget_bytes;
  s.peak_hbm_ms = 0.0;
  for (const MemoryPoint& m : r.memory) {
    if (m.bytes == s.peak_hbm_bytes) {
      s.peak_hbm_ms = m.t_ms;
      break;
    }
  }
  // When: the layer whose forward holds the peak, or the backward.
  std::string when = fmt::format("at {:.2f} ms", s.peak_hbm_ms);
  const std::vector<double>& fwd_end = r.layer_fwd_end_ms;
  const auto in_fwd = std::lower_bound(fwd_end.begin(), fwd_end.end(), s.peak_hbm_ms);
  if (in_fwd != fwd_end.end()) {
    when += fmt::format(", in layer {}'s forward", in_fwd - fwd_end.begin());
  } else if (r.scenario == "train-step" && !fwd_end.empty()) {
    when += ", in the backward";
  }
  const std::string gpus =
      r.gpus > 1 ? fmt::format("GPU 0, as on each of the {} GPUs", r.gpus) : "GPU 0";
  const double peak_gb = static_cast<double>(s.peak_hbm_bytes) / 1e9;
  if (s.hbm_capacity_bytes > 0 && s.peak_hbm_bytes > s.hbm_capacity_bytes) {
    s.reasons.push_back(
        fmt::format("peak HBM {:.2f} GB ({}, {}) > {:.2f} GB of HBM on {}: {:.2f} GB over", peak_gb,
                    gpus, when, static_cast<double>(s.hbm_capacity_bytes) / 1e9, req.hardware.name,
                    static_cast<double>(s.peak_hbm_bytes - s.hbm_capacity_bytes) / 1e9));
  }
  if (s.hbm_budget_bytes > 0 && s.peak_hbm_bytes > s.hbm_budget_bytes) {
    s.reasons.push_back(
        fmt::format("peak HBM {:.2f} GB ({}, {}) > budget {:.2f} GB: {:.2f} GB over", peak_gb, gpus,
                    when, static_cast<double>(s.hbm_budget_bytes) / 1e9,
                    static_cast<double>(s.peak_hbm_bytes - s.hbm_budget_bytes) / 1e9));
  }
  s.feasible = s.reasons.empty();
}

// The plan's collectives, checked before they become tasks (a Plan built in code has not
// been through the JSON reader's checks).
void check_collectives(const Plan& plan) {
  for (size_t l = 0; l < plan.layers.size(); ++l) {
    const std::vector<CollectivePlan>& cs = plan.layers[l].collectives;
    for (size_t k = 0; k < cs.size(); ++k) {
      const CollectivePlan& c = cs[k];
      const std::string at = fmt::format("layers[{}].collectives[{}].", l, k);
      if (c.link != "nvlink" && c.link != "network" && c.link != "host")
        SPILLWAY_FIELD_ERROR(at + "link", fmt::format("\"{}\"", c.link),
                             "must be nvlink, network or host");
      if (c.bytes < 0) SPILLWAY_FIELD_ERROR(at + "bytes", c.bytes, "must be >= 0");
      if (c.group < 1 || c.group > PlanLimits::kMaxGroup)
        SPILLWAY_FIELD_ERROR(at + "group", c.group, "must be in [1, {}]", PlanLimits::kMaxGroup);
      if (c.link != "host" && !(c.gbps >= PlanLimits::kMinGbps && c.gbps <= PlanLimits::kMaxGbps))
        SPILLWAY_FIELD_ERROR(at + "gbps", c.gbps, "must be in [{:g}, {:g}] GB/s",
                             PlanLimits::kMinGbps, PlanLimits::kMaxGbps);
    }
  }
}

}  // namespace sim::detail

}  // namespace spillway

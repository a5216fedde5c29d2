// The simulator's results as JSON: a Chrome trace-event file (Perfetto, chrome://tracing)
// and the summary for scripts (schema spillway.sim/1).
//
// Trace layout: one process per GPU (pid = gpu), one thread per resource of that GPU
// (tid 0 compute, 1 D2H copy engine, 2 H2D copy engine, 3 communication when the plan has
// collectives), one complete event ("X") per
// finished task, and a counter track "HBM (GB)" for GPU 0's device memory. Times are
// microseconds in the trace (the format's unit) and milliseconds everywhere else. Every
// event carries name, ph, ts, pid and tid, metadata and counters included, so that strict
// readers accept the file. Keys keep the order written here (ordered_json) to stay
// readable in a diff.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string_view>

#include "spillway/sim/sim.hpp"

namespace spillway {

namespace {

using OJson = nlohmann::ordered_json;

constexpr int kTidCompute = 0;
constexpr int kTidD2H = 1;
constexpr int kTidH2D = 2;
constexpr int kTidComm = 3;

int tid_of(TaskKind k) {
  switch (k) {
    case TaskKind::kD2H:
      return kTidD2H;
    case TaskKind::kH2D:
      return kTidH2D;
    case TaskKind::kCollective:
      return kTidComm;
    case TaskKind::kForward:
    case TaskKind::kBackward:
    case TaskKind::kRecompute:
    case TaskKind::kHead:
    case TaskKind::kOptimizer:
      break;
  }
  return kTidCompute;
}

bool is_copy(TaskKind k) {
  return k == TaskKind::kD2H || k == TaskKind::kH2D;
}

// "L7 mlp.gate_out" -> "mlp.gate_out"; a name without a layer prefix ("W12") is its own
// tensor or op name.
std::string_view name_part(std::string_view task_name) {
  const size_t space = task_name.find(' ');
  return space == std::string_view::npos ? task_name : task_name.substr(space + 1);
}

// JSON has no NaN or infinity; a time that is not finite is written as 0.
double finite_or_zero(double v) {
  return std::isfinite(v) ? v : 0.0;
}

OJson metadata_event(const char* name, int pid, int tid, const std::string& value) {
  return OJson{{"name", name}, {"ph", "M"},  {"ts", 0.0},
               {"pid", pid},   {"tid", tid}, {"args", OJson{{"name", value}}}};
}

// Invalid UTF-8 in a task or scenario name becomes U+FFFD instead of throwing.
std::string dump(const OJson& j, int indent) {
  return j.dump(indent, ' ', false, OJson::error_handler_t::replace) + "\n";
}

}  // namespace

std::string sim_trace_json(const SimResult& r) {
  int gpus = std::max(r.gpus, 1);
  for (const TaskRecord& t : r.tasks) gpus = std::max(gpus, t.gpu + 1);

  const bool comm = std::any_of(r.tasks.begin(), r.tasks.end(), [](const TaskRecord& t) {
    return t.kind == TaskKind::kCollective;
  });
  OJson events = OJson::array();
  for (int gpu = 0; gpu < gpus; ++gpu) {
    events.push_back(metadata_event("process_name", gpu, 0, fmt::format("GPU {}", gpu)));
    events.push_back(metadata_event("thread_name", gpu, kTidCompute, "compute"));
    events.push_back(metadata_event("thread_name", gpu, kTidD2H, "D2H copy"));
    events.push_back(metadata_event("thread_name", gpu, kTidH2D, "H2D copy"));
    if (comm) events.push_back(metadata_event("thread_name", gpu, kTidComm, "comm"));
  }

  for (const TaskRecord& t : r.tasks) {
    const double start_ms = finite_or_zero(t.start_ms);
    const double end_ms = finite_or_zero(t.end_ms);
    const double ready_ms = finite_or_zero(t.ready_ms);
    OJson args{{"layer", t.layer}, {"micro_batch", t.micro_batch}, {"bytes", t.bytes}};
    if (t.kind == TaskKind::kCollective) {
      args["collective"] = std::string(name_part(t.name));
      args["link"] = t.link;
    } else {
      args[is_copy(t.kind) ? "tensor" : "op"] = std::string(name_part(t.name));
    }
    args["queued_ms"] = start_ms - ready_ms;
    events.push_back(OJson{{"name", t.name},
                           {"cat", to_string(t.kind)},
                           {"ph", "X"},
                           {"ts", start_ms * 1000.0},
                           {"dur", std::max(end_ms - start_ms, 0.0) * 1000.0},
                           {"pid", t.gpu},
                           {"tid", tid_of(t.kind)},
                           {"args", std::move(args)}});
  }

  for (const MemoryPoint& m : r.memory) {
    events.push_back(OJson{{"name", "HBM (GB)"},
                           {"ph", "C"},
                           {"ts", finite_or_zero(m.t_ms) * 1000.0},
                           {"pid", 0},
                           {"tid", 0},
                           {"args", OJson{{"GB", static_cast<double>(m.bytes) / 1e9}}}});
  }

  OJson j;
  j["displayTimeUnit"] = "ms";
  j["traceEvents"] = std::move(events);
  j["otherData"] = OJson{{"scenario", r.scenario},
                         {"gpus", r.gpus},
                         {"gpus_per_link", r.gpus_per_link},
                         {"link_d2h_gbps", r.link_d2h_gbps},
                         {"link_h2d_gbps", r.link_h2d_gbps}};
  return dump(j, -1);
}

std::string sim_summary_json(const SimResult& r) {
  const SimSummary& s = r.summary;
  OJson j;
  j["schema"] = "spillway.sim/1";
  j["scenario"] = r.scenario;
  j["gpus"] = r.gpus;
  j["gpus_per_link"] = r.gpus_per_link;
  j["step_ms"] = s.step_ms;
  j["compute_ms"] = s.compute_ms;
  j["recompute_ms"] = s.recompute_ms;
  j["stall_ms"] = s.stall_ms;
  j["backpressure_ms"] = s.backpressure_ms;
  j["exposed_copy_ms"] = s.exposed_copy_ms;
  j["idle_ms"] = s.idle_ms;
  j["peak_hbm_bytes"] = s.peak_hbm_bytes;
  j["peak_hbm_ms"] = s.peak_hbm_ms;
  j["hbm_capacity_bytes"] = s.hbm_capacity_bytes;
  j["hbm_budget_bytes"] = s.hbm_budget_bytes;
  j["feasible"] = s.feasible;
  j["reasons"] = s.reasons;
  j["snowball"] = s.snowball;
  j["snowball_first_layer"] =
      s.snowball_first_layer ? OJson(*s.snowball_first_layer) : OJson(nullptr);
  j["backlog_bytes"] = s.backlog_bytes;
  j["link_gbps_achieved"] = s.link_gbps_achieved;
  j["link_d2h_gbps_achieved"] = s.link_d2h_gbps;
  j["link_h2d_gbps_achieved"] = s.link_h2d_gbps;
  j["link_d2h_gbps_capacity"] = r.link_d2h_gbps;
  j["link_h2d_gbps_capacity"] = r.link_h2d_gbps;
  j["d2h_bytes"] = s.d2h_bytes;
  j["h2d_bytes"] = s.h2d_bytes;
  j["events"] = s.events;
  j["hbm_slowdown"] = s.hbm_slowdown;
  j["gpu_step_ms"] = s.gpu_step_ms;
  j["collectives"] = s.collectives;
  j["collective_ms"] = s.collective_ms;
  j["collective_wait_ms"] = s.collective_wait_ms;
  j["collective_tail_ms"] = s.collective_tail_ms;
  j["collective_bytes"] = s.collective_bytes;
  j["collective_host_bytes"] = s.collective_host_bytes;
  return dump(j, 2);
}

}  // namespace spillway

// The human report of a simulation: step time and its split, links, memory, backlog, and
// the memory verdict with its reasons.
#include <fmt/format.h>

#include <algorithm>

#include "spillway/sim/sim.hpp"

namespace spillway {

namespace {

double gb(int64_t bytes) {
  return static_cast<double>(bytes) / 1e9;
}

}  // namespace

std::string format_sim_report(const SimResult& r, const PlanRequest& req) {
  const SimSummary& s = r.summary;
  std::string out;
  out += fmt::format("spillway simulate: {} on {} ({}, policy {})\n", req.model.name,
                     req.hardware.name, r.scenario, to_string(req.strategy));
  out += fmt::format(
      "  topology  {} GPU(s), {} per host link; link {:.0f} GB/s D2H, {:.0f} GB/s H2D per "
      "direction\n",
      r.gpus, r.gpus_per_link, r.link_d2h_gbps, r.link_h2d_gbps);
  out += fmt::format("  events    {} (HBM sharing {})\n", s.events,
                     s.hbm_slowdown > 1.0
                         ? fmt::format("slowed kernels and copies by up to {:.2f}x", s.hbm_slowdown)
                         : std::string("off or never contended"));
  out += "\n";
  out += fmt::format("  step time        {:10.2f} ms{}\n", s.step_ms,
                     r.gpus > 1 ? fmt::format(" (slowest of {} GPUs)", r.gpus) : std::string());
  out += fmt::format("    compute        {:10.2f} ms\n", s.compute_ms);
  if (r.scenario == "train-step")
    out += fmt::format("    recompute      {:10.2f} ms\n", s.recompute_ms);
  out += fmt::format(
      "    stalls         {:10.2f} ms (waiting on copies; {:.2f} ms at the in-flight bound)\n",
      s.stall_ms, s.backpressure_ms);
  out += fmt::format("    exposed copy   {:10.2f} ms\n", s.exposed_copy_ms);
  if (s.collective_wait_ms > 0.0 || s.collective_tail_ms > 0.0) {
    out += fmt::format(
        "    collectives    {:10.2f} ms (compute waiting on them; {:.2f} ms more "
        "after the last compute and copy)\n",
        s.collective_wait_ms, s.collective_tail_ms);
  }
  out += fmt::format("    other idle     {:10.2f} ms\n", s.idle_ms);
  out += fmt::format(
      "  link achieved    D2H {:.1f} GB/s, H2D {:.1f} GB/s (while busy; {:.2f} GB and {:.2f} GB "
      "per GPU moved)\n",
      s.link_d2h_gbps, s.link_h2d_gbps, static_cast<double>(s.d2h_bytes) / 1e9 / r.gpus,
      static_cast<double>(s.h2d_bytes) / 1e9 / r.gpus);
  if (s.collectives > 0) {
    out += fmt::format(
        "  collectives      {} tasks, {:.2f} GB of ring traffic per GPU ({:.2f} GB through the "
        "host link); GPU 0's comm stream busy {:.2f} ms\n",
        s.collectives, static_cast<double>(s.collective_bytes) / 1e9 / r.gpus,
        static_cast<double>(s.collective_host_bytes) / 1e9 / r.gpus, s.collective_ms);
  }
  out += fmt::format("  peak HBM         {:.2f} GB (GPU 0, at {:.2f} ms)", gb(s.peak_hbm_bytes),
                     s.peak_hbm_ms);
  if (s.hbm_capacity_bytes > 0) out += fmt::format(" of {:.2f} GB HBM", gb(s.hbm_capacity_bytes));
  if (s.hbm_budget_bytes > 0) out += fmt::format(", budget {:.2f} GB", gb(s.hbm_budget_bytes));
  out += "\n";
  if (r.scenario == "train-step") {
    const int64_t worst = s.backlog_bytes.empty()
                              ? 0
                              : *std::max_element(s.backlog_bytes.begin(), s.backlog_bytes.end());
    out +=
        fmt::format("  D2H backlog      largest {} at a layer boundary", to_string(Bytes(worst)));
    if (!s.backlog_bytes.empty()) {
      out += fmt::format(", {} when the forward ends", to_string(Bytes(s.backlog_bytes.back())));
    }
    out += "\n";
    if (s.snowball) {
      out += fmt::format(
          "  SNOWBALL         from layer {}: its copies end after layer {}'s forward, and the "
          "queue carries over\n",
          *s.snowball_first_layer, *s.snowball_first_layer + 1);
    } else {
      out += "  snowball         none: every layer's copies end within the next layer's forward\n";
    }
  }
  // The verdict last, as `spillway plan` words it (Note [Simulated memory verdict]).
  out += fmt::format("  feasible         {}\n", s.feasible ? "yes" : "NO");
  for (const std::string& reason : s.reasons) out += fmt::format("    - {}\n", reason);
  return out;
}

}  // namespace spillway

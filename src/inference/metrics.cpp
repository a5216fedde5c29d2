// The engine's metrics: EngineMetrics gathered from the serving engine (metrics()), and
// /metrics, EngineMetrics in the Prometheus text exposition format (version 0.0.4).
#include <fmt/format.h>

#include <algorithm>

#include "inference/engine_impl.hpp"
#include "spillway/inference/inference.hpp"

namespace spillway::inference {

using detail::Clock;
using detail::kTpotBounds;
using detail::kTtftBounds;
using detail::ms_between;

namespace {

// A label value with \, " and newlines escaped.
std::string label(const std::string& v) {
  std::string o;
  for (char ch : v) {
    if (ch == '\\' || ch == '"') o += '\\';
    if (ch == '\n') {
      o += "\\n";
      continue;
    }
    o += ch;
  }
  return o;
}

void histogram(std::string& out, const char* name, const char* help,
               const std::vector<double>& bounds, const std::vector<int64_t>& counts, double sum,
               int64_t n) {
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  for (size_t i = 0; i < bounds.size(); ++i)
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds[i], counts[i]);
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name,
                     counts.empty() ? 0 : counts.back(), name, sum, name, n);
}

void gauge_header(std::string& out, const char* name, const char* type, const char* help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

}  // namespace

std::string prometheus_text(const EngineMetrics& m) {
  std::string out;
  // One sample of a metric without labels, and one per slice.
  auto scalar = [&](const char* name, const char* type, const char* help, auto value) {
    gauge_header(out, name, type, help);
    out += fmt::format("{} {}\n", name, value);
  };
  auto per_slice = [&](const char* name, const char* type, const char* help, auto value) {
    gauge_header(out, name, type, help);
    for (size_t i = 0; i < m.slices.size(); ++i)
      out += fmt::format("{}{{slice=\"{}\"}} {}\n", name, i, value(m.slices[i]));
  };
  using Slice = EngineMetrics::Slice;
  gauge_header(out, "spillway_requests_total", "counter",
               "Completion requests by outcome (ok, invalid, unknown_model, overloaded, "
               "draining, unavailable, failed, cancelled).");
  for (const auto& [outcome, n] : m.requests)
    out += fmt::format("spillway_requests_total{{outcome=\"{}\"}} {}\n", label(outcome), n);
  scalar("spillway_generated_tokens_total", "counter", "Tokens generated.", m.tokens_generated);
  scalar("spillway_prompt_tokens_total", "counter", "Prompt tokens accepted.", m.prompt_tokens);
  histogram(out, "spillway_ttft_seconds", "Time from a request's arrival to its first token.",
            m.ttft_bounds_s, m.ttft_counts, m.ttft_sum_s, m.ttft_n);
  histogram(out, "spillway_tpot_seconds", "Mean time between a request's tokens after the first.",
            m.tpot_bounds_s, m.tpot_counts, m.tpot_sum_s, m.tpot_n);
  scalar("spillway_requests_within_slo_total", "counter",
         "Finished requests that met both the TTFT and the TPOT target.", m.within_slo);
  scalar("spillway_model_switches_total", "counter",
         "A slice took a model already resident in host memory (nothing copied).", m.switches);
  scalar("spillway_cold_loads_total", "counter",
         "A slice took a model that had to be read from disk into host memory.", m.cold_loads);
  scalar("spillway_pool_evictions_total", "counter",
         "Models dropped from host memory to make room.", m.evictions);
  scalar("spillway_waiting_requests", "gauge", "Requests accepted and not yet decoding.",
         m.waiting);
  scalar("spillway_link_utilization", "gauge",
         "Bytes moved over the shared host link / (its bandwidth x uptime).", m.link_utilization);
  scalar("spillway_link_bytes_total", "counter",
         "Bytes moved over the shared host link (HybridGEMM's weight reads).", m.link_bytes);
  scalar("spillway_link_bandwidth_bytes_per_second", "gauge",
         "The emulated shared host link's bandwidth (scaled).", m.link_gbps * 1e9);
  per_slice("spillway_slice_hbm_bytes_total", "counter",
            "Bytes a slice's HybridGEMMs read and wrote in its HBM.",
            [](const Slice& x) { return x.hbm_bytes; });
  per_slice("spillway_slice_hbm_bandwidth_bytes_per_second", "gauge",
            "A slice's emulated HBM bandwidth (scaled).",
            [](const Slice& x) { return x.hbm_gbps * 1e9; });
  per_slice("spillway_slice_hbm_utilization", "gauge",
            "A slice's HBM bytes / (its bandwidth x uptime).",
            [](const Slice& x) { return x.hbm_utilization; });
  per_slice("spillway_slice_link_share", "gauge",
            "A slice's link bytes / (the link's bandwidth x uptime).",
            [](const Slice& x) { return x.link_share; });
  per_slice("spillway_slice_alpha", "gauge",
            "HybridGEMM's alpha on a slice (the share of columns on the symmetric path).",
            [](const Slice& x) { return x.alpha; });
  gauge_header(out, "spillway_slice_running_requests", "gauge",
               "Requests on a slice (decoding or waiting for a sequence).");
  for (size_t i = 0; i < m.slices.size(); ++i)
    out += fmt::format("spillway_slice_running_requests{{slice=\"{}\",model=\"{}\"}} {}\n", i,
                       label(m.slices[i].model), m.slices[i].running);
  per_slice("spillway_slice_iterations_total", "counter", "Decoder steps of a slice.",
            [](const Slice& x) { return x.iterations; });
  per_slice("spillway_slice_device_bytes_in_use", "gauge",
            "A slice's device memory in use (KV cache and step buffers).",
            [](const Slice& x) { return x.device_bytes_in_use; });
  per_slice("spillway_slice_device_bytes", "gauge",
            "A slice's device memory (emulated, times the memory scale).",
            [](const Slice& x) { return x.device_bytes; });
  scalar("spillway_uptime_seconds", "gauge", "Seconds since the engine started.", m.uptime_s);
  return out;
}

EngineMetrics ServingEngine::metrics() const {
  const Impl& m = *impl_;
  EngineMetrics e;
  const double up = std::max(ms_between(m.start_time, Clock::now()) / 1e3, 1e-9);
  const ModelPoolStats ps = m.pool->stats();
  std::lock_guard lk(m.mu);
  e.uptime_s = up;
  e.requests = m.outcomes;
  for (const char* k : {"ok", "invalid", "unknown_model", "overloaded", "draining", "unavailable",
                        "failed", "cancelled"})
    e.requests.emplace(k, 0);
  e.tokens_generated = m.tokens_generated;
  e.prompt_tokens = m.prompt_tokens;
  e.ttft_bounds_s = kTtftBounds;
  e.tpot_bounds_s = kTpotBounds;
  e.ttft_counts = m.ttft_hist;
  e.tpot_counts = m.tpot_hist;
  e.ttft_sum_s = m.ttft_sum;
  e.tpot_sum_s = m.tpot_sum;
  e.ttft_n = m.ttft_n;
  e.tpot_n = m.tpot_n;
  e.within_slo = m.within_slo;
  e.switches = m.switches;
  e.cold_loads = m.cold_loads;
  e.evictions = ps.evictions;
  e.waiting = static_cast<int64_t>(m.pending.size());
  e.link_gbps = m.setup.link_gbps;
  int64_t link_bytes = 0;
  for (size_t i = 0; i < m.slices.size(); ++i) {
    const Impl::Slice& s = *m.slices[i];
    EngineMetrics::Slice x;
    x.model = s.model;
    x.running = static_cast<int>(s.running_count);
    x.alpha = s.alpha;
    x.hbm_utilization = static_cast<double>(s.hbm_bytes) / (m.setup.slices[i].hbm_gbps * 1e9 * up);
    x.link_share = static_cast<double>(s.link_bytes) / (m.setup.link_gbps * 1e9 * up);
    x.iterations = s.iterations;
    x.hbm_bytes = s.hbm_bytes;
    x.hbm_gbps = m.setup.slices[i].hbm_gbps;
    const MemoryStats ms = s.slice->device().memory_stats();
    x.device_bytes_in_use = ms.current[0];
    x.device_bytes = m.setup.slices[i].hbm_bytes;
    e.waiting += static_cast<int64_t>(s.inbox.size());
    link_bytes += s.link_bytes;
    e.slices.push_back(x);
  }
  e.link_bytes = link_bytes;
  e.link_utilization = static_cast<double>(link_bytes) / (m.setup.link_gbps * 1e9 * up);
  return e;
}

}  // namespace spillway::inference

// /metrics: EngineMetrics in the Prometheus text exposition format (version 0.0.4).
#include <fmt/format.h>

#include "spillway/server.hpp"

namespace spillway::server {
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
  gauge_header(out, "spillway_requests_total", "counter",
               "Completion requests by outcome (ok, invalid, unknown_model, overloaded, "
               "draining, unavailable, failed, cancelled).");
  for (const auto& [outcome, n] : m.requests)
    out += fmt::format("spillway_requests_total{{outcome=\"{}\"}} {}\n", label(outcome), n);
  gauge_header(out, "spillway_generated_tokens_total", "counter", "Tokens generated.");
  out += fmt::format("spillway_generated_tokens_total {}\n", m.tokens_generated);
  gauge_header(out, "spillway_prompt_tokens_total", "counter", "Prompt tokens accepted.");
  out += fmt::format("spillway_prompt_tokens_total {}\n", m.prompt_tokens);
  histogram(out, "spillway_ttft_seconds", "Time from a request's arrival to its first token.",
            m.ttft_bounds_s, m.ttft_counts, m.ttft_sum_s, m.ttft_n);
  histogram(out, "spillway_tpot_seconds", "Mean time between a request's tokens after the first.",
            m.tpot_bounds_s, m.tpot_counts, m.tpot_sum_s, m.tpot_n);
  gauge_header(out, "spillway_requests_within_slo_total", "counter",
               "Finished requests that met both the TTFT and the TPOT target.");
  out += fmt::format("spillway_requests_within_slo_total {}\n", m.within_slo);
  gauge_header(out, "spillway_model_switches_total", "counter",
               "A slice took a model already resident in host memory (nothing copied).");
  out += fmt::format("spillway_model_switches_total {}\n", m.switches);
  gauge_header(out, "spillway_cold_loads_total", "counter",
               "A slice took a model that had to be read from disk into host memory.");
  out += fmt::format("spillway_cold_loads_total {}\n", m.cold_loads);
  gauge_header(out, "spillway_pool_evictions_total", "counter",
               "Models dropped from host memory to make room.");
  out += fmt::format("spillway_pool_evictions_total {}\n", m.evictions);
  gauge_header(out, "spillway_waiting_requests", "gauge",
               "Requests accepted and not yet decoding.");
  out += fmt::format("spillway_waiting_requests {}\n", m.waiting);
  gauge_header(out, "spillway_link_utilization", "gauge",
               "Bytes moved over the shared host link / (its bandwidth x uptime).");
  out += fmt::format("spillway_link_utilization {}\n", m.link_utilization);
  gauge_header(out, "spillway_link_bytes_total", "counter",
               "Bytes moved over the shared host link (HybridGEMM's weight reads).");
  out += fmt::format("spillway_link_bytes_total {}\n", m.link_bytes);
  gauge_header(out, "spillway_slice_hbm_bytes_total", "counter",
               "Bytes a slice's HybridGEMMs read and wrote in its HBM.");
  for (size_t i = 0; i < m.slices.size(); ++i)
    out += fmt::format("spillway_slice_hbm_bytes_total{{slice=\"{}\"}} {}\n", i,
                       m.slices[i].hbm_bytes);
  gauge_header(out, "spillway_slice_hbm_bandwidth_bytes_per_second", "gauge",
               "A slice's emulated HBM bandwidth (scaled).");
  for (size_t i = 0; i < m.slices.size(); ++i)
    out += fmt::format("spillway_slice_hbm_bandwidth_bytes_per_second{{slice=\"{}\"}} {}\n", i,
                       m.slices[i].hbm_gbps * 1e9);
  gauge_header(out, "spillway_link_bandwidth_bytes_per_second", "gauge",
               "The emulated shared host link's bandwidth (scaled).");
  out += fmt::format("spillway_link_bandwidth_bytes_per_second {}\n", m.link_gbps * 1e9);
  gauge_header(out, "spillway_slice_hbm_utilization", "gauge",
               "A slice's HBM bytes / (its bandwidth x uptime).");
  for (size_t i = 0; i < m.slices.size(); ++i)
    out += fmt::format("spillway_slice_hbm_utilization{{slice=\"{}\"}} {}\n", i,
                       m.slices[i].hbm_utilization);
  gauge_header(out, "spillway_slice_link_share", "gauge",
               "A slice's link bytes / (the link's bandwidth x uptime).");
  for (size_t i = 0; i < m.slices.size(); ++i)
    out += fmt::format("spillway_slice_link_share{{slice=\"{}\"}} {}\n", i, m.slices[i].link_share);
  gauge_header(out, "spillway_slice_alpha", "gauge",
               "HybridGEMM's alpha on a slice (the share of columns on the symmetric path).");
  for (size_t i = 0; i < m.slices.size(); ++i)
    out += fmt::format("spillway_slice_alpha{{slice=\"{}\"}} {}\n", i, m.slices[i].alpha);
  gauge_header(out, "spillway_slice_running_requests", "gauge",
               "Requests on a slice (decoding or waiting for a sequence).");
  for (size_t i = 0; i < m.slices.size(); ++i)
    out += fmt::format("spillway_slice_running_requests{{slice=\"{}\",model=\"{}\"}} {}\n", i,
                       label(m.slices[i].model), m.slices[i].running);
  gauge_header(out, "spillway_slice_iterations_total", "counter", "Decoder steps of a slice.");
  for (size_t i = 0; i < m.slices.size(); ++i)
    out += fmt::format("spillway_slice_iterations_total{{slice=\"{}\"}} {}\n", i,
                       m.slices[i].iterations);
  gauge_header(out, "spillway_slice_device_bytes_in_use", "gauge",
               "A slice's device memory in use (KV cache and step buffers).");
  for (size_t i = 0; i < m.slices.size(); ++i)
    out += fmt::format("spillway_slice_device_bytes_in_use{{slice=\"{}\"}} {}\n", i,
                       m.slices[i].device_bytes_in_use);
  gauge_header(out, "spillway_uptime_seconds", "gauge", "Seconds since the engine started.");
  out += fmt::format("spillway_uptime_seconds {}\n", m.uptime_s);
  return out;
}

}  // namespace spillway::server

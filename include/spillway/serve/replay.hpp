// Trace replay of host-resident serving (docs/serve.md, `spillway replay`): the
// production trace's arrivals and model ids, open loop, through a discrete-event
// simulation of MIG slices that compute every model from host memory with HybridGEMM,
// placed by the Scheduler (spillway/serve/scheduler.hpp: the same code a live server runs),
// against baselines in the same run.
//
// Note [Replay model]: each trace model id is a distinct served model (its own weights)
// with the architecture of a catalog model (the ids by popularity, dealt round-robin over
// the catalog models given). The trace has no token counts: prompt and output lengths are
// drawn from log-normal distributions (medians and clips in ReplayOptions) with a seed,
// and every report says so. A slice serves its active model with continuous batching:
// each iteration decodes one token for every running request and prefills one chunk of
// the oldest waiting prompt; its time is the latest of
//   - link: the HybridGEMM link bytes of the weights the iteration touches (all of a dense
//     model; an MoE's active bytes times the tokens, up to all of it) over the link's
//     bandwidth divided among the slices iterating at that moment;
//   - HBM: HybridGEMM's HBM bytes plus the KV cache read (every decoding request's context)
//     and written, at the slice's bandwidth;
//   - compute: 2 x active parameters x tokens at the slice's rate times an efficiency.
// The GEMM of a model is taken as one (tokens x hidden) by (hidden x weights / hidden);
// tiles 64 x 128 x 64. Host memory holds models up to a budget (LRU); a model not there is
// loaded from disk first (a cold start). Alpha per slice follows the alpha controller
// (or stays fixed: an ablation).
// Baselines: dedicated GPUs (each model alone on whole GPUs with its weights in HBM:
// enough GPUs to hold it), time sharing one whole GPU with reloads (a switch costs a
// reload latency drawn from the trace's measured ones), and the ablations of the
// scheduler (random placement, a fixed prefill chunk) and a static alpha.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "spillway/catalog/model.hpp"

namespace spillway {

struct TraceRequest {
  double arrival_s = 0.0;  // from the trace's first request
  std::string model;       // the trace's model id
};

// The request trace's CSV (columns gmt_create "YYYY-MM-DD HH:MM:SS" and
// checkpoint_model_version_id, found by header name), in arrival order, the first
// `max_requests` (0: all). Rows without a model id are skipped and counted in *skipped.
// Errors name the file, the line and the column.
std::vector<TraceRequest> read_request_trace(const std::string& path, int64_t max_requests,
                                             int64_t* skipped = nullptr);
// The reload latencies (column "value", ms).
std::vector<double> read_reload_latencies_ms(const std::string& path);

struct ReplayOptions {
  std::string hardware = "gh200";
  std::string profile = "1g.12gb";  // the MIG profile every slice has
  std::vector<std::string> models = {"Llama-3.2-3B", "Llama-3.1-8B", "Qwen3-30B-A3B",
                                     "Mixtral-8x7B", "Llama-3.1-70B"};
  double time_scale = 1.0;  // arrivals compressed by this factor (> 1: a busier trace)
  uint64_t seed = 1;
  double prompt_median = 512, prompt_sigma = 1.0;  // log-normal, clipped to [16, 8192]
  double output_median = 128, output_sigma = 0.8;  // log-normal, clipped to [8, 2048]
  int64_t prompt_min = 16, prompt_max = 8192;      // the clips
  int64_t output_min = 8, output_max = 2048;
  // The served architectures as configs (a live server's models): when not empty, used in
  // place of `models` (catalog names), with their weights at this many bytes a parameter.
  std::vector<ModelConfig> architectures;
  double weight_bytes_per_param = 2.0;  // bf16
  bool baselines = true;                // false: the host-resident configuration alone
  double ttft_ms = 2000.0;              // SLO targets, every model
  double tpot_ms = 100.0;
  double host_budget_gb = 400.0;  // host memory for weights
  double disk_gbps = 5.0;         // cold loads
  double efficiency = 0.5;        // of the slice's peak compute
  std::vector<double> reload_ms;  // the production reload latencies (time-sharing baseline)
};

struct LatencyStats {
  double p50 = 0, p95 = 0, p99 = 0;
};

struct ReplayResult {
  std::string name;  // the configuration
  int64_t requests = 0, completed = 0;
  LatencyStats ttft_ms, tpot_ms;
  double slo_attainment = 0.0;  // both targets met
  int64_t switches = 0;         // a slice given another model (or a reload, time sharing)
  LatencyStats switch_ttft_ms;  // TTFT of the requests that caused a switch
  int64_t cold_starts = 0;
  LatencyStats cold_ttft_ms;
  double link_utilization = 0.0;  // link bytes / (bandwidth x makespan)
  double hbm_utilization = 0.0;   // mean over slices
  double makespan_s = 0.0;
  int gpus = 1;                                       // GPUs the configuration uses
  std::vector<std::pair<double, double>> ttft_trace;  // (arrival s, TTFT ms) per request
};

// The (prompt, output) token counts of n requests, drawn as Note [Replay model] says (one
// generator seeded by o.seed, a prompt then an output per request, clipped).
std::vector<std::pair<int64_t, int64_t>> draw_token_counts(size_t n, const ReplayOptions& o);
// The trace's model ids, the most requested first (ties by id): the order in which the
// replays deal them over architectures or served models.
std::vector<std::string> models_by_popularity(const std::vector<TraceRequest>& trace);
// Percentiles 50, 95 and 99 (nearest rank) of v; zeros when v is empty.
LatencyStats latency_stats(const std::vector<double>& v);

// The main configuration (the scheduler, chunks from the profile table, the controller)
// and the baselines, on the same requests.
std::vector<ReplayResult> run_replay(const std::vector<TraceRequest>& trace,
                                     const ReplayOptions& o);
std::string format_replay(const std::vector<ReplayResult>& r, const ReplayOptions& o,
                          int64_t distinct_models);
std::string replay_json(const std::vector<ReplayResult>& r, const ReplayOptions& o);
// TTFT over time of the configurations, one series each (log scale).
std::string replay_svg(const std::vector<ReplayResult>& r);

}  // namespace spillway

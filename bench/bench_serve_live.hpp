// The live serving engine's benchmark (`spillway bench serve-live`): continuous batching
// against one request at a time, same requests, same emulated slice, same run.
//
// Both runs submit the same requests at once (model, prompt, output length and seed each)
// to a ServingEngine on one slice; the baseline decodes one request at a time
// (max_running 1), continuous batching up to max_running together. Throughput is generated
// tokens over the wall time from the first submit to the last token. The physical limit of
// a run: at alpha 0 every decoder step reads the weights its tokens touch once over the
// link, so a run cannot be faster than its link bytes at the link's bandwidth: its tokens
// over that time. The two runs' completions are compared token for token (Note [Served
// determinism]).
#pragma once

#include <cstdint>
#include <string>

namespace spillway {

struct ServeLiveBenchOptions {
  std::string config = "tiny-moe";  // the reference model served (embedded or a path)
  std::string hardware = "gh200";
  std::string profile = "7g.96gb";  // one slice
  double rate_scale = 1e-3;
  int requests = 32;
  int prompt_tokens = 32;
  int output_tokens = 32;
  int max_running = 8;
};

struct ServeLiveBenchResult {
  ServeLiveBenchOptions options;
  int64_t weight_bytes = 0;
  double link_gbps = 0.0;
  double batched_s = 0.0, serial_s = 0.0;  // wall time of each run
  double batched_tokens_per_s = 0.0, serial_tokens_per_s = 0.0;
  double limit_tokens_per_s = 0.0;         // tokens / (link bytes / link bandwidth), batched
  double serial_limit_tokens_per_s = 0.0;  // the same, one at a time
  double serial_link_bytes_per_token = 0.0, batched_link_bytes_per_token = 0.0;
  double batched_ttft_p99_ms = 0.0, serial_ttft_p99_ms = 0.0;
  bool same_tokens = false;
};

ServeLiveBenchResult run_serve_live_bench(const ServeLiveBenchOptions& o);
std::string format_serve_live_bench(const ServeLiveBenchResult& r);
std::string serve_live_bench_json(const ServeLiveBenchResult& r);

}  // namespace spillway

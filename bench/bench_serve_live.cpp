#include "bench_serve_live.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "spillway/error.hpp"
#include "spillway/replay.hpp"
#include "spillway/server.hpp"

namespace spillway {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

struct Run {
  double seconds = 0.0;
  int64_t tokens = 0;
  double ttft_p99_ms = 0.0;
  std::vector<std::vector<int32_t>> outputs;
};

Run run_engine(const std::vector<server::ModelFiles>& models, const ServeLiveBenchOptions& o,
               int max_running) {
  server::EngineOptions e;
  e.hardware = o.hardware;
  e.profile = o.profile;
  e.rate_scale = o.rate_scale;
  e.max_running = max_running;
  e.max_context = o.prompt_tokens + o.output_tokens;
  e.max_step_tokens = std::max(2 * o.max_running, 64);
  e.max_waiting = o.requests;
  e.alpha = 0.0;
  server::ServingEngine engine(models, e);
  std::vector<std::shared_ptr<server::Completion>> cs;
  const auto t0 = Clock::now();
  for (int i = 0; i < o.requests; ++i) {
    server::CompletionRequest q;
    q.model = models.front().name;
    for (int t = 0; t < o.prompt_tokens; ++t) q.prompt.push_back((i * 31 + t * 7) % 256);
    q.max_tokens = o.output_tokens;
    q.temperature = 0.8;
    q.seed = static_cast<uint64_t>(i);
    server::SubmitResult r = engine.submit(q);
    SPILLWAY_CHECK(r.status == server::SubmitStatus::kAccepted, "bench serve-live: {}", r.message);
    cs.push_back(r.completion);
  }
  Run run;
  std::vector<double> ttft;
  for (const auto& c : cs) {
    std::vector<int32_t> toks;
    while (c->wait_tokens(toks.size(), &toks) == server::Completion::State::kRunning) {
    }
    SPILLWAY_CHECK(c->state() == server::Completion::State::kDone, "bench serve-live: {}",
                   c->error());
    run.tokens += static_cast<int64_t>(toks.size());
    ttft.push_back(c->ttft_ms());
    run.outputs.push_back(std::move(toks));
  }
  run.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  run.ttft_p99_ms = latency_stats(ttft).p99;
  return run;
}

}  // namespace

ServeLiveBenchResult run_serve_live_bench(const ServeLiveBenchOptions& o) {
  if (o.requests < 1) SPILLWAY_FIELD_ERROR("requests", o.requests, "must be >= 1");
  if (o.max_running < 2) SPILLWAY_FIELD_ERROR("max_running", o.max_running, "must be >= 2");
  ServeLiveBenchResult r;
  r.options = o;
  const fs::path dir =
      fs::temp_directory_path() / fmt::format("spillway-bench-serve-live-{}", ::getpid());
  struct Remove {
    fs::path p;
    ~Remove() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } remove{dir};
  server::write_checkpoint(o.config, 1, (dir / "model").string(), DType::kFp32);
  const std::vector<server::ModelFiles> models = server::find_models(dir.string());
  const Run serial = run_engine(models, o, 1);
  const Run batched = run_engine(models, o, o.max_running);
  {
    server::EngineOptions e;
    e.hardware = o.hardware;
    e.profile = o.profile;
    e.rate_scale = o.rate_scale;
    e.max_running = 1;
    e.max_step_tokens = 64;
    server::ServingEngine probe(models, e);
    r.link_gbps = probe.link_gbps();
    r.weight_bytes = probe.models().front().weight_bytes;
  }
  r.serial_s = serial.seconds;
  r.batched_s = batched.seconds;
  r.serial_tokens_per_s = static_cast<double>(serial.tokens) / serial.seconds;
  r.batched_tokens_per_s = static_cast<double>(batched.tokens) / batched.seconds;
  r.serial_limit_tokens_per_s = r.link_gbps * 1e9 / static_cast<double>(r.weight_bytes);
  r.limit_tokens_per_s = r.serial_limit_tokens_per_s * std::min(o.max_running, o.requests);
  r.serial_ttft_p99_ms = serial.ttft_p99_ms;
  r.batched_ttft_p99_ms = batched.ttft_p99_ms;
  r.same_tokens = serial.outputs == batched.outputs;
  return r;
}

std::string format_serve_live_bench(const ServeLiveBenchResult& r) {
  const ServeLiveBenchOptions& o = r.options;
  return fmt::format(
      "{} requests of {} ({:.2f} MB fp32), {} prompt + {} generated tokens each, on one {} "
      "slice of {} (rates x {:g}: link {:.3f} GB/s), alpha 0\n"
      "{:<34} {:>10} {:>12} {:>14} {:>10}\n"
      "{:<34} {:>9.2f}s {:>12.0f} {:>14.0f} {:>9.0f}%\n"
      "{:<34} {:>9.2f}s {:>12.0f} {:>14.0f} {:>9.0f}%\n"
      "continuous batching: {:.2f}x the tokens/s of one request at a time; TTFT p99 {:.0f} ms "
      "against {:.0f} ms; completions token for token the same: {}\n"
      "limit: each decoder step reads the weights once over the link (S / link), so at most "
      "max_running tokens per S / link; prefill steps are part of the time\n",
      o.requests, o.config, static_cast<double>(r.weight_bytes) / 1e6, o.prompt_tokens,
      o.output_tokens, o.profile, o.hardware, o.rate_scale, r.link_gbps, "", "wall", "tokens/s",
      "limit tok/s", "of limit", fmt::format("one at a time (max_running 1)"), r.serial_s,
      r.serial_tokens_per_s, r.serial_limit_tokens_per_s,
      100.0 * r.serial_tokens_per_s / r.serial_limit_tokens_per_s,
      fmt::format("continuous batching (max_running {})", o.max_running), r.batched_s,
      r.batched_tokens_per_s, r.limit_tokens_per_s,
      100.0 * r.batched_tokens_per_s / r.limit_tokens_per_s,
      r.batched_tokens_per_s / r.serial_tokens_per_s, r.batched_ttft_p99_ms, r.serial_ttft_p99_ms,
      r.same_tokens ? "yes" : "NO");
}

std::string serve_live_bench_json(const ServeLiveBenchResult& r) {
  const ServeLiveBenchOptions& o = r.options;
  nlohmann::json j = {{"schema", "spillway.bench-serve-live/1"},
                      {"config", o.config},
                      {"hardware", o.hardware},
                      {"profile", o.profile},
                      {"rate_scale", o.rate_scale},
                      {"requests", o.requests},
                      {"prompt_tokens", o.prompt_tokens},
                      {"output_tokens", o.output_tokens},
                      {"max_running", o.max_running},
                      {"weight_bytes", r.weight_bytes},
                      {"link_gbps", r.link_gbps},
                      {"serial_s", r.serial_s},
                      {"batched_s", r.batched_s},
                      {"serial_tokens_per_s", r.serial_tokens_per_s},
                      {"batched_tokens_per_s", r.batched_tokens_per_s},
                      {"speedup", r.batched_tokens_per_s / r.serial_tokens_per_s},
                      {"limit_tokens_per_s", r.limit_tokens_per_s},
                      {"serial_limit_tokens_per_s", r.serial_limit_tokens_per_s},
                      {"serial_ttft_p99_ms", r.serial_ttft_p99_ms},
                      {"batched_ttft_p99_ms", r.batched_ttft_p99_ms},
                      {"same_tokens", r.same_tokens}};
  return j.dump(2) + "\n";
}

}  // namespace spillway

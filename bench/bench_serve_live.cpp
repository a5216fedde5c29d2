#include "bench_serve_live.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "spillway/core/error.hpp"
#include "spillway/inference/inference.hpp"
#include "spillway/serve/replay.hpp"
#include "spillway/serve/serve.hpp"

namespace spillway {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

struct Run {
  double seconds = 0.0;
  int64_t tokens = 0;
  int64_t link_bytes = 0;  // moved over the link by the run
  double link_gbps = 0.0;
  double ttft_p99_ms = 0.0;
  std::vector<std::vector<int32_t>> outputs;
};

Run run_engine(const std::vector<inference::ModelFiles>& models, const ServeLiveBenchOptions& o,
               int max_running) {
  inference::EngineOptions e;
  e.hardware = o.hardware;
  e.profile = o.profile;
  e.rate_scale = o.rate_scale;
  e.max_running = max_running;
  e.max_context = o.prompt_tokens + o.output_tokens;
  e.max_step_tokens = std::max(2 * o.max_running, 64);
  e.max_waiting = o.requests;
  e.alpha = 0.0;
  inference::ServingEngine engine(models, e);
  std::vector<std::shared_ptr<inference::Completion>> cs;
  const auto t0 = Clock::now();
  for (int i = 0; i < o.requests; ++i) {
    inference::CompletionRequest q;
    q.model = models.front().name;
    for (int t = 0; t < o.prompt_tokens; ++t) q.prompt.push_back((i * 31 + t * 7) % 256);
    q.max_tokens = o.output_tokens;
    q.temperature = 0.8;
    q.seed = static_cast<uint64_t>(i);
    inference::SubmitResult r = engine.submit(q);
    SPILLWAY_CHECK(r.status == inference::SubmitStatus::kAccepted, "bench serve-live: {}",
                   r.message);
    cs.push_back(r.completion);
  }
  Run run;
  std::vector<double> ttft;
  for (const auto& c : cs) {
    std::vector<int32_t> toks;
    while (c->wait_tokens(toks.size(), &toks) == inference::Completion::State::kRunning) {
    }
    SPILLWAY_CHECK(c->state() == inference::Completion::State::kDone, "bench serve-live: {}",
                   c->error());
    run.tokens += static_cast<int64_t>(toks.size());
    ttft.push_back(c->ttft_ms());
    run.outputs.push_back(std::move(toks));
  }
  run.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  run.link_bytes = engine.metrics().link_bytes;
  run.link_gbps = engine.link_gbps();
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
  inference::write_checkpoint(o.config, 1, (dir / "model").string(), DType::kFp32);
  const std::vector<inference::ModelFiles> models = inference::find_models(dir.string());
  const Run serial = run_engine(models, o, 1);
  const Run batched = run_engine(models, o, o.max_running);
  r.link_gbps = batched.link_gbps;
  r.weight_bytes = SafetensorsFile(models.front().weights_path).data_bytes();
  r.serial_s = serial.seconds;
  r.batched_s = batched.seconds;
  r.serial_tokens_per_s = static_cast<double>(serial.tokens) / serial.seconds;
  r.batched_tokens_per_s = static_cast<double>(batched.tokens) / batched.seconds;
  // The limit of each run: its tokens over the time its link bytes take at the link's
  // bandwidth (what it moved: a step reads the weights its tokens touch once).
  auto limit = [](const Run& x) {
    return static_cast<double>(x.tokens) /
           (static_cast<double>(x.link_bytes) / (x.link_gbps * 1e9));
  };
  r.serial_limit_tokens_per_s = limit(serial);
  r.limit_tokens_per_s = limit(batched);
  r.serial_link_bytes_per_token =
      static_cast<double>(serial.link_bytes) / static_cast<double>(serial.tokens);
  r.batched_link_bytes_per_token =
      static_cast<double>(batched.link_bytes) / static_cast<double>(batched.tokens);
  r.serial_ttft_p99_ms = serial.ttft_p99_ms;
  r.batched_ttft_p99_ms = batched.ttft_p99_ms;
  r.same_tokens = serial.outputs == batched.outputs;
  return r;
}

std::string format_serve_live_bench(const ServeLiveBenchResult& r) {
  const ServeLiveBenchOptions& o = r.options;
  std::string s = fmt::format(
      "{} requests of {} ({:.2f} MB fp32), {} prompt + {} generated tokens each, on one {} "
      "slice of {} (rates x {:g}: link {:.3f} GB/s), alpha 0\n",
      o.requests, o.config, static_cast<double>(r.weight_bytes) / 1e6, o.prompt_tokens,
      o.output_tokens, o.profile, o.hardware, o.rate_scale, r.link_gbps);
  s += fmt::format("{:<38} {:>8} {:>10} {:>14} {:>12} {:>9}\n", "", "wall", "tokens/s",
                   "link B/token", "limit tok/s", "of limit");
  auto row = [&](const std::string& name, double secs, double tps, double bpt, double lim) {
    s += fmt::format("{:<38} {:>7.2f}s {:>10.0f} {:>14.0f} {:>12.0f} {:>8.0f}%\n", name, secs, tps,
                     bpt, lim, 100.0 * tps / lim);
  };
  row("one at a time (max_running 1)", r.serial_s, r.serial_tokens_per_s,
      r.serial_link_bytes_per_token, r.serial_limit_tokens_per_s);
  row(fmt::format("continuous batching (max_running {})", o.max_running), r.batched_s,
      r.batched_tokens_per_s, r.batched_link_bytes_per_token, r.limit_tokens_per_s);
  s += fmt::format(
      "continuous batching: {:.2f}x the tokens/s of one request at a time; TTFT p99 {:.0f} ms "
      "against {:.0f} ms; completions token for token the same: {}\n"
      "limit: a run's tokens over the time its link bytes take at the link's bandwidth (each "
      "decoder step reads the weights its tokens touch once: with more tokens a step, an MoE "
      "touches more experts); batching cuts the link bytes per token\n",
      r.batched_tokens_per_s / r.serial_tokens_per_s, r.batched_ttft_p99_ms, r.serial_ttft_p99_ms,
      r.same_tokens ? "yes" : "NO");
  return s;
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
                      {"serial_link_bytes_per_token", r.serial_link_bytes_per_token},
                      {"batched_link_bytes_per_token", r.batched_link_bytes_per_token},
                      {"serial_ttft_p99_ms", r.serial_ttft_p99_ms},
                      {"batched_ttft_p99_ms", r.batched_ttft_p99_ms},
                      {"same_tokens", r.same_tokens}};
  return j.dump(2) + "\n";
}

}  // namespace spillway

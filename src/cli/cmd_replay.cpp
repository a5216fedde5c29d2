// `spillway replay`: the production serving trace through host-resident serving on a
// GH200's MIG slices and its baselines, simulated (spillway/serve/replay.hpp, Note [Replay model]),
// or sent live to a running `spillway serve` (spillway/http/load_clients.hpp, Note [Live replay]);
// and `spillway load`, the load test of a running server (Note [Load test]). Both clients fail
// (exit 1, saying how many and why) when a request they sent was not answered.
//
// Note [The replay's default data]: the trace CSVs (data/traces, 2.4 MB) are not compiled
// in: `cmake --install` puts them in <prefix>/share/spillway/traces, beside
// <prefix>/bin/spillway. A binary with <its folder>/../share/spillway is an installed one
// and reads them there, never from the source tree it was built from; a binary run from its
// build tree reads the source tree's data/traces. A default file that is not there is an
// error naming the path and --trace / --reloads.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <system_error>

#include "cli/commands.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/http/load_clients.hpp"
#include "spillway/serve/replay.hpp"
#include "tool/output_path.hpp"

namespace spillway::cli {

namespace {

namespace fs = std::filesystem;

// --time-scale: below this the trace's 23 days span more than 60 years and the simulated
// clock (ms in a double) loses its sub-millisecond resolution; above, every request arrives
// at once.
constexpr double kMinTimeScale = 1e-3;
constexpr double kMaxTimeScale = 1e9;
// --max-requests not given, live: the first this many (0 given: all, as simulated).
constexpr int64_t kLiveDefaultRequests = 200;

// The path of a default data file (Note [The replay's default data]).
std::string default_data_file(const std::string& name, const std::string& flag) {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  const fs::path share = exe.parent_path().parent_path() / "share" / "spillway";
  if (!ec && fs::is_directory(share, ec)) {
    const fs::path f = share / "traces" / name;
    if (!fs::is_regular_file(f, ec))
      SPILLWAY_INPUT_ERROR(
          "the default {} ({}) is missing from this installation: {} is not a file; give one "
          "with {} FILE",
          flag, name, f.string(), flag);
    return f.string();
  }
  const fs::path f = fs::path(SPILLWAY_SOURCE_DATA_DIR) / "traces" / name;
  if (!fs::is_regular_file(f, ec))
    SPILLWAY_INPUT_ERROR(
        "the default {} ({}) is not found: this spillway ({}) is not installed ({} does not "
        "exist) and its source tree's {} is not a file; give one with {} FILE",
        flag, name, exe.string(), share.string(), f.string(), flag);
  return f.string();
}

template <class State>
void run_live_replay(State& st) {
  st.live = http::server_base_url(st.live, "--live");
  const std::string trace_path =
      st.trace.empty() ? default_data_file("lora_request_trace.csv", "--trace") : st.trace;
  int64_t skipped = 0;
  const int64_t n = st.max_requests < 0 ? kLiveDefaultRequests : st.max_requests;
  const std::vector<TraceRequest> trace = read_request_trace(trace_path, n, &skipped);
  if (trace.empty()) SPILLWAY_INPUT_ERROR("--trace {}: no request", trace_path);
  const double span_s = trace.back().arrival_s - trace.front().arrival_s;
  if (st.o.time_scale == 0) st.o.time_scale = std::max(1.0, span_s / 20.0);
  int64_t in_time = 0;
  for (const TraceRequest& t : trace) in_time += t.arrival_s / st.o.time_scale <= st.lo.max_seconds;
  std::map<std::string, int> distinct;
  for (const TraceRequest& t : trace) distinct[t.model] = 1;
  std::string says =
      fmt::format("replaying {} requests of {} live against {}: arrivals x{:g} span {:.1f} s",
                  trace.size(), trace_path, st.live, st.o.time_scale, span_s / st.o.time_scale);
  says += in_time == static_cast<int64_t>(trace.size())
              ? fmt::format(" (--max-seconds {:g})...\n", st.lo.max_seconds)
              : fmt::format(
                    "; only {} of them arrive within --max-seconds {:g}: the other {} "
                    "are not sent...\n",
                    in_time, st.lo.max_seconds, static_cast<int64_t>(trace.size()) - in_time);
  say_beside_json(st.json_path, says);
  const http::LiveReplayReport r = http::replay_live(st.live, trace, st.o, st.lo);
  say_beside_json(st.json_path, http::format_live_replay(r, static_cast<int64_t>(distinct.size())));
  if (!st.svg_path.empty() && r.answered > 0) write_output(st.svg_path, replay_svg(r.results));
  if (!st.json_path.empty()) write_output(st.json_path, http::live_replay_json(r));
  const std::string failure = http::live_replay_failure(r);
  if (!failure.empty()) throw Error(failure);
}

}  // namespace

void add_replay_command(CLI::App& app) {
  overview_line("replay", Group::kServe, "replay a production serving trace, simulated or live");
  struct State {
    ReplayOptions o;
    std::string trace, reloads;  // empty: the installed ones (Note [The replay's default data])
    int64_t max_requests = -1;   // not given: all, live kLiveDefaultRequests
    std::string json_path, svg_path;
    std::string live;
    http::LiveOptions lo;
    double prompt_median = 0, output_median = 0;  // 0: 512 / 128 simulated, 64 / 16 live
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "replay",
      "Replays the production serving trace (data/traces: arrivals and model ids of a "
      "serverless service, GenTD26) open loop through host-resident serving, simulated: every "
      "model's weights in host memory, the MIG slices of a GH200 computing from them with "
      "HybridGEMM, placed by the serving scheduler (the code a server runs), alpha per slice "
      "from the controller. Each trace model id is a served model with the architecture of "
      "one of --models (dealt by popularity). The trace has no token counts: prompt and "
      "output lengths are drawn log-normal with --seed, and the report says so. Beside it, "
      "same requests: dedicated GPUs per model, time sharing one GPU with reloads (the "
      "trace's measured reload latencies), and the ablations random placement, default "
      "chunk, static alpha. Prints TTFT and TPOT p50/p95/p99, SLO attainment, switches, cold "
      "starts, link and HBM utilization; --svg draws TTFT over time.\n\n"
      "Examples:\n"
      "  spillway replay\n"
      "  spillway replay --max-requests 5000 --time-scale 200 --profile 2g.24gb --svg ttft.svg\n"
      "  spillway replay --models Llama-3.1-8B,Qwen3-30B-A3B --json -\n\n"
      "Live (--live URL): the trace's requests sent to a running `spillway serve` at URL, open "
      "loop at their arrival times / --time-scale (default: the requests' span fits in ~20 s), "
      "streamed and timed at the client (TTFT from each request's arrival time, so a wait for "
      "a free client thread counts), bounded by --max-requests (not given: 200) and "
      "--max-seconds; not retried: a request refused (429, 503) or failed is an SLO miss and "
      "the replay exits 1 saying how many; the trace's model ids dealt over the served models; "
      "printed beside the simulator's prediction for the server's own setup (its GPU, MIG "
      "profile, rate scale, models and targets, read from URL/spillway/setup).\n"
      "  spillway serve --port 8000 &\n"
      "  spillway replay --live http://127.0.0.1:8000 --max-requests 100\n\n"
      "The trace files are installed with spillway (<prefix>/share/spillway/traces); a "
      "spillway run from its build tree reads the source tree's data/traces.");
  cmd->add_option("--trace", st->trace,
                  "The request trace CSV (default: the installed lora_request_trace.csv)");
  cmd->add_option("--reloads", st->reloads,
                  "The measured reload latencies CSV, ms (default: the installed "
                  "basemodel_update_latency_anon.csv)");
  in_range(cmd->add_option("--max-requests", st->max_requests,
                           "Replay the first N requests of the trace, simulated or live (0: all; "
                           "not given: all, live 200)"),
           closed(0, 1000000));
  st->o.time_scale = 0;
  in_range(cmd->add_option("--time-scale", st->o.time_scale,
                           "Arrivals this many times faster than the trace's (it spans 23 days); "
                           "0: 1, or live, the requests' span in ~20 s")
               ->capture_default_str(),
           closed_or(kMinTimeScale, kMaxTimeScale, 0));
  cmd->add_option("--live", st->live,
                  "Replay against the `spillway serve` at this URL (http://host:port, or its "
                  "/v1 as an OpenAI client's base_url)");
  in_range(cmd->add_option("--max-seconds", st->lo.max_seconds,
                           "Live: send no request after this many seconds")
               ->capture_default_str(),
           open_closed(0, 86400));
  in_range(cmd->add_option("--max-concurrency", st->lo.max_concurrency,
                           "Live: client threads (requests in flight at once)")
               ->capture_default_str(),
           closed(1, 4096));
  in_range(cmd->add_option("--prompt-median", st->prompt_median,
                           "Median prompt tokens of the drawn lengths (0: 512, live 64)")
               ->capture_default_str(),
           closed(0, 1e6));
  in_range(cmd->add_option("--output-median", st->output_median,
                           "Median output tokens of the drawn lengths (0: 128, live 16)")
               ->capture_default_str(),
           closed(0, 1e6));
  cmd->add_option("--hardware", st->o.hardware, "The GPU (catalog name)")->capture_default_str();
  cmd->add_option("--profile", st->o.profile, "The MIG profile of the slices")
      ->capture_default_str();
  cmd->add_option("--models", st->o.models, "Catalog architectures the trace's models take")
      ->delimiter(',')
      ->capture_default_str();
  in_range(cmd->add_option("--seed", st->o.seed, "Seed of the drawn token counts")
               ->capture_default_str(),
           closed(0, 4294967295.0));
  in_range(cmd->add_option("--ttft-ms", st->o.ttft_ms, "TTFT target")->capture_default_str(),
           open_closed(0, 1e9));
  in_range(cmd->add_option("--tpot-ms", st->o.tpot_ms,
                           "TPOT target (a model streamed alone over the link gets at least "
                           "1.25 x weights / link)")
               ->capture_default_str(),
           open_closed(0, 1e9));
  cmd->add_option("--json", st->json_path, "Write the results as JSON to FILE ('-' for stdout)");
  cmd->add_option("--svg", st->svg_path, "Write TTFT over time as an SVG picture");
  cmd->callback([st]() {
    const bool live = !st->live.empty();
    st->o.prompt_median = st->prompt_median > 0 ? st->prompt_median : (live ? 64 : 512);
    st->o.output_median = st->output_median > 0 ? st->output_median : (live ? 16 : 128);
    if (live) {
      run_live_replay(*st);
      return;
    }
    if (st->o.time_scale == 0) st->o.time_scale = 1;
    // The models and the outputs before the trace is read and the replay announced.
    for (const std::string& m : st->o.models) (void)load_model(m);
    tool::check_output_path(st->json_path);
    tool::check_output_path(st->svg_path);
    const std::string trace_path =
        st->trace.empty() ? default_data_file("lora_request_trace.csv", "--trace") : st->trace;
    const std::string reloads_path =
        st->reloads.empty() ? default_data_file("basemodel_update_latency_anon.csv", "--reloads")
                            : st->reloads;
    int64_t skipped = 0;
    const std::vector<TraceRequest> trace =
        read_request_trace(trace_path, std::max<int64_t>(st->max_requests, 0), &skipped);
    if (trace.empty()) SPILLWAY_INPUT_ERROR("--trace {}: no request", trace_path);
    st->o.reload_ms = read_reload_latencies_ms(reloads_path);
    std::map<std::string, int> distinct;
    for (const TraceRequest& t : trace) distinct[t.model] = 1;
    say_beside_json(st->json_path,
                    fmt::format("replaying {} requests of {} through 6 configurations ({} rows "
                                "of the trace have no model id and are left out)...\n",
                                trace.size(), trace_path, skipped));
    const std::vector<ReplayResult> r = run_replay(trace, st->o);
    say_beside_json(st->json_path, format_replay(r, st->o, static_cast<int64_t>(distinct.size())));
    if (!st->svg_path.empty()) write_output(st->svg_path, replay_svg(r));
    if (!st->json_path.empty()) write_output(st->json_path, replay_json(r, st->o));
  });
}

void add_load_command(CLI::App& app) {
  overview_line("load", Group::kServe, "load-test a running `spillway serve`");
  struct State {
    std::string url;
    http::LoadOptions o;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "load",
      "Load-tests a running `spillway serve`: --clients threads send --requests requests back "
      "to back, each one of --distinct (model, prompt, seed) triples sampled at temperature "
      "0.8 (each triple sent several times, batched differently each time). A 429 is retried "
      "after 20 ms doubling up to 1 s (never longer than the server's Retry-After), at most "
      "--max-retries times and not past --max-retry-seconds from the request's first try; when "
      "--clients requests in a row still meet 429, the rest are not sent. Checks that every "
      "request got exactly one complete answer (none refused, failed or lost, no response id "
      "twice) and that the answers to a triple are the same tokens, saying how many triples "
      "were answered more than once (only those are compared); prints latency and TTFT "
      "p50/p95/p99 from each request's first try. Exits 1, saying how many and why, when a "
      "check fails.\n\n"
      "Example:\n"
      "  spillway serve --port 8000 &\n"
      "  spillway load http://127.0.0.1:8000 --clients 16 --requests 400");
  cmd->add_option("url", st->url,
                  "The server (http://host:port, or its /v1 as an OpenAI client's base_url)")
      ->required();
  in_range(cmd->add_option("--clients", st->o.clients, "Concurrent clients")->capture_default_str(),
           closed(1, 1024));
  in_range(cmd->add_option("--requests", st->o.requests, "Requests in all")->capture_default_str(),
           closed(1, 10000000));
  in_range(cmd->add_option("--distinct", st->o.distinct, "Distinct (model, prompt, seed) triples")
               ->capture_default_str(),
           closed(1, 1000000));
  in_range(cmd->add_option("--max-tokens", st->o.max_tokens, "Tokens generated per request")
               ->capture_default_str(),
           closed(1, 1 << 20));
  in_range(cmd->add_option("--prompt-tokens", st->o.prompt_tokens, "Prompt tokens per request")
               ->capture_default_str(),
           closed(1, 1 << 20));
  in_range(cmd->add_option("--seed", st->o.seed, "Seed of the prompts and sampling seeds")
               ->capture_default_str(),
           closed(0, 4294967295.0));
  in_range(cmd->add_option("--max-retries", st->o.max_retries,
                           "Retries of a request refused with 429 (0: none)")
               ->capture_default_str(),
           closed(0, 1000));
  in_range(cmd->add_option("--max-retry-seconds", st->o.max_retry_s,
                           "No retry of a request this many seconds after its first try")
               ->capture_default_str(),
           closed(0, 3600));
  cmd->callback([st]() {
    st->url = http::server_base_url(st->url, "url");
    const http::LoadReport r = http::run_load(st->url, st->o);
    std::fputs(http::format_load(r, st->o).c_str(), stdout);
    std::fflush(stdout);
    const std::string failure = http::load_failure(r, st->o);
    if (!failure.empty()) SPILLWAY_INPUT_ERROR("load: {}", failure);
  });
}

}  // namespace spillway::cli

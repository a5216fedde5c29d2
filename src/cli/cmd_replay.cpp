// `spillway replay`: the production serving trace through host-resident serving on a
// GH200's MIG slices and its baselines, simulated (spillway/replay.hpp, Note [Replay model]).
#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "cli/commands.hpp"
#include "spillway/error.hpp"
#include "spillway/live.hpp"
#include "spillway/replay.hpp"

namespace spillway::cli {

namespace {

template <class State>
void run_live_replay(State& st) {
  int64_t skipped = 0;
  const std::vector<TraceRequest> trace =
      read_request_trace(st.trace, st.max_requests > 0 ? st.max_requests : 200, &skipped);
  if (trace.empty()) SPILLWAY_INPUT_ERROR("--trace {}: no request", st.trace);
  if (st.o.time_scale == 0)
    st.o.time_scale = std::max(1.0, (trace.back().arrival_s - trace.front().arrival_s) / 20.0);
  std::map<std::string, int> distinct;
  for (const TraceRequest& t : trace) distinct[t.model] = 1;
  say_beside_json(st.json_path,
                  fmt::format("replaying {} requests live against {} (arrivals x{:g}: {:.1f} s, "
                              "at most {:g} s)...\n",
                              trace.size(), st.live, st.o.time_scale,
                              (trace.back().arrival_s - trace.front().arrival_s) / st.o.time_scale,
                              st.lo.max_seconds));
  const server::LiveReplayReport r = server::replay_live(st.live, trace, st.o, st.lo);
  say_beside_json(st.json_path,
                  server::format_live_replay(r, static_cast<int64_t>(distinct.size())));
  if (!st.svg_path.empty()) write_output(st.svg_path, replay_svg(r.results));
  if (!st.json_path.empty()) write_output(st.json_path, server::live_replay_json(r));
}

}  // namespace

void add_replay_command(CLI::App& app) {
  struct State {
    ReplayOptions o;
    std::string trace = std::string(SPILLWAY_SOURCE_DATA_DIR) + "/traces/lora_request_trace.csv";
    std::string reloads =
        std::string(SPILLWAY_SOURCE_DATA_DIR) + "/traces/basemodel_update_latency_anon.csv";
    int64_t max_requests = 0;
    std::string json_path, svg_path;
    std::string live;
    server::LiveOptions lo;
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
      "streamed and timed at the client, bounded by --max-requests (default 200) and "
      "--max-seconds; the trace's model ids dealt over the served models; printed beside the "
      "simulator's prediction for the server's own setup (its GPU, MIG profile, rate scale, "
      "models and targets, read from URL/spillway/setup).\n"
      "  spillway serve --port 8000 &\n"
      "  spillway replay --live http://127.0.0.1:8000 --max-requests 100");
  cmd->add_option("--trace", st->trace, "The request trace CSV")->capture_default_str();
  cmd->add_option("--reloads", st->reloads, "The measured reload latencies CSV (ms)")
      ->capture_default_str();
  in_range(
      cmd->add_option("--max-requests", st->max_requests, "Replay the first N requests (0: all)")
          ->capture_default_str(),
      closed(0, 1000000));
  st->o.time_scale = 0;
  in_range(cmd->add_option("--time-scale", st->o.time_scale,
                           "Arrivals this many times faster than the trace's (it spans 23 days); "
                           "0: 1, or live, the requests' span in ~20 s")
               ->capture_default_str(),
           closed(0, 1e9));
  cmd->add_option("--live", st->live,
                  "Replay against the `spillway serve` at this URL (http://host:port)");
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
    int64_t skipped = 0;
    const std::vector<TraceRequest> trace =
        read_request_trace(st->trace, st->max_requests, &skipped);
    st->o.reload_ms = read_reload_latencies_ms(st->reloads);
    std::map<std::string, int> distinct;
    for (const TraceRequest& t : trace) distinct[t.model] = 1;
    say_beside_json(st->json_path,
                    fmt::format("replaying {} requests through 6 configurations ({} rows of the "
                                "trace have no model id and are left out)...\n",
                                trace.size(), skipped));
    const std::vector<ReplayResult> r = run_replay(trace, st->o);
    say_beside_json(st->json_path, format_replay(r, st->o, static_cast<int64_t>(distinct.size())));
    if (!st->svg_path.empty()) write_output(st->svg_path, replay_svg(r));
    if (!st->json_path.empty()) write_output(st->json_path, replay_json(r, st->o));
  });
}

}  // namespace spillway::cli

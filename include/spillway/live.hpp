// Clients of a running `spillway serve` (spillway/http_server.hpp): the trace replayed live
// (`spillway replay --live URL`) and the load test (`spillway load URL`).
//
// Note [Live replay]: the trace's requests are sent open loop at their arrival times
// divided by time_scale, each on its own connection from a pool of max_concurrency client
// threads (a request finding none free waits, and its lateness is reported), streamed, so
// that TTFT is the first event's arrival at the client and TPOT the mean gap of the events
// after it. Bounded: at most max_requests, none sent after max_seconds. The trace's model
// ids are dealt over the served models by popularity (as the simulated replay deals them
// over architectures) and the token counts are drawn by draw_token_counts with the seed,
// clipped so that a request fits the server's context; prompts are random bytes (seeded).
// Beside the measurement, the simulator's prediction for the same emulated setup
// (run_replay on the same requests): the server's GPU and MIG profile at its real rates,
// arrivals at time_scale / rate_scale, the targets times rate_scale, its models' configs at
// their checkpoints' bytes per parameter, then every time divided by rate_scale. The
// server's switches, cold starts, link and HBM bytes over the replay come from its
// /metrics, read before and after.
//
// Note [Load test]: `clients` threads each send requests back to back (closed loop) until
// `requests` have been sent, every request one of `distinct` (model, prompt, seed) triples
// sampled at temperature 0.8, so that each triple is sent several times under different
// batching; a 429 is retried after its Retry-After (counted). It checks that every request
// got exactly one complete answer (no connection error, no missing [DONE], no response id
// seen twice) and that every answer to a triple has the same tokens (Note [Served
// determinism]), and reports latency percentiles.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/replay.hpp"

namespace spillway::server {

struct ServedModelSetup {
  std::string id;
  int64_t weight_bytes = 0;
  std::string dtype;
  int vocab = 0;
  std::string config_json;
};

// GET URL/spillway/setup: what the server runs. Errors name the URL and what failed.
struct ServerSetup {
  std::string hardware, profile;
  int slices = 0;
  double rate_scale = 1.0, memory_scale = 1.0;
  int64_t host_budget_bytes = 0;
  int max_running = 0, max_context = 0, max_waiting = 0;
  double ttft_ms = 0.0, tpot_ms = 0.0, alpha = -1.0, link_gbps = 0.0;
  std::vector<ServedModelSetup> models;
};
ServerSetup fetch_setup(const std::string& url);

struct LiveRequest {
  double at_s = 0.0;  // send time from the start
  std::string model;
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  double temperature = 0.0;
  uint64_t seed = 0;
};

struct LiveOutcome {
  int status = 0;         // HTTP status; 0: no response (connection error: `error` says)
  bool sent = false;      // false: not sent (the time bound)
  bool complete = false;  // 200 with its finish event and [DONE]
  std::string error;
  std::string id;  // the response's id
  std::vector<int32_t> tokens;
  double late_ms = 0.0;  // sent this long after its time (no client thread was free)
  double ttft_ms = -1.0, tpot_ms = -1.0, e2e_ms = -1.0;
  bool switched = false, cold = false;  // the server's "spillway" extension
  int retries = 0;                      // 429s retried (load test)
};

struct LiveOptions {
  int max_concurrency = 64;
  double max_seconds = 60.0;  // no request is sent after this
  double timeout_s = 120.0;   // per request
};

// Sends every request (Note [Live replay]) and returns one outcome each, in order.
std::vector<LiveOutcome> run_live(const std::string& url, const std::vector<LiveRequest>& reqs,
                                  const LiveOptions& o);

struct LiveReplayReport {
  std::vector<ReplayResult> results;  // [0] live (measured), [1] simulator (predicted)
  ReplayOptions sim;                  // what the prediction ran with
  int64_t sent = 0, not_sent = 0, refused_429 = 0, refused_503 = 0, errors = 0;
  double max_late_ms = 0.0;
  double rate_scale = 1.0;
};
// Note [Live replay]: replays `trace` against the server at `url`.
LiveReplayReport replay_live(const std::string& url, const std::vector<TraceRequest>& trace,
                             const ReplayOptions& o, const LiveOptions& lo);
std::string format_live_replay(const LiveReplayReport& r, int64_t distinct_models);
std::string live_replay_json(const LiveReplayReport& r);

struct LoadOptions {
  int clients = 8;
  int requests = 200;
  int distinct = 50;
  int max_tokens = 8;
  int prompt_tokens = 24;
  uint64_t seed = 1;
  double timeout_s = 120.0;
};
struct LoadReport {
  int64_t requests = 0, answered = 0, retries_429 = 0;
  int64_t lost = 0;          // no complete answer
  int64_t duplicated = 0;    // a response id seen twice
  int64_t inconsistent = 0;  // an answer whose tokens differ from its triple's first
  LatencyStats latency_ms, ttft_ms;
  double seconds = 0.0;
  std::vector<std::string> problems;  // the first few, said
};
LoadReport run_load(const std::string& url, const LoadOptions& o);
std::string format_load(const LoadReport& r, const LoadOptions& o);

}  // namespace spillway::server

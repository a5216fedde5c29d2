// Clients of a running `spillway serve` (spillway/http/http_server.hpp): the trace replayed live
// (`spillway replay --live URL`) and the load test (`spillway load URL`).
//
// Note [Live replay]: the trace's requests are sent open loop at their arrival times
// divided by time_scale, each on its own connection from a pool of max_concurrency client
// threads (a request finding none free waits, and its lateness is reported), streamed.
// TTFT and the end-to-end time are measured from the request's arrival time (the time it
// was due), so a wait for a free client thread is part of them, as it would be for a user;
// TPOT is the mean gap of the events after the first. Bounded: at most max_requests, none
// sent after max_seconds. A request is not retried: a refusal (429, 503) is an SLO miss,
// and a replay where any request sent was not answered fails (live_replay_failure). The trace's
// model ids are dealt over the served models by popularity (as the simulated replay deals them over
// architectures) and the token counts are drawn by draw_token_counts with the seed, clipped so that
// a request fits the server's context; prompts are random bytes (seeded). Beside the measurement,
// the simulator's prediction for the same emulated setup (run_replay on the same requests): the
// server's GPU and MIG profile at its real rates, arrivals at time_scale / rate_scale, the targets
// times rate_scale, its models' configs at their checkpoints' bytes per parameter, then every time
// divided by rate_scale. The server's switches, cold starts, link and HBM bytes over the replay
// come from its /metrics, read before and after.
//
// Note [Load test]: `clients` threads each send requests back to back (closed loop) until
// `requests` have been sent, every request one of `distinct` (model, prompt, seed) triples
// sampled at temperature 0.8, so that each triple is sent several times under different
// batching. A 429 is retried, bounded in count (max_retries) and in time (max_retry_s from
// the first try), after 20 ms doubling up to 1 s and never longer than the server's
// Retry-After; a request that runs out gives up saying which bound it met. When `clients`
// requests in a row give up, the server is taken to refuse everything and the rest are not
// sent. It checks that every request got exactly one complete answer (no connection error,
// no missing [DONE], no response id seen twice) and that every answer to a triple has the
// same tokens (Note [Served determinism]); it says how many triples were answered more than
// once (only those are compared), and reports latency percentiles measured from each
// request's first try (its retries included).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/serve/replay.hpp"

namespace spillway::http {

// The server's root URL (http://host:port) from what a user gives: http://host[:port], then
// optionally /v1 (an OpenAI client's base_url) and slashes, which are dropped. Anything else
// is an InputError naming `flag` and the URL.
std::string server_base_url(const std::string& url, const std::string& flag = "url");

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
  // From the request's due time (its arrival in a replay, its first try in the load test):
  // late_ms and retries included.
  double ttft_ms = -1.0, tpot_ms = -1.0, e2e_ms = -1.0;
  bool switched = false, cold = false;  // the server's "spillway" extension
  int retries = 0;                      // 429s retried (load test)
  double retry_after_s = -1.0;          // the answer's Retry-After header; -1: none
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
  int64_t answered = 0;     // sent and answered completely
  std::string first_error;  // of the first request sent and not answered
  double max_late_ms = 0.0;
  double rate_scale = 1.0;
};
// Note [Live replay]: replays `trace` against the server at `url`.
LiveReplayReport replay_live(const std::string& url, const std::vector<TraceRequest>& trace,
                             const ReplayOptions& o, const LiveOptions& lo);
std::string format_live_replay(const LiveReplayReport& r, int64_t distinct_models);
std::string live_replay_json(const LiveReplayReport& r);
// Empty when every request sent was answered; else how many were not and why (a replay
// that says this has failed: its measurement covers only the answered requests).
std::string live_replay_failure(const LiveReplayReport& r);

struct LoadOptions {
  int clients = 8;
  int requests = 200;
  int distinct = 50;
  int max_tokens = 8;
  int prompt_tokens = 24;
  uint64_t seed = 1;
  double timeout_s = 120.0;
  int max_retries = 20;       // 429s retried per request
  double max_retry_s = 60.0;  // no retry this long after a request's first try
};
struct LoadReport {
  int64_t requests = 0, answered = 0, retries_429 = 0;
  int64_t lost = 0;              // no complete answer (refused, failed or not sent)
  int64_t refused_429 = 0;       // of lost: still 429 when its retries ran out
  int64_t not_sent = 0;          // of lost: not sent, the server refusing everything
  int64_t duplicated = 0;        // a response id seen twice
  int64_t inconsistent = 0;      // an answer whose tokens differ from its triple's first
  int64_t triples_compared = 0;  // triples answered more than once
  int64_t answers_compared = 0;  // answers compared with their triple's first
  int max_retries_used = 0;      // the most 429s one request retried
  LatencyStats latency_ms, ttft_ms;
  double seconds = 0.0;
  std::string stopped;                // why the rest was not sent; empty: all sent
  std::vector<std::string> problems;  // the first few, said
};
LoadReport run_load(const std::string& url, const LoadOptions& o);
std::string format_load(const LoadReport& r, const LoadOptions& o);
// Empty when every request got exactly one answer and every repeated triple the same
// tokens; else what failed, in numbers (`spillway load` exits 1 with it).
std::string load_failure(const LoadReport& r, const LoadOptions& o);

}  // namespace spillway::http

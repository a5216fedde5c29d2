// `spillway serve`'s HTTP face: the OpenAI-compatible completions endpoint over a
// ServingEngine (spillway/server.hpp), on cpp-httplib.
//
// Note [HTTP endpoints]:
//   POST /v1/completions  {"model", "prompt" (a string: its bytes are the tokens of a
//                         byte-level model; or an array of token ids), "max_tokens" (16),
//                         "temperature" (1.0; 0 is greedy), "seed" (drawn when absent),
//                         "stop" (a string or up to 4, or arrays of token ids: the output
//                         ends before one, with finish_reason "stop"), "stream" (false)}:
//                         the OpenAI completion object, or with stream
//                         server-sent events, one per token, then "data: [DONE]". Each choice
//                         also carries "token_ids" (an extension: the text of a byte-level
//                         model's random tokens need not be valid UTF-8, and is sent with
//                         U+FFFD in place of invalid bytes).
//   GET /v1/models        the served models.
//   GET /metrics          Prometheus text (spillway::server::prometheus_text).
//   GET /health           200, or 503 while draining.
// Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 naming the
// field (also for the fields this server does not implement, unless at their default: n,
// best_of, echo, logprobs, suffix, top_p, presence_penalty, frequency_penalty, logit_bias); 404 for
// an unknown model or path; 413 for a body over 1 MiB; 429 with Retry-After when max_waiting
// requests are queued; 503 while draining or when the pool cannot hold the model. A request is
// never dropped: it is answered, refused or, when its client goes away mid-stream, cancelled
// (counted).
#pragma once

#include <memory>
#include <string>

#include "spillway/server.hpp"

namespace spillway::server {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (port() tells which)
  int threads = 0;  // connection threads; 0: slices x max_running + max_waiting + 8, so
                    // that the engine's refusal (429) comes before connections queue
};

class HttpServer {
 public:
  // Binds host:port now; throws naming them when it cannot. The process ignores SIGPIPE from
  // then on (a client gone mid-response is a failed write that cancels its request).
  HttpServer(ServingEngine& engine, const HttpOptions& options);
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  // Serves until stop() (blocking).
  void run();
  // Drains: the engine takes no new request (503) and every accepted one is answered to
  // its end, every response written out; then stops. Returns the requests drained.
  int64_t shutdown();
  // Stops accepting connections and returns once run() has returned (handlers finish).
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway::server

// `spillway serve`'s HTTP face: the OpenAI-compatible completions endpoint over a
// inference::ServingEngine (spillway/inference/inference.hpp), on cpp-httplib.
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
//                         With "stream_options": {"include_usage": true} every event carries
//                         "usage": null and a last one before [DONE] has no choices and the
//                         request's usage (OpenAI's shape).
//   GET /v1/models        the served models; GET /v1/models/{id} one of them (404 if not).
//   GET /metrics          Prometheus text (spillway::inference::prometheus_text).
//   GET /health           200, or 503 while draining.
// Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 naming the
// field: a field OpenAI's API does not have (a misspelt "max_token" is refused, not ignored);
// a field this server does not implement unless at its default (n, best_of, echo, logprobs,
// suffix, top_p, presence_penalty, frequency_penalty, logit_bias); max_tokens past what the
// context holds beside the prompt (the message says the maximum). 404 for an unknown model
// or path; 405 (with Allow) for a known path asked with another method; 413 for a body over
// 1 MiB however it is framed (chunked bodies are counted as they are read); 415 for a
// Content-Encoding (a compressed body's decoded size is not bounded by its length: it is
// refused before anything decodes it); 429 with Retry-After when max_waiting requests are
// queued; 503 while draining or when the model cannot run (its reason). Every request to
// /v1/completions is counted once by outcome (Note [One count per request]). A request is
// never dropped: it is answered, refused or, when its client goes away (mid-stream, or
// before a non-streamed answer: Note [Client gone]), cancelled (counted). Pipelined requests
// on one connection are each answered, in order (Note [Connections]). The port is bound
// exclusively: a second server on a port in use is an error naming it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "spillway/inference/inference.hpp"

namespace spillway::http {

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
  HttpServer(inference::ServingEngine& engine, const HttpOptions& options);
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  // Serves until stop() (blocking).
  void run();
  // Drains: the engine takes no new request (503) and every accepted one is answered to
  // its end, every response written out; then stops. Returns the requests drained.
  int64_t shutdown();
  // Note [Bounded drain]: the same within `deadline`: what has not ended by then is cancelled
  // (its client sees the stream end with an error event, or a 503) and counted in `cut`.
  struct DrainReport {
    int64_t in_flight = 0;  // accepted and not ended when the drain began
    int64_t cut = 0;        // of those, cancelled at the deadline
  };
  DrainReport shutdown(std::chrono::milliseconds deadline);
  // Stops accepting connections and returns once run() has returned (handlers finish).
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway::http

// What the HTTP server tests share: an engine behind an HttpServer on an ephemeral loopback
// port, cpp-httplib's client, and the readers of completions and server-sent events.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "inference/served_models.hpp"
#include "spillway/http/http_server.hpp"
#include "spillway/inference/inference.hpp"

namespace spillway::http::testing {

// The engine under the front end, and its tests' served models.
using namespace spillway::inference;           // NOLINT(google-build-using-namespace)
using namespace spillway::inference::testing;  // NOLINT(google-build-using-namespace)

using nlohmann::json;

// A slow engine on one slice (7g.96gb): requests queue, a stream lasts long enough to act
// in the middle of it.
inline EngineOptions slow(int max_running, int max_waiting) {
  EngineOptions o = fast("7g.96gb");
  o.rate_scale = 1e-4;
  o.max_running = max_running;
  o.max_waiting = max_waiting;
  return o;
}

// An engine behind an HttpServer on an ephemeral loopback port, served on its own thread
// from construction (and answering: /health has replied) to stop().
class Served {
 public:
  explicit Served(const EngineOptions& o) : Served(models().files, o) {}
  Served(const std::vector<ModelFiles>& files, const EngineOptions& o)
      : engine(files, o), server(engine, HttpOptions{"127.0.0.1", 0}) {
    runner_ = std::thread([this] { server.run(); });
    // Connections wait in the backlog until run() accepts them: one answer means it does
    // (and stop() then finds it running).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    httplib::Client cli = client();
    cli.set_read_timeout(1);
    while (!cli.Get("/health")) {
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "the server on port " << server.port() << " does not answer";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ~Served() { stop(); }
  Served(const Served&) = delete;
  Served& operator=(const Served&) = delete;

  httplib::Client client() const {
    httplib::Client cli("127.0.0.1", server.port());
    cli.set_connection_timeout(5);
    cli.set_read_timeout(30);
    cli.set_write_timeout(30);
    return cli;
  }
  // Stops the server (a no-op after shutdown()) and waits for run() to return.
  void stop() {
    server.stop();
    join();
  }
  void join() {
    if (runner_.joinable()) runner_.join();
  }

  ServingEngine engine;
  HttpServer server;

 private:
  std::thread runner_;
};

inline httplib::Result post(httplib::Client& cli, const json& body) {
  return cli.Post("/v1/completions", body.dump(), "application/json");
}

inline std::vector<int32_t> token_ids(const json& choice) {
  return choice.at("token_ids").get<std::vector<int32_t>>();
}

// Server-sent events: the payload of every "data: " event, in order.
inline std::vector<std::string> sse_payloads(const std::string& body) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < body.size()) {
    const size_t end = body.find("\n\n", at);
    EXPECT_NE(end, std::string::npos) << "an unterminated event at byte " << at << ":\n" << body;
    if (end == std::string::npos) break;
    const std::string event = body.substr(at, end - at);
    EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
    out.push_back(event.substr(6));
    at = end + 2;
  }
  return out;
}

// The tokens of a stream's payloads, checking its shape on the way: one token per event with
// no finish reason, then one event with none and finish_reason "length", then [DONE].
inline std::vector<int32_t> stream_tokens(const std::vector<std::string>& payloads) {
  std::vector<int32_t> toks;
  EXPECT_GE(payloads.size(), 2u);
  if (payloads.size() < 2) return toks;
  EXPECT_EQ(payloads.back(), "[DONE]");
  for (size_t i = 0; i + 1 < payloads.size(); ++i) {
    const json ev = json::parse(payloads[i]);
    EXPECT_EQ(ev.at("object"), "text_completion");
    EXPECT_EQ(ev.at("id"), json::parse(payloads[0]).at("id"));
    const json& choice = ev.at("choices").at(0);
    const std::vector<int32_t> t = token_ids(choice);
    if (i + 2 < payloads.size()) {
      EXPECT_EQ(t.size(), 1u) << payloads[i];
      EXPECT_TRUE(choice.at("finish_reason").is_null()) << payloads[i];
    } else {
      EXPECT_TRUE(t.empty()) << payloads[i];
      EXPECT_EQ(choice.at("finish_reason"), "length") << payloads[i];
    }
    toks.insert(toks.end(), t.begin(), t.end());
  }
  return toks;
}

}  // namespace spillway::http::testing

// The HTTP face of the serving engine (spillway/http/http_server.hpp, Note [HTTP endpoints]),
// driven by cpp-httplib's client over loopback: completions equal to the engine's own,
// streamed or not; OpenAI-shaped errors naming the field; models, metrics and health;
// overload answered 429 with nothing lost; and a shutdown that drains a running stream.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <latch>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "http/http_served.hpp"
#include "inference/served_models.hpp"
#include "spillway/http/http_server.hpp"
#include "spillway/inference/inference.hpp"
#include "test_support.hpp"

namespace spillway::http {
namespace {

using namespace spillway::inference;  // NOLINT(google-build-using-namespace): the engine served

using testing::bytes;
using testing::complete;
using testing::fast;
using testing::models;
using testing::Models;
using testing::post;
using testing::Served;
using testing::slow;
using testing::sse_payloads;
using testing::stream_tokens;
using testing::token_ids;

using nlohmann::json;
using spillway::testing::TempDir;

TEST(HttpServer, GreedyCompletionIsTheEnginesOwn) {
  Served s(fast());
  httplib::Client cli = s.client();
  const std::string prompt = "an endpoint over the engine, ";
  const int n = 12;
  const json body = {
      {"model", "tiny-a"}, {"prompt", prompt}, {"max_tokens", n}, {"temperature", 0}};
  const httplib::Result res = post(cli, body);
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(res->get_header_value("Content-Type"), "application/json");
  const json out = json::parse(res->body);
  EXPECT_EQ(out.at("object"), "text_completion");
  EXPECT_EQ(out.at("model"), "tiny-a");
  EXPECT_EQ(out.at("id").get<std::string>().rfind("cmpl-", 0), 0u) << out.at("id");
  ASSERT_EQ(out.at("choices").size(), 1u);
  const json& choice = out.at("choices").at(0);
  EXPECT_EQ(choice.at("index"), 0);
  EXPECT_EQ(choice.at("finish_reason"), "length");
  const std::vector<int32_t> got = token_ids(choice);
  ASSERT_EQ(got.size(), static_cast<size_t>(n));
  EXPECT_EQ(out.at("usage").at("prompt_tokens"), prompt.size());
  EXPECT_EQ(out.at("usage").at("completion_tokens"), n);
  EXPECT_EQ(out.at("usage").at("total_tokens"), prompt.size() + n);

  // Greedy is deterministic: the engine gives the same tokens directly.
  CompletionRequest q;
  q.model = "tiny-a";
  q.prompt = bytes(prompt);
  q.max_tokens = n;
  q.temperature = 0.0;
  EXPECT_EQ(got, complete(s.engine, q));
  // The prompt as an array of token ids is the same request.
  json as_ids = body;
  as_ids["prompt"] = bytes(prompt);
  const httplib::Result again = post(cli, as_ids);
  ASSERT_TRUE(again) << httplib::to_string(again.error());
  ASSERT_EQ(again->status, 200) << again->body;
  EXPECT_EQ(token_ids(json::parse(again->body).at("choices").at(0)), got);
  // The other model (other weights) continues otherwise.
  json other = body;
  other["model"] = "tiny-b";
  const httplib::Result b = post(cli, other);
  ASSERT_TRUE(b) << httplib::to_string(b.error());
  ASSERT_EQ(b->status, 200) << b->body;
  EXPECT_NE(token_ids(json::parse(b->body).at("choices").at(0)), got);
}

TEST(HttpServer, AStreamCarriesTheSameTokensAsOneResponse) {
  Served s(fast());
  httplib::Client cli = s.client();
  const int n = 10;
  const json body = {{"model", "tiny-b"},
                     {"prompt", "sampled, then streamed: "},
                     {"max_tokens", n},
                     {"temperature", 0.8},
                     {"seed", 4242}};
  const httplib::Result whole = post(cli, body);
  ASSERT_TRUE(whole) << httplib::to_string(whole.error());
  ASSERT_EQ(whole->status, 200) << whole->body;
  const std::vector<int32_t> expected = token_ids(json::parse(whole->body).at("choices").at(0));
  ASSERT_EQ(expected.size(), static_cast<size_t>(n));
  // The seed and temperature reach the engine: its own completion of the request is this.
  CompletionRequest q;
  q.model = "tiny-b";
  q.prompt = bytes("sampled, then streamed: ");
  q.max_tokens = n;
  q.temperature = 0.8;
  q.seed = 4242;
  EXPECT_EQ(complete(s.engine, q), expected);

  json streamed = body;
  streamed["stream"] = true;
  const httplib::Result res = post(cli, streamed);
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(res->get_header_value("Content-Type").rfind("text/event-stream", 0), 0u)
      << res->get_header_value("Content-Type");
  const std::vector<std::string> payloads = sse_payloads(res->body);
  ASSERT_EQ(payloads.size(), static_cast<size_t>(n) + 2) << res->body;
  EXPECT_EQ(stream_tokens(payloads), expected);
  const json last = json::parse(payloads[payloads.size() - 2]);
  EXPECT_EQ(last.at("choices").at(0).at("finish_reason"), "length");
  EXPECT_EQ(last.at("choices").at(0).at("spillway").at("seed"), 4242);
  EXPECT_EQ(s.engine.metrics().requests.at("ok"), 3);
}

// res is the error `status` in OpenAI's shape with `param` (null when empty) and, when not
// empty, `code`.
void expect_api_error(const httplib::Result& res, int status, const std::string& param,
                      const std::string& code = "") {
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, status) << res->body;
  EXPECT_EQ(res->get_header_value("Content-Type"), "application/json");
  json out;
  ASSERT_NO_THROW(out = json::parse(res->body)) << res->body;
  ASSERT_TRUE(out.contains("error")) << res->body;
  const json& e = out.at("error");
  ASSERT_TRUE(e.is_object()) << res->body;
  for (const char* key : {"message", "type", "param", "code"})
    EXPECT_TRUE(e.contains(key)) << key << " missing: " << res->body;
  EXPECT_TRUE(e.at("message").is_string() && !e.at("message").get<std::string>().empty())
      << res->body;
  EXPECT_TRUE(e.at("type").is_string()) << res->body;
  if (param.empty()) {
    EXPECT_TRUE(e.at("param").is_null()) << res->body;
  } else {
    EXPECT_EQ(e.at("param"), param) << res->body;
  }
  if (!code.empty()) {
    EXPECT_EQ(e.at("code"), code) << res->body;
  }
}

TEST(HttpServer, BadRequestsGetOpenAIErrorsNamingTheField) {
  Served s(fast());
  httplib::Client cli = s.client();
  const json good = {{"model", "tiny-a"}, {"prompt", "x"}, {"max_tokens", 2}};
  auto with = [&](const std::string& field, const json& value) {
    json b = good;
    b[field] = value;
    return b;
  };
  {
    SCOPED_TRACE("not JSON");
    expect_api_error(cli.Post("/v1/completions", "{\"model\": \"tiny-a\", ", "application/json"),
                     400, "");
  }
  {
    SCOPED_TRACE("no model");
    json b = good;
    b.erase("model");
    expect_api_error(post(cli, b), 400, "model");
  }
  {
    SCOPED_TRACE("prompt a number");
    expect_api_error(post(cli, with("prompt", 42)), 400, "prompt");
  }
  {
    SCOPED_TRACE("prompt a list of strings");
    expect_api_error(post(cli, with("prompt", json::array({"a", "b"}))), 400, "prompt");
  }
  {
    SCOPED_TRACE("max_tokens 0");
    expect_api_error(post(cli, with("max_tokens", 0)), 400, "max_tokens");
  }
  {
    SCOPED_TRACE("temperature 5");
    expect_api_error(post(cli, with("temperature", 5)), 400, "temperature");
  }
  {
    SCOPED_TRACE("top_p 0 and top_p 'x'");
    expect_api_error(post(cli, with("top_p", 0)), 400, "top_p");
    expect_api_error(post(cli, with("top_p", "x")), 400, "top_p");
  }
  {
    SCOPED_TRACE("n 2");
    expect_api_error(post(cli, with("n", 2)), 400, "n");
  }
  {
    SCOPED_TRACE("stop [\"\"] and stop 5");
    expect_api_error(post(cli, with("stop", json::array({""}))), 400, "stop");
    expect_api_error(post(cli, with("stop", 5)), 400, "stop");
  }
  {
    SCOPED_TRACE("unknown model");
    expect_api_error(post(cli, with("model", "tiny-z")), 404, "model", "model_not_found");
  }
  {
    SCOPED_TRACE("unknown path");
    expect_api_error(cli.Get("/v2/foo"), 404, "");
  }
  {
    SCOPED_TRACE("a body over 1 MiB");
    json b = good;
    b["prompt"] = std::string((size_t{1} << 20) + 16, 'x');
    expect_api_error(post(cli, b), 413, "");
  }
  // Nothing above ran, and the unimplemented fields at their defaults are accepted.
  EXPECT_EQ(s.engine.in_flight(), 0);
  EXPECT_EQ(s.engine.metrics().requests.at("ok"), 0);
  EXPECT_EQ(s.engine.metrics().requests.at("unknown_model"), 1);
  json defaults = good;
  defaults.update({{"n", 1},
                   {"stop", json::array()},
                   {"echo", false},
                   {"top_p", 1.0},
                   {"presence_penalty", 0},
                   {"logit_bias", json::object()},
                   {"suffix", nullptr}});
  const httplib::Result ok = post(cli, defaults);
  ASSERT_TRUE(ok) << httplib::to_string(ok.error());
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(s.engine.metrics().requests.at("ok"), 1);
}

// Note [Logprobs]: OpenAI's completions logprobs (tokens, token_logprobs, top_logprobs by
// text, text_offset) plus the top entries by id; the same in a stream, token by token; a
// logprobs outside [0, 20] or not an integer is a 400 naming it.
TEST(HttpServer, LogprobsInOpenAIsShapeStreamedOrNot) {
  Served s(fast());
  httplib::Client cli = s.client();
  const json body = {{"model", "tiny-a"},
                     {"prompt", "log probs "},
                     {"max_tokens", 6},
                     {"temperature", 0},
                     {"logprobs", 3}};
  const httplib::Result whole = post(cli, body);
  ASSERT_TRUE(whole) << httplib::to_string(whole.error());
  ASSERT_EQ(whole->status, 200) << whole->body;
  const json choice = json::parse(whole->body).at("choices").at(0);
  const std::vector<int32_t> tokens = token_ids(choice);
  const json& lp = choice.at("logprobs");
  ASSERT_EQ(lp.at("tokens").size(), tokens.size());
  for (size_t t = 0; t < tokens.size(); ++t) {
    // A byte token is its character; one that is not whole UTF-8 alone (a byte >= 0x80)
    // is written as U+FFFD, as JSON has no way to say a lone byte.
    EXPECT_EQ(lp.at("tokens")[t], tokens[t] < 0x80 ? std::string(1, static_cast<char>(tokens[t]))
                                                   : std::string("\xEF\xBF\xBD"));
    EXPECT_EQ(lp.at("text_offset")[t], t);
    ASSERT_EQ(lp.at("top_logprob_ids")[t].size(), 3u);
    EXPECT_EQ(lp.at("top_logprob_ids")[t][0][0], tokens[t]);  // greedy: the most likely
    EXPECT_EQ(lp.at("top_logprob_ids")[t][0][1], lp.at("token_logprobs")[t]);
    EXPECT_LE(lp.at("top_logprobs")[t].size(), 3u);
  }
  json streamed = body;
  streamed["stream"] = true;
  const httplib::Result res = post(cli, streamed);
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  const std::vector<std::string> payloads = sse_payloads(res->body);
  ASSERT_EQ(payloads.size(), tokens.size() + 2) << res->body;
  for (size_t t = 0; t < tokens.size(); ++t) {
    const json one = json::parse(payloads[t]).at("choices").at(0).at("logprobs");
    EXPECT_EQ(one.at("token_logprobs")[0], lp.at("token_logprobs")[t]) << t;
    EXPECT_EQ(one.at("top_logprob_ids")[0], lp.at("top_logprob_ids")[t]) << t;
    EXPECT_EQ(one.at("text_offset")[0], t);
  }
  EXPECT_TRUE(json::parse(payloads[tokens.size()]).at("choices").at(0).at("logprobs").is_null());
  for (const json& bad : {json(21), json(-1), json("3"), json(1.5)}) {
    json b = body;
    b["logprobs"] = bad;
    expect_api_error(post(cli, b), 400, "logprobs");
  }
}

TEST(HttpServer, AStopStringEndsTheTextBeforeIt) {
  Served s(fast("7g.96gb", 0.0));
  httplib::Client cli = s.client();
  cli.set_read_timeout(60);
  const json base = {
      {"model", "tiny-a"}, {"prompt", "stop here"}, {"max_tokens", 16}, {"temperature", 0}};
  const httplib::Result full = post(cli, base);
  ASSERT_TRUE(full && full->status == 200);
  const std::vector<int32_t> all = token_ids(json::parse(full->body)["choices"][0]);
  ASSERT_EQ(all.size(), 16u);
  // Tokens 5 and 6 as a stop sequence (token ids: random bytes are not a UTF-8 string),
  // beside a string that never comes: the output ends before their first occurrence.
  size_t at = 0;
  while (!(all[at] == all[5] && all[at + 1] == all[6])) ++at;
  json b = base;
  b["stop"] = json::array({"never seen", json::array({all[5], all[6]})});
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "stream" : "one response");
    b["stream"] = stream;
    const httplib::Result r = post(cli, b);
    ASSERT_TRUE(r && r->status == 200);
    std::vector<int32_t> got;
    std::string reason;
    if (!stream) {
      const json c = json::parse(r->body)["choices"][0];
      got = token_ids(c);
      reason = c["finish_reason"];
    } else {
      for (const std::string& ev : sse_payloads(r->body)) {
        if (ev == "[DONE]") continue;
        const json c = json::parse(ev)["choices"][0];
        for (int32_t t : token_ids(c)) got.push_back(t);
        if (!c["finish_reason"].is_null()) reason = c["finish_reason"];
      }
    }
    EXPECT_EQ(got, std::vector<int32_t>(all.begin(), all.begin() + static_cast<long>(at)));
    EXPECT_EQ(reason, "stop");
  }
}

TEST(HttpServer, ModelsMetricsAndHealth) {
  Served s(fast());
  httplib::Client cli = s.client();
  const httplib::Result models_res = cli.Get("/v1/models");
  ASSERT_TRUE(models_res) << httplib::to_string(models_res.error());
  ASSERT_EQ(models_res->status, 200) << models_res->body;
  const json list = json::parse(models_res->body);
  EXPECT_EQ(list.at("object"), "list");
  std::vector<std::string> ids;
  for (const json& m : list.at("data")) {
    EXPECT_EQ(m.at("object"), "model") << m;
    EXPECT_EQ(m.at("family"), "qwen3_moe") << m;  // the config's model_type
    EXPECT_EQ(m.at("dtype"), "fp32") << m;
    ids.push_back(m.at("id").get<std::string>());
  }
  EXPECT_EQ(ids, (std::vector<std::string>{"tiny-a", "tiny-b"}));

  auto metrics = [&] {
    const httplib::Result r = cli.Get("/metrics");
    EXPECT_TRUE(r) << httplib::to_string(r.error());
    if (!r) return std::string();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->get_header_value("Content-Type").rfind("text/plain", 0), 0u);
    return r->body;
  };
  const std::string before = metrics();
  EXPECT_NE(before.find("spillway_requests_total{outcome=\"ok\"} 0"), std::string::npos) << before;
  const httplib::Result done = post(cli, {{"model", "tiny-b"}, {"prompt", "m"}, {"max_tokens", 3}});
  ASSERT_TRUE(done) << httplib::to_string(done.error());
  ASSERT_EQ(done->status, 200) << done->body;
  const std::string after = metrics();
  for (const char* needle :
       {"spillway_requests_total{outcome=\"ok\"} 1", "# TYPE spillway_ttft_seconds histogram",
        "spillway_ttft_seconds_count 1"})
    EXPECT_NE(after.find(needle), std::string::npos) << needle << "\n" << after;

  const httplib::Result health = cli.Get("/health");
  ASSERT_TRUE(health) << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(health->body, "ok\n");
}

TEST(HttpServer, OverloadIsAnswered429AndNothingIsLost) {
  Served s(slow(/*max_running=*/1, /*max_waiting=*/1));
  ASSERT_EQ(s.engine.slices(), 1);
  const int clients = 12, n = 4;
  struct Answer {
    bool answered = false;
    std::string error;
    int status = 0;
    std::string retry_after;
    json body;
  };
  std::vector<Answer> answers(clients);
  std::latch start(clients);
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] {
      httplib::Client cli = s.client();
      const json body = {{"model", i % 2 ? "tiny-a" : "tiny-b"},
                         {"prompt", "crowd " + std::to_string(i)},
                         {"max_tokens", n},
                         {"temperature", 0}};
      start.arrive_and_wait();
      const httplib::Result r = post(cli, body);
      Answer& a = answers[static_cast<size_t>(i)];
      if (!r) {
        a.error = httplib::to_string(r.error());
        return;
      }
      a.answered = true;
      a.status = r->status;
      a.retry_after = r->get_header_value("Retry-After");
      a.body = json::parse(r->body, nullptr, false);
    });
  }
  for (std::thread& t : threads) t.join();
  int ok = 0, overloaded = 0;
  for (int i = 0; i < clients; ++i) {
    SCOPED_TRACE(::testing::Message() << "client " << i);
    const Answer& a = answers[static_cast<size_t>(i)];
    ASSERT_TRUE(a.answered) << a.error;
    if (a.status == 200) {
      ++ok;
      EXPECT_EQ(token_ids(a.body.at("choices").at(0)).size(), static_cast<size_t>(n)) << a.body;
    } else {
      ++overloaded;
      EXPECT_EQ(a.status, 429) << a.body;
      EXPECT_EQ(a.retry_after, "1");
      ASSERT_TRUE(a.body.contains("error")) << a.body;
      EXPECT_EQ(a.body.at("error").at("code"), "overloaded") << a.body;
    }
  }
  EXPECT_EQ(ok + overloaded, clients);
  EXPECT_GE(ok, 1);
  EXPECT_GE(overloaded, 1);
  const EngineMetrics m = s.engine.metrics();
  EXPECT_EQ(m.requests.at("ok"), ok);
  EXPECT_EQ(m.requests.at("overloaded"), overloaded);
  EXPECT_EQ(s.engine.in_flight(), 0);
}

TEST(HttpServer, ShutdownDrainsARunningStream) {
  Served s(slow(/*max_running=*/4, /*max_waiting=*/64));
  const int n = 40;
  const json body = {{"model", "tiny-a"},
                     {"prompt", "drain me: "},
                     {"max_tokens", n},
                     {"temperature", 0},
                     {"stream", true}};
  std::string received;
  int events = 0, events_while_draining = 0;
  std::atomic<int64_t> drained{-1};
  std::thread closer, prober;
  // What the prober saw of the server while it drained.
  std::atomic<int> late_status{0}, health_status{0};
  std::string late_body;

  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    received.append(data, len);
    // Events complete so far; the first starts the shutdown.
    int complete = 0;
    for (size_t at = received.find("\n\n"); at != std::string::npos;
         at = received.find("\n\n", at + 2))
      ++complete;
    if (complete > events && s.engine.draining()) events_while_draining += complete - events;
    events = complete;
    if (events >= 1 && !closer.joinable()) {
      closer = std::thread([&] { drained = s.server.shutdown(); });
      prober = std::thread([&] {
        while (!s.engine.draining()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        httplib::Client cli = s.client();
        const httplib::Result late = post(cli, {{"model", "tiny-a"}, {"prompt", "late"}});
        if (late) {
          late_status = late->status;
          late_body = late->body;
        }
        const httplib::Result health = cli.Get("/health");
        if (health) health_status = health->status;
      });
    }
    return true;
  };
  httplib::Client cli = s.client();
  const httplib::Result res = cli.send(req);
  if (closer.joinable()) {
    closer.join();
    prober.join();
    s.join();  // shutdown() stopped the server: run() has returned
  } else {
    s.stop();  // no event came: the failures below say so
  }

  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  const std::vector<std::string> payloads = sse_payloads(received);
  ASSERT_EQ(payloads.size(), static_cast<size_t>(n) + 2) << received;
  EXPECT_EQ(stream_tokens(payloads).size(), static_cast<size_t>(n));
  EXPECT_GT(events_while_draining, 0) << "the shutdown began after the stream ended";
  EXPECT_EQ(drained, 1);
  // While it drained: new requests refused (503), the health check failing.
  EXPECT_EQ(late_status, 503) << late_body;
  EXPECT_NE(late_body.find("\"draining\""), std::string::npos) << late_body;
  EXPECT_EQ(health_status, 503);
  // Afterwards: nothing listens (or, at most, a refusal).
  httplib::Client after = s.client();
  after.set_connection_timeout(2);
  const httplib::Result gone = post(after, {{"model", "tiny-a"}, {"prompt", "gone"}});
  if (gone) {
    EXPECT_EQ(gone->status, 503) << gone->body;
  }
  EXPECT_EQ(s.engine.in_flight(), 0);
  EXPECT_EQ(s.engine.metrics().requests.at("ok"), 1);
}

}  // namespace
}  // namespace spillway::http

namespace spillway::http {
namespace {

TEST(HttpServer, StopsWhenStoppedAtOnceAfterStarting) {
  // httplib's own stop() does nothing until its loop runs: stop() right after run() starts
  // (a signal at startup) must still end run(). A hang here is the bug.
  ServingEngine engine(models().files, fast());
  for (int i = 0; i < 50; ++i) {
    HttpServer http(engine, HttpOptions{"127.0.0.1", 0});
    std::thread t([&] { http.run(); });
    if (i % 2 == 1) std::this_thread::yield();
    http.stop();
    t.join();
  }
  HttpServer never_run(engine, HttpOptions{"127.0.0.1", 0});
  never_run.stop();  // returns: run() was never called
}

}  // namespace
}  // namespace spillway::http

// The HTTP server against what hostile and careless clients did (issue: `spillway serve` in
// the open): a second server on a taken port, compressed and chunked bodies past the limit,
// pipelined requests, unknown fields, every refusal counted, a client gone before a
// non-streamed answer, a bounded drain; and what the OpenAI client expects (models.retrieve,
// 405, stream_options.include_usage, null TPOT with one token). Raw sockets where the
// library client would hide what is on the wire.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "http/http_served.hpp"
#include "inference/served_models.hpp"
#include "spillway/core/error.hpp"
#include "spillway/http/http_server.hpp"
#include "spillway/inference/inference.hpp"

namespace spillway::http {
namespace {

using namespace spillway::inference;  // NOLINT(google-build-using-namespace): the engine served

using testing::fast;
using testing::post;
using testing::Served;
using testing::slow;
using testing::sse_payloads;
using testing::token_ids;

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// A loopback TCP connection that sends and reads raw bytes.
class Raw {
 public:
  explicit Raw(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~Raw() { close(); }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;

  bool connected() const { return connected_; }
  // Sends everything (false when the peer stopped taking it).
  bool send(const std::string& bytes) {
    size_t at = 0;
    while (at < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
      if (n <= 0) return false;
      at += static_cast<size_t>(n);
    }
    return true;
  }
  // Reads until `done(received)` or the peer closes or `timeout` passes.
  template <class Done>
  std::string read_until(Done done, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    std::string got;
    const auto until = Clock::now() + timeout;
    char buf[4096];
    while (!done(got) && Clock::now() < until) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) break;
      got.append(buf, static_cast<size_t>(n));
    }
    return got;
  }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

std::string http_post(const std::string& body, const std::string& extra_headers = "") {
  return "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
         extra_headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

size_t count_of(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t at = s.find(needle); at != std::string::npos; at = s.find(needle, at + 1)) ++n;
  return n;
}

int64_t counter(const ServingEngine& e, const std::string& outcome) {
  return e.metrics().requests.at(outcome);
}

TEST(HttpHostile, ASecondServerCannotListenOnATakenPort) {
  Served s(fast());
  try {
    HttpServer second(s.engine, HttpOptions{"127.0.0.1", s.server.port()});
    FAIL() << "a second server listens on port " << s.server.port();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(std::to_string(s.server.port())), std::string::npos) << what;
    EXPECT_NE(what.find("in use"), std::string::npos) << what;
  }
}

TEST(HttpHostile, ACompressedBodyIsRefusedUnread) {
  Served s(fast());
  const int64_t invalid = counter(s.engine, "invalid");
  httplib::Client cli = s.client();
  httplib::Headers h = {{"Content-Encoding", "gzip"}};
  // Not even valid gzip: the body is refused before anything decodes it.
  const httplib::Result r =
      cli.Post("/v1/completions", h, std::string(4096, 'x'), "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 415) << r->body;
  EXPECT_NE(r->body.find("gzip"), std::string::npos) << r->body;
  EXPECT_EQ(counter(s.engine, "invalid"), invalid + 1);
}

TEST(HttpHostile, AChunkedBodyPastTheLimitIs413) {
  Served s(fast());
  Raw c(s.server.port());
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(
      c.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             "Transfer-Encoding: chunked\r\n\r\n"));
  // 2 MiB of a valid JSON document in 64 KiB chunks; the server may stop reading early.
  const std::string head = R"({"model": "tiny-a", "max_tokens": 1, "prompt": ")";
  auto chunk = [](const std::string& data) {
    char size[32];
    std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
    return std::string(size) + data + "\r\n";
  };
  bool sending = c.send(chunk(head));
  for (int i = 0; i < 32 && sending; ++i) sending = c.send(chunk(std::string(65536, 'a')));
  if (sending) sending = c.send(chunk("\"}") + "0\r\n\r\n");
  const std::string got = c.read_until([](const std::string& g) {
    return g.find("\r\n\r\n") != std::string::npos && g.find("}}") != std::string::npos;
  });
  EXPECT_EQ(got.rfind("HTTP/1.1 413", 0), 0u) << got.substr(0, 400);
  EXPECT_NE(got.find("too_large"), std::string::npos) << got.substr(0, 400);
}

TEST(HttpHostile, PipelinedRequestsAreEachAnswered) {
  Served s(fast());
  Raw c(s.server.port());
  ASSERT_TRUE(c.connected());
  std::string three;
  for (int i = 0; i < 3; ++i)
    three += http_post(json{
        {"model", "tiny-a"},
        {"prompt", "pipelined " + std::to_string(i)},
        {"max_tokens", 2},
        {"temperature", 0}}.dump());
  ASSERT_TRUE(c.send(three));  // one write: the three arrive together
  const std::string got =
      c.read_until([](const std::string& g) { return count_of(g, "\"text_completion\"") == 3; });
  EXPECT_EQ(count_of(got, "HTTP/1.1 200"), 3u) << got;
  EXPECT_EQ(count_of(got, "\"text_completion\""), 3u) << got;
}

TEST(HttpHostile, UnknownFieldsAreRefusedByName) {
  Served s(fast());
  httplib::Client cli = s.client();
  const httplib::Result r =
      post(cli, {{"model", "tiny-a"}, {"prompt", "x"}, {"max_token", 4}, {"temprature", 0}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 400) << r->body;
  const json e = json::parse(r->body).at("error");
  EXPECT_EQ(e.at("param"), "max_token") << e;
  EXPECT_NE(e.at("message").get<std::string>().find("'temprature'"), std::string::npos) << e;
  // What the OpenAI client may send beside the fields it was given.
  const httplib::Result ok =
      post(cli, {{"model", "tiny-a"}, {"prompt", "x"}, {"max_tokens", 1}, {"user", "me"}});
  ASSERT_TRUE(ok) << httplib::to_string(ok.error());
  EXPECT_EQ(ok->status, 200) << ok->body;
}

TEST(HttpHostile, EveryRefusalIsCounted) {
  Served s(fast());
  httplib::Client cli = s.client();
  const int64_t invalid = counter(s.engine, "invalid");
  const std::vector<std::string> bodies = {
      "{not json",
      json{{"model", "tiny-a"}, {"prompt", "x"}, {"max_tokens", -1}}.dump(),
      json{{"model", "tiny-a"}, {"prompt", "x"}, {"n", 2}}.dump(),
      json{{"model", "tiny-a"}, {"prompt", "x"}, {"temperature", 3}}.dump(),
      json{{"model", "tiny-a"}, {"prompt", ""}}.dump(),  // the engine's own refusal
  };
  for (const std::string& b : bodies) {
    const httplib::Result r = cli.Post("/v1/completions", b, "application/json");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 400) << b << " -> " << r->body;
  }
  EXPECT_EQ(counter(s.engine, "invalid"), invalid + static_cast<int64_t>(bodies.size()));
  const httplib::Result m = cli.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("spillway_requests_total{outcome=\"invalid\"} " +
                         std::to_string(invalid + static_cast<int64_t>(bodies.size()))),
            std::string::npos)
      << m->body;
}

TEST(HttpHostile, MaxTokensPastTheContextSaysTheMaximum) {
  Served s(fast());  // max_context 96
  httplib::Client cli = s.client();
  const httplib::Result r =
      post(cli, {{"model", "tiny-a"}, {"prompt", "abcd"}, {"max_tokens", 5000000}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 400) << r->body;
  const json e = json::parse(r->body).at("error");
  EXPECT_EQ(e.at("param"), "max_tokens");
  EXPECT_NE(e.at("message").get<std::string>().find("maximum for this prompt is 92"),
            std::string::npos)
      << e;
}

TEST(HttpHostile, ANonStreamedRequestWhoseClientLeftIsCancelled) {
  Served s(slow(/*max_running=*/2, /*max_waiting=*/8));
  {
    Raw c(s.server.port());
    ASSERT_TRUE(c.connected());
    ASSERT_TRUE(c.send(http_post(
        json{{"model", "tiny-a"}, {"prompt", "gone"}, {"max_tokens", 80}, {"temperature", 0}}
            .dump())));
    // Until it runs on the slice: then the client leaves without its answer.
    const auto until = Clock::now() + std::chrono::seconds(10);
    while (s.engine.metrics().tokens_generated == 0 && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (s.engine.in_flight() > 0 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(s.engine.in_flight(), 0);
  EXPECT_EQ(counter(s.engine, "cancelled"), 1);
  EXPECT_EQ(counter(s.engine, "ok"), 0);
  EXPECT_LT(s.engine.metrics().tokens_generated, 80);
}

TEST(HttpHostile, ModelsRetrieveAndWrongMethods) {
  Served s(fast());
  httplib::Client cli = s.client();
  const httplib::Result one = cli.Get("/v1/models/tiny-b");
  ASSERT_TRUE(one) << httplib::to_string(one.error());
  ASSERT_EQ(one->status, 200) << one->body;
  EXPECT_EQ(json::parse(one->body).at("id"), "tiny-b");
  EXPECT_EQ(json::parse(one->body).at("object"), "model");
  const httplib::Result none = cli.Get("/v1/models/nope");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 404);
  EXPECT_EQ(json::parse(none->body).at("error").at("code"), "model_not_found");
  const httplib::Result get = cli.Get("/v1/completions");
  ASSERT_TRUE(get);
  EXPECT_EQ(get->status, 405) << get->body;
  EXPECT_EQ(get->get_header_value("Allow"), "POST");
  const httplib::Result del = cli.Delete("/v1/models/tiny-a");
  ASSERT_TRUE(del);
  EXPECT_EQ(del->status, 405) << del->body;
  const httplib::Result elsewhere = cli.Get("/v2/nothing");
  ASSERT_TRUE(elsewhere);
  EXPECT_EQ(elsewhere->status, 404);
}

TEST(HttpHostile, StreamOptionsIncludeUsageEndsWithAUsageChunk) {
  Served s(fast());
  httplib::Client cli = s.client();
  const int n = 5;
  const httplib::Result r = post(cli, {{"model", "tiny-a"},
                                       {"prompt", "usage"},
                                       {"max_tokens", n},
                                       {"stream", true},
                                       {"stream_options", {{"include_usage", true}}}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 200) << r->body;
  const std::vector<std::string> p = sse_payloads(r->body);
  ASSERT_GE(p.size(), 3u);
  EXPECT_EQ(p.back(), "[DONE]");
  const json last = json::parse(p[p.size() - 2]);
  EXPECT_TRUE(last.at("choices").empty()) << last;
  EXPECT_EQ(last.at("usage").at("completion_tokens"), n) << last;
  EXPECT_EQ(last.at("usage").at("prompt_tokens"), 5) << last;
  EXPECT_EQ(last.at("usage").at("total_tokens"), 5 + n) << last;
  for (size_t i = 0; i + 2 < p.size(); ++i)
    EXPECT_TRUE(json::parse(p[i]).at("usage").is_null()) << p[i];
  const httplib::Result bad = post(
      cli, {{"model", "tiny-a"}, {"prompt", "x"}, {"stream_options", {{"include_usage", true}}}});
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400) << bad->body;
  EXPECT_EQ(json::parse(bad->body).at("error").at("param"), "stream_options");
}

TEST(HttpHostile, OneTokenHasNoTpot) {
  Served s(fast());
  httplib::Client cli = s.client();
  const httplib::Result r = post(cli, {{"model", "tiny-a"}, {"prompt", "x"}, {"max_tokens", 1}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 200) << r->body;
  const json ext = json::parse(r->body).at("spillway");
  EXPECT_TRUE(ext.at("tpot_ms").is_null()) << ext;
  EXPECT_TRUE(ext.at("ttft_ms").is_number()) << ext;
}

TEST(HttpHostile, ADrainPastItsDeadlineCutsWhatRemains) {
  Served s(slow(/*max_running=*/2, /*max_waiting=*/8));
  std::string received;
  std::thread client([&] {
    httplib::Client cli = s.client();
    const json body = {{"model", "tiny-a"},
                       {"prompt", "never done"},
                       {"max_tokens", 80},
                       {"temperature", 0},
                       {"stream", true}};
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = body.dump();
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      received.append(data, n);
      return true;
    };
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    cli.send(req, res, err);
  });
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (s.engine.metrics().tokens_generated == 0 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const auto t0 = Clock::now();
  const HttpServer::DrainReport r = s.server.shutdown(std::chrono::milliseconds(100));
  const double took_s = std::chrono::duration<double>(Clock::now() - t0).count();
  client.join();
  s.join();
  EXPECT_EQ(r.in_flight, 1);
  EXPECT_EQ(r.cut, 1);
  EXPECT_LT(took_s, 10.0);
  EXPECT_EQ(counter(s.engine, "cancelled"), 1);
  // The client saw its stream end: an error event naming the deadline, then [DONE].
  const std::vector<std::string> p = sse_payloads(received);
  ASSERT_GE(p.size(), 2u) << received;
  EXPECT_EQ(p.back(), "[DONE]");
  EXPECT_NE(p[p.size() - 2].find("deadline"), std::string::npos) << p[p.size() - 2];
}

}  // namespace
}  // namespace spillway::http

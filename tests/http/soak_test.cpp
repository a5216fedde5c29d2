// The server under a bounded mixed load on loopback (issue: `spillway serve` in the open):
// good requests streamed and not, malformed ones, clients that leave mid-answer, and one
// model's checkpoint rewritten on disk while it is served. Checks: the server stays up and
// answers to the end; every request that was accepted (200) got exactly one complete answer
// (its finish reason and tokens, a stream's [DONE]); every other request an OpenAI-shaped
// error; the engine counted each request once (its outcomes sum to what was sent and
// answered); nothing is left in flight; and the resident memory stayed flat over the second
// half of the run. SPILLWAY_SOAK_SECONDS sets its length (default 20).
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "http/http_served.hpp"
#include "inference/served_models.hpp"
#include "spillway/inference/inference.hpp"
#include "test_support.hpp"

namespace spillway::http {
namespace {

using namespace spillway::inference;  // NOLINT(google-build-using-namespace): the engine served

using nlohmann::json;
using testing::fast;
using testing::Served;
using testing::sse_payloads;
using Clock = std::chrono::steady_clock;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

double soak_seconds() {
  const char* env = std::getenv("SPILLWAY_SOAK_SECONDS");
  const double s = env != nullptr ? std::atof(env) : 20.0;
  return s > 0 ? s : 20.0;
}

// The process's resident set, bytes.
int64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

struct Tally {
  std::mutex mu;
  int64_t sent = 0;      // requests whose bytes all went out and that got a status line
  int64_t accepted = 0;  // 200
  int64_t complete = 0;  // 200 with exactly one complete answer
  int64_t refused = 0;   // an OpenAI-shaped error
  int64_t left = 0;      // the client left on purpose
  std::vector<std::string> faults;
  void fault(std::string what) {
    std::lock_guard lk(mu);
    if (faults.size() < 20) faults.push_back(std::move(what));
  }
};

bool is_error_body(const std::string& body) {
  const json e = json::parse(body, nullptr, false);
  return e.is_object() && e.contains("error") && e["error"].contains("message");
}

// One good request, streamed or not; checks its one complete answer.
void good_request(httplib::Client& cli, const std::string& model, int i, bool stream, Tally& t) {
  const int n = 1 + i % 12;
  const json body = {{"model", model},  {"prompt", "soak " + std::to_string(i)},
                     {"max_tokens", n}, {"temperature", i % 3 == 0 ? 0.0 : 0.7},
                     {"seed", i},       {"stream", stream}};
  const httplib::Result r = cli.Post("/v1/completions", body.dump(), "application/json");
  if (!r) {
    t.fault("request " + std::to_string(i) + ": no answer: " + httplib::to_string(r.error()));
    return;
  }
  std::lock_guard lk(t.mu);
  ++t.sent;
  if (r->status != 200) {
    if (is_error_body(r->body)) {
      ++t.refused;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a refused client backs off
    } else
      t.faults.push_back(fmt::format("request {}: HTTP {} without an error: {}", i, r->status,
                                     r->body.substr(0, 200)));
    return;
  }
  ++t.accepted;
  if (!stream) {
    const json j = json::parse(r->body, nullptr, false);
    const bool whole = j.is_object() && j.contains("choices") &&
                       j["choices"][0]["token_ids"].size() == static_cast<size_t>(n) &&
                       j["choices"][0]["finish_reason"] == "length";
    if (whole)
      ++t.complete;
    else
      t.faults.push_back(fmt::format("request {}: incomplete: {}", i, r->body.substr(0, 200)));
    return;
  }
  // A stream: n token events, one finish event, [DONE]; or an error event then [DONE] (a
  // request of the rewritten model may fail after its 200).
  std::vector<std::string> p;
  size_t at = 0;
  while (at < r->body.size()) {
    const size_t end = r->body.find("\n\n", at);
    if (end == std::string::npos) break;
    p.push_back(r->body.substr(at + 6, end - at - 6));
    at = end + 2;
  }
  const bool done = !p.empty() && p.back() == "[DONE]" && at == r->body.size();
  const bool errored = p.size() >= 2 && is_error_body(p[p.size() - 2]);
  if (done && (errored || p.size() == static_cast<size_t>(n) + 2))
    ++t.complete;
  else
    t.faults.push_back(fmt::format("stream {}: {} events, done {}: {}", i, p.size(), done,
                                   r->body.substr(0, 200)));
}

TEST(Soak, MixedLoadWithACheckpointRewrittenUnderIt) {
  spillway::testing::TempDir dir;
  write_checkpoint("tiny-moe", 1, (dir.path() / "a").string(), DType::kFp32);
  write_checkpoint("tiny-moe", 2, (dir.path() / "b").string(), DType::kFp32);
  write_checkpoint("tiny-moe", 3, (dir.path() / "c").string(), DType::kFp32);
  // The rewrites: c's checkpoint in bf16 (another size) and back, renamed over it.
  write_checkpoint("tiny-moe", 4, (dir.path() / "spare-bf16").string(), DType::kBf16);
  write_checkpoint("tiny-moe", 3, (dir.path() / "spare-fp32").string(), DType::kFp32);
  const std::vector<ModelFiles> files = find_models(dir.path().string());
  std::vector<ModelFiles> served;
  for (const ModelFiles& f : files)
    if (f.name.rfind("spare", 0) != 0) served.push_back(f);
  ASSERT_EQ(served.size(), 3u);

  // One slice: it runs one model at a time and switches between the three.
  EngineOptions o = fast("7g.96gb");
  o.max_waiting = 16;
  // Room for two models of three: c is evicted and read again from disk now and then.
  const int64_t model_bytes =
      static_cast<int64_t>(std::filesystem::file_size(served[0].weights_path));
  o.host_budget_bytes = model_bytes * 5 / 2;
  Served s(served, o);

  const double seconds = soak_seconds();
  const auto start = Clock::now();
  const auto stop_at = start + std::chrono::duration<double>(seconds);
  std::atomic<bool> stop{false};
  Tally t;
  std::atomic<int64_t> malformed{0}, left{0};
  std::vector<std::thread> threads;
  // Good clients: streamed and not, over the three models.
  for (int c = 0; c < 6; ++c)
    threads.emplace_back([&, c] {
      httplib::Client cli = s.client();
      for (int i = c; !stop; i += 6)
        good_request(cli, served[static_cast<size_t>(i % 3)].name, i, c % 2 == 0, t);
    });
  // Malformed: bad JSON, unknown fields, wrong types, a compressed body, a wrong method.
  threads.emplace_back([&] {
    httplib::Client cli = s.client();
    const std::vector<std::string> bodies = {"{",
                                             "[]",
                                             R"({"model":"a","prompt":"x","max_token":4})",
                                             R"({"model":"a","prompt":7})",
                                             R"({"model":"a","prompt":"x","max_tokens":-1})",
                                             R"({"model":"nope","prompt":"x"})"};
    for (size_t i = 0; !stop; ++i) {
      const httplib::Result r =
          i % 7 == 6 ? cli.Post("/v1/completions", httplib::Headers{{"Content-Encoding", "gzip"}},
                                "xx", "application/json")
                     : cli.Post("/v1/completions", bodies[i % bodies.size()], "application/json");
      if (!r) {
        t.fault("malformed " + std::to_string(i) + ": no answer: " + httplib::to_string(r.error()));
        continue;
      }
      if (r->status < 400 || r->status >= 500 || !is_error_body(r->body))
        t.fault(fmt::format("malformed {}: HTTP {}: {}", i, r->status, r->body.substr(0, 200)));
      ++malformed;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  // Clients that leave: a request sent, then the connection closed before its answer.
  threads.emplace_back([&] {
    for (int i = 0; !stop; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(s.server.port()));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
        const std::string body = json{
            {"model", "a"},
            {"prompt", "leaving " + std::to_string(i)},
            {"max_tokens", 40},
            {"stream", i % 2 == 0}}.dump();
        const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                                std::to_string(body.size()) + "\r\n\r\n" + body;
        (void)::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
        std::this_thread::sleep_for(std::chrono::milliseconds(20 + 10 * (i % 5)));
        ++left;
      }
      ::close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
    }
  });
  // The rewrite: c's checkpoint replaced on disk (renamed over: never half-written).
  threads.emplace_back([&] {
    const std::filesystem::path target = dir.path() / "c" / "model.safetensors";
    for (int i = 0; !stop; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(700));
      const std::filesystem::path from =
          dir.path() / (i % 2 == 0 ? "spare-bf16" : "spare-fp32") / "model.safetensors";
      const std::filesystem::path tmp = dir.path() / "c" / "model.safetensors.new";
      std::filesystem::copy_file(from, tmp, std::filesystem::copy_options::overwrite_existing);
      std::filesystem::rename(tmp, target);
    }
  });
  int64_t rss_mid = 0;
  while (Clock::now() < stop_at) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (rss_mid == 0 && Clock::now() - start > std::chrono::duration<double>(seconds / 2))
      rss_mid = rss_bytes();
  }
  stop = true;
  for (std::thread& th : threads) th.join();
  const int64_t rss_end = rss_bytes();

  // The server is up and answers.
  httplib::Client cli = s.client();
  const httplib::Result health = cli.Get("/health");
  ASSERT_TRUE(health) << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (s.engine.in_flight() > 0 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(s.engine.in_flight(), 0);

  for (const std::string& f : t.faults) ADD_FAILURE() << f;
  EXPECT_GT(t.accepted, 50) << "too little got through to say anything";
  EXPECT_EQ(t.complete, t.accepted);
  EXPECT_GT(malformed.load(), 10);
  // One count per request: every request the clients sent is in exactly one outcome. (The
  // leaving clients' requests are counted whatever they became; a leaving client whose bytes
  // the server never read as a whole request is not a request.)
  const EngineMetrics m = s.engine.metrics();
  int64_t counted = 0;
  for (const auto& [outcome, n] : m.requests) counted += n;
  const int64_t answered = t.sent + malformed.load();
  EXPECT_GE(counted, answered);
  EXPECT_LE(counted, answered + left.load());
  std::printf(
      "soak %.0f s: %lld good requests (%lld accepted, %lld refused), %lld malformed, "
      "%lld clients left; counted %lld; RSS %.1f MiB at half time, %.1f at the end\n",
      seconds, static_cast<long long>(t.sent), static_cast<long long>(t.accepted),
      static_cast<long long>(t.refused), static_cast<long long>(malformed.load()),
      static_cast<long long>(left.load()), static_cast<long long>(counted),
      static_cast<double>(rss_mid) / (1 << 20), static_cast<double>(rss_end) / (1 << 20));
  for (const auto& [outcome, n] : m.requests)
    std::printf("  %s %lld\n", outcome.c_str(), static_cast<long long>(n));
  // Flat: the second half adds no more than a few MiB (allocator noise, not a leak per
  // request). Not under a sanitizer: ASan keeps freed memory resident in its quarantine (256
  // MiB by default) and TSan its shadow; there LeakSanitizer checks leaks instead.
  if (!kSanitized) {
    EXPECT_LT(rss_end - rss_mid, int64_t{24} << 20);
  }
}

}  // namespace
}  // namespace spillway::http

// The clients of a running server, `spillway load URL` and `spillway replay --live URL`,
// against a stand-in server on loopback (cpp-httplib) whose answers the test chooses: one
// that refuses every completion with 429, one that answers after a fixed delay. Retries are
// bounded in count and time and say which bound they met; a run where a request was not
// answered exits 1 saying how many and why, with no SLO figure when nothing was measured;
// TTFT includes the wait for a client thread; a base_url ending in /v1 is accepted; the
// load test says how many triples it compared; numeric flags and the default trace of an
// installed binary (spillway/http/load_clients.hpp, Note [Live replay], Note [Load test]).
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "cli/run_command.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

namespace fs = std::filesystem;
using cli_test::contains;
using nlohmann::json;
using spillway::testing::TempDir;

const std::string kBin = std::string("'") + SPILLWAY_CLI_PATH + "'";

// A stand-in for `spillway serve`: its setup (one tiny-moe model), empty metrics, and
// completions refused with 429 (Retry-After `retry_after`) or answered, streamed, after
// `delay_ms`: max_tokens tokens that depend on the seed alone, then [DONE].
class FakeServer {
 public:
  enum class Mode { kRefuse, kAnswer };
  explicit FakeServer(Mode mode, int delay_ms = 0, const std::string& retry_after = "0") {
    std::ifstream f(std::string(SPILLWAY_DATA_DIR) + "/nn/tiny-moe.json");
    const std::string config((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const json setup = {{"schema", "spillway.serve-setup/1"},
                        {"hardware", "gh200"},
                        {"profile", "1g.12gb"},
                        {"slices", 1},
                        {"rate_scale", 1.0},
                        {"memory_scale", 1.0},
                        {"host_budget_bytes", 1000000000},
                        {"max_running", 8},
                        {"max_context", 512},
                        {"max_waiting", 64},
                        {"ttft_ms", 2000.0},
                        {"tpot_ms", 100.0},
                        {"alpha", -1.0},
                        {"link_gbps", 100.0},
                        {"models", json::array({{{"id", "tiny"},
                                                 {"weight_bytes", 1000000},
                                                 {"dtype", "fp32"},
                                                 {"vocab_size", 256},
                                                 {"config", config}}})}};
    svr_.Get("/spillway/setup", [setup](const httplib::Request&, httplib::Response& res) {
      res.set_content(setup.dump(), "application/json");
    });
    svr_.Get("/metrics", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("", "text/plain");
    });
    svr_.Post("/v1/completions", [this, mode, delay_ms, retry_after](const httplib::Request& req,
                                                                     httplib::Response& res) {
      const int n = ++completions_;
      if (mode == Mode::kRefuse) {
        res.status = 429;
        res.set_header("Retry-After", retry_after);
        res.set_content(R"({"error": {"message": "overloaded: 64 requests waiting"}})",
                        "application/json");
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      const json q = json::parse(req.body);
      const int max_tokens = q.value("max_tokens", 16);
      const uint64_t seed = q.value("seed", uint64_t{0});
      const std::string id = "cmpl-" + std::to_string(n);
      std::string body;
      for (int i = 0; i < max_tokens; ++i)
        body += "data: " +
                json{{"id", id},
                     {"choices",
                      {{{"token_ids", {static_cast<int>((seed + static_cast<uint64_t>(i)) % 256)}},
                        {"finish_reason", nullptr}}}}}
                    .dump() +
                "\n\n";
      body += "data: " +
              json{{"id", id},
                   {"choices", {{{"token_ids", json::array()}, {"finish_reason", "length"}}}}}
                  .dump() +
              "\n\n";
      body += "data: [DONE]\n\n";
      res.set_content(body, "text/event-stream");
    });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
    while (!svr_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeServer() {
    svr_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int completions() const { return completions_; }

 private:
  httplib::Server svr_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<int> completions_{0};
};

// "2024-11-15 10:MM:SS" plus t seconds (t < 3000).
std::string fmt_time(int t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "2024-11-15 10:%02d:%02d", t / 60, t % 60);
  return buf;
}

// A request trace CSV of `n` requests, `gap_s` seconds apart, over two model ids.
std::string write_trace(const TempDir& dir, int n, int gap_s = 0) {
  const std::string path = (dir.path() / "trace.csv").string();
  std::ofstream f(path);
  f << "gmt_create,checkpoint_model_version_id\n";
  for (int i = 0; i < n; ++i) {
    const int t = i * gap_s;
    f << fmt_time(t) << ",M000" << (i % 2) << "\n";
  }
  return path;
}

TEST(LiveClientsCli, LoadRetriesA429ABoundedNumberOfTimesAndFailsSayingSo) {
  FakeServer srv(FakeServer::Mode::kRefuse);
  // `timeout`: a client that retries forever fails here rather than hanging the suite.
  const cli_test::CommandResult r =
      cli_test::run_command("timeout 30 " + kBin + " load " + srv.url() +
                            " --clients 2 --requests 6 --max-retries 3 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "answered 0 / 6")) << r.out;
  EXPECT_TRUE(contains(r.out, "still 429 after 3 retries (--max-retries 3)")) << r.out;
  EXPECT_TRUE(contains(r.out, "6 of 6 requests not answered")) << r.out;
  EXPECT_TRUE(contains(r.out, "refused with 429 after their retries (--max-retries 3")) << r.out;
  // Two requests in a row (one per client) gave up: the rest is not sent.
  EXPECT_TRUE(contains(r.out, "not sent (the server refused everything)")) << r.out;
  EXPECT_FALSE(contains(r.out, "every request answered")) << r.out;
  EXPECT_GE(srv.completions(), 2 * 4);
  EXPECT_LE(srv.completions(), 6 * 4);
}

TEST(LiveClientsCli, LoadStopsRetryingAtItsTimeBound) {
  // Retry-After 1: waits of 20, 40, 80, 160 ms, then 320 ms would pass 0.5 s.
  FakeServer srv(FakeServer::Mode::kRefuse, 0, "1");
  const auto t0 = std::chrono::steady_clock::now();
  const cli_test::CommandResult r = cli_test::run_command(
      "timeout 30 " + kBin + " load " + srv.url() +
      " --clients 1 --requests 2 --max-retries 1000 --max-retry-seconds 0.5 2>&1");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "still 429 after 4 retries in 0.")) << r.out;
  EXPECT_TRUE(contains(r.out, "(--max-retry-seconds 0.5)")) << r.out;
  EXPECT_TRUE(contains(r.out, "2 of 2 requests not answered: 1 refused with 429")) << r.out;
  EXPECT_TRUE(contains(r.out, "1 not sent")) << r.out;
  EXPECT_EQ(srv.completions(), 5);
  EXPECT_LT(s, 10.0);
}

TEST(LiveClientsCli, LiveReplayWithNothingAnsweredFailsAndPrintsNoSlo) {
  FakeServer srv(FakeServer::Mode::kRefuse);
  TempDir dir;
  const std::string trace = write_trace(dir, 5);
  const cli_test::CommandResult r =
      cli_test::run_command("timeout 30 " + kBin + " replay --live " + srv.url() + " --trace '" +
                            trace + "' --time-scale 1e9 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "none answered: 5 refused 429")) << r.out;
  EXPECT_TRUE(contains(r.out, "5 of 5 requests sent were not answered: 5 refused with 429"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "overloaded: 64 requests waiting")) << r.out;
  EXPECT_FALSE(contains(r.out, "SLO")) << r.out;
  EXPECT_EQ(srv.completions(), 5);  // not retried
  // As JSON: the live figures are null, not 0.
  const cli_test::CommandResult j =
      cli_test::run_command("timeout 30 " + kBin + " replay --live " + srv.url() + " --trace '" +
                            trace + "' --time-scale 1e9 --json - 2>/dev/null");
  EXPECT_EQ(j.code, 1) << j.out;
  const json doc = json::parse(j.out);
  EXPECT_EQ(doc["live"]["answered"], 0);
  EXPECT_TRUE(doc["configurations"][0]["slo_attainment"].is_null()) << j.out;
  EXPECT_TRUE(doc["configurations"][0]["ttft_ms"].is_null()) << j.out;
}

TEST(LiveClientsCli, LiveReplayTtftIncludesTheWaitForAClientThread) {
  // Four requests due at once, one client thread, 200 ms each: the last waits 600 ms for
  // the thread, so its TTFT from its arrival is >= 800 ms.
  FakeServer srv(FakeServer::Mode::kAnswer, 200);
  TempDir dir;
  const std::string trace = write_trace(dir, 4);
  const cli_test::CommandResult r =
      cli_test::run_command("timeout 30 " + kBin + " replay --live " + srv.url() + " --trace '" +
                            trace + "' --time-scale 1e9 --max-concurrency 1 --json - 2>/dev/null");
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = json::parse(r.out);
  const json& live = j["configurations"][0];
  EXPECT_EQ(live["completed"], 4);
  EXPECT_EQ(j["live"]["answered"], 4);
  EXPECT_GE(j["live"]["max_late_ms"].get<double>(), 550.0) << r.out;
  EXPECT_GE(live["ttft_ms"]["p99"].get<double>(), 750.0) << r.out;
  EXPECT_GE(live["ttft_ms"]["p50"].get<double>(), 350.0) << r.out;
}

TEST(LiveClientsCli, ABaseUrlEndingInV1IsAcceptedAndABadUrlIsNamed) {
  FakeServer srv(FakeServer::Mode::kAnswer);
  TempDir dir;
  const std::string trace = write_trace(dir, 3);
  cli_test::CommandResult r =
      cli_test::run_command("timeout 30 " + kBin + " load " + srv.url() +
                            "/v1/ --clients 2 --requests 4 --distinct 2 --max-tokens 3 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "answered 4 / 4")) << r.out;
  r = cli_test::run_command("timeout 30 " + kBin + " replay --live " + srv.url() + "/v1 --trace '" +
                            trace + "' --time-scale 1e9 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "3 sent (0 not sent: past --max-seconds), 3 answered")) << r.out;

  r = cli_test::run_command(kBin + " load " + srv.url() + "/v2 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "url is '" + srv.url() + "/v2'; has path '/v2'")) << r.out;
  r = cli_test::run_command(kBin + " replay --live ftp://127.0.0.1:8000 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--live is 'ftp://127.0.0.1:8000'; must start with http://"))
      << r.out;
  r = cli_test::run_command(kBin + " load http://127.0.0.1:99999 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "has port '99999'; must be in [1, 65535]")) << r.out;
}

TEST(LiveClientsCli, LoadSaysHowManyTriplesItComparedAndClaimsNothingWhenNoneRepeated) {
  FakeServer srv(FakeServer::Mode::kAnswer);
  cli_test::CommandResult r = cli_test::run_command("timeout 30 " + kBin + " load " + srv.url() +
                                                    " --distinct 100 --requests 5 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "no triple was answered twice (--distinct 100 with --requests 5)"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "NOT checked")) << r.out;
  EXPECT_FALSE(contains(r.out, "the same for its triple")) << r.out;
  r = cli_test::run_command("timeout 30 " + kBin + " load " + srv.url() +
                            " --distinct 3 --requests 7 --clients 2 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  // Requests k and k + 3, k + 6 share triple k % 3: 3 triples repeated, 4 answers compared.
  EXPECT_TRUE(contains(r.out,
                       "3 triples answered more than once: every one of their 4 "
                       "repeated answers the same tokens"))
      << r.out;
}

TEST(LiveClientsCli, ReplayRefusesTimeScalesOutsideItsRangeAndSaysWhatWillNotBeSent) {
  cli_test::CommandResult r = cli_test::run_command(kBin + " replay --time-scale 1e-300 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--time-scale is 1e-300; must be in [0.001, ")) << r.out;
  r = cli_test::run_command(kBin + " replay --time-scale 1e300 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--time-scale is 1e300; must be in")) << r.out;

  // Live, at the trace's own pace: only the first of three requests 10 s apart arrives
  // within --max-seconds 5, and that is said before anything is sent.
  FakeServer srv(FakeServer::Mode::kAnswer);
  TempDir dir;
  const std::string trace = write_trace(dir, 3, 10);
  r = cli_test::run_command("timeout 30 " + kBin + " replay --live " + srv.url() + " --trace '" +
                            trace + "' --time-scale 1 --max-seconds 5 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out,
                       "span 20.0 s; only 1 of them arrive within --max-seconds 5: the "
                       "other 2 are not sent"))
      << r.out;
  EXPECT_EQ(srv.completions(), 1);
}

TEST(LiveClientsCli, MaxRequestsZeroMeansTheWholeTraceLiveAsSimulated) {
  FakeServer srv(FakeServer::Mode::kAnswer);
  TempDir dir;
  const std::string trace = write_trace(dir, 205);
  const cli_test::CommandResult r = cli_test::run_command(
      "timeout 60 " + kBin + " replay --live " + srv.url() + " --trace '" + trace +
      "' --max-requests 0 --time-scale 1e9 --max-concurrency 8 --json - 2>/dev/null");
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["live"]["sent"], 205);
  EXPECT_EQ(srv.completions(), 205);
  const cli_test::CommandResult help = cli_test::run_command(kBin + " replay --help 2>&1");
  EXPECT_TRUE(contains(help.out, "(0: all; not given: all, live 200)")) << help.out;
}

// An installed spillway (<prefix>/bin/spillway beside <prefix>/share/spillway) reads its
// default trace from <prefix>/share/spillway/traces, never from the source tree, and says
// so when it is missing.
TEST(LiveClientsCli, AnInstalledReplayReadsTheInstalledTrace) {
  TempDir dir;
  const fs::path prefix = dir.path() / "prefix";
  fs::create_directories(prefix / "bin");
  fs::create_directories(prefix / "share" / "spillway" / "traces");
  fs::copy_file(SPILLWAY_CLI_PATH, prefix / "bin" / "spillway");
  const fs::path traces = prefix / "share" / "spillway" / "traces";
  {
    std::ofstream t(traces / "lora_request_trace.csv");
    t << "gmt_create,checkpoint_model_version_id\n"
         "2024-11-15 16:57:50,M0000\n2024-11-15 16:57:51,M0001\n2024-11-15 16:57:52,M0000\n";
    std::ofstream l(traces / "basemodel_update_latency_anon.csv");
    l << "value\n1200\n900\n";
  }
  const std::string bin = "'" + (prefix / "bin" / "spillway").string() + "'";
  // From another working directory: nothing relative to the cwd.
  cli_test::CommandResult r = cli_test::run_command(
      "cd / && " + bin + " replay --max-requests 0 --models Llama-3.2-3B 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(
      contains(r.out, "replaying 3 requests of " + (traces / "lora_request_trace.csv").string()))
      << r.out;
  fs::remove(traces / "lora_request_trace.csv");
  r = cli_test::run_command("cd / && " + bin + " replay 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out,
                       "the default --trace (lora_request_trace.csv) is missing from "
                       "this installation: " +
                           (traces / "lora_request_trace.csv").string()))
      << r.out;
  EXPECT_TRUE(contains(r.out, "give one with --trace FILE")) << r.out;
}

}  // namespace
}  // namespace spillway

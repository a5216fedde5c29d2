// `spillway checkpoint` and `spillway serve` as a user runs them: a checkpoint written, the
// server started on a free port, a streamed completion, and SIGTERM in the middle of it:
// the stream still ends with every token and [DONE], a request after the signal gets 503,
// and the server exits 0 saying what it drained. Bad flags exit non-zero naming the field.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "cli/run_command.hpp"
#include "test_support.hpp"

extern char** environ;

namespace spillway {
namespace {

using cli_test::contains;
using spillway::testing::TempDir;

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(ServeCli, ServesAStreamAndDrainsOnSigterm) {
  TempDir dir;
  const std::string models = (dir.path() / "models").string();
  const cli_test::CommandResult ck =
      cli_test::run_command(std::string("'") + SPILLWAY_CLI_PATH + "' checkpoint --seed 4 --out '" +
                            models + "/tiny-d' 2>&1");
  ASSERT_EQ(ck.code, 0) << ck.out;
  EXPECT_TRUE(contains(ck.out, "model.safetensors")) << ck.out;

  const std::string port_file = (dir.path() / "port").string();
  const std::string log = (dir.path() / "log").string();
  const std::string script = std::string("exec '") + SPILLWAY_CLI_PATH + "' serve --models '" +
                             models + "' --port 0 --port-file '" + port_file +
                             "' --rate-scale 1e-4 --profile 7g.96gb > '" + log + "' 2>&1";
  const char* argv[] = {"/bin/sh", "-c", script.c_str(), nullptr};
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ), 0);
  int port = 0;
  for (int i = 0; i < 300 && port == 0; ++i) {
    std::ifstream f(port_file);
    if (!(f >> port)) {
      port = 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ASSERT_GT(port, 0) << slurp(log);

  // A stream of 30 tokens (slow: rates x 1e-4); SIGTERM after its first event.
  std::string body;
  bool signalled = false;
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(60);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"model": "tiny-d", "prompt": "drain me", "max_tokens": 30, "stream": true,
                 "temperature": 0})";
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    body.append(data, n);
    if (!signalled && contains(body, "data: ")) {
      signalled = true;
      ::kill(pid, SIGTERM);
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  ASSERT_TRUE(cli.send(req, res, err)) << httplib::to_string(err);
  EXPECT_EQ(res.status, 200);
  EXPECT_TRUE(signalled);
  size_t events = 0;
  for (size_t at = body.find("data: {"); at != std::string::npos; at = body.find("data: {", at + 1))
    ++events;
  EXPECT_EQ(events, 31u) << body;  // 30 tokens, then the finish
  EXPECT_TRUE(contains(body, "\"finish_reason\":\"length\"")) << body;
  EXPECT_TRUE(contains(body, "data: [DONE]")) << body;
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << slurp(log);
  EXPECT_EQ(WEXITSTATUS(status), 0) << slurp(log);
  const std::string out = slurp(log);
  EXPECT_TRUE(contains(out, "SIGTERM: draining 1 requests")) << out;
  EXPECT_TRUE(contains(out, "drained; 1 requests answered, 30 tokens generated")) << out;
}

// `spillway serve` in the background on a free port, SIGTERM on scope exit.
class Server {
 public:
  explicit Server(const std::string& flags) {
    const std::string port_file = (dir_.path() / "port").string();
    log_ = (dir_.path() / "log").string();
    const std::string script = std::string("exec '") + SPILLWAY_CLI_PATH +
                               "' serve --port 0 --port-file '" + port_file + "' " + flags +
                               " > '" + log_ + "' 2>&1";
    const char* argv[] = {"/bin/sh", "-c", script.c_str(), nullptr};
    if (posix_spawn(&pid_, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ) != 0)
      pid_ = 0;
    for (int i = 0; i < 300 && port_ == 0 && pid_ != 0; ++i) {
      std::ifstream f(port_file);
      if (!(f >> port_)) {
        port_ = 0;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  }
  ~Server() {
    if (pid_ == 0) return;
    ::kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  std::string log() const { return slurp(log_); }

 private:
  TempDir dir_;
  std::string log_;
  pid_t pid_ = 0;
  int port_ = 0;
};

TEST(ServeCli, LiveReplayIsMeasuredBesideTheSimulatorsPrediction) {
  Server srv("--rate-scale 1e-3");
  ASSERT_GT(srv.port(), 0) << srv.log();
  const cli_test::CommandResult r =
      cli_test::run_command(std::string("'") + SPILLWAY_CLI_PATH + "' replay --live " + srv.url() +
                            " --max-requests 40 --time-scale 20000 --json - 2>/dev/null");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["schema"], "spillway.replay-live/1");
  ASSERT_EQ(j["configurations"].size(), 2u);
  const nlohmann::json& live = j["configurations"][0];
  const nlohmann::json& pred = j["configurations"][1];
  EXPECT_EQ(live["name"], "live (measured)");
  EXPECT_EQ(pred["name"], "simulator (predicted)");
  EXPECT_EQ(j["live"]["sent"], 40);
  EXPECT_EQ(j["live"]["errors"], 0);
  EXPECT_EQ(live["completed"], 40);
  EXPECT_EQ(pred["completed"], 40);
  EXPECT_GT(live["ttft_ms"]["p50"].get<double>(), 0.0);
  EXPECT_GT(pred["ttft_ms"]["p50"].get<double>(), 0.0);
  EXPECT_GT(live["link_utilization"].get<double>(), 0.0);
  // The two demo models start cold once each, live and predicted.
  EXPECT_EQ(pred["cold_starts"], live["cold_starts"]);
  EXPECT_EQ(j["models"], nlohmann::json({"tiny-moe-a", "tiny-moe-b"}));
}

TEST(ServeCli, LoadAnswersEveryRequestOnceAndTheSameForItsSeed) {
  // One slice decoding one request, one waiting: most requests meet a 429 and retry.
  Server srv("--profile 7g.96gb --max-running 1 --max-waiting 1 --rate-scale 1e-2");
  ASSERT_GT(srv.port(), 0) << srv.log();
  const cli_test::CommandResult r =
      cli_test::run_command(std::string("'") + SPILLWAY_CLI_PATH + "' load " + srv.url() +
                            " --clients 6 --requests 36 --distinct 9 --max-tokens 4 2>&1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "answered 36 / 36, lost 0, duplicated 0, inconsistent 0")) << r.out;
  // Each of the 9 triples sent 4 times: 27 answers compared with their triple's first.
  EXPECT_TRUE(contains(r.out,
                       "9 triples answered more than once: every one of their 27 "
                       "repeated answers the same tokens"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "p99")) << r.out;
  EXPECT_FALSE(contains(r.out, "429s retried 0")) << r.out;
  // Nothing listening: said, exit 1.
  const cli_test::CommandResult none = cli_test::run_command(std::string("'") + SPILLWAY_CLI_PATH +
                                                             "' load http://127.0.0.1:1 2>&1");
  EXPECT_EQ(none.code, 1) << none.out;
  EXPECT_TRUE(contains(none.out, "is `spillway serve` running there?")) << none.out;
}

TEST(ServeCli, BenchServeLiveComparesBatchingWithOneAtATime) {
  const cli_test::CommandResult r = cli_test::run_command(
      std::string("'") + SPILLWAY_CLI_PATH +
      "' bench serve-live --requests 6 --prompt-tokens 8 --output-tokens 6 --max-running 3 "
      "--rate-scale 1e-2 --json - 2>/dev/null");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["schema"], "spillway.bench-serve-live/1");
  EXPECT_TRUE(j["same_tokens"].get<bool>());
  EXPECT_GT(j["batched_tokens_per_s"].get<double>(), 0.0);
  EXPECT_GT(j["serial_tokens_per_s"].get<double>(), 0.0);
  // Batching reads fewer weight bytes per token, and no run beats its link's limit.
  EXPECT_LT(j["batched_link_bytes_per_token"].get<double>(),
            j["serial_link_bytes_per_token"].get<double>());
  EXPECT_LE(j["batched_tokens_per_s"].get<double>(), j["limit_tokens_per_s"].get<double>());
  EXPECT_LE(j["serial_tokens_per_s"].get<double>(), j["serial_limit_tokens_per_s"].get<double>());
  EXPECT_GT(j["weight_bytes"].get<int64_t>(), 1000000);
}

TEST(ServeCli, BadSetupsExitNonZeroNamingTheField) {
  TempDir dir;
  const std::string bin = std::string("'") + SPILLWAY_CLI_PATH + "'";
  cli_test::CommandResult r =
      cli_test::run_command(bin + " serve --models '" + dir.path().string() + "/none' 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "is not a directory")) << r.out;
  r = cli_test::run_command(bin + " serve --max-running 8 --max-step-tokens 8 --port 0 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "max_step_tokens")) << r.out;
  r = cli_test::run_command(bin + " checkpoint --out '" + dir.path().string() +
                            "/x' --dtype fp16 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--dtype")) << r.out;
  r = cli_test::run_command(bin + " serve --port 70000 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--port is 70000")) << r.out;
  r = cli_test::run_command(bin + " serve --no-such-flag 2>&1");
  EXPECT_EQ(r.code, 2) << r.out;
}

}  // namespace
}  // namespace spillway

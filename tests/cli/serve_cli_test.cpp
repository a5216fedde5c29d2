// `spillway bench serve` as a user runs it: a small run's JSON (the switch copies nothing,
// every MIG profile of the sweep has its slice count, the link bytes follow the dataflows),
// on any GPU with MIG profiles (its own), and one without them refused naming --hardware.
// `spillway serve` and `spillway checkpoint` at their edges: a --port-file that cannot be
// written stops the server naming it (nothing left behind, a device never replaced), a
// drain bounded by --drain-seconds and cut at once by a second signal, SIGHUP removing the
// demo models, an IPv6 address bracketed; --out refused over a model without --force.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/run_command.hpp"
#include "core/json_io.hpp"
#include "test_support.hpp"

extern char** environ;

namespace spillway {
namespace {

using cli_test::contains;
using spillway::testing::TempDir;
namespace fs = std::filesystem;

std::string cli() {
  return std::string("'") + SPILLWAY_CLI_PATH + "'";
}

TEST(ServeBenchCli, ASmallRunSwitchesWithoutCopyingAndSweepsAlpha) {
  const cli_test::CommandResult r = cli_test::run_command(
      std::string("'") + SPILLWAY_CLI_PATH +
      "' bench serve --m 8 --n 64 --k 64 --rate-scale 0.001 --json - 2>/dev/null");
  ASSERT_EQ(r.code, 0) << r.out;
  const Json j = Json::parse(r.out);
  EXPECT_EQ(j["schema"], "spillway.bench-serve/1");
  EXPECT_EQ(j["switch"]["switch_device_allocations"], 0);
  EXPECT_EQ(j["switch"]["switch_device_bytes"], 0);
  EXPECT_GT(j["switch"]["reload_ms"].get<double>(), 0.0);
  ASSERT_EQ(j["sweeps"].size(), 3u);
  const int slices[] = {1, 3, 7};
  for (size_t i = 0; i < 3; ++i) {
    const Json& s = j["sweeps"][i];
    EXPECT_EQ(s["slices"], slices[i]);
    ASSERT_EQ(s["points"].size(), 5u);
    // alpha 0: every slice reads the 64 x 64 bf16 weights once over the link.
    EXPECT_EQ(s["points"][0]["link_bytes"], slices[i] * 64 * 64 * 2);
    // More symmetric: less HBM per slice.
    EXPECT_GT(s["points"][0]["hbm_bytes_per_slice"].get<int64_t>(),
              s["points"][4]["hbm_bytes_per_slice"].get<int64_t>());
  }
}

// Each GPU's own 1-, 3- and 7-way profiles; one without MIG is refused naming --hardware
// (not a --profile flag that bench serve does not have).
TEST(ServeBenchCli, AnyGpuWithMigRunsOnItsOwnProfilesAndOneWithoutIsRefused) {
  const cli_test::CommandResult r = cli_test::run_command(
      cli() + " bench serve --hardware h100-pcie --m 8 --n 64 --k 64 --json - 2>&1 >/dev/null");
  const cli_test::CommandResult j = cli_test::run_command(
      cli() + " bench serve --hardware h100-pcie --m 8 --n 64 --k 64 --json - 2>/dev/null");
  ASSERT_EQ(j.code, 0) << r.out;
  const Json doc = Json::parse(j.out);
  ASSERT_EQ(doc["sweeps"].size(), 3u);
  EXPECT_EQ(doc["sweeps"][0]["profile"], "7g.80gb");
  EXPECT_EQ(doc["sweeps"][1]["profile"], "2g.20gb");
  EXPECT_EQ(doc["sweeps"][2]["profile"], "1g.10gb");
  EXPECT_EQ(doc["sweeps"][2]["slices"], 7);

  const cli_test::CommandResult no =
      cli_test::run_command(cli() + " bench serve --hardware rubin 2>&1");
  EXPECT_EQ(no.code, 1) << no.out;
  EXPECT_TRUE(contains(no.out, "--hardware rubin: it has no MIG profiles")) << no.out;
  EXPECT_TRUE(contains(no.out, "h100-pcie")) << no.out;
  EXPECT_FALSE(contains(no.out, "--profile")) << no.out;
}

// Rates at the edge: a rate scale too small is refused by its range; one whose run would
// take hours is refused up front with the numbers and the flag.
TEST(ServeBenchCli, ARunThatWouldTakeHoursIsRefusedUpFront) {
  const cli_test::CommandResult tiny =
      cli_test::run_command(cli() + " bench serve --rate-scale 1e-30 2>&1");
  EXPECT_EQ(tiny.code, 1) << tiny.out;
  EXPECT_TRUE(contains(tiny.out, "--rate-scale is 1e-30; must be in [1e-06, 1]")) << tiny.out;
  const auto t0 = std::chrono::steady_clock::now();
  const cli_test::CommandResult slow =
      cli_test::run_command(cli() + " bench serve --rate-scale 1e-6 --n 65536 --k 65536 2>&1");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  EXPECT_EQ(slow.code, 1) << slow.out;
  EXPECT_TRUE(contains(slow.out, "more than the 3600 s a run may take; raise --rate-scale"))
      << slow.out;
}

// `spillway serve` in the background: its pid, its log (stdout and stderr), its port.
class ServeProcess {
 public:
  ServeProcess(const TempDir& dir, const std::string& flags)
      : ServeProcess(dir, "serve --port 0 --port-file '" + dir.file("port") + "' " + flags,
                     dir.file("port")) {}
  // `spillway <args>` run in `dir`, its port written to `port_file` (by the args).
  ServeProcess(const TempDir& dir, const std::string& args, const std::string& port_file)
      : log_(dir.file("serve.log")), port_file_(port_file) {
    const std::string script =
        "cd '" + dir.path().string() + "' && exec " + cli() + " " + args + " > '" + log_ + "' 2>&1";
    const char* argv[] = {"/bin/sh", "-c", script.c_str(), nullptr};
    if (posix_spawn(&pid_, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ) != 0)
      pid_ = 0;
  }
  ~ServeProcess() {
    if (pid_ == 0 || exited_) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  // The port once the port file has it (0 if the server did not get there in 30 s).
  int wait_port() {
    for (int i = 0; i < 600 && pid_ != 0; ++i) {
      std::ifstream f(port_file_);
      int port = 0;
      if (f >> port && port > 0) return port;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return 0;
  }
  // The exit status (128 + n for a signal), or -1 when it has not exited within `limit`.
  int wait_exit(std::chrono::seconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
  void signal(int sig) const { ::kill(pid_, sig); }
  std::string log() const { return cli_test::read_file(log_); }
  bool started() const { return pid_ != 0; }

 private:
  std::string log_, port_file_;
  pid_t pid_ = 0;
  bool exited_ = false;
};

// A completion of `tokens` tokens, not streamed, on a thread; done once answered or cut.
class SlowRequest {
 public:
  SlowRequest(int port, int tokens) {
    thread_ = std::thread([this, port, tokens] {
      httplib::Client c("127.0.0.1", port);
      c.set_read_timeout(120);
      const std::string body = R"({"model": "tiny-moe-a", "prompt": "slow", "temperature": 0, )"
                               R"("max_tokens": )" +
                               std::to_string(tokens) + "}";
      auto res = c.Post("/v1/completions", body, "application/json");
      status_ = res ? res->status : -1;
      done_ = true;
    });
  }
  ~SlowRequest() { thread_.join(); }
  bool done() const { return done_; }
  int status() const { return status_; }

 private:
  std::thread thread_;
  std::atomic<bool> done_{false};
  std::atomic<int> status_{0};
};

// Waits until the server has `n` requests waiting or running (its /metrics), up to 10 s.
bool wait_in_flight(int port, int n) {
  httplib::Client c("127.0.0.1", port);
  const std::regex line(R"((?:^|\n)spillway_(?:waiting|slice_running)_requests\S* (\d+))");
  for (int i = 0; i < 500; ++i) {
    if (auto res = c.Get("/metrics")) {
      int have = 0;
      for (auto it = std::sregex_iterator(res->body.begin(), res->body.end(), line);
           it != std::sregex_iterator(); ++it)
        have += std::stoi((*it)[1]);
      if (have >= n) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

constexpr const char* kSlowServe = "--rate-scale 1e-5 --profile 7g.96gb";

TEST(ServeCli, TheDrainHasADeadlineAndSaysWhatItCut) {
  TempDir dir;
  ServeProcess srv(dir, std::string(kSlowServe) + " --drain-seconds 1");
  ASSERT_TRUE(srv.started());
  const int port = srv.wait_port();
  ASSERT_GT(port, 0) << srv.log();
  SlowRequest req(port, 500);
  ASSERT_TRUE(wait_in_flight(port, 1)) << srv.log();
  const auto t0 = std::chrono::steady_clock::now();
  srv.signal(SIGTERM);
  const int code = srv.wait_exit(std::chrono::seconds(20));
  const double took_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string log = srv.log();
  EXPECT_EQ(code, 0) << log;
  EXPECT_GE(took_s, 0.9) << log;  // the request had its second
  EXPECT_LT(took_s, 10.0) << log;
  EXPECT_TRUE(contains(log, "SIGTERM: draining 1 requests in flight (up to 1 s")) << log;
  EXPECT_TRUE(contains(log, "cut 1 of the 1 requests in flight at the 1 s deadline")) << log;
}

TEST(ServeCli, ASecondSignalDuringTheDrainEndsAtOnce) {
  TempDir dir;
  ServeProcess srv(dir, std::string(kSlowServe) + " --drain-seconds 600");
  ASSERT_TRUE(srv.started());
  const int port = srv.wait_port();
  ASSERT_GT(port, 0) << srv.log();
  SlowRequest req(port, 500);
  ASSERT_TRUE(wait_in_flight(port, 1)) << srv.log();
  srv.signal(SIGTERM);
  // The first signal is being drained (its line printed), then the second.
  for (int i = 0; i < 250 && !contains(srv.log(), "draining"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto t0 = std::chrono::steady_clock::now();
  srv.signal(SIGINT);
  const int code = srv.wait_exit(std::chrono::seconds(20));
  const double took_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string log = srv.log();
  EXPECT_EQ(code, 128 + SIGINT) << log;
  EXPECT_LT(took_s, 3.0) << log;
  EXPECT_TRUE(contains(log,
                       "a second signal (SIGINT) during the drain: exiting at once, cutting 1 "
                       "requests in flight"))
      << log;
}

// SIGHUP drains as SIGTERM does, and the demo models' temporary directory goes with it.
TEST(ServeCli, SighupRemovesTheDemoModelsDirectory) {
  TempDir dir;
  ServeProcess srv(dir, "");
  ASSERT_TRUE(srv.started());
  ASSERT_GT(srv.wait_port(), 0) << srv.log();
  std::smatch m;
  const std::string log = srv.log();
  ASSERT_TRUE(std::regex_search(log, m, std::regex(R"(seeds 1 and 2\) in (\S+))"))) << log;
  const fs::path demo = m[1].str();
  ASSERT_TRUE(fs::is_directory(demo)) << demo;
  srv.signal(SIGHUP);
  EXPECT_EQ(srv.wait_exit(std::chrono::seconds(20)), 0) << srv.log();
  EXPECT_FALSE(fs::exists(demo)) << demo;
}

TEST(ServeCli, AnIpv6AddressIsPrintedInBrackets) {
  TempDir dir;
  ServeProcess srv(dir, "--host ::1");
  ASSERT_TRUE(srv.started());
  const int port = srv.wait_port();
  if (port == 0 && contains(srv.log(), "cannot bind")) GTEST_SKIP() << "no IPv6 loopback here";
  ASSERT_GT(port, 0) << srv.log();
  EXPECT_TRUE(contains(srv.log(), "listening on http://[::1]:" + std::to_string(port) + " "))
      << srv.log();
  srv.signal(SIGTERM);
  EXPECT_EQ(srv.wait_exit(std::chrono::seconds(20)), 0) << srv.log();
}

// Note [Atomic output] for the port file: a directory is an error naming it, with nothing
// left beside it; a device is written in place, and a full one stops the server.
TEST(ServeCli, APortFileThatCannotBeWrittenStopsTheServerNamingIt) {
  TempDir dir;
  const fs::path target = dir.path() / "ports";
  fs::create_directory(target);
  const cli_test::CommandResult r = cli_test::run_command(
      "timeout 60 " + cli() + " serve --port 0 --port-file '" + target.string() + "' 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "spillway: error: --port-file: cannot write '" + target.string() +
                                  "': Is a directory"))
      << r.out;
  EXPECT_FALSE(contains(r.out, "internal error")) << r.out;
  EXPECT_FALSE(contains(r.out, "listening on")) << r.out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path(), target) << "left behind: " << e.path();

  struct stat st {};
  if (::geteuid() != 0 || ::stat("/dev/full", &st) != 0 || !S_ISCHR(st.st_mode))
    GTEST_SKIP() << "/dev/full: needs root and the device";
  const cli_test::CommandResult full =
      cli_test::run_command("timeout 60 " + cli() + " serve --port 0 --port-file /dev/full 2>&1");
  EXPECT_EQ(full.code, 1) << full.out;
  EXPECT_TRUE(
      contains(full.out, "spillway: error: --port-file: cannot write '/dev/full': No space left"))
      << full.out;
  ASSERT_EQ(::stat("/dev/full", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << "/dev/full is no longer a device";
}

// Note [Checkpoint --out]: a model is replaced only with --force, a directory holding
// anything else never.
TEST(CheckpointCli, OutOverAModelNeedsForceAndOverAnythingElseIsRefused) {
  TempDir dir;
  const std::string out = (dir.path() / "m").string();
  const auto checkpoint = [&](const std::string& args) {
    return cli_test::run_command(cli() + " checkpoint " + args + " 2>&1");
  };
  cli_test::CommandResult r = checkpoint("--seed 1 --out '" + out + "'");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string seed1 = cli_test::read_file(out + "/model.safetensors");
  r = checkpoint("--seed 2 --out '" + out + "'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--out: '" + out + "' already holds a model")) << r.out;
  EXPECT_TRUE(contains(r.out, "--force")) << r.out;
  EXPECT_EQ(cli_test::read_file(out + "/model.safetensors"), seed1);
  r = checkpoint("--seed 2 --force --out '" + out + "'");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(cli_test::read_file(out + "/model.safetensors"), seed1);
  for (const fs::directory_entry& e : fs::directory_iterator(out)) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "config.json" || name == "model.safetensors") << "left: " << name;
  }

  const std::string other = dir.write("notes/todo.txt", "mine");
  const std::string notes = (dir.path() / "notes").string();
  r = checkpoint("--force --out '" + notes + "'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--out: '" + notes + "' is not empty and holds no model")) << r.out;
  EXPECT_FALSE(fs::exists(notes + "/model.safetensors"));
  EXPECT_EQ(cli_test::read_file(other), "mine");
  r = checkpoint("--out '" + other + "'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "exists and is not a directory")) << r.out;
  // The root: refused even with --force. Only where a mistake could not write there.
  if (::geteuid() != 0) {
    r = checkpoint("--force --out /");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(contains(r.out, "--out: '/' is the root directory")) << r.out;
  }
}

// The examples of `spillway checkpoint --help` and `spillway serve --help`, run in one
// directory as written: every checkpoint is written, and the server they document serves
// each of them (the serve example once named a profile too small for small-moe's decoder).
TEST(DocsCli, TheCheckpointAndServeExamplesWorkTogetherAsWritten) {
  std::vector<std::string> checkpoints;
  std::string serve;
  for (const char* command : {"checkpoint", "serve"}) {
    const cli_test::CommandResult help =
        cli_test::run_command(cli() + " " + command + " --help 2>&1");
    ASSERT_EQ(help.code, 0) << help.out;
    std::istringstream in(help.out);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("  spillway checkpoint ", 0) == 0) checkpoints.push_back(line.substr(11));
      if (line.rfind("  spillway serve --models", 0) == 0) serve = line.substr(11);
    }
  }
  ASSERT_GE(checkpoints.size(), 3u);
  ASSERT_FALSE(serve.empty());
  TempDir dir;
  for (const std::string& args : checkpoints) {
    const cli_test::CommandResult r = cli_test::run_command("cd '" + dir.path().string() + "' && " +
                                                            cli() + " " + args + " 2>&1");
    ASSERT_EQ(r.code, 0) << args << "\n" << r.out;
  }
  ServeProcess srv(dir, serve, dir.file("port.txt"));
  ASSERT_TRUE(srv.started());
  const int port = srv.wait_port();
  ASSERT_GT(port, 0) << serve << "\n" << srv.log();
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(60);
  int served = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(dir.path() / "models")) {
    const std::string model = e.path().filename().string();
    const auto res = c.Post("/v1/completions",
                            R"({"model": ")" + model + R"(", "prompt": "Hi", "max_tokens": 2})",
                            "application/json");
    ASSERT_TRUE(res) << model;
    EXPECT_EQ(res->status, 200) << model << ": " << res->body;
    ++served;
  }
  EXPECT_EQ(served, static_cast<int>(checkpoints.size()));
  srv.signal(SIGTERM);
  EXPECT_EQ(srv.wait_exit(std::chrono::seconds(20)), 0) << srv.log();
}

// The planning guide's catalog: its count and its table are what `spillway models` prints.
TEST(DocsCli, ThePlanningGuideListsTheModelsTheCatalogHas) {
  const cli_test::CommandResult models = cli_test::run_command(cli() + " models 2>&1");
  ASSERT_EQ(models.code, 0) << models.out;
  int rows = 0;
  std::istringstream in(models.out);
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line) && !line.empty()) ++rows;
  const std::string readme =
      cli_test::read_file(std::string(SPILLWAY_DATA_DIR) + "/../docs/guide/planning.md");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      readme, m, std::regex(R"(lists the embedded model catalog: (\d+) Hugging Face)")));
  EXPECT_EQ(std::stoi(m[1]), rows);
  EXPECT_TRUE(contains(readme, "$ spillway models\n" + models.out + "```")) << models.out;
}

// A config whose initialization cannot fit this machine names the flag to change.
TEST(CheckpointCli, AConfigTooLargeForTheArenaNamesTheFlag) {
  TempDir dir;
  std::string config = cli_test::read_file(std::string(SPILLWAY_DATA_DIR) + "/nn/tiny-moe.json");
  config =
      std::regex_replace(config, std::regex(R"("hidden_size": 64)"), R"("hidden_size": 65536)");
  config = std::regex_replace(config, std::regex(R"("num_experts": 8)"), R"("num_experts": 512)");
  config = std::regex_replace(config, std::regex(R"("moe_intermediate_size": 32)"),
                              R"("moe_intermediate_size": 65536)");
  const std::string path = dir.write("huge.json", config);
  const cli_test::CommandResult r =
      cli_test::run_command("timeout 60 " + cli() + " checkpoint --config '" + path + "' --out '" +
                            (dir.path() / "huge").string() + "' 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--config: '" + path + "' has ")) << r.out;
  EXPECT_TRUE(contains(r.out, "choose a smaller --config")) << r.out;
  EXPECT_FALSE(fs::exists(dir.path() / "huge"));
}

TEST(ReplayCli, TheTraceReplaysThroughEveryConfigurationWithAPicture) {
  spillway::testing::TempDir dir;
  const cli_test::CommandResult r = cli_test::run_command(
      std::string("'") + SPILLWAY_CLI_PATH + "' replay --max-requests 300 --json '" +
      dir.file("r.json") + "' --svg '" + dir.file("t.svg") + "' 2>&1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "token counts are not in the trace")) << r.out;
  EXPECT_TRUE(contains(r.out, "time sharing + reload")) << r.out;
  const Json j = Json::parse(cli_test::read_file(dir.file("r.json")));
  ASSERT_EQ(j["configurations"].size(), 6u);
  for (const Json& c : j["configurations"]) EXPECT_EQ(c["completed"], 300) << c["name"];
  EXPECT_TRUE(contains(cli_test::read_file(dir.file("t.svg")), "</svg>"));
  const cli_test::CommandResult bad =
      cli_test::run_command(std::string("'") + SPILLWAY_CLI_PATH + "' replay --trace '" +
                            dir.file("none.csv") + "' 2>&1");
  EXPECT_EQ(bad.code, 1);
  EXPECT_TRUE(contains(bad.out, "cannot open the request trace")) << bad.out;
}

}  // namespace
}  // namespace spillway

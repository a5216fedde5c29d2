// `spillway train` run as a user runs it, on tiny shapes (micro-batch 2 x seq 32, 2-3
// steps, well under a second each): help that teaches, per-step lines on stderr and the
// table on stdout, --compare JSON with bitwise-identical losses across the six policies,
// --json - as JSON only, a plan file from `spillway plan` as the policy, a throttled link
// that snowballs, and bad input that exits non-zero with a message naming the flag and
// the value, leaving no output file behind.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/run_command.hpp"
#include "core/json_io.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::TempDir;

// The tiny shape every run here uses.
constexpr const char* kTiny = "--micro-batch 2 --seq-len 32";

struct TrainRun {
  int code = -1;    // exit status; -1 when the shell did not exit normally
  std::string out;  // stdout
  std::string err;  // stderr
};

using cli_test::contains;
using cli_test::read_file;

// Runs `spillway <args>` with stdout and stderr captured apart (stderr through a file in
// `dir`).
TrainRun run(const std::string& args, const TempDir& dir) {
  const std::string err_path = dir.file("stderr.txt");
  const std::string cmd =
      std::string("'") + SPILLWAY_CLI_PATH + "' " + args + " 2>'" + err_path + "'";
  const cli_test::CommandResult c = cli_test::run_command(cmd);
  TrainRun r;
  r.code = c.code;
  r.out = c.out;
  r.err = read_file(err_path);
  return r;
}

// A crash: killed by a signal (the shell reports 128 + signal, or did not exit itself).
bool crashed(const TrainRun& r) {
  return r.code < 0 || r.code >= 128;
}

std::string shown(const TrainRun& r) {
  return "exit " + std::to_string(r.code) + "\n--- stdout:\n" + r.out.substr(0, 2000) +
         "\n--- stderr:\n" + r.err.substr(0, 2000);
}

Json parse_or_fail(const std::string& text) {
  try {
    return Json::parse(text);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not JSON (" << e.what() << "):\n" << text.substr(0, 500);
    return Json::object();
  }
}

// `spillway plan --policy offload` of the reference model `model` at kTiny, fp32, into
// dir's plan.json: judged infeasible for gh200 (exit 3) or not, it is written either way.
std::string offload_plan_file(const TempDir& dir, const std::string& model) {
  const std::string plan = dir.file("plan.json");
  const TrainRun p = run("plan --model '" + model + "' --hardware gh200 " + kTiny +
                             " --dtype fp32 --policy offload --quiet --json '" + plan + "'",
                         dir);
  EXPECT_TRUE(p.code == 0 || p.code == 3) << shown(p);
  EXPECT_TRUE(std::filesystem::exists(plan)) << shown(p);
  return plan;
}

const std::vector<std::string> kPolicies = {"keep",      "checkpoint", "recompute", "offload",
                                            "selective", "hybrid",     "auto"};

TEST(TrainCli, HelpTeachesPoliciesFlagsAndAnExample) {
  TempDir dir;
  const TrainRun r = run("train --help", dir);
  ASSERT_EQ(r.code, 0) << shown(r);
  for (const std::string& p : kPolicies) EXPECT_TRUE(contains(r.out, p)) << "help lacks " << p;
  for (const char* s :
       {"plan JSON", "--compare", "--json", "--device-memory-mb", "--policy", "--steps",
        "--micro-batch", "--seq-len", "--d2h-gbps", "--h2d-gbps", "--model", "--corpus", "--seed",
        "--quiet", "Examples:", "spillway train --compare", "spillway plan --model"}) {
    EXPECT_TRUE(contains(r.out, s)) << "help lacks [" << s << "]";
  }
}

TEST(TrainCli, OnePolicyPrintsStepLinesOnStderrAndTheTableOnStdout) {
  TempDir dir;
  const TrainRun r = run(std::string("train --steps 3 ") + kTiny, dir);
  ASSERT_EQ(r.code, 0) << shown(r);

  // stderr: one line per step of the default policy (keep), each with a plausible loss
  // (byte-level tokens: ~ln 256 = 5.55 at the start).
  for (int s = 1; s <= 3; ++s) {
    const std::string tag = "step   " + std::to_string(s) + "/3";
    const size_t at = r.err.find(tag);
    ASSERT_NE(at, std::string::npos) << "no [" << tag << "] line\n" << shown(r);
    const size_t line_start =
        r.err.rfind('\n', at) == std::string::npos ? 0 : r.err.rfind('\n', at) + 1;
    EXPECT_EQ(r.err.compare(line_start, 4, "keep"), 0) << r.err.substr(line_start, 120);
    const size_t loss_at = r.err.find("loss ", at);
    ASSERT_NE(loss_at, std::string::npos) << r.err;
    const double loss = std::stod(r.err.substr(loss_at + 5, 12));
    EXPECT_GT(loss, 3.0) << tag;
    EXPECT_LT(loss, 7.0) << tag;
  }
  EXPECT_FALSE(contains(r.err, "step   4/3")) << r.err;
  EXPECT_FALSE(contains(r.err, "error")) << r.err;

  // stdout: the header, the shape, one keep row, the loss summary; no per-step lines.
  for (const char* s :
       {"model tiny-moe", "micro-batch 2 x seq 32", "3 steps", "policy", "loss", "peak MB",
        "step ms", "offload MB", "snowball", "plan MB", "\nkeep ", "keep       loss "}) {
    EXPECT_TRUE(contains(r.out, s)) << "stdout lacks [" << s << "]\n" << r.out;
  }
  EXPECT_FALSE(contains(r.out, "step   1/3")) << "per-step lines belong on stderr\n" << r.out;
  for (const std::string& p : kPolicies) {
    if (p == "keep") continue;
    EXPECT_FALSE(contains(r.out, "\n" + p + " ")) << p << " was not asked for";
  }
}

TEST(TrainCli, ASinglePolicyClaimsNoBitwiseIdentity) {
  // One policy compares nothing: bitwise_identical is null (not true) and the table says
  // nothing about identity (issue: a single-policy --json wrote true).
  TempDir dir;
  const std::string json = dir.file("one.json");
  const TrainRun r = run(std::string("train --steps 2 ") + kTiny + " --json '" + json + "'", dir);
  ASSERT_EQ(r.code, 0) << shown(r);
  const Json j = parse_or_fail(read_file(json));
  ASSERT_TRUE(j.contains("bitwise_identical")) << j.dump(2);
  EXPECT_TRUE(j["bitwise_identical"].is_null()) << j.dump(2);
  EXPECT_EQ(j.value("policies_compared", -1), 1) << j.dump(2);
  EXPECT_FALSE(contains(r.out, "bitwise identical")) << r.out;
}

TEST(TrainCli, CompareJsonFileHasEveryPolicyWithBitwiseIdenticalLosses) {
  TempDir dir;
  const std::string json = dir.file("train.json");
  const TrainRun r =
      run(std::string("train --compare --steps 3 ") + kTiny + " --json '" + json + "'", dir);
  ASSERT_EQ(r.code, 0) << shown(r);
  ASSERT_TRUE(std::filesystem::exists(json)) << shown(r);
  EXPECT_FALSE(std::filesystem::exists(json + ".tmp"));
  const Json j = parse_or_fail(read_file(json));
  EXPECT_EQ(j.value("schema", ""), "spillway.train/1");
  EXPECT_EQ(j.value("micro_batch", 0), 2);
  EXPECT_EQ(j.value("seq_len", 0), 32);
  EXPECT_EQ(j.value("steps", 0), 3);
  ASSERT_TRUE(j.contains("bitwise_identical")) << j.dump(2);
  EXPECT_TRUE(j["bitwise_identical"].get<bool>());
  ASSERT_TRUE(j.contains("policies") && j["policies"].is_array()) << j.dump(2);
  const Json& ps = j["policies"];
  ASSERT_EQ(ps.size(), kPolicies.size()) << j.dump(2);
  EXPECT_EQ(j.value("policies_compared", -1), static_cast<int>(kPolicies.size())) << j.dump(2);

  for (size_t i = 0; i < ps.size(); ++i) {
    const Json& p = ps[i];
    SCOPED_TRACE(kPolicies[i]);
    for (const char* k : {"name", "loss", "peak_device_bytes", "step_ms", "offloaded_bytes",
                          "stall_ms", "snowball", "losses"}) {
      ASSERT_TRUE(p.contains(k)) << "missing " << k << " in " << p.dump(2);
    }
    EXPECT_EQ(p["name"].get<std::string>(), kPolicies[i]);
    EXPECT_TRUE(p["loss"].is_number());
    EXPECT_TRUE(p["peak_device_bytes"].is_number_integer());
    EXPECT_GT(p["peak_device_bytes"].get<int64_t>(), 0);
    EXPECT_GT(p["step_ms"].get<double>(), 0.0);
    EXPECT_GE(p["offloaded_bytes"].get<int64_t>(), 0);
    EXPECT_GE(p["stall_ms"].get<double>(), 0.0);
    EXPECT_TRUE(p["snowball"].is_boolean());
    EXPECT_EQ(p["losses"].size(), 3u);
    // Bitwise: the same doubles, not merely close ones.
    EXPECT_EQ(p["loss"].get<double>(), ps[0]["loss"].get<double>());
    EXPECT_EQ(p["losses"], ps[0]["losses"]);
  }
  auto by = [&](const std::string& name) -> const Json& {
    for (const Json& p : ps)
      if (p["name"] == name) return p;
    ADD_FAILURE() << "no policy " << name;
    return ps[0];
  };
  const double loss = by("keep")["loss"].get<double>();
  EXPECT_GT(loss, 3.0);
  EXPECT_LT(loss, 7.0);
  EXPECT_GT(by("keep")["peak_device_bytes"].get<int64_t>(),
            by("recompute")["peak_device_bytes"].get<int64_t>())
      << "keep holds every saved tensor; recompute holds fewer";
  EXPECT_GT(by("recompute")["peak_device_bytes"].get<int64_t>(),
            by("checkpoint")["peak_device_bytes"].get<int64_t>())
      << "checkpoint holds only the layer inputs";
  EXPECT_LT(by("recompute")["recomputed_ops"].get<int64_t>(),
            by("checkpoint")["recomputed_ops"].get<int64_t>());
  EXPECT_EQ(by("keep")["offloaded_bytes"].get<int64_t>(), 0) << "keep offloads nothing";
  EXPECT_EQ(by("recompute")["offloaded_bytes"].get<int64_t>(), 0) << "recompute offloads nothing";
  EXPECT_GT(by("offload")["offloaded_bytes"].get<int64_t>(), 0) << "offload offloads";

  // The table on stdout shows every policy and the identity verdict.
  for (const std::string& p : kPolicies)
    EXPECT_TRUE(contains(r.out, "\n" + p + " ")) << "table lacks " << p << "\n" << r.out;
  EXPECT_TRUE(contains(r.out, "bitwise identical")) << r.out;
  EXPECT_FALSE(contains(r.out, "WARNING")) << r.out;
}

TEST(TrainCli, JsonToStdoutIsJsonOnly) {
  TempDir dir;
  const TrainRun r = run(std::string("train --steps 2 ") + kTiny + " --json -", dir);
  ASSERT_EQ(r.code, 0) << shown(r);
  ASSERT_FALSE(r.out.empty());
  EXPECT_EQ(r.out.front(), '{') << r.out.substr(0, 200);
  const Json j = parse_or_fail(r.out);
  EXPECT_EQ(j.value("schema", ""), "spillway.train/1");
  ASSERT_TRUE(j.contains("policies")) << r.out.substr(0, 500);
  ASSERT_EQ(j["policies"].size(), 1u);
  EXPECT_EQ(j["policies"][0].value("name", ""), "keep");
  for (const char* s : {"peak MB", "policy    ", "step   1/2"})
    EXPECT_FALSE(contains(r.out, s)) << "[" << s << "] on stdout with --json -";
  EXPECT_FALSE(contains(r.err, "step   1/2")) << "no per-step lines with --json -\n" << r.err;
}

TEST(TrainCli, OptimizerOffloadReportsItsCountersInTheTableAndTheJson) {
  TempDir dir;
  const TrainRun r = run(
      std::string("train --steps 2 --optimizer offload --device-buckets 1 ") + kTiny + " --json -",
      dir);
  ASSERT_EQ(r.code, 0) << shown(r);
  const Json j = parse_or_fail(r.out);
  EXPECT_EQ(j.value("optimizer", ""), "offload");
  ASSERT_EQ(j["policies"].size(), 1u);
  const Json& opt = j["policies"][0]["optimizer"];
  EXPECT_EQ(opt.value("device_buckets", -1), 1);
  EXPECT_EQ(opt.value("commits", 0) + opt.value("replays", 0) + opt.value("skips", 0), 2);
  const TrainRun t = run(std::string("train --steps 2 --optimizer offload ") + kTiny, dir);
  ASSERT_EQ(t.code, 0) << shown(t);
  EXPECT_TRUE(contains(t.out, "optimizer offloaded (STV")) << shown(t);
  EXPECT_TRUE(contains(t.err, "optimizer +")) << "per-step lines show the optimizer's tail\n"
                                              << shown(t);
}

struct BadCase {
  std::string args;
  std::vector<std::string> all;  // substrings the message must hold, every one
  std::vector<std::string> any;  // substrings of which the message must hold one (if any)
};

TEST(TrainCli, BadInputExitsNonZeroNamingTheFlagAndValueAndWritesNothing) {
  TempDir dir;
  const std::string missing_plan = dir.file("no-such-plan.json");
  const std::string big_plan = dir.file("llama-plan.json");
  // A plan for another model: 32 layers against tiny-moe's 4.
  const TrainRun p = run("plan --model Llama-3.1-8B --quiet --json '" + big_plan + "'", dir);
  ASSERT_TRUE(p.code == 0 || p.code == 3) << shown(p);
  const std::vector<BadCase> cases = {
      {"--steps 2 --policy sideways", {"--policy", "sideways"}, {}},
      {"--steps 0", {"--steps", "0"}, {}},
      {"--steps 2 --device cuda", {"--device cuda", "host backend only"}, {}},
      {"--steps 2 --device tpu", {"--device", "tpu"}, {}},
      {"--steps 2 --model /nonexistent.json", {"--model", "/nonexistent.json"}, {}},
      {"--steps 2 --corpus /nonexistent", {"--corpus", "/nonexistent"}, {}},
      {"--steps 2 --d2h-gbps -1", {"--d2h-gbps", "-1"}, {}},
      {"--steps 2 --policy '" + missing_plan + "'", {missing_plan}, {}},
      {"--steps 2 --policy '" + big_plan + "'", {big_plan, "32 layers", "4"}, {}},
      {"--steps 2 --device-memory-mb 2 --policy keep",
       {"device memory exhausted", "--device-memory-mb"},
       {"policy keep", "parameters"}},
      {"--steps 2 --device-memory-mb 4 --policy keep",
       {"device memory exhausted", "policy keep", "--device-memory-mb"},
       {}},
      {"--steps 2 --optimizer cpu", {"--optimizer", "cpu"}, {}},
      {"--steps 2 --device-buckets 2", {"--optimizer offload"}, {}},
      {"--steps 2 --optimizer offload --device-buckets 7", {"--device-buckets", "7", "6"}, {}},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.args);
    const std::string out = dir.file("out.json");
    const TrainRun r =
        run(std::string("train ") + kTiny + " " + c.args + " --json '" + out + "'", dir);
    EXPECT_FALSE(crashed(r)) << shown(r);
    EXPECT_EQ(r.code, 1) << "an input error exits 1\n" << shown(r);
    EXPECT_TRUE(contains(r.err, "spillway: error:")) << shown(r);
    for (const std::string& m : c.all)
      EXPECT_TRUE(contains(r.err, m)) << "[" << m << "]\n" << shown(r);
    if (!c.any.empty()) {
      bool found = false;
      for (const std::string& m : c.any) found = found || contains(r.err, m);
      EXPECT_TRUE(found) << "none of the expected phrases\n" << shown(r);
    }
    EXPECT_EQ(r.out, "") << "an erroring run prints no table";
    EXPECT_FALSE(std::filesystem::exists(out)) << "an erroring run left " << out;
    EXPECT_FALSE(std::filesystem::exists(out + ".tmp")) << "an erroring run left " << out << ".tmp";
  }
}

TEST(TrainCli, UsageErrorsExitTwo) {
  TempDir dir;
  for (const std::string& args :
       {std::string("--steps abc"), std::string("--no-such-flag"), std::string("--micro-batch")}) {
    SCOPED_TRACE(args);
    const std::string out = dir.file("out.json");
    std::string cmd = "train --json '" + out + "' ";
    cmd += args;
    const TrainRun r = run(cmd, dir);
    EXPECT_EQ(r.code, 2) << shown(r);
    const std::string flag = args.substr(0, args.find(' '));
    EXPECT_TRUE(contains(r.err, flag)) << shown(r);
    EXPECT_FALSE(std::filesystem::exists(out));
  }
}

TEST(TrainCli, ReservesTheDeviceMemoryAskedForNotFourTimesIt) {
  // Calibration and auto's measuring run used to reserve 4 x --device-memory-mb + 64 MiB
  // of host memory: under a 4 GB address-space limit a 1500 MiB run could not start. The
  // sanitizers reserve terabytes of shadow address space, so the limit cannot apply there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "an address-space limit does not apply under a sanitizer";
#else
  const cli_test::CommandResult c = cli_test::run_command(
      std::string("ulimit -v 4000000; '") + SPILLWAY_CLI_PATH +
      "' train --policy auto --device-memory-mb 1500 --steps 1 --quiet " + kTiny + " 2>&1");
  EXPECT_EQ(c.code, 0) << c.out;
  EXPECT_FALSE(contains(c.out, "cannot reserve")) << c.out;
#endif
}

TEST(TrainCli, WorkThatCannotFitIsRefusedBeforeAnythingIsAllocated) {
  // Note [Work fits before it starts]: a batch larger than host memory was a
  // std::bad_alloc after seconds of allocation; a corpus that is a directory or a device
  // (/dev/zero) failed late or never ended. Each is an input error naming the numbers,
  // at once.
  TempDir dir;
  struct Case {
    std::string args;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"--micro-batch 1048576 --seq-len 4096",
       {"--micro-batch is 1048576", "bytes of host memory"}},
      {"--micro-batch 100000000", {"--micro-batch is 100000000; must be in [1, 1048576]"}},
      {"--micro-batch 1000000", {"embedding's output", "--device-memory-mb 256"}},
      {"--corpus /etc", {"'/etc' is not a regular file"}},
      {"--corpus /dev/zero", {"'/dev/zero' is not a regular file"}},
      {"--corpus /no/such/corpus.txt", {"no such file"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const TrainRun r = run("train --steps 1 " + c.args, dir);
    EXPECT_EQ(r.code, 1) << shown(r);
    for (const std::string& m : c.says) EXPECT_TRUE(contains(r.err, m)) << m << "\n" << shown(r);
    EXPECT_FALSE(contains(r.err, "internal error")) << shown(r);
    EXPECT_FALSE(contains(r.err, "step   1/1")) << "refused before any step\n" << shown(r);
  }
}

TEST(TrainCli, OneSpellingPerIdeaAcrossSubcommands) {
  // --margin as plan writes it (10%) and as a fraction; the same plan either way.
  TempDir dir;
  const TrainRun pct = run(std::string("train --steps 1 --margin 10% --json - ") + kTiny, dir);
  ASSERT_EQ(pct.code, 0) << shown(pct);
  const TrainRun frac = run(std::string("train --steps 1 --margin 0.1 --json - ") + kTiny, dir);
  ASSERT_EQ(frac.code, 0) << shown(frac);
  const TrainRun bad = run(std::string("train --steps 1 --margin 5 ") + kTiny, dir);
  EXPECT_EQ(bad.code, 1) << shown(bad);
  EXPECT_TRUE(contains(bad.err, "--margin")) << shown(bad);
  // A throttle is none (0) or a link speed with a meaning.
  const TrainRun slow = run(std::string("train --steps 1 --d2h-gbps 1e-300 ") + kTiny, dir);
  EXPECT_EQ(slow.code, 1) << shown(slow);
  EXPECT_TRUE(contains(slow.err, "--d2h-gbps is 1e-300; must be in [1e-06, 1000000] or 0"))
      << shown(slow);
  // --plan wants a plan file.
  const TrainRun not_json = run(std::string("train --steps 1 --plan notes.txt ") + kTiny, dir);
  EXPECT_EQ(not_json.code, 1) << shown(not_json);
  EXPECT_TRUE(contains(not_json.err, "--plan is 'notes.txt'")) << shown(not_json);
  // The help describes the embedded reference models as they are (data/nn/).
  const TrainRun help = run("train --help", dir);
  EXPECT_TRUE(contains(help.out, "4 experts of 256 top-2")) << help.out;
  EXPECT_TRUE(contains(help.out, "8 experts of 32 top-2")) << help.out;
}

TEST(TrainCli, PlanFileFromSpillwayPlanIsAPolicy) {
  TempDir dir;
  const std::string model = std::string(SPILLWAY_DATA_DIR) + "/nn/tiny-moe.json";
  const std::string plan = offload_plan_file(dir, model);
  ASSERT_TRUE(std::filesystem::exists(plan));

  const TrainRun r = run(
      "train --model '" + model + "' --plan '" + plan + "' " + kTiny + " --steps 2 --json -", dir);
  ASSERT_EQ(r.code, 0) << shown(r);
  EXPECT_FALSE(contains(r.err, "deprecated")) << shown(r);
  // The old spelling still works and says it is old.
  const TrainRun old =
      run("train --model '" + model + "' --policy '" + plan + "' " + kTiny + " --steps 2 --json -",
          dir);
  ASSERT_EQ(old.code, 0) << shown(old);
  EXPECT_TRUE(contains(old.err, "--policy FILE is deprecated; write --plan")) << shown(old);
  EXPECT_EQ(parse_or_fail(old.out)["policies"][0]["losses"],
            parse_or_fail(r.out)["policies"][0]["losses"]);
  const Json j = parse_or_fail(r.out);
  ASSERT_TRUE(j.contains("policies")) << r.out.substr(0, 500);
  ASSERT_EQ(j["policies"].size(), 1u);
  const Json& q = j["policies"][0];
  EXPECT_EQ(q.value("name", ""), plan);
  EXPECT_GT(q.value("offloaded_bytes", int64_t{0}), 0) << q.dump(2);
  // The file's prediction is its own, not this run's calibration, and the report says so.
  EXPECT_FALSE(q.value("prediction_calibrated", true)) << q.dump(2);
  const TrainRun table =
      run("train --model '" + model + "' --plan '" + plan + "' " + kTiny + " --steps 2", dir);
  EXPECT_TRUE(contains(table.out, "not calibrated to this run")) << shown(table);
  EXPECT_FALSE(contains(q.value("actions", ""), " 0 offloaded")) << q.dump(2);

  // The plan changes where tensors live, never the math: the same losses as keep.
  const TrainRun k =
      run("train --model '" + model + "' --policy keep " + kTiny + " --steps 2 --json -", dir);
  ASSERT_EQ(k.code, 0) << shown(k);
  const Json kj = parse_or_fail(k.out);
  ASSERT_TRUE(kj.contains("policies")) << k.out.substr(0, 500);
  EXPECT_EQ(q["losses"], kj["policies"][0]["losses"]);
  EXPECT_LT(q.value("peak_device_bytes", int64_t{0}),
            kj["policies"][0].value("peak_device_bytes", int64_t{0}))
      << "the plan offloads and recomputes; keep holds everything";
}

// A plan must be one for the trained model and workload (check_plan_matches): the same
// layer count alone is not enough.
TEST(TrainCli, PlanFileForAnotherModelOrWorkloadIsRefused) {
  TempDir dir;
  const std::string model = std::string(SPILLWAY_DATA_DIR) + "/nn/tiny-moe.json";
  // tiny-moe twice as wide: 4 layers as well.
  Json wide = parse_or_fail(read_file(model));
  wide["hidden_size"] = 128;
  const std::string wide_model = dir.file("wide-moe.json");
  std::ofstream(wide_model) << wide.dump(2);
  struct Case {
    std::string plan_args;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {"--model '" + wide_model + "' " + kTiny + " --dtype fp32",
       {"made for model", "hidden size 128", "hidden size 64"}},
      {"--model '" + model + "' --micro-batch 8 --seq-len 32 --dtype fp32",
       {"made for micro_batch 8; used with micro_batch 2"}},
      {"--model '" + model + "' " + kTiny, {"made for dtype bf16; used with dtype fp32"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.plan_args);
    const std::string plan = dir.file("plan.json");
    const TrainRun p = run(
        "plan " + c.plan_args + " --hardware gh200 --policy offload --quiet --json '" + plan + "'",
        dir);
    ASSERT_TRUE(p.code == 0 || p.code == 3) << shown(p);
    const std::string out = dir.file("out.json");
    const TrainRun r = run("train --model '" + model + "' --policy '" + plan + "' " + kTiny +
                               " --steps 1 --json '" + out + "'",
                           dir);
    EXPECT_EQ(r.code, 1) << shown(r);
    EXPECT_TRUE(contains(r.err, "spillway: error: " + plan + ": made for")) << shown(r);
    for (const std::string& m : c.message)
      EXPECT_TRUE(contains(r.err, m)) << "[" << m << "]\n" << shown(r);
    EXPECT_FALSE(std::filesystem::exists(out)) << "an erroring run left " << out;
  }
}

TEST(TrainCli, SlowLinkSnowballs) {
  TempDir dir;
  const TrainRun r = run(std::string("train --policy offload --d2h-gbps 0.005 --h2d-gbps 0.005 "
                                     "--steps 3 ") +
                             kTiny + " --json -",
                         dir);
  ASSERT_EQ(r.code, 0) << shown(r);
  const Json j = parse_or_fail(r.out);
  ASSERT_TRUE(j.contains("policies")) << r.out.substr(0, 500);
  ASSERT_EQ(j["policies"].size(), 1u);
  const Json& q = j["policies"][0];
  EXPECT_EQ(q.value("name", ""), "offload");
  EXPECT_DOUBLE_EQ(j.value("d2h_gbps", 0.0), 0.005);
  EXPECT_GT(q.value("offloaded_bytes", int64_t{0}), 0);
  ASSERT_TRUE(q.contains("snowball")) << q.dump(2);
  EXPECT_TRUE(q["snowball"].get<bool>()) << q.dump(2);
  EXPECT_TRUE(q["snowball_layer"].is_number_integer()) << q.dump(2);
  EXPECT_GT(q.value("stall_ms", 0.0), 0.0) << "a 5 MB/s link stalls compute\n" << q.dump(2);
}

TEST(TrainCli, CompareGoesOnWhenAPolicyCannotRun) {
  // 4.7 MiB: keep (about 4.9 MiB at this shape) and the planner's auto do not fit;
  // recompute (about 4.5 MiB) does. --compare reports the failures and runs the rest.
  TempDir dir;
  const std::string json = dir.file("train.json");
  const TrainRun r = run(std::string("train --compare --steps 2 --device-memory-mb 4.7 ") + kTiny +
                             " --json '" + json + "'",
                         dir);
  if (crashed(r)) {
    GTEST_SKIP() << "BUG: `spillway train --compare` crashes (exit " << r.code
                 << ") when a policy cannot run: format_train_report and train_report_json "
                    "read steps.front() of the failed policy's empty step list "
                    "(src/train/train_report.cpp); expected the table and JSON to show the "
                    "failure";
  }
  ASSERT_EQ(r.code, 0) << shown(r);
  EXPECT_TRUE(contains(r.err, "keep       failed: policy keep: device memory exhausted"))
      << shown(r);
  EXPECT_TRUE(contains(r.out, "\nrecompute ")) << r.out;
  const Json j = parse_or_fail(read_file(json));
  ASSERT_TRUE(j.contains("policies")) << j.dump(2);
  ASSERT_EQ(j["policies"].size(), kPolicies.size()) << j.dump(2);
  EXPECT_GT(j["policies"][1].value("peak_device_bytes", int64_t{0}), 0) << "recompute ran";
}

// Note [Plans re-timed from their actions]: a plan file edited by hand (an action changed,
// not its times) is named as edited by simulate and train, and re-timed from its actions.
TEST(TrainCli, AnEditedPlanFileIsSaidAndReTimedFromItsActions) {
  TempDir dir;
  const std::string model = std::string(SPILLWAY_DATA_DIR) + "/nn/tiny-moe.json";
  const std::string plan = offload_plan_file(dir, model);
  ASSERT_TRUE(std::filesystem::exists(plan));
  const TrainRun sim0 = run("simulate --plan '" + plan + "' --json -", dir);
  EXPECT_FALSE(contains(sim0.err, "was edited")) << shown(sim0);
  Json doc = parse_or_fail(read_file(plan));
  for (Json& t : doc["layers"][0]["tensors"]) {
    if (t["action"] == "offload") t["action"] = "recompute";
  }
  const std::string edited = dir.file("edited.json");
  std::ofstream(edited) << doc.dump(2);
  const TrainRun sim = run("simulate --plan '" + edited + "' --json -", dir);
  EXPECT_TRUE(sim.code == 0 || sim.code == 3) << shown(sim);
  EXPECT_TRUE(contains(sim.err, "edited.json was edited: the actions of 1 layer(s) (0)"))
      << shown(sim);
  // The simulator recomputes what the edited actions re-run.
  EXPECT_GT(parse_or_fail(sim.out)["recompute_ms"].get<double>(),
            parse_or_fail(sim0.out)["recompute_ms"].get<double>());
  const TrainRun r =
      run("train --model '" + model + "' --plan '" + edited + "' " + kTiny + " --steps 2 --json -",
          dir);
  ASSERT_EQ(r.code, 0) << shown(r);
  const Json j = parse_or_fail(r.out);
  const Json& q = j["policies"][0];
  EXPECT_TRUE(contains(q.value("actions", ""), "was edited")) << q.dump(2);
  EXPECT_TRUE(q.value("prediction_calibrated", false)) << q.dump(2);
}

// Note [Re-planning while training]: a link throttled mid-run makes the layers whose copies
// snowball switch to recompute within two steps, and back within two steps after the
// throttle lifts; each change is in the report; losses bitwise those of a fixed policy.
TEST(TrainCli, AdaptiveRePlansWhenTheLinkSlowsAndAgainWhenItRecovers) {
  // 32 MiB: room for auto's offloading plan however its probe's copies were paced (Note
  // [Auto covers the copies' pace]); at 22 a loaded machine's probe made it recompute.
  TempDir dir;
  const std::string args =
      "--steps 12 --device-memory-mb 32 --d2h-gbps 20 --h2d-gbps 20 --quiet --json - ";
  const TrainRun r = run("train --policy adaptive --link-schedule 5:0.01,9:20 " + args, dir);
  ASSERT_EQ(r.code, 0) << shown(r);
  const Json j = parse_or_fail(r.out);
  const Json& q = j["policies"][0];
  const std::vector<int64_t> moved = q["step_offloaded_bytes"].get<std::vector<int64_t>>();
  ASSERT_EQ(moved.size(), 12u);
  const int64_t before = moved[3];  // step 4, the fast link
  const std::vector<std::string> early = q.value("replans", std::vector<std::string>{});
  for (const std::string& s : early) {
    for (int step = 1; step <= 3; ++step) {
      if (contains(s, fmt::format("re-planned after step {}:", step)) && contains(s, "late"))
        GTEST_SKIP() << "copies were late on the fast link (a loaded machine): " << s;
    }
  }
  ASSERT_GT(before, 0) << q.dump(2);
  // Throttled from step 5: by step 7 the plan moves less, and nothing is late any more.
  EXPECT_LT(moved[6], before) << q.dump(2);
  // Lifted from step 9: by step 11 it moves more again (on a quiet machine, what it moved
  // on the fast link: the link a probe measures there depends on the machine's load).
  EXPECT_GT(moved[10], moved[7]) << q.dump(2);
  ASSERT_TRUE(q.contains("replans")) << q.dump(2);
  const std::vector<std::string> replans = q["replans"].get<std::vector<std::string>>();
  auto after = [&](int step) {
    return std::any_of(replans.begin(), replans.end(), [&](const std::string& s) {
      return contains(s, fmt::format("re-planned after step {}:", step));
    });
  };
  EXPECT_TRUE(after(5) || after(6)) << q.dump(2);
  EXPECT_TRUE(after(9) || after(10)) << q.dump(2);
  EXPECT_TRUE(contains(replans.front(), "GB/s measured")) << replans.front();
  // Where tensors live never changes the arithmetic.
  const TrainRun k = run("train --policy recompute " + args, dir);
  ASSERT_EQ(k.code, 0) << shown(k);
  EXPECT_EQ(q["losses"], parse_or_fail(k.out)["policies"][0]["losses"]);
  // A schedule needs the speed before it.
  const TrainRun bad = run("train --policy adaptive --steps 4 --link-schedule 2:1", dir);
  EXPECT_EQ(bad.code, 1) << shown(bad);
  EXPECT_TRUE(contains(bad.err, "needs d2h_gbps and h2d_gbps") ||
              contains(bad.err, "needs --d2h-gbps and --h2d-gbps"))
      << shown(bad);
  const TrainRun junk = run("train --policy adaptive --steps 4 --link-schedule 2-1", dir);
  EXPECT_EQ(junk.code, 2) << shown(junk);
  EXPECT_TRUE(contains(junk.err, "'2-1' is not STEP:GBPS")) << shown(junk);
}

// Note [A fixed calibration]: with --layer-fwd-ms the re-plans follow the schedule alone
// (the link as scheduled, the layers as fixed, no lateness): two runs on a loaded machine
// re-plan at the same steps to the same plans, and move the same bytes each step.
TEST(TrainCli, AdaptiveWithAFixedCalibrationRePlansTheSameOnEveryRun) {
  TempDir dir;
  const std::string cmd =
      "train --policy adaptive --steps 12 --device-memory-mb 24 --d2h-gbps 20 --h2d-gbps 20 "
      "--link-schedule 5:0.15,9:20 --layer-fwd-ms 5 --quiet --json -";
  const TrainRun a = run(cmd, dir);
  ASSERT_EQ(a.code, 0) << shown(a);
  const TrainRun b = run(cmd, dir);
  ASSERT_EQ(b.code, 0) << shown(b);
  const Json ja = parse_or_fail(a.out), jb = parse_or_fail(b.out);
  const Json& qa = ja["policies"][0];
  const Json& qb = jb["policies"][0];
  ASSERT_TRUE(qa.contains("replans")) << shown(a);
  const std::vector<std::string> replans = qa["replans"].get<std::vector<std::string>>();
  ASSERT_EQ(replans.size(), 2u) << shown(a);
  EXPECT_TRUE(contains(replans[0],
                       "re-planned after step 5: link 0.150 GB/s as scheduled, "
                       "the plan assumed 20.000"))
      << replans[0];
  EXPECT_TRUE(contains(replans[1], "re-planned after step 9: link 20.000 GB/s as scheduled"))
      << replans[1];
  EXPECT_EQ(qa["replans"], qb["replans"]);
  EXPECT_EQ(qa["step_offloaded_bytes"], qb["step_offloaded_bytes"]);
  const std::vector<int64_t> moved = qa["step_offloaded_bytes"].get<std::vector<int64_t>>();
  ASSERT_EQ(moved.size(), 12u);
  EXPECT_LT(moved[5], moved[3]);  // slowed from step 5, re-planned after it
  EXPECT_EQ(moved[9], moved[3]);  // lifted from step 9, re-planned back after it
  // Out of the planner's range: refused, naming the flag.
  const TrainRun bad = run("train --steps 2 --layer-fwd-ms 0", dir);
  EXPECT_EQ(bad.code, 1) << shown(bad);
  EXPECT_TRUE(contains(bad.err, "--layer-fwd-ms is 0")) << shown(bad);
}

}  // namespace
}  // namespace spillway

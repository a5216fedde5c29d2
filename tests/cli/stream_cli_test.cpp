// `spillway stream --explain` run as a user runs it: the mode choice with its numbers,
// the GPUs per link from a PCI tree (a fake sysfs), JSON, and what is not built yet.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>

#include "cli/run_command.hpp"
#include "core/json_io.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using cli_test::contains;
using spillway::testing::TempDir;

struct StreamRun {
  int code = -1;
  std::string out, err;
};

StreamRun run(const std::string& args, const TempDir& dir) {
  const std::string err_path = dir.file("stderr.txt");
  const cli_test::CommandResult c = cli_test::run_command(std::string("'") + SPILLWAY_CLI_PATH +
                                                          "' " + args + " 2>'" + err_path + "'");
  return {c.code, c.out, cli_test::read_file(err_path)};
}

constexpr const char* kPcie = "stream --explain --model Llama-3.1-70B --hardware h100-pcie";

TEST(StreamCli, FourPcieGpusOnOneLinkShardAndTheArithmeticIsShown) {
  TempDir dir;
  const StreamRun r =
      run(std::string(kPcie) + " --gpus-per-link 4 --sysfs " + dir.file("none"), dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "GPUs per link 4 (from --gpus-per-link)")) << r.out;
  EXPECT_TRUE(contains(r.out, "<- chosen")) << r.out;
  EXPECT_TRUE(contains(r.out, "sharded")) << r.out;
  EXPECT_TRUE(contains(r.out, "in-place   not available")) << r.out;
  EXPECT_TRUE(contains(r.out, "simulator (full copy, 4 GPUs on the link)")) << r.out;
  EXPECT_TRUE(contains(r.out, "simulator (sharded, 4 GPUs on the link)")) << r.out;
  EXPECT_TRUE(contains(r.out, "warning: the link cannot hide the copies")) << r.out;
}

TEST(StreamCli, TheGpusPerLinkComeFromThePciTree) {
  TempDir dir;
  namespace fs = std::filesystem;
  const fs::path root = dir.file("sys");
  for (const char* gpu : {"0000:03:00.0", "0000:04:00.0"}) {
    const fs::path d = root / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0" / gpu;
    fs::create_directories(d);
    std::ofstream(d / "vendor") << "0x10de\n";
    std::ofstream(d / "class") << "0x030200\n";
    fs::create_directories(root / "bus" / "pci" / "devices");
    fs::create_symlink(d, root / "bus" / "pci" / "devices" / gpu);
  }
  const StreamRun r = run(std::string(kPcie) + " --sysfs " + root.string() + " --json -", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "GPUs per link 2 (from the PCI tree (2 GPUs in 1 link groups))"))
      << r.out;
  const size_t brace = r.out.find("{\n");
  ASSERT_NE(brace, std::string::npos) << r.out;
  const Json j = Json::parse(r.out.substr(brace));
  EXPECT_EQ(j["schema"], "spillway.stream-choice/1");
  EXPECT_EQ(j["gpus_per_link"], 2);
  EXPECT_EQ(j["chosen"], "sharded");
  ASSERT_EQ(j["modes"].size(), 3u);
  EXPECT_EQ(j["modes"][0]["link_bytes"].get<int64_t>(),
            2 * j["modes"][1]["link_bytes"].get<int64_t>());
}

TEST(StreamCli, OnASuperchipTheWeightsAreReadInPlace) {
  TempDir dir;
  const StreamRun r = run(
      "stream --explain --model Llama-3.1-70B --hardware gh200 --sysfs " + dir.file("none"), dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "(coherent, C2C)")) << r.out;
  EXPECT_TRUE(contains(r.out, "in-place")) << r.out;
  EXPECT_NE(r.out.find("<- chosen"), std::string::npos);
  EXPECT_GT(r.out.find("<- chosen"), r.out.find("in-place "));
}

TEST(StreamCli, ARunStreamsTheReferenceModelBitwiseBesideTheResidentOne) {
  TempDir dir;
  for (const char* mode : {"", " --training --prefetch-depth 2"}) {
    SCOPED_TRACE(mode);
    const StreamRun r = run(std::string("stream --ref-model tiny-moe --steps 2 --micro-batch 1 "
                                        "--seq-len 32 --link-gbps 0.5") +
                                mode + " --json " + dir.file("run.json"),
                            dir);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(contains(r.out, "bitwise identical to the resident model's")) << r.out;
    EXPECT_TRUE(contains(r.out, "all resident")) << r.out;
    EXPECT_TRUE(contains(r.out, "predicted")) << r.out;
    const Json j = Json::parse(cli_test::read_file(dir.file("run.json")));
    EXPECT_EQ(j["schema"], "spillway.stream-run/1");
    EXPECT_EQ(j["bitwise_identical"], true);
    // tiny-moe: 4 layers; training re-streams 4 - (2 + 1) of them in backward.
    EXPECT_GT(j["loads"].get<int64_t>(), 0);
    EXPECT_GT(j["simulator_ms"].get<double>(), 0.0);
    if (std::string(mode).empty()) {
      EXPECT_EQ(j["hits"], 0);
    } else {
      EXPECT_EQ(j["hits"], 2 * 3);  // two steps, the turn's 3 layers each
    }
  }
}

TEST(StreamCli, EmulatedGpusOnOneLinkShardAndCarryEachLayerOnce) {
  // 2 emulated GPUs behind one link: full copy puts every layer on the link twice, sharded
  // once (each GPU copies half and all-gathers); both compute the resident losses. At a
  // link slow enough to be the bottleneck, auto picks sharded.
  TempDir dir;
  const std::string base =
      "stream --ref-model tiny-moe --steps 2 --micro-batch 1 --seq-len 32 --gpus-per-link 2 "
      "--link-gbps 0.05";
  std::map<std::string, Json> runs;
  for (const char* mode : {"full-copy", "sharded", "auto"}) {
    SCOPED_TRACE(mode);
    const StreamRun r =
        run(base + " --mode " + mode + " --json " + dir.file(std::string(mode) + ".json"), dir);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(contains(r.out, "2 emulated GPUs sharing the link")) << r.out;
    runs[mode] = Json::parse(cli_test::read_file(dir.file(std::string(mode) + ".json")));
    EXPECT_EQ(runs[mode]["bitwise_identical"], true);
    EXPECT_EQ(runs[mode]["gpus_per_link"], 2);
    EXPECT_TRUE(runs[mode].contains("simulator_ms"));
  }
  const double full = runs["full-copy"]["link_bytes_per_step"].get<double>();
  const double sharded = runs["sharded"]["link_bytes_per_step"].get<double>();
  EXPECT_NEAR(full / sharded, 2.0, 0.05);
  EXPECT_EQ(runs["sharded"]["mode"], "sharded");
  EXPECT_EQ(runs["auto"]["mode"], "sharded");
  // A training run: the same batch on both GPUs, sharded, bitwise.
  const StreamRun t = run(base + " --training --mode sharded", dir);
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_TRUE(contains(t.out, "bitwise identical")) << t.out;
  EXPECT_TRUE(contains(t.out, "the same on every GPU")) << t.out;
  // Sharding needs peers, and a run emulates at most 16 GPUs.
  StreamRun bad = run("stream --ref-model tiny-moe --mode sharded", dir);
  EXPECT_NE(bad.code, 0);
  EXPECT_TRUE(contains(bad.err, "--gpus-per-link 2 or more")) << bad.err;
  bad = run("stream --gpus-per-link 17", dir);
  EXPECT_EQ(bad.code, 1);
  EXPECT_TRUE(contains(bad.err, "--gpus-per-link is 17")) << bad.err;
  bad = run(std::string(kPcie) + " --mode sharded", dir);
  EXPECT_NE(bad.code, 0);
  EXPECT_TRUE(contains(bad.err, "--mode")) << bad.err;
}

TEST(StreamCli, SimulateStreamsShardedAndTrainingSteps) {
  // spillway simulate --scenario stream: --sharded puts each layer on the shared link once
  // for the 4 GPUs (a quarter of full copy's bytes), --stream-training re-streams backward.
  TempDir dir;
  const std::string base =
      "simulate --model Llama-3.1-70B --hardware h100-pcie --scenario stream --gpus 4 "
      "--gpus-per-link 4 --json - ";
  auto bytes = [&](const std::string& extra) {
    const StreamRun r = run(base + extra, dir);
    EXPECT_EQ(r.code, 0) << r.err;
    const Json j = Json::parse(r.out);
    const Json& s = j.contains("summary") ? j["summary"] : j;
    return std::pair{s["h2d_bytes"].get<double>(), s["step_ms"].get<double>()};
  };
  const auto full = bytes("");
  const auto sharded = bytes("--sharded");
  const auto training = bytes("--stream-training");
  EXPECT_NEAR(sharded.first * 4, full.first, 0.001 * full.first);
  EXPECT_LT(sharded.second, full.second / 3);
  EXPECT_GT(training.first, 1.9 * full.first);
  const StreamRun bad = run("simulate --model Llama-3.1-70B --sharded", dir);
  EXPECT_NE(bad.code, 0);
  EXPECT_TRUE(contains(bad.err, "applies to --scenario stream")) << bad.err;
}

TEST(StreamCli, FlagsOfTheOtherModeAreRefusedNotIgnored) {
  TempDir dir;
  StreamRun r = run("stream --model Llama-3.1-70B --steps 2", dir);
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(contains(r.err, "--model")) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  r = run(std::string(kPcie) + " --link-gbps 3", dir);
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(contains(r.err, "--link-gbps")) << r.err;
  const StreamRun bad = run(std::string(kPcie) + " --gpus-per-link 0", dir);
  EXPECT_EQ(bad.code, 1);  // a bad value, as every command
  EXPECT_TRUE(contains(bad.err, "--gpus-per-link")) << bad.err;
}

}  // namespace
}  // namespace spillway

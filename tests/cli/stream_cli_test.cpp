// `spillway stream --explain` run as a user runs it: the mode choice with its numbers,
// the GPUs per link from a PCI tree (a fake sysfs), JSON, and what is not built yet.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cli/run_command.hpp"
#include "core/json_io.hpp"
#include "spillway/device/device.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using cli_test::contains;
using spillway::testing::expect_error;
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

// A ring that cannot fit in the GPU is never chosen: Llama-3.1-70B at depth 64 on an H100
// PCIe needs 65 slots of a 1.7 GB layer, more than its 80 GB. Every mode is ruled out with
// its numbers and the command exits 3, as `spillway plan` does for an infeasible plan; a
// depth that fits is chosen as before.
TEST(StreamCli, ARingThatDoesNotFitInTheGpuIsNeverChosen) {
  TempDir dir;
  const StreamRun r = run(std::string(kPcie) + " --prefetch-depth 64 --sysfs " + dir.file("none") +
                              " --json " + dir.file("c.json"),
                          dir);
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_TRUE(
      contains(r.out, "full-copy  not available: its ring of 65 slots of the largest layer"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "of HBM free for weights; a prefetch depth of ")) << r.out;
  EXPECT_TRUE(contains(r.out, "no mode can run here")) << r.out;
  EXPECT_FALSE(contains(r.out, "<- chosen")) << r.out;
  const Json j = Json::parse(cli_test::read_file(dir.file("c.json")));
  EXPECT_TRUE(j["chosen"].is_null()) << j.dump();
  EXPECT_GT(j["modes"][0]["ring_bytes"].get<double>(), j["hbm_free_bytes"].get<double>());

  const StreamRun fits =
      run(std::string(kPcie) + " --prefetch-depth 2 --sysfs " + dir.file("none"), dir);
  EXPECT_EQ(fits.code, 0) << fits.err;
  EXPECT_TRUE(contains(fits.out, "<- chosen")) << fits.out;
}

// Note [Checked rate durations]: a link too slow to mean anything is refused by its range,
// and a run whose link time alone would pass an hour is refused before it starts, with the
// numbers and the flag to change.
TEST(StreamCli, ARunThatWouldTakeHoursIsRefusedUpFront) {
  TempDir dir;
  StreamRun r = run("stream --link-gbps 1e-20", dir);
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(contains(r.err, "--link-gbps is 1e-20; must be in [0.001, 100000]")) << r.err;
  const auto t0 = std::chrono::steady_clock::now();
  r = run("stream --link-gbps 0.001 --steps 100000", dir);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.err, "--link-gbps is 0.001; the 100000 streamed steps copy at least"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "more than the 3600 s a run may take; raise --link-gbps to"))
      << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

// The throttle behind every emulated link: bytes / rate as a clock duration, refused where
// it would overflow (1e-20 GB/s wrapped to a negative time and turned the throttle off).
TEST(StreamCli, TheLinkThrottleRefusesTimesThatOverflow) {
  using std::chrono::milliseconds;
  EXPECT_EQ(std::chrono::duration_cast<milliseconds>(transfer_duration(1e9, 1.0)),
            milliseconds(1000));
  expect_error([] { (void)transfer_duration(1e9, 1e-20); }, {"gbps is 1e-20", "more than"});
  expect_error([] { (void)transfer_duration(1e9, 0.0); }, {"gbps is 0"});
  expect_error([] { (void)transfer_duration(1.0, std::nan("")); }, {"gbps is nan"});
  expect_error([] { (void)checked_duration_ms(1e300, "reload_ms"); }, {"reload_ms is 1e+300 ms"});
  expect_error([] { (void)HostLink(1e-20, 1.0); }, {"h2d_gbps is 1e-20"});
  HostDeviceOptions o;
  o.device_bytes = 1 << 20;
  o.d2h_gbps = 1e-20;
  expect_error([&] { (void)make_host_device(o); }, {"d2h_gbps is 1e-20"});
  // A copy whose time passes the bound (2 GB at 1 KB/s: 23 days) is refused when it is
  // enqueued, on the caller's thread, before any byte moves.
  o.d2h_gbps = kMinThrottleGbps;
  const std::unique_ptr<Device> dev = make_host_device(o);
  const Stream s = dev->create_stream(StreamRole::kD2H);
  std::vector<std::byte> a(16), b(16);
  expect_error([&] { dev->copy_async(b.data(), a.data(), size_t{2'000'000'000}, s); },
               {"2000000000 bytes at this rate take", "more than the"});
  dev->synchronize(s);
  dev->destroy_stream(s);
}

}  // namespace
}  // namespace spillway

// `spillway bench serve` as a user runs it: a small run's JSON (the switch copies nothing,
// every MIG profile of the sweep has its slice count, the link bytes follow the dataflows)
// and a GPU without those MIG profiles refused with the profiles it has.
#include <gtest/gtest.h>

#include <string>

#include "cli/run_command.hpp"
#include "core/json_io.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using cli_test::contains;

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

TEST(ServeBenchCli, AGpuWithoutTheProfilesIsRefusedNamingItsOwn) {
  const cli_test::CommandResult r = cli_test::run_command(
      std::string("'") + SPILLWAY_CLI_PATH + "' bench serve --hardware h100-pcie 2>&1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "profile")) << r.out;
  EXPECT_TRUE(contains(r.out, "h100-pcie has")) << r.out;
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

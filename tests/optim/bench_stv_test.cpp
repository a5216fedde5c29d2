// The optimizer-offload pipeline benchmark (bench/bench_stv.cpp) on a tiny workload: its
// bitwise check passes, it runs the three variants with the undo memory each should have,
// every figure is finite, the JSON carries the fields scripts read, and bad options throw
// spillway::Error naming the field. Timings are not asserted (they depend on the machine).
#include "bench_stv.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "spillway/core/error.hpp"
#include "spillway/optim/optim.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

StvBenchOptions tiny() {
  StvBenchOptions o;
  o.buckets = 4;
  o.bucket_elements = 5000;
  o.backward_ms = 4.0;
  o.d2h_gbps = 0.0;
  o.h2d_gbps = 0.0;
  o.threads = 2;
  o.repeats = 1;
  o.steps = 2;
  return o;
}

TEST(BenchStv, TinyRunIsCorrectAndReportsEveryVariant) {
  const StvBenchResult r = run_stv_bench(tiny());
  EXPECT_TRUE(r.correct);
  EXPECT_EQ(r.elements, 20000);
  ASSERT_EQ(r.variants.size(), 3u);
  EXPECT_EQ(r.variants[0].name, "after-backward");
  EXPECT_EQ(r.variants[0].undo_bytes, 0);
  // 4 buckets of 5000 elements, each's second buffers padded to kStateAlignFloats.
  const auto padded = static_cast<int64_t>(optim::state_padded(5000));
  EXPECT_EQ(r.variants[1].undo_bytes, 4 * padded * 12);
  EXPECT_GE(r.variants[2].device_buckets, 1);
  EXPECT_EQ(r.variants[2].undo_bytes, (4 - r.variants[2].device_buckets) * padded * 12);
  for (const StvBenchVariant& v : r.variants) {
    EXPECT_EQ(v.samples_tail_ms.size(), 2u) << v.name;
    EXPECT_TRUE(std::isfinite(v.tail_ms)) << v.name;
    EXPECT_GE(v.backward_ms, 4.0) << v.name << ": backward lasts its schedule";
    EXPECT_GE(v.step_ms, v.backward_ms) << v.name;
  }
  EXPECT_GT(r.bucket_lanes_ms, 0.0);
  EXPECT_GT(r.bucket_step_ms, 0.0);
  EXPECT_EQ(r.bucket_link_ms, 0.0);  // unthrottled
  EXPECT_DOUBLE_EQ(r.bucket_cpu_ms, r.bucket_lanes_ms + r.bucket_step_ms);
  EXPECT_GT(r.bucket_device_ms, 0.0);
  EXPECT_GE(r.options.device_buckets, 0);
  EXPECT_EQ(r.options.threads, 2);

  const nlohmann::json j = nlohmann::json::parse(stv_bench_json(r));
  EXPECT_EQ(j["schema"], "spillway.bench.optim_offload/1");
  for (const char* key :
       {"correct", "stv_tail_ratio", "stv_step_ratio", "variants", "split", "workload"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["variants"].size(), 3u);
  EXPECT_TRUE(j["variants"][1].contains("tail_ms"));
  const std::string text = format_stv_bench(r);
  EXPECT_NE(text.find("after-backward"), std::string::npos) << text;
  EXPECT_NE(text.find("bitwise"), std::string::npos) << text;
}

TEST(BenchStv, BadOptionsNameTheField) {
  auto expect_error = [](const StvBenchOptions& o, std::string_view field) {
    spillway::testing::expect_error([&] { check_stv_bench_options(o); }, {field});
  };
  StvBenchOptions o = tiny();
  o.buckets = 0;
  expect_error(o, "--buckets");
  o = tiny();
  o.bucket_elements = 0;
  expect_error(o, "--bucket-elements");
  o = tiny();
  o.backward_ms = -1;
  expect_error(o, "--backward-ms");
  o = tiny();
  o.d2h_gbps = std::nan("");
  expect_error(o, "--d2h-gbps");
  o = tiny();
  o.h2d_gbps = -1;
  expect_error(o, "--h2d-gbps");
  o = tiny();
  o.device_buckets = 5;
  expect_error(o, "--device-buckets");
  o = tiny();
  o.repeats = 0;
  expect_error(o, "--repeats");
  o = tiny();
  o.bucket_elements = size_t{1} << 30;
  o.buckets = 8;
  expect_error(o, "bucket_elements");
}

}  // namespace
}  // namespace spillway

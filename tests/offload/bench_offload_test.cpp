// The offload benchmark (bench/bench_offload.cpp) on a tiny workload: its correctness pass
// succeeds, steady state allocates nothing, every figure is positive and finite, and the
// JSON carries the five fields scripts read. Timing values are not asserted (they depend
// on the machine); their presence and sign are.
#include "bench_offload.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"

namespace spillway {
namespace {

OffloadBenchOptions tiny() {
  OffloadBenchOptions o;
  o.layers = 4;
  o.tensors_per_layer = 3;
  o.tensor_bytes = size_t{1} << 20;
  o.steps = 3;
  o.repeats = 1;
  o.overhead_layers = 4;
  o.overhead_tensors_per_layer = 50;
  return o;
}

void expect_positive(double v, const char* what) {
  EXPECT_TRUE(std::isfinite(v) && v > 0.0) << what << " = " << v;
}

TEST(BenchOffload, TinyRunIsCorrectAllocatesNothingAndReportsEveryFigure) {
  const OffloadBenchOptions o = tiny();
  const OffloadBenchResult r = run_offload_bench(o);

  EXPECT_TRUE(r.correct);
  const int64_t bytes_per_step = int64_t{4} * 3 * (1 << 20);
  EXPECT_EQ(r.bytes_per_step, bytes_per_step);
  EXPECT_EQ(r.bytes_checked, bytes_per_step * o.repeats);          // warm-up: every byte
  EXPECT_EQ(r.stamps_checked, 4 * 3 * (o.steps - 1) * o.repeats);  // timed steps: stamps
  EXPECT_EQ(r.allocations_steady_state, 0);
  EXPECT_EQ(r.allocations_first_step, 0);
  EXPECT_EQ(r.fallbacks_steady_state, 0);
  EXPECT_EQ(r.steady_steps, (o.steps - 1) * o.repeats);
  EXPECT_EQ(r.memcpy_samples_gbps.size(), static_cast<size_t>(r.steady_steps));
  EXPECT_EQ(r.offload_samples_gbps.size(), static_cast<size_t>(r.steady_steps));
  EXPECT_EQ(r.reload_samples_gbps.size(), static_cast<size_t>(r.steady_steps));
  EXPECT_EQ(r.overhead_samples_us.size(), static_cast<size_t>((o.steps - 1) * o.repeats));
  EXPECT_EQ(r.overhead_tensors_per_step, 200);

  expect_positive(r.memcpy_gbps, "memcpy_gbps");
  expect_positive(r.offload_gbps, "offload_gbps");
  expect_positive(r.reload_gbps, "reload_gbps");
  expect_positive(r.offload_ratio, "offload_ratio");
  expect_positive(r.reload_ratio, "reload_ratio");
  expect_positive(r.overhead_us_per_tensor, "overhead_us_per_tensor");
  expect_positive(r.offload_us, "offload_us");
  expect_positive(r.reload_us, "reload_us");
  expect_positive(r.free_us, "free_us");
  expect_positive(r.loop_wall_us, "loop_wall_us");
  EXPECT_NEAR(r.offload_ratio, r.offload_gbps / r.memcpy_gbps, 1e-12);
  // Per step the whole loop contains the timed calls, so its median is not below theirs.
  EXPECT_GE(r.loop_wall_us, r.overhead_us_per_tensor);

  const nlohmann::json j = nlohmann::json::parse(offload_bench_json(r));
  EXPECT_EQ(j.at("schema"), "spillway.bench.offload/1");
  for (const char* field : {"offload_gbps", "reload_gbps", "memcpy_gbps", "overhead_us_per_tensor",
                            "allocations_steady_state"}) {
    ASSERT_TRUE(j.contains(field)) << field;
    EXPECT_TRUE(j.at(field).is_number()) << field;
  }
  EXPECT_DOUBLE_EQ(j.at("offload_gbps").get<double>(), r.offload_gbps);
  EXPECT_DOUBLE_EQ(j.at("reload_gbps").get<double>(), r.reload_gbps);
  EXPECT_DOUBLE_EQ(j.at("memcpy_gbps").get<double>(), r.memcpy_gbps);
  EXPECT_DOUBLE_EQ(j.at("overhead_us_per_tensor").get<double>(), r.overhead_us_per_tensor);
  EXPECT_EQ(j.at("allocations_steady_state").get<int64_t>(), 0);
  EXPECT_TRUE(j.at("correct").get<bool>());

  const std::string table = format_offload_bench(r);
  for (const char* text :
       {"baseline (memcpy)", "offload (D2H) GB/s", "reload (H2D) GB/s", "CPU overhead us/tensor",
        ">= 0.90 x memcpy", "< 2.0 us", "worker threads doing memcpy"}) {
    EXPECT_NE(table.find(text), std::string::npos) << text << "\n" << table;
  }
}

TEST(BenchOffload, OddTensorSizesRoundTripEveryByte) {
  OffloadBenchOptions o = tiny();
  o.layers = 2;
  o.tensors_per_layer = 2;
  o.tensor_bytes = (size_t{64} << 10) + 5;  // a tail that is not a whole word
  o.steps = 2;
  o.overhead_layers = 2;
  o.overhead_tensors_per_layer = 10;
  o.overhead_tensor_bytes = 1000;
  const OffloadBenchResult r = run_offload_bench(o);
  EXPECT_TRUE(r.correct);
  EXPECT_EQ(r.bytes_checked, 4 * static_cast<int64_t>(o.tensor_bytes));
  EXPECT_EQ(r.allocations_steady_state, 0);
}

TEST(BenchOffload, BadOptionsNameTheField) {
  OffloadBenchOptions o = tiny();
  o.steps = 1;
  try {
    run_offload_bench(o);
    FAIL() << "steps = 1 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("steps is 1"), std::string::npos) << e.what();
  }
  o = tiny();
  o.tensor_bytes = 0;
  EXPECT_THROW(run_offload_bench(o), Error);
}

// --backend cuda (Note [Offload bench backends]): on a GPU the same tiny run is correct and
// its limit is the link, both directions measured; without one it is refused, saying why.
TEST(BenchOffload, OnCudaTheLimitIsTheLinkOrTheRunSaysThereIsNoDevice) {
  OffloadBenchOptions o = tiny();
  o.cuda = true;
  std::string why;
  if (make_cuda_device(0, &why) == nullptr) {
    try {
      (void)run_offload_bench(o);
      FAIL() << "--backend cuda ran without a CUDA device";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--backend cuda"), std::string::npos) << e.what();
      // A build without the CUDA backend (the sanitizer builds) says that instead.
      const std::string what = e.what();
      EXPECT_TRUE(what.find("no CUDA device") != std::string::npos ||
                  what.find("built without the CUDA backend") != std::string::npos)
          << what;
    }
    return;
  }
  const OffloadBenchResult r = run_offload_bench(o);
  EXPECT_TRUE(r.correct);
  EXPECT_EQ(r.limit, "pinned link");
  EXPECT_EQ(r.bytes_checked, r.bytes_per_step * o.repeats);
  EXPECT_GT(r.stamps_checked, 0);
  expect_positive(r.limit_d2h_gbps, "limit_d2h_gbps");
  expect_positive(r.limit_h2d_gbps, "limit_h2d_gbps");
  EXPECT_NEAR(r.offload_ratio, r.offload_gbps / r.limit_d2h_gbps, 1e-12);
  EXPECT_EQ(r.allocations_steady_state, 0);
}

}  // namespace
}  // namespace spillway

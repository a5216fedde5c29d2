// The AdamW benchmark (bench/bench_adam.cpp) on a tiny workload: its bitwise SIMD-vs-scalar
// check passes, every figure is positive and finite, the JSON carries the fields scripts
// read, a torch that cannot run is skipped with its reason, and bad options throw
// spillway::Error naming the field. Timing values are not asserted (they depend on the
// machine); their presence and sign are.
#include "bench_adam.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "spillway/core/error.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

AdamBenchOptions tiny() {
  AdamBenchOptions o;
  o.elements = size_t{1} << 16;
  o.repeats = 1;
  o.steps = 2;
  o.torch = false;
  o.triad_elements = size_t{1} << 20;  // small: the test times nothing that matters
  return o;
}

void expect_positive(double v, const char* what) {
  EXPECT_TRUE(std::isfinite(v) && v > 0.0) << what << " = " << v;
}

TEST(BenchAdam, TinyRunIsCorrectAndReportsEveryFigure) {
  const AdamBenchOptions o = tiny();
  const AdamBenchResult r = run_adam_bench(o);

  EXPECT_TRUE(r.correct);
  EXPECT_EQ(r.elements_checked, int64_t{1 << 16} * o.check_steps);
  EXPECT_GE(r.threads, 1);
  EXPECT_EQ(r.options.threads, r.threads);
  EXPECT_NE(r.options.seed, 0u);  // resolved and printed
  EXPECT_FALSE(r.simd_target.empty());
  EXPECT_DOUBLE_EQ(r.bytes_per_element, 30.0);  // 28 + the bf16 copy
  EXPECT_DOUBLE_EQ(r.triad_bytes_per_element, 16.0);
  const size_t samples = static_cast<size_t>(o.repeats) * static_cast<size_t>(o.steps);
  EXPECT_EQ(r.samples_elements_per_s.size(), samples);
  EXPECT_EQ(r.samples_triad_gbps.size(), samples);
  EXPECT_EQ(r.samples_scalar_elements_per_s.size(), samples);
  EXPECT_TRUE(r.samples_torch_elements_per_s.empty());

  expect_positive(r.elements_per_s, "elements_per_s");
  expect_positive(r.state_gbps, "state_gbps");
  expect_positive(r.triad_gbps, "triad_gbps");
  expect_positive(r.fraction_of_triad, "fraction_of_triad");
  expect_positive(r.scalar_elements_per_s, "scalar_elements_per_s");
  expect_positive(r.scalar_ratio, "scalar_ratio");
  EXPECT_NEAR(r.state_gbps, r.elements_per_s * 30.0 / 1e9, 1e-9 * r.state_gbps);
  EXPECT_NEAR(r.fraction_of_triad, r.state_gbps / r.triad_gbps, 1e-12);
  EXPECT_NEAR(r.scalar_ratio, r.elements_per_s / r.scalar_elements_per_s, 1e-12);
  EXPECT_FALSE(r.torch_ran);
  EXPECT_NE(r.torch_skip_reason.find("--no-torch"), std::string::npos) << r.torch_skip_reason;

  const nlohmann::json j = nlohmann::json::parse(adam_bench_json(r));
  EXPECT_EQ(j.at("schema"), "spillway.bench.adam/1");
  for (const char* field :
       {"elements_per_s", "state_gbps", "triad_gbps", "fraction_of_triad", "scalar_ratio"}) {
    ASSERT_TRUE(j.contains(field)) << field;
    EXPECT_TRUE(j.at(field).is_number()) << field;
  }
  EXPECT_DOUBLE_EQ(j.at("elements_per_s").get<double>(), r.elements_per_s);
  EXPECT_DOUBLE_EQ(j.at("fraction_of_triad").get<double>(), r.fraction_of_triad);
  ASSERT_TRUE(j.contains("torch_ratio"));
  EXPECT_TRUE(j.at("torch_ratio").is_null());
  EXPECT_EQ(j.at("simd_target").get<std::string>(), r.simd_target);
  EXPECT_EQ(j.at("threads").get<int>(), r.threads);
  EXPECT_EQ(j.at("samples").at("elements_per_s").size(), samples);
  EXPECT_EQ(j.at("samples").at("triad_gbps").size(), samples);
  EXPECT_TRUE(j.at("correct").get<bool>());

  const std::string table = format_adam_bench(r);
  EXPECT_NE(table.find("state traffic GB/s"), std::string::npos) << table;
  EXPECT_NE(table.find("torch: skipped"), std::string::npos) << table;
}

// Note [The step's passes]: each pass of CPUAdamW's paths timed, interleaved, against the
// in-place step; none without --passes.
TEST(BenchAdam, PassesAreEachTimedAgainstTheInPlaceStep) {
  EXPECT_TRUE(run_adam_bench(tiny()).passes.empty());
  AdamBenchOptions o = tiny();
  o.passes = true;
  o.repeats = 2;
  const AdamBenchResult r = run_adam_bench(o);
  const std::vector<double> bytes{28, 32, 28, 32, 32, 4};
  ASSERT_EQ(r.passes.size(), bytes.size());
  for (size_t k = 0; k < bytes.size(); ++k) {
    const AdamPass& p = r.passes[k];
    SCOPED_TRACE(p.name);
    EXPECT_DOUBLE_EQ(p.bytes_per_element, bytes[k]);
    EXPECT_EQ(p.samples_ms.size(), 4u);  // repeats x steps
    expect_positive(p.ms, "ms");
    EXPECT_NEAR(p.relative, p.ms / r.passes[0].ms, 1e-12);
  }
  EXPECT_DOUBLE_EQ(r.passes[0].relative, 1.0);
  EXPECT_NE(r.passes[0].name.find("in place"), std::string::npos);
  EXPECT_NE(r.passes[4].name.find("norm lanes"), std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(adam_bench_json(r));
  ASSERT_EQ(j.at("passes").size(), bytes.size());
  EXPECT_EQ(j.at("passes")[3].at("name").get<std::string>(), r.passes[3].name);
  EXPECT_DOUBLE_EQ(j.at("passes")[5].at("relative_to_in_place").get<double>(),
                   r.passes[5].relative);
  const std::string table = format_adam_bench(r);
  EXPECT_NE(table.find("passes (Note [The step's passes])"), std::string::npos) << table;
  EXPECT_NE(table.find(r.passes[1].name), std::string::npos) << table;
}

TEST(BenchAdam, OddSizeWithoutCopyAndATorchThatCannotRun) {
  AdamBenchOptions o = tiny();
  o.elements = 4099;  // not a multiple of any vector width or thread count
  o.copy_bf16 = false;
  o.threads = 2;
  o.torch = true;
  o.python = "/nonexistent/python3";
  const AdamBenchResult r = run_adam_bench(o);
  EXPECT_TRUE(r.correct);
  EXPECT_EQ(r.threads, 2);
  EXPECT_DOUBLE_EQ(r.bytes_per_element, 28.0);
  EXPECT_FALSE(r.torch_ran);
  EXPECT_NE(r.torch_skip_reason.find("/nonexistent/python3"), std::string::npos)
      << r.torch_skip_reason;
  expect_positive(r.elements_per_s, "elements_per_s");
  EXPECT_TRUE(nlohmann::json::parse(adam_bench_json(r)).at("torch_ratio").is_null());
  EXPECT_FALSE(r.torch_fused_ran);
  EXPECT_TRUE(nlohmann::json::parse(adam_bench_json(r)).at("torch_fused_ratio").is_null());
}

void expect_error_naming(const AdamBenchOptions& o, std::string_view field) {
  spillway::testing::expect_error([&] { (void)run_adam_bench(o); }, {field});
}

TEST(BenchAdam, BadOptionsThrowNamingTheField) {
  AdamBenchOptions o = tiny();
  o.elements = 0;
  expect_error_naming(o, "elements (--elements) is 0");
  o = tiny();
  o.repeats = 0;
  expect_error_naming(o, "repeats (--repeats) is 0");
  o = tiny();
  o.steps = -1;
  expect_error_naming(o, "steps (--steps) is -1");
  o = tiny();
  o.threads = -2;
  expect_error_naming(o, "threads (--threads) is -2");
  o = tiny();
  o.check_steps = 0;
  expect_error_naming(o, "check_steps (--check-steps) is 0");
  o = tiny();
  o.elements = size_t{1} << 40;
  expect_error_naming(o, "elements (--elements)");
}

}  // namespace
}  // namespace spillway

// bench gemm (bench/bench_gemm.hpp): the backend-independent figures from given samples
// (summarize_gemm_bench), and the CUDA twin's refusals on a machine without a GPU.
#include "bench_gemm.hpp"

#include <gtest/gtest.h>

#include <string>

#include "cuda/gemm_cuda.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/core/error.hpp"

namespace spillway {
namespace {

// Efficiency = FLOPs / median ms over the limit, capped at 1; the limit is --peak-gflops
// when given, else the baseline's median rate.
TEST(BenchGemm, FiguresFromGivenSamples) {
  GemmBenchResult r;
  r.options.square = 1000;
  r.samples_square_gflops = {90.0, 100.0, 300.0};  // median 100
  GemmShapeResult s;
  s.op.kind = MeasuredKind::kGemm;
  s.op.shape.m = 100;
  s.op.shape.n = 200;
  s.op.shape.k = 50;                 // 2 MB FLOPs = 2e6
  s.samples_ms = {0.05, 0.04, 1.0};  // median 0.05 ms: 40 GFLOP/s
  GemmShapeResult fast = s;
  fast.samples_ms = {0.001, 0.001, 0.001};  // 2000 GFLOP/s, above the limit
  GemmShapeResult grouped = s;
  grouped.op.kind = MeasuredKind::kGroupedGemm;
  grouped.op.shape.experts = 4;          // 8e6 FLOPs
  grouped.samples_ms = {0.1, 0.1, 0.1};  // 80 GFLOP/s
  r.shapes = {s, fast, grouped};
  summarize_gemm_bench(r);
  EXPECT_DOUBLE_EQ(r.square_gflops, 100.0);
  EXPECT_TRUE(r.limit_measured);
  EXPECT_DOUBLE_EQ(r.limit_gflops, 100.0);
  EXPECT_DOUBLE_EQ(r.shapes[0].op.ms, 0.05);
  EXPECT_NEAR(r.shapes[0].gflops, 40.0, 1e-9);
  EXPECT_NEAR(r.shapes[0].op.efficiency, 0.4, 1e-12);
  EXPECT_DOUBLE_EQ(r.shapes[1].op.efficiency, 1.0);  // capped
  EXPECT_NEAR(r.shapes[2].gflops, 80.0, 1e-9);
  // A given peak (what a cuda run always has: the profile's bf16 peak) is the limit.
  r.options.peak_gflops = 989000.0;  // h100-sxm dense bf16
  summarize_gemm_bench(r);
  EXPECT_FALSE(r.limit_measured);
  EXPECT_DOUBLE_EQ(r.limit_gflops, 989000.0);
  EXPECT_NEAR(r.shapes[0].op.efficiency, 40.0 / 989000.0, 1e-15);
}

TEST(BenchGemm, CudaBackendNeedsAPeakAndSaysWhenItCannotRun) {
  GemmBenchOptions o;
  o.backend = "cuda";
  o.seq_len = 64;
  o.repeats = 1;
  try {
    (void)run_gemm_bench(o);
    ADD_FAILURE() << "no --hardware and no --peak-gflops";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("give --hardware PROFILE"), std::string::npos) << e.what();
  }
  o.hardware = "h100-sxm";
  try {
    const GemmBenchResult r = run_gemm_bench(o);
    // A machine with a GPU: the run is checked and bf16.
    EXPECT_TRUE(r.correct);
    EXPECT_NEAR(r.limit_gflops, load_hardware("h100-sxm").bf16_dense.value * 1e3, 1e-6);
    for (const GemmShapeResult& s : r.shapes) EXPECT_EQ(s.op.dtype, DType::kBf16);
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(m.find("no CUDA device on this machine") != std::string::npos ||
                m.find("this build has no CUDA backend") != std::string::npos)
        << m;
    EXPECT_EQ(cuda_bench::compiled(), m.find("no CUDA backend") == std::string::npos);
  }
  o.backend = "tpu";
  EXPECT_THROW((void)run_gemm_bench(o), Error);
}

}  // namespace
}  // namespace spillway

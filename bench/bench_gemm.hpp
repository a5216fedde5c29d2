// The GEMM efficiency benchmark (`spillway bench gemm`): times the host backend's GEMMs
// (cblas sgemm through nn::gemm, what the reference model src/nn runs) at the shapes the
// planner's inventory gives a model and workload, and writes them as measured kernels of a
// calibration profile ({"ops": [...]}, schema spillway.profile/1) that `spillway plan
// --profile` merges into the efficiency curves (Note [Efficiency curves]).
//
// Method:
//   shapes       the distinct GEMMs of the model's distinct layers (build_inventory, the
//                forward of each: m x k by k x n; a grouped expert GEMM is `experts` GEMMs
//                of ceil(tokens per expert) rows, one cblas call per expert, as the
//                reference model runs them).
//   correctness  before anything is timed, every shape's output (poisoned with NaN first)
//                must be finite everywhere and match a double-precision dot product at
//                `check_points` random elements per GEMM within 1e-4 x sqrt(k) relative
//                (inputs uniform in [-1, 1], the seed printed); a mismatch throws naming the
//                shape, the element and both values.
//   baseline     a square GEMM of side `square` (default 2048) in the same run: the large
//                dense GEMM the planner's former constant stood for.
//   limit        `peak_gflops` when given (the machine's theoretical fp32 peak), else the
//                baseline's rate (said so): efficiencies are rates over this limit.
//   timing       after one untimed round, each repeat runs the baseline then every shape
//                once (interleaved; this machine's clock drifts); figures are medians.
// The CUDA twin (--backend cuda, bench/cuda/gemm_cuda.hpp): cuBLAS bf16 GEMMs (fp32
// accumulation) at the same shapes, checked the same way in bf16, timed with CUDA events;
// the limit is the hardware profile's dense bf16 peak (--hardware) or --peak-gflops. It
// has not run on this project's machines, which have no GPU: `bench gemm --backend cuda`
// there says so and writes nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/plan/plan.hpp"

namespace spillway {

struct GemmBenchOptions {
  std::string model = "Qwen3-30B-A3B";
  int64_t micro_batch = 1;
  int64_t seq_len = 512;  // small: a CPU runs ~1e11 FLOP/s, the full shapes take minutes
  int64_t tp = 1;
  int64_t ep = 8;
  int64_t square = 2048;     // the baseline's side
  double peak_gflops = 0.0;  // the limit; 0: the baseline's rate
  int repeats = 3;
  int threads = 1;  // OpenBLAS threads
  int check_points = 64;
  uint64_t seed = 0;             // 0: a fresh one (printed)
  std::string backend = "host";  // "host" (cblas sgemm, fp32) or "cuda" (cuBLAS, bf16)
  std::string hardware;          // cuda: the profile whose dense bf16 peak is the limit
};

struct GemmShapeResult {
  std::string ops;  // the inventory ops with this shape, "mlp.gate, mlp.up"
  MeasuredOp op;    // kind, shape, dtype fp32, ms (median), efficiency (over the limit)
  double gflops = 0.0;
  std::vector<double> samples_ms;
};

struct GemmBenchResult {
  GemmBenchOptions options;  // as run (seed resolved)
  bool correct = false;      // a failure throws: a result always has correct == true
  int64_t elements_checked = 0;
  double square_gflops = 0.0;  // baseline, median
  std::vector<double> samples_square_gflops;
  double limit_gflops = 0.0;
  bool limit_measured = true;  // the limit is the baseline's rate (no peak_gflops)
  std::string limit_source;    // what the limit is, in words
  std::string device;          // what ran the GEMMs
  std::vector<GemmShapeResult> shapes;
};

// The figures from the samples (the backend-independent part of run_gemm_bench, tested
// with given samples): per shape its median ms, GFLOP/s and efficiency = GFLOP/s over the
// limit, capped at 1; the baseline's median; the limit: options.peak_gflops when given,
// else the baseline's rate (host) -- a cuda run always has a peak.
void summarize_gemm_bench(GemmBenchResult& result);

// The distinct GEMM shapes of a model's inventory (what run_gemm_bench times).
std::vector<GemmShapeResult> gemm_bench_shapes(const GemmBenchOptions& options);
GemmBenchResult run_gemm_bench(const GemmBenchOptions& options);
// spillway.profile/1 with "ops" (ms, efficiency, gflops per shape) and "bench" (the run).
std::string gemm_bench_json(const GemmBenchResult& result);
std::string format_gemm_bench(const GemmBenchResult& result);

}  // namespace spillway

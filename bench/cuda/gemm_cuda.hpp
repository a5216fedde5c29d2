// The CUDA twin of `spillway bench gemm` (bench_gemm.hpp): cuBLAS bf16 GEMMs (bf16 inputs
// and output, fp32 accumulation: what training runs) at given shapes, checked, then timed
// with CUDA events. Plain C++: no CUDA type crosses this header. Built from gemm_cuda.cu
// with the CUDA backend, else from gemm_cuda_none.cpp, whose functions say so.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spillway::cuda_bench {

// `batch` GEMMs of (m x k) by (k x n), row-major (a grouped expert GEMM: one per expert).
struct GemmShape {
  int64_t m = 0, n = 0, k = 0, batch = 1;
};

struct GemmTiming {
  std::string device;                         // "NVIDIA H100 80GB HBM3 (sm_90)"
  std::vector<double> square_ms;              // the baseline square GEMM, one per repeat
  std::vector<std::vector<double>> shape_ms;  // per shape, one per repeat
  int64_t elements_checked = 0;
};

// True when this build has the CUDA backend (then time_bf16_gemms may find a device).
bool compiled();

// Method: inputs uniform in [-1, 1] rounded to bf16 on the host from `seed` (so the host
// can check), outputs poisoned with NaN; every shape (and the baseline square GEMM of side
// `square`) runs once and is checked: every output finite, and `check_points` random
// elements per GEMM within 4e-3 x sum |a_l b_l| of a double dot product of the bf16
// inputs (bf16 output rounding is 2^-9 relative; fp32 accumulation adds k 2^-24); then
// one untimed round, then `repeats` rounds of the baseline and every shape, interleaved,
// each timed with CUDA events. Throws spillway::Error: without a device ("no CUDA device
// on this machine ..."), naming the failing call (CUDA or cuBLAS), or naming the shape,
// element and both values when a check fails.
GemmTiming time_bf16_gemms(const std::vector<GemmShape>& shapes, int64_t square, int repeats,
                           int check_points, uint64_t seed);

}  // namespace spillway::cuda_bench

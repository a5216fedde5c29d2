// The launcher of HybridGEMM's CUDA kernels (hybrid_gemm_kernels.cu), in C++17 for nvcc:
// plain arguments, no spillway type that needs C++20. hybrid_gemm_cuda
// (src/serve/hybrid_gemm_cuda.cpp) checks the problem and calls it.
#pragma once

#include <cstdint>

namespace spillway::cuda {

struct HybridGemmArgs {
  int64_t m = 0, n = 0, k = 0;
  int64_t ns = 0;  // columns [0, ns) symmetric, [ns, n) asymmetric
  bool w_bf16 = true;
  int64_t sym_m = 0, sym_n = 0, sym_k = 0;     // symmetric tiles
  int64_t asym_m = 0, asym_n = 0, asym_k = 0;  // asymmetric tiles
};

inline constexpr int kHybridGemmThreads = 256;
inline constexpr int64_t kHybridGemmOutputsPerThread = 16;
inline constexpr int64_t kHybridGemmSharedBytes = int64_t{48} * 1024;

// Enqueues both paths on `stream` (a cudaStream_t); x, o device memory, w mapped host
// memory. Throws spillway::Error when a launch fails.
void launch_hybrid_gemm(const HybridGemmArgs& a, const float* x, const void* w, float* o,
                        void* stream);

}  // namespace spillway::cuda

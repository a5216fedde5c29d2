// The launcher of HybridGEMM's CUDA kernels (hybrid_gemm_kernels.cu), the CUDA backend's
// Device::hybrid_gemm (Note [HybridGEMM as a device operation]), in C++17 for nvcc.
#pragma once

#include <cstdint>
#include <string>

#include "spillway/device/device.hpp"

namespace spillway::cuda {

inline constexpr int kHybridGemmThreads = 256;
inline constexpr int64_t kHybridGemmOutputsPerThread = 16;
inline constexpr int64_t kHybridGemmSharedBytes = int64_t{48} * 1024;

// The first tile shape the kernels cannot take (shared memory, outputs per block), "MxNxK",
// and the rule it breaks; `tiles` empty when both fit. Checked before anything is launched.
struct HybridGemmTilesRefusal {
  std::string tiles;
  std::string rule;
};
HybridGemmTilesRefusal hybrid_gemm_tiles_refusal(const DeviceHybridGemm& a);

// Enqueues both paths on `stream` (a cudaStream_t); x, o device memory, w mapped host
// memory; with a.traffic set, the counting kernels add to it (Note [Counted HybridGEMM
// kernels] in hybrid_gemm_kernels.cu). Throws spillway::Error when a launch fails.
void launch_hybrid_gemm(const DeviceHybridGemm& a, void* stream);

}  // namespace spillway::cuda

// What HybridGEMM's kernels (hybrid_gemm_kernels.cu) can take, checked on the host before a
// launch: plain C++, so the check is tested in a build with the CUDA backend and no GPU.
#include <fmt/format.h>

#include <string>

#include "device/cuda/hybrid_gemm_kernels.hpp"

namespace spillway::cuda {

HybridGemmTilesRefusal hybrid_gemm_tiles_refusal(const DeviceHybridGemm& a) {
  for (const DeviceGemmTiles* g : {&a.symmetric, &a.asymmetric}) {
    const int64_t shared = (g->m + g->n) * g->k * static_cast<int64_t>(sizeof(float));
    const int64_t outputs = kHybridGemmOutputsPerThread * kHybridGemmThreads;
    if (g->m <= 0 || g->n <= 0 || g->k <= 0 || shared > kHybridGemmSharedBytes ||
        g->m * g->n > outputs)
      return {fmt::format("{}x{}x{}", g->m, g->n, g->k),
              fmt::format("the CUDA kernels take tiles of at most {} bytes of shared memory "
                          "((m + n) * k * 4: {}) and {} outputs per block (m * n: {}), each "
                          "side > 0",
                          kHybridGemmSharedBytes, shared, outputs, g->m * g->n)};
  }
  return {};
}

}  // namespace spillway::cuda

// bench gemm's CUDA twin in a build without the CUDA backend (gemm_cuda.hpp).
#include "cuda/gemm_cuda.hpp"
#include "spillway/core/error.hpp"

namespace spillway::cuda_bench {

bool compiled() {
  return false;
}

GemmTiming time_bf16_gemms(const std::vector<GemmShape>& /*shapes*/, int64_t /*square*/,
                           int /*repeats*/, int /*check_points*/, uint64_t /*seed*/) {
  SPILLWAY_INPUT_ERROR(
      "bench gemm --backend cuda: this build has no CUDA backend (configured with "
      "SPILLWAY_CUDA=OFF or without nvcc); the host backend is --backend host");
}

}  // namespace spillway::cuda_bench

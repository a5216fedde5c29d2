// bench gemm's CUDA twin on a GPU (bench/cuda/gemm_cuda.hpp): two small shapes, one of
// them batched, checked and timed. Skips without a device.
#include "cuda/gemm_cuda.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace spillway::cuda_bench {
namespace {

TEST(GemmCuda, SmallShapesAreCheckedAndTimed) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "no CUDA device on this machine";
  }
  const GemmTiming t = time_bf16_gemms({{64, 96, 128, 1}, {32, 64, 48, 4}}, 256, 3, 16, 7);
  EXPECT_FALSE(t.device.empty());
  EXPECT_EQ(t.square_ms.size(), 3u);
  ASSERT_EQ(t.shape_ms.size(), 2u);
  for (const auto& v : t.shape_ms) {
    ASSERT_EQ(v.size(), 3u);
    for (double ms : v) EXPECT_GT(ms, 0.0);
  }
  EXPECT_EQ(t.elements_checked, 16 * (1 + 1 + 4));
}

}  // namespace
}  // namespace spillway::cuda_bench

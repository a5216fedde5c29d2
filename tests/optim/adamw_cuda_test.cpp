// The CUDA backend's AdamW, widening and norm-lane kernels (src/device/cuda/adamw_kernels.cu)
// against optim's CPU reference, bitwise (Note [AdamW on the device]). GPU only: without a
// CUDA device every test skips and says why.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "device/cuda/adamw_kernels.hpp"
#include "spillway/optim/optim.hpp"

namespace spillway::optim {
namespace {

// Skips the test without a usable device; names the reason.
#define SKIP_WITHOUT_GPU()                                                      \
  do {                                                                          \
    int count = 0;                                                              \
    const cudaError_t e = cudaGetDeviceCount(&count);                           \
    if (e != cudaSuccess || count == 0)                                         \
      GTEST_SKIP() << "no CUDA device: "                                        \
                   << (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"); \
  } while (0)

template <class T>
T* to_device(const std::vector<T>& host) {
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(T) + 1), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return static_cast<T*>(d);
}

template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

TEST(AdamWCuda, MatchesTheCpuReferenceBitwise) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = 31;
  std::cout << "seed " << seed << "\n";
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, 0.1f);
  const size_t n = 100003;
  AdamWParams hp;
  hp.lr = 3e-3;
  hp.weight_decay = 0.05;
  for (GradType type : {GradType::kFp32, GradType::kBf16}) {
    std::vector<float> p(n), m(n), v(n), g32(n);
    std::vector<uint16_t> g16(n);
    for (size_t i = 0; i < n; ++i) {
      p[i] = d(g);
      m[i] = d(g) * 0.01f;
      v[i] = std::abs(d(g)) * 0.001f;
      g32[i] = d(g);
      g16[i] = float_to_bf16(d(g));
    }
    float* dp = to_device(p);
    float* dm = to_device(m);
    float* dv = to_device(v);
    const void* dg = type == GradType::kFp32 ? static_cast<const void*>(to_device(g32))
                                             : static_cast<const void*>(to_device(g16));
    uint16_t* dcopy = to_device(std::vector<uint16_t>(n, 0xFFFF));
    std::vector<uint16_t> copy(n);
    for (int64_t step = 1; step <= 3; ++step) {
      DeviceAdamW op;
      op.scalars = adamw_step_scalars(hp, step);
      op.p = dp;
      op.m = dm;
      op.v = dv;
      op.g = dg;
      op.grad_bf16 = type == GradType::kBf16;
      op.grad_scale = 0.75f;
      op.copy = dcopy;
      op.n = n;
      ASSERT_NO_THROW(cuda::launch_adamw(op, nullptr));
      AdamWArgs a;
      a.p = p.data();
      a.m = m.data();
      a.v = v.data();
      a.g = type == GradType::kFp32 ? static_cast<const void*>(g32.data())
                                    : static_cast<const void*>(g16.data());
      a.grad_type = type;
      a.grad_scale = 0.75f;
      a.copy_out = copy.data();
      a.copy_type = CopyType::kBf16;
      a.n = n;
      a.step = step;
      adamw_step_scalar(hp, a);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(std::memcmp(to_host(dp, n).data(), p.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(to_host(dm, n).data(), m.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(to_host(dv, n).data(), v.data(), n * 4), 0);
    EXPECT_EQ(to_host(dcopy, n), copy);
    for (const void* ptr : {static_cast<const void*>(dp), static_cast<const void*>(dm),
                            static_cast<const void*>(dv), dg, static_cast<const void*>(dcopy)})
      EXPECT_EQ(cudaFree(const_cast<void*>(ptr)), cudaSuccess);
  }
}

TEST(AdamWCuda, WideningIsExact) {
  SKIP_WITHOUT_GPU();
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  uint16_t* src = to_device(all);
  float* dst = to_device(std::vector<float>(all.size(), 0.0f));
  ASSERT_NO_THROW(cuda::launch_widen_bf16(DeviceWidenBf16{src, dst, all.size()}, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> out = to_host(dst, all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    const float want = bf16_to_float(all[i]);
    ASSERT_EQ(std::memcmp(&out[i], &want, 4), 0) << "pattern " << i;
  }
  EXPECT_EQ(cudaFree(src), cudaSuccess);
  EXPECT_EQ(cudaFree(dst), cudaSuccess);
}

// Note [Norm lanes]: the GPU's lane sums are the CPU's, bit for bit, for a bucket longer
// than the lanes and one shorter.
TEST(AdamWCuda, NormLanesMatchTheCpuBitwise) {
  SKIP_WITHOUT_GPU();
  std::mt19937 r(8);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (size_t n : {3 * kNormLanes + 11, size_t{1000}}) {
    SCOPED_TRACE(n);
    std::vector<uint16_t> g(n);
    for (uint16_t& x : g) x = float_to_bf16(d(r));
    const size_t width = std::min(n, kNormLanes);
    std::vector<double> want(width);
    norm_lane_sums_bf16(g.data(), n, want.data());
    uint16_t* gd = to_device(g);
    double* lanes = to_device(std::vector<double>(width, -1.0));
    ASSERT_NO_THROW(
        cuda::launch_norm_lanes_bf16(DeviceNormLanes{gd, n, kNormLanes, lanes}, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<double> got = to_host(lanes, width);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), width * sizeof(double)), 0);
    EXPECT_EQ(cudaFree(gd), cudaSuccess);
    EXPECT_EQ(cudaFree(lanes), cudaSuccess);
  }
}

}  // namespace
}  // namespace spillway::optim

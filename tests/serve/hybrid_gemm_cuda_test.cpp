// HybridGEMM as a device operation (Note [HybridGEMM as a device operation]): where a GPU
// exists, the CUDA backend's kernels with X and O in device memory and W in mapped host
// memory give the host implementation's result within Note [HybridGEMM arithmetic]'s bound,
// for several alphas, ragged shapes and both dtypes, and tiles beyond the kernels' limits
// are refused before a launch; without one those tests skip and say why. Everywhere: a
// device without the operation (the host backend) says so and a bad problem is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "spillway/device.hpp"
#include "spillway/device_math.hpp"
#include "spillway/error.hpp"
#include "spillway/hybrid_gemm.hpp"

namespace spillway {
namespace {

TEST(HybridGemmOnDevice, ADeviceWithoutTheOperationSaysSoAndABadProblemIsRefused) {
  const std::unique_ptr<Device> host = make_host_device(HostDeviceOptions{});
  const UniqueStream s(*host, StreamRole::kCompute);
  HybridGemmProblem p{4, 4, 4, DType::kBf16, 0.5, {16, 16, 16}, {16, 16, 16}};
  std::string why;
  EXPECT_FALSE(hybrid_gemm_on_device(*host, p, nullptr, nullptr, nullptr, s, &why));
  EXPECT_NE(why.find("has no HybridGEMM operation"), std::string::npos) << why;
  p.alpha = 2.0;
  EXPECT_THROW((void)hybrid_gemm_on_device(*host, p, nullptr, nullptr, nullptr, s, &why),
               InputError);
}

TEST(HybridGemmCuda, TilesBeyondTheKernelsLimitsAreRefusedWithoutALaunch) {
  std::string why;
  const std::unique_ptr<Device> dev = make_cuda_device(0, &why);
  if (!dev) GTEST_SKIP() << why;
  const UniqueStream s(*dev, StreamRole::kCompute);
  const HybridGemmProblem p{4, 4, 4, DType::kBf16, 0.5, {256, 256, 64}, {16, 16, 16}};
  try {
    (void)hybrid_gemm_on_device(*dev, p, nullptr, nullptr, nullptr, s, &why);
    ADD_FAILURE() << "tiles 256x256x64 were not refused";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("shared memory"), std::string::npos) << e.what();
  }
}

TEST(HybridGemmCuda, KernelsMatchTheHostImplementation) {
  std::string why;
  const std::unique_ptr<Device> dev = make_cuda_device(0, &why);
  if (!dev) GTEST_SKIP() << why;
  const UniqueStream s(*dev, StreamRole::kCompute);
  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape sh : {Shape{1, 64, 64}, Shape{37, 50, 29}, Shape{128, 96, 200}})
    for (DType wt : {DType::kBf16, DType::kFp32})
      for (double alpha : {0.0, 0.4, 1.0}) {
        SCOPED_TRACE(::testing::Message() << sh.m << "x" << sh.n << "x" << sh.k << " "
                                          << to_string(wt) << " alpha " << alpha);
        HybridGemmProblem p{sh.m, sh.n, sh.k, wt, alpha, {16, 32, 32}, {16, 16, 32}};
        std::mt19937 g(3);
        std::uniform_real_distribution<float> u(-1, 1);
        std::vector<float> x(static_cast<size_t>(sh.m * sh.k)),
            w32(static_cast<size_t>(sh.n * sh.k));
        for (float& v : x) v = u(g);
        std::vector<uint16_t> w16(w32.size());
        for (size_t i = 0; i < w32.size(); ++i) {
          w16[i] = float_to_bf16(u(g));
          w32[i] = bf16_to_float(w16[i]);
        }
        const size_t wbytes = w32.size() * static_cast<size_t>(dtype_bytes(wt));
        const AllocResult xd = dev->allocate(x.size() * 4, MemoryKind::kDevice);
        const AllocResult od =
            dev->allocate(static_cast<size_t>(sh.m * sh.n) * 4, MemoryKind::kDevice);
        const AllocResult wm = dev->allocate(wbytes, MemoryKind::kMappedHost);
        ASSERT_TRUE(xd && od && wm);
        std::memcpy(wm.ptr,
                    wt == DType::kBf16 ? static_cast<const void*>(w16.data())
                                       : static_cast<const void*>(w32.data()),
                    wbytes);
        dev->copy_async(xd.ptr, x.data(), x.size() * 4, s);
        ASSERT_TRUE(hybrid_gemm_on_device(*dev, p, static_cast<const float*>(xd.ptr), wm.ptr,
                                          static_cast<float*>(od.ptr), s, &why))
            << why;
        std::vector<float> got(static_cast<size_t>(sh.m * sh.n)), want(got.size());
        dev->copy_async(got.data(), od.ptr, got.size() * 4, s);
        dev->synchronize(s);
        // The host implementation reads W in the problem's dtype, as the kernels do.
        hybrid_gemm_host(p, x.data(),
                         wt == DType::kBf16 ? static_cast<const void*>(w16.data())
                                            : static_cast<const void*>(w32.data()),
                         want.data());
        for (int64_t i = 0; i < sh.m; ++i)
          for (int64_t j = 0; j < sh.n; ++j) {
            double mag = 0;
            for (int64_t k = 0; k < sh.k; ++k)
              mag += std::fabs(static_cast<double>(x[static_cast<size_t>(i * sh.k + k)]) *
                               w32[static_cast<size_t>(j * sh.k + k)]);
            const size_t e = static_cast<size_t>(i * sh.n + j);
            EXPECT_LE(std::fabs(got[e] - want[e]),
                      4.0 * static_cast<double>(sh.k) * std::ldexp(1.0, -24) * mag)
                << i << "," << j;
          }
        dev->free(xd.ptr, MemoryKind::kDevice);
        dev->free(od.ptr, MemoryKind::kDevice);
        dev->free(wm.ptr, MemoryKind::kMappedHost);
      }
}

}  // namespace
}  // namespace spillway

// HybridGEMM as a device operation (Note [HybridGEMM as a device operation]): where a GPU
// exists, the CUDA backend's kernels with X and O in device memory and W in mapped host
// memory give the host implementation's result within Note [HybridGEMM arithmetic]'s bound,
// for several alphas, ragged shapes and both dtypes, move exactly the closed form's bytes
// when they count them (Note [Counted HybridGEMM kernels]), and tiles beyond the kernels'
// limits are refused before a launch; without one those tests skip and say why.
// Everywhere: a device without the operation (the host backend) says so, counted or not, a
// bad problem is refused, and hybrid_gemm_counted_on_device puts each of the six counters a
// device adds to into its field, and frees them on every path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "forwarding_device.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "spillway/device/device_math.hpp"
#include "spillway/serve/hybrid_gemm.hpp"

namespace spillway {
namespace {

struct Shape {
  int64_t m, n, k;
};

constexpr int kDeviceMemory = static_cast<int>(MemoryKind::kDevice);  // MemoryStats' index

// Random inputs of a problem (seed printed by the caller's trace): X (m, k) fp32 and W
// (n, k) as bf16 bits and their exact fp32 values, both in [-1, 1].
struct GemmInputs {
  std::vector<float> x, w32;
  std::vector<uint16_t> w16;
  // W in the problem's dtype, what the kernels and the host implementation read.
  const void* w(DType t) const {
    return t == DType::kBf16 ? static_cast<const void*>(w16.data())
                             : static_cast<const void*>(w32.data());
  }
};

GemmInputs random_inputs(const HybridGemmProblem& p, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  GemmInputs in;
  in.x.resize(static_cast<size_t>(p.m * p.k));
  in.w32.resize(static_cast<size_t>(p.n * p.k));
  in.w16.resize(in.w32.size());
  for (float& v : in.x) v = u(g);
  for (size_t i = 0; i < in.w32.size(); ++i) {
    in.w16[i] = float_to_bf16(u(g));
    in.w32[i] = bf16_to_float(in.w16[i]);
  }
  return in;
}

void expect_fields_equal(const HybridGemmTraffic& got, const HybridGemmTraffic& want) {
  EXPECT_EQ(got.n_symmetric, want.n_symmetric);
  EXPECT_EQ(got.symmetric.link_bytes, want.symmetric.link_bytes);
  EXPECT_EQ(got.symmetric.hbm_read_bytes, want.symmetric.hbm_read_bytes);
  EXPECT_EQ(got.symmetric.hbm_write_bytes, want.symmetric.hbm_write_bytes);
  EXPECT_EQ(got.asymmetric.link_bytes, want.asymmetric.link_bytes);
  EXPECT_EQ(got.asymmetric.hbm_read_bytes, want.asymmetric.hbm_read_bytes);
  EXPECT_EQ(got.asymmetric.hbm_write_bytes, want.asymmetric.hbm_write_bytes);
}

// got within Note [HybridGEMM arithmetic]'s bound (twice over: the kernels' fp32 sums in K
// order against BLAS's) of the host implementation's product.
void expect_matches_host(const HybridGemmProblem& p, const GemmInputs& in,
                         const std::vector<float>& got) {
  std::vector<float> want(got.size());
  // The host implementation reads W in the problem's dtype, as the kernels do.
  hybrid_gemm_host(p, in.x.data(), in.w(p.w_dtype), want.data());
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      double mag = 0;
      for (int64_t k = 0; k < p.k; ++k)
        mag += std::fabs(static_cast<double>(in.x[static_cast<size_t>(i * p.k + k)]) *
                         in.w32[static_cast<size_t>(j * p.k + k)]);
      const size_t e = static_cast<size_t>(i * p.n + j);
      EXPECT_LE(std::fabs(got[e] - want[e]),
                4.0 * static_cast<double>(p.k) * std::ldexp(1.0, -24) * mag)
          << i << "," << j;
    }
}

// The host device with a HybridGEMM operation of its own: hybrid_gemm_host on the pointers
// (the host backend's device memory is host memory) as stream work, adding the bytes it
// counted to a.traffic when set, in DeviceHybridGemm's order, as the kernels do.
class CountingHostDevice final : public testing::ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  bool hybrid_gemm(const DeviceHybridGemm& a, Stream s) override {
    inner().host_callback(s, [a] {
      HybridGemmProblem p;
      p.m = a.m;
      p.n = a.n;
      p.k = a.k;
      p.w_dtype = a.w_bf16 ? DType::kBf16 : DType::kFp32;
      p.symmetric = {a.symmetric.m, a.symmetric.n, a.symmetric.k};
      p.asymmetric = {a.asymmetric.m, a.asymmetric.n, a.asymmetric.k};
      // An alpha whose floor(alpha * n) is the split given (away from a rounding edge).
      p.alpha = a.n_symmetric == a.n
                    ? 1.0
                    : (static_cast<double>(a.n_symmetric) + 0.5) / static_cast<double>(a.n);
      const HybridGemmTraffic t = hybrid_gemm_host(p, a.x, a.w, a.o);
      if (a.traffic == nullptr) return;
      const int64_t counts[6] = {t.symmetric.link_bytes,      t.symmetric.hbm_read_bytes,
                                 t.symmetric.hbm_write_bytes, t.asymmetric.link_bytes,
                                 t.asymmetric.hbm_read_bytes, t.asymmetric.hbm_write_bytes};
      for (int i = 0; i < 6; ++i) a.traffic[i] += counts[i];
    });
    return true;
  }
};

// A device whose HybridGEMM launch fails.
class FailingLaunchDevice final : public testing::ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  bool hybrid_gemm(const DeviceHybridGemm& /*a*/, Stream /*s*/) override {
    throw Error("hybrid_gemm: the test's launch failed");
  }
};

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

TEST(HybridGemmOnDevice, CountedTrafficLandsInTheClosedFormsFields) {
  const std::unique_ptr<Device> host = make_host_device(HostDeviceOptions{});
  CountingHostDevice dev(*host);
  const UniqueStream s(dev.device(), StreamRole::kCompute);
  const int64_t device_bytes = dev.device().memory_stats().current[kDeviceMemory];
  // Ragged shapes (no side a multiple of a tile) whose six figures differ from each other at
  // every alpha in (0, 1): two counters swapped in the mapping fail.
  for (const Shape sh : {Shape{37, 50, 29}, Shape{33, 97, 61}, Shape{130, 41, 77}})
    for (DType wt : {DType::kBf16, DType::kFp32})
      for (double alpha : {0.0, 0.3, 0.7, 1.0})
        for (bool invariant : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << sh.m << "x" << sh.n << "x" << sh.k << " " << to_string(wt) << " alpha "
                       << alpha << (invariant ? " invariant" : "") << " seed 5");
          HybridGemmProblem p{sh.m, sh.n, sh.k, wt, alpha, {16, 32, 32}, {16, 16, 32}};
          if (invariant) p.asymmetric = p.symmetric;  // Note [Invariant HybridGEMM]
          p.invariant = invariant;
          const HybridGemmTraffic want = hybrid_gemm_traffic(p);
          const GemmTraffic& ws = want.symmetric;
          const GemmTraffic& wa = want.asymmetric;
          if (want.n_symmetric > 0 && want.n_symmetric < p.n) {
            const std::set<int64_t> distinct{ws.link_bytes, ws.hbm_read_bytes, ws.hbm_write_bytes,
                                             wa.link_bytes, wa.hbm_read_bytes, wa.hbm_write_bytes};
            ASSERT_EQ(distinct.size(), 6u) << "the shape cannot tell two counters apart";
          }
          const GemmInputs in = random_inputs(p, 5);
          std::vector<float> got(static_cast<size_t>(p.m * p.n), std::nanf(""));
          HybridGemmTraffic counted;
          std::string why;
          ASSERT_TRUE(hybrid_gemm_counted_on_device(dev.device(), p, in.x.data(), in.w(wt),
                                                    got.data(), s, &counted, &why))
              << why;
          expect_fields_equal(counted, want);
          // The product went through too (the backend does not know p.invariant, so its
          // tile products may be made by other calls: within the bound, not bitwise).
          expect_matches_host(p, in, got);
          EXPECT_EQ(dev.device().memory_stats().current[kDeviceMemory], device_bytes)
              << "counters leaked";
        }
}

TEST(HybridGemmOnDevice, CountingWithoutTheOperationSaysSoAndFreesTheCounters) {
  const std::unique_ptr<Device> host = make_host_device(HostDeviceOptions{});
  const UniqueStream s(*host, StreamRole::kCompute);
  const HybridGemmProblem p{4, 4, 4, DType::kBf16, 0.5, {16, 16, 16}, {16, 16, 16}};
  const MemoryStats before = host->memory_stats();
  HybridGemmTraffic counted;
  counted.n_symmetric = -7;  // untouched on failure
  std::string why;
  EXPECT_FALSE(
      hybrid_gemm_counted_on_device(*host, p, nullptr, nullptr, nullptr, s, &counted, &why));
  EXPECT_NE(why.find("has no HybridGEMM operation"), std::string::npos) << why;
  EXPECT_EQ(counted.n_symmetric, -7);
  const MemoryStats after = host->memory_stats();
  EXPECT_EQ(after.current[kDeviceMemory], before.current[kDeviceMemory]);
  EXPECT_EQ(after.allocations[kDeviceMemory], before.allocations[kDeviceMemory] + 1)
      << "the counters were allocated";

  // A launch that throws: the error reaches the caller, and the counters are freed.
  FailingLaunchDevice failing(*host);
  EXPECT_THROW((void)hybrid_gemm_counted_on_device(failing.device(), p, nullptr, nullptr, nullptr,
                                                   s, &counted, &why),
               Error);
  EXPECT_EQ(host->memory_stats().current[kDeviceMemory], before.current[kDeviceMemory]);
  HybridGemmProblem bad = p;
  bad.alpha = -1.0;
  EXPECT_THROW(
      (void)hybrid_gemm_counted_on_device(*host, bad, nullptr, nullptr, nullptr, s, &counted, &why),
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
  } catch (const InputError& e) {  // the problem's field, as the host backend's check names it
    EXPECT_EQ(e.field(), "tiles");
    EXPECT_EQ(e.value(), "256x256x64");
    EXPECT_NE(e.rule().find("shared memory"), std::string::npos) << e.what();
  }
}

// p on the CUDA device: X and O in device memory, W in mapped host memory; counted by the
// kernels into *counted when it is non-null. *got: O.
void run_on_cuda(Device& dev, Stream s, const HybridGemmProblem& p, const GemmInputs& in,
                 std::vector<float>* got, HybridGemmTraffic* counted) {
  const size_t wbytes = in.w32.size() * static_cast<size_t>(dtype_bytes(p.w_dtype));
  const UniqueMemory xd(dev, in.x.size() * 4, MemoryKind::kDevice);
  const UniqueMemory od(dev, static_cast<size_t>(p.m * p.n) * 4, MemoryKind::kDevice);
  const UniqueMemory wm(dev, wbytes, MemoryKind::kMappedHost);
  ASSERT_TRUE(xd && od && wm) << xd.reason() << od.reason() << wm.reason();
  std::memcpy(wm.get(), in.w(p.w_dtype), wbytes);
  dev.copy_async(xd.get(), in.x.data(), in.x.size() * 4, s);
  std::string why;
  const auto* x = static_cast<const float*>(xd.get());
  auto* o = static_cast<float*>(od.get());
  if (counted != nullptr) {
    ASSERT_TRUE(hybrid_gemm_counted_on_device(dev, p, x, wm.get(), o, s, counted, &why)) << why;
  } else {
    ASSERT_TRUE(hybrid_gemm_on_device(dev, p, x, wm.get(), o, s, &why)) << why;
  }
  got->assign(static_cast<size_t>(p.m * p.n), 0.0f);
  dev.copy_async(got->data(), od.get(), got->size() * 4, s);
  dev.synchronize(s);
}

TEST(HybridGemmCuda, KernelsMatchTheHostImplementation) {
  std::string why;
  const std::unique_ptr<Device> dev = make_cuda_device(0, &why);
  if (!dev) GTEST_SKIP() << why;
  const UniqueStream s(*dev, StreamRole::kCompute);
  for (const Shape sh : {Shape{1, 64, 64}, Shape{37, 50, 29}, Shape{128, 96, 200}})
    for (DType wt : {DType::kBf16, DType::kFp32})
      for (double alpha : {0.0, 0.4, 1.0}) {
        SCOPED_TRACE(::testing::Message() << sh.m << "x" << sh.n << "x" << sh.k << " "
                                          << to_string(wt) << " alpha " << alpha << " seed 3");
        const HybridGemmProblem p{sh.m, sh.n, sh.k, wt, alpha, {16, 32, 32}, {16, 16, 32}};
        const GemmInputs in = random_inputs(p, 3);
        std::vector<float> got;
        ASSERT_NO_FATAL_FAILURE(run_on_cuda(*dev, s, p, in, &got, nullptr));
        expect_matches_host(p, in, got);
      }
}

// Note [Counted HybridGEMM kernels]: the bytes the kernels' loads and stores move are the
// closed form's, field by field, and the counted run computes the same product.
TEST(HybridGemmCuda, TheKernelsMoveExactlyTheClosedFormsBytes) {
  std::string why;
  const std::unique_ptr<Device> dev = make_cuda_device(0, &why);
  if (!dev) GTEST_SKIP() << why;
  const UniqueStream s(*dev, StreamRole::kCompute);
  for (const Shape sh :
       {Shape{1, 64, 64}, Shape{37, 50, 29}, Shape{128, 96, 200}, Shape{300, 130, 70}})
    for (DType wt : {DType::kBf16, DType::kFp32})
      for (double alpha : {0.0, 0.4, 1.0})
        for (bool invariant : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << sh.m << "x" << sh.n << "x" << sh.k << " " << to_string(wt) << " alpha "
                       << alpha << (invariant ? " invariant" : "") << " seed 3");
          HybridGemmProblem p{sh.m, sh.n, sh.k, wt, alpha, {16, 32, 32}, {16, 16, 32}};
          if (invariant) p.asymmetric = p.symmetric;  // Note [Invariant HybridGEMM]
          p.invariant = invariant;
          const GemmInputs in = random_inputs(p, 3);
          std::vector<float> got;
          HybridGemmTraffic counted;
          counted.n_symmetric = -1;
          ASSERT_NO_FATAL_FAILURE(run_on_cuda(*dev, s, p, in, &got, &counted));
          expect_fields_equal(counted, hybrid_gemm_traffic(p));
          expect_matches_host(p, in, got);
        }
}

}  // namespace
}  // namespace spillway

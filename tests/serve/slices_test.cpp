// Emulated MIG slices (Note [Emulated MIG slices]): slice shapes from the catalog's MIG
// profiles; the results are HybridGEMM's real ones; co-running slices share the link (a
// link-bound GEMM on 4 slices at once takes about 4 times as long as alone, and the link
// never carries more than its bandwidth); a GEMM bound by HBM or compute takes that time.
#include "spillway/serve/slices.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "spillway/core/error.hpp"

namespace spillway {
namespace {

TEST(Slices, MigProfilesCutTheGpuAsTheCatalogSays) {
  const HardwareProfile gh = load_hardware("gh200");
  const SliceSetup s = mig_slices(gh, "1g.12gb", 1e-3, 1e-2);
  ASSERT_EQ(s.slices.size(), 7u);
  EXPECT_DOUBLE_EQ(s.link_gbps, gh.h2d_typical.value * 1e-3);
  const SliceSpec& k = s.slices[0];
  EXPECT_EQ(k.hbm_bytes, static_cast<int64_t>(12e9 * 1e-2));
  EXPECT_DOUBLE_EQ(k.hbm_gbps, 0.5e3 * 1e-3);
  EXPECT_DOUBLE_EQ(k.gflops, gh.bf16_dense.value * 1e3 * 16 / 132 * 1e-3);
  EXPECT_EQ(mig_slices(gh, "7g.96gb", 1e-3, 1e-2).slices.size(), 1u);
  EXPECT_EQ(mig_slices(gh, "2g.24gb", 1e-3, 1e-2).slices.size(), 3u);
  try {
    (void)mig_slices(gh, "9g.1tb", 1e-3, 1e-2);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), "profile");
    EXPECT_NE(std::string(e.what()).find("1g.12gb"), std::string::npos) << e.what();
  }
}

struct Gemm {
  HybridGemmProblem p;
  std::vector<float> x;
  std::vector<uint16_t> w;
  Gemm(int64_t m, int64_t n, int64_t k, double alpha) : p{m, n, k, DType::kBf16, alpha, {}, {}} {
    p.symmetric = p.asymmetric = {16, 64, 64};
    std::mt19937 g(5);
    std::uniform_real_distribution<float> u(-1, 1);
    x.resize(static_cast<size_t>(m * k));
    for (float& v : x) v = u(g);
    w.resize(static_cast<size_t>(n * k));
    for (uint16_t& v : w) v = static_cast<uint16_t>(0x3c00 + g() % 256);
  }
};

TEST(Slices, CoRunningSlicesShareTheLink) {
  // Link-bound: 256 KiB of bf16 weights at 16 MB/s is ~16 ms of link alone; HBM and compute
  // are far faster.
  auto link = std::make_shared<HostLink>(0.016, 0.016);
  const SliceSpec spec{"test", int64_t{64} << 20, 100.0, 1000.0};
  Gemm gm(8, 512, 256, 0.0);
  std::vector<float> want(static_cast<size_t>(8 * 512));
  hybrid_gemm_host(gm.p, gm.x.data(), gm.w.data(), want.data());
  EmulatedSlice alone(spec, link);
  std::vector<float> out(want.size());
  const SliceGemmTiming a = alone.gemm(gm.p, gm.x.data(), gm.w.data(), out.data());
  EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);
  EXPECT_FALSE(a.overrun);
  const double link_ms = 512.0 * 256 * 2 / (0.016 * 1e6);
  EXPECT_NEAR(a.elapsed_ms, link_ms, 0.25 * link_ms);
  EXPECT_GT(a.link_ms, a.hbm_ms);
  EXPECT_GT(a.link_ms, a.compute_ms);
  // Four slices at once: each waits its turn on the link.
  constexpr int kSlices = 4;
  std::vector<std::unique_ptr<EmulatedSlice>> slices;
  for (int i = 0; i < kSlices; ++i) slices.push_back(std::make_unique<EmulatedSlice>(spec, link));
  std::vector<SliceGemmTiming> t(kSlices);
  std::vector<std::vector<float>> outs(kSlices, std::vector<float>(want.size()));
  const int64_t booked = link->h2d_bytes();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < kSlices; ++i)
    threads.emplace_back([&, i] {
      t[static_cast<size_t>(i)] = slices[static_cast<size_t>(i)]->gemm(
          gm.p, gm.x.data(), gm.w.data(), outs[static_cast<size_t>(i)].data());
    });
  for (std::thread& th : threads) th.join();
  const double wall =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  double slowest = 0;
  for (int i = 0; i < kSlices; ++i) {
    EXPECT_EQ(std::memcmp(outs[static_cast<size_t>(i)].data(), want.data(), want.size() * 4), 0);
    slowest = std::max(slowest, t[static_cast<size_t>(i)].elapsed_ms);
  }
  EXPECT_EQ(link->h2d_bytes() - booked, kSlices * a.traffic.total().link_bytes);
  // The link carried 4 GEMMs' bytes: no faster than its bandwidth allows.
  EXPECT_GE(wall, 0.95 * kSlices * link_ms);
  EXPECT_NEAR(slowest, kSlices * link_ms, 0.3 * kSlices * link_ms);
}

TEST(Slices, AGemmBoundByHbmOrComputeTakesThatTime) {
  auto link = std::make_shared<HostLink>(100.0, 100.0);
  Gemm gm(64, 128, 128, 0.0);
  std::vector<float> out(static_cast<size_t>(64 * 128));
  // HBM-bound: the asymmetric path's traffic at 0.05 GB/s.
  EmulatedSlice hbm({"hbm", int64_t{16} << 20, 0.05, 1e6}, link);
  const SliceGemmTiming h = hbm.gemm(gm.p, gm.x.data(), gm.w.data(), out.data());
  const double want_h = static_cast<double>(h.traffic.total().hbm_bytes()) / (0.05 * 1e6);
  EXPECT_NEAR(h.hbm_ms, want_h, 1e-9);
  // The emulation paces the call to the modelled time: never shorter (a loaded machine
  // makes it longer, so no upper bound: no timed assertion that load can break).
  EXPECT_GE(h.elapsed_ms, 0.99 * want_h);
  // Compute-bound: 2 M N K FLOPs at 0.1 GFLOP/s.
  EmulatedSlice slow({"compute", int64_t{16} << 20, 1e6, 0.1}, link);
  const SliceGemmTiming c = slow.gemm(gm.p, gm.x.data(), gm.w.data(), out.data());
  const double want_c = 2.0 * 64 * 128 * 128 / (0.1 * 1e6);
  EXPECT_NEAR(c.compute_ms, want_c, 1e-9);
  EXPECT_GE(c.elapsed_ms, 0.99 * want_c);
}

}  // namespace
}  // namespace spillway

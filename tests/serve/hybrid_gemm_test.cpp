// HybridGEMM on the host backend (Note [HybridGEMM dataflows], Note [HybridGEMM
// arithmetic]): the traffic counted as the tiles move equals the closed-form formulas for
// every shape, tile and alpha tested; both dataflows compute the same bits when they make
// the same tile calls, and every alpha is within the documented bound of the product in
// double; the crossover the design predicts shows in the counts: the symmetric path pays
// link bytes for HBM, the asymmetric path HBM bytes for link.
#include "spillway/serve/hybrid_gemm.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "allocation_count.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device_math.hpp"

namespace spillway {
namespace {

struct Operands {
  std::vector<float> x;
  std::vector<uint16_t> w16;
  std::vector<float> w32;
};

Operands operands(int64_t m, int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Operands o;
  o.x.resize(static_cast<size_t>(m * k));
  for (float& v : o.x) v = u(g);
  o.w32.resize(static_cast<size_t>(n * k));
  o.w16.resize(o.w32.size());
  for (size_t i = 0; i < o.w32.size(); ++i) {
    o.w16[i] = float_to_bf16(u(g));
    o.w32[i] = bf16_to_float(o.w16[i]);  // the same values in both dtypes
  }
  return o;
}

void expect_same_traffic(const HybridGemmTraffic& a, const HybridGemmTraffic& b) {
  EXPECT_EQ(a.n_symmetric, b.n_symmetric);
  for (auto [x, y] : {std::pair{a.symmetric, b.symmetric}, std::pair{a.asymmetric, b.asymmetric}}) {
    EXPECT_EQ(x.link_bytes, y.link_bytes);
    EXPECT_EQ(x.hbm_read_bytes, y.hbm_read_bytes);
    EXPECT_EQ(x.hbm_write_bytes, y.hbm_write_bytes);
  }
}

TEST(HybridGemm, CountedTrafficIsTheClosedFormForEveryShapeAndAlpha) {
  struct Shape {
    int64_t m, n, k;
    GemmTiles sym, asym;
  };
  const std::vector<Shape> shapes = {
      {1, 64, 64, {16, 16, 16}, {16, 16, 16}},     // decode: one row
      {37, 50, 29, {8, 16, 8}, {8, 8, 8}},         // every dimension ragged
      {128, 96, 200, {32, 32, 64}, {32, 48, 64}},  // prefill-like
      {5, 3, 7, {64, 64, 64}, {64, 64, 64}},       // tiles larger than the problem
      {64, 256, 128, {64, 128, 32}, {16, 64, 32}},
  };
  for (const Shape& s : shapes)
    for (DType wt : {DType::kBf16, DType::kFp32})
      for (double alpha : {0.0, 0.125, 0.3, 0.5, 0.77, 1.0}) {
        SCOPED_TRACE(::testing::Message() << s.m << "x" << s.n << "x" << s.k << " " << to_string(wt)
                                          << " alpha " << alpha);
        HybridGemmProblem p{s.m, s.n, s.k, wt, alpha, s.sym, s.asym};
        const Operands o = operands(s.m, s.n, s.k, 3);
        std::vector<float> out(static_cast<size_t>(s.m * s.n), NAN);
        const void* w = wt == DType::kBf16 ? static_cast<const void*>(o.w16.data())
                                           : static_cast<const void*>(o.w32.data());
        const HybridGemmTraffic counted = hybrid_gemm_host(p, o.x.data(), w, out.data());
        const HybridGemmTraffic formula = hybrid_gemm_traffic(p);
        expect_same_traffic(counted, formula);
        EXPECT_EQ(counted.n_symmetric,
                  static_cast<int64_t>(std::floor(alpha * static_cast<double>(s.n))));
        for (float v : out) ASSERT_FALSE(std::isnan(v)) << "an output element was not written";
      }
}

TEST(HybridGemm, BothDataflowsComputeTheSameBitsAndEveryAlphaIsNearTheExactProduct) {
  const int64_t m = 33, n = 96, k = 150;
  const Operands o = operands(m, n, k, 9);
  const GemmTiles tiles{16, 32, 32};
  auto run = [&](double alpha, GemmTiles sym, GemmTiles asym, DType wt) {
    std::vector<float> out(static_cast<size_t>(m * n));
    const void* w = wt == DType::kBf16 ? static_cast<const void*>(o.w16.data())
                                       : static_cast<const void*>(o.w32.data());
    hybrid_gemm_host({m, n, k, wt, alpha, sym, asym}, o.x.data(), w, out.data());
    return out;
  };
  // Same tiles, split on a tile boundary: every tile product is the same BLAS call on the
  // same operands whichever path makes it, added in the same K order: the same bits.
  const std::vector<float> sym = run(1.0, tiles, tiles, DType::kBf16);
  for (double alpha : {0.0, 1.0 / 3, 2.0 / 3}) {
    SCOPED_TRACE(::testing::Message() << "alpha " << alpha);
    EXPECT_EQ(
        std::memcmp(run(alpha, tiles, tiles, DType::kBf16).data(), sym.data(), sym.size() * 4), 0);
  }
  // fp32 weights of the same values: the same bits.
  EXPECT_EQ(std::memcmp(run(0.5, tiles, tiles, DType::kFp32).data(),
                        run(0.5, tiles, tiles, DType::kBf16).data(), sym.size() * 4),
            0);
  // Any alpha and tiles: within 2 * K * 2^-24 * sum |x w| of the product in double (the
  // tile products' own order is BLAS's, which may differ with the tile's width).
  for (double alpha : {0.0, 0.2, 0.5, 0.9, 1.0}) {
    SCOPED_TRACE(::testing::Message() << "alpha " << alpha);
    const std::vector<float> out = run(alpha, {16, 32, 32}, {8, 8, 64}, DType::kBf16);
    double worst = 0.0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double exact = 0, mag = 0;
        for (int64_t kk = 0; kk < k; ++kk) {
          const double t = static_cast<double>(o.x[static_cast<size_t>(i * k + kk)]) *
                           o.w32[static_cast<size_t>(j * k + kk)];
          exact += t;
          mag += std::fabs(t);
        }
        const double bound = 2.0 * static_cast<double>(k) * std::ldexp(1.0, -24) * mag;
        worst = std::max(worst, std::fabs(out[static_cast<size_t>(i * n + j)] - exact) / bound);
      }
    EXPECT_LE(worst, 1.0);
  }
}

TEST(HybridGemm, InvariantOutputsDependOnNeitherTheOtherRowsNorAlpha) {
  // Note [Invariant HybridGEMM]: row r of X gives the same bits alone, at any place in a
  // batch of any size, under any alpha.
  const int64_t n = 96, k = 150;
  const GemmTiles tiles{16, 32, 32};
  const Operands big = operands(70, n, k, 21);
  auto gemm = [&](const std::vector<float>& x, int64_t m, double alpha, bool invariant) {
    std::vector<float> out(static_cast<size_t>(m * n));
    HybridGemmProblem p{m, n, k, DType::kBf16, alpha, tiles, tiles};
    p.invariant = invariant;
    const HybridGemmTraffic t = hybrid_gemm_host(p, x.data(), big.w16.data(), out.data());
    expect_same_traffic(t, hybrid_gemm_traffic(p));
    EXPECT_EQ(t.n_symmetric % tiles.n, invariant ? 0 : t.n_symmetric % tiles.n);
    return out;
  };
  auto row_of = [&](const std::vector<float>& out, int64_t r) {
    return std::vector<float>(out.begin() + r * n, out.begin() + (r + 1) * n);
  };
  // Row 5 of `big` alone, at alpha 0: the reference bits.
  const std::vector<float> x5(big.x.begin() + 5 * k, big.x.begin() + 6 * k);
  const std::vector<float> alone = gemm(x5, 1, 0.0, true);
  int differ_without = 0;
  for (int64_t m : {7, 33, 70}) {
    for (double alpha : {0.0, 0.13, 0.5, 0.77, 1.0}) {
      SCOPED_TRACE(::testing::Message() << "m " << m << " alpha " << alpha);
      const std::vector<float> x(big.x.begin(), big.x.begin() + m * k);
      EXPECT_EQ(row_of(gemm(x, m, alpha, true), 5), alone);
      if (row_of(gemm(x, m, alpha, false), 5) != alone) ++differ_without;
    }
  }
  // What the option buys: without it the row's bits move with the batch or alpha here.
  EXPECT_GT(differ_without, 0);
  HybridGemmProblem bad{4, n, k, DType::kBf16, 0.5, tiles, {16, 32, 64}};
  bad.invariant = true;
  EXPECT_THROW(hybrid_gemm_traffic(bad), Error);
}

TEST(HybridGemm, AlphaTradesLinkBytesForHbmBytes) {
  // Decode-like (M small): the symmetric path re-reads W once per row tile; with M = 256 and
  // tm = 64 that is 4x the link bytes of the asymmetric path, which instead reads and
  // writes O once per K tile.
  HybridGemmProblem p{256, 4096, 4096, DType::kBf16, 0.0, {64, 128, 64}, {64, 128, 64}};
  const HybridGemmTraffic a0 = hybrid_gemm_traffic(p);
  p.alpha = 1.0;
  const HybridGemmTraffic a1 = hybrid_gemm_traffic(p);
  EXPECT_EQ(a0.total().link_bytes, 4096LL * 4096 * 2);  // W once
  EXPECT_EQ(a1.total().link_bytes, 4 * a0.total().link_bytes);
  EXPECT_GT(a0.total().hbm_bytes(), 2 * a1.total().hbm_bytes());
  int64_t last_link = -1, last_hbm = INT64_MAX;
  for (double alpha = 0.0; alpha <= 1.0; alpha += 0.125) {
    p.alpha = alpha;
    const GemmTraffic t = hybrid_gemm_traffic(p).total();
    EXPECT_GT(t.link_bytes, last_link) << alpha;  // more symmetric: more link
    EXPECT_LT(t.hbm_bytes(), last_hbm) << alpha;  // ...and less HBM
    last_link = t.link_bytes;
    last_hbm = t.hbm_bytes();
  }
}

TEST(HybridGemm, ASecondGemmOfTheSameTilesAllocatesNothing) {
  // The tiles' buffers are the thread's, sized once (a kernel's on-chip memory).
  const Operands o = operands(40, 70, 90, 4);
  std::vector<float> out(40 * 70);
  const HybridGemmProblem p{40, 70, 90, DType::kBf16, 0.5, {16, 32, 32}, {16, 16, 32}};
  hybrid_gemm_host(p, o.x.data(), o.w16.data(), out.data());
  const int64_t before = spillway::testing::heap_allocations();
  for (int i = 0; i < 3; ++i) hybrid_gemm_host(p, o.x.data(), o.w16.data(), out.data());
  EXPECT_EQ(spillway::testing::heap_allocations(), before);
}

TEST(HybridGemm, BadProblemsNameTheField) {
  const float x = 0;
  float o = 0;
  const uint16_t w = 0;
  auto field_of = [&](HybridGemmProblem p) {
    try {
      hybrid_gemm_host(p, &x, &w, &o);
    } catch (const InputError& e) {
      return e.field();
    }
    return std::string();
  };
  EXPECT_EQ(field_of({0, 1, 1, DType::kBf16, 0.0, {}, {}}), "m");
  EXPECT_EQ(field_of({1, 1, 1, DType::kBf16, 1.5, {}, {}}), "alpha");
  EXPECT_EQ(field_of({1, 1, 1, DType::kFp16, 0.0, {}, {}}), "w_dtype");
  EXPECT_EQ(field_of({1, 1, 1, DType::kBf16, 0.0, {0, 1, 1}, {}}), "tiles");
}

}  // namespace
}  // namespace spillway

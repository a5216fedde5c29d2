// Tests of the reference model's operations (src/nn/ops.hpp).
//
// Each op with a backward goes through one harness (check_case) that runs the op (forward,
// then backward with a fixed random upstream gradient R) and checks:
//   (a) gradients: central finite differences in double of L = sum(out * R) against every
//       input and parameter gradient;
//   (b) float vs double: the float instantiation matches the double one on the same
//       (float-rounded) inputs within the case's tolerance;
//   (c) determinism: two float runs give the same bits (a double run between them dirties
//       the ops' scratch);
//   (d) overwritten outputs start as NaN and must come out finite; accumulated ones start
//       at kPrefill and must hold kPrefill + the gradient.
// Inputs are random with a printed seed; SPILLWAY_TEST_SEED=<n> reruns one.
#include "nn/ops.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace spillway::nn {
namespace {

using Vec = std::vector<double>;
template <class T>
using Outs = std::vector<std::vector<T>>;

// Finite differences: step kFdEps, |fd - analytic| <= kFdTol * max(1, |analytic|). The
// truncation error is O(eps^2 f''') ~ 1e-12 and the cancellation error ~ 1e-16 |L| / eps
// ~ 1e-9 for the |L| ~ 10 of these sizes, far below kFdTol; a wrong backward is off by
// O(0.01 .. 1).
constexpr double kFdEps = 1e-6;
constexpr double kFdTol = 1e-6;
// Float vs double: |f - d| <= tol * max(1, max |d| over the output). The ops accumulate
// reductions in double and round once, except GEMMs (and attention, whose scores,
// probabilities and gradients are float GEMMs summing head_dim or up to seq float
// products), so the error is a few float ulps of the stored inputs and intermediates
// times the square root of the summed terms at most: 2e-5 unless a case says.
constexpr double kFloatTol = 2e-5;
constexpr double kPrefill = 0.5;

using spillway::testing::make_rng;

size_t sz(int n) {
  return static_cast<size_t>(n);
}

Vec uniform(std::mt19937& rng, size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

Vec randn(std::mt19937& rng, size_t n, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  Vec v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

template <class T>
std::vector<T> cast(const Vec& v) {
  return std::vector<T>(v.begin(), v.end());
}

template <class T>
std::vector<T> nans(size_t n) {
  return std::vector<T>(n, std::numeric_limits<T>::quiet_NaN());
}

template <class T>
std::vector<T> filled(size_t n, double value) {
  return std::vector<T>(n, static_cast<T>(value));
}

double max_abs(const Vec& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

template <class T>
bool all_finite(const std::vector<T>& v, size_t* bad) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) {
      *bad = i;
      return false;
    }
  }
  return true;
}

// One op under test. `run(T{}, in, prefill)` returns its outputs: the forward outputs
// first (one per entry of `upstream`), then the rest (gradients).
struct Case {
  std::vector<Vec> in;                     // inputs, parameters and upstream gradients
  std::vector<int> upstream;               // per forward output: index in `in` of its R, -1: none
  std::vector<std::pair<int, int>> grads;  // (input, output): outs[output] = dL / d in[input]
  std::vector<int> accumulated;            // outputs that are added to; the others are overwritten
  double float_tol = kFloatTol;
};

template <class Run>
double loss_of(const Case& c, const std::vector<Vec>& in, Run& run) {
  const Outs<double> outs = run(double{}, in, 0.0);
  double loss = 0;
  for (size_t o = 0; o < c.upstream.size(); ++o) {
    if (c.upstream[o] < 0) continue;
    const Vec& r = c.in[sz(c.upstream[o])];
    for (size_t e = 0; e < r.size(); ++e) loss += outs[o][e] * r[e];
  }
  return loss;
}

template <class Run>
void check_case(const Case& c, Run run) {
  const Outs<double> outs = run(double{}, c.in, 0.0);
  for (size_t o = 0; o < outs.size(); ++o) {
    size_t bad = 0;
    ASSERT_TRUE(all_finite(outs[o], &bad))
        << "double output " << o << " element " << bad << " is not finite (unwritten or overflow)";
  }

  // (a) finite differences.
  for (const auto& [input, output] : c.grads) {
    std::vector<Vec> in = c.in;
    Vec& x = in[sz(input)];
    const Vec& g = outs[sz(output)];
    ASSERT_EQ(g.size(), x.size()) << "gradient " << output << " of input " << input;
    for (size_t e = 0; e < x.size(); ++e) {
      const double x0 = x[e];
      x[e] = x0 + kFdEps;
      const double lp = loss_of(c, in, run);
      x[e] = x0 - kFdEps;
      const double lm = loss_of(c, in, run);
      x[e] = x0;
      const double fd = (lp - lm) / (2 * kFdEps);
      ASSERT_NEAR(g[e], fd, kFdTol * std::max(1.0, std::abs(g[e])))
          << "d loss / d input " << input << " element " << e << " (output " << output << ")";
    }
  }

  // (d) accumulated outputs hold prefill + gradient; overwritten ones ignore the prefill.
  const Outs<double> pre = run(double{}, c.in, kPrefill);
  for (size_t o = 0; o < outs.size(); ++o) {
    const bool acc = std::find(c.accumulated.begin(), c.accumulated.end(), static_cast<int>(o)) !=
                     c.accumulated.end();
    for (size_t e = 0; e < outs[o].size(); ++e) {
      if (acc) {
        ASSERT_NEAR(pre[o][e], kPrefill + outs[o][e], 1e-12 * (1 + std::abs(outs[o][e])))
            << "accumulated output " << o << " element " << e;
      } else {
        ASSERT_EQ(pre[o][e], outs[o][e]) << "overwritten output " << o << " element " << e;
      }
    }
  }

  // (b) float vs double on the same float-rounded inputs, (c) determinism.
  std::vector<Vec> rounded = c.in;
  for (Vec& v : rounded) {
    for (double& x : v) x = static_cast<float>(x);
  }
  const Outs<float> f1 = run(float{}, rounded, 0.0);
  const Outs<double> d = run(double{}, rounded, 0.0);
  const Outs<float> f2 = run(float{}, rounded, 0.0);
  ASSERT_EQ(f1.size(), d.size());
  for (size_t o = 0; o < d.size(); ++o) {
    size_t bad = 0;
    ASSERT_TRUE(all_finite(f1[o], &bad)) << "float output " << o << " element " << bad;
    const double tol = c.float_tol * std::max(1.0, max_abs(d[o]));
    for (size_t e = 0; e < d[o].size(); ++e) {
      ASSERT_NEAR(f1[o][e], d[o][e], tol) << "float vs double, output " << o << " element " << e;
    }
    ASSERT_EQ(f1[o].size(), f2[o].size());
    ASSERT_EQ(std::memcmp(f1[o].data(), f2[o].data(), f1[o].size() * sizeof(float)), 0)
        << "float output " << o << " differs between two identical calls";
  }
}

// --- GEMM and add (no backward) -----------------------------------------------------

// C = alpha op(A) op(B) + beta C, in double with plain loops.
Vec gemm_reference(bool ta, bool tb, int m, int n, int k, double alpha, const Vec& a, int lda,
                   const Vec& b, int ldb, double beta, Vec c, int ldc) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int p = 0; p < k; ++p) {
        const double av = ta ? a[sz(p * lda + i)] : a[sz(i * lda + p)];
        const double bv = tb ? b[sz(j * ldb + p)] : b[sz(p * ldb + j)];
        s += av * bv;
      }
      double& cij = c[sz(i * ldc + j)];
      cij = alpha * s + (beta == 0 ? 0.0 : beta * cij);
    }
  }
  return c;
}

TEST(NnOps, GemmMatchesLoopsForEveryTransposeWithStrides) {
  auto rng = make_rng();
  const int m = 7, n = 5, k = 9, pad = 3;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      for (double beta : {0.0, 0.75}) {
        SCOPED_TRACE("trans_a " + std::to_string(ta) + " trans_b " + std::to_string(tb) + " beta " +
                     std::to_string(beta));
        const int lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad, ldc = n + pad;
        const Vec a = randn(rng, sz((ta ? k : m) * lda));
        const Vec b = randn(rng, sz((tb ? n : k) * ldb));
        Vec c0 = randn(rng, sz(m * ldc));
        const double alpha = 1.25;
        const Vec ref = gemm_reference(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c0, ldc);
        if (beta == 0) {
          // beta = 0 must not read C: a NaN there would survive 0 * NaN.
          for (int i = 0; i < m; ++i) {
            for (int j = 0; j < n; ++j) c0[sz(i * ldc + j)] = std::nan("");
          }
        }
        Vec cd = c0;
        gemm<double>(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, cd.data(), ldc);
        std::vector<float> cf = cast<float>(c0), cf2 = cf;
        const auto af = cast<float>(a), bf = cast<float>(b);
        const auto fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
        gemm<float>(ta, tb, m, n, k, fa, af.data(), lda, bf.data(), ldb, fb, cf.data(), ldc);
        gemm<float>(ta, tb, m, n, k, fa, af.data(), lda, bf.data(), ldb, fb, cf2.data(), ldc);
        for (int i = 0; i < m; ++i) {
          for (int j = 0; j < ldc; ++j) {
            const size_t e = sz(i * ldc + j);
            if (j >= n) {  // the padding of C is untouched
              ASSERT_TRUE(std::isnan(c0[e]) ? std::isnan(cd[e]) : cd[e] == c0[e]) << e;
              continue;
            }
            ASSERT_NEAR(cd[e], ref[e], 1e-12 * (1 + std::abs(ref[e]))) << i << "," << j;
            ASSERT_NEAR(cf[e], ref[e], 1e-5 * (1 + std::abs(ref[e]))) << i << "," << j;
          }
        }
        ASSERT_EQ(std::memcmp(cf.data(), cf2.data(), cf.size() * sizeof(float)), 0);
      }
    }
  }
}

TEST(NnOps, GemmWithEmptyInnerDimensionScalesC) {
  Vec c = {1, 2, std::nan(""), 4};
  gemm<double>(false, false, 2, 2, 0, 1.0, nullptr, 1, nullptr, 2, 0.0, c.data(), 2);
  EXPECT_EQ(c, Vec(4, 0.0));
  c = {1, 2, 3, 4};
  gemm<double>(false, false, 2, 2, 0, 1.0, nullptr, 1, nullptr, 2, 2.0, c.data(), 2);
  EXPECT_EQ(c, (Vec{2, 4, 6, 8}));
}

TEST(NnOps, AddIsElementwiseAndMayAlias) {
  auto rng = make_rng();
  const auto a = cast<float>(randn(rng, 37)), b = cast<float>(randn(rng, 37));
  auto y = nans<float>(37);
  add<float>(a.data(), b.data(), y.data(), y.size());
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], a[i] + b[i]) << i;
  auto alias = a;
  add<float>(alias.data(), b.data(), alias.data(), alias.size());
  EXPECT_EQ(alias, y);
}

// --- linear, RMSNorm, embedding -----------------------------------------------------

TEST(NnOps, LinearGradients) {
  auto rng = make_rng();
  const int n = 6, in = 9, out = 7;
  for (bool accumulate_dx : {false, true}) {
    SCOPED_TRACE(accumulate_dx ? "accumulate_dx" : "overwrite dx");
    Case c;
    c.in = {randn(rng, sz(n * in)), randn(rng, sz(out * in), 0.5), randn(rng, sz(n * out))};
    c.upstream = {2};
    c.grads = {{0, 1}, {1, 2}};
    c.accumulated = accumulate_dx ? std::vector<int>{1, 2} : std::vector<int>{2};
    check_case(c, [&](auto tag, const std::vector<Vec>& v, double prefill) {
      using T = decltype(tag);
      const auto x = cast<T>(v[0]), w = cast<T>(v[1]), dy = cast<T>(v[2]);
      auto y = nans<T>(sz(n * out));
      auto dx = accumulate_dx ? filled<T>(sz(n * in), prefill) : nans<T>(sz(n * in));
      auto dw = filled<T>(sz(out * in), prefill);
      linear_fwd<T>(x.data(), w.data(), y.data(), n, in, out);
      linear_bwd<T>(x.data(), w.data(), dy.data(), dx.data(), dw.data(), n, in, out, accumulate_dx);
      return Outs<T>{y, dx, dw};
    });
  }
}

TEST(NnOps, LinearBackwardWithoutInputGradient) {
  auto rng = make_rng();
  const int n = 4, in = 5, out = 3;
  const auto x = cast<float>(randn(rng, sz(n * in))), w = cast<float>(randn(rng, sz(out * in)));
  const auto dy = cast<float>(randn(rng, sz(n * out)));
  std::vector<float> dx(sz(n * in)), dw1(sz(out * in), 0.f), dw2(sz(out * in), 0.f);
  linear_bwd<float>(x.data(), w.data(), dy.data(), dx.data(), dw1.data(), n, in, out, false);
  linear_bwd<float>(x.data(), w.data(), dy.data(), nullptr, dw2.data(), n, in, out, false);
  EXPECT_EQ(dw1, dw2);
}

TEST(NnOps, RmsnormGradients) {
  auto rng = make_rng();
  const int n = 5, d = 12;
  const double eps = 1e-5;
  Case c;
  c.in = {randn(rng, sz(n * d)), uniform(rng, sz(d), 0.5, 1.5), randn(rng, sz(n * d))};
  c.upstream = {2};
  c.grads = {{0, 1}, {1, 2}};
  c.accumulated = {2};
  check_case(c, [&](auto tag, const std::vector<Vec>& v, double prefill) {
    using T = decltype(tag);
    const auto x = cast<T>(v[0]), w = cast<T>(v[1]), dy = cast<T>(v[2]);
    auto y = nans<T>(sz(n * d)), dx = nans<T>(sz(n * d));
    auto dw = filled<T>(sz(d), prefill);
    rmsnorm_fwd<T>(x.data(), w.data(), y.data(), n, d, eps);
    rmsnorm_bwd<T>(x.data(), w.data(), dy.data(), dx.data(), dw.data(), n, d, eps);
    return Outs<T>{y, dx, dw};
  });
}

TEST(NnOps, RmsnormNormalizesRows) {
  const Vec x = {3, 4, 0, 0};  // mean square 6.25, rms 2.5
  const Vec w = {1, 2, 1, 1};
  Vec y(4);
  rmsnorm_fwd<double>(x.data(), w.data(), y.data(), 1, 4, 0.0);
  EXPECT_NEAR(y[0], 1.2, 1e-15);
  EXPECT_NEAR(y[1], 3.2, 1e-15);
  EXPECT_EQ(y[2], 0.0);
}

TEST(NnOps, EmbeddingGradients) {
  auto rng = make_rng();
  const int vocab = 6, d = 5, n = 9;
  const std::vector<int32_t> tokens = {3, 0, 3, 5, 1, 3, 0, 2, 5};  // repeats; 4 unused
  Case c;
  c.in = {randn(rng, sz(vocab * d)), randn(rng, sz(n * d))};
  c.upstream = {1};
  c.grads = {{0, 1}};
  c.accumulated = {1};
  check_case(c, [&](auto tag, const std::vector<Vec>& v, double prefill) {
    using T = decltype(tag);
    const auto table = cast<T>(v[0]), dout = cast<T>(v[1]);
    auto out = nans<T>(sz(n * d));
    auto dtable = filled<T>(sz(vocab * d), prefill);
    embedding_fwd<T>(tokens.data(), table.data(), out.data(), n, d);
    embedding_bwd<T>(tokens.data(), dout.data(), dtable.data(), n, d);
    return Outs<T>{out, dtable};
  });
}

// --- attention ----------------------------------------------------------------------

struct AttnShape {
  int batch, seq, heads, kv_heads, head_dim;
  double theta;
  int width() const { return (heads + 2 * kv_heads) * head_dim; }
};

// The textbook definition, written independently of ops.cpp: RoPE on q and k, then
// softmax(q k^T / sqrt(d)) v over the causal prefix, per (batch, head), q head h on kv
// head h / (heads / kv_heads).
void attention_reference(const AttnShape& s, const Vec& qkv, Vec& out, Vec& lse) {
  const int hd = s.head_dim, half = hd / 2, w = s.width();
  out.assign(sz(s.batch * s.seq * s.heads * hd), 0.0);
  lse.assign(sz(s.batch * s.seq * s.heads), 0.0);
  auto rope = [&](const double* x, int pos) {
    Vec y(sz(hd));
    for (int i = 0; i < half; ++i) {
      const double angle = pos * std::pow(s.theta, -2.0 * i / hd);
      y[sz(i)] = x[i] * std::cos(angle) - x[i + half] * std::sin(angle);
      y[sz(i + half)] = x[i] * std::sin(angle) + x[i + half] * std::cos(angle);
    }
    return y;
  };
  for (int b = 0; b < s.batch; ++b) {
    for (int h = 0; h < s.heads; ++h) {
      const int kvh = h / (s.heads / s.kv_heads);
      for (int i = 0; i < s.seq; ++i) {
        const double* row_i = qkv.data() + sz((b * s.seq + i) * w);
        const Vec q = rope(row_i + sz(h * hd), i);
        Vec scores;
        for (int j = 0; j <= i; ++j) {
          const double* row_j = qkv.data() + sz((b * s.seq + j) * w);
          const Vec k = rope(row_j + sz((s.heads + kvh) * hd), j);
          scores.push_back(std::inner_product(q.begin(), q.end(), k.begin(), 0.0) /
                           std::sqrt(static_cast<double>(hd)));
        }
        const double m = *std::max_element(scores.begin(), scores.end());
        double sum = 0;
        for (double x : scores) sum += std::exp(x - m);
        const double l = m + std::log(sum);
        const size_t token = sz(b * s.seq + i);
        lse[token * sz(s.heads) + sz(h)] = l;
        for (int j = 0; j <= i; ++j) {
          const double p = std::exp(scores[sz(j)] - l);
          const double* v =
              qkv.data() + sz((b * s.seq + j) * w + (s.heads + s.kv_heads + kvh) * hd);
          for (int c = 0; c < hd; ++c) out[token * sz(s.heads * hd) + sz(h * hd + c)] += p * v[c];
        }
      }
    }
  }
}

TEST(NnOps, AttentionMatchesReference) {
  auto rng = make_rng();
  // seq 150 spans several row blocks of the implementation, the last one partial.
  for (const AttnShape s : {AttnShape{2, 17, 4, 2, 8, 10000.0}, AttnShape{1, 33, 3, 1, 16, 500.0},
                            AttnShape{3, 9, 2, 2, 4, 10.0}, AttnShape{2, 150, 4, 2, 8, 10000.0}}) {
    SCOPED_TRACE("heads " + std::to_string(s.heads) + " kv_heads " + std::to_string(s.kv_heads));
    const Vec qkv = randn(rng, sz(s.batch * s.seq * s.width()));
    Vec out_ref, lse_ref;
    attention_reference(s, qkv, out_ref, lse_ref);
    Vec out(out_ref.size(), std::nan("")), lse(lse_ref.size(), std::nan(""));
    attention_fwd<double>(qkv.data(), out.data(), lse.data(), s.batch, s.seq, s.heads, s.kv_heads,
                          s.head_dim, s.theta);
    for (size_t e = 0; e < out.size(); ++e) ASSERT_NEAR(out[e], out_ref[e], 1e-12) << e;
    for (size_t e = 0; e < lse.size(); ++e) ASSERT_NEAR(lse[e], lse_ref[e], 1e-12) << e;
  }
}

TEST(NnOps, AttentionGradients) {
  auto rng = make_rng();
  // seq 70 spans two row blocks of the implementation (keys and values gather gradients
  // from both).
  for (const AttnShape s :
       {AttnShape{2, 6, 4, 2, 4, 100.0}, AttnShape{1, 5, 2, 2, 6, 10.0},
        AttnShape{1, 5, 3, 1, 4, 10000.0}, AttnShape{1, 70, 2, 1, 4, 10000.0}}) {
    SCOPED_TRACE("heads " + std::to_string(s.heads) + " kv_heads " + std::to_string(s.kv_heads));
    const size_t tokens = sz(s.batch * s.seq);
    Case c;
    c.in = {randn(rng, tokens * sz(s.width())), randn(rng, tokens * sz(s.heads * s.head_dim))};
    c.upstream = {1, -1};  // lse is an output the backward reads, not a loss term
    c.grads = {{0, 2}};
    check_case(c, [&](auto tag, const std::vector<Vec>& v, double) {
      using T = decltype(tag);
      const auto qkv = cast<T>(v[0]), dout = cast<T>(v[1]);
      auto out = nans<T>(v[1].size()), lse = nans<T>(tokens * sz(s.heads));
      auto dqkv = nans<T>(v[0].size());
      attention_fwd<T>(qkv.data(), out.data(), lse.data(), s.batch, s.seq, s.heads, s.kv_heads,
                       s.head_dim, s.theta);
      attention_bwd<T>(qkv.data(), out.data(), lse.data(), dout.data(), dqkv.data(), s.batch, s.seq,
                       s.heads, s.kv_heads, s.head_dim, s.theta);
      return Outs<T>{out, lse, dqkv};
    });
  }
}

// --- SwiGLU, softmax, top-k ---------------------------------------------------------

TEST(NnOps, SwigluGradients) {
  auto rng = make_rng();
  const size_t n = 40;
  Case c;
  c.in = {randn(rng, n, 2.0), randn(rng, n), randn(rng, n)};
  c.upstream = {2};
  c.grads = {{0, 1}, {1, 2}};
  check_case(c, [&](auto tag, const std::vector<Vec>& v, double) {
    using T = decltype(tag);
    const auto g = cast<T>(v[0]), u = cast<T>(v[1]), dact = cast<T>(v[2]);
    auto act = nans<T>(n), dg = nans<T>(n), du = nans<T>(n);
    swiglu_fwd<T>(g.data(), u.data(), act.data(), n);
    swiglu_bwd<T>(g.data(), u.data(), dact.data(), dg.data(), du.data(), n);
    return Outs<T>{act, dg, du};
  });
}

TEST(NnOps, SwigluIsFiniteForLargeInputs) {
  const std::vector<float> g = {-200.f, -90.f, 90.f, 200.f}, u(4, 1.f), dact(4, 1.f);
  std::vector<float> act(4), dg(4), du(4);
  swiglu_fwd<float>(g.data(), u.data(), act.data(), 4);
  swiglu_bwd<float>(g.data(), u.data(), dact.data(), dg.data(), du.data(), 4);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::isfinite(act[i]) && std::isfinite(dg[i]) && std::isfinite(du[i])) << i;
  }
  EXPECT_EQ(act[3], 200.f);
}

TEST(NnOps, SoftmaxGradients) {
  auto rng = make_rng();
  const int n = 5, e = 8;
  Case c;
  c.in = {randn(rng, sz(n * e), 2.0), randn(rng, sz(n * e))};
  c.upstream = {1};
  c.grads = {{0, 1}};
  check_case(c, [&](auto tag, const std::vector<Vec>& v, double) {
    using T = decltype(tag);
    const auto logits = cast<T>(v[0]), dprobs = cast<T>(v[1]);
    auto probs = nans<T>(v[0].size()), dlogits = nans<T>(v[0].size());
    softmax_fwd<T>(logits.data(), probs.data(), n, e);
    softmax_bwd<T>(probs.data(), dprobs.data(), dlogits.data(), n, e);
    return Outs<T>{probs, dlogits};
  });
}

TEST(NnOps, SoftmaxIsStableForLargeLogits) {
  const std::vector<float> logits = {1000.f, 999.f, -1000.f};
  std::vector<float> probs(3);
  softmax_fwd<float>(logits.data(), probs.data(), 1, 3);
  EXPECT_NEAR(probs[0], 1 / (1 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(probs[1], 1 / (1 + std::exp(1.0)), 1e-6);
  EXPECT_EQ(probs[2], 0.f);
}

// Rows whose values are at least 0.2 apart: the selection stays fixed under the finite
// difference step (top-k is piecewise constant, its gradient exists away from ties).
Vec untied_probs(std::mt19937& rng, int n, int e) {
  Vec p(sz(n * e));
  std::vector<int> order(sz(e));
  std::uniform_real_distribution<double> frac(0.1, 0.9);
  for (int r = 0; r < n; ++r) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int x = 0; x < e; ++x) p[sz(r * e + x)] = (order[sz(x)] + frac(rng)) / e;
  }
  return p;
}

TEST(NnOps, TopkGradients) {
  auto rng = make_rng();
  const int n = 6, e = 8, k = 3;
  for (bool norm : {false, true}) {
    SCOPED_TRACE(norm ? "norm_topk" : "raw weights");
    Case c;
    c.in = {untied_probs(rng, n, e), randn(rng, sz(n * k))};
    c.upstream = {-1, 1};  // idx is piecewise constant
    c.grads = {{0, 2}};
    check_case(c, [&](auto tag, const std::vector<Vec>& v, double) {
      using T = decltype(tag);
      const auto probs = cast<T>(v[0]), dweights = cast<T>(v[1]);
      std::vector<int32_t> idx(sz(n * k), -1);
      auto weights = nans<T>(sz(n * k)), dprobs = nans<T>(v[0].size());
      topk_fwd<T>(probs.data(), idx.data(), weights.data(), n, e, k, norm);
      topk_bwd<T>(probs.data(), idx.data(), dweights.data(), dprobs.data(), n, e, k, norm);
      return Outs<T>{std::vector<T>(idx.begin(), idx.end()), weights, dprobs};
    });
  }
}

TEST(NnOps, TopkOrdersDescendingWithLowerIndexFirstOnTies) {
  const std::vector<float> probs = {0.1f, 0.3f, 0.2f, 0.3f, 0.1f,   // tie at the top
                                    0.2f, 0.2f, 0.2f, 0.2f, 0.2f};  // all tied
  std::vector<int32_t> idx(6);
  std::vector<float> w(6);
  topk_fwd<float>(probs.data(), idx.data(), w.data(), 2, 5, 3, false);
  EXPECT_EQ(idx, (std::vector<int32_t>{1, 3, 2, 0, 1, 2}));
  EXPECT_EQ(w[0], 0.3f);
  EXPECT_EQ(w[2], 0.2f);
  topk_fwd<float>(probs.data(), idx.data(), w.data(), 2, 5, 3, true);
  EXPECT_NEAR(w[0] + w[1] + w[2], 1.0f, 1e-6f);
  EXPECT_NEAR(w[0], 0.375f, 1e-6f);
}

// --- MoE routing --------------------------------------------------------------------

// Per token, k distinct experts out of `experts`, never expert `unused`.
std::vector<int32_t> random_assignment(std::mt19937& rng, int n, int k, int experts, int unused) {
  std::vector<int32_t> pool, idx;
  for (int x = 0; x < experts; ++x) {
    if (x != unused) pool.push_back(x);
  }
  for (int t = 0; t < n; ++t) {
    std::shuffle(pool.begin(), pool.end(), rng);
    idx.insert(idx.end(), pool.begin(), pool.begin() + k);
  }
  return idx;
}

TEST(NnOps, MoeRouteIsExpertMajorThenTokenThenSlot) {
  auto rng = make_rng();
  const int n = 13, k = 3, experts = 8;
  const auto idx = random_assignment(rng, n, k, experts, 5);
  std::vector<int32_t> perm(sz(n * k), -1), offsets(sz(experts + 1), -1);
  moe_route(idx.data(), n, k, experts, perm.data(), offsets.data());

  EXPECT_EQ(offsets[0], 0);
  EXPECT_EQ(offsets[sz(experts)], n * k);
  EXPECT_EQ(offsets[5], offsets[6]) << "expert 5 has no tokens";
  std::vector<int32_t> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  for (int a = 0; a < n * k; ++a) ASSERT_EQ(sorted[sz(a)], a) << "perm is not a permutation";
  for (int x = 0; x < experts; ++x) {
    const auto count = std::count(idx.begin(), idx.end(), x);
    ASSERT_EQ(offsets[sz(x + 1)] - offsets[sz(x)], count) << "expert " << x;
    for (int32_t r = offsets[sz(x)]; r < offsets[sz(x + 1)]; ++r) {
      ASSERT_EQ(idx[sz(perm[sz(r)])], x) << "row " << r;
      // perm = t * k + s ascending: token, then slot.
      if (r > offsets[sz(x)]) {
        ASSERT_LT(perm[sz(r - 1)], perm[sz(r)]) << "row " << r;
      }
    }
  }
}

TEST(NnOps, MoeDispatchGradients) {
  auto rng = make_rng();
  const int n = 7, k = 2, experts = 4, d = 5, rows = n * k;
  const auto idx = random_assignment(rng, n, k, experts, -1);
  std::vector<int32_t> perm(sz(rows)), offsets(sz(experts + 1));
  moe_route(idx.data(), n, k, experts, perm.data(), offsets.data());
  Case c;
  c.in = {randn(rng, sz(n * d)), randn(rng, sz(rows * d))};
  c.upstream = {1};
  c.grads = {{0, 1}};
  c.accumulated = {1};
  check_case(c, [&](auto tag, const std::vector<Vec>& v, double prefill) {
    using T = decltype(tag);
    const auto x = cast<T>(v[0]), dxd = cast<T>(v[1]);
    auto xd = nans<T>(sz(rows * d));
    auto dx = filled<T>(sz(n * d), prefill);
    moe_dispatch_fwd<T>(x.data(), perm.data(), xd.data(), rows, k, d);
    moe_dispatch_bwd<T>(dxd.data(), perm.data(), dx.data(), rows, k, d);
    return Outs<T>{xd, dx};
  });
}

TEST(NnOps, MoeCombineGradients) {
  auto rng = make_rng();
  const int n = 7, k = 3, experts = 5, d = 4, rows = n * k;
  const auto idx = random_assignment(rng, n, k, experts, -1);
  std::vector<int32_t> perm(sz(rows)), offsets(sz(experts + 1)), inv(sz(rows));
  moe_route(idx.data(), n, k, experts, perm.data(), offsets.data());
  for (int r = 0; r < rows; ++r) inv[sz(perm[sz(r)])] = r;
  Case c;
  c.in = {randn(rng, sz(n * d)), randn(rng, sz(rows * d)), uniform(rng, sz(n * k), 0.1, 1.0),
          randn(rng, sz(n * d))};
  c.upstream = {3};
  // The residual's gradient is dy itself (the caller adds it): output 3 is dy.
  c.grads = {{0, 3}, {1, 1}, {2, 2}};
  check_case(c, [&](auto tag, const std::vector<Vec>& v, double) {
    using T = decltype(tag);
    const auto residual = cast<T>(v[0]), eo = cast<T>(v[1]), weights = cast<T>(v[2]);
    const auto dy = cast<T>(v[3]);
    auto y = nans<T>(sz(n * d)), deo = nans<T>(sz(rows * d)), dweights = nans<T>(sz(n * k));
    moe_combine_fwd<T>(residual.data(), eo.data(), weights.data(), inv.data(), y.data(), n, k, d);
    moe_combine_bwd<T>(eo.data(), weights.data(), inv.data(), dy.data(), deo.data(),
                       dweights.data(), n, k, d);
    return Outs<T>{y, deo, dweights, dy};
  });
}

// --- cross-entropy ------------------------------------------------------------------

TEST(NnOps, CrossEntropyGradients) {
  auto rng = make_rng();
  const int n = 6, v = 11;
  std::vector<int32_t> targets(sz(n));
  std::uniform_int_distribution<int32_t> pick(0, v - 1);
  for (auto& t : targets) t = pick(rng);
  Case c;
  c.in = {randn(rng, sz(n * v), 2.0), Vec{1.0}};
  c.upstream = {1};
  c.grads = {{0, 1}};
  check_case(c, [&](auto tag, const std::vector<Vec>& in, double) {
    using T = decltype(tag);
    const auto logits = cast<T>(in[0]);
    auto dlogits = nans<T>(in[0].size());
    const double loss = cross_entropy<T>(logits.data(), targets.data(), dlogits.data(), n, v);
    return Outs<T>{{static_cast<T>(loss)}, dlogits};
  });
}

TEST(NnOps, CrossEntropyOfUniformLogitsIsLogV) {
  const std::vector<float> logits(size_t{2} * 1000, 1000.f);  // large: needs the max subtraction
  const std::vector<int32_t> targets = {0, 999};
  std::vector<float> dlogits(logits.size());
  EXPECT_NEAR(cross_entropy<float>(logits.data(), targets.data(), dlogits.data(), 2, 1000),
              std::log(1000.0), 1e-5);
  EXPECT_NEAR(dlogits[0], (0.001 - 1) / 2, 1e-7);
  EXPECT_NEAR(dlogits[1], 0.001 / 2, 1e-7);
}

// --- contract violations -----------------------------------------------------------

TEST(NnOps, BadShapesThrowNamingTheValue) {
  using spillway::testing::error_of;
  EXPECT_NE(error_of([] {
              attention_fwd<float>(nullptr, nullptr, nullptr, 1, 1, 3, 2, 4, 10000.0);
            }).find("kv_heads (2)"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              attention_bwd<float>(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 1, 2, 1, 5,
                                   10000.0);
            }).find("head_dim is 5"),
            std::string::npos);
  const std::vector<float> probs(4, 0.25f);
  std::vector<int32_t> idx(5);
  std::vector<float> w(5);
  EXPECT_NE(error_of([&] {
              topk_fwd<float>(probs.data(), idx.data(), w.data(), 1, 4, 5, false);
            }).find("k is 5"),
            std::string::npos);
  const std::vector<int32_t> bad = {0, 4};
  std::vector<int32_t> perm(2), offsets(5);
  EXPECT_NE(error_of([&] {
              moe_route(bad.data(), 1, 2, 4, perm.data(), offsets.data());
            }).find("expert index 4"),
            std::string::npos);
}

// --- Mamba-2 (ssm_ops.cpp) --------------------------------------------------------------

TEST(NnOps, CausalConvSiluGradients) {
  auto rng = make_rng();
  const int batch = 2, seq = 5, ch = 3, width = 4;
  const size_t n = sz(batch * seq * ch);
  Case c;
  c.in = {randn(rng, n), randn(rng, sz(ch * width), 0.5), randn(rng, sz(ch), 0.5), randn(rng, n)};
  c.upstream = {3};
  c.grads = {{0, 1}, {1, 2}, {2, 3}};
  c.accumulated = {2, 3};
  check_case(c, [&](auto tag, const std::vector<Vec>& v, double pre) {
    using T = decltype(tag);
    const auto x = cast<T>(v[0]), w = cast<T>(v[1]), bias = cast<T>(v[2]), dy = cast<T>(v[3]);
    auto y = nans<T>(n), dx = nans<T>(n);
    auto dw = filled<T>(v[1].size(), pre), db = filled<T>(v[2].size(), pre);
    causal_conv1d_silu_fwd<T>(x.data(), w.data(), bias.data(), y.data(), batch, seq, ch, width);
    causal_conv1d_silu_bwd<T>(x.data(), w.data(), bias.data(), dy.data(), dx.data(), dw.data(),
                              db.data(), batch, seq, ch, width);
    return Outs<T>{y, dx, dw, db};
  });
}

// The scan over two sequences of 7 tokens in chunks of 3 (the last one partial), 4 heads of
// 2 in 2 groups, state 3: every input's gradient, the states restarted from in backward.
TEST(NnOps, SsdScanGradients) {
  auto rng = make_rng();
  SsdShape s;
  s.batch = 2;
  s.seq = 7;
  s.heads = 4;
  s.head_dim = 2;
  s.groups = 2;
  s.state = 3;
  s.chunk = 3;
  const size_t tok = sz(s.batch * s.seq);
  const size_t hp = sz(s.heads * s.head_dim), gn = sz(s.groups * s.state);
  const size_t st = sz(s.batch * s.chunks()) * hp * sz(s.state);
  Case c;
  c.in = {randn(rng, tok * hp),         randn(rng, tok * sz(s.heads), 0.5),
          randn(rng, sz(s.heads), 0.5), uniform(rng, sz(s.heads), -1.0, 0.5),
          randn(rng, tok * gn),         randn(rng, tok * gn),
          randn(rng, sz(s.heads)),      randn(rng, tok * hp)};
  c.upstream = {7, -1};
  c.grads = {{0, 2}, {1, 3}, {2, 4}, {3, 5}, {4, 6}, {5, 7}, {6, 8}};
  c.accumulated = {4, 5, 8};
  check_case(c, [&](auto tag, const std::vector<Vec>& v, double pre) {
    using T = decltype(tag);
    const auto x = cast<T>(v[0]), dtr = cast<T>(v[1]), dtb = cast<T>(v[2]), alog = cast<T>(v[3]);
    const auto bm = cast<T>(v[4]), cm = cast<T>(v[5]), dsk = cast<T>(v[6]), dy = cast<T>(v[7]);
    auto y = nans<T>(tok * hp), states = nans<T>(st), dx = nans<T>(tok * hp);
    auto ddt = nans<T>(v[1].size()), db = nans<T>(tok * gn), dc = nans<T>(tok * gn);
    auto ddtb = filled<T>(v[2].size(), pre), dalog = filled<T>(v[3].size(), pre);
    auto dd = filled<T>(v[6].size(), pre);
    ssd_scan_fwd<T>(s, x.data(), dtr.data(), dtb.data(), alog.data(), bm.data(), cm.data(),
                    dsk.data(), y.data(), states.data());
    ssd_scan_bwd<T>(s, x.data(), dtr.data(), dtb.data(), alog.data(), bm.data(), cm.data(),
                    dsk.data(), states.data(), dy.data(), dx.data(), ddt.data(), ddtb.data(),
                    dalog.data(), db.data(), dc.data(), dd.data());
    return Outs<T>{y, states, dx, ddt, ddtb, dalog, db, dc, dd};
  });
}

// The chunk states are the recurrence's own: with one chunk per token, state t + 1 is the
// forward's S_t; and chunking does not change y.
TEST(NnOps, SsdScanStatesAreTheRecurrence) {
  auto rng = make_rng();
  SsdShape one;
  one.seq = 6;
  one.heads = 2;
  one.head_dim = 2;
  one.state = 2;
  one.chunk = 1;
  SsdShape whole = one;
  whole.chunk = 6;
  const size_t tok = sz(one.seq), hp = 4, gn = 2;
  const auto x = cast<float>(randn(rng, tok * hp)), dtr = cast<float>(randn(rng, tok * 2, 0.5));
  const auto dtb = cast<float>(randn(rng, 2)), alog = cast<float>(randn(rng, 2, 0.3));
  const auto bm = cast<float>(randn(rng, tok * gn)), cm = cast<float>(randn(rng, tok * gn));
  const auto dsk = cast<float>(randn(rng, 2));
  std::vector<float> y1(tok * hp), y6(tok * hp), s1(tok * hp * 2), s6(hp * 2);
  ssd_scan_fwd<float>(one, x.data(), dtr.data(), dtb.data(), alog.data(), bm.data(), cm.data(),
                      dsk.data(), y1.data(), s1.data());
  ssd_scan_fwd<float>(whole, x.data(), dtr.data(), dtb.data(), alog.data(), bm.data(), cm.data(),
                      dsk.data(), y6.data(), s6.data());
  EXPECT_EQ(std::memcmp(y1.data(), y6.data(), y1.size() * sizeof(float)), 0);
  for (float v : s6) EXPECT_EQ(v, 0.0f);  // the state before the first token
  // y_0 = S_0 C_0 + D x_0 with S_0 = dt x_0 B_0^T: the state saved before token 1.
  const double dt0 = std::log1p(std::exp(static_cast<double>(dtr[0]) + dtb[0]));
  EXPECT_NEAR(s1[hp * 2 + 0], static_cast<float>(dt0 * x[0] * bm[0]), 1e-6);
}

TEST(NnOps, GatedRmsNormGradients) {
  auto rng = make_rng();
  const int n = 4, d = 6;
  Case c;
  c.in = {randn(rng, sz(n * d)), randn(rng, sz(n * d), 1.5), randn(rng, sz(d)),
          randn(rng, sz(n * d))};
  c.upstream = {3};
  c.grads = {{0, 1}, {1, 2}, {2, 3}};
  c.accumulated = {3};
  check_case(c, [&](auto tag, const std::vector<Vec>& v, double pre) {
    using T = decltype(tag);
    const auto x = cast<T>(v[0]), z = cast<T>(v[1]), w = cast<T>(v[2]), dy = cast<T>(v[3]);
    auto y = nans<T>(v[0].size()), dx = nans<T>(v[0].size()), dz = nans<T>(v[0].size());
    auto dw = filled<T>(v[2].size(), pre);
    gated_rmsnorm_fwd<T>(x.data(), z.data(), w.data(), y.data(), n, d, 1e-5);
    gated_rmsnorm_bwd<T>(x.data(), z.data(), w.data(), dy.data(), dx.data(), dz.data(), dw.data(),
                         n, d, 1e-5);
    return Outs<T>{y, dx, dz, dw};
  });
}

// A sliding window (Mistral's) over the KV cache: one that covers every key is full
// attention to the bit; a window of one key gives each query its own token's v.
TEST(CachedAttention, SlidingWindowKeepsTheLastKeys) {
  constexpr int n = 7, heads = 2, kv = 1, hd = 4, cap = 8;
  const int width = (heads + 2 * kv) * hd;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> qkv(static_cast<size_t>(n * width));
  for (float& v : qkv) v = normal(rng);
  std::vector<double> cs(static_cast<size_t>(cap * hd / 2)), sn(cs.size());
  rope_angles(cap, hd, 10000.0, cs.data(), sn.data());
  auto run = [&](int window) {
    std::vector<float> out(static_cast<size_t>(n * heads * hd)), k(static_cast<size_t>(cap * hd)),
        v(k.size()), scratch(attention_cached_scratch(n, n, heads, hd));
    attention_cached_fwd(qkv.data(), out.data(), k.data(), v.data(), cap, 0, n, heads, kv, hd,
                         cs.data(), sn.data(), scratch.data(), CachedAttention{window});
    return out;
  };
  EXPECT_EQ(run(n), run(0));
  EXPECT_NE(run(3), run(0));
  const std::vector<float> own = run(1);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < hd; ++i)
        EXPECT_FLOAT_EQ(own[static_cast<size_t>((t * heads + h) * hd + i)],
                        qkv[static_cast<size_t>(t * width + (heads + kv) * hd + i)]);
}

// Note [Served Gemma]: the softmax scale (query_pre_attn_scalar^-1/2) and the soft cap of the
// scores (cap * tanh(s / cap) before the mask), against a direct computation (RoPE at angle
// 0: the identity); the default scale given explicitly is the default to the bit; the table
// of the step's positions only (rope_first) is the whole table's.
TEST(CachedAttention, ScaleAndSoftcapAsGemmaComputesThem) {
  constexpr int n = 6, heads = 2, kv = 1, hd = 4, cap = 8;
  const int width = (heads + 2 * kv) * hd;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> qkv(static_cast<size_t>(n * width));
  for (float& v : qkv) v = normal(rng);
  const std::vector<double> one(static_cast<size_t>(cap * hd / 2), 1.0), zero(one.size(), 0.0);
  auto run = [&](const CachedAttention& how, const double* cs, const double* sn) {
    std::vector<float> out(static_cast<size_t>(n * heads * hd)), k(static_cast<size_t>(cap * hd)),
        v(k.size()), scratch(attention_cached_scratch(n, n, heads, hd));
    attention_cached_fwd(qkv.data(), out.data(), k.data(), v.data(), cap, 0, n, heads, kv, hd, cs,
                         sn, scratch.data(), how);
    return out;
  };
  const double scale = 0.3, softcap = 1.5;
  const std::vector<float> got = run({0, scale, softcap, 0}, one.data(), zero.data());
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < n; ++i) {
      const float* q = &qkv[static_cast<size_t>(i * width + h * hd)];
      std::vector<double> p(static_cast<size_t>(i + 1));
      double mx = -1e300, sum = 0;
      for (int j = 0; j <= i; ++j) {
        const float* k = &qkv[static_cast<size_t>(j * width + heads * hd)];
        double s = 0;
        for (int e = 0; e < hd; ++e) s += static_cast<double>(q[e]) * k[e];
        s = softcap * std::tanh(s * scale / softcap);
        p[static_cast<size_t>(j)] = s;
        mx = std::max(mx, s);
      }
      for (double& x : p) sum += (x = std::exp(x - mx));
      for (int e = 0; e < hd; ++e) {
        double o = 0;
        for (int j = 0; j <= i; ++j)
          o += p[static_cast<size_t>(j)] / sum *
               qkv[static_cast<size_t>(j * width + (heads + kv) * hd + e)];
        EXPECT_NEAR(got[static_cast<size_t>((i * heads + h) * hd + e)], o, 1e-5) << h << i << e;
      }
    }
  }
  std::vector<double> cs(one.size()), sn(one.size());
  rope_angles(cap, hd, 10000.0, cs.data(), sn.data());
  EXPECT_EQ(run({0, 1.0 / std::sqrt(double{hd}), 0, 0}, cs.data(), sn.data()),
            run({}, cs.data(), sn.data()));
  EXPECT_NE(run({0, 0, softcap, 0}, cs.data(), sn.data()), run({}, cs.data(), sn.data()));
  // Two steps of 3 tokens; the second with the whole table or its rows from position 3 on.
  auto two_steps = [&](int first) {
    std::vector<float> out(static_cast<size_t>(n * heads * hd)), k(static_cast<size_t>(cap * hd)),
        v(k.size()), scratch(attention_cached_scratch(3, n, heads, hd));
    attention_cached_fwd(qkv.data(), out.data(), k.data(), v.data(), cap, 0, 3, heads, kv, hd,
                         cs.data(), sn.data(), scratch.data());
    const size_t skip = static_cast<size_t>(first * hd / 2);
    attention_cached_fwd(qkv.data() + 3 * width, out.data() + 3 * heads * hd, k.data(), v.data(),
                         cap, 3, 3, heads, kv, hd, cs.data() + skip, sn.data() + skip,
                         scratch.data(), CachedAttention{0, 0, 0, first});
    return out;
  };
  EXPECT_EQ(two_steps(3), two_steps(0));
}

}  // namespace
}  // namespace spillway::nn

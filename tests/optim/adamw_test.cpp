// Tests of the CPU AdamW (include/spillway/optim/optim.hpp):
//   (a) the SIMD step equals the scalar reference bit for bit, on every Highway target
//       this CPU runs, for odd sizes and unaligned pointers, fp32 and bf16 gradients, a
//       grad_scale != 1, every copy type, several steps; the thread pool likewise;
//   (b) the scalar reference against float64 PyTorch AdamW over 100 steps, within an error
//       bound carried along with the reference (derived at kUnit below);
//   (c) bf16/fp16 conversions: every 16-bit pattern round-trips, ties go to even, fp16
//       overflows to inf and keeps subnormals; the SIMD copy-out rounds the same way;
//   (d) NaN/Inf gradients give NaN weights, no crash, and leave other elements alone;
//   (e) poisoned outputs are fully written and nothing past n is touched.
// Inputs are random with a printed seed; SPILLWAY_TEST_SEED=<n> reruns one.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "spillway/optim/optim.hpp"
#include "test_support.hpp"

namespace spillway::optim {
namespace {

using spillway::testing::make_rng;

uint32_t bits_of(float x) {
  return std::bit_cast<uint32_t>(x);
}
bool bf16_is_nan(uint16_t b) {
  return (b & 0x7F80) == 0x7F80 && (b & 0x7F) != 0;
}
bool fp16_is_nan(uint16_t h) {
  return (h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0;
}

// Makes adamw_step_simd use one target for the scope, then the best one again.
class ForceTarget {
 public:
  explicit ForceTarget(const std::string& name) {
    EXPECT_TRUE(adamw_simd_force_target(name.c_str())) << name;
  }
  ~ForceTarget() { adamw_simd_force_target(nullptr); }
  ForceTarget(const ForceTarget&) = delete;
  ForceTarget& operator=(const ForceTarget&) = delete;
};

// One parameter tensor: state, gradient and copy, each with `offset` guard elements in
// front (so the pointers handed out are not vector-aligned for offset 1) and kGuard
// behind, all guards poisoned; copy_out poisoned with 0xFFFF (a NaN in bf16 and fp16,
// never the copy of a finite p).
struct Tensor {
  static constexpr size_t kGuard = 17;
  static constexpr uint32_t kPoison = 0x7FBADBAD;  // a signalling NaN nothing computes
  size_t n = 0;
  size_t offset = 0;
  std::vector<float> p, m, v, g32;
  std::vector<uint16_t> g16, out;

  Tensor(size_t n_, size_t offset_) : n(n_), offset(offset_) {
    const size_t len = offset + n + kGuard;
    const float poison = std::bit_cast<float>(kPoison);
    p.assign(len, poison);
    m.assign(len, poison);
    v.assign(len, poison);
    g32.assign(len, poison);
    g16.assign(len, 0xFFFF);
    out.assign(len, 0xFFFF);
  }
  float* P() { return p.data() + offset; }
  float* M() { return m.data() + offset; }
  float* V() { return v.data() + offset; }

  // p spans magnitudes so the fp16 copy meets subnormals and overflow.
  void randomize_state(std::mt19937& rng) {
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    std::uniform_real_distribution<double> ex(-28.0, 17.0);
    std::normal_distribution<double> nd(0.0, 1.0);
    for (size_t i = 0; i < n; ++i) {
      P()[i] = static_cast<float>(u(rng) * std::exp2(ex(rng)));
      const double mm = 0.1 * nd(rng);
      M()[i] = static_cast<float>(mm);
      V()[i] = static_cast<float>(mm * mm + 1e-3 * std::abs(nd(rng)));
    }
  }
  // Gradients of magnitude 2^-12 .. 2^6, some exactly zero; the bf16 copy holds the same
  // values rounded to bf16.
  void randomize_grad(std::mt19937& rng) {
    std::normal_distribution<double> nd(0.0, 1.0);
    std::uniform_real_distribution<double> ex(-12.0, 6.0);
    std::uniform_int_distribution<int> zero(0, 31);
    for (size_t i = 0; i < n; ++i) {
      const float g = zero(rng) == 0 ? 0.0f : static_cast<float>(nd(rng) * std::exp2(ex(rng)));
      g32[offset + i] = g;
      g16[offset + i] = float_to_bf16(g);
    }
  }
  AdamWArgs args(GradType gt, CopyType ct, float grad_scale, int64_t step) {
    AdamWArgs a;
    a.p = P();
    a.m = M();
    a.v = V();
    a.g = gt == GradType::kBf16 ? static_cast<const void*>(g16.data() + offset)
                                : static_cast<const void*>(g32.data() + offset);
    a.grad_type = gt;
    a.grad_scale = grad_scale;
    a.copy_out = ct == CopyType::kNone ? nullptr : out.data() + offset;
    a.copy_type = ct;
    a.n = n;
    a.step = step;
    return a;
  }
};

// Bitwise equality of everything, guards included (so nothing past n was touched).
// With nan_ok, two NaNs count as equal (Note [AdamW operation order]: the payload of a
// NaN may differ between the paths).
void expect_same(const Tensor& x, const Tensor& y, bool nan_ok = false) {
  ASSERT_EQ(x.p.size(), y.p.size());
  size_t bad = 0;
  for (size_t i = 0; i < x.p.size() && bad < 5; ++i) {
    const float* xs[] = {&x.p[i], &x.m[i], &x.v[i]};
    const float* ys[] = {&y.p[i], &y.m[i], &y.v[i]};
    for (int k = 0; k < 3; ++k) {
      const bool both_nan = std::isnan(*xs[k]) && std::isnan(*ys[k]);
      if (bits_of(*xs[k]) != bits_of(*ys[k]) && !(nan_ok && both_nan)) {
        ADD_FAILURE() << "pmv"[k] << "[" << i << "] (offset " << x.offset << ", n " << x.n
                      << "): " << std::hexfloat << *xs[k] << " vs " << *ys[k];
        ++bad;
      }
    }
    const bool both_nan = (bf16_is_nan(x.out[i]) || fp16_is_nan(x.out[i])) &&
                          (bf16_is_nan(y.out[i]) || fp16_is_nan(y.out[i]));
    if (x.out[i] != y.out[i] && !(nan_ok && both_nan)) {
      ADD_FAILURE() << "out[" << i << "]: " << std::hex << x.out[i] << " vs " << y.out[i];
      ++bad;
    }
  }
}

constexpr GradType kGradTypes[] = {GradType::kFp32, GradType::kBf16};
constexpr CopyType kCopyTypes[] = {CopyType::kNone, CopyType::kBf16, CopyType::kFp16};

AdamWParams test_params() {
  AdamWParams hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.1;
  return hp;
}

// --- (a) SIMD and pool vs scalar, bitwise --------------------------------------------

TEST(AdamWSimd, MatchesScalarBitwiseOnEveryTarget) {
  std::mt19937 rng = make_rng();
  const std::vector<std::string> targets = adamw_simd_targets();
  ASSERT_FALSE(targets.empty());
  std::cout << "[ info ] best target " << adamw_simd_target() << "; testing";
  for (const std::string& t : targets) std::cout << " " << t;
  std::cout << "\n";
  const AdamWParams hp = test_params();
  for (const std::string& target : targets) {
    ForceTarget force(target);
    EXPECT_EQ(std::string(adamw_simd_target()), target);
    for (size_t n : {0, 1, 7, 63, 1000, 100003}) {
      for (size_t offset : {0, 1}) {
        for (GradType gt : kGradTypes) {
          for (CopyType ct : kCopyTypes) {
            SCOPED_TRACE(target + " n=" + std::to_string(n) + " offset=" + std::to_string(offset) +
                         " grad=" + std::to_string(int(gt)) + " copy=" + std::to_string(int(ct)));
            Tensor ref(n, offset);
            ref.randomize_state(rng);
            Tensor simd = ref;
            for (int64_t step : {1, 2, 1000}) {
              ref.randomize_grad(rng);
              simd.g32 = ref.g32;
              simd.g16 = ref.g16;
              adamw_step_scalar(hp, ref.args(gt, ct, 0.7f, step));
              adamw_step_simd(hp, simd.args(gt, ct, 0.7f, step));
            }
            expect_same(ref, simd);
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  }
}

TEST(AdamWPool, MatchesScalarBitwise) {
  std::mt19937 rng = make_rng();
  const AdamWParams hp = test_params();
  for (int threads : {1, 2, 3}) {
    AdamW opt(threads);
    EXPECT_EQ(opt.threads(), threads);
    // Below one tile (on the caller), exactly one, one and a bit, several with a tail.
    for (size_t n : std::vector<size_t>{0, 5, 16384, 16385, 200003}) {
      for (GradType gt : kGradTypes) {
        for (CopyType ct : kCopyTypes) {
          SCOPED_TRACE("threads=" + std::to_string(threads) + " n=" + std::to_string(n) +
                       " grad=" + std::to_string(int(gt)) + " copy=" + std::to_string(int(ct)));
          Tensor ref(n, 1);
          ref.randomize_state(rng);
          Tensor pool = ref;
          for (int64_t step : {1, 2}) {
            ref.randomize_grad(rng);
            pool.g32 = ref.g32;
            pool.g16 = ref.g16;
            adamw_step_scalar(hp, ref.args(gt, ct, 0.7f, step));
            opt.step(hp, pool.args(gt, ct, 0.7f, step));
          }
          expect_same(ref, pool);
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// Out of place (STV's double buffer): the outputs are bitwise the in-place step's, the
// inputs are untouched, nothing past n is written; on every target, in the pool and in
// the scalar reference.
TEST(AdamW, OutOfPlaceMatchesInPlaceAndLeavesTheInputs) {
  std::mt19937 rng = make_rng();
  const AdamWParams hp = test_params();
  AdamW pool(2);
  const std::vector<std::string> targets = adamw_simd_targets();
  for (size_t n : std::vector<size_t>{1, 7, 1000, 40003}) {
    for (GradType gt : kGradTypes) {
      Tensor ref(n, 1);
      ref.randomize_state(rng);
      ref.randomize_grad(rng);
      const Tensor before = ref;
      adamw_step_scalar(hp, ref.args(gt, CopyType::kBf16, 0.7f, 3));
      // Paths: scalar, pool, then each SIMD target.
      for (size_t path = 0; path < targets.size() + 2; ++path) {
        SCOPED_TRACE("n=" + std::to_string(n) + " grad=" + std::to_string(int(gt)) +
                     " path=" + std::to_string(path));
        Tensor src = before;
        Tensor dst(n, 1);  // poisoned
        dst.g32 = src.g32;
        dst.g16 = src.g16;
        AdamWArgs a = src.args(gt, CopyType::kBf16, 0.7f, 3);
        a.copy_out = dst.out.data() + 1;
        a.p_out = dst.P();
        a.m_out = dst.M();
        a.v_out = dst.V();
        if (path == 0) {
          adamw_step_scalar(hp, a);
        } else if (path == 1) {
          pool.step(hp, a);
        } else {
          ForceTarget force(targets[path - 2]);
          adamw_step_simd(hp, a);
        }
        expect_same(dst, ref);
        src.out = before.out;  // the copy went to dst
        expect_same(src, before);
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

// --- (b) scalar vs float64 PyTorch AdamW ---------------------------------------------
//
// The reference runs torch.optim.AdamW's equations in double on the same float inputs:
//   p = p (1 - lr wd);  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps),   g = grad * grad_scale.
// The bound is a running error analysis of the float evaluation (Note [AdamW operation
// order]), to first order in the unit roundoff u = 2^-24: every float operation adds u
// times its result, every float constant (rounded from double) carries a relative error
// uc = u + 2^-50, and errors in inputs propagate through each operation's derivative:
//   eg = u |g|
//   em = b1 em + b1 |m| (uc + u) + (1 - b1) (|g| (uc + u) + eg) + u |m'|
//   ev = b2 ev + b2 v (uc + u) + (1 - b2) (2 |g| eg + g^2 (2u + uc)) + u v'
//   es = min(ev / (2 sqrt v'), sqrt ev) + u sqrt v'                    (s = sqrt v')
//   eD = r es + s r (uc + u) + eps uc + u D                            (D = s r + eps)
//   eq = em / D + |q| eD / D + u |q|                                   (q = m' / D)
//   ep = d ep + |p| d (uc + u) + k (eq + |q| (uc + u)) + u |p'|        (d decay, k step)
// with r = 1 / sqrt(bc2) and primes for the new values. m and v do not depend on p, so
// nothing feeds back and the first-order terms are the whole story up to O(u^2); the
// test allows twice the bound (kBoundFactor) plus 2^-45 relative for the double
// reference's own rounding. In closed form, roughly: per step about 3u |p| (the decay
// constant, its product, the subtraction; the constant's rounding is systematic, so it
// adds up linearly) plus up to ~70u lr for the update (|m^| / sqrt(v^) <= (1 - b1) /
// sqrt((1 - b2)(1 - b1^2 / b2)) ~ 7.3 bounds both q and em / D), so after T = 100 steps
// |p - p_ref| <~ T (3 |p| + 70 lr) u. Observed (printed): 100-400 u max(|p|, lr), about
// a third of the running bound. (An ulp count of p misleads where p crosses zero.)
constexpr double kUnit = 0x1p-24;
constexpr double kUnitConst = kUnit + 0x1p-50;
constexpr double kBoundFactor = 2.0;

TEST(AdamWScalar, MatchesFloat64ReferenceWithinBound) {
  std::mt19937 rng = make_rng();
  AdamWParams hp;
  hp.lr = 1e-3;
  hp.weight_decay = 0.01;
  const size_t n = 4096;
  const float grad_scale = 0.7f;
  Tensor t(n, 0);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (size_t i = 0; i < n; ++i) {
    t.P()[i] = static_cast<float>(u(rng));
    t.M()[i] = 0.0f;
    t.V()[i] = 0.0f;
  }
  std::vector<double> p(n), m(n, 0.0), v(n, 0.0), ep(n, 0.0), em(n, 0.0), ev(n, 0.0);
  for (size_t i = 0; i < n; ++i) p[i] = t.P()[i];
  const double b1 = hp.beta1, b2 = hp.beta2, uc = kUnitConst;
  double worst_ratio = 0.0, worst_scaled = 0.0, worst_bound_scaled = 0.0;
  for (int64_t step = 1; step <= 100; ++step) {
    t.randomize_grad(rng);
    adamw_step_scalar(hp, t.args(GradType::kFp32, CopyType::kNone, grad_scale, step));
    const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
    const double d = 1.0 - hp.lr * hp.weight_decay, k = hp.lr / bc1, r = 1.0 / std::sqrt(bc2);
    for (size_t i = 0; i < n; ++i) {
      const double g = static_cast<double>(t.g32[i]) * static_cast<double>(grad_scale);
      const double m1 = b1 * m[i] + (1.0 - b1) * g;
      const double v1 = b2 * v[i] + (1.0 - b2) * g * g;
      const double s = std::sqrt(v1);
      const double denom = s / std::sqrt(bc2) + hp.eps;
      const double q = m1 / denom;
      const double p1 = p[i] * d - k * q;
      // The bound, as derived above.
      const double eg = kUnit * std::abs(g);
      em[i] = b1 * em[i] + b1 * std::abs(m[i]) * (uc + kUnit) +
              (1.0 - b1) * (std::abs(g) * (uc + kUnit) + eg) + kUnit * std::abs(m1);
      ev[i] = b2 * ev[i] + b2 * v[i] * (uc + kUnit) +
              (1.0 - b2) * (2.0 * std::abs(g) * eg + g * g * (2.0 * kUnit + uc)) + kUnit * v1;
      const double es =
          (s > 0.0 ? std::min(ev[i] / (2.0 * s), std::sqrt(ev[i])) : std::sqrt(ev[i])) + kUnit * s;
      const double ed = r * es + s * r * (uc + kUnit) + hp.eps * uc + kUnit * denom;
      const double eq = em[i] / denom + std::abs(q) * ed / denom + kUnit * std::abs(q);
      ep[i] = d * ep[i] + std::abs(p[i]) * d * (uc + kUnit) +
              k * (eq + std::abs(q) * (uc + kUnit)) + kUnit * std::abs(p1);
      p[i] = p1;
      m[i] = m1;
      v[i] = v1;

      const double slack = 0x1p-45;
      const double err_p = std::abs(static_cast<double>(t.P()[i]) - p1);
      const double err_m = std::abs(static_cast<double>(t.M()[i]) - m1);
      const double err_v = std::abs(static_cast<double>(t.V()[i]) - v1);
      const double bound_p = kBoundFactor * ep[i] + slack * std::abs(p1);
      ASSERT_LE(err_p, bound_p) << "p[" << i << "] step " << step;
      ASSERT_LE(err_m, kBoundFactor * em[i] + slack * std::abs(m1))
          << "m[" << i << "] step " << step;
      ASSERT_LE(err_v, kBoundFactor * ev[i] + slack * v1) << "v[" << i << "] step " << step;
      worst_ratio = std::max(worst_ratio, err_p / bound_p);
      const double scale = kUnit * std::max(std::abs(p1), hp.lr);
      worst_scaled = std::max(worst_scaled, err_p / scale);
      worst_bound_scaled = std::max(worst_bound_scaled, bound_p / scale);
    }
  }
  std::cout << "[ info ] 100 steps: worst |p - p_ref| is " << worst_scaled
            << " u max(|p|, lr) (bound: " << worst_bound_scaled << "), worst error / bound "
            << worst_ratio << "\n";
}

// --- (c) conversions -----------------------------------------------------------------

TEST(Bf16, EveryPatternRoundTrips) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    const float f = bf16_to_float(b);
    ASSERT_EQ(bits_of(f), h << 16);
    const uint16_t back = float_to_bf16(f);
    if (bf16_is_nan(b)) {
      ASSERT_TRUE(bf16_is_nan(back)) << std::hex << h;
      ASSERT_EQ(back & 0x8000, b & 0x8000);
    } else {
      ASSERT_EQ(back, b) << std::hex << h;
    }
  }
}

TEST(Bf16, RoundsToNearestEven) {
  // Every pair of neighbours (b, b + 1) with b finite, both signs: the midpoint goes to
  // the even one, one float ulp either side to the nearer. b = 0x7F7F rounds up to inf.
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    if ((h & 0x7F80) == 0x7F80) continue;  // inf, NaN
    const uint32_t mid = (h << 16) | 0x8000;
    const uint16_t lo = static_cast<uint16_t>(h), hi = static_cast<uint16_t>(h + 1);
    ASSERT_EQ(float_to_bf16(std::bit_cast<float>(mid)), (h & 1) ? hi : lo) << std::hex << h;
    ASSERT_EQ(float_to_bf16(std::bit_cast<float>(mid - 1)), lo) << std::hex << h;
    ASSERT_EQ(float_to_bf16(std::bit_cast<float>(mid + 1)), hi) << std::hex << h;
  }
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // overflow: inf
  // A NaN whose payload sits in the low half must not round to inf.
  EXPECT_TRUE(bf16_is_nan(float_to_bf16(std::bit_cast<float>(0x7F800001u))));
  EXPECT_TRUE(bf16_is_nan(float_to_bf16(std::bit_cast<float>(0xFF80FFFFu))));
}

// The value of an fp16 pattern, from its definition.
double fp16_value(uint32_t h) {
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -24);
  if (exp == 31)
    return mant ? std::numeric_limits<double>::quiet_NaN()
                : sign * std::numeric_limits<double>::infinity();
  return sign * std::ldexp(1024.0 + mant, static_cast<int>(exp) - 25);
}

TEST(Fp16, EveryPatternRoundTrips) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const uint16_t x = static_cast<uint16_t>(h);
    const float f = fp16_to_float(x);
    const double want = fp16_value(h);
    const uint16_t back = float_to_fp16(f);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(fp16_is_nan(back)) << std::hex << h;
      ASSERT_EQ(back & 0x8000, x & 0x8000);
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0);
      ASSERT_EQ(back, x) << std::hex << h;
    }
  }
}

TEST(Fp16, RoundsToNearestEvenWithSubnormalsAndOverflow) {
  // Every pair of neighbours, subnormals included, both signs; the midpoint of 65504 and
  // the next step (65536) is 65520, which goes to inf (0x7C00 is the even one).
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    if ((h & 0x7FFF) > 0x7BFF) continue;  // inf, NaN
    const double a = fp16_value(h);
    if (h == 0x8000) continue;  // -0: its tie with -2^-24 is checked below
    const double b = (h & 0x7FFF) == 0x7BFF ? std::copysign(65536.0, a) : fp16_value(h + 1);
    const float mid = static_cast<float>((a + b) / 2);  // exact: 12 significant bits
    ASSERT_EQ(static_cast<double>(mid), (a + b) / 2);
    const uint16_t lo = static_cast<uint16_t>(h), hi = static_cast<uint16_t>(h + 1);
    const float toward_lo = std::nextafter(mid, static_cast<float>(a));
    const float toward_hi = std::nextafter(mid, static_cast<float>(b));
    ASSERT_EQ(float_to_fp16(mid), (h & 1) ? hi : lo) << std::hex << h;
    ASSERT_EQ(float_to_fp16(toward_lo), lo) << std::hex << h;
    ASSERT_EQ(float_to_fp16(toward_hi), hi) << std::hex << h;
  }
  EXPECT_EQ(float_to_fp16(-0x1p-25f), 0x8000);  // tie between -0 and -2^-24: even (-0)
  EXPECT_EQ(float_to_fp16(std::nextafter(-0x1p-25f, -1.0f)), 0x8001);
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7C00);
  EXPECT_EQ(float_to_fp16(-65520.0f), 0xFC00);
  EXPECT_EQ(float_to_fp16(65519.996f), 0x7BFF);
  EXPECT_EQ(float_to_fp16(1e10f), 0x7C00);
  EXPECT_EQ(float_to_fp16(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(float_to_fp16(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(float_to_fp16(std::numeric_limits<float>::min()), 0x0000);
  EXPECT_EQ(float_to_fp16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(float_to_fp16(-std::numeric_limits<float>::denorm_min()), 0x8000);
  EXPECT_TRUE(fp16_is_nan(float_to_fp16(std::bit_cast<float>(0x7F800001u))));  // low payload
  EXPECT_EQ(float_to_fp16(std::numeric_limits<float>::quiet_NaN()), 0x7E00);
}

// The SIMD copy-out rounds as the scalar conversions do, on every target: with lr = 0 and
// wd = 0 the step leaves p as it is (x * 1 - 0), so the copy is the conversion of p, for
// float patterns around every bf16 and fp16 rounding boundary.
TEST(AdamWSimd, CopyOutRoundsLikeTheConversionsOnEveryTarget) {
  std::mt19937 rng = make_rng();
  std::vector<float> patterns;
  const uint32_t lows[] = {0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF,
                           0x2000, 0x7FFF, 0x8000, 0x8001, 0xFFFF};
  for (uint32_t hi = 0; hi <= 0xFFFF; ++hi) {
    for (uint32_t lo : lows) patterns.push_back(std::bit_cast<float>((hi << 16) | lo));
    patterns.push_back(std::bit_cast<float>((hi << 16) | (static_cast<uint32_t>(rng()) & 0xFFFF)));
  }
  AdamWParams hp;
  hp.lr = 0.0;
  hp.weight_decay = 0.0;
  const size_t n = patterns.size();
  for (const std::string& target : adamw_simd_targets()) {
    ForceTarget force(target);
    for (CopyType ct : {CopyType::kBf16, CopyType::kFp16}) {
      Tensor t(n, 1);
      std::copy(patterns.begin(), patterns.end(), t.P());
      std::fill(t.M(), t.M() + n, 0.0f);
      std::fill(t.V(), t.V() + n, 0.0f);
      std::fill(t.g32.begin() + 1, t.g32.begin() + 1 + static_cast<std::ptrdiff_t>(n), 0.0f);
      adamw_step_simd(hp, t.args(GradType::kFp32, ct, 1.0f, 1));
      size_t bad = 0;
      for (size_t i = 0; i < n && bad < 5; ++i) {
        const float p = t.P()[i];
        const bool same =
            std::isnan(patterns[i]) ? std::isnan(p) : bits_of(p) == bits_of(patterns[i]);
        const uint16_t want = ct == CopyType::kBf16 ? float_to_bf16(p) : float_to_fp16(p);
        if (!same || t.out[1 + i] != want) {
          ADD_FAILURE() << target << " copy " << int(ct) << ": p " << std::hex
                        << bits_of(patterns[i]) << " -> " << bits_of(p) << ", copy " << t.out[1 + i]
                        << ", want " << want;
          ++bad;
        }
      }
    }
  }
}

// --- (d) NaN/Inf gradients -----------------------------------------------------------

TEST(AdamW, NonFiniteGradientsGiveNaNWeights) {
  std::mt19937 rng = make_rng();
  const AdamWParams hp = test_params();
  const size_t n = 3 * 16384 + 77;
  const float inf = std::numeric_limits<float>::infinity();
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(), inf, -inf};
  std::uniform_int_distribution<size_t> pick(0, n - 1);
  AdamW opt(2);
  for (GradType gt : kGradTypes) {
    for (CopyType ct : kCopyTypes) {
      Tensor ref(n, 1);
      ref.randomize_state(rng);
      ref.randomize_grad(rng);
      std::vector<size_t> bad_at = {0, n - 1};
      for (int k = 0; k < 50; ++k) bad_at.push_back(pick(rng));
      for (size_t k = 0; k < bad_at.size(); ++k) {
        const float b = bad_values[k % 3];
        ref.g32[1 + bad_at[k]] = b;
        ref.g16[1 + bad_at[k]] = float_to_bf16(b);
      }
      Tensor simd = ref, pool = ref;
      adamw_step_scalar(hp, ref.args(gt, ct, 0.7f, 3));
      adamw_step_simd(hp, simd.args(gt, ct, 0.7f, 3));
      opt.step(hp, pool.args(gt, ct, 0.7f, 3));
      for (size_t i : bad_at) {
        ASSERT_TRUE(std::isnan(ref.P()[i])) << i;
        if (ct == CopyType::kBf16) {
          ASSERT_TRUE(bf16_is_nan(ref.out[1 + i]));
        }
        if (ct == CopyType::kFp16) {
          ASSERT_TRUE(fp16_is_nan(ref.out[1 + i]));
        }
      }
      expect_same(ref, simd, /*nan_ok=*/true);
      expect_same(ref, pool, /*nan_ok=*/true);
      size_t nans = 0;
      for (size_t i = 0; i < n; ++i) nans += std::isnan(ref.P()[i]) ? 1 : 0;
      std::sort(bad_at.begin(), bad_at.end());
      EXPECT_EQ(nans,
                static_cast<size_t>(std::unique(bad_at.begin(), bad_at.end()) - bad_at.begin()));
    }
  }
}

// --- (e) outputs fully written, nothing past n ----------------------------------------

TEST(AdamW, PoisonedCopyIsFullyWrittenAndGuardsUntouched) {
  std::mt19937 rng = make_rng();
  const AdamWParams hp = test_params();
  AdamW opt(2);
  for (size_t n : {1, 15, 17, 16384 * 2 + 9}) {
    for (CopyType ct : {CopyType::kBf16, CopyType::kFp16}) {
      for (int path = 0; path < 3; ++path) {
        Tensor t(n, 1);  // copy_out starts as 0xFFFF, guards as kPoison
        t.randomize_state(rng);
        t.randomize_grad(rng);
        const AdamWArgs a = t.args(GradType::kBf16, ct, 0.7f, 2);
        if (path == 0) adamw_step_scalar(hp, a);
        if (path == 1) adamw_step_simd(hp, a);
        if (path == 2) opt.step(hp, a);
        for (size_t i = 0; i < n; ++i) {
          const float p = t.P()[i];
          ASSERT_TRUE(std::isfinite(p)) << "path " << path << " p[" << i << "]";
          const uint16_t want = ct == CopyType::kBf16 ? float_to_bf16(p) : float_to_fp16(p);
          ASSERT_EQ(t.out[1 + i], want) << "path " << path << " out[" << i << "]";
        }
        for (size_t i : {size_t{0}, n + 1, n + Tensor::kGuard}) {
          ASSERT_EQ(bits_of(t.p[i]), Tensor::kPoison) << "path " << path << " guard " << i;
          ASSERT_EQ(bits_of(t.m[i]), Tensor::kPoison) << "path " << path << " guard " << i;
          ASSERT_EQ(bits_of(t.v[i]), Tensor::kPoison) << "path " << path << " guard " << i;
          ASSERT_EQ(t.out[i], 0xFFFF) << "path " << path << " guard " << i;
        }
      }
    }
  }
}

TEST(AdamW, RejectsBadArguments) {
  Tensor t(8, 0);
  AdamWParams hp;
  AdamWArgs a = t.args(GradType::kFp32, CopyType::kNone, 1.0f, 0);
  testing::expect_error([&] { adamw_step_scalar(hp, a); }, {"step is 0"});
  testing::expect_error([&] { adamw_step_simd(hp, a); }, {"step is 0"});
  a.step = 1;
  a.copy_type = CopyType::kBf16;
  testing::expect_error([&] { adamw_step_simd(hp, a); }, {"copy_out"});
  a.copy_type = CopyType::kNone;
  a.m = nullptr;
  AdamW opt(1);
  testing::expect_error([&] { opt.step(hp, a); }, {"non-null"});
  hp.beta2 = 1.0;
  testing::expect_error(
      [&] { adamw_step_scalar(hp, t.args(GradType::kFp32, CopyType::kNone, 1.0f, 1)); },
      {"beta2 is 1"});
}

}  // namespace
}  // namespace spillway::optim

namespace spillway::optim {
namespace {

// Bad arguments of the C++ API are InputErrors naming the field and the value, thrown on
// the caller's thread by every path (the pool's workers never see them).
void expect_input_error(const std::function<void()>& f, const std::string& field,
                        const std::string& value) {
  try {
    f();
    ADD_FAILURE() << field << " = " << value << " accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), field) << e.what();
    if (!value.empty()) {
      EXPECT_EQ(e.value(), value) << e.what();
    }
  }
}

TEST(AdamW, ANonFiniteOrNegativeGradScaleIsAnInputError) {
  const AdamWParams hp = test_params();
  AdamW pool(2);
  const size_t n = 3 * 16384 + 5;  // over one tile: the pool splits it
  for (float scale :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -0.5f}) {
    SCOPED_TRACE(scale);
    std::mt19937 rng = make_rng();
    Tensor t(n, 1);
    t.randomize_state(rng);
    t.randomize_grad(rng);
    const Tensor before = t;
    const AdamWArgs a = t.args(GradType::kFp32, CopyType::kNone, scale, 1);
    const std::string value = fmt::format("{}", scale);
    expect_input_error([&] { adamw_step_scalar(hp, a); }, "grad_scale", value);
    expect_input_error([&] { adamw_step_simd(hp, a); }, "grad_scale", value);
    expect_input_error([&] { pool.step(hp, a); }, "grad_scale", value);
    std::vector<double> lanes(kNormLanes);
    expect_input_error([&] { pool.step_and_norm_lanes(hp, a, lanes.data()); }, "grad_scale", value);
    expect_same(t, before);  // nothing written
  }
  // 0 (every gradient clipped away) and 1 are fine.
  Tensor t(16, 0);
  EXPECT_NO_THROW(adamw_step_simd(hp, t.args(GradType::kFp32, CopyType::kNone, 0.0f, 1)));
  EXPECT_NO_THROW(adamw_step_simd(hp, t.args(GradType::kFp32, CopyType::kNone, 1.0f, 1)));
}

TEST(AdamW, OutputsOverlappingAnInputPartiallyAreAnInputError) {
  const AdamWParams hp = test_params();
  AdamW pool(2);
  const size_t n = 64;
  std::mt19937 rng = make_rng();
  Tensor src(n, 1);
  src.randomize_state(rng);
  src.randomize_grad(rng);
  Tensor dst(n, 1);
  auto out_of_place = [&] {
    AdamWArgs a = src.args(GradType::kFp32, CopyType::kBf16, 1.0f, 1);
    a.copy_out = dst.out.data() + 1;
    a.p_out = dst.P();
    a.m_out = dst.M();
    a.v_out = dst.V();
    return a;
  };
  // Disjoint, and exactly in place (p_out == p), are fine.
  EXPECT_NO_THROW(adamw_step_scalar(hp, out_of_place()));
  AdamWArgs same = out_of_place();
  same.p_out = same.p;
  same.m_out = same.m;
  same.v_out = same.v;
  EXPECT_NO_THROW(adamw_step_scalar(hp, same));
  // One element off: the step would read elements it has already written.
  AdamWArgs a = out_of_place();
  a.p_out = src.P() + 1;
  const std::string p_out = fmt::format("{}", static_cast<const void*>(a.p_out));
  expect_input_error([&] { adamw_step_scalar(hp, a); }, "p_out", p_out);
  expect_input_error([&] { adamw_step_simd(hp, a); }, "p_out", p_out);
  expect_input_error([&] { pool.step(hp, a); }, "p_out", p_out);
  testing::expect_error([&] { pool.step(hp, a); }, {"overlaps p partially"});
  a = out_of_place();
  a.v_out = src.M() + n / 2;  // half over m
  expect_input_error([&] { pool.step(hp, a); }, "v_out", "");
  a = out_of_place();
  a.m_out = dst.P() + 3;  // two outputs over each other: the first named, then the other
  expect_input_error([&] { pool.step(hp, a); }, "p_out", "");
  testing::expect_error([&] { pool.step(hp, a); }, {"overlaps m_out partially"});
  a = out_of_place();
  a.copy_out = reinterpret_cast<unsigned char*>(src.g32.data() + 1) + 2;  // the copy over g
  expect_input_error([&] { pool.step(hp, a); }, "copy_out", "");
  // In place, the updated arrays are outputs too.
  a = src.args(GradType::kFp32, CopyType::kNone, 1.0f, 1);
  a.m = a.p + 1;
  expect_input_error([&] { adamw_step_scalar(hp, a); }, "p", "");
}

TEST(AdamW, MoreThreadsThanItCanStartIsAnInputError) {
  expect_input_error([] { AdamW opt(100000); }, "threads", "100000");
  testing::expect_error([] { AdamW opt(100000); }, {"threads is 100000", "4096"});
  AdamW opt(2);  // still fine
  EXPECT_EQ(opt.threads(), 2);
}

}  // namespace
}  // namespace spillway::optim

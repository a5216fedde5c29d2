// Tests of the one-pass CPU AdamW (include/spillway/optim/optim.hpp): Note [Streamed stores] and
// Note [Norm lanes in the step's pass] change how the step writes and what it sums on the
// way, never a bit of what it computes:
//   (a) out of place with streamed stores, every copy type (fp32 included), on every
//       Highway target: bitwise the scalar reference, at every alignment of the outputs
//       (those that share p_out's alignment stream; the others fall back), nothing written
//       outside [0, n), the inputs untouched;
//   (b) step_and_norm_lanes: the lanes bitwise the plain per-lane reference (lane_sums_by_rows of
//   spillway/device/device_math.hpp) and the state bitwise
//       the scalar step, on every Highway target, for 1-3 workers, shapes below a row,
//       whole rows and a ragged last row, fp32 and bf16 gradients, every copy type,
//       outputs aligned, off alignment or in place;
//   (c) norm_lane_sums (SIMD, by rows) and its pooled form against the same reference;
//   (d) write_weights: the fp32 copy (streamed) bitwise, the bf16 one float_to_bf16's, at
//       every alignment, nothing written outside [0, n).
// Inputs are random with a printed seed; SPILLWAY_TEST_SEED=<n> reruns one.
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "spillway/device/device_math.hpp"
#include "spillway/optim/optim.hpp"
#include "test_support.hpp"

namespace spillway::optim {
namespace {

using spillway::testing::make_rng;

constexpr uint32_t kPoison = 0x7FBADBAD;  // a signalling NaN nothing computes
constexpr size_t kGuard = 19;

AdamWParams test_params() {
  AdamWParams hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.1;
  return hp;
}

// An array of n elements at `offset` elements past a 64-byte boundary, kGuard poisoned
// elements before and after.
template <typename T>
struct Guarded {
  std::vector<T> buf;
  size_t offset = 0, n = 0;
  Guarded(size_t n_, size_t offset_, T poison) : offset(offset_), n(n_) {
    buf.assign(n + offset + 2 * kGuard + 64, poison);
  }
  T* data() {
    T* base = buf.data() + kGuard;
    const size_t past = reinterpret_cast<uintptr_t>(base) % 64;  // a multiple of sizeof(T)
    return base + (past == 0 ? 0 : (64 - past) / sizeof(T)) + offset;
  }
  // Everything outside [data(), data() + n) still `poison`, bit for bit.
  bool guards_intact(T poison) {
    using Bits = std::array<unsigned char, sizeof(T)>;
    const T* d = data();
    for (const T& x : buf) {
      const T* p = &x;
      if ((p < d || p >= d + n) && std::bit_cast<Bits>(x) != std::bit_cast<Bits>(poison))
        return false;
    }
    return true;
  }
};

struct State {
  std::vector<float> p, m, v, g32;
  std::vector<uint16_t> g16;
};

State random_state(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  State s;
  for (size_t i = 0; i < n; ++i) {
    s.p.push_back(nd(rng));
    const float mm = 0.1f * nd(rng);
    s.m.push_back(mm);
    s.v.push_back(mm * mm + 1e-3f * std::abs(nd(rng)));
    const float g = nd(rng) * 0.01f;
    s.g32.push_back(g);
    s.g16.push_back(float_to_bf16(g));
  }
  return s;
}

size_t copy_bytes(CopyType c) {
  return copy_type_bytes(c);
}

// One out-of-place step of `s` into po, mo, vo and its copy (of ct) into copy.
AdamWArgs out_of_place(State& s, GradType gt, float* po, float* mo, float* vo, CopyType ct,
                       void* copy, int64_t step) {
  AdamWArgs a;
  a.p = s.p.data();
  a.m = s.m.data();
  a.v = s.v.data();
  a.g = gt == GradType::kBf16 ? static_cast<const void*>(s.g16.data())
                              : static_cast<const void*>(s.g32.data());
  a.grad_type = gt;
  a.p_out = po;
  a.m_out = mo;
  a.v_out = vo;
  a.copy_type = ct;
  a.copy_out = ct == CopyType::kNone ? nullptr : copy;
  a.n = s.p.size();
  a.step = step;
  return a;
}

// The scalar reference's p, m, v and copy (as bytes) of one step of `s`, out of place.
struct Result {
  std::vector<float> p, m, v;
  std::vector<unsigned char> copy;
};

Result reference_step(const AdamWParams& hp, const State& s, GradType gt, CopyType ct,
                      int64_t step) {
  const size_t n = s.p.size();
  Result r{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n),
           std::vector<unsigned char>(n * copy_bytes(ct))};
  State in = s;  // the step reads it only
  adamw_step_scalar(
      hp, out_of_place(in, gt, r.p.data(), r.m.data(), r.v.data(), ct, r.copy.data(), step));
  return r;
}

bool same_bits(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

// An out-of-place step's inputs p, m, v (in) still those it was given (s), bit for bit.
bool untouched(const State& in, const State& s) {
  const size_t n = s.p.size();
  return same_bits(in.p.data(), s.p.data(), n) && same_bits(in.m.data(), s.m.data(), n) &&
         same_bits(in.v.data(), s.v.data(), n);
}

constexpr GradType kGradTypes[] = {GradType::kFp32, GradType::kBf16};
constexpr CopyType kCopyTypes[] = {CopyType::kNone, CopyType::kBf16, CopyType::kFp16,
                                   CopyType::kFp32};

// (a)
TEST(AdamWStreamed, OutOfPlaceStoresMatchTheScalarReferenceAtEveryAlignment) {
  std::mt19937 rng = make_rng();
  const AdamWParams hp = test_params();
  const float fpoison = std::bit_cast<float>(kPoison);
  for (const std::string& target : adamw_simd_targets()) {
    ASSERT_TRUE(adamw_simd_force_target(target.c_str())) << target;
    for (size_t n : std::vector<size_t>{1, 7, 64, 1000, 4099}) {
      const State s = random_state(n, rng);
      // p_out's offset from a 64-byte boundary, and m_out's (the same: streamed; another:
      // the fallback), in elements.
      for (size_t po_off : std::vector<size_t>{0, 1, 5, 15}) {
        for (size_t mo_off : std::vector<size_t>{po_off, (po_off + 3) % 16}) {
          for (GradType gt : kGradTypes) {
            for (CopyType ct : kCopyTypes) {
              SCOPED_TRACE(target + " n=" + std::to_string(n) + " p_out at +" +
                           std::to_string(po_off) + " m_out at +" + std::to_string(mo_off) +
                           " grad=" + std::to_string(int(gt)) + " copy=" + std::to_string(int(ct)));
              const Result want = reference_step(hp, s, gt, ct, 3);
              Guarded<float> po(n, po_off, fpoison), mo(n, mo_off, fpoison), vo(n, po_off, fpoison);
              Guarded<unsigned char> out(n * copy_bytes(ct), po_off * copy_bytes(ct), 0xEE);
              State in = s;
              AdamWArgs a =
                  out_of_place(in, gt, po.data(), mo.data(), vo.data(), ct, out.data(), 3);
              a.stream = true;
              adamw_step_simd(hp, a);
              EXPECT_TRUE(same_bits(po.data(), want.p.data(), n));
              EXPECT_TRUE(same_bits(mo.data(), want.m.data(), n));
              EXPECT_TRUE(same_bits(vo.data(), want.v.data(), n));
              if (ct != CopyType::kNone) {
                EXPECT_EQ(std::memcmp(out.data(), want.copy.data(), want.copy.size()), 0);
              }
              EXPECT_TRUE(po.guards_intact(fpoison) && mo.guards_intact(fpoison) &&
                          vo.guards_intact(fpoison) && out.guards_intact(0xEE));
              EXPECT_TRUE(untouched(in, s));
              if (::testing::Test::HasFailure()) {
                adamw_simd_force_target(nullptr);
                return;
              }
            }
          }
        }
      }
    }
  }
  adamw_simd_force_target(nullptr);
}

std::vector<double> reference_lanes(const State& s, GradType gt) {
  const size_t n = s.p.size();
  std::vector<double> lanes(std::min(n, kNormLanes));
  if (gt == GradType::kBf16) {
    lane_sums_by_rows(n, kNormLanes, lanes.data(),
                      [&](size_t i) { return bf16_to_float(s.g16[i]); });
  } else {
    lane_sums_by_rows(n, kNormLanes, lanes.data(), [&](size_t i) { return s.g32[i]; });
  }
  return lanes;
}

// (b)
TEST(AdamWPass, StepAndNormLanesIsTheStepAndThePlainLaneSums) {
  std::mt19937 rng = make_rng();
  const AdamWParams hp = test_params();
  const float fpoison = std::bit_cast<float>(kPoison);
  // Below a row, a row and a bit, below the pooled threshold, more rows than one pass
  // takes (kRowsPerPass = 4) with a ragged last one. Sized for qemu too (tests/arm runs
  // this file once per emulated CPU).
  const std::vector<size_t> sizes{5, kNormLanes + 3, 3 * kNormLanes + 5, 5 * kNormLanes + 77};
  // The outputs at a 64-byte boundary (streamed), off it (the fallback), or in place: all
  // three with two workers, aligned with one and three.
  enum class Out { kAligned, kOff, kInPlace };
  std::vector<std::unique_ptr<AdamW>> pools;
  for (int threads : {1, 2, 3}) pools.push_back(std::make_unique<AdamW>(threads));
  for (size_t n : sizes) {
    const State s = random_state(n, rng);
    for (GradType gt : kGradTypes) {
      const std::vector<double> want_lanes = reference_lanes(s, gt);
      for (CopyType ct : kCopyTypes) {
        const Result want = reference_step(hp, s, gt, ct, 2);  // the scalar step, once
        for (const std::string& target : adamw_simd_targets()) {
          ASSERT_TRUE(adamw_simd_force_target(target.c_str())) << target;
          for (const std::unique_ptr<AdamW>& pool_ptr : pools) {
            AdamW& pool = *pool_ptr;
            for (Out out : {Out::kAligned, Out::kOff, Out::kInPlace}) {
              if (pool.threads() != 2 && out != Out::kAligned) continue;
              SCOPED_TRACE(target + " threads=" + std::to_string(pool.threads()) +
                           " n=" + std::to_string(n) + " grad=" + std::to_string(int(gt)) +
                           " copy=" + std::to_string(int(ct)) + " out=" + std::to_string(int(out)));
              State in = s;
              const size_t off = out == Out::kOff ? 5 : 0;
              Guarded<float> po(n, off, fpoison), mo(n, off, fpoison), vo(n, off, fpoison);
              Guarded<unsigned char> copy(n * copy_bytes(ct), off * copy_bytes(ct), 0xEE);
              std::vector<double> lanes(std::min(n, kNormLanes), -1.0);
              AdamWArgs a =
                  out_of_place(in, gt, po.data(), mo.data(), vo.data(), ct, copy.data(), 2);
              a.stream = out != Out::kInPlace;
              if (out == Out::kInPlace) a.p_out = a.m_out = a.v_out = nullptr;
              pool.step_and_norm_lanes(hp, a, lanes.data());
              EXPECT_EQ(std::memcmp(lanes.data(), want_lanes.data(), lanes.size() * sizeof(double)),
                        0);
              const float* p = out == Out::kInPlace ? in.p.data() : po.data();
              const float* m = out == Out::kInPlace ? in.m.data() : mo.data();
              const float* v = out == Out::kInPlace ? in.v.data() : vo.data();
              EXPECT_TRUE(same_bits(p, want.p.data(), n));
              EXPECT_TRUE(same_bits(m, want.m.data(), n));
              EXPECT_TRUE(same_bits(v, want.v.data(), n));
              if (ct != CopyType::kNone) {
                EXPECT_EQ(std::memcmp(copy.data(), want.copy.data(), want.copy.size()), 0);
              }
              EXPECT_TRUE(copy.guards_intact(0xEE));
              if (out != Out::kInPlace) {
                EXPECT_TRUE(po.guards_intact(fpoison) && mo.guards_intact(fpoison) &&
                            vo.guards_intact(fpoison));
                EXPECT_TRUE(untouched(in, s));
              }
              if (::testing::Test::HasFailure()) {
                adamw_simd_force_target(nullptr);
                return;
              }
            }
          }
        }
        adamw_simd_force_target(nullptr);
      }
    }
  }
}

// (c)
TEST(NormLanes, TheSimdRowsAndThePoolGiveThePlainLaneSums) {
  std::mt19937 rng = make_rng();
  AdamW pool(3);
  for (size_t n :
       std::vector<size_t>{1, 3, 1000, kNormLanes, 5 * kNormLanes + 9, 13 * kNormLanes}) {
    const State s = random_state(n, rng);
    for (GradType gt : kGradTypes) {
      SCOPED_TRACE("n=" + std::to_string(n) + " grad=" + std::to_string(int(gt)));
      const std::vector<double> want = reference_lanes(s, gt);
      std::vector<double> one(want.size(), -1.0), many(want.size(), -1.0);
      if (gt == GradType::kBf16) {
        norm_lane_sums_bf16(s.g16.data(), n, one.data());
        norm_lane_sums_bf16(&pool, s.g16.data(), n, many.data());
      } else {
        norm_lane_sums(s.g32.data(), n, one.data());
        norm_lane_sums(&pool, s.g32.data(), n, many.data());
      }
      EXPECT_EQ(std::memcmp(one.data(), want.data(), want.size() * sizeof(double)), 0);
      EXPECT_EQ(std::memcmp(many.data(), want.data(), want.size() * sizeof(double)), 0);
    }
  }
}

// (d)
TEST(WriteWeights, Fp32CopiesAndBf16RoundsAtEveryAlignment) {
  std::mt19937 rng = make_rng();
  const float fpoison = std::bit_cast<float>(kPoison);
  for (size_t n : std::vector<size_t>{1, 7, 64, 4099}) {
    const State s = random_state(n, rng);
    for (size_t off : std::vector<size_t>{0, 1, 6, 15}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " at +" + std::to_string(off));
      Guarded<float> f32(n, off, fpoison);
      write_weights(s.p.data(), f32.data(), ParamDtype::kFp32, n);
      EXPECT_TRUE(same_bits(f32.data(), s.p.data(), n));
      EXPECT_TRUE(f32.guards_intact(fpoison));
      Guarded<uint16_t> b16(n, off, 0xEEEE);
      write_weights(s.p.data(), b16.data(), ParamDtype::kBf16, n);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(b16.data()[i], float_to_bf16(s.p[i])) << i;
      EXPECT_TRUE(b16.guards_intact(0xEEEE));
    }
  }
}

}  // namespace
}  // namespace spillway::optim

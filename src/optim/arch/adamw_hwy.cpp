// The SIMD AdamW step: Highway, compiled once per target (foreach_target.h re-includes
// this file) and dispatched at run time to the best target the CPU supports.
//
// Invariants: the arithmetic is Note [AdamW operation order] (spillway/device/device_math.hpp)
// lane by lane, so the result equals adamw_step_scalar (adamw_element) bit for bit on every
// target; the tail (fewer elements than one vector) goes through the same vector code on
// zero-padded stack copies, so there is no second scalar formula here; the bf16/fp16/fp32 copy
// of p is written in the same pass with the rounding of float_to_bf16 / float_to_fp16.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "optim/arch/adamw_hwy.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <cstdint>
#include <cstring>

#include "spillway/optim/optim.hpp"

HWY_BEFORE_NAMESPACE();
namespace spillway::optim::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// fp16 conversion in hardware: x86 F16C (AVX2 and up) rounds to nearest even, keeps
// subnormals and quiets NaNs exactly as float_to_fp16 does. Elsewhere (Highway 1.0.3's
// emulated DemoteTo truncates) the integer formula of float_to_fp16 is used.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
#define SPILLWAY_ADAMW_F16C 1
#else
#define SPILLWAY_ADAMW_F16C 0
#endif

// Stores v at p: a non-temporal store (Note [Streamed stores]) when kStream, p then aligned
// to the vector.
template <bool kStream, class D, typename T>
HWY_INLINE void store(D d, hn::Vec<D> v, T* HWY_RESTRICT p) {
  if constexpr (kStream) {
    hn::Stream(v, d, p);
  } else {
    hn::StoreU(v, d, p);
  }
}

template <class DF>
HWY_INLINE void store_bf16(DF df, hn::Vec<DF> p, uint16_t* HWY_RESTRICT out) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> du16;
  (void)df;
  const auto bits = hn::BitCast(du, p);
  const auto hi = hn::ShiftRight<16>(bits);
  const auto rounded = hn::ShiftRight<16>(
      hn::Add(hn::Add(bits, hn::Set(du, 0x7FFFu)), hn::And(hi, hn::Set(du, 1u))));
  const auto quiet_nan = hn::Or(hi, hn::Set(du, 0x0040u));
  const auto is_nan = hn::Gt(hn::BitCast(di, hn::And(bits, hn::Set(du, 0x7FFFFFFFu))),
                             hn::Set(di, int32_t{0x7F800000}));
  const auto r = hn::IfThenElse(hn::RebindMask(du, is_nan), quiet_nan, rounded);
  hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, r)), du16, out);
}

template <class DF>
HWY_INLINE void store_fp16(DF df, hn::Vec<DF> p, uint16_t* HWY_RESTRICT out) {
  const hn::Rebind<uint16_t, DF> du16;
#if SPILLWAY_ADAMW_F16C
  const hn::Rebind<hwy::float16_t, DF> df16;
  hn::StoreU(hn::BitCast(du16, hn::DemoteTo(df16, p)), du16, out);
#else
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(du, p);
  const auto sign = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 0x8000u));
  const auto a = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  const auto ai = hn::BitCast(di, a);  // a < 2^31: signed compares are exact
  const auto r = hn::Sub(a, hn::Set(du, 0x38000000u));
  const auto normal = hn::ShiftRight<13>(
      hn::Add(hn::Add(r, hn::Set(du, 0xFFFu)), hn::And(hn::ShiftRight<13>(r), hn::Set(du, 1u))));
  const auto subnormal = hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, a), hn::Set(df, 0.5f))),
                                 hn::Set(du, 0x3F000000u));
  const auto quiet_nan =
      hn::Or(hn::Set(du, 0x7E00u), hn::And(hn::ShiftRight<13>(a), hn::Set(du, 0x3FFu)));
  auto h = hn::IfThenElse(hn::RebindMask(du, hn::Lt(ai, hn::Set(di, int32_t{0x38800000}))),
                          subnormal, normal);
  h = hn::IfThenElse(hn::RebindMask(du, hn::Gt(ai, hn::Set(di, int32_t{0x477FEFFF}))),
                     hn::Set(du, 0x7C00u), h);
  h = hn::IfThenElse(hn::RebindMask(du, hn::Gt(ai, hn::Set(di, int32_t{0x7F800000}))), quiet_nan,
                     h);
  h = hn::Or(h, sign);
  hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, h)), du16, out);
#endif
}

// One vector of elements at p, m, v, g, out (each already offset to the same element); the
// updated p, m, v go to po, mo, vo (the same pointers in place: no restrict on them), and
// its copy to out (of kCopy). kStream: po, mo, vo are aligned and stored non-temporally;
// kStreamCopy: the fp32 copy too.
template <GradType kGrad, CopyType kCopy, bool kStream, bool kStreamCopy, class DF>
HWY_INLINE void step_vector(DF df, const AdamWStepScalars& s, float grad_scale, const float* p,
                            const float* m, const float* v, const void* HWY_RESTRICT g, float* po,
                            float* mo, float* vo, void* HWY_RESTRICT out) {
  hn::Vec<DF> gv;
  if constexpr (kGrad == GradType::kBf16) {
    const hn::RebindToUnsigned<DF> du;
    const hn::Rebind<uint16_t, DF> du16;
    const auto g16 = hn::LoadU(du16, static_cast<const uint16_t*>(g));
    gv = hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, g16)));
  } else {
    gv = hn::LoadU(df, static_cast<const float*>(g));
  }
  // Note [AdamW operation order]: no MulAdd, each operation rounds on its own. Named
  // operations, not operators: SVE's vectors are sizeless types, which take none.
  gv = hn::Mul(gv, hn::Set(df, grad_scale));
  auto pv = hn::Mul(hn::LoadU(df, p), hn::Set(df, s.decay));
  const auto mv = hn::Add(hn::Mul(hn::Set(df, s.beta1), hn::LoadU(df, m)),
                          hn::Mul(hn::Set(df, s.one_minus_beta1), gv));
  const auto vv = hn::Add(hn::Mul(hn::Set(df, s.beta2), hn::LoadU(df, v)),
                          hn::Mul(hn::Set(df, s.one_minus_beta2), hn::Mul(gv, gv)));
  const auto denom =
      hn::Add(hn::Mul(hn::Sqrt(vv), hn::Set(df, s.inv_sqrt_bc2)), hn::Set(df, s.eps));
  pv = hn::Sub(pv, hn::Mul(hn::Set(df, s.step_size), hn::Div(mv, denom)));
  store<kStream>(df, pv, po);
  store<kStream>(df, mv, mo);
  store<kStream>(df, vv, vo);
  if constexpr (kCopy == CopyType::kBf16) store_bf16(df, pv, static_cast<uint16_t*>(out));
  if constexpr (kCopy == CopyType::kFp16) store_fp16(df, pv, static_cast<uint16_t*>(out));
  if constexpr (kCopy == CopyType::kFp32) store<kStreamCopy>(df, pv, static_cast<float*>(out));
}

// The pointers of one call, each at element 0.
struct StepPointers {
  const float *p, *m, *v;
  const unsigned char* g;
  float *po, *mo, *vo;
  unsigned char* out;
};

template <GradType kGrad>
constexpr size_t kGradBytes = kGrad == GradType::kBf16 ? 2 : 4;
template <CopyType kCopy>
constexpr size_t kCopyBytes = kCopy == CopyType::kFp32   ? 4
                              : kCopy == CopyType::kNone ? 0
                                                         : 2;

// Elements [i, i + count), count < one vector: the same vector code on zero-padded copies
// (no second scalar formula).
template <GradType kGrad, CopyType kCopy, class DF>
void step_partial(DF df, const AdamWStepScalars& s, float grad_scale, const StepPointers& q,
                  size_t i, size_t count) {
  constexpr size_t kMaxLanes = HWY_MAX_BYTES / sizeof(float);
  constexpr size_t kG = kGradBytes<kGrad>;
  constexpr size_t kC = kCopyBytes<kCopy>;
  HWY_ALIGN float tp[kMaxLanes] = {};
  HWY_ALIGN float tm[kMaxLanes] = {};
  HWY_ALIGN float tv[kMaxLanes] = {};
  HWY_ALIGN unsigned char tg[HWY_MAX_BYTES] = {};    // fp32 or bf16 bits
  HWY_ALIGN unsigned char tout[HWY_MAX_BYTES] = {};  // the copy's bits
  std::memcpy(tp, q.p + i, count * sizeof(float));
  std::memcpy(tm, q.m + i, count * sizeof(float));
  std::memcpy(tv, q.v + i, count * sizeof(float));
  std::memcpy(tg, q.g + i * kG, count * kG);
  step_vector<kGrad, kCopy, false, false>(df, s, grad_scale, tp, tm, tv, tg, tp, tm, tv, tout);
  std::memcpy(q.po + i, tp, count * sizeof(float));
  std::memcpy(q.mo + i, tm, count * sizeof(float));
  std::memcpy(q.vo + i, tv, count * sizeof(float));
  if constexpr (kC != 0) std::memcpy(q.out + i * kC, tout, count * kC);
}

// Whole vectors [i, end).
template <GradType kGrad, CopyType kCopy, bool kStream, bool kStreamCopy, class DF>
void step_vectors(DF df, const AdamWStepScalars& s, float grad_scale, const StepPointers& q,
                  size_t i, size_t end) {
  constexpr size_t kG = kGradBytes<kGrad>;
  constexpr size_t kC = kCopyBytes<kCopy>;
  const size_t lanes = hn::Lanes(df);
  for (; i + lanes <= end; i += lanes) {
    step_vector<kGrad, kCopy, kStream, kStreamCopy>(df, s, grad_scale, q.p + i, q.m + i, q.v + i,
                                                    q.g + i * kG, q.po + i, q.mo + i, q.vo + i,
                                                    kC == 0 ? nullptr : q.out + i * kC);
  }
}

bool aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

template <GradType kGrad, CopyType kCopy>
void step_range(const AdamWStepScalars& s, const AdamWArgs& a) {
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  constexpr size_t kC = kCopyBytes<kCopy>;
  const StepPointers q{a.p,
                       a.m,
                       a.v,
                       static_cast<const unsigned char*>(a.g),
                       a.p_out != nullptr ? a.p_out : a.p,
                       a.m_out != nullptr ? a.m_out : a.m,
                       a.v_out != nullptr ? a.v_out : a.v,
                       static_cast<unsigned char*>(a.copy_out)};
  const size_t whole = a.n - a.n % lanes;
  // Note [Streamed stores]: out of place only (in place, the lines were just read). The
  // head up to p_out's alignment goes through the padded path; the rest streams when
  // m_out and v_out (and the copy) share that alignment.
  const size_t vec = lanes * sizeof(float);
  if (a.stream && a.p_out != nullptr && a.n >= 4 * lanes) {
    const size_t off = (reinterpret_cast<uintptr_t>(q.po) % vec) / sizeof(float);
    const size_t head =
        off == 0 || reinterpret_cast<uintptr_t>(q.po) % sizeof(float) != 0 ? 0 : lanes - off;
    if (head != 0) step_partial<kGrad, kCopy>(df, s, a.grad_scale, q, 0, head);
    const size_t i = head;
    const size_t end = i + (a.n - i) / lanes * lanes;
    if (aligned(q.po + i, vec) && aligned(q.mo + i, vec) && aligned(q.vo + i, vec)) {
      // The 16-bit copies are half vectors, which Highway may stream as whole ones: only
      // an fp32 copy streams.
      if (kCopy == CopyType::kFp32 && aligned(q.out + i * kC, vec)) {
        step_vectors<kGrad, kCopy, true, true>(df, s, a.grad_scale, q, i, end);
      } else {
        step_vectors<kGrad, kCopy, true, false>(df, s, a.grad_scale, q, i, end);
      }
      // The streamed stores visible before the step returns (or the caller's fence).
      if (a.stream_fence) hwy::FlushStream();
    } else {
      step_vectors<kGrad, kCopy, false, false>(df, s, a.grad_scale, q, i, end);
    }
    if (end < a.n) step_partial<kGrad, kCopy>(df, s, a.grad_scale, q, end, a.n - end);
    return;
  }
  step_vectors<kGrad, kCopy, false, false>(df, s, a.grad_scale, q, 0, whole);
  if (whole < a.n) step_partial<kGrad, kCopy>(df, s, a.grad_scale, q, whole, a.n - whole);
}

template <GradType kGrad>
void step_copy(const AdamWStepScalars& s, const AdamWArgs& a) {
  switch (a.copy_type) {
    case CopyType::kNone:
      return step_range<kGrad, CopyType::kNone>(s, a);
    case CopyType::kBf16:
      return step_range<kGrad, CopyType::kBf16>(s, a);
    case CopyType::kFp16:
      return step_range<kGrad, CopyType::kFp16>(s, a);
    case CopyType::kFp32:
      return step_range<kGrad, CopyType::kFp32>(s, a);
  }
}

void adamw_step_target(const AdamWStepScalars& s, const AdamWArgs& a) {
  if (a.grad_type == GradType::kBf16) {
    step_copy<GradType::kBf16>(s, a);
  } else {
    step_copy<GradType::kFp32>(s, a);
  }
}

// Note [Norm lanes]: lanes[c] += double(g[r * stride + c])^2 for c in [0, count), rows r =
// 0, 1, ... in order: one element per lane and row, a multiply then an add in double, each
// rounded on its own (as lane_add_square), so any vector width gives the scalar sums' bits.
// Several rows per load and store of the lanes.
template <bool kBf16>
void norm_lanes_rows(const void* g, size_t stride, size_t rows, size_t count,
                     double* HWY_RESTRICT lanes) {
  const auto value = [g](size_t i) {
    if constexpr (kBf16) {
      return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
    } else {
      return static_cast<const float*>(g)[i];
    }
  };
  size_t c = 0;
#if HWY_HAVE_FLOAT64
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const size_t n = hn::Lanes(dd);
  for (; c + n <= count; c += n) {
    auto acc = hn::LoadU(dd, lanes + c);
    for (size_t r = 0; r < rows; ++r) {
      const size_t at = r * stride + c;
      hn::Vec<decltype(df)> x;
      if constexpr (kBf16) {
        const hn::Rebind<uint32_t, decltype(dd)> du;
        const hn::Rebind<uint16_t, decltype(dd)> du16;
        const auto h = hn::LoadU(du16, static_cast<const uint16_t*>(g) + at);
        x = hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, h)));
      } else {
        x = hn::LoadU(df, static_cast<const float*>(g) + at);
      }
      const auto d = hn::PromoteTo(dd, x);
      acc = hn::Add(acc, hn::Mul(d, d));
    }
    hn::StoreU(acc, dd, lanes + c);
  }
#endif
  for (; c < count; ++c) {
    for (size_t r = 0; r < rows; ++r) lanes[c] = lane_add_square(lanes[c], value(r * stride + c));
  }
}

void norm_lanes_add_target(const void* g, bool bf16, size_t stride, size_t rows, size_t count,
                           double* HWY_RESTRICT lanes) {
  if (bf16) {
    norm_lanes_rows<true>(g, stride, rows, count, lanes);
  } else {
    norm_lanes_rows<false>(g, stride, rows, count, lanes);
  }
}

// The weights p (n) into dst as fp32 (streamed where dst is aligned or can be made so: Note
// [Streamed stores]) or bf16 (float_to_bf16's rounding).
void write_weights_target(const float* HWY_RESTRICT p, void* HWY_RESTRICT dst, bool bf16,
                          size_t n) {
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  size_t i = 0;
  if (bf16) {
    auto* out = static_cast<uint16_t*>(dst);
    for (; i + lanes <= n; i += lanes) store_bf16(df, hn::LoadU(df, p + i), out + i);
    for (; i < n; ++i) out[i] = float_to_bf16(p[i]);
    return;
  }
  auto* out = static_cast<float*>(dst);
  const size_t vec = lanes * sizeof(float);
  if (n >= 4 * lanes && reinterpret_cast<uintptr_t>(out) % sizeof(float) == 0) {
    for (; reinterpret_cast<uintptr_t>(out + i) % vec != 0; ++i) out[i] = p[i];
    for (; i + lanes <= n; i += lanes) hn::Stream(hn::LoadU(df, p + i), df, out + i);
    hwy::FlushStream();
  }
  for (; i < n; ++i) out[i] = p[i];
}

const char* adamw_target_name() {
  return hwy::TargetName(HWY_TARGET);
}

#undef SPILLWAY_ADAMW_F16C
}  // namespace spillway::optim::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <string>
#include <vector>

#include "spillway/core/error.hpp"

namespace spillway::optim {

HWY_EXPORT(adamw_step_target);
HWY_EXPORT(adamw_target_name);
HWY_EXPORT(norm_lanes_add_target);
HWY_EXPORT(write_weights_target);

void stream_fence() {
  hwy::FlushStream();
}

void write_weights(const float* p, void* dst, ParamDtype dtype, size_t n) {
  if (n == 0) return;
  HWY_DYNAMIC_DISPATCH(write_weights_target)(p, dst, dtype == ParamDtype::kBf16, n);
}

void norm_lanes_add(const void* g, GradType type, size_t stride, size_t rows, size_t count,
                    double* lanes) {
  HWY_DYNAMIC_DISPATCH(norm_lanes_add_target)
  (g, type == GradType::kBf16, stride, rows, count, lanes);
}

void adamw_step_simd(const AdamWParams& hp, const AdamWArgs& a) {
  const AdamWStepScalars s = adamw_step_scalars(hp, a.step);
  if (a.n == 0) return;
  check_adamw_args(a);
  HWY_DYNAMIC_DISPATCH(adamw_step_target)(s, a);
}

const char* adamw_simd_target() {
  return HWY_DYNAMIC_DISPATCH(adamw_target_name)();
}

namespace {
// The targets compiled in and supported, computed on first use (before any forcing).
const std::vector<int64_t>& compiled_targets() {
  static const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  return targets;
}
}  // namespace

std::vector<std::string> adamw_simd_targets() {
  std::vector<std::string> names;
  for (int64_t t : compiled_targets()) names.emplace_back(hwy::TargetName(t));
  return names;
}

bool adamw_simd_force_target(const char* name) {
  const std::vector<int64_t>& targets = compiled_targets();
  int64_t chosen = 0;  // 0: no mock, the best supported target
  if (name != nullptr) {
    for (int64_t t : targets) {
      if (std::string(hwy::TargetName(t)) == name) chosen = t;
    }
    if (chosen == 0) return false;
  }
  hwy::SetSupportedTargetsForTest(chosen);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
  return true;
}

}  // namespace spillway::optim
#endif  // HWY_ONCE

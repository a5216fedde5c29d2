// The SIMD AdamW step: Highway, compiled once per target (foreach_target.h re-includes
// this file) and dispatched at run time to the best target the CPU supports.
//
// Invariants: the arithmetic is Note [AdamW operation order] (spillway/device_math.hpp)
// lane by lane, so the result equals adamw_step_scalar (adamw_element) bit for bit on every
// target; the tail (fewer elements than one vector) goes through the same vector code on
// zero-padded stack copies, so there is no second scalar formula here; the bf16/fp16 copy of p
// is written in the same pass with the rounding of float_to_bf16 / float_to_fp16.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "optim/arch/adamw_hwy.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/highway.h>

#include <cstring>

#include "spillway/optim.hpp"

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

template <class DF>
HWY_INLINE void store_bf16(DF df, hn::Vec<DF> p, uint16_t* HWY_RESTRICT out) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> du16;
  (void)df;
  const auto bits = hn::BitCast(du, p);
  const auto hi = hn::ShiftRight<16>(bits);
  const auto rounded = hn::ShiftRight<16>(bits + hn::Set(du, 0x7FFFu) + (hi & hn::Set(du, 1u)));
  const auto quiet_nan = hi | hn::Set(du, 0x0040u);
  const auto is_nan =
      hn::BitCast(di, bits & hn::Set(du, 0x7FFFFFFFu)) > hn::Set(di, int32_t{0x7F800000});
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
  const auto sign = hn::ShiftRight<16>(bits) & hn::Set(du, 0x8000u);
  const auto a = bits & hn::Set(du, 0x7FFFFFFFu);
  const auto ai = hn::BitCast(di, a);  // a < 2^31: signed compares are exact
  const auto r = a - hn::Set(du, 0x38000000u);
  const auto normal =
      hn::ShiftRight<13>(r + hn::Set(du, 0xFFFu) + (hn::ShiftRight<13>(r) & hn::Set(du, 1u)));
  const auto subnormal =
      hn::BitCast(du, hn::BitCast(df, a) + hn::Set(df, 0.5f)) - hn::Set(du, 0x3F000000u);
  const auto quiet_nan = hn::Set(du, 0x7E00u) | (hn::ShiftRight<13>(a) & hn::Set(du, 0x3FFu));
  auto h =
      hn::IfThenElse(hn::RebindMask(du, ai < hn::Set(di, int32_t{0x38800000})), subnormal, normal);
  h = hn::IfThenElse(hn::RebindMask(du, ai > hn::Set(di, int32_t{0x477FEFFF})),
                     hn::Set(du, 0x7C00u), h);
  h = hn::IfThenElse(hn::RebindMask(du, ai > hn::Set(di, int32_t{0x7F800000})), quiet_nan, h);
  h = h | sign;
  hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, h)), du16, out);
#endif
}

// One vector of elements at p, m, v, g, out (each already offset to the same element); the
// updated p, m, v go to po, mo, vo (the same pointers in place: no restrict on them).
template <GradType kGrad, CopyType kCopy, class DF>
HWY_INLINE void step_vector(DF df, const AdamWStepScalars& s, float grad_scale, const float* p,
                            const float* m, const float* v, const void* HWY_RESTRICT g, float* po,
                            float* mo, float* vo, uint16_t* HWY_RESTRICT out) {
  hn::Vec<DF> gv;
  if constexpr (kGrad == GradType::kBf16) {
    const hn::RebindToUnsigned<DF> du;
    const hn::Rebind<uint16_t, DF> du16;
    const auto g16 = hn::LoadU(du16, static_cast<const uint16_t*>(g));
    gv = hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, g16)));
  } else {
    gv = hn::LoadU(df, static_cast<const float*>(g));
  }
  // Note [AdamW operation order]: no MulAdd, each operation rounds on its own.
  gv = gv * hn::Set(df, grad_scale);
  auto pv = hn::LoadU(df, p) * hn::Set(df, s.decay);
  const auto mv = hn::Set(df, s.beta1) * hn::LoadU(df, m) + hn::Set(df, s.one_minus_beta1) * gv;
  const auto vv =
      hn::Set(df, s.beta2) * hn::LoadU(df, v) + hn::Set(df, s.one_minus_beta2) * (gv * gv);
  const auto denom = hn::Sqrt(vv) * hn::Set(df, s.inv_sqrt_bc2) + hn::Set(df, s.eps);
  pv = pv - hn::Set(df, s.step_size) * (mv / denom);
  hn::StoreU(pv, df, po);
  hn::StoreU(mv, df, mo);
  hn::StoreU(vv, df, vo);
  if constexpr (kCopy == CopyType::kBf16) store_bf16(df, pv, out);
  if constexpr (kCopy == CopyType::kFp16) store_fp16(df, pv, out);
}

template <GradType kGrad, CopyType kCopy>
void step_range(const AdamWStepScalars& s, const AdamWArgs& a) {
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  constexpr size_t kGradBytes = kGrad == GradType::kBf16 ? 2 : 4;
  const auto* g = static_cast<const unsigned char*>(a.g);
  auto* out = static_cast<uint16_t*>(a.copy_out);
  float* po = a.p_out != nullptr ? a.p_out : a.p;
  float* mo = a.m_out != nullptr ? a.m_out : a.m;
  float* vo = a.v_out != nullptr ? a.v_out : a.v;
  size_t i = 0;
  for (; i + lanes <= a.n; i += lanes) {
    step_vector<kGrad, kCopy>(df, s, a.grad_scale, a.p + i, a.m + i, a.v + i, g + i * kGradBytes,
                              po + i, mo + i, vo + i, kCopy == CopyType::kNone ? nullptr : out + i);
  }
  if (i == a.n) return;
  // The tail: the same vector code on zero-padded copies.
  constexpr size_t kMaxLanes = HWY_MAX_BYTES / sizeof(float);
  HWY_ALIGN float tp[kMaxLanes] = {};
  HWY_ALIGN float tm[kMaxLanes] = {};
  HWY_ALIGN float tv[kMaxLanes] = {};
  HWY_ALIGN unsigned char tg[HWY_MAX_BYTES] = {};  // fp32 or bf16 bits
  HWY_ALIGN uint16_t tout[kMaxLanes] = {};
  const size_t rest = a.n - i;
  std::memcpy(tp, a.p + i, rest * sizeof(float));
  std::memcpy(tm, a.m + i, rest * sizeof(float));
  std::memcpy(tv, a.v + i, rest * sizeof(float));
  std::memcpy(tg, g + i * kGradBytes, rest * kGradBytes);
  step_vector<kGrad, kCopy>(df, s, a.grad_scale, tp, tm, tv, tg, tp, tm, tv, tout);
  std::memcpy(po + i, tp, rest * sizeof(float));
  std::memcpy(mo + i, tm, rest * sizeof(float));
  std::memcpy(vo + i, tv, rest * sizeof(float));
  if constexpr (kCopy != CopyType::kNone) std::memcpy(out + i, tout, rest * sizeof(uint16_t));
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
  }
}

void adamw_step_target(const AdamWStepScalars& s, const AdamWArgs& a) {
  if (a.grad_type == GradType::kBf16) {
    step_copy<GradType::kBf16>(s, a);
  } else {
    step_copy<GradType::kFp32>(s, a);
  }
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

#include "spillway/error.hpp"

namespace spillway::optim {

HWY_EXPORT(adamw_step_target);
HWY_EXPORT(adamw_target_name);

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

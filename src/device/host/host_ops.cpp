// The host backend's device operations: see host_ops.hpp.
//
// Compiled with -ffp-contract=off (Note [AdamW operation order]), -O3 (the lanes of a row
// of the norm lane sums vectorize, as in optim's stv.cpp) and -fno-math-errno (sqrt is then
// the IEEE instruction alone, so that the AdamW loop vectorizes; its results are the same
// bits either way).
#include "device/host/host_ops.hpp"

#include "spillway/core/error.hpp"
#include "spillway/device/device_math.hpp"

namespace spillway::host_ops {

namespace {

// The loops below are compiled for several x86 targets and picked at load time (function
// multi-versioning), so that they vectorize as wide as the CPU allows (as wide as optim's
// Highway step: the same time per bucket). Every target computes the same bits: IEEE
// operations, and -ffp-contract=off keeps the FMA-capable targets from fusing any.
// Not under ThreadSanitizer, whose runtime is not up yet when the load-time resolvers run
// (a binary with both crashes before main).
#if defined(__SANITIZE_THREAD__)
#define SPILLWAY_HOST_OPS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SPILLWAY_HOST_OPS_TSAN 1
#endif
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(SPILLWAY_HOST_OPS_TSAN)
#define SPILLWAY_HOST_OPS_TARGETS \
  __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define SPILLWAY_HOST_OPS_TARGETS
#endif

// One pass over the elements: the gradient type and the copy fixed at compile time, the
// arrays apart (DeviceAdamW), so that the loop vectorizes. Inlined into each target's copy.
template <bool kBf16Grad, bool kCopy>
[[gnu::always_inline]] inline void adamw_loop(const DeviceAdamW& a) {
  const AdamWScalars s = a.scalars;
  const float scale = a.grad_scale;
  float* __restrict p = a.p;
  float* __restrict m = a.m;
  float* __restrict v = a.v;
  const auto* __restrict g32 = static_cast<const float*>(a.g);
  const auto* __restrict g16 = static_cast<const uint16_t*>(a.g);
  uint16_t* __restrict copy = a.copy;
  for (size_t i = 0; i < a.n; ++i) {
    const float g = kBf16Grad ? bf16_to_float(g16[i]) : g32[i];
    const AdamWElement e = adamw_element(s, scale, g, p[i], m[i], v[i]);
    p[i] = e.p;
    m[i] = e.m;
    v[i] = e.v;
    if constexpr (kCopy) copy[i] = float_to_bf16(e.p);
  }
}

SPILLWAY_HOST_OPS_TARGETS void adamw_bf16_copy(const DeviceAdamW& a) {
  adamw_loop<true, true>(a);
}
SPILLWAY_HOST_OPS_TARGETS void adamw_bf16(const DeviceAdamW& a) {
  adamw_loop<true, false>(a);
}
SPILLWAY_HOST_OPS_TARGETS void adamw_fp32_copy(const DeviceAdamW& a) {
  adamw_loop<false, true>(a);
}
SPILLWAY_HOST_OPS_TARGETS void adamw_fp32(const DeviceAdamW& a) {
  adamw_loop<false, false>(a);
}

SPILLWAY_HOST_OPS_TARGETS void norm_lanes(const DeviceNormLanes& a) {
  const uint16_t* g = a.g;
  lane_sums_by_rows(a.n, a.lane_count, a.lanes, [g](size_t i) { return bf16_to_float(g[i]); });
}

SPILLWAY_HOST_OPS_TARGETS void widen(const DeviceWidenBf16& a) {
  const uint16_t* __restrict src = a.src;
  float* __restrict dst = a.dst;
  for (size_t i = 0; i < a.n; ++i) dst[i] = bf16_to_float(src[i]);
}

}  // namespace

void check(const DeviceAdamW& a) {
  SPILLWAY_CHECK(a.n == 0 || (a.p != nullptr && a.m != nullptr && a.v != nullptr && a.g != nullptr),
                 "adamw_step: p, m, v and g must be non-null for n = {}", a.n);
}

void check(const DeviceNormLanes& a) {
  SPILLWAY_CHECK(a.n == 0 || (a.g != nullptr && a.lanes != nullptr && a.lane_count > 0),
                 "norm_lanes_bf16: g and lanes must be non-null and lane_count ({}) > 0 for n = {}",
                 a.lane_count, a.n);
}

void check(const DeviceWidenBf16& a) {
  SPILLWAY_CHECK(a.n == 0 || (a.src != nullptr && a.dst != nullptr),
                 "widen_bf16: src and dst must be non-null for n = {}", a.n);
}

void run(const DeviceAdamW& a) {
  if (a.grad_bf16) {
    if (a.copy != nullptr) {
      adamw_bf16_copy(a);
    } else {
      adamw_bf16(a);
    }
  } else {
    if (a.copy != nullptr) {
      adamw_fp32_copy(a);
    } else {
      adamw_fp32(a);
    }
  }
}

void run(const DeviceNormLanes& a) {
  norm_lanes(a);
}

void run(const DeviceWidenBf16& a) {
  widen(a);
}

}  // namespace spillway::host_ops

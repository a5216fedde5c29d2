// The arithmetic of the device operations (Device::adamw_step, norm_lanes_bf16,
// widen_bf16; Note [Device operations] in device.hpp), written once below every engine:
// the host backend runs it as stream-ordered host work, the CUDA kernels of
// src/device/cuda/ run it per thread, and optim's CPU reference (adamw_step_scalar, STV's
// norm lanes) is written with it. optim's SIMD step (src/optim/arch/) is the one second
// formula, held to this one bit for bit by tests/optim/adamw_test.cpp.
//
// Every function here is host and device code: valid C++17 (nvcc) and C++20. On the
// device each operation is a round-to-nearest intrinsic (__fmul_rn, __fadd_rn, ...), which
// nvcc never contracts into a fused multiply-add; on the host the files that evaluate it
// are compiled with -ffp-contract=off (CMakeLists.txt).
//
// Note [AdamW operation order]
// The CPU reference, the host backend, the SIMD step and the CUDA kernel must agree to
// the bit, on every target (with or without FMA). So none uses a fused multiply-add: every
// multiply and every add rounds on its own. Division and square root are correctly
// rounded in IEEE scalar and vector instructions and in the _rn intrinsics alike. Per
// element, all in float, in this order:
//   g     = g * grad_scale                  (always; exact when grad_scale is 1)
//   p     = p * decay
//   m     = beta1 * m + one_minus_beta1 * g
//   v     = beta2 * v + one_minus_beta2 * (g * g)
//   denom = sqrt(v) * inv_sqrt_bc2 + eps
//   p     = p - step_size * (m / denom)
// with the per-step scalars of AdamWScalars (computed once per step in double and rounded
// to float: optim::adamw_step_scalars). NaN payloads are the one exception: which NaN
// operand an instruction propagates may differ between paths, so a NaN result is NaN in
// all of them but its bits may differ.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define SPILLWAY_HOST_DEVICE __host__ __device__
#else
#define SPILLWAY_HOST_DEVICE
#endif

namespace spillway {

// The per-step scalars of Note [AdamW operation order].
struct AdamWScalars {
  float step_size;        // lr / bc1, bc1 = 1 - beta1^t
  float inv_sqrt_bc2;     // 1 / sqrt(bc2), bc2 = 1 - beta2^t
  float decay;            // 1 - lr * weight_decay
  float beta1;            // beta1
  float one_minus_beta1;  // 1 - beta1
  float beta2;            // beta2
  float one_minus_beta2;  // 1 - beta2
  float eps;              // eps
};

namespace detail {
// One IEEE operation, rounded to nearest on its own (never fused with its neighbour).
SPILLWAY_HOST_DEVICE inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SPILLWAY_HOST_DEVICE inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
SPILLWAY_HOST_DEVICE inline float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
SPILLWAY_HOST_DEVICE inline float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
SPILLWAY_HOST_DEVICE inline float sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
SPILLWAY_HOST_DEVICE inline double mul_rn(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
SPILLWAY_HOST_DEVICE inline double add_rn(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
}  // namespace detail

// bf16 bits -> float: exact.
SPILLWAY_HOST_DEVICE inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

// float -> bf16 bits, round to nearest even; a NaN stays a quiet NaN of the same sign.
SPILLWAY_HOST_DEVICE inline uint16_t float_to_bf16(float x) {
#ifdef __CUDA_ARCH__
  const uint32_t bits = __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
#endif
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// One element's p, m, v.
struct AdamWElement {
  float p;
  float m;
  float v;
};

// Note [AdamW operation order] for one element: `g` is the gradient as stored (widened
// from bf16 when it was), before the scale.
SPILLWAY_HOST_DEVICE inline AdamWElement adamw_element(const AdamWScalars& s, float grad_scale,
                                                       float g, float p, float m, float v) {
  using detail::add_rn;
  using detail::mul_rn;
  g = mul_rn(g, grad_scale);
  p = mul_rn(p, s.decay);
  const float m1 = add_rn(mul_rn(s.beta1, m), mul_rn(s.one_minus_beta1, g));
  const float v1 = add_rn(mul_rn(s.beta2, v), mul_rn(s.one_minus_beta2, mul_rn(g, g)));
  const float denom = add_rn(mul_rn(detail::sqrt_rn(v1), s.inv_sqrt_bc2), s.eps);
  p = detail::sub_rn(p, mul_rn(s.step_size, detail::div_rn(m1, denom)));
  return AdamWElement{p, m1, v1};
}

// Norm lanes (optim's Note [Norm lanes] fixes the lane count): the elements of a bucket
// are dealt to lane_count lanes (element i to lane i % lane_count); lane c sums the
// squares of its elements in double, in index order, from 0. A float squared is exact in
// double, so a fused multiply-add would give the same bits; it is not used anyway.
SPILLWAY_HOST_DEVICE inline double lane_add_square(double sum, float x) {
  const double d = static_cast<double>(x);
  return detail::add_rn(sum, detail::mul_rn(d, d));
}

// The lane sums on a CPU: lanes (min(n, lane_count)) from load(i), the float value of
// element i, one row of lanes at a time, so that each lane keeps its order while the lanes
// of a row vectorize (GCC does so at -O3). Host only.
template <typename Load>
inline void lane_sums_by_rows(size_t n, size_t lane_count, double* lanes, Load load) {
  const size_t width = n < lane_count ? n : lane_count;
  for (size_t c = 0; c < width; ++c) lanes[c] = 0.0;
  for (size_t row = 0; row < n; row += lane_count) {
    const size_t w = n - row < lane_count ? n - row : lane_count;
    for (size_t c = 0; c < w; ++c) lanes[c] = lane_add_square(lanes[c], load(row + c));
  }
}

}  // namespace spillway

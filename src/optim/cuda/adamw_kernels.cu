// CUDA kernels of optimizer offload: see adamw_kernels.hpp and Note [AdamW on the device].
#include <cuda_runtime.h>

#include "optim/cuda/adamw_kernels.hpp"

namespace spillway::optim::cuda {

namespace {

__device__ float widen(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// Round to nearest even; a NaN stays a (quiet) NaN. Same as optim::float_to_bf16.
__device__ uint16_t narrow(float x) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__global__ void adamw_kernel(AdamWStepScalars s, float* p, float* m, float* v, const void* g,
                             int bf16_grad, float grad_scale, uint16_t* copy_bf16, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    // Note [AdamW operation order], every operation rounded on its own.
    float gi =
        bf16_grad ? widen(static_cast<const uint16_t*>(g)[i]) : static_cast<const float*>(g)[i];
    gi = __fmul_rn(gi, grad_scale);
    float pi = __fmul_rn(p[i], s.decay);
    const float mi = __fadd_rn(__fmul_rn(s.beta1, m[i]), __fmul_rn(s.one_minus_beta1, gi));
    const float vi =
        __fadd_rn(__fmul_rn(s.beta2, v[i]), __fmul_rn(s.one_minus_beta2, __fmul_rn(gi, gi)));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), s.inv_sqrt_bc2), s.eps);
    pi = __fsub_rn(pi, __fmul_rn(s.step_size, __fdiv_rn(mi, denom)));
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (copy_bf16 != nullptr) copy_bf16[i] = narrow(pi);
  }
}

__global__ void widen_kernel(const uint16_t* src, float* dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = widen(src[i]);
}

// Note [Norm lanes]: lane c in index order; a float squared is exact in double, so a
// contraction into a fused multiply-add changes no bit.
__global__ void norm_lanes_kernel(const uint16_t* g, size_t n, size_t lane_count, double* lanes) {
  const size_t c = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= lane_count || c >= n) return;
  double s = 0.0;
  for (size_t i = c; i < n; i += lane_count) {
    const double x = static_cast<double>(widen(g[i]));
    s += x * x;
  }
  lanes[c] = s;
}

unsigned blocks_for(size_t n, unsigned threads) {
  const size_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 ? (b == 0 ? 1 : b) : 65535);
}

std::string checked_launch() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

}  // namespace

std::string launch_adamw(const AdamWStepScalars& s, float* p, float* m, float* v, const void* g,
                         GradType grad_type, float grad_scale, uint16_t* copy_bf16, size_t n,
                         void* stream) {
  if (n == 0) return {};
  constexpr unsigned kThreads = 256;
  adamw_kernel<<<blocks_for(n, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      s, p, m, v, g, grad_type == GradType::kBf16 ? 1 : 0, grad_scale, copy_bf16, n);
  return checked_launch();
}

std::string launch_widen_bf16(const uint16_t* src, float* dst, size_t n, void* stream) {
  if (n == 0) return {};
  constexpr unsigned kThreads = 256;
  widen_kernel<<<blocks_for(n, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(src,
                                                                                            dst, n);
  return checked_launch();
}

std::string launch_norm_lanes_bf16(const uint16_t* g, size_t n, size_t lane_count, double* lanes,
                                   void* stream) {
  if (n == 0 || lane_count == 0) return {};
  constexpr unsigned kThreads = 256;
  const size_t width = n < lane_count ? n : lane_count;
  norm_lanes_kernel<<<blocks_for(width, kThreads), kThreads, 0,
                      static_cast<cudaStream_t>(stream)>>>(g, n, lane_count, lanes);
  return checked_launch();
}

}  // namespace spillway::optim::cuda

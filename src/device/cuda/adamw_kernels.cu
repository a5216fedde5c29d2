// CUDA kernels of the device operations: see adamw_kernels.hpp and Note [AdamW on the
// device]. The arithmetic is spillway/device/device_math.hpp's, nothing of its own.
#include <cuda_runtime.h>

#include "device/cuda/adamw_kernels.hpp"
#include "device/cuda/cuda_check.hpp"
#include "spillway/device/device_math.hpp"

namespace spillway::cuda {

namespace {

// Grid-stride over n elements; the gradient type and the copy fixed at compile time.
template <bool kBf16Grad, bool kCopy>
__global__ void adamw_kernel(DeviceAdamW a) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.n;
       i += stride) {
    const float g = kBf16Grad ? bf16_to_float(static_cast<const uint16_t*>(a.g)[i])
                              : static_cast<const float*>(a.g)[i];
    const AdamWElement e = adamw_element(a.scalars, a.grad_scale, g, a.p[i], a.m[i], a.v[i]);
    a.p[i] = e.p;
    a.m[i] = e.m;
    a.v[i] = e.v;
    if constexpr (kCopy) a.copy[i] = float_to_bf16(e.p);
  }
}

__global__ void widen_kernel(const uint16_t* src, float* dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = bf16_to_float(src[i]);
}

// One thread per lane (grid-stride over the lanes), each in index order: lane_add_square
// as the host's rows do it.
__global__ void norm_lanes_kernel(const uint16_t* g, size_t n, size_t lane_count, double* lanes) {
  const size_t width = n < lane_count ? n : lane_count;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t c = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < width;
       c += stride) {
    double s = 0.0;
    for (size_t i = c; i < n; i += lane_count) s = lane_add_square(s, bf16_to_float(g[i]));
    lanes[c] = s;
  }
}

constexpr unsigned kThreads = 256;

unsigned blocks_for(size_t n) {
  const size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 ? (b == 0 ? 1 : b) : 65535);
}

template <bool kBf16Grad, bool kCopy>
void launch_adamw_as(const DeviceAdamW& a, cudaStream_t stream) {
  adamw_kernel<kBf16Grad, kCopy><<<blocks_for(a.n), kThreads, 0, stream>>>(a);
  SPILLWAY_CUDA_LAUNCH_CHECK();
}

}  // namespace

void launch_adamw(const DeviceAdamW& a, cudaStream_t stream) {
  if (a.n == 0) return;
  if (a.grad_bf16) {
    if (a.copy != nullptr) {
      launch_adamw_as<true, true>(a, stream);
    } else {
      launch_adamw_as<true, false>(a, stream);
    }
  } else {
    if (a.copy != nullptr) {
      launch_adamw_as<false, true>(a, stream);
    } else {
      launch_adamw_as<false, false>(a, stream);
    }
  }
}

void launch_widen_bf16(const DeviceWidenBf16& a, cudaStream_t stream) {
  if (a.n == 0) return;
  widen_kernel<<<blocks_for(a.n), kThreads, 0, stream>>>(a.src, a.dst, a.n);
  SPILLWAY_CUDA_LAUNCH_CHECK();
}

void launch_norm_lanes_bf16(const DeviceNormLanes& a, cudaStream_t stream) {
  if (a.n == 0 || a.lane_count == 0) return;
  const size_t width = a.n < a.lane_count ? a.n : a.lane_count;
  norm_lanes_kernel<<<blocks_for(width), kThreads, 0, stream>>>(a.g, a.n, a.lane_count, a.lanes);
  SPILLWAY_CUDA_LAUNCH_CHECK();
}

}  // namespace spillway::cuda

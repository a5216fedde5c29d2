// The device side of optimizer offload (DESIGN section 4) as CUDA kernels: the AdamW step
// of the GPU/CPU split's device buckets, and the bf16 -> fp32 widening of gradients for
// the device cast site. Plain C++ declarations (no CUDA types), so the engines include it
// without the CUDA toolkit; built only with the CUDA backend (SPILLWAY_HAVE_CUDA).
//
// Note [AdamW on the device]: the kernel evaluates Note [AdamW operation order] with the
// round-to-nearest intrinsics (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn), which nvcc
// never contracts into a fused multiply-add, so a device bucket gets the same bits as the
// CPU step; tests/optim/adamw_cuda_test.cpp checks it where a GPU exists.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "spillway/optim.hpp"

namespace spillway::optim::cuda {

// AdamW over n device elements, gradient fp32 or bf16 bits, optional bf16 copy of p.
// `stream` is a cudaStream_t (null: the default stream). Returns "" on success, else the
// CUDA error of the launch (checked with cudaGetLastError).
std::string launch_adamw(const AdamWStepScalars& s, float* p, float* m, float* v, const void* g,
                         GradType grad_type, float grad_scale, uint16_t* copy_bf16, size_t n,
                         void* stream);

// dst (n fp32) = src (n bf16 bits) widened, on `stream`. "" on success, else the error.
std::string launch_widen_bf16(const uint16_t* src, float* dst, size_t n, void* stream);

// The norm lane sums of Note [Norm lanes] (optim/stv.hpp) over n bf16 gradients: lanes
// (min(n, lane_count) doubles) where lane c sums the squares of elements c, c + lane_count,
// ... in index order, one thread per lane. "" on success, else the error.
std::string launch_norm_lanes_bf16(const uint16_t* g, size_t n, size_t lane_count, double* lanes,
                                   void* stream);

}  // namespace spillway::optim::cuda

// The CUDA kernels of the device operations (Note [Device operations], device.hpp): the
// CUDA twin of src/device/host/host_ops.cpp, with the same operations and arguments. Every
// kernel evaluates the arithmetic of spillway/device/device_math.hpp per thread; the backend
// (cuda_device.cpp) calls these on its streams.
//
// Note [AdamW on the device]: device_math.hpp's operations are round-to-nearest
// intrinsics on the device (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn), which nvcc never
// contracts into a fused multiply-add, so a device bucket gets the same bits as the CPU
// step; tests/optim/device_ops_test.cpp and tests/optim/adamw_cuda_test.cpp check it where
// a GPU exists.
#pragma once

#include <cuda_runtime.h>

#include "spillway/device/device.hpp"

namespace spillway::cuda {

// Each enqueues its kernel on `stream` (the current device's) and checks the launch
// (SPILLWAY_CUDA_LAUNCH_CHECK: a failed launch throws spillway::Error); n = 0 launches
// nothing.
void launch_adamw(const DeviceAdamW& a, cudaStream_t stream);
// One thread per lane, each summing its elements in index order.
void launch_norm_lanes_bf16(const DeviceNormLanes& a, cudaStream_t stream);
void launch_widen_bf16(const DeviceWidenBf16& a, cudaStream_t stream);

}  // namespace spillway::cuda

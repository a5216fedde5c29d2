// What the CUDA runtime reports, for cuda_info() (include/spillway/device/device.hpp); built
// only with the CUDA backend.
#pragma once

#include <string>

#include "spillway/device/device.hpp"

namespace spillway {

// Implemented in cuda_runtime_info.cu: fills the device count, the driver and runtime
// versions and each device's properties. Never throws: a failing call (no driver, no
// device) leaves what it could not learn at zero and says why in `info->note`.
void cuda_runtime_info(CudaInfo* info);

}  // namespace spillway

// The CUDA runtime's device count, for cuda_info() (include/spillway/device.hpp); built
// only with the CUDA backend.
#pragma once

#include <string>

namespace spillway {

// Implemented in cuda_runtime_info.cu; returns the device count and sets `note` on
// failure (every runtime call is checked).
int cuda_runtime_device_count(std::string* note);

}  // namespace spillway

// Whether the CUDA backend is compiled in and how many devices the runtime sees. The
// answer is a value: "no GPU" is an expected outcome here, not an error.
#pragma once

#include <string>

namespace spillway {

struct CudaInfo {
  bool compiled = false;  // built with SPILLWAY_CUDA
  int devices = 0;        // devices the CUDA runtime reports (0 without a GPU or driver)
  std::string note;       // e.g. "cudaGetDeviceCount: no CUDA-capable device is detected"
};

CudaInfo cuda_info();

#ifdef SPILLWAY_HAVE_CUDA
// Implemented in cuda/cuda_runtime_info.cu; returns the device count and sets `note` on
// failure (every runtime call is checked).
int cuda_runtime_device_count(std::string* note);
#endif

}  // namespace spillway

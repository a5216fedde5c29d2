// The thinnest CUDA translation unit: asks the runtime how many devices it sees. It
// proves the CUDA toolchain builds and links with the project; it never aborts on a
// machine without a GPU (the error becomes the returned note).
#include <cuda_runtime.h>

#include <string>

#include "device/cuda/cuda_runtime_info.hpp"

namespace spillway {

int cuda_runtime_device_count(std::string* note) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (note != nullptr) {
      *note = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    }
    (void)cudaGetLastError();  // clear the sticky error state for later callers
    return 0;
  }
  return count;
}

}  // namespace spillway

// make_cuda_device and cuda_info in a build without the CUDA backend (CMake compiles this
// file instead of src/device/cuda/): there is no CUDA device, and the reason says why.
#include <memory>
#include <string>

#include "spillway/device/device.hpp"

namespace spillway {

std::unique_ptr<Device> make_cuda_device(int /*ordinal*/, std::string* why) {
  if (why != nullptr) *why = "built without the CUDA backend (SPILLWAY_CUDA=OFF or no nvcc)";
  return nullptr;
}

CudaInfo cuda_info() {
  CudaInfo info;
  info.note = "built without the CUDA backend (SPILLWAY_CUDA=OFF or no nvcc)";
  return info;
}

}  // namespace spillway

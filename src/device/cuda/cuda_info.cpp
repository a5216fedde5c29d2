// cuda_info() with the CUDA backend: what the runtime reports.
#include <string>

#include "device/cuda/cuda_runtime_info.hpp"
#include "spillway/device.hpp"

namespace spillway {

CudaInfo cuda_info() {
  CudaInfo info;
  info.compiled = true;
  info.devices = cuda_runtime_device_count(&info.note);
  if (info.devices == 0 && info.note.empty()) info.note = "the CUDA runtime reports no device";
  return info;
}

}  // namespace spillway

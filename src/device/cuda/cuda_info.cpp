// cuda_info() with the CUDA backend: what the runtime reports.
#include <string>

#include "device/cuda/cuda_runtime_info.hpp"
#include "spillway/device/device.hpp"

namespace spillway {

CudaInfo cuda_info() {
  CudaInfo info;
  info.compiled = true;
#ifdef SPILLWAY_HAVE_NCCL
  info.nccl_compiled = true;
#endif
  cuda_runtime_info(&info);
  if (info.devices == 0 && info.note.empty()) info.note = "the CUDA runtime reports no device";
  return info;
}

}  // namespace spillway

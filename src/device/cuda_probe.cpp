// CudaInfo for both builds: with the CUDA backend it asks the runtime, without it it
// says the backend was not compiled.
#include "spillway/device.hpp"

#ifdef SPILLWAY_HAVE_CUDA
#include "device/cuda/cuda_runtime_info.hpp"
#endif

namespace spillway {

CudaInfo cuda_info() {
  CudaInfo info;
#ifdef SPILLWAY_HAVE_CUDA
  info.compiled = true;
  info.devices = cuda_runtime_device_count(&info.note);
  if (info.devices == 0 && info.note.empty()) info.note = "the CUDA runtime reports no device";
#else
  info.note = "built without the CUDA backend (SPILLWAY_CUDA=OFF or no nvcc)";
#endif
  return info;
}

}  // namespace spillway

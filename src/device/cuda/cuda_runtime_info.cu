// The thinnest CUDA translation unit: asks the runtime what it sees (devices, driver,
// runtime). It proves the CUDA toolchain builds and links with the project; it never aborts
// on a machine without a GPU or driver (the error becomes the note).
#include <cuda_runtime.h>

#include <string>

#include "device/cuda/cuda_runtime_info.hpp"

namespace spillway {

namespace {

// True on success; otherwise sets `note` (once: the first failure is the reason) and
// clears the sticky error state for later callers.
bool ok(cudaError_t err, const char* what, std::string* note) {
  if (err == cudaSuccess) return true;
  if (note->empty()) *note = std::string(what) + ": " + cudaGetErrorString(err);
  (void)cudaGetLastError();
  return false;
}

}  // namespace

void cuda_runtime_info(CudaInfo* info) {
  (void)ok(cudaRuntimeGetVersion(&info->runtime_version), "cudaRuntimeGetVersion", &info->note);
  (void)ok(cudaDriverGetVersion(&info->driver_version), "cudaDriverGetVersion", &info->note);
  int count = 0;
  if (!ok(cudaGetDeviceCount(&count), "cudaGetDeviceCount", &info->note)) count = 0;
  info->devices = count;
  for (int d = 0; d < count; ++d) {
    CudaDeviceInfo g;
    cudaDeviceProp prop{};
    if (ok(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties", &info->note)) {
      g.name = prop.name;
      g.bytes_total = static_cast<int64_t>(prop.totalGlobalMem);
      g.compute_major = prop.major;
      g.compute_minor = prop.minor;
      g.pageable_access = prop.pageableMemoryAccess != 0;
    }
    char bus[32] = {};
    if (ok(cudaDeviceGetPCIBusId(bus, sizeof bus, d), "cudaDeviceGetPCIBusId", &info->note))
      g.pci_bus_id = bus;
    info->gpus.push_back(g);
  }
}

}  // namespace spillway

// The device an engine session of the extension module runs on, with the caller's compute
// stream adopted (Note [Adopted streams]): the host backend for CPU tensors (their compute
// stream an inline host stream, Note [Inline host streams]), the CUDA backend for GPU ones
// (torch's current stream, by its native handle).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"

namespace spillway::python {

struct AdoptedDevice {
  AdoptedDevice(const std::string& device, int ordinal, uintptr_t native_stream,
                const HostDeviceOptions& host, const char* who) {
    if (device == "host") {
      this->device = make_host_device(host);
    } else if (device == "cuda") {
      std::string why;
      this->device = make_cuda_device(ordinal, &why);
      if (!this->device) SPILLWAY_INPUT_ERROR("{}: no CUDA device {}: {}", who, ordinal, why);
    } else {
      SPILLWAY_FIELD_ERROR("device", "'" + device + "'", "must be 'host' or 'cuda' ({})", who);
    }
    // A CUDA stream handle of 0 is CUDA's legacy default stream (torch's default stream,
    // `torch.cuda.current_stream().cuda_stream == 0`): adopted as any other. (It was taken
    // for "CPU tensors" and a host stream's handle given to CUDA: a crash on first use.)
    if (device == "cuda" || native_stream != 0) {
      compute = this->device->adopt_stream(
          reinterpret_cast<void*>(native_stream),  // NOLINT(performance-no-int-to-ptr)
          StreamRole::kCompute);
    } else {
      // CPU tensors: torch runs their ops on the calling thread, so the compute stream is
      // an inline host stream: a wait on it blocks the caller until the event completes.
      cpu_stream = std::make_unique<HostStream>(HostStream::Mode::kInline);
      compute = this->device->adopt_stream(cpu_stream->native(), StreamRole::kCompute);
    }
  }
  ~AdoptedDevice() {
    if (device) device->destroy_stream(compute);
  }
  AdoptedDevice(const AdoptedDevice&) = delete;
  AdoptedDevice& operator=(const AdoptedDevice&) = delete;

  std::unique_ptr<HostStream> cpu_stream;  // CPU tensors' inline stream; outlives device
  std::unique_ptr<Device> device;
  Stream compute;
};

}  // namespace spillway::python

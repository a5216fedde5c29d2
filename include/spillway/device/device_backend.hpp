// The socket a device backend fills (as ggml-backend-impl.h is to ggml-backend.h): the host
// emulation (src/device/host/host_device.cpp), CUDA (src/device/cuda/cuda_device.cpp) and the
// tests' wrappers implement DeviceBackend; a Device (spillway/device/device.hpp) owns one and is
// what every caller uses. A backend keeps the semantics stated in spillway/device/device.hpp
// (stream order, events, allocation failure as a value, Note [Adopted streams], Note
// [Device operations]); each member is the Device member of the same name. Optional
// members say so and have a default.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "spillway/device/device.hpp"

namespace spillway {

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  virtual std::string name() const = 0;
  virtual bool emulated() const = 0;

  virtual AllocResult allocate(size_t bytes, MemoryKind kind) = 0;
  virtual void free(void* ptr, MemoryKind kind) = 0;
  virtual MemoryStats memory_stats() const = 0;
  virtual void reset_peaks() = 0;

  virtual Stream create_stream(StreamRole role, int priority) = 0;
  virtual Stream adopt_stream(void* native, StreamRole role) = 0;
  virtual void destroy_stream(Stream s) = 0;

  virtual Event create_event() = 0;
  virtual void destroy_event(Event e) = 0;
  virtual void record(Event e, Stream s) = 0;
  virtual void wait(Stream s, Event e) = 0;
  virtual bool query(Event e) = 0;
  virtual void synchronize(Event e) = 0;
  virtual void synchronize(Stream s) = 0;

  virtual void copy_async(void* dst, const void* src, size_t bytes, Stream s) = 0;
  virtual void host_callback(Stream s, std::function<void()> fn) = 0;
  // (optional) default null: the backend has no native handle.
  virtual void* native_stream(Stream /*s*/) { return nullptr; }
  // (optional) default -1: not a CUDA device.
  virtual int cuda_ordinal() const { return -1; }

  // (optional) The device operations; default false: the backend does not have it, nothing
  // is enqueued.
  virtual bool adamw_step(const DeviceAdamW& /*a*/, Stream /*s*/) { return false; }
  virtual bool norm_lanes_bf16(const DeviceNormLanes& /*a*/, Stream /*s*/) { return false; }
  virtual bool widen_bf16(const DeviceWidenBf16& /*a*/, Stream /*s*/) { return false; }
  virtual bool hybrid_gemm(const DeviceHybridGemm& /*a*/, Stream /*s*/) { return false; }
};

}  // namespace spillway

// A device backend that forwards every call to another device: tests derive from it to
// inject faults or log calls, overriding only what they change, and hand the engines under
// test its face (device(), or the wrapper itself where a Device& is taken).
#pragma once

#include <functional>
#include <string>
#include <utility>

#include "spillway/device/device.hpp"
#include "spillway/device/device_backend.hpp"

namespace spillway::testing {

class ForwardingDevice : public DeviceBackend {
 public:
  explicit ForwardingDevice(Device& inner) : inner_(inner) {}
  ForwardingDevice(const ForwardingDevice&) = delete;
  ForwardingDevice& operator=(const ForwardingDevice&) = delete;
  // The device whose calls go through this backend.
  Device& device() { return face_; }
  operator Device&() { return face_; }  // NOLINT(google-explicit-constructor)

  std::string name() const override { return inner_.name(); }
  bool emulated() const override { return inner_.emulated(); }
  AllocResult allocate(size_t bytes, MemoryKind kind) override {
    return inner_.allocate(bytes, kind);
  }
  void free(void* ptr, MemoryKind kind) override { inner_.free(ptr, kind); }
  MemoryStats memory_stats() const override { return inner_.memory_stats(); }
  void reset_peaks() override { inner_.reset_peaks(); }
  Stream create_stream(StreamRole role, int priority) override {
    return inner_.create_stream(role, priority);
  }
  Stream adopt_stream(void* native, StreamRole role) override {
    return inner_.adopt_stream(native, role);
  }
  void destroy_stream(Stream s) override { inner_.destroy_stream(s); }
  Event create_event() override { return inner_.create_event(); }
  void destroy_event(Event e) override { inner_.destroy_event(e); }
  void record(Event e, Stream s) override { inner_.record(e, s); }
  void wait(Stream s, Event e) override { inner_.wait(s, e); }
  bool query(Event e) override { return inner_.query(e); }
  void synchronize(Event e) override { inner_.synchronize(e); }
  void synchronize(Stream s) override { inner_.synchronize(s); }
  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    inner_.copy_async(dst, src, bytes, s);
  }
  void host_callback(Stream s, std::function<void()> fn) override {
    inner_.host_callback(s, std::move(fn));
  }
  void* native_stream(Stream s) override { return inner_.native_stream(s); }
  bool adamw_step(const DeviceAdamW& a, Stream s) override { return inner_.adamw_step(a, s); }
  bool norm_lanes_bf16(const DeviceNormLanes& a, Stream s) override {
    return inner_.norm_lanes_bf16(a, s);
  }
  bool widen_bf16(const DeviceWidenBf16& a, Stream s) override { return inner_.widen_bf16(a, s); }
  bool hybrid_gemm(const DeviceHybridGemm& a, Stream s) override {
    return inner_.hybrid_gemm(a, s);
  }
  int cuda_ordinal() const override { return inner_.cuda_ordinal(); }

 protected:
  Device& inner() const { return inner_; }

 private:
  Device& inner_;
  Device face_{static_cast<DeviceBackend&>(*this)};
};

}  // namespace spillway::testing

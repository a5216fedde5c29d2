// Device, the face of spillway/device/device.hpp: each call forwarded to the backend it owns.
#include "spillway/device/device.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <utility>

#include "spillway/core/error.hpp"
#include "spillway/device/device_backend.hpp"

namespace spillway {

Device::Device(std::unique_ptr<DeviceBackend> backend)
    : owned_(std::move(backend)), backend_(owned_.get()) {
  if (backend_ == nullptr) SPILLWAY_INPUT_ERROR("Device: the backend is null");
}
Device::Device(DeviceBackend& backend) : backend_(&backend) {}
Device::~Device() = default;

std::string Device::name() const {
  return backend_->name();
}
bool Device::emulated() const {
  return backend_->emulated();
}
AllocResult Device::allocate(size_t bytes, MemoryKind kind) {
  return backend_->allocate(bytes, kind);
}
void Device::free(void* ptr, MemoryKind kind) {
  backend_->free(ptr, kind);
}
MemoryStats Device::memory_stats() const {
  return backend_->memory_stats();
}
void Device::reset_peaks() {
  backend_->reset_peaks();
}
Stream Device::create_stream(StreamRole role, int priority) {
  return backend_->create_stream(role, priority);
}
Stream Device::adopt_stream(void* native, StreamRole role) {
  return backend_->adopt_stream(native, role);
}
void Device::destroy_stream(Stream s) {
  backend_->destroy_stream(s);
}
Event Device::create_event() {
  return backend_->create_event();
}
void Device::destroy_event(Event e) {
  backend_->destroy_event(e);
}
void Device::record(Event e, Stream s) {
  backend_->record(e, s);
}
void Device::wait(Stream s, Event e) {
  backend_->wait(s, e);
}
bool Device::query(Event e) {
  return backend_->query(e);
}
void Device::synchronize(Event e) {
  backend_->synchronize(e);
}
void Device::synchronize(Stream s) {
  backend_->synchronize(s);
}
void Device::copy_async(void* dst, const void* src, size_t bytes, Stream s) {
  backend_->copy_async(dst, src, bytes, s);
}
void Device::host_callback(Stream s, std::function<void()> fn) {
  backend_->host_callback(s, std::move(fn));
}
void* Device::native_stream(Stream s) {
  return backend_->native_stream(s);
}
int Device::cuda_ordinal() const {
  return backend_->cuda_ordinal();
}
bool Device::adamw_step(const DeviceAdamW& a, Stream s) {
  return backend_->adamw_step(a, s);
}
bool Device::norm_lanes_bf16(const DeviceNormLanes& a, Stream s) {
  return backend_->norm_lanes_bf16(a, s);
}
bool Device::widen_bf16(const DeviceWidenBf16& a, Stream s) {
  return backend_->widen_bf16(a, s);
}
bool Device::hybrid_gemm(const DeviceHybridGemm& a, Stream s) {
  return backend_->hybrid_gemm(a, s);
}

void UniqueStream::reset() noexcept {
  if (device_ == nullptr) return;
  Device* d = std::exchange(device_, nullptr);
  try {
    d->destroy_stream(stream_);
  } catch (const std::exception& e) {  // a destructor must not throw: said, not hidden
    std::fprintf(stderr, "spillway: error: destroying a stream: %s\n", e.what());
  }
}

UniqueMemory::UniqueMemory(Device& device, size_t bytes, MemoryKind kind)
    : device_(&device), kind_(kind) {
  AllocResult r = device.allocate(bytes, kind);
  ptr_ = r.ptr;
  reason_ = std::move(r.reason);
}

void UniqueMemory::reset() noexcept {
  if (ptr_ == nullptr) return;
  void* p = std::exchange(ptr_, nullptr);
  try {
    device_->free(p, kind_);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spillway: error: freeing %s memory: %s\n", to_string(kind_).c_str(),
                 e.what());
  }
}

void UniqueEvent::reset() noexcept {
  if (device_ == nullptr) return;
  Device* d = std::exchange(device_, nullptr);
  try {
    d->destroy_event(event_);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spillway: error: destroying an event: %s\n", e.what());
  }
}

double time_copies(Device& device, void* dst, const void* src, size_t bytes, int copies, Stream s) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < copies; ++i) device.copy_async(dst, src, bytes, s);
  device.synchronize(s);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double CopySample::gbps() const {
  return static_cast<double>(bytes) * copies / std::max(seconds, 1e-9) / 1e9;
}

CopySample calibrate_copy_sample(Device& device, void* dst, const void* src, size_t bytes,
                                 Stream s) {
  time_copies(device, dst, src, bytes, 1, s);  // the warm-up: first-touch and wake-up costs
  CopySample c;
  c.bytes = bytes;
  c.seconds = time_copies(device, dst, src, bytes, c.copies, s);
  double copy_s = c.seconds;  // the fastest a copy has gone so far
  while ((c.seconds < kMinCopySampleS || c.copies * copy_s < kMinCopySampleS) &&
         c.copies < kMaxCopiesPerSample) {
    const double wanted = std::ceil(1.25 * kMinCopySampleS / std::max(copy_s, 1e-9));
    c.copies = static_cast<int>(std::min({std::clamp(wanted, 2.0 * c.copies, 16.0 * c.copies),
                                          static_cast<double>(kMaxCopiesPerSample)}));
    c.seconds = time_copies(device, dst, src, bytes, c.copies, s);
    copy_s = std::min(copy_s, c.seconds / c.copies);
  }
  return c;
}

double measure_d2h_gbps(Device& device, size_t bytes, Stream s) {
  const UniqueMemory src(device, bytes, MemoryKind::kDevice);
  const UniqueMemory dst(device, bytes, MemoryKind::kPinnedHost);
  if (!src || !dst || bytes == 0) return 0.0;
  device.synchronize(s);
  return calibrate_copy_sample(device, dst.get(), src.get(), bytes, s).gbps();
}

double measure_d2h_gbps(Device& device, size_t bytes) {
  UniqueStream stream(device, StreamRole::kD2H);
  return measure_d2h_gbps(device, bytes, stream.get());
}

}  // namespace spillway

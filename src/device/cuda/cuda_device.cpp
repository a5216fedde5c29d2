// The CUDA backend of spillway::Device: thin RAII wrappers over the CUDA runtime, every
// call checked (cuda_check.hpp). Plain C++20, compiled by the host compiler; the kernels of
// the device operations are adamw_kernels.cu (Note [Device operations]).
//
// - Every call that touches the device first makes it current with a DeviceGuard, which
//   restores the caller's device on exit: the backend never changes the current device
//   behind the caller's back.
// - Memory is accounted per kind (current, peak, count) under one mutex. Device memory
//   comes from the device's default pool (cudaMallocAsync on an internal stream), or from
//   cudaMalloc when the device has no pools. Lack of memory is a value (AllocResult with
//   a reason), never an exception.
// - Pinned host memory is cudaHostAlloc(portable [| mapped]). When pinning fails, a
//   pinned request falls back to pageable memory (said once on stderr, accounted as
//   kHost, as ggml's CUDA host buffer does); a mapped request falls back only when the
//   device can address pageable memory (HMM/ATS), since otherwise the device could not
//   use the pointer.
// - Stream and Event handles index tables of RAII wrappers; a destroyed slot is reused by
//   the next create; an unknown or destroyed handle throws spillway::Error naming it.
// - An adopted stream (Note [Adopted streams], device.hpp) is a borrowed CudaStream in the
//   same table: used like the others, forgotten and never destroyed by destroy_stream.
//
// Note [Allocation is synchronous]: allocate() waits for its cudaMallocAsync on the
// internal stream, so the pointer it returns is usable on any stream at once, as the
// interface promises. free() is stream-ordered only on the internal stream: the caller
// must have finished (synchronized) all work that uses the memory, as on the host
// backend.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device/cuda/adamw_kernels.hpp"
#include "device/cuda/cuda_check.hpp"
#include "device/cuda/hybrid_gemm_kernels.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"
#include "spillway/device/device.hpp"
#include "spillway/device/device_backend.hpp"

namespace spillway {
namespace {

// Makes `ordinal` the current device for its scope and restores the previous one (c10's
// CUDAGuard): neither copyable nor movable, it lives on the stack of one call.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) : ordinal_(ordinal) {
    SPILLWAY_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != ordinal_) SPILLWAY_CUDA_CHECK(cudaSetDevice(ordinal_));
  }
  ~DeviceGuard() {
    if (previous_ != ordinal_) SPILLWAY_CUDA_CHECK_WARN(cudaSetDevice(previous_));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  DeviceGuard(DeviceGuard&&) = delete;
  DeviceGuard& operator=(DeviceGuard&&) = delete;

 private:
  int ordinal_;
  int previous_ = 0;
};

// A cudaStream_t (c10's CUDAStream): a non-blocking one it created and owns, or one it
// borrows (an adopted stream: never destroyed here; it may be a default stream, whose
// handle is null or a special value). Non-copyable, movable; an empty CudaStream holds
// nothing. Created on the current device.
class CudaStream {
 public:
  CudaStream() = default;
  static CudaStream create(int priority) {
    cudaStream_t s = nullptr;
    SPILLWAY_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
    return CudaStream(s, true);
  }
  static CudaStream borrow(cudaStream_t s) { return CudaStream(s, false); }
  ~CudaStream() { reset(); }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  CudaStream(CudaStream&& o) noexcept
      : stream_(std::exchange(o.stream_, nullptr)),
        live_(std::exchange(o.live_, false)),
        owned_(std::exchange(o.owned_, false)) {}
  CudaStream& operator=(CudaStream&& o) noexcept {
    if (this != &o) {
      reset();
      stream_ = std::exchange(o.stream_, nullptr);
      live_ = std::exchange(o.live_, false);
      owned_ = std::exchange(o.owned_, false);
    }
    return *this;
  }

  // Destroys an owned stream (pending work still completes: cudaStreamDestroy does not
  // wait for it); forgets a borrowed one.
  void reset() noexcept {
    if (owned_ && stream_ != nullptr) SPILLWAY_CUDA_CHECK_WARN(cudaStreamDestroy(stream_));
    stream_ = nullptr;
    live_ = false;
    owned_ = false;
  }
  cudaStream_t get() const { return stream_; }
  explicit operator bool() const { return live_; }

 private:
  CudaStream(cudaStream_t s, bool owned) : stream_(s), live_(true), owned_(owned) {}
  cudaStream_t stream_ = nullptr;
  bool live_ = false;   // holds a stream (a borrowed default stream's handle may be null)
  bool owned_ = false;  // destroyed by reset()
};

// A cudaEvent_t without timing (c10's CUDAEvent): owns it, non-copyable, movable.
// Created on the current device.
class CudaEvent {
 public:
  CudaEvent() = default;
  static CudaEvent create() {
    cudaEvent_t e = nullptr;
    SPILLWAY_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return CudaEvent(e);
  }
  ~CudaEvent() { reset(); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept {
    if (this != &o) {
      reset();
      event_ = std::exchange(o.event_, nullptr);
    }
    return *this;
  }

  void reset() noexcept {
    if (event_ != nullptr) SPILLWAY_CUDA_CHECK_WARN(cudaEventDestroy(event_));
    event_ = nullptr;
  }
  cudaEvent_t get() const { return event_; }
  explicit operator bool() const { return event_ != nullptr; }

 private:
  explicit CudaEvent(cudaEvent_t e) : event_(e) {}
  cudaEvent_t event_ = nullptr;
};

// Slots of RAII handles (CudaStream or CudaEvent) addressed by small ids; an empty slot
// is free and the most recently freed one is reused first. Not locked: the owner locks.
template <class Handle>
class HandleTable {
 public:
  explicit HandleTable(const char* what) : what_(what) {}

  int add(Handle h) {
    if (!free_.empty()) {
      const int id = free_.back();
      free_.pop_back();
      slots_[static_cast<size_t>(id)] = std::move(h);
      return id;
    }
    SPILLWAY_CHECK(slots_.size() < static_cast<size_t>(std::numeric_limits<int>::max()),
                   "too many {}s: {}", what_, slots_.size());
    slots_.push_back(std::move(h));
    return static_cast<int>(slots_.size() - 1);
  }
  // The live handle `id`, or Error("<device>: unknown or destroyed <what> <id>").
  Handle& at(int id, const std::string& device) {
    SPILLWAY_CHECK(id >= 0 && static_cast<size_t>(id) < slots_.size() &&
                       static_cast<bool>(slots_[static_cast<size_t>(id)]),
                   "{}: unknown or destroyed {} {}", device, what_, id);
    return slots_[static_cast<size_t>(id)];
  }
  // Takes the handle out of its slot (the caller destroys it) and frees the slot.
  Handle remove(int id, const std::string& device) {
    Handle h = std::move(at(id, device));
    free_.push_back(id);
    return h;
  }
  std::vector<Handle>& slots() { return slots_; }

 private:
  const char* what_;
  std::vector<Handle> slots_;
  std::vector<int> free_;
};

// Where an allocation came from, i.e. how it is given back.
enum class Source { kPool, kCudaMalloc, kHostAlloc, kMalloc };

struct Allocation {
  int64_t bytes = 0;  // as requested (a 0-byte request holds 1 byte)
  MemoryKind requested = MemoryKind::kHost;
  MemoryKind accounted = MemoryKind::kHost;  // kHost for a pinned request that fell back
  Source source = Source::kMalloc;
};

int64_t to_int64(size_t n) {
  return n > static_cast<size_t>(std::numeric_limits<int64_t>::max())
             ? std::numeric_limits<int64_t>::max()
             : static_cast<int64_t>(n);
}

std::string bytes_text(size_t n) {
  return to_string(Bytes(to_int64(n)));
}

// Runs the boxed function of host_callback on CUDA's callback thread and deletes it. It
// must not call the CUDA API (CUDA forbids it in a host function). An exception cannot
// cross the runtime: it is reported on stderr.
void CUDART_CB run_host_callback(void* boxed) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(boxed));
  try {
    (*fn)();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spillway: error: a host callback threw: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "spillway: error: a host callback threw a non-std exception\n");
  }
}

class CudaDevice final : public DeviceBackend {
 public:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal) {
    DeviceGuard guard(ordinal_);
    cudaDeviceProp prop{};
    SPILLWAY_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal_));
    name_ = fmt::format("cuda:{} {}", ordinal_, prop.name);
    pools_ = attribute(cudaDevAttrMemoryPoolsSupported) != 0;
    can_map_host_ = attribute(cudaDevAttrCanMapHostMemory) != 0;
    pageable_access_ = attribute(cudaDevAttrPageableMemoryAccess) != 0;
    SPILLWAY_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&priority_least_, &priority_greatest_));
    alloc_stream_ = CudaStream::create(priority_least_);
  }

  // Waits for the work on this device's streams, then frees what is still allocated and
  // destroys the streams and events; failures are reported, never thrown.
  ~CudaDevice() override {
    try {
      DeviceGuard guard(ordinal_);
      std::lock_guard<std::mutex> tables_lock(tables_mu_);
      for (CudaStream& s : streams_.slots()) {
        if (s) SPILLWAY_CUDA_CHECK_WARN(cudaStreamSynchronize(s.get()));
      }
      {
        std::lock_guard<std::mutex> memory_lock(memory_mu_);
        for (const auto& [ptr, a] : allocations_) release_noexcept(ptr, a.source);
        allocations_.clear();
      }
      if (alloc_stream_) SPILLWAY_CUDA_CHECK_WARN(cudaStreamSynchronize(alloc_stream_.get()));
      streams_.slots().clear();
      events_.slots().clear();
      alloc_stream_.reset();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "spillway: warning: %s: cleanup failed: %s\n", name_.c_str(), e.what());
    }
  }

  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  std::string name() const override { return name_; }
  bool emulated() const override { return false; }

  AllocResult allocate(size_t bytes, MemoryKind kind) override {
    check_kind(kind);
    DeviceGuard guard(ordinal_);
    switch (kind) {
      case MemoryKind::kDevice:
        return allocate_device(bytes);
      case MemoryKind::kPinnedHost:
      case MemoryKind::kMappedHost:
        return allocate_pinned(bytes, kind);
      case MemoryKind::kHost:
        return allocate_host(bytes, kind);
    }
    return {};  // unreachable: check_kind
  }

  void free(void* ptr, MemoryKind kind) override {
    if (ptr == nullptr) return;
    check_kind(kind);
    Allocation a;
    {
      std::lock_guard<std::mutex> lock(memory_mu_);
      const auto it = allocations_.find(ptr);
      SPILLWAY_CHECK(it != allocations_.end(), "{}: free: {} was not allocated by this device",
                     name_, ptr);
      a = it->second;
      SPILLWAY_CHECK(kind == a.requested || kind == a.accounted,
                     "{}: free: {} is {} memory, not {}", name_, ptr, to_string(a.requested),
                     to_string(kind));
      allocations_.erase(it);
      stats_.current[index(a.accounted)] -= a.bytes;
    }
    DeviceGuard guard(ordinal_);
    switch (a.source) {
      case Source::kPool:
        SPILLWAY_CUDA_CHECK(cudaFreeAsync(ptr, alloc_stream_.get()));
        break;
      case Source::kCudaMalloc:
        SPILLWAY_CUDA_CHECK(cudaFree(ptr));
        break;
      case Source::kHostAlloc:
        SPILLWAY_CUDA_CHECK(cudaFreeHost(ptr));
        break;
      case Source::kMalloc:
        std::free(ptr);
        break;
    }
  }

  MemoryStats memory_stats() const override {
    std::lock_guard<std::mutex> lock(memory_mu_);
    return stats_;
  }

  void reset_peaks() override {
    std::lock_guard<std::mutex> lock(memory_mu_);
    for (int k = 0; k < kMemoryKinds; ++k) stats_.peak[k] = stats_.current[k];
  }

  // The role only documents intent: CUDA picks the copy engine from the direction.
  Stream create_stream(StreamRole /*role*/, int priority) override {
    const int clamped = std::clamp(priority, priority_greatest_, priority_least_);
    DeviceGuard guard(ordinal_);
    CudaStream s = CudaStream::create(clamped);
    std::lock_guard<std::mutex> lock(tables_mu_);
    return Stream{streams_.add(std::move(s))};
  }

  // Note [Adopted streams]: `native` is checked to be a stream of this device (as far as
  // the runtime can tell; a dangling handle cannot be detected) and is never destroyed.
  Stream adopt_stream(void* native, StreamRole /*role*/) override {
    const auto stream = static_cast<cudaStream_t>(native);
    DeviceGuard guard(ordinal_);
    const cudaError_t err = cudaStreamQuery(stream);
    if (err != cudaSuccess && err != cudaErrorNotReady)
      detail::throw_cuda_failure("cudaStreamQuery(native)", __FILE__, __LINE__, err);
#if CUDART_VERSION >= 12080
    int device = -1;
    SPILLWAY_CUDA_CHECK(cudaStreamGetDevice(stream, &device));
    SPILLWAY_CHECK(device == ordinal_, "{}: adopt_stream: stream {} belongs to cuda:{}", name_,
                   native, device);
#endif
    std::lock_guard<std::mutex> lock(tables_mu_);
    return Stream{streams_.add(CudaStream::borrow(stream))};
  }

  void destroy_stream(Stream s) override {
    CudaStream victim;
    {
      std::lock_guard<std::mutex> lock(tables_mu_);
      victim = streams_.remove(s.id, name_);
    }
    DeviceGuard guard(ordinal_);
    victim.reset();
  }

  Event create_event() override {
    DeviceGuard guard(ordinal_);
    CudaEvent e = CudaEvent::create();
    std::lock_guard<std::mutex> lock(tables_mu_);
    return Event{events_.add(std::move(e))};
  }

  void destroy_event(Event e) override {
    CudaEvent victim;
    {
      std::lock_guard<std::mutex> lock(tables_mu_);
      victim = events_.remove(e.id, name_);
    }
    DeviceGuard guard(ordinal_);
    victim.reset();
  }

  void record(Event e, Stream s) override {
    const cudaEvent_t event = lookup(e);
    const cudaStream_t stream = lookup(s);
    DeviceGuard guard(ordinal_);
    SPILLWAY_CUDA_CHECK(cudaEventRecord(event, stream));
  }

  void wait(Stream s, Event e) override {
    const cudaStream_t stream = lookup(s);
    const cudaEvent_t event = lookup(e);
    DeviceGuard guard(ordinal_);
    SPILLWAY_CUDA_CHECK(cudaStreamWaitEvent(stream, event, 0));
  }

  bool query(Event e) override {
    const cudaEvent_t event = lookup(e);
    DeviceGuard guard(ordinal_);
    const cudaError_t err = cudaEventQuery(event);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    detail::throw_cuda_failure("cudaEventQuery(event)", __FILE__, __LINE__, err);
  }

  void synchronize(Event e) override {
    const cudaEvent_t event = lookup(e);
    DeviceGuard guard(ordinal_);
    SPILLWAY_CUDA_CHECK(cudaEventSynchronize(event));
  }

  void synchronize(Stream s) override {
    const cudaStream_t stream = lookup(s);
    DeviceGuard guard(ordinal_);
    SPILLWAY_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    SPILLWAY_CHECK(bytes == 0 || (dst != nullptr && src != nullptr),
                   "{}: copy_async: null pointer for {} bytes (dst {}, src {})", name_, bytes, dst,
                   src);
    const cudaStream_t stream = lookup(s);
    if (bytes == 0) return;
    DeviceGuard guard(ordinal_);
    SPILLWAY_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  }

  void host_callback(Stream s, std::function<void()> fn) override {
    SPILLWAY_CHECK(static_cast<bool>(fn), "{}: host_callback: empty function on stream {}", name_,
                   s.id);
    const cudaStream_t stream = lookup(s);
    auto boxed = std::make_unique<std::function<void()>>(std::move(fn));
    DeviceGuard guard(ordinal_);
    SPILLWAY_CUDA_CHECK(cudaLaunchHostFunc(stream, &run_host_callback, boxed.get()));
    (void)boxed.release();  // run_host_callback deletes it
  }

  void* native_stream(Stream s) override {
    return static_cast<void*>(lookup(s));
  }
  int cuda_ordinal() const override {
    return ordinal_;
  }

  // Note [Device operations]: the kernels of adamw_kernels.cu, each launch checked there.
  bool adamw_step(const DeviceAdamW& a, Stream s) override {
    SPILLWAY_CHECK(
        a.n == 0 || (a.p != nullptr && a.m != nullptr && a.v != nullptr && a.g != nullptr),
        "{}: adamw_step: p, m, v and g must be non-null for n = {}", name_, a.n);
    return launch(s, a.n, [&](cudaStream_t stream) { cuda::launch_adamw(a, stream); });
  }
  bool norm_lanes_bf16(const DeviceNormLanes& a, Stream s) override {
    SPILLWAY_CHECK(a.n == 0 || (a.g != nullptr && a.lanes != nullptr && a.lane_count > 0),
                   "{}: norm_lanes_bf16: g and lanes must be non-null and lane_count ({}) > 0 "
                   "for n = {}",
                   name_, a.lane_count, a.n);
    return launch(s, a.n, [&](cudaStream_t stream) { cuda::launch_norm_lanes_bf16(a, stream); });
  }
  bool widen_bf16(const DeviceWidenBf16& a, Stream s) override {
    SPILLWAY_CHECK(a.n == 0 || (a.src != nullptr && a.dst != nullptr),
                   "{}: widen_bf16: src and dst must be non-null for n = {}", name_, a.n);
    return launch(s, a.n, [&](cudaStream_t stream) { cuda::launch_widen_bf16(a, stream); });
  }
  bool hybrid_gemm(const DeviceHybridGemm& a, Stream s) override {
    const cuda::HybridGemmTilesRefusal refusal = cuda::hybrid_gemm_tiles_refusal(a);
    if (!refusal.tiles.empty())  // bad input in the problem's field, as the host's check
      SPILLWAY_FIELD_ERROR("tiles", refusal.tiles, "{} on {}", refusal.rule, name_);
    const size_t outputs = static_cast<size_t>(a.m * a.n);
    SPILLWAY_CHECK(outputs == 0 || (a.x != nullptr && a.w != nullptr && a.o != nullptr),
                   "{}: hybrid_gemm: x, w and o must be non-null for {}x{}x{}", name_, a.m, a.n,
                   a.k);
    return launch(s, outputs, [&](cudaStream_t stream) { cuda::launch_hybrid_gemm(a, stream); });
  }

 private:
  static int index(MemoryKind k) {
    return static_cast<int>(k);
  }

  void check_kind(MemoryKind kind) const {
    SPILLWAY_CHECK(index(kind) >= 0 && index(kind) < kMemoryKinds, "{}: unknown memory kind {}",
                   name_, index(kind));
  }

  int attribute(cudaDeviceAttr attr) const {
    int value = 0;
    SPILLWAY_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, ordinal_));
    return value;
  }

  // Runs `kernel` on stream s on this device (nothing for n = 0); true: the operation exists.
  template <typename Kernel>
  bool launch(Stream s, size_t n, Kernel kernel) {
    const cudaStream_t stream = lookup(s);
    if (n == 0) return true;
    DeviceGuard guard(ordinal_);
    kernel(stream);
    return true;
  }

  cudaStream_t lookup(Stream s) {
    std::lock_guard<std::mutex> lock(tables_mu_);
    return streams_.at(s.id, name_).get();
  }
  cudaEvent_t lookup(Event e) {
    std::lock_guard<std::mutex> lock(tables_mu_);
    return events_.at(e.id, name_).get();
  }

  // Records a live allocation and accounts it.
  AllocResult keep(void* ptr, size_t bytes, MemoryKind requested, MemoryKind accounted,
                   Source source) {
    Allocation a;
    a.bytes = to_int64(bytes);
    a.requested = requested;
    a.accounted = accounted;
    a.source = source;
    std::lock_guard<std::mutex> lock(memory_mu_);
    allocations_.emplace(ptr, a);
    const int k = index(accounted);
    stats_.current[k] += a.bytes;
    stats_.peak[k] = std::max(stats_.peak[k], stats_.current[k]);
    ++stats_.allocations[k];
    AllocResult r;
    r.ptr = ptr;
    return r;
  }

  static AllocResult unavailable(std::string reason) {
    AllocResult r;
    r.reason = std::move(reason);
    return r;
  }

  // "80.0 GB free of 85.0 GB" (the device's own count, including other processes' use).
  std::string device_memory_text() const {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    SPILLWAY_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return bytes_text(free_bytes) + " free of " + bytes_text(total_bytes);
  }

  // See Note [Allocation is synchronous].
  AllocResult allocate_device(size_t bytes) {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    SPILLWAY_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (bytes > total_bytes) {
      return unavailable(fmt::format("{} device memory: {} requested, more than the device's {}",
                                     name_, bytes_text(bytes), bytes_text(total_bytes)));
    }
    const size_t n = std::max<size_t>(bytes, 1);
    void* ptr = nullptr;
    const cudaError_t err =
        pools_ ? cudaMallocAsync(&ptr, n, alloc_stream_.get()) : cudaMalloc(&ptr, n);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return unavailable(fmt::format("{} device memory: {} requested, {} ({})", name_,
                                     bytes_text(bytes), device_memory_text(),
                                     pools_ ? "cudaMallocAsync" : "cudaMalloc"));
    }
    if (err != cudaSuccess) {
      detail::throw_cuda_failure(
          pools_ ? "cudaMallocAsync(&ptr, n, alloc_stream)" : "cudaMalloc(&ptr, n)", __FILE__,
          __LINE__, err);
    }
    if (pools_) {
      const cudaError_t sync = cudaStreamSynchronize(alloc_stream_.get());
      if (sync != cudaSuccess) {
        SPILLWAY_CUDA_CHECK_WARN(cudaFreeAsync(ptr, alloc_stream_.get()));
        detail::throw_cuda_failure("cudaStreamSynchronize(alloc_stream)", __FILE__, __LINE__, sync);
      }
    }
    return keep(ptr, bytes, MemoryKind::kDevice, MemoryKind::kDevice,
                pools_ ? Source::kPool : Source::kCudaMalloc);
  }

  AllocResult allocate_pinned(size_t bytes, MemoryKind kind) {
    const bool mapped = kind == MemoryKind::kMappedHost;
    const size_t n = std::max<size_t>(bytes, 1);
    cudaError_t err = cudaErrorNotSupported;
    void* ptr = nullptr;
    if (!mapped || can_map_host_) {
      err = cudaHostAlloc(&ptr, n, cudaHostAllocPortable | (mapped ? cudaHostAllocMapped : 0u));
      if (err == cudaSuccess) return keep(ptr, bytes, kind, kind, Source::kHostAlloc);
      (void)cudaGetLastError();
    }
    const std::string why = mapped && !can_map_host_
                                ? std::string("the device cannot map host memory")
                                : "cudaHostAlloc: " + detail::cuda_error_text(err);
    if (mapped && !pageable_access_) {
      return unavailable(fmt::format(
          "{} mapped host memory: {} requested, {}; pageable memory is no substitute (the "
          "device cannot address it)",
          name_, bytes_text(bytes), why));
    }
    AllocResult r = allocate_host(bytes, kind);
    if (!r) {
      r.reason = fmt::format("{} {} memory: {} requested, {}; pageable fallback: malloc failed",
                             name_, to_string(kind), bytes_text(bytes), why);
    } else if (!said_pageable_.exchange(true)) {
      std::fprintf(stderr,
                   "spillway: warning: %s: cannot pin %s of host memory (%s); using pageable "
                   "memory instead (accounted as host memory; copies from or to it are slower "
                   "and may block the host). Said once.\n",
                   name_.c_str(), bytes_text(bytes).c_str(), why.c_str());
    }
    return r;
  }

  // Pageable memory, accounted as kHost whatever was requested.
  AllocResult allocate_host(size_t bytes, MemoryKind requested) {
    void* ptr = std::malloc(std::max<size_t>(bytes, 1));
    if (ptr == nullptr) {
      return unavailable(fmt::format("{} {} memory: {} requested, malloc failed", name_,
                                     to_string(requested), bytes_text(bytes)));
    }
    return keep(ptr, bytes, requested, MemoryKind::kHost, Source::kMalloc);
  }

  // For the destructor: gives `ptr` back, reporting failures.
  void release_noexcept(void* ptr, Source source) noexcept {
    switch (source) {
      case Source::kPool:
        SPILLWAY_CUDA_CHECK_WARN(cudaFreeAsync(ptr, alloc_stream_.get()));
        break;
      case Source::kCudaMalloc:
        SPILLWAY_CUDA_CHECK_WARN(cudaFree(ptr));
        break;
      case Source::kHostAlloc:
        SPILLWAY_CUDA_CHECK_WARN(cudaFreeHost(ptr));
        break;
      case Source::kMalloc:
        std::free(ptr);
        break;
    }
  }

  const int ordinal_;
  std::string name_;
  bool pools_ = false;            // cudaMallocAsync is available
  bool can_map_host_ = false;     // cudaHostAllocMapped is available
  bool pageable_access_ = false;  // the device addresses pageable memory (HMM / ATS)
  int priority_least_ = 0;        // the CUDA range: lower is more urgent
  int priority_greatest_ = 0;
  std::atomic<bool> said_pageable_{false};

  mutable std::mutex memory_mu_;  // guards allocations_ and stats_
  std::unordered_map<void*, Allocation> allocations_;
  MemoryStats stats_;

  std::mutex tables_mu_;     // guards streams_ and events_
  CudaStream alloc_stream_;  // cudaMallocAsync / cudaFreeAsync only
  HandleTable<CudaStream> streams_{"stream"};
  HandleTable<CudaEvent> events_{"event"};
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int ordinal, std::string* why) {
  std::string unused;
  std::string& reason = why != nullptr ? *why : unused;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    reason = "no CUDA device: cudaGetDeviceCount: " + std::string(cudaGetErrorString(err));
    return nullptr;
  }
  if (ordinal < 0 || ordinal >= count) {
    reason = fmt::format("no CUDA device: ordinal {} requested, cudaGetDeviceCount reports {}",
                         ordinal, count);
    return nullptr;
  }
  try {
    return std::make_unique<Device>(std::make_unique<CudaDevice>(ordinal));
  } catch (const Error& e) {  // the device exists but cannot be used (busy, prohibited)
    reason = fmt::format("no CUDA device: cuda:{} cannot be used: {}", ordinal, e.what());
    return nullptr;
  }
}

}  // namespace spillway

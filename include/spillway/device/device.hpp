// The device layer: one interface for every backend (ggml's backend interface is the
// model: one line per member, optional members say so). The host backend emulates a GPU
// (a capacity-limited "device" arena, streams as worker threads, throttled copies) so
// every engine runs and is tested without one; the CUDA backend implements the same
// interface over the CUDA runtime.
//
// Semantics (the CUDA ones, kept by every backend):
//   - work on one stream runs in order; different streams run concurrently;
//   - record(e, s): e completes when all work enqueued on s before the call has run;
//     wait(s, e): work enqueued on s after the call runs only once e's latest record has
//     completed (a never-recorded event is complete);
//   - copy_async and host callbacks are stream work; the host returns at once;
//   - allocate() failing for lack of memory is an expected outcome (a null pointer and
//     the reason), never an exception; misuse (an unknown handle) throws spillway::Error;
//   - free() is not stream-ordered: all work using the memory must be finished (wait on
//     an event first);
//   - a host callback must not call the Device (CUDA forbids CUDA calls there) and must
//     not throw;
//   - stream order and "returns at once" hold for device, pinned and mapped memory; a
//     copy from or to pageable (kHost) memory may be synchronous on CUDA.
//
// Note [Adopted streams]: a stream the caller owns (PyTorch's current cudaStream_t, or on
// the host backend a HostStream a second party made) joins a device with adopt_stream.
// The device enqueues on it like on its own streams, so engine work is ordered after the
// caller's by stream order and events, never by synchronizing the host. The device never
// destroys it: destroy_stream forgets the handle (the host backend first waits for the
// work enqueued so far, whose-ever it is, since it may name the device's events and
// memory), and the native stream must stay alive until then.
//
// Note [Device operations]: device work an engine launches (AdamW, norm lanes, widening)
// is an optional member of this interface, as in ggml's backend interface. Its arguments
// are plain data (pointers into memory the device addresses, counts, per-step scalars; no
// engine types); its per-element arithmetic is spillway/device/device_math.hpp, written once.
// The host backend runs it as stream-ordered host work (the host addresses its device
// memory), the CUDA backend as kernels, every launch checked. A call enqueues the work on
// s and returns true; a backend without the operation returns false (the default) and
// enqueues nothing; with n = 0 a call only answers. The arguments are copied at the call;
// the memory they point to must stay valid until the work has run (as for copy_async).
// A failed launch throws spillway::Error.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "spillway/device/device_math.hpp"

namespace spillway {

enum class MemoryKind { kDevice = 0, kPinnedHost = 1, kMappedHost = 2, kHost = 3 };
inline constexpr int kMemoryKinds = 4;
std::string to_string(MemoryKind k);

struct MemoryStats {
  int64_t current[kMemoryKinds] = {};
  int64_t peak[kMemoryKinds] = {};
  int64_t allocations[kMemoryKinds] = {};  // successful allocate() calls, ever
};

struct AllocResult {
  void* ptr = nullptr;  // null when the memory is not available
  std::string reason;   // why not, e.g. "device arena: 2.1 GB requested, 0.4 GB free of 8.0 GB"
  explicit operator bool() const { return ptr != nullptr; }
};

enum class StreamRole { kCompute, kD2H, kH2D };

// Opaque handles: small integers owned by the device.
struct Stream {
  int id = -1;
};
struct Event {
  int id = -1;
};

// The arguments of the device operations (Note [Device operations]): arrays in memory the
// device addresses, none overlapping another.
struct DeviceAdamW {
  AdamWScalars scalars{};   // of this step (Note [AdamW operation order])
  float* p = nullptr;       // (n) fp32 master weights, updated in place
  float* m = nullptr;       // (n) fp32 first moments, updated in place
  float* v = nullptr;       // (n) fp32 second moments, updated in place
  const void* g = nullptr;  // (n) gradient: fp32, or bf16 bits (uint16_t) when grad_bf16
  bool grad_bf16 = false;
  float grad_scale = 1.0f;   // the gradient is multiplied by this first (clipping)
  uint16_t* copy = nullptr;  // (n) bf16 bits of the updated p, or null
  size_t n = 0;
};
struct DeviceNormLanes {
  const uint16_t* g = nullptr;  // (n) bf16 bits
  size_t n = 0;
  size_t lane_count = 0;    // lanes of lane_add_square (device_math.hpp); > 0 when n > 0
  double* lanes = nullptr;  // (min(n, lane_count)) fp64 lane sums, written
};
struct DeviceWidenBf16 {
  const uint16_t* src = nullptr;  // (n) bf16 bits
  float* dst = nullptr;           // (n) fp32, written: exact
  size_t n = 0;
};

// HybridGEMM's kernels (Note [HybridGEMM as a device operation]): o (m x n, fp32, device
// memory) = x (m x k, fp32, device memory) times w^T, w (n x k, row-major: a Linear layer's
// weight; fp32 or bf16 bits, mapped host memory the kernels read in place). The columns
// [0, n_symmetric) take the symmetric tiles, the rest the asymmetric ones; the caller has
// checked the problem.
struct DeviceGemmTiles {
  int64_t m = 0, n = 0, k = 0;
};
struct DeviceHybridGemm {
  int64_t m = 0, n = 0, k = 0;
  int64_t n_symmetric = 0;
  bool w_bf16 = false;
  DeviceGemmTiles symmetric, asymmetric;
  const float* x = nullptr;
  const void* w = nullptr;
  float* o = nullptr;
  // (6) int64 counters in device memory, or null (not counted: what the server runs). The
  // kernels add to them the bytes their loads and stores move, in the order of
  // HybridGemmTraffic: symmetric link, HBM read, HBM write; asymmetric link, HBM read, HBM
  // write (the zeroing of O counts as the asymmetric path's HBM write).
  int64_t* traffic = nullptr;
};

class DeviceBackend;  // the socket a backend fills: spillway/device/device_backend.hpp

// A device: the face every engine and caller uses. It forwards each call to its backend
// (the host emulation, CUDA, or a wrapper such as a test's fault injection); the semantics
// above are the backend's contract. Not copyable or movable: engines hold a Device& for
// their lifetime.
class Device final {
 public:
  explicit Device(std::unique_ptr<DeviceBackend> backend);  // owned; not null
  // Borrowed: the backend must outlive the device (a wrapper that holds its own face).
  explicit Device(DeviceBackend& backend);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // "host (emulated device, 8.0 GB arena)" or "cuda:0 NVIDIA GH200 480GB".
  std::string name() const;
  // True for the host backend (device memory is host-addressable).
  bool emulated() const;

  // Memory of a kind; device memory comes from the device (arena or cudaMallocAsync),
  // pinned host memory is page-locked (mapped: also addressable by the device).
  AllocResult allocate(size_t bytes, MemoryKind kind);
  // Frees what allocate returned (null is a no-op).
  void free(void* ptr, MemoryKind kind);
  // Current and peak bytes per kind, and the number of allocations.
  MemoryStats memory_stats() const;
  // Starts a new peak window: every kind's peak becomes its current bytes.
  void reset_peaks();

  // A stream for a role (the copy directions get their own engines); priority: lower is
  // more urgent (backends without priorities ignore it). A caller that owns the stream
  // for a scope holds it in a UniqueStream.
  Stream create_stream(StreamRole role, int priority = 0);
  // A handle for the caller's stream `native` (cudaStream_t on CUDA, HostStream::native() on
  // the host backend), used but not owned: Note [Adopted streams]. Throws for a foreign one.
  Stream adopt_stream(void* native, StreamRole role);
  // Destroys a created stream (its pending work still completes); forgets an adopted one.
  void destroy_stream(Stream s);

  Event create_event();
  void destroy_event(Event e);
  void record(Event e, Stream s);
  void wait(Stream s, Event e);
  bool query(Event e);
  void synchronize(Event e);
  void synchronize(Stream s);

  // Copies `bytes` from src to dst in stream order; any direction (the pointers' kinds
  // are the caller's business, as with cudaMemcpyAsync and cudaMemcpyDefault).
  void copy_async(void* dst, const void* src, size_t bytes, Stream s);
  // Runs fn on a host thread in stream order (the stream waits for it).
  void host_callback(Stream s, std::function<void()> fn);
  // The backend's own handle of stream s, what adopt_stream takes (cudaStream_t on CUDA, a
  // HostStream's native() on the host backend); null when the backend has none.
  void* native_stream(Stream s);
  // The CUDA ordinal of a CUDA device; -1 for every other backend.
  int cuda_ordinal() const;

  // The device operations (Note [Device operations]): each enqueues its work on s and
  // returns true, or returns false when the backend does not have it.
  // AdamW over a.n elements.
  bool adamw_step(const DeviceAdamW& a, Stream s);
  // The norm lane sums of a.n bf16 values.
  bool norm_lanes_bf16(const DeviceNormLanes& a, Stream s);
  // a.dst = a.src widened from bf16 to fp32.
  bool widen_bf16(const DeviceWidenBf16& a, Stream s);
  // HybridGEMM's two paths over weights the device reads where they lie (Note [HybridGEMM
  // as a device operation]).
  bool hybrid_gemm(const DeviceHybridGemm& a, Stream s);

  // The backend itself, for a wrapper that forwards to it (tests' fault injection).
  DeviceBackend& backend() { return *backend_; }

 private:
  std::unique_ptr<DeviceBackend> owned_;
  DeviceBackend* backend_ = nullptr;
};

// Note [Copy samples]: a copy's bandwidth is measured over a sample of `copies`
// back-to-back copies of one size on one stream, timed from the first enqueue to the
// stream's synchronize (copies * bytes / time). One copy per sample would measure the
// host <-> stream round trip (about 0.1 ms on the host backend, 10 us on CUDA) as much as
// the link; so after one warm-up copy, `copies` grows from 1 (at least doubling) until a
// sample lasts kMinCopySampleS, both as measured and as the fastest copy seen so far
// predicts (one stalled sample on a busy host does not end it early), at most
// kMaxCopiesPerSample. Large or slow copies take one copy per sample.
inline constexpr double kMinCopySampleS = 2e-3;
inline constexpr int kMaxCopiesPerSample = 4096;
// `copies` copies of `bytes` from src to dst on s, first enqueue to synchronize, in seconds.
double time_copies(Device& device, void* dst, const void* src, size_t bytes, int copies, Stream s);
struct CopySample {
  size_t bytes = 0;      // per copy
  int copies = 1;        // per sample
  double seconds = 0.0;  // the last calibration sample's time
  double gbps() const;   // of that sample (1 GB/s = 1e9 bytes/s)
};
// The warm-up and calibration of Note [Copy samples]; the returned sample is a measurement.
CopySample calibrate_copy_sample(Device& device, void* dst, const void* src, size_t bytes,
                                 Stream s);

// The device->host bandwidth of copies of `bytes` (device memory to pinned host memory, on
// the caller's D2H stream `s`: made once, since on the host backend a stream is a thread
// whose start would be counted) now, one sample of Note [Copy samples], in GB/s; 0 when
// the memory for it is not available. Allocates and frees its buffers: for between steps
// (a re-planner's probe of the link), never on a hot path.
double measure_d2h_gbps(Device& device, size_t bytes, Stream s);
// The same on a D2H stream of its own.
double measure_d2h_gbps(Device& device, size_t bytes);

// Note [Owned streams and events]: a stream or event a caller creates for a scope (an
// engine's copy streams, a benchmark's compute stream) is held by one of these, which
// destroys it when it goes (as c10's guards restore a stream): no path, an exception's
// included, leaks the handle or destroys it twice. Handles a caller adopted or received
// stay plain Stream / Event values. Movable, not copyable; the device must outlive them.
class UniqueStream {
 public:
  UniqueStream() = default;
  UniqueStream(Device& device, StreamRole role, int priority = 0)
      : device_(&device), stream_(device.create_stream(role, priority)) {}
  ~UniqueStream() { reset(); }
  UniqueStream(UniqueStream&& o) noexcept : device_(o.device_), stream_(o.stream_) {
    o.device_ = nullptr;
  }
  UniqueStream& operator=(UniqueStream&& o) noexcept {
    if (this != &o) {
      reset();
      device_ = o.device_;
      stream_ = o.stream_;
      o.device_ = nullptr;
    }
    return *this;
  }
  UniqueStream(const UniqueStream&) = delete;
  UniqueStream& operator=(const UniqueStream&) = delete;

  Stream get() const { return stream_; }
  operator Stream() const { return stream_; }  // NOLINT(google-explicit-constructor)
  // Destroys the stream now (its pending work still completes); idempotent.
  void reset() noexcept;

 private:
  Device* device_ = nullptr;
  Stream stream_{};
};

// Memory a caller owns for a scope, the same way: allocate()'s result, freed when it goes.
// A failed allocation is a value here too: get() is null and reason() says why.
class UniqueMemory {
 public:
  UniqueMemory(Device& device, size_t bytes, MemoryKind kind);
  ~UniqueMemory() { reset(); }
  UniqueMemory(UniqueMemory&& o) noexcept
      : device_(o.device_), kind_(o.kind_), ptr_(o.ptr_), reason_(std::move(o.reason_)) {
    o.ptr_ = nullptr;
  }
  UniqueMemory& operator=(UniqueMemory&&) = delete;
  UniqueMemory(const UniqueMemory&) = delete;
  UniqueMemory& operator=(const UniqueMemory&) = delete;

  void* get() const { return ptr_; }
  unsigned char* bytes() const { return static_cast<unsigned char*>(ptr_); }
  explicit operator bool() const { return ptr_ != nullptr; }
  const std::string& reason() const { return reason_; }
  // Frees the memory now (all work using it must be finished); idempotent.
  void reset() noexcept;

 private:
  Device* device_;
  MemoryKind kind_;
  void* ptr_ = nullptr;
  std::string reason_;
};

class UniqueEvent {
 public:
  UniqueEvent() = default;
  explicit UniqueEvent(Device& device) : device_(&device), event_(device.create_event()) {}
  ~UniqueEvent() { reset(); }
  UniqueEvent(UniqueEvent&& o) noexcept : device_(o.device_), event_(o.event_) {
    o.device_ = nullptr;
  }
  UniqueEvent& operator=(UniqueEvent&& o) noexcept {
    if (this != &o) {
      reset();
      device_ = o.device_;
      event_ = o.event_;
      o.device_ = nullptr;
    }
    return *this;
  }
  UniqueEvent(const UniqueEvent&) = delete;
  UniqueEvent& operator=(const UniqueEvent&) = delete;

  Event get() const { return event_; }
  operator Event() const { return event_; }  // NOLINT(google-explicit-constructor)
  void reset() noexcept;

 private:
  Device* device_ = nullptr;
  Event event_{};
};

// Note [Checked rate durations]: every wait computed from a rate (a throttled copy, a
// link booking, an emulated slice's time) goes through transfer_duration: bytes / rate as a
// clock duration, or spillway::Error naming the bytes, the rate and the time when the rate
// is not a finite number > 0 or the time is not finite or longer than kMaxRateSeconds. An
// unchecked bytes / 1e-20 GB/s overflows the clock's 64-bit nanoseconds and wraps to a
// negative time, which turns the throttle off instead of waiting for ever.
inline constexpr double kMaxRateSeconds = 1e6;    // one wait, ~11.6 days
inline constexpr double kMinThrottleGbps = 1e-6;  // a throttle or link below: refused
std::chrono::steady_clock::duration transfer_duration(double bytes, double gbps);
// The same check for a time already computed from a rate, in milliseconds; `what` names it.
std::chrono::steady_clock::duration checked_duration_ms(double ms, const char* what);

// Note [Shared host links]: one host link that several emulated devices share, as GPUs
// behind one PCIe root complex or MIG slices behind one C2C link do. The copies of every
// device on it are scheduled on one timeline per direction (first come, first served):
// a copy ends no earlier than the previous copy on the link in its direction plus its own
// bytes at the link's bandwidth, so co-running copies slow each other and the link's
// total never exceeds its bandwidth.
class HostLink {
 public:
  HostLink(double h2d_gbps, double d2h_gbps);  // >= kMinThrottleGbps each
  double h2d_gbps() const { return gbps_[0].load(std::memory_order_relaxed); }
  double d2h_gbps() const { return gbps_[1].load(std::memory_order_relaxed); }
  // A link that changes speed (another job on it, a throttle lifted): copies booked from
  // now on run at the new bandwidths (>= kMinThrottleGbps each).
  void set_gbps(double h2d_gbps, double d2h_gbps);
  // Books `bytes` in a direction for a copy that started at `start`; returns when it ends.
  std::chrono::steady_clock::time_point book(bool h2d, size_t bytes,
                                             std::chrono::steady_clock::time_point start);
  // Bytes booked so far per direction.
  int64_t h2d_bytes() const;
  int64_t d2h_bytes() const;

 private:
  std::atomic<double> gbps_[2];
  mutable std::mutex mu_;
  std::chrono::steady_clock::time_point deadline_[2]{};
  int64_t booked_[2] = {0, 0};
};

struct HostDeviceOptions {
  int64_t device_bytes = int64_t{1} << 30;  // capacity of the emulated device memory
  double d2h_gbps = 0.0;  // throttle of device->host copies (0 = none, else >= kMinThrottleGbps)
  double h2d_gbps = 0.0;  // throttle of host->device copies (0 = none, else >= kMinThrottleGbps)
  // A link shared with other emulated devices (Note [Shared host links]): when set, its
  // bandwidths throttle this device's host copies instead of d2h_gbps / h2d_gbps.
  std::shared_ptr<HostLink> link = nullptr;
};

// The emulated device. Throws spillway::Error when the arena cannot be reserved.
std::unique_ptr<Device> make_host_device(const HostDeviceOptions& options);

namespace detail {
class HostQueue;  // the host backend's in-order queue of work (src/device/host/host_queue.hpp)
}

// A stream of the host backend made outside any device, the host twin of a cudaStream_t
// that a framework created: an in-order queue of host work with its own thread. Whoever
// made it (a PyTorch adapter on CPU, a test, a training loop) enqueues its own work with
// launch() and hands native() to Device::adopt_stream of any host device; that device's
// copies, records, waits and operations then run in the same order (Note [Adopted
// streams]). Destroying it never cuts the queue short: work enqueued before still runs,
// and a device that adopted it keeps it alive until destroy_stream forgets it. A host
// device's native_stream(s) is the same kind of handle: one host device's stream can be
// adopted by another.
class HostStream {
 public:
  enum class Mode {
    kThread,  // work runs in order on the stream's own thread (a GPU stream's twin)
    // Work runs on the thread that enqueues it, at once: a wait blocks it, a record
    // completes, a copy is done when the call returns (PyTorch's CPU ops run on the
    // calling thread; Note [Inline host streams]). One thread at a time enqueues on it.
    kInline,
  };
  explicit HostStream(Mode mode = Mode::kThread);
  ~HostStream();
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  // Runs fn on the stream's thread after all work enqueued before it (the caller's
  // "kernel"); returns at once (kInline: runs it now, on the calling thread). fn must not
  // call a Device and must not throw.
  void launch(std::function<void()> fn);
  // Blocks until the work enqueued so far has run.
  void synchronize();
  // The handle Device::adopt_stream takes.
  void* native() const;

 private:
  std::shared_ptr<detail::HostQueue> queue_;
};

// The CUDA device `ordinal`, or null with `why` set when the backend is not compiled or
// no such device exists (an expected outcome: tests skip on it).
std::unique_ptr<Device> make_cuda_device(int ordinal, std::string* why);

// Note [Device groups]: N devices that gather together, one AllGather per rank, made
// together. The collective is the backend's: NCCL on CUDA (make_nccl_all_gather), and on
// the host backend an emulation of N devices of one process (make_host_all_gather), as the
// host backend emulates copy engines; spillway never runs a collective algorithm of its
// own over a real interconnect.
class AllGather {
 public:
  virtual ~AllGather() = default;
  virtual int rank() const = 0;
  virtual int ranks() const = 0;
  // In place, on this rank's stream s: `buffer` (ranks() * bytes of this rank's device
  // memory) holds this rank's part at buffer + rank() * bytes; after the work enqueued here
  // it holds every rank's part in rank order. Every rank makes the same calls in the same
  // order (as NCCL requires); a rank's part may be overwritten only after the call's work
  // on its stream is done (its peers read it until then).
  virtual void all_gather_in_place(void* buffer, size_t bytes, Stream s) = 0;
  // (optional) A rank failed and will make no more calls: every call of the group, pending
  // or later, returns without waiting for its peers (its buffer's other parts are left as
  // they were), so the surviving ranks' streams drain instead of waiting for ever; the
  // group is unusable afterwards. Any rank may call it, from any thread. Default: nothing.
  virtual void abort() {}
};

// The host backend's group over `devices` (host devices of this process, one per rank):
// each rank's call runs on its stream's thread, meets its peers (a rendezvous per call),
// and copies their parts from their buffers; `peer_gbps` > 0 throttles each rank's reads
// as a device-to-device link of that bandwidth (0: unthrottled). No allocation per call.
std::vector<std::unique_ptr<AllGather>> make_host_all_gather(const std::vector<Device*>& devices,
                                                             double peer_gbps = 0.0);

// NCCL's all-gather over CUDA devices of this process, one communicator per device
// (ncclCommInitAll). Each rank's calls must come from its own host thread (or process), as
// NCCL requires of one GPU per thread without group calls. Empty, with `why`, when the
// CUDA backend or NCCL is not compiled in, a device is not a CUDA one, or NCCL fails.
std::vector<std::unique_ptr<AllGather>> make_nccl_all_gather(const std::vector<Device*>& devices,
                                                             std::string* why);

// Whether the CUDA backend is compiled in, what the driver and runtime are and which
// devices the runtime sees (`spillway doctor`, `spillway hardware`). The answer is a value:
// "no GPU" and "no driver" are expected outcomes here, not errors.
struct CudaDeviceInfo {
  std::string name;         // "NVIDIA H200"
  std::string pci_bus_id;   // "0000:41:00.0"
  int64_t bytes_total = 0;  // device memory
  int compute_major = 0;    // compute capability, e.g. 9.0
  int compute_minor = 0;
  bool pageable_access = false;  // the device addresses pageable memory (HMM / ATS: GH200)
};
struct CudaInfo {
  bool compiled = false;       // built with SPILLWAY_CUDA
  bool nccl_compiled = false;  // built with NCCL (make_nccl_all_gather can work)
  int devices = 0;             // devices the CUDA runtime reports (0 without a GPU or driver)
  int driver_version = 0;      // cudaDriverGetVersion: 12040 is CUDA 12.4; 0: no driver
  int runtime_version = 0;     // cudaRuntimeGetVersion, the runtime linked in; 0: not compiled
  std::vector<CudaDeviceInfo> gpus;  // one per device, in ordinal order
  std::string note;  // e.g. "cudaGetDeviceCount: no CUDA-capable device is detected"
};
CudaInfo cuda_info();

}  // namespace spillway

// The offload engine benchmark (see bench_offload.hpp for the method and conventions).
#include "bench_offload.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>

#include "bench_json.hpp"
#include "core/stats.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"
#include "spillway/device/device.hpp"
#include "spillway/offload/offload.hpp"

namespace spillway {

namespace {

size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

std::string size_text(size_t bytes) {
  if (bytes >= (size_t{1} << 30) && bytes % (size_t{1} << 30) == 0) {
    return fmt::format("{} GiB", bytes >> 30);
  }
  if (bytes >= (size_t{1} << 20)) {
    return fmt::format("{:.4g} MiB", static_cast<double>(bytes) / (1 << 20));
  }
  if (bytes >= (size_t{1} << 10)) {
    return fmt::format("{:.4g} KiB", static_cast<double>(bytes) / (1 << 10));
  }
  return fmt::format("{} B", bytes);
}

// Note [Bench pattern]: word k of a tensor holds tag + k * kStride (the tail bytes: the
// low bytes of word `words`); tags differ per step, layer and tensor, so stale bytes from
// an earlier use of the same memory never match.
constexpr uint64_t kStride = 0x9E3779B97F4A7C15ULL;

uint64_t tag_of(uint64_t step, int layer, int index) {
  uint64_t h = step * 0xD6E8FEB86659FD93ULL ^ (static_cast<uint64_t>(layer) << 32) ^
               static_cast<uint64_t>(index);
  h ^= h >> 29;
  return h * 0xBF58476D1CE4E5B9ULL + 1;
}

void fill(void* ptr, size_t bytes, uint64_t tag) {
  auto* p = static_cast<uint64_t*>(ptr);  // engine blocks are 256-byte aligned
  const size_t words = bytes / 8;
  for (size_t k = 0; k < words; ++k) p[k] = tag + k * kStride;
  if (bytes % 8 != 0) {
    const uint64_t w = tag + words * kStride;
    std::memcpy(static_cast<unsigned char*>(ptr) + words * 8, &w, bytes % 8);
  }
}

// The first and last words only (timed steps; a full fill would compete with the copies for
// this machine's memory bandwidth, which a GPU's compute does not do with its host link).
void fill_stamps(void* ptr, size_t bytes, uint64_t tag) {
  const size_t words = bytes / 8;
  if (words < 2) return fill(ptr, bytes, tag);
  auto* p = static_cast<uint64_t*>(ptr);
  p[0] = tag;
  p[words - 1] = tag + (words - 1) * kStride;
}

// First mismatching byte offset, or -1.
int64_t first_mismatch(const void* ptr, size_t bytes, uint64_t tag) {
  const auto* p = static_cast<const uint64_t*>(ptr);
  const size_t words = bytes / 8;
  for (size_t k = 0; k < words; ++k) {
    if (p[k] != tag + k * kStride) return static_cast<int64_t>(k * 8);
  }
  if (bytes % 8 != 0) {
    const uint64_t w = tag + words * kStride;
    if (std::memcmp(static_cast<const unsigned char*>(ptr) + words * 8, &w, bytes % 8) != 0) {
      return static_cast<int64_t>(words * 8);
    }
  }
  return -1;
}

// The first and last words only (timed steps).
bool stamps_match(const void* ptr, size_t bytes, uint64_t tag) {
  const size_t words = bytes / 8;
  if (words < 2) return first_mismatch(ptr, bytes, tag) < 0;
  const auto* p = static_cast<const uint64_t*>(ptr);
  return p[0] == tag && p[words - 1] == tag + (words - 1) * kStride;
}

// Written by compute-stream callbacks only (one thread, in order), read after end_step()
// synchronized the compute stream.
struct CheckLog {
  int64_t bytes_checked = 0;
  int64_t stamps_checked = 0;
  int64_t bad_tensors = 0;
  uint64_t first_step = 0;
  int first_layer = -1;
  int first_index = -1;
  int64_t first_offset = -1;
};

// Host memory laid out like the host backend's (aligned_alloc, 4 KiB pages), touched.
struct HostBuffer {
  std::unique_ptr<void, decltype(&std::free)> mem{nullptr, &std::free};
  explicit HostBuffer(size_t bytes) {
    mem.reset(std::aligned_alloc(4096, round_up(std::max<size_t>(bytes, 1), 4096)));
    if (!mem)
      SPILLWAY_INPUT_ERROR("offload bench: cannot allocate {} of host memory", size_text(bytes));
    std::memset(mem.get(), 0x5A, bytes);
  }
  unsigned char* get() const { return static_cast<unsigned char*>(mem.get()); }
};

struct Shape {
  int layers = 0;
  int per_layer = 0;
  size_t bytes = 0;
  int64_t tensors() const { return int64_t{layers} * per_layer; }
};

struct Rig {
  MemoryPolicy policy;
  OffloadOptions options;
  std::vector<std::vector<OffloadHandle>> handles;  // (layers, per_layer), reused
  std::vector<std::string> names;                   // per tensor index
};

// Pools that never run dry, so that no engine call waits for memory: the device pool holds
// every tensor twice (its forward block may not be released yet when its reload lands),
// the pinned pool once.
Rig make_rig(const Shape& w, int prefetch_depth) {
  Rig r;
  for (int i = 0; i < w.per_layer; ++i) r.names.push_back(fmt::format("act.{}", i));
  r.policy = MemoryPolicy::uniform(w.layers, r.names, /*keep_last=*/0);
  r.policy.prefetch_depth = prefetch_depth;
  // The pinned pool holds every tensor: no fallback to keeping it on the device.
  const int64_t block = static_cast<int64_t>(round_up(w.bytes, 256));
  const int slabs = 4;
  r.options.pinned_slabs = slabs;
  r.options.pinned_bytes = checked_mul(block, w.tensors() + slabs, "offload bench: pinned pool");
  r.options.device_pool_bytes =
      checked_mul(block, 2 * w.tensors() + 2, "offload bench: device pool");
  r.options.inflight_bound_bytes = 0;
  r.options.verify = false;
  r.options.max_tensors = static_cast<int>(w.tensors()) + 8;
  r.handles.assign(static_cast<size_t>(w.layers),
                   std::vector<OffloadHandle>(static_cast<size_t>(w.per_layer), -1));
  return r;
}

// Note [Offload bench backends]: the bandwidth pass needs three things of its backend: the
// device, a "compute" that writes each tensor's pattern and checks each reloaded one in
// stream order, and the limit the engine's copies are held to, sampled beside every timed
// step. The host backend: callbacks on the compute stream writing and reading its device
// memory (host-addressable), and memcpy. CUDA: the patterns go down and the reloaded
// bytes come back as copies on the compute stream through pinned staging (every byte in
// the warm-up steps, the end words in timed steps), compared on the host once the step has
// ended; the limit is the link itself, pinned copies of the same bytes in the same chunks
// on copy streams of the device's own, D2H and H2D.
class BenchBackend {
 public:
  virtual ~BenchBackend() = default;
  virtual Device& device() = 0;
  virtual void produce(Stream compute, const DeviceTensor& t, int64_t index, uint64_t tag,
                       bool full) = 0;
  virtual void check(Stream compute, const DeviceTensor& t, int64_t index, uint64_t tag, bool full,
                     uint64_t step, int layer, int i) = 0;
  // After end_step(): what the checks found is in the log once this returns.
  virtual void step_end(Stream /*compute*/) {}
  // One sample of the limit, GB/s, per direction (d2h, h2d).
  virtual std::pair<double, double> limit_gbps() = 0;
};

void log_result(CheckLog* log, bool ok, uint64_t step, int layer, int i) {
  if (ok) return;
  if (log->bad_tensors == 0) {
    log->first_step = step;
    log->first_layer = layer;
    log->first_index = i;
  }
  ++log->bad_tensors;
}

// One training-loop-shaped step of the bandwidth pass; full_check writes and compares every
// byte, else the stamps only.
StepTelemetry bandwidth_step(BenchBackend& backend, Stream compute, OffloadEngine& engine, Rig& rig,
                             const Shape& w, int prefetch_depth, uint64_t step, bool full_check) {
  engine.begin_step();
  for (int l = 0; l < w.layers; ++l) {
    for (int i = 0; i < w.per_layer; ++i) {
      const DeviceTensor t = engine.allocate(w.bytes);
      backend.produce(compute, t, int64_t{l} * w.per_layer + i, tag_of(step, l, i), full_check);
      rig.handles[static_cast<size_t>(l)][static_cast<size_t>(i)] =
          engine.offload(t, l, rig.names[static_cast<size_t>(i)]);
    }
    engine.end_forward_layer(l);
  }
  for (int l = w.layers - 1; l >= 0; --l) {
    engine.prefetch(l - prefetch_depth);
    for (int i = 0; i < w.per_layer; ++i) {
      const DeviceTensor t =
          engine.reload(rig.handles[static_cast<size_t>(l)][static_cast<size_t>(i)]);
      backend.check(compute, t, int64_t{l} * w.per_layer + i, tag_of(step, l, i), full_check, step,
                    l, i);
      engine.free(t);
    }
  }
  StepTelemetry t = engine.end_step();
  backend.step_end(compute);
  return t;
}

struct OverheadSample {
  double total_s = 0.0;  // offload + reload + free + prefetch + end_forward_layer
  double offload_s = 0.0;
  double reload_s = 0.0;
  double free_s = 0.0;
  double layer_s = 0.0;
  double allocate_s = 0.0;
  double loop_wall_s = 0.0;  // the whole forward + backward loop (allocate, timer reads
  double loop_cpu_s = 0.0;   // included): wall time and the host thread's CPU time
};

double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// One step of the overhead pass: no compute, every engine call timed.
StepTelemetry overhead_step(OffloadEngine& engine, Rig& rig, const Shape& w, int prefetch_depth,
                            OverheadSample* out) {
  using D = std::chrono::duration<double>;
  D offload{}, reload{}, free_d{}, layer{}, allocate{};
  engine.begin_step();
  const auto loop_start = Clock::now();
  const double cpu_start = thread_cpu_s();
  for (int l = 0; l < w.layers; ++l) {
    for (int i = 0; i < w.per_layer; ++i) {
      const auto t0 = Clock::now();
      const DeviceTensor t = engine.allocate(w.bytes);
      const auto t1 = Clock::now();
      rig.handles[static_cast<size_t>(l)][static_cast<size_t>(i)] =
          engine.offload(t, l, rig.names[static_cast<size_t>(i)]);
      const auto t2 = Clock::now();
      allocate += t1 - t0;
      offload += t2 - t1;
    }
    const auto t0 = Clock::now();
    engine.end_forward_layer(l);
    layer += Clock::now() - t0;
  }
  for (int l = w.layers - 1; l >= 0; --l) {
    const auto t0 = Clock::now();
    engine.prefetch(l - prefetch_depth);
    layer += Clock::now() - t0;
    for (int i = 0; i < w.per_layer; ++i) {
      const auto t1 = Clock::now();
      const DeviceTensor t =
          engine.reload(rig.handles[static_cast<size_t>(l)][static_cast<size_t>(i)]);
      const auto t2 = Clock::now();
      engine.free(t);
      const auto t3 = Clock::now();
      reload += t2 - t1;
      free_d += t3 - t2;
    }
  }
  out->loop_cpu_s = thread_cpu_s() - cpu_start;
  out->loop_wall_s = seconds_since(loop_start);
  out->offload_s = offload.count();
  out->reload_s = reload.count();
  out->free_s = free_d.count();
  out->layer_s = layer.count();
  out->allocate_s = allocate.count();
  out->total_s = out->offload_s + out->reload_s + out->free_s + out->layer_s;
  return engine.end_step();
}

// One memcpy sample: the same bytes in the same chunks as the engine's copies; GB/s
// counting each copied byte once.
double memcpy_gbps(const HostBuffer& src, const HostBuffer& dst, int64_t total, size_t chunk) {
  const auto t0 = Clock::now();
  for (int64_t off = 0; off < total; off += static_cast<int64_t>(chunk)) {
    const size_t n = std::min(chunk, static_cast<size_t>(total - off));
    std::memcpy(dst.get() + off, src.get() + off, n);
  }
  const double s = seconds_since(t0);
  // Keep the copy observable.
  volatile unsigned char sink = dst.get()[total - 1];
  (void)sink;
  return static_cast<double>(total) / s / 1e9;
}

// The host backend: the compute is callbacks on the compute stream (the device's memory is
// host memory), the limit memcpy of the same bytes in the same chunks.
class HostBench final : public BenchBackend {
 public:
  HostBench(int64_t arena, int64_t total, size_t chunk, CheckLog* log)
      : device_(make_host_device(HostDeviceOptions{arena, 0.0, 0.0})),
        src_(static_cast<size_t>(total)),
        dst_(static_cast<size_t>(total)),
        total_(total),
        chunk_(chunk),
        log_(log) {}
  Device& device() override { return *device_; }
  void produce(Stream compute, const DeviceTensor& t, int64_t /*index*/, uint64_t tag,
               bool full) override {
    device_->host_callback(compute, [p = t.ptr, n = t.bytes, tag, full] {
      if (full) {
        fill(p, n, tag);
      } else {
        fill_stamps(p, n, tag);
      }
    });
  }
  void check(Stream compute, const DeviceTensor& t, int64_t /*index*/, uint64_t tag, bool full,
             uint64_t step, int layer, int i) override {
    device_->host_callback(compute,
                           [p = t.ptr, n = t.bytes, tag, step, layer, i, full, log = log_] {
                             bool ok = true;
                             if (full) {
                               const int64_t at = first_mismatch(p, n, tag);
                               ok = at < 0;
                               log->bytes_checked += static_cast<int64_t>(n);
                               if (!ok && log->bad_tensors == 0) log->first_offset = at;
                             } else {
                               ok = stamps_match(p, n, tag);
                               ++log->stamps_checked;
                             }
                             log_result(log, ok, step, layer, i);
                           });
  }
  std::pair<double, double> limit_gbps() override {
    const double g = memcpy_gbps(src_, dst_, total_, chunk_);
    return {g, g};
  }

 private:
  std::unique_ptr<Device> device_;
  HostBuffer src_, dst_;
  int64_t total_;
  size_t chunk_;
  CheckLog* log_;
};

// Memory of a kind from the device, or the run is refused naming what it was for.
UniqueMemory checked_memory(Device& d, size_t bytes, MemoryKind kind, const char* what) {
  UniqueMemory m(d, std::max<size_t>(bytes, 1), kind);
  if (!m)
    SPILLWAY_INPUT_ERROR("offload bench: cannot allocate {} of {} for {}: {}", size_text(bytes),
                         to_string(kind), what, m.reason());
  return m;
}

// CUDA (Note [Offload bench backends]): staging in pinned memory, one slot per tensor of the
// step (no slot is reused within a step; each step ends synchronized).
class CudaBench final : public BenchBackend {
 public:
  CudaBench(std::unique_ptr<Device> device, const Shape& w, CheckLog* log)
      : device_(std::move(device)),
        slot_(round_up(w.bytes, 256)),
        bytes_(w.bytes),
        total_(static_cast<size_t>(w.tensors()) * round_up(w.bytes, 256)),
        up_(checked_memory(*device_, total_, MemoryKind::kPinnedHost, "the patterns")),
        back_(checked_memory(*device_, total_, MemoryKind::kPinnedHost, "the reloaded bytes")),
        stamps_up_(checked_memory(*device_, static_cast<size_t>(w.tensors()) * 16,
                                  MemoryKind::kPinnedHost, "the stamps")),
        stamps_back_(checked_memory(*device_, static_cast<size_t>(w.tensors()) * 16,
                                    MemoryKind::kPinnedHost, "the stamps")),
        link_(checked_memory(*device_, total_, MemoryKind::kDevice, "the link's limit")),
        d2h_(*device_, StreamRole::kD2H),
        h2d_(*device_, StreamRole::kH2D),
        log_(log) {
    pending_.reserve(static_cast<size_t>(w.tensors()));
  }
  Device& device() override { return *device_; }
  void produce(Stream compute, const DeviceTensor& t, int64_t index, uint64_t tag,
               bool full) override {
    const size_t words = bytes_ / 8;
    if (full || words < 2) {
      unsigned char* up = up_.bytes() + static_cast<size_t>(index) * slot_;
      fill(up, bytes_, tag);
      device_->copy_async(t.ptr, up, bytes_, compute);
      return;
    }
    auto* st = reinterpret_cast<uint64_t*>(stamps_up_.bytes()) + 2 * index;
    st[0] = tag;
    st[1] = tag + (words - 1) * kStride;
    device_->copy_async(t.ptr, st, 8, compute);
    device_->copy_async(static_cast<unsigned char*>(t.ptr) + (words - 1) * 8, st + 1, 8, compute);
  }
  void check(Stream compute, const DeviceTensor& t, int64_t index, uint64_t tag, bool full,
             uint64_t step, int layer, int i) override {
    const size_t words = bytes_ / 8;
    const bool whole = full || words < 2;
    if (whole) {
      device_->copy_async(back_.bytes() + static_cast<size_t>(index) * slot_, t.ptr, bytes_,
                          compute);
    } else {
      auto* st = reinterpret_cast<uint64_t*>(stamps_back_.bytes()) + 2 * index;
      device_->copy_async(st, t.ptr, 8, compute);
      device_->copy_async(st + 1, static_cast<const unsigned char*>(t.ptr) + (words - 1) * 8, 8,
                          compute);
    }
    pending_.push_back({index, tag, whole, step, layer, i});
  }
  void step_end(Stream compute) override {
    device_->synchronize(compute);
    const size_t words = bytes_ / 8;
    for (const Pending& p : pending_) {
      bool ok = true;
      if (p.whole) {
        const int64_t at =
            first_mismatch(back_.bytes() + static_cast<size_t>(p.index) * slot_, bytes_, p.tag);
        ok = at < 0;
        log_->bytes_checked += static_cast<int64_t>(bytes_);
        if (!ok && log_->bad_tensors == 0) log_->first_offset = at;
      } else {
        const auto* st = reinterpret_cast<const uint64_t*>(stamps_back_.bytes()) + 2 * p.index;
        ok = st[0] == p.tag && st[1] == p.tag + (words - 1) * kStride;
        ++log_->stamps_checked;
      }
      log_result(log_, ok, p.step, p.layer, p.i);
    }
    pending_.clear();
  }
  std::pair<double, double> limit_gbps() override {
    const auto timed = [&](Stream s, bool d2h) {
      const auto t0 = Clock::now();
      size_t moved = 0;
      for (size_t off = 0; off < total_; off += slot_) {
        const size_t n = std::min(bytes_, total_ - off);
        moved += n;
        if (d2h) {
          device_->copy_async(up_.bytes() + off, link_.bytes() + off, n, s);
        } else {
          device_->copy_async(link_.bytes() + off, up_.bytes() + off, n, s);
        }
      }
      device_->synchronize(s);
      return static_cast<double>(moved) / seconds_since(t0) / 1e9;
    };
    const double d2h = timed(d2h_, true);
    return {d2h, timed(h2d_, false)};
  }

 private:
  struct Pending {
    int64_t index;
    uint64_t tag;
    bool whole;
    uint64_t step;
    int layer;
    int i;
  };
  std::unique_ptr<Device> device_;
  size_t slot_, bytes_, total_;
  UniqueMemory up_, back_, stamps_up_, stamps_back_, link_;
  UniqueStream d2h_, h2d_;
  CheckLog* log_;
  std::vector<Pending> pending_;
};

void validate(const OffloadBenchOptions& o) {
  const auto at_least = [](const char* what, int64_t v, int64_t min) {
    if (v < min) SPILLWAY_INPUT_ERROR("offload bench: {} is {}; must be >= {}", what, v, min);
  };
  at_least("layers", o.layers, 1);
  at_least("tensors_per_layer", o.tensors_per_layer, 1);
  at_least("tensor_bytes", static_cast<int64_t>(o.tensor_bytes), 1);
  at_least("steps", o.steps, 2);
  at_least("repeats", o.repeats, 1);
  at_least("prefetch_depth", o.prefetch_depth, 0);
  at_least("overhead_layers", o.overhead_layers, 1);
  at_least("overhead_tensors_per_layer", o.overhead_tensors_per_layer, 1);
  at_least("overhead_tensor_bytes", static_cast<int64_t>(o.overhead_tensor_bytes), 1);
  if (int64_t{o.layers} * o.tensors_per_layer > (int64_t{1} << 24) ||
      int64_t{o.overhead_layers} * o.overhead_tensors_per_layer > (int64_t{1} << 24)) {
    SPILLWAY_INPUT_ERROR("offload bench: more than {} tensors per step", int64_t{1} << 24);
  }
}

}  // namespace

OffloadBenchResult run_offload_bench(const OffloadBenchOptions& o) {
  validate(o);
  const Shape bw{o.layers, o.tensors_per_layer, o.tensor_bytes};
  const Shape ov{o.overhead_layers, o.overhead_tensors_per_layer, o.overhead_tensor_bytes};
  const int64_t total = checked_mul(bw.tensors(), static_cast<int64_t>(o.tensor_bytes),
                                    "offload bench: bytes per step");
  Rig bw_rig = make_rig(bw, o.prefetch_depth);
  Rig ov_rig = make_rig(ov, o.prefetch_depth);

  // Memory: the device arena holds both engines' device pools; the host holds the pinned
  // pools and the two memcpy buffers. Refuse what the machine cannot hold.
  const int64_t slack = int64_t{64} << 20;
  const int64_t arena = checked_add(
      checked_add(bw_rig.options.device_pool_bytes, ov_rig.options.device_pool_bytes, "arena"),
      slack, "arena");
  const int64_t needed = checked_add(
      checked_add(arena, bw_rig.options.pinned_bytes + ov_rig.options.pinned_bytes, "memory"),
      checked_mul(total, 2, "memory"), "memory");
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    const double physical = static_cast<double>(pages) * static_cast<double>(page);
    if (static_cast<double>(needed) > 0.75 * physical) {
      SPILLWAY_INPUT_ERROR(
          "offload bench: {} per step needs {} of host memory (device pools, pinned pools, "
          "memcpy buffers); this machine has {}: use fewer layers or smaller tensors",
          to_string(Bytes(total)), to_string(Bytes(needed)),
          to_string(Bytes(static_cast<int64_t>(physical))));
    }
  }

  CheckLog log;
  std::unique_ptr<BenchBackend> backend;
  if (o.cuda) {
    std::string why;
    std::unique_ptr<Device> cuda = make_cuda_device(0, &why);
    if (!cuda) SPILLWAY_INPUT_ERROR("offload bench --backend cuda: {}", why);
    backend = std::make_unique<CudaBench>(std::move(cuda), bw, &log);
  } else {
    backend = std::make_unique<HostBench>(arena, total, o.tensor_bytes, &log);  // unthrottled
  }
  Device& dev = backend->device();
  const UniqueStream compute(dev, StreamRole::kCompute);
  OffloadBenchResult r;
  r.backend = dev.name();
  r.limit = o.cuda ? "pinned link" : "memcpy";
  r.options = o;
  r.bytes_per_step = total;
  r.overhead_tensors_per_step = static_cast<int>(ov.tensors());
  {
    OffloadEngine bw_engine(dev, compute, bw_rig.policy, bw_rig.options);
    OffloadEngine ov_engine(dev, compute, ov_rig.policy, ov_rig.options);
    std::vector<OverheadSample> overhead;
    uint64_t step = 0;
    bool bw_first = true;
    bool ov_first = true;
    const auto account = [&](const StepTelemetry& t, bool* first) {
      if (*first) {
        r.allocations_first_step += t.device_allocations;
        *first = false;
        return;
      }
      r.allocations_steady_state += t.device_allocations;
      r.fallbacks_steady_state += t.fallback_kept + t.fallback_direct;
      r.backpressure_ms_steady_state += t.backpressure_ms;
    };
    for (int rep = 0; rep < o.repeats; ++rep) {
      for (int s = 0; s < o.steps; ++s) {
        const bool warmup = s == 0;
        if (!warmup) {
          // memcpy's own warm-up, after the engine's: the first pass after the warm-up
          // step (which touches the pools' pages) runs measurably slower.
          if (s == 1) (void)backend->limit_gbps();
          const auto [d2h, h2d] = backend->limit_gbps();
          r.limit_d2h_samples_gbps.push_back(d2h);
          r.limit_h2d_samples_gbps.push_back(h2d);
        }
        const StepTelemetry t = bandwidth_step(*backend, compute, bw_engine, bw_rig, bw,
                                               o.prefetch_depth, step++, warmup);
        if (log.bad_tensors > 0) {
          SPILLWAY_INPUT_ERROR(
              "offload bench: reloaded bytes differ from what was offloaded: {} tensor(s); "
              "first: step {} layer {} tensor {} ({} each, {} check{})",
              log.bad_tensors, log.first_step, log.first_layer, log.first_index,
              size_text(o.tensor_bytes), warmup ? "full" : "stamp",
              log.first_offset >= 0 ? fmt::format(", first wrong byte at {}", log.first_offset)
                                    : std::string());
        }
        SPILLWAY_CHECK(t.d2h_bytes == total && t.h2d_bytes == total,
                       "offload bench: the engine moved {} bytes D2H and {} H2D; expected {}",
                       t.d2h_bytes, t.h2d_bytes, total);
        account(t, &bw_first);
        if (warmup) continue;
        r.offload_samples_gbps.push_back(t.d2h_gbps);
        r.reload_samples_gbps.push_back(t.h2d_gbps);
        ++r.steady_steps;
      }
      for (int s = 0; s < o.steps; ++s) {
        OverheadSample sample;
        const StepTelemetry t = overhead_step(ov_engine, ov_rig, ov, o.prefetch_depth, &sample);
        account(t, &ov_first);
        if (s > 0) overhead.push_back(sample);
      }
    }
    r.correct = true;
    r.bytes_checked = log.bytes_checked;
    r.stamps_checked = log.stamps_checked;

    const double per_tensor_us = 1e6 / static_cast<double>(ov.tensors());
    std::vector<double> offload_us, reload_us, free_us, layer_us, allocate_us, wall_us, cpu_us;
    for (const OverheadSample& s : overhead) {
      r.overhead_samples_us.push_back(s.total_s * per_tensor_us);
      offload_us.push_back(s.offload_s * per_tensor_us);
      reload_us.push_back(s.reload_s * per_tensor_us);
      free_us.push_back(s.free_s * per_tensor_us);
      layer_us.push_back(s.layer_s * per_tensor_us);
      allocate_us.push_back(s.allocate_s * per_tensor_us);
      wall_us.push_back(s.loop_wall_s * per_tensor_us);
      cpu_us.push_back(s.loop_cpu_s * per_tensor_us);
    }
    r.overhead_us_per_tensor = median(r.overhead_samples_us);
    r.offload_us = median(offload_us);
    r.reload_us = median(reload_us);
    r.free_us = median(free_us);
    r.layer_calls_us = median(layer_us);
    r.allocate_us = median(allocate_us);
    r.loop_wall_us = median(wall_us);
    r.loop_cpu_us = median(cpu_us);
  }
  r.limit_d2h_gbps = median(r.limit_d2h_samples_gbps);
  r.limit_h2d_gbps = median(r.limit_h2d_samples_gbps);
  if (!o.cuda) {  // memcpy has one direction
    r.memcpy_samples_gbps = r.limit_d2h_samples_gbps;
    r.memcpy_gbps = r.limit_d2h_gbps;
  }
  r.offload_gbps = median(r.offload_samples_gbps);
  r.reload_gbps = median(r.reload_samples_gbps);
  r.offload_ratio = r.limit_d2h_gbps > 0.0 ? r.offload_gbps / r.limit_d2h_gbps : 0.0;
  r.reload_ratio = r.limit_h2d_gbps > 0.0 ? r.reload_gbps / r.limit_h2d_gbps : 0.0;
  return r;
}

std::string offload_bench_json(const OffloadBenchResult& r) {
  using bench_json::finite;
  using bench_json::finite_all;
  using bench_json::Json;
  const OffloadBenchOptions& o = r.options;
  Json j;
  j["schema"] = "spillway.bench.offload/1";
  j["offload_gbps"] = finite(r.offload_gbps);
  j["reload_gbps"] = finite(r.reload_gbps);
  j["memcpy_gbps"] = finite(r.memcpy_gbps);
  j["limit"] = r.limit;
  j["limit_d2h_gbps"] = finite(r.limit_d2h_gbps);
  j["limit_h2d_gbps"] = finite(r.limit_h2d_gbps);
  j["overhead_us_per_tensor"] = finite(r.overhead_us_per_tensor);
  j["allocations_steady_state"] = r.allocations_steady_state;
  j["offload_ratio"] = finite(r.offload_ratio);
  j["reload_ratio"] = finite(r.reload_ratio);
  j["targets"] = Json{{"min_ratio_to_memcpy", r.target_ratio},
                      {"max_overhead_us_per_tensor", r.target_overhead_us},
                      {"allocations_steady_state", 0}};
  j["meets_targets"] = Json{{"bandwidth", r.meets_bandwidth_target()},
                            {"overhead", r.meets_overhead_target()},
                            {"allocations", r.allocations_steady_state == 0}};
  j["gbps_convention"] =
      "1e9 bytes copied per second, each byte counted once (memory traffic: twice that)";
  j["backend"] = r.backend;
  j["correct"] = r.correct;
  j["bytes_checked"] = r.bytes_checked;
  j["stamps_checked"] = r.stamps_checked;
  j["overhead_breakdown_us_per_tensor"] =
      Json{{"offload", finite(r.offload_us)},
           {"reload", finite(r.reload_us)},
           {"free", finite(r.free_us)},
           {"prefetch_and_end_forward_layer", finite(r.layer_calls_us)},
           {"allocate_not_counted", finite(r.allocate_us)}};
  j["overhead_loop_us_per_tensor"] =
      Json{{"wall", finite(r.loop_wall_us)}, {"host_thread_cpu", finite(r.loop_cpu_us)}};
  j["allocations_first_step"] = r.allocations_first_step;
  j["fallbacks_steady_state"] = r.fallbacks_steady_state;
  j["backpressure_ms_steady_state"] = finite(r.backpressure_ms_steady_state);
  j["samples"] = Json{{"memcpy_gbps", finite_all(r.memcpy_samples_gbps)},
                      {"limit_d2h_gbps", finite_all(r.limit_d2h_samples_gbps)},
                      {"limit_h2d_gbps", finite_all(r.limit_h2d_samples_gbps)},
                      {"offload_gbps", finite_all(r.offload_samples_gbps)},
                      {"reload_gbps", finite_all(r.reload_samples_gbps)},
                      {"overhead_us_per_tensor", finite_all(r.overhead_samples_us)}};
  j["workload"] = Json{{"layers", o.layers},
                       {"tensors_per_layer", o.tensors_per_layer},
                       {"tensor_bytes", o.tensor_bytes},
                       {"bytes_per_step", r.bytes_per_step},
                       {"steps_per_repeat", o.steps},
                       {"repeats", o.repeats},
                       {"prefetch_depth", o.prefetch_depth},
                       {"overhead_tensors_per_step", r.overhead_tensors_per_step},
                       {"overhead_tensor_bytes", o.overhead_tensor_bytes}};
  return j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

std::string format_offload_bench(const OffloadBenchResult& r) {
  const OffloadBenchOptions& o = r.options;
  const auto verdict = [](bool ok) { return ok ? "ok" : "MISSED"; };
  std::string out;
  out += fmt::format("offload engine benchmark on {}\n", r.backend);
  out += fmt::format(
      "workload: {} layers x {} tensors x {} = {} offloaded and reloaded per step, prefetch "
      "depth {}; {} steps per repeat (the first a warm-up) x {} repeats, memcpy and engine runs "
      "interleaved; figures are medians\n",
      o.layers, o.tensors_per_layer, size_text(o.tensor_bytes), to_string(Bytes(r.bytes_per_step)),
      o.prefetch_depth, o.steps, o.repeats);
  out += fmt::format(
      "correctness: every reloaded byte equal to what was written ({} compared in {} warm-up "
      "steps); in the timed steps the compute writes and checks the end words of each tensor "
      "({} tensors), so that it does not compete with the copies for memory bandwidth\n\n",
      to_string(Bytes(r.bytes_checked)), o.repeats, r.stamps_checked);

  const std::string limit = o.cuda ? "link" : "memcpy";
  out += fmt::format("{:<34} {:>10} {:>18} {:>7}  {:<22} {}\n", "", "measured",
                     fmt::format("baseline ({})", r.limit), "ratio", "target", "");
  out += fmt::format("{:<34} {:>10.2f} {:>18.2f} {:>7.3f}  {:<22} {}\n", "offload (D2H) GB/s",
                     r.offload_gbps, r.limit_d2h_gbps, r.offload_ratio,
                     fmt::format(">= {:.2f} x {}", r.target_ratio, limit),
                     verdict(r.offload_ratio >= r.target_ratio));
  out += fmt::format("{:<34} {:>10.2f} {:>18.2f} {:>7.3f}  {:<22} {}\n", "reload (H2D) GB/s",
                     r.reload_gbps, r.limit_h2d_gbps, r.reload_ratio,
                     fmt::format(">= {:.2f} x {}", r.target_ratio, limit),
                     verdict(r.reload_ratio >= r.target_ratio));
  out += fmt::format("{:<34} {:>10.3f} {:>18} {:>7}  {:<22} {}\n", "CPU overhead us/tensor",
                     r.overhead_us_per_tensor, "-", "-",
                     fmt::format("< {:.1f} us", r.target_overhead_us),
                     verdict(r.meets_overhead_target()));
  out += fmt::format("{:<34} {:>10} {:>18} {:>7}  {:<22} {}\n", "device allocations, steady state",
                     r.allocations_steady_state, "-", "-", "0",
                     verdict(r.allocations_steady_state == 0));
  out += "\n";
  out += fmt::format(
      "GB/s: 1e9 bytes copied per second, each byte counted once (the memory traffic, one read "
      "and one write per byte, is twice that). {}: {} of the same {} in {} chunks{}. "
      "offload/reload: the engine's StepTelemetry d2h_gbps/h2d_gbps, bytes over the time the "
      "copy engine was busy with them (the sum of each layer's first-copy-start to "
      "last-copy-end).\n",
      r.limit,
      o.cuda ? "pinned host <-> device copies on copy streams of the device's own" : "std::memcpy",
      to_string(Bytes(r.bytes_per_step)), size_text(o.tensor_bytes),
      o.cuda ? ", each direction alone" : " between two pre-touched buffers, single thread");
  out += fmt::format(
      "overhead: host time inside offload {:.3f} + reload {:.3f} + free {:.3f} + prefetch and "
      "end_forward_layer {:.3f} us per tensor (allocate, not counted: {:.3f} us), steady_clock "
      "around each call, {} tensors of {} per step with no compute, so no call waits for a "
      "copy. The whole loop: {:.3f} us per tensor wall, {:.3f} us host-thread CPU time (wall "
      "above CPU: the thread was descheduled).\n",
      r.offload_us, r.reload_us, r.free_us, r.layer_calls_us, r.allocate_us,
      r.overhead_tensors_per_step, size_text(o.overhead_tensor_bytes), r.loop_wall_us,
      r.loop_cpu_us);
  const auto list = [](const std::vector<double>& v) {
    std::string s;
    for (double x : v) s += fmt::format("{}{:.2f}", s.empty() ? "" : " ", x);
    return s;
  };
  out += fmt::format("samples: {} GB/s D2H [{}] H2D [{}]; offload GB/s [{}]; reload GB/s [{}]\n",
                     r.limit, list(r.limit_d2h_samples_gbps), list(r.limit_h2d_samples_gbps),
                     list(r.offload_samples_gbps), list(r.reload_samples_gbps));
  out += fmt::format("         overhead us/tensor [{}]\n", list(r.overhead_samples_us));
  out += fmt::format(
      "steady state: {} device allocations, {} fallbacks, {:.2f} ms back-pressure (first "
      "steps: {} allocations)\n",
      r.allocations_steady_state, r.fallbacks_steady_state, r.backpressure_ms_steady_state,
      r.allocations_first_step);
  out += o.cuda ? "limit: the link between host and device, as pinned copies on the device's "
                  "own copy streams move it (the baseline above).\n"
                : "limit: the host backend's copy engines are worker threads doing memcpy, so "
                  "the limit is this machine's memcpy bandwidth (the baseline above).\n";
  return out;
}

}  // namespace spillway

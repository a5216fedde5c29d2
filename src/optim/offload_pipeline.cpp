// The bucketed optimizer-offload pipeline: see the pipeline section of spillway/optim/optim.hpp.
// Its device work (the widening of the device cast, a device bucket's norm lanes and AdamW
// step) is the backend's device operations (Note [Device operations], device.hpp), the
// same calls on every backend.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>

#include "core/stats.hpp"
#include "spillway/core/error.hpp"
#include "spillway/optim/optim.hpp"

namespace spillway::optim {

CastSite choose_cast_site(double link_gbps, double cpu_cast_gbps) {
  if (link_gbps <= 0.0 || cpu_cast_gbps <= 0.0) return CastSite::kDevice;
  // Per element: device cast 4 / link; host cast 2 / link + 2 / cpu (bytes read).
  return 2.0 / link_gbps + 2.0 / cpu_cast_gbps < 4.0 / link_gbps ? CastSite::kHost
                                                                 : CastSite::kDevice;
}

struct OptimizerOffload::Impl {
  Device& dev;
  Stream compute;              // the caller's
  UniqueStream d2h, h2d, cpu;  // the pipeline's own (Note [Owned streams and events])
  size_t n = 0;
  std::vector<Bucket> buckets;  // the caller's: offsets into the device weights and gradients
  std::vector<size_t> local;    // per bucket: offset into the host state (CPU buckets) or the
                                // device state (device buckets)
  std::vector<size_t> lane_at;  // per device bucket: offset of its lane sums
  size_t n_cpu = 0, n_dev = 0, n_lanes = 0;
  OptimOffloadOptions opt;
  CastSite site = CastSite::kDevice;
  int64_t retries = 0;
  // Device memory.
  uint16_t* w_dev = nullptr;  // (n) bf16 weights
  bool owns_w_dev = true;     // false: the caller's (OptimOffloadOptions::device_weights)
  bool owns_g_dev = true;
  uint16_t* g_dev = nullptr;  // (n) bf16 gradients
  float* g32_dev = nullptr;   // (n_cpu) fp32 gradients (device cast only)
  float* p_dev = nullptr;     // (n_dev) device buckets' state
  float* m_dev = nullptr;
  float* v_dev = nullptr;
  double* lanes_dev = nullptr;  // (n_lanes) device buckets' norm lane sums
  // Pinned host memory.
  float* p = nullptr;                // (n_cpu) fp32 master weights
  float* m = nullptr;                // (n_cpu)
  float* v = nullptr;                // (n_cpu)
  void* g_stage = nullptr;           // (n_cpu) gradients as copied, read by the step: fp32 or bf16
  uint16_t* w_stage = nullptr;       // (n) bf16 weights to upload, written by the step
  double* lanes_host = nullptr;      // (n_lanes)
  std::vector<char> device_arrived;  // per device bucket, this step
  double cpu_ms = 0.0;       // bucket steps on the cpu stream this step (read after synchronize)
  double last_cpu_ms = 0.0;  // the last step's, with its end_step
  std::vector<UniqueEvent> copied, stepped;  // per bucket
  UniqueEvent produced, done;
  std::unique_ptr<StvAdamW> stv;

  Impl(Device& d, Stream c) : dev(d), compute(c) {}

  bool on_device(int b) const { return b < opt.device_buckets; }

  void* alloc(size_t bytes, MemoryKind kind, const char* what) {
    AllocResult r = dev.allocate(std::max<size_t>(bytes, 1), kind);
    if (!r)
      SPILLWAY_INPUT_ERROR("optimizer offload: cannot allocate {} ({} bytes of {}): {}", what,
                           bytes, to_string(kind), r.reason);
    return r.ptr;
  }

  // Device work on the compute stream: the backend's device operation `op` (Note [Device
  // operations]); its failure, or its absence, is an error naming the work and the bucket.
  template <typename Args>
  void device_op(bool (Device::*op)(const Args&, Stream), const Args& args, const char* what,
                 int bucket) {
    bool offered = false;
    try {
      offered = (dev.*op)(args, compute);
    } catch (const Error& e) {
      throw Error(fmt::format("optimizer offload: {} of bucket {} on {}: {}", what, bucket,
                              dev.name(), e.what()));
    }
    if (!offered)
      throw Error(
          fmt::format("optimizer offload: {} of bucket {} on {}: the backend has no "
                      "such device operation",
                      what, bucket, dev.name()));
  }

  // Note [Optimizer copy failures]: retried after the copies in flight, then reported.
  void copy_with_retry(void* dst, const void* src, size_t bytes, Stream s, int bucket) {
    for (int attempt = 0;; ++attempt) {
      try {
        dev.copy_async(dst, src, bytes, s);
        return;
      } catch (const Error& e) {
        if (attempt >= opt.max_retries) {
          throw Error(fmt::format(
              "optimizer offload: the gradient copy of bucket {} failed {} times ({}); the "
              "step is abandoned and no bucket is updated from it",
              bucket, attempt + 1, e.what()));
        }
        ++retries;
        dev.synchronize(s);  // stall: let the copies in flight drain, then retry
      }
    }
  }

  // The bucket's bf16 weights up; `round`: from its current p first (after a skip or an
  // abandoned step), else as the step wrote them.
  void upload(int b, bool round) {
    const size_t at = local[static_cast<size_t>(b)];
    const size_t count = buckets[static_cast<size_t>(b)].n;
    if (round) {
      const float* cur = stv->state(b).p;
      for (size_t i = 0; i < count; ++i) w_stage[at + i] = float_to_bf16(cur[i]);
    }
    dev.copy_async(w_dev + buckets[static_cast<size_t>(b)].offset, w_stage + at,
                   count * sizeof(uint16_t), h2d);
  }

  // Per bucket, sized at construction: stream-ordered host work captures one pointer to its
  // job, which std::function holds without allocating (a larger capture would allocate per
  // bucket and step).
  struct Job {
    Impl* s = nullptr;
    int b = 0;
    bool absent = false;  // this step: no gradient (set before the enqueue)
  };
  std::vector<Job> jobs;
  // The CPU step of bucket b, on the cpu stream.
  void host_step(int b);

  void enqueue_cpu_bucket(int b);
  void enqueue_device_bucket(int b);
  void step_device_bucket(int b, float scale, int64_t t);
  [[noreturn]] void abandon_step(const Error& e);
};

OptimizerOffload::OptimizerOffload(Device& dev, Stream compute, const float* weights, size_t n,
                                   std::vector<Bucket> buckets, const OptimOffloadOptions& o,
                                   AdamW* pool)
    : impl_(std::make_unique<Impl>(dev, compute)) {
  Impl& s = *impl_;
  s.n = n;
  s.buckets = std::move(buckets);
  s.opt = o;
  s.site = o.cast == CastSite::kAuto ? choose_cast_site(o.link_gbps, o.cpu_cast_gbps) : o.cast;
  const int nb = static_cast<int>(s.buckets.size());
  if (o.device_buckets < 0 || o.device_buckets > nb)
    SPILLWAY_FIELD_ERROR("device_buckets", o.device_buckets, "must be in [0, {}] (the buckets)",
                         nb);
  // Note [Device operations]: a call with n = 0 only answers whether the backend has it.
  const bool can_cast = s.site != CastSite::kDevice || dev.widen_bf16(DeviceWidenBf16{}, compute);
  const bool can_split =
      o.device_buckets == 0 ||
      (dev.norm_lanes_bf16(DeviceNormLanes{}, compute) && dev.adamw_step(DeviceAdamW{}, compute));
  if (!can_cast || !can_split) {
    SPILLWAY_INPUT_ERROR(
        "optimizer offload on {}: the device cast needs the backend's widen_bf16 and the "
        "GPU/CPU split its norm_lanes_bf16 and adamw_step (optional device operations it does "
        "not offer); use the host cast and device_buckets = 0",
        dev.name());
  }
  // Layout: the CPU buckets packed in the host state in bucket order, the device buckets
  // packed in the device state. STV sees the CPU buckets at their host offsets and the
  // device buckets after them (it never touches their elements).
  std::vector<Bucket> stv_buckets(s.buckets.size());
  s.local.assign(s.buckets.size(), 0);
  s.lane_at.assign(s.buckets.size(), 0);
  for (int b = 0; b < nb; ++b) {
    const Bucket& k = s.buckets[static_cast<size_t>(b)];
    SPILLWAY_CHECK(k.offset + k.n <= n, "optimizer offload: bucket {} ends at {}, past {}", b,
                   k.offset + k.n, n);
    if (s.on_device(b)) {
      s.local[static_cast<size_t>(b)] = s.n_dev;
      s.lane_at[static_cast<size_t>(b)] = s.n_lanes;
      s.n_dev += k.n;
      s.n_lanes += std::min(k.n, kNormLanes);
    } else {
      s.local[static_cast<size_t>(b)] = s.n_cpu;
      s.n_cpu += k.n;
    }
  }
  for (int b = 0; b < nb; ++b) {
    const size_t at = s.local[static_cast<size_t>(b)];
    stv_buckets[static_cast<size_t>(b)] = {s.on_device(b) ? s.n_cpu + at : at,
                                           s.buckets[static_cast<size_t>(b)].n};
  }
  const size_t n_cpu = s.n_cpu, n_dev = s.n_dev;
  // Caller-owned device buffers are used as they are (and never freed here).
  s.w_dev = o.device_weights != nullptr
                ? o.device_weights
                : static_cast<uint16_t*>(s.alloc(n * 2, MemoryKind::kDevice, "the bf16 weights"));
  s.g_dev = o.device_grads != nullptr
                ? o.device_grads
                : static_cast<uint16_t*>(s.alloc(n * 2, MemoryKind::kDevice, "the bf16 gradients"));
  s.owns_w_dev = o.device_weights == nullptr;
  s.owns_g_dev = o.device_grads == nullptr;
  if (s.site == CastSite::kDevice)
    s.g32_dev = static_cast<float*>(s.alloc(n_cpu * 4, MemoryKind::kDevice, "the fp32 gradients"));
  if (n_dev > 0) {
    s.p_dev = static_cast<float*>(s.alloc(n_dev * 4, MemoryKind::kDevice, "the split's weights"));
    s.m_dev = static_cast<float*>(s.alloc(n_dev * 4, MemoryKind::kDevice, "the split's moments"));
    s.v_dev = static_cast<float*>(s.alloc(n_dev * 4, MemoryKind::kDevice, "the split's moments"));
    s.lanes_dev = static_cast<double*>(
        s.alloc(s.n_lanes * 8, MemoryKind::kDevice, "the split's norm lane sums"));
    s.lanes_host = static_cast<double*>(
        s.alloc(s.n_lanes * 8, MemoryKind::kPinnedHost, "the split's norm lane sums"));
  }
  s.p = static_cast<float*>(s.alloc(n_cpu * 4, MemoryKind::kPinnedHost, "the master weights"));
  s.m = static_cast<float*>(s.alloc(n_cpu * 4, MemoryKind::kPinnedHost, "the first moments"));
  s.v = static_cast<float*>(s.alloc(n_cpu * 4, MemoryKind::kPinnedHost, "the second moments"));
  s.g_stage = s.alloc(n_cpu * (s.site == CastSite::kDevice ? 4 : 2), MemoryKind::kPinnedHost,
                      "the gradient staging");
  // The weight staging holds every weight for the first upload; later only CPU buckets.
  s.w_stage = static_cast<uint16_t*>(s.alloc(n * 2, MemoryKind::kPinnedHost, "the weight staging"));
  s.d2h = UniqueStream(dev, StreamRole::kD2H);
  s.h2d = UniqueStream(dev, StreamRole::kH2D);
  s.cpu = UniqueStream(dev, StreamRole::kCompute);
  // The initial state: host buckets packed, every weight rounded to bf16 on the device, the
  // device buckets' fp32 state uploaded through a temporary pinned buffer.
  for (int b = 0; b < nb; ++b) {
    const Bucket& k = s.buckets[static_cast<size_t>(b)];
    if (!s.on_device(b))
      std::memcpy(s.p + s.local[static_cast<size_t>(b)], weights + k.offset, k.n * sizeof(float));
  }
  std::memset(s.m, 0, n_cpu * sizeof(float));
  std::memset(s.v, 0, n_cpu * sizeof(float));
  for (size_t i = 0; i < n; ++i) s.w_stage[i] = float_to_bf16(weights[i]);
  dev.copy_async(s.w_dev, s.w_stage, n * 2, s.h2d);
  if (n_dev > 0) {
    auto* tmp = static_cast<float*>(
        s.alloc(n_dev * 2 * sizeof(float), MemoryKind::kPinnedHost, "the split's initial state"));
    for (int b = 0; b < o.device_buckets; ++b) {
      const Bucket& k = s.buckets[static_cast<size_t>(b)];
      std::memcpy(tmp + s.local[static_cast<size_t>(b)], weights + k.offset, k.n * sizeof(float));
    }
    std::memset(tmp + n_dev, 0, n_dev * sizeof(float));
    dev.copy_async(s.p_dev, tmp, n_dev * 4, s.h2d);
    dev.copy_async(s.m_dev, tmp + n_dev, n_dev * 4, s.h2d);
    dev.copy_async(s.v_dev, tmp + n_dev, n_dev * 4, s.h2d);
    dev.synchronize(s.h2d);
    dev.free(tmp, MemoryKind::kPinnedHost);
  }
  dev.synchronize(s.h2d);
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    s.copied.emplace_back(dev);
    s.stepped.emplace_back(dev);
  }
  s.device_arrived.assign(s.buckets.size(), 0);
  s.jobs.resize(s.buckets.size());
  for (int b = 0; b < nb; ++b) s.jobs[static_cast<size_t>(b)] = {&s, b};
  s.produced = UniqueEvent(dev);
  s.done = UniqueEvent(dev);
  s.stv = std::make_unique<StvAdamW>(o.hp, o.clip, s.p, s.m, s.v, n, std::move(stv_buckets),
                                     o.device_buckets, pool, o.undo_limit_bytes);
  s.stv->set_bf16_copy(s.w_stage);  // the step writes the bf16 weights in the same pass
}

OptimizerOffload::~OptimizerOffload() {
  Impl& s = *impl_;
  // A destructor must not throw (that ends the process): a stream that cannot be waited
  // for (the caller destroyed the compute stream first, or the device failed) is said,
  // and the rest is still released.
  for (Stream st : {s.d2h.get(), s.h2d.get(), s.cpu.get(), s.compute}) {
    try {
      s.dev.synchronize(st);
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "spillway: optimizer offload: waiting for stream %d at destruction: %s (the "
                   "compute stream must outlive the pipeline)\n",
                   st.id, e.what());
    }
  }
  s.copied.clear();
  s.stepped.clear();
  s.produced.reset();
  s.done.reset();
  s.d2h.reset();
  s.h2d.reset();
  s.cpu.reset();
  for (void* ptr :
       {static_cast<void*>(s.owns_w_dev ? s.w_dev : nullptr),
        static_cast<void*>(s.owns_g_dev ? s.g_dev : nullptr), static_cast<void*>(s.g32_dev),
        static_cast<void*>(s.p_dev), static_cast<void*>(s.m_dev), static_cast<void*>(s.v_dev),
        static_cast<void*>(s.lanes_dev)})
    if (ptr != nullptr) s.dev.free(ptr, MemoryKind::kDevice);
  for (void* ptr : {static_cast<void*>(s.p), static_cast<void*>(s.m), static_cast<void*>(s.v),
                    s.g_stage, static_cast<void*>(s.w_stage), static_cast<void*>(s.lanes_host)})
    if (ptr != nullptr) s.dev.free(ptr, MemoryKind::kPinnedHost);
}

uint16_t* OptimizerOffload::device_weights() const {
  return impl_->w_dev;
}
uint16_t* OptimizerOffload::device_grads() const {
  return impl_->g_dev;
}
CastSite OptimizerOffload::cast_site() const {
  return impl_->site;
}
const StvCounters& OptimizerOffload::counters() const {
  return impl_->stv->counters();
}
int64_t OptimizerOffload::step() const {
  return impl_->stv->step();
}
int64_t OptimizerOffload::retries() const {
  return impl_->retries;
}
int64_t OptimizerOffload::undo_bytes() const {
  return impl_->stv->undo_bytes();
}

OptimState OptimizerOffload::read_state() const {
  Impl& s = *impl_;
  for (Stream st : {s.compute, s.d2h.get(), s.h2d.get(), s.cpu.get()}) s.dev.synchronize(st);
  OptimState out{std::vector<float>(s.n), std::vector<float>(s.n), std::vector<float>(s.n)};
  for (int b = 0; b < static_cast<int>(s.buckets.size()); ++b) {
    const Bucket& k = s.buckets[static_cast<size_t>(b)];
    const size_t at = s.local[static_cast<size_t>(b)];
    const size_t bytes = k.n * sizeof(float);
    if (s.on_device(b)) {
      s.dev.copy_async(out.p.data() + k.offset, s.p_dev + at, bytes, s.d2h);
      s.dev.copy_async(out.m.data() + k.offset, s.m_dev + at, bytes, s.d2h);
      s.dev.copy_async(out.v.data() + k.offset, s.v_dev + at, bytes, s.d2h);
    } else {
      const StvAdamW::BucketState cur = s.stv->state(b);  // Note [Bounded undo]: either buffer
      std::memcpy(out.p.data() + k.offset, cur.p, bytes);
      std::memcpy(out.m.data() + k.offset, cur.m, bytes);
      std::memcpy(out.v.data() + k.offset, cur.v, bytes);
    }
  }
  s.dev.synchronize(s.d2h);
  return out;
}

// Note [Optimizer copy failures]: no bucket of this step is applied; the speculative
// weights already uploaded are replaced by the restored ones. The device buckets step only
// in end_step, so nothing of theirs needs undoing.
void OptimizerOffload::Impl::abandon_step(const Error& e) {
  dev.synchronize(cpu);
  dev.synchronize(h2d);
  dev.synchronize(d2h);
  stv->abort();
  std::fill(device_arrived.begin(), device_arrived.end(), 0);
  std::string also;
  try {
    for (int i = opt.device_buckets; i < static_cast<int>(buckets.size()); ++i) upload(i, true);
    dev.synchronize(h2d);
  } catch (const Error& e2) {
    also = fmt::format("; restoring the device weights failed too ({}): reload them", e2.what());
  }
  throw Error(std::string(e.what()) + also);
}

// The CPU bucket's speculative step reads the staged gradient as it came (the host cast
// widens inside the step) and writes the bf16 weights into the weight staging in the same
// pass.
void OptimizerOffload::Impl::host_step(int b) {
  const auto t0 = Clock::now();
  const size_t at = local[static_cast<size_t>(b)];
  if (jobs[static_cast<size_t>(b)].absent) {
    stv->on_absent_bucket(b);
  } else if (site == CastSite::kHost) {
    stv->on_bucket_bf16(b, static_cast<const uint16_t*>(g_stage) + at);
  } else {
    stv->on_bucket(b, static_cast<const float*>(g_stage) + at);
  }
  cpu_ms += ms_since(t0);
}

void OptimizerOffload::Impl::enqueue_device_bucket(int b) {
  const Bucket k = buckets[static_cast<size_t>(b)];
  SPILLWAY_CHECK(device_arrived[static_cast<size_t>(b)] == 0,
                 "optimizer offload: bucket {} arrived twice in one step", b);
  double* lanes = lanes_dev + lane_at[static_cast<size_t>(b)];
  const size_t width = std::min(k.n, kNormLanes);
  DeviceNormLanes op;
  op.g = g_dev + k.offset;
  op.n = k.n;
  op.lane_count = kNormLanes;  // Note [Norm lanes]: STV adds them as the CPU buckets' own
  op.lanes = lanes;
  device_op(&Device::norm_lanes_bf16, op, "the norm lane sums", b);
  dev.record(produced, compute);
  dev.wait(d2h, produced);
  copy_with_retry(lanes_host + lane_at[static_cast<size_t>(b)], lanes, width * sizeof(double), d2h,
                  b);
  device_arrived[static_cast<size_t>(b)] = 1;
}

void OptimizerOffload::Impl::enqueue_cpu_bucket(int b) {
  const Bucket k = buckets[static_cast<size_t>(b)];
  const size_t at = local[static_cast<size_t>(b)];
  const bool speculate = stv->admit(b);  // checks b; Note [Bounded undo]
  jobs[static_cast<size_t>(b)].absent = false;
  if (site == CastSite::kDevice) {
    // The device widens bf16 to fp32 before the copy: 4 bytes per element on the link.
    DeviceWidenBf16 op;
    op.src = g_dev + k.offset;
    op.dst = g32_dev + at;
    op.n = k.n;
    device_op(&Device::widen_bf16, op, "widening the gradient", b);
  }
  dev.record(produced, compute);
  dev.wait(d2h, produced);
  if (site == CastSite::kDevice) {
    copy_with_retry(static_cast<float*>(g_stage) + at, g32_dev + at, k.n * 4, d2h, b);
  } else {
    copy_with_retry(static_cast<uint16_t*>(g_stage) + at, g_dev + k.offset, k.n * 2, d2h, b);
  }
  dev.record(copied[static_cast<size_t>(b)], d2h);
  dev.wait(cpu, copied[static_cast<size_t>(b)]);
  dev.host_callback(cpu, [j = &jobs[static_cast<size_t>(b)]] { j->s->host_step(j->b); });
  if (!speculate) return;  // deferred: stepped and uploaded in end_step
  // The speculative weights go up at once (corrected at end_step on a replay or a skip).
  uint16_t* stage = w_stage + at;
  dev.record(stepped[static_cast<size_t>(b)], cpu);
  dev.wait(h2d, stepped[static_cast<size_t>(b)]);
  dev.copy_async(w_dev + k.offset, stage, k.n * 2, h2d);
}

void OptimizerOffload::Impl::step_device_bucket(int b, float scale, int64_t t) {
  const Bucket k = buckets[static_cast<size_t>(b)];
  const size_t at = local[static_cast<size_t>(b)];
  DeviceAdamW op;
  op.scalars = adamw_step_scalars(opt.hp, t);  // checks hp and t
  op.p = p_dev + at;
  op.m = m_dev + at;
  op.v = v_dev + at;
  op.g = g_dev + k.offset;
  op.grad_bf16 = true;
  op.grad_scale = scale;
  op.copy = w_dev + k.offset;
  op.n = k.n;
  device_op(&Device::adamw_step, op, "the AdamW step", b);
}

void OptimizerOffload::on_bucket_grad(int b) {
  Impl& s = *impl_;
  SPILLWAY_CHECK(b >= 0 && static_cast<size_t>(b) < s.buckets.size(),
                 "optimizer offload: unknown bucket {}", b);
  try {
    if (s.on_device(b)) {
      s.enqueue_device_bucket(b);
    } else {
      s.enqueue_cpu_bucket(b);
    }
  } catch (const Error& e) {
    s.abandon_step(e);
  }
}

void OptimizerOffload::on_bucket_absent(int b) {
  Impl& s = *impl_;
  SPILLWAY_CHECK(b >= s.opt.device_buckets && static_cast<size_t>(b) < s.buckets.size(),
                 "optimizer offload: bucket {} is not a CPU bucket", b);
  // In stream order with the arrivals, whose steps run on the cpu stream.
  s.jobs[static_cast<size_t>(b)].absent = true;
  s.dev.host_callback(s.cpu, [j = &s.jobs[static_cast<size_t>(b)]] { j->s->host_step(j->b); });
}

void OptimizerOffload::abort_step() {
  Impl& s = *impl_;
  for (Stream st : {s.cpu.get(), s.h2d.get(), s.d2h.get()}) s.dev.synchronize(st);
  s.stv->abort();
  std::fill(s.device_arrived.begin(), s.device_arrived.end(), 0);
  for (int b = s.opt.device_buckets; b < static_cast<int>(s.buckets.size()); ++b) s.upload(b, true);
  s.dev.record(s.done, s.h2d);
  s.dev.wait(s.compute, s.done);
  s.cpu_ms = 0.0;
}

double OptimizerOffload::arrived_cpu_sum_of_squares() const {
  Impl& s = *impl_;
  s.dev.synchronize(s.cpu);  // the steps of the buckets handed over, and their sums
  return s.stv->arrived_sum_of_squares();
}

void OptimizerOffload::set_hparams(int b, const AdamWParams& hp) {
  Impl& s = *impl_;
  SPILLWAY_CHECK(b >= s.opt.device_buckets && static_cast<size_t>(b) < s.buckets.size(),
                 "optimizer offload: bucket {} is not a CPU bucket", b);
  s.stv->set_hparams(b, hp);
}

int64_t OptimizerOffload::bucket_step(int b) const {
  return impl_->stv->bucket_step(b);
}

void OptimizerOffload::read_bucket(int b, float* p, float* m, float* v) const {
  Impl& s = *impl_;
  SPILLWAY_CHECK(b >= s.opt.device_buckets && static_cast<size_t>(b) < s.buckets.size(),
                 "optimizer offload: bucket {} is not a CPU bucket", b);
  s.dev.synchronize(s.cpu);
  const StvAdamW::BucketState cur = s.stv->state(b);
  const size_t bytes = s.buckets[static_cast<size_t>(b)].n * sizeof(float);
  std::memcpy(p, cur.p, bytes);
  std::memcpy(m, cur.m, bytes);
  std::memcpy(v, cur.v, bytes);
}

void OptimizerOffload::write_bucket(int b, const float* p, const float* m, const float* v,
                                    int64_t step) {
  Impl& s = *impl_;
  SPILLWAY_CHECK(b >= s.opt.device_buckets && static_cast<size_t>(b) < s.buckets.size(),
                 "optimizer offload: bucket {} is not a CPU bucket", b);
  for (Stream st : {s.cpu.get(), s.h2d.get()}) s.dev.synchronize(st);
  s.stv->set_bucket_step(b, step);  // checks that no step is in flight
  const StvAdamW::BucketState cur = s.stv->state(b);
  const size_t bytes = s.buckets[static_cast<size_t>(b)].n * sizeof(float);
  std::memcpy(cur.p, p, bytes);
  std::memcpy(cur.m, m, bytes);
  std::memcpy(cur.v, v, bytes);
  s.upload(b, true);
  s.dev.record(s.done, s.h2d);
  s.dev.wait(s.compute, s.done);
}

float OptimizerOffload::last_scale() const {
  return impl_->stv->last_scale();
}

double OptimizerOffload::last_cpu_ms() const {
  return impl_->last_cpu_ms;
}

// The device buckets' lane sums (down by now) handed to STV, once per step.
void OptimizerOffload::fold_device_sums() {
  Impl& s = *impl_;
  for (int b = 0; b < s.opt.device_buckets; ++b) {
    if (s.device_arrived[static_cast<size_t>(b)] == 0) continue;  // finish() reports it
    s.stv->on_device_bucket(b, add_lane_sums(s.lanes_host + s.lane_at[static_cast<size_t>(b)],
                                             s.buckets[static_cast<size_t>(b)].n));
  }
  std::fill(s.device_arrived.begin(), s.device_arrived.end(), 0);
}

double OptimizerOffload::sum_of_squares() {
  Impl& s = *impl_;
  s.dev.synchronize(s.cpu);
  s.dev.synchronize(s.d2h);
  fold_device_sums();
  return s.stv->sum_of_squares();
}

StvOutcome OptimizerOffload::end_step(std::optional<double> global_sum_of_squares) {
  Impl& s = *impl_;
  s.dev.synchronize(s.cpu);
  s.dev.synchronize(s.h2d);
  s.dev.synchronize(s.d2h);
  const auto t0 = Clock::now();
  fold_device_sums();
  const StvOutcome outcome =
      global_sum_of_squares ? s.stv->finish(*global_sum_of_squares) : s.stv->finish();
  if (outcome != StvOutcome::kSkip) {
    // The device buckets step now, on the compute stream, writing their bf16 weights.
    for (int b = 0; b < s.opt.device_buckets; ++b) {
      try {
        s.step_device_bucket(b, s.stv->last_scale(), s.stv->step());
      } catch (const Error& e) {
        throw Error(fmt::format(
            "{}; step {} is applied to the CPU buckets and to device buckets below {} only: "
            "the optimizer state is inconsistent, restore it from a checkpoint",
            e.what(), s.stv->step(), b));
      }
    }
  }
  // CPU buckets whose weights changed after their upload: all of them on a replay or a
  // skip, the deferred ones on a commit.
  for (int b = s.opt.device_buckets; b < static_cast<int>(s.buckets.size()); ++b) {
    if (outcome != StvOutcome::kCommit || s.stv->stepped_late(b))
      s.upload(b, outcome == StvOutcome::kSkip);
  }
  s.dev.record(s.done, s.h2d);
  s.dev.wait(s.compute, s.done);
  s.last_cpu_ms = s.cpu_ms + ms_since(t0);
  s.cpu_ms = 0.0;
  return outcome;
}

}  // namespace spillway::optim

// The bucketed optimizer-offload pipeline: see offload_pipeline.hpp.
#include "optim/offload_pipeline.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "spillway/error.hpp"
#ifdef SPILLWAY_HAVE_CUDA
#include "optim/cuda/adamw_kernels.hpp"
#endif

namespace spillway::optim {

CastSite choose_cast_site(double link_gbps, double cpu_cast_gbps) {
  if (link_gbps <= 0.0 || cpu_cast_gbps <= 0.0) return CastSite::kDevice;
  // Per element: device cast 4 / link; host cast 2 / link + 2 / cpu (bytes read).
  return 2.0 / link_gbps + 2.0 / cpu_cast_gbps < 4.0 / link_gbps ? CastSite::kHost
                                                                 : CastSite::kDevice;
}

struct OptimizerOffload::Impl {
  Device& dev;
  Stream compute, d2h, h2d, cpu;
  size_t n = 0;
  std::vector<Bucket> buckets;
  OptimOffloadOptions opt;
  CastSite site = CastSite::kDevice;
  int64_t retries = 0;
  // Device memory.
  uint16_t* w_dev = nullptr;  // (n) bf16 weights
  uint16_t* g_dev = nullptr;  // (n) bf16 gradients
  float* g32_dev = nullptr;   // (n) fp32 gradients (device cast only)
  // Pinned host memory.
  float* p = nullptr;           // (n) fp32 master weights
  float* m = nullptr;           // (n)
  float* v = nullptr;           // (n)
  void* g_stage = nullptr;      // (n) gradients as copied: fp32 or bf16
  float* g32_host = nullptr;    // (n) fp32 gradients the step reads (host cast: widened here)
  uint16_t* w_stage = nullptr;  // (n) bf16 weights to upload
  std::vector<Event> copied, stepped, uploaded;  // per bucket
  Event produced{-1}, done{-1};
  std::unique_ptr<StvAdamW> stv;

  Impl(Device& d, Stream c) : dev(d), compute(c) {}

  void* alloc(size_t bytes, MemoryKind kind, const char* what) {
    AllocResult r = dev.allocate(std::max<size_t>(bytes, 1), kind);
    if (!r)
      SPILLWAY_INPUT_ERROR("optimizer offload: cannot allocate {} ({} bytes of {}): {}", what,
                           bytes, to_string(kind), r.reason);
    return r.ptr;
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

  void upload(int b) {
    const Bucket& k = buckets[static_cast<size_t>(b)];
    for (size_t i = 0; i < k.n; ++i) w_stage[k.offset + i] = float_to_bf16(p[k.offset + i]);
    dev.copy_async(w_dev + k.offset, w_stage + k.offset, k.n * sizeof(uint16_t), h2d);
  }
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
  if (!dev.emulated() && o.device_buckets > 0) {
    SPILLWAY_INPUT_ERROR(
        "optimizer offload on {}: the split's device-side AdamW is not wired to the pipeline "
        "yet (src/optim/cuda has the kernel); use device_buckets = 0",
        dev.name());
  }
  if (!dev.emulated() && s.site == CastSite::kDevice && dev.native_stream(compute) == nullptr) {
    SPILLWAY_INPUT_ERROR(
        "optimizer offload on {}: the device cast needs a backend that launches kernels; use "
        "the host cast",
        dev.name());
  }
  s.w_dev = static_cast<uint16_t*>(s.alloc(n * 2, MemoryKind::kDevice, "the bf16 weights"));
  s.g_dev = static_cast<uint16_t*>(s.alloc(n * 2, MemoryKind::kDevice, "the bf16 gradients"));
  if (s.site == CastSite::kDevice)
    s.g32_dev = static_cast<float*>(s.alloc(n * 4, MemoryKind::kDevice, "the fp32 gradients"));
  s.p = static_cast<float*>(s.alloc(n * 4, MemoryKind::kPinnedHost, "the master weights"));
  s.m = static_cast<float*>(s.alloc(n * 4, MemoryKind::kPinnedHost, "the first moments"));
  s.v = static_cast<float*>(s.alloc(n * 4, MemoryKind::kPinnedHost, "the second moments"));
  s.g_stage = s.alloc(n * (s.site == CastSite::kDevice ? 4 : 2), MemoryKind::kPinnedHost,
                      "the gradient staging");
  s.g32_host = s.site == CastSite::kDevice
                   ? static_cast<float*>(s.g_stage)
                   : static_cast<float*>(s.alloc(n * 4, MemoryKind::kHost, "the fp32 gradients"));
  s.w_stage = static_cast<uint16_t*>(s.alloc(n * 2, MemoryKind::kPinnedHost, "the weight staging"));
  std::memcpy(s.p, weights, n * sizeof(float));
  std::memset(s.m, 0, n * sizeof(float));
  std::memset(s.v, 0, n * sizeof(float));
  for (size_t i = 0; i < n; ++i) s.w_stage[i] = float_to_bf16(s.p[i]);
  s.d2h = dev.create_stream(StreamRole::kD2H);
  s.h2d = dev.create_stream(StreamRole::kH2D);
  s.cpu = dev.create_stream(StreamRole::kCompute);
  dev.copy_async(s.w_dev, s.w_stage, n * 2, s.h2d);
  dev.synchronize(s.h2d);
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    s.copied.push_back(dev.create_event());
    s.stepped.push_back(dev.create_event());
  }
  s.produced = dev.create_event();
  s.done = dev.create_event();
  s.stv =
      std::make_unique<StvAdamW>(o.hp, o.clip, s.p, s.m, s.v, n, s.buckets, o.device_buckets, pool);
}

OptimizerOffload::~OptimizerOffload() {
  Impl& s = *impl_;
  for (Stream st : {s.d2h, s.h2d, s.cpu}) s.dev.synchronize(st);
  for (Event e : s.copied) s.dev.destroy_event(e);
  for (Event e : s.stepped) s.dev.destroy_event(e);
  s.dev.destroy_event(s.produced);
  s.dev.destroy_event(s.done);
  for (Stream st : {s.d2h, s.h2d, s.cpu}) s.dev.destroy_stream(st);
  s.dev.free(s.w_dev, MemoryKind::kDevice);
  s.dev.free(s.g_dev, MemoryKind::kDevice);
  if (s.g32_dev != nullptr) s.dev.free(s.g32_dev, MemoryKind::kDevice);
  for (void* ptr : {static_cast<void*>(s.p), static_cast<void*>(s.m), static_cast<void*>(s.v),
                    s.g_stage, static_cast<void*>(s.w_stage)})
    s.dev.free(ptr, MemoryKind::kPinnedHost);
  if (s.site != CastSite::kDevice) s.dev.free(s.g32_host, MemoryKind::kHost);
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
const float* OptimizerOffload::master_weights() const {
  return impl_->p;
}

void OptimizerOffload::on_bucket_grad(int b) {
  Impl& s = *impl_;
  SPILLWAY_CHECK(b >= 0 && static_cast<size_t>(b) < s.buckets.size(),
                 "optimizer offload: unknown bucket {}", b);
  const Bucket k = s.buckets[static_cast<size_t>(b)];
  if (s.site == CastSite::kDevice) {
    // The device widens bf16 to fp32: a kernel where the backend launches kernels, else
    // (the host backend) the same on its host-addressable memory, in stream order.
    uint16_t* src = s.g_dev + k.offset;
    float* dst = s.g32_dev + k.offset;
    void* native = s.dev.native_stream(s.compute);
    if (native != nullptr) {
#ifdef SPILLWAY_HAVE_CUDA
      const std::string err = cuda::launch_widen_bf16(src, dst, k.n, native);
#else
      const std::string err = "built without the CUDA kernels";
#endif
      if (!err.empty())
        throw Error(
            fmt::format("optimizer offload: widening bucket {} on {}: {}", b, s.dev.name(), err));
    } else {
      s.dev.host_callback(s.compute, [src, dst, n = k.n] {
        for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
      });
    }
  }
  s.dev.record(s.produced, s.compute);
  s.dev.wait(s.d2h, s.produced);
  try {
    if (s.site == CastSite::kDevice) {
      s.copy_with_retry(static_cast<float*>(s.g_stage) + k.offset, s.g32_dev + k.offset, k.n * 4,
                        s.d2h, b);
    } else {
      s.copy_with_retry(static_cast<uint16_t*>(s.g_stage) + k.offset, s.g_dev + k.offset, k.n * 2,
                        s.d2h, b);
    }
  } catch (const Error& e) {
    // Note [Optimizer copy failures]: no bucket of this step is applied; the speculative
    // weights already uploaded are replaced by the restored ones.
    s.dev.synchronize(s.cpu);
    s.dev.synchronize(s.h2d);
    s.stv->abort();
    std::string also;
    try {
      for (int i = 0; i < static_cast<int>(s.buckets.size()); ++i) s.upload(i);
      s.dev.synchronize(s.h2d);
    } catch (const Error& e2) {
      also = fmt::format("; restoring the device weights failed too ({}): reload them", e2.what());
    }
    throw Error(std::string(e.what()) + also);
  }
  s.dev.record(s.copied[static_cast<size_t>(b)], s.d2h);
  s.dev.wait(s.cpu, s.copied[static_cast<size_t>(b)]);
  StvAdamW* stv = s.stv.get();
  const bool widen = s.site == CastSite::kHost;
  const uint16_t* g16 = static_cast<const uint16_t*>(s.g_stage) + k.offset;
  float* g32 = s.g32_host + k.offset;
  s.dev.host_callback(s.cpu, [stv, b, widen, g16, g32, n = k.n] {
    if (widen)
      for (size_t i = 0; i < n; ++i) g32[i] = bf16_to_float(g16[i]);
    stv->on_bucket(b, g32);
  });
  if (b >= s.opt.device_buckets) {
    // The speculative weights go up at once (corrected at end_step on a replay or a skip).
    float* p = s.p + k.offset;
    uint16_t* stage = s.w_stage + k.offset;
    s.dev.host_callback(s.cpu, [p, stage, n = k.n] {
      for (size_t i = 0; i < n; ++i) stage[i] = float_to_bf16(p[i]);
    });
    s.dev.record(s.stepped[static_cast<size_t>(b)], s.cpu);
    s.dev.wait(s.h2d, s.stepped[static_cast<size_t>(b)]);
    s.dev.copy_async(s.w_dev + k.offset, stage, k.n * 2, s.h2d);
  }
}

StvOutcome OptimizerOffload::end_step() {
  Impl& s = *impl_;
  s.dev.synchronize(s.cpu);
  s.dev.synchronize(s.h2d);
  const StvOutcome outcome = s.stv->finish();
  // Device buckets stepped now; on a replay or a skip every bucket's weights changed.
  for (int b = 0; b < static_cast<int>(s.buckets.size()); ++b) {
    if (b < s.opt.device_buckets || outcome != StvOutcome::kCommit) s.upload(b);
  }
  s.dev.record(s.done, s.h2d);
  s.dev.wait(s.compute, s.done);
  return outcome;
}

}  // namespace spillway::optim

namespace spillway::optim {

SplitChoice choose_device_buckets(const std::vector<BucketTiming>& arrival_order,
                                  double backward_ms, int64_t free_hbm_bytes) {
  const int nb = static_cast<int>(arrival_order.size());
  auto end_with = [&](int device) {
    // The first nb - device to arrive go through the CPU, one at a time.
    double cpu_end = 0.0;
    for (int i = 0; i < nb - device; ++i) {
      const BucketTiming& b = arrival_order[static_cast<size_t>(i)];
      cpu_end = std::max(cpu_end, b.arrive_ms) + b.cpu_ms;
    }
    double device_end = backward_ms;
    for (int i = nb - device; i < nb; ++i)
      device_end += arrival_order[static_cast<size_t>(i)].device_ms;
    return std::max({backward_ms, cpu_end, device_end});
  };
  SplitChoice c;
  c.cpu_only_ms = end_with(0);
  c.end_ms = c.cpu_only_ms;
  int64_t hbm = 0;
  for (int device = 1; device <= nb; ++device) {
    hbm += arrival_order[static_cast<size_t>(nb - device)].state_bytes;
    if (hbm > free_hbm_bytes) break;
    const double e = end_with(device);
    if (e < c.end_ms) {
      c.end_ms = e;
      c.device_buckets = device;
    }
  }
  return c;
}

}  // namespace spillway::optim

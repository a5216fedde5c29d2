// Caller-owned memory in the activation offload engine, on the host backend: borrowed
// offloads (the source stays the caller's and its event orders reuse) and reloads into
// caller memory (direct, staged and kept paths; Note [Reload into caller memory]), beside
// the owned mode, bitwise, with random data (printed seed) and poisoned destinations
// (every byte poisoned to the complement of what must land, guard bytes after it); the
// in-flight bound measured by the device, not by the engine; no allocation in steady
// state; the pinned-pool-full fallback; OffloadHooks through CompositeHooks.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "d2h_meter.hpp"
#include "forwarding_device.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/hooks.hpp"
#include "spillway/offload/offload.hpp"
#include "test_support.hpp"
#include "virtual_clock_device.hpp"

namespace spillway {
namespace {

constexpr size_t kGuard = 64;  // bytes after each caller destination that must stay intact
constexpr unsigned char kGuardByte = 0x5a;
constexpr unsigned char kSourcePoison = 0xee;
const char* const kNames[] = {"mlp.gate_out", "mlp.up_out", "mlp.act", "attn.input"};

int64_t allocations(const Device& dev) {
  const MemoryStats s = dev.memory_stats();
  int64_t n = 0;
  for (int k = 0; k < kMemoryKinds; ++k) n += s.allocations[k];
  return n;
}

void* must_allocate(Device& dev, size_t bytes) {
  const AllocResult a = dev.allocate(bytes, MemoryKind::kDevice);
  if (!a) throw Error("test: " + a.reason);
  return a.ptr;
}

void fill_random(std::vector<unsigned char>& v, size_t bytes, std::mt19937& rng) {
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<unsigned char>(rng());
}

// The caller's compute: every write to and read of caller memory is a callback on the
// compute stream, so only the engine's events order it against the copies.
struct Compute {
  Device& dev;
  Stream s;
  std::atomic<int> bad{0};      // tensors whose bytes (or guard) were wrong
  std::atomic<int> checked{0};  // tensors checked

  void produce(void* dst, const std::vector<unsigned char>* v, size_t bytes) {
    dev.host_callback(s, [dst, v, bytes] { std::memcpy(dst, v->data(), bytes); });
  }
  // Every byte the complement of what must land there, then the guard.
  void poison(void* dst, const std::vector<unsigned char>* v, size_t bytes) {
    dev.host_callback(s, [dst, v, bytes] {
      auto* b = static_cast<unsigned char*>(dst);
      for (size_t i = 0; i < bytes; ++i) b[i] = static_cast<unsigned char>(~(*v)[i]);
      std::memset(b + bytes, kGuardByte, kGuard);
    });
  }
  void overwrite(void* dst, size_t bytes) {
    dev.host_callback(s, [dst, bytes] { std::memset(dst, kSourcePoison, bytes); });
  }
  void check(const void* p, const std::vector<unsigned char>* v, size_t bytes, bool guarded) {
    dev.host_callback(s, [this, p, v, bytes, guarded] {
      const auto* b = static_cast<const unsigned char*>(p);
      bool ok = std::memcmp(b, v->data(), bytes) == 0;
      for (size_t i = 0; guarded && i < kGuard; ++i) ok = ok && b[bytes + i] == kGuardByte;
      if (!ok) ++bad;
      ++checked;
    });
  }
};

// How a test hands tensors over and gets them back.
struct Mode {
  const char* name;
  bool borrowed;         // offload_borrowed() of caller memory (else offload() of an engine block)
  bool into;             // reload_into() caller memory (else reload() + free())
  bool targeted;         // set_reload_target() before prefetch() issues the reload
  bool batched = false;  // a layer's targets in one set_reload_targets() call
  int copy_batch = 1;    // OffloadOptions::copy_batch (Note [Copies in batches])
};
constexpr Mode kModes[] = {
    {"owned", false, false, false},
    {"owned_into", false, true, false},
    {"owned_targeted", false, true, true},
    {"borrowed", true, false, false},
    {"borrowed_into", true, true, false},
    {"borrowed_targeted", true, true, true},
    {"owned_batched", false, true, true, true},
    {"borrowed_batched", true, true, true, true},
    // Copies in batches of 3 among a layer's 4 tensors: one batch full, one at its end.
    {"owned_copies_in_batches", false, true, true, true, 3},
    {"borrowed_copies_in_batches", true, true, true, true, 3},
};

// A training loop over caller memory allocated once: one source buffer per tensor index,
// reused by every layer (a framework's allocator recycles it as soon as the copy's event
// allows), and prefetch_depth + 1 sets of destinations (a set is in use by a layer's
// backward while the next layers' reloads land in the others).
class Loop {
 public:
  Loop(Device& dev, Stream compute, Mode mode, int layers, int per_layer, size_t max_bytes,
       int depth, const OffloadOptions& o)
      : c{dev, compute},
        mode_(mode),
        layers_(layers),
        per_layer_(per_layer),
        max_bytes_(max_bytes),
        depth_(depth),
        engine_(dev, compute, policy(layers, depth), with_batch(o, mode.copy_batch)) {
    for (int k = 0; k < per_layer; ++k) sources_.push_back(must_allocate(dev, max_bytes));
    for (int k = 0; k < (depth + 1) * per_layer; ++k)
      dsts_.push_back(must_allocate(dev, max_bytes + kGuard));
    tensors_.resize(static_cast<size_t>(layers * per_layer));
    for (Tensor& t : tensors_) t.expected.resize(max_bytes);
  }
  ~Loop() {
    c.dev.synchronize(c.s);
    for (void* p : sources_) c.dev.free(p, MemoryKind::kDevice);
    for (void* p : dsts_) c.dev.free(p, MemoryKind::kDevice);
  }

  void* source(int k) const { return sources_[static_cast<size_t>(k)]; }

  // One step; data from `seed`. Borrowed sources are reused as soon as their event allows:
  // even indices by the compute stream waiting on it, odd ones by the host synchronizing
  // on it and overwriting at once; after the forward every source is overwritten.
  StepTelemetry step(uint32_t seed) {
    std::mt19937 rng(seed);
    OffloadEngine& e = engine_;
    // The data first, so that the forward runs at the pace of the engine's calls.
    for (int l = 0; l < layers_; ++l) {
      for (int k = 0; k < per_layer_; ++k) {
        Tensor& t = tensor(l, k);
        t.bytes = 1 + rng() % max_bytes_;  // odd sizes included, from 1 byte
        fill_random(t.expected, t.bytes, rng);
      }
    }
    e.begin_step();
    // Per source, the handle that last borrowed it: its copy's event orders the reuse.
    std::vector<OffloadHandle> last(static_cast<size_t>(per_layer_), -1);
    for (int l = 0; l < layers_; ++l) {
      for (int k = 0; k < per_layer_; ++k) {
        Tensor& t = tensor(l, k);
        t.handle = -1;
        t.targeted = false;
        const char* name = kNames[k % 4];
        if (!e.wants(l, name)) continue;
        ++offloaded;
        if (!mode_.borrowed) {
          const DeviceTensor d = e.allocate(t.bytes);
          c.produce(d.ptr, &t.expected, t.bytes);
          t.handle = e.offload(d, l, name);
          continue;
        }
        void* src = source(k);
        OffloadHandle& prev = last[static_cast<size_t>(k)];
        if (prev >= 0) reuse(k, copy_event(prev));
        c.produce(src, &t.expected, t.bytes);
        const BorrowedOffload b = e.offload_borrowed(src, t.bytes, l, name);
        EXPECT_FALSE(b.kept) << "layer " << l << " tensor " << k;
        if (!e.copied(b.handle)) ++pending_at_offload;
        if (mode_.copy_batch == 1) {
          EXPECT_EQ(b.copied.id, e.copy_event(b.handle).id) << "the event, at once";
        }
        prev = b.handle;
        t.handle = b.handle;
      }
      e.end_forward_layer(l);
    }
    for (int k = 0; k < per_layer_ && mode_.borrowed; ++k) {
      if (last[static_cast<size_t>(k)] < 0) continue;
      c.dev.synchronize(copy_event(last[static_cast<size_t>(k)]));
      std::memset(source(k), kSourcePoison, max_bytes_);  // no reload may read a source
    }
    for (int l = layers_ - 1; l >= 0; --l) {
      if (mode_.targeted) {
        for (int q = std::max(0, l - depth_); q <= l; ++q) target_layer(q);
      }
      for (int p = 1; p <= depth_; ++p) e.prefetch(l - p);
      for (int k = 0; k < per_layer_; ++k) {
        Tensor& t = tensor(l, k);
        if (t.handle < 0) continue;
        if (!mode_.into) {
          const DeviceTensor back = e.reload(t.handle);
          c.check(back.ptr, &t.expected, t.bytes, false);
          e.free(back);
          continue;
        }
        void* dst = destination(l, k);
        if (!t.targeted) c.poison(dst, &t.expected, t.bytes);
        e.reload_into(t.handle, dst);
        c.check(dst, &t.expected, t.bytes, true);
      }
    }
    return e.end_step();
  }

  Compute c;
  int offloaded = 0;           // tensors handed over, all steps
  int pending_at_offload = 0;  // borrowed copies not yet done when offload_borrowed returned

 private:
  struct Tensor {
    std::vector<unsigned char> expected;  // (bytes) what was produced
    size_t bytes = 0;
    OffloadHandle handle = -1;
    bool targeted = false;
  };
  static OffloadOptions with_batch(OffloadOptions o, int copy_batch) {
    o.copy_batch = copy_batch;
    return o;
  }
  // The event of a borrowed source's copy, enqueued by now: its layer's forward ended
  // (Note [Copies in batches]).
  Event copy_event(OffloadHandle h) {
    const Event e = engine_.copy_event(h);
    EXPECT_GE(e.id, 0) << "handle " << h << ": its copy is enqueued once its layer ended";
    return e;
  }
  static MemoryPolicy policy(int layers, int depth) {
    MemoryPolicy p =
        MemoryPolicy::uniform(layers, {"mlp.gate_out", "mlp.up_out", "mlp.act", "attn.input"});
    p.prefetch_depth = depth;
    return p;
  }
  Tensor& tensor(int l, int k) { return tensors_[static_cast<size_t>(l * per_layer_ + k)]; }
  void* destination(int l, int k) {
    return dsts_[static_cast<size_t>((l % (depth_ + 1)) * per_layer_ + k)];
  }
  void reuse(int k, Event copied) {
    if (k % 2 == 0) {
      c.dev.wait(c.s, copied);  // stream-ordered reuse, as a caching allocator does
      c.overwrite(source(k), max_bytes_);
    } else {
      c.dev.synchronize(copied);  // the host reuses it the moment the event completes
      std::memset(source(k), kSourcePoison, max_bytes_);
    }
  }
  void target_layer(int l) {
    batch_handles_.clear();
    batch_dsts_.clear();
    for (int k = 0; k < per_layer_; ++k) {
      Tensor& t = tensor(l, k);
      if (t.handle < 0 || t.targeted) continue;
      void* dst = destination(l, k);
      c.poison(dst, &t.expected, t.bytes);  // before: the H2D copy is ordered after it
      if (mode_.batched) {
        batch_handles_.push_back(t.handle);
        batch_dsts_.push_back(dst);
      } else {
        EXPECT_TRUE(engine_.set_reload_target(t.handle, dst)) << "layer " << l << " tensor " << k;
      }
      t.targeted = true;
    }
    if (!batch_handles_.empty()) {  // Note [One fence per batch]
      EXPECT_EQ(engine_.set_reload_targets(batch_handles_.data(), batch_dsts_.data(),
                                           batch_handles_.size()),
                batch_handles_.size())
          << "layer " << l;
    }
  }
  std::vector<OffloadHandle> batch_handles_;
  std::vector<void*> batch_dsts_;

  Mode mode_;
  int layers_;
  int per_layer_;
  size_t max_bytes_;
  int depth_;
  OffloadEngine engine_;
  std::vector<void*> sources_;  // (per_layer) of max_bytes each
  std::vector<void*> dsts_;     // (depth + 1, per_layer) of max_bytes + kGuard each
  std::vector<Tensor> tensors_;
};

struct Case {
  Mode mode;
  double gbps;
  int depth;
};

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (const Mode& m : kModes)
    for (double gbps : {0.0, 1.0})
      for (int depth : {0, 1, 2}) v.push_back({m, gbps, depth});
  return v;
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.mode.name << " at " << c.gbps << " GB/s, prefetch depth " << c.depth;
}

class CallerOwnedRoundTrip : public ::testing::TestWithParam<Case> {};

TEST_P(CallerOwnedRoundTrip, EveryReloadedByteIsTheOffloadedOneAndSteadyStateAllocatesNothing) {
  const Case& k = GetParam();
  spillway::testing::make_rng();  // prints the seed
  const uint32_t seed = spillway::testing::test_seed();
  auto dev = make_host_device(HostDeviceOptions{int64_t{256} << 20, k.gbps, k.gbps});
  const Stream compute = dev->create_stream(StreamRole::kCompute);
  OffloadOptions o;
  o.pinned_bytes = int64_t{32} << 20;
  o.device_pool_bytes = int64_t{32} << 20;
  const int layers = 6, per_layer = 4;
  Loop loop(*dev, compute, k.mode, layers, per_layer, size_t{192} << 10, k.depth, o);
  const int64_t after_setup = allocations(*dev);
  for (uint32_t step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    const StepTelemetry t = loop.step(seed + step);
    EXPECT_EQ(t.tensors_offloaded, (layers - 1) * per_layer);  // the last layer is kept
    EXPECT_EQ(t.d2h_bytes, t.h2d_bytes);
    EXPECT_EQ(t.fallback_kept, 0);
    EXPECT_EQ(t.fallback_direct, 0);
    // The caller's memory was allocated before the first step: nothing in any step.
    EXPECT_EQ(t.device_allocations, 0);
    if (k.mode.targeted || !k.mode.into || k.depth == 0) {
      EXPECT_EQ(t.reloads_staged, 0) << "every reload into caller memory is direct";
    } else {
      EXPECT_GT(t.reloads_staged, 0) << "prefetched without a destination: staged";
    }
  }
  EXPECT_EQ(allocations(*dev), after_setup);
  EXPECT_EQ(loop.c.checked.load(), loop.offloaded);
  EXPECT_EQ(loop.c.bad.load(), 0) << "of " << loop.offloaded << " tensors";
  if (k.mode.borrowed && k.gbps > 0) {
    // Not vacuous: sources were reused while their copies were still pending, and only
    // the event kept the reuse behind the copy.
    EXPECT_GT(loop.pending_at_offload, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(ModesLinksDepths, CallerOwnedRoundTrip, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return std::string(i.param.mode.name) +
                                  (i.param.gbps > 0 ? "_throttled" : "_unthrottled") + "_depth" +
                                  std::to_string(i.param.depth);
                         });

TEST(CallerOwned, TheSourceMayBeOverwrittenTheMomentItsEventCompletes) {
  // 1 MiB at 0.05 GB/s: a 20 ms copy, still running when offload_borrowed() returns, on
  // the test's clock (Note [A virtual clock for windows]): it lands only once waited for,
  // however long the host takes to get to the query.
  std::mt19937 rng = spillway::testing::make_rng();
  auto inner = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  spillway::testing::VirtualClockDevice clock(*inner, 0.05);
  Device& dev = clock;
  Compute c{dev, dev.create_stream(StreamRole::kCompute)};
  OffloadOptions o;
  o.pinned_bytes = int64_t{8} << 20;
  o.device_pool_bytes = int64_t{8} << 20;
  OffloadEngine e(dev, c.s, MemoryPolicy::uniform(2, {"x", "y"}), o);
  const size_t bytes = size_t{1} << 20;
  std::vector<unsigned char> a(bytes), b(bytes);
  fill_random(a, bytes, rng);
  fill_random(b, bytes, rng);
  void* src_a = must_allocate(dev, bytes);
  void* src_b = must_allocate(dev, bytes);
  void* dst_a = must_allocate(dev, bytes + kGuard);
  void* dst_b = must_allocate(dev, bytes + kGuard);
  e.begin_step();
  c.produce(src_a, &a, bytes);
  const BorrowedOffload ha = e.offload_borrowed(src_a, bytes, 0, "x");
  c.produce(src_b, &b, bytes);
  const BorrowedOffload hb = e.offload_borrowed(src_b, bytes, 0, "y");
  ASSERT_FALSE(ha.kept);
  ASSERT_FALSE(hb.kept);
  EXPECT_FALSE(dev.query(ha.copied)) << "the copy is still running: the wait below matters";
  // The host: wait, then overwrite at once.
  dev.synchronize(ha.copied);
  std::memset(src_a, kSourcePoison, bytes);
  // The compute stream: wait on the event, then overwrite in stream order.
  dev.wait(c.s, hb.copied);
  c.overwrite(src_b, bytes);
  e.end_forward_layer(0);
  e.end_forward_layer(1);
  c.poison(dst_a, &a, bytes);
  c.poison(dst_b, &b, bytes);
  e.reload_into(ha.handle, dst_a);
  e.reload_into(hb.handle, dst_b);
  c.check(dst_a, &a, bytes, true);
  c.check(dst_b, &b, bytes, true);
  e.end_step();
  EXPECT_EQ(c.checked.load(), 2);
  EXPECT_EQ(c.bad.load(), 0);
  for (void* p : {src_a, src_b, dst_a, dst_b}) dev.free(p, MemoryKind::kDevice);
}

TEST(CallerOwned, InFlightD2HBytesNeverExceedTheBoundInEitherMode) {
  spillway::testing::make_rng();  // prints the seed
  const uint32_t seed = spillway::testing::test_seed();
  for (const Mode& m : {kModes[0], kModes[4], kModes[9]}) {
    SCOPED_TRACE(m.name);
    // 0.1 GB/s on the test's clock: the host offloads far faster than the link drains,
    // however the copy thread is scheduled (Note [A virtual clock for windows]).
    auto inner = make_host_device(HostDeviceOptions{int64_t{128} << 20, 0.0, 0.0});
    spillway::testing::VirtualClockDevice clock(*inner, 0.1);
    spillway::testing::D2HMeter dev(clock);
    const Stream compute = dev.create_stream(StreamRole::kCompute, 0);
    OffloadOptions o;
    o.pinned_bytes = int64_t{32} << 20;
    o.device_pool_bytes = int64_t{32} << 20;
    const size_t max_bytes = size_t{512} << 10;
    o.inflight_bound_bytes = int64_t{1} << 20;  // two of the largest tensors
    Loop loop(dev, compute, m, 4, 6, max_bytes, 1, o);
    const StepTelemetry t = loop.step(seed);
    EXPECT_LE(dev.max_inflight(), o.inflight_bound_bytes);
    EXPECT_GT(dev.max_inflight(), 0);
    EXPECT_GT(t.backpressure_ms, 0.0) << "the bound engaged";
    EXPECT_EQ(loop.c.checked.load(), loop.offloaded);
    EXPECT_EQ(loop.c.bad.load(), 0);
  }
}

TEST(CallerOwned, APinnedPoolFullLeavesBorrowedTensorsWithTheCaller) {
  // 1 MiB of pinned memory, 256 KiB tensors: the first few are copied, the rest are kept;
  // a kept tensor's source must stay the caller's until its reload, which reads it there.
  std::mt19937 rng = spillway::testing::make_rng();
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 1.0, 1.0});
  Compute c{*dev, dev->create_stream(StreamRole::kCompute)};
  OffloadOptions o;
  o.pinned_bytes = int64_t{1} << 20;
  o.pinned_slabs = 1;
  o.device_pool_bytes = int64_t{8} << 20;
  OffloadEngine e(*dev, c.s, MemoryPolicy::uniform(2, {"x"}), o);
  const size_t bytes = size_t{256} << 10;
  const int n = 8;
  std::vector<std::vector<unsigned char>> data(n, std::vector<unsigned char>(bytes));
  std::vector<void*> src(n), dst(n);
  for (int i = 0; i < n; ++i) {
    fill_random(data[static_cast<size_t>(i)], bytes, rng);
    src[static_cast<size_t>(i)] = must_allocate(*dev, bytes);
    dst[static_cast<size_t>(i)] = must_allocate(*dev, bytes + kGuard);
  }
  e.begin_step();
  std::vector<BorrowedOffload> h;
  for (int i = 0; i < n; ++i) {
    c.produce(src[static_cast<size_t>(i)], &data[static_cast<size_t>(i)], bytes);
    h.push_back(e.offload_borrowed(src[static_cast<size_t>(i)], bytes, 0, "x"));
  }
  e.end_forward_layer(0);
  int kept = 0;
  for (int i = 0; i < n; ++i) {
    const BorrowedOffload& b = h[static_cast<size_t>(i)];
    if (b.kept) {
      ++kept;
      EXPECT_LT(b.copied.id, 0) << "a kept tensor has no event: it is not released early";
      continue;
    }
    ASSERT_EQ(kept, 0) << "the pool fills once: the copied ones come first";
    dev->synchronize(b.copied);
    std::memset(src[static_cast<size_t>(i)], kSourcePoison, bytes);  // copied: reusable
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, n);
  // Backward, every way: reload_into a destination, reload_into the source itself (kept:
  // no copy at all), reload into the engine's pool.
  std::vector<DeviceTensor> back;
  for (int i = 0; i < n; ++i) {
    const BorrowedOffload& b = h[static_cast<size_t>(i)];
    const auto* v = &data[static_cast<size_t>(i)];
    if (i % 3 == 2) {
      const DeviceTensor t = e.reload(b.handle);
      c.check(t.ptr, v, bytes, false);
      back.push_back(t);
    } else if (i % 3 == 1 && b.kept) {
      e.reload_into(b.handle, src[static_cast<size_t>(i)]);
      c.check(src[static_cast<size_t>(i)], v, bytes, false);
    } else {
      c.poison(dst[static_cast<size_t>(i)], v, bytes);
      e.reload_into(b.handle, dst[static_cast<size_t>(i)]);
      c.check(dst[static_cast<size_t>(i)], v, bytes, true);
    }
  }
  for (const DeviceTensor& t : back) e.free(t);
  const StepTelemetry t = e.end_step();
  EXPECT_EQ(t.fallback_kept, kept);
  EXPECT_EQ(t.tensors_offloaded, n - kept);
  EXPECT_EQ(t.d2h_bytes, static_cast<int64_t>(bytes) * (n - kept));
  EXPECT_EQ(c.checked.load(), n);
  EXPECT_EQ(c.bad.load(), 0);
  for (int i = 0; i < n; ++i) {
    dev->free(src[static_cast<size_t>(i)], MemoryKind::kDevice);
    dev->free(dst[static_cast<size_t>(i)], MemoryKind::kDevice);
  }
}

TEST(CallerOwned, AnOwnedTensorKeptOnTheDeviceReloadsIntoCallerMemory) {
  std::mt19937 rng = spillway::testing::make_rng();
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  Compute c{*dev, dev->create_stream(StreamRole::kCompute)};
  OffloadOptions o;
  o.pinned_bytes = int64_t{1} << 20;
  o.pinned_slabs = 1;
  o.device_pool_bytes = int64_t{8} << 20;
  OffloadEngine e(*dev, c.s, MemoryPolicy::uniform(2, {"x"}), o);
  const size_t bytes = size_t{768} << 10;
  std::vector<std::vector<unsigned char>> data(3, std::vector<unsigned char>(bytes));
  void* dst = must_allocate(*dev, bytes + kGuard);
  e.begin_step();
  std::vector<OffloadHandle> h;
  for (auto& v : data) {
    fill_random(v, bytes, rng);
    const DeviceTensor t = e.allocate(bytes);
    c.produce(t.ptr, &v, bytes);
    h.push_back(e.offload(t, 0, "x"));
  }
  e.end_forward_layer(0);
  for (size_t i = 0; i < h.size(); ++i) {  // one destination, reused in stream order
    c.poison(dst, &data[i], bytes);
    e.reload_into(h[i], dst);
    c.check(dst, &data[i], bytes, true);
  }
  const StepTelemetry t = e.end_step();
  EXPECT_EQ(t.fallback_kept, 2);
  EXPECT_EQ(c.checked.load(), 3);
  EXPECT_EQ(c.bad.load(), 0);
  dev->free(dst, MemoryKind::kDevice);
}

// Logs every copy (destination and stream) in the order it was enqueued.
class CopyLog final : public spillway::testing::ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  struct Copy {
    void* dst;
    int stream;
  };
  std::vector<Copy> copies;
  std::vector<int> waits;    // the stream of every wait, in order
  std::vector<int> records;  // the stream of every event record, in order
  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    copies.push_back({dst, s.id});
    inner().copy_async(dst, src, bytes, s);
  }
  void wait(Stream s, Event e) override {
    waits.push_back(s.id);
    inner().wait(s, e);
  }
  void record(Event e, Stream s) override {
    records.push_back(s.id);
    inner().record(e, s);
  }
};

// The targeted-reload tests' setup: a host device logged by CopyLog, its compute stream,
// 1 MiB pools, and `n` random tensors of `bytes` with a source and a guarded destination
// each (freed at the end).
struct TargetRig {
  explicit TargetRig(int n, size_t tensor_bytes = 4096)
      : inner(make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0})),
        dev(*inner),
        c{dev, dev.create_stream(StreamRole::kCompute, 0)},
        bytes(tensor_bytes),
        data(static_cast<size_t>(n), std::vector<unsigned char>(tensor_bytes)) {
    o.pinned_bytes = int64_t{1} << 20;
    o.device_pool_bytes = int64_t{1} << 20;
    std::mt19937 rng = spillway::testing::make_rng();
    for (auto& d : data) {
      fill_random(d, bytes, rng);
      src.push_back(must_allocate(dev, bytes));
      dst.push_back(must_allocate(dev, bytes + kGuard));
    }
  }
  ~TargetRig() {
    for (void* p : src) dev.free(p, MemoryKind::kDevice);
    for (void* p : dst) dev.free(p, MemoryKind::kDevice);
  }
  TargetRig(const TargetRig&) = delete;
  TargetRig& operator=(const TargetRig&) = delete;
  // Tensor i produced on the compute stream and offloaded borrowed as `name` of `layer`.
  OffloadHandle offload(OffloadEngine& e, int i, int layer, const char* name) {
    const auto k = static_cast<size_t>(i);
    c.produce(src[k], &data[k], bytes);
    const BorrowedOffload b = e.offload_borrowed(src[k], bytes, layer, name);
    EXPECT_FALSE(b.kept) << "tensor " << i;
    return b.handle;
  }
  // Tensor i (handle h) reloaded into its destination, checked there, guard included.
  void reload(OffloadEngine& e, OffloadHandle h, int i) {
    const auto k = static_cast<size_t>(i);
    e.reload_into(h, dst[k]);
    c.check(dst[k], &data[k], bytes, true);
  }

  std::unique_ptr<Device> inner;
  CopyLog dev;
  Compute c;
  OffloadOptions o;
  size_t bytes;
  std::vector<std::vector<unsigned char>> data;
  std::vector<void*> src, dst;
};

TEST(CallerOwned, ABatchOfTargetsIsFencedOnce) {
  // Note [One fence per batch]: the targets of a layer set in one call share one fence on
  // the compute stream, and the H2D stream waits on it once; a fence recorded before one the
  // H2D stream already waits on is not waited on at all. Every byte checked.
  TargetRig r(8);
  OffloadEngine e(r.dev, r.c.s, MemoryPolicy::uniform(2, {"a", "b", "c", "d"}), r.o);
  const char* names[] = {"a", "b", "c", "d"};
  e.begin_step();
  std::vector<OffloadHandle> h;
  for (int i = 0; i < 8; ++i) {  // layer 0: tensors 0-3, layer 1: tensors 4-7
    h.push_back(r.offload(e, i, i / 4, names[i % 4]));
    if (i % 4 == 3) e.end_forward_layer(i / 4);
  }
  for (int i = 0; i < 8; ++i)
    r.c.poison(r.dst[static_cast<size_t>(i)], &r.data[static_cast<size_t>(i)], r.bytes);
  // Layer 0's targets first (fence 1), then layer 1's (fence 2).
  const int compute = r.c.s.id;
  const int h2d = e.h2d_stream().id;
  r.dev.records.clear();
  EXPECT_EQ(e.set_reload_targets(h.data(), r.dst.data(), 4), 4u);
  EXPECT_EQ(e.set_reload_targets(h.data() + 4, r.dst.data() + 4, 4), 4u);
  EXPECT_EQ(std::count(r.dev.records.begin(), r.dev.records.end(), compute), 2)
      << "one fence per batch, where set_reload_target() records one per tensor";
  EXPECT_EQ(e.set_reload_targets(h.data(), r.dst.data(), 1), 1u) << "the same target: fine";
  r.dev.waits.clear();
  r.dev.records.clear();
  e.prefetch(0);  // issues layer 1 (it waits on fence 2), then layer 0 (fence 1 is covered)
  const auto h2d_waits = std::count(r.dev.waits.begin(), r.dev.waits.end(), h2d);
  EXPECT_EQ(h2d_waits, 2) << "the last offload copy and fence 2, where it was 1 + 8";
  EXPECT_EQ(std::count(r.dev.records.begin(), r.dev.records.end(), h2d), 2)
      << "one event per layer of reloads (Note [One event per layer]), where it was 8";
  for (int i = 7; i >= 0; --i) r.reload(e, h[static_cast<size_t>(i)], i);
  const StepTelemetry t = e.end_step();
  EXPECT_EQ(r.c.bad.load(), 0);
  EXPECT_EQ(r.c.checked.load(), 8);
  EXPECT_EQ(t.reloads_staged, 0);
  void* null_dst[] = {nullptr};
  e.begin_step();
  EXPECT_THROW(e.set_reload_targets(h.data(), null_dst, 1), Error);
  e.end_step();
}

TEST(CallerOwned, CopiesInABatchShareOneFenceAndOneEvent) {
  // Note [Copies in batches]: 8 tensors in 2 layers, batches of 3: a batch is enqueued when
  // full and when its layer's forward ends, so 4 fences on compute, 4 waits and 4 events on
  // the D2H stream, where one at a time makes 8 of each. A queued copy is not copied and
  // has no event yet. Every byte checked.
  for (const int batch : {1, 3}) {
    SCOPED_TRACE(batch);
    TargetRig r(8);
    r.o.copy_batch = batch;
    OffloadEngine e(r.dev, r.c.s, MemoryPolicy::uniform(2, {"a", "b", "c", "d"}), r.o);
    const char* names[] = {"a", "b", "c", "d"};
    const int compute = r.c.s.id;
    const int d2h = e.d2h_stream().id;
    e.begin_step();
    r.dev.records.clear();
    r.dev.waits.clear();
    std::vector<OffloadHandle> h;
    for (int i = 0; i < 8; ++i) {  // layer 0: tensors 0-3, layer 1: tensors 4-7
      h.push_back(r.offload(e, i, i / 4, names[i % 4]));
      if (batch > 1 && i == 0) {
        EXPECT_FALSE(e.copied(h[0])) << "queued";
        EXPECT_LT(e.copy_event(h[0]).id, 0) << "queued: no event yet";
      }
      if (i % 4 == 3) e.end_forward_layer(i / 4);
    }
    const int copies = batch == 1 ? 8 : 4;
    EXPECT_EQ(std::count(r.dev.records.begin(), r.dev.records.end(), compute), copies);
    EXPECT_EQ(std::count(r.dev.waits.begin(), r.dev.waits.end(), d2h), copies);
    EXPECT_EQ(std::count(r.dev.records.begin(), r.dev.records.end(), d2h), copies);
    // A batch's tensors share its event: 0-2, 3, 4-6, 7.
    EXPECT_EQ(e.copy_event(h[0]).id == e.copy_event(h[2]).id, batch > 1);
    EXPECT_NE(e.copy_event(h[2]).id, e.copy_event(h[3]).id);
    for (OffloadHandle x : h) {
      const Event ev = e.copy_event(x);
      ASSERT_GE(ev.id, 0) << "handle " << x << ": enqueued once its layer ended";
      r.dev.synchronize(ev);
      EXPECT_TRUE(e.copied(x));
    }
    for (int i = 0; i < 8; ++i) {  // the sources may be reused: no reload reads them
      std::memset(r.src[static_cast<size_t>(i)], kSourcePoison, r.bytes);
      r.c.poison(r.dst[static_cast<size_t>(i)], &r.data[static_cast<size_t>(i)], r.bytes);
    }
    for (int i = 7; i >= 0; --i) r.reload(e, h[static_cast<size_t>(i)], i);
    const StepTelemetry t = e.end_step();
    EXPECT_EQ(r.c.bad.load(), 0);
    EXPECT_EQ(r.c.checked.load(), 8);
    EXPECT_EQ(t.tensors_offloaded, 8);
    EXPECT_EQ(t.d2h_bytes, t.h2d_bytes);
  }
}

TEST(CallerOwned, BatchesOfCopiesAndReloadsGiveEachEventBackOnce) {
  // A batch of copies shares one event, and so do a layer's reloads (Note [One event per
  // layer]); only the last slot gives it back, and the slots' own events (a target's) go
  // back when the shared one replaces them. With 8 slots (24 events), steps of 8 tensors in
  // batches of 3, reloads prefetched by layer (targeted on even steps, staged on odd ones),
  // an event given twice or never runs out within a few steps. Every byte checked.
  TargetRig r(8);
  r.o.copy_batch = 3;
  r.o.max_tensors = 8;
  OffloadEngine e(r.dev, r.c.s, MemoryPolicy::uniform(2, {"a", "b", "c", "d"}), r.o);
  const char* names[] = {"a", "b", "c", "d"};
  for (int step = 0; step < 8; ++step) {
    SCOPED_TRACE(step);
    e.begin_step();
    std::vector<OffloadHandle> h;
    for (int i = 0; i < 8; ++i) {
      h.push_back(r.offload(e, i, i / 4, names[i % 4]));
      if (i % 4 == 3) e.end_forward_layer(i / 4);
    }
    for (int l = 1; l >= 0; --l) {
      for (size_t k = 4 * static_cast<size_t>(l); k < 4 * static_cast<size_t>(l) + 4; ++k)
        r.c.poison(r.dst[k], &r.data[k], r.bytes);
      if (step % 2 == 0) {
        EXPECT_EQ(e.set_reload_targets(h.data() + 4 * l, r.dst.data() + 4 * l, 4), 4u);
      }
      e.prefetch(l);
      for (int i = 4 * l; i < 4 * l + 4; ++i) r.reload(e, h[static_cast<size_t>(i)], i);
    }
    const StepTelemetry t = e.end_step();
    EXPECT_EQ(t.reloads_staged, step % 2 == 0 ? 0 : 8);
  }
  EXPECT_EQ(r.c.bad.load(), 0);
  EXPECT_EQ(r.c.checked.load(), 8 * 8);
}

TEST(CallerOwned, AReloadTargetedBeforePrefetchLandsInCallerMemoryDirectly) {
  TargetRig r(4);
  CopyLog& dev = r.dev;
  Compute& c = r.c;
  const size_t bytes = r.bytes;
  std::vector<void*>& dst = r.dst;
  const auto& data = r.data;
  OffloadEngine e(dev, c.s, MemoryPolicy::uniform(3, {"x", "y"}), r.o);
  e.begin_step();
  std::vector<OffloadHandle> h;
  for (int i = 0; i < 4; ++i) {  // layer 0: x, y; layer 1: x, y
    const int l = i / 2;
    h.push_back(r.offload(e, i, l, i % 2 == 0 ? "x" : "y"));
    if (i % 2 == 1) e.end_forward_layer(l);
  }
  const size_t forward_copies = dev.copies.size();
  // Layer 1 is targeted, layer 0's x too; layer 0's y is left to the pool.
  for (int i : {3, 2, 0}) {
    c.poison(dst[static_cast<size_t>(i)], &data[static_cast<size_t>(i)], bytes);
    EXPECT_TRUE(e.set_reload_target(h[static_cast<size_t>(i)], dst[static_cast<size_t>(i)]));
  }
  e.prefetch(0);  // issues layer 1, then layer 0
  EXPECT_FALSE(e.set_reload_target(h[1], dst[1])) << "already issued into the pool";
  EXPECT_TRUE(e.set_reload_target(h[0], dst[0])) << "the same destination again: fine";
  for (int i : {2, 3, 0, 1}) {
    if (i == 1) c.poison(dst[1], &data[1], bytes);
    e.reload_into(h[static_cast<size_t>(i)], dst[static_cast<size_t>(i)]);
    c.check(dst[static_cast<size_t>(i)], &data[static_cast<size_t>(i)], bytes, true);
  }
  const StepTelemetry t = e.end_step();
  EXPECT_EQ(c.bad.load(), 0);
  EXPECT_EQ(c.checked.load(), 4);
  EXPECT_EQ(t.reloads_staged, 1);
  // Backward's copies: H2D into the targets of layer 1 then layer 0's x, H2D of layer 0's
  // y into a pool block, and one compute-stream copy of that block into its destination.
  ASSERT_EQ(dev.copies.size(), forward_copies + 5);
  const CopyLog::Copy* b = &dev.copies[forward_copies];
  const int h2d = e.h2d_stream().id;
  EXPECT_EQ(b[0].dst, dst[2]);
  EXPECT_EQ(b[1].dst, dst[3]);
  EXPECT_EQ(b[2].dst, dst[0]);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(b[i].stream, h2d) << i;
  EXPECT_NE(b[3].dst, dst[1]) << "the pool block";
  EXPECT_EQ(b[4].dst, dst[1]);
  EXPECT_EQ(b[4].stream, c.s.id);
}

TEST(CallerOwned, MisuseIsAnError) {
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  Compute c{*dev, dev->create_stream(StreamRole::kCompute)};
  OffloadOptions o;
  o.pinned_bytes = int64_t{1} << 20;
  o.device_pool_bytes = int64_t{1} << 20;
  OffloadEngine e(*dev, c.s, MemoryPolicy::uniform(2, {"x"}), o);
  void* src = must_allocate(*dev, 256);
  void* dst = must_allocate(*dev, 256);
  void* other = must_allocate(*dev, 256);
  EXPECT_THROW(e.offload_borrowed(src, 256, 0, "x"), Error);  // outside a step
  e.begin_step();
  EXPECT_THROW(e.offload_borrowed(nullptr, 256, 0, "x"), Error);
  EXPECT_THROW(e.reload_into(3, dst), Error);        // unknown handle
  EXPECT_THROW(e.set_reload_target(3, dst), Error);  // unknown handle
  EXPECT_THROW((void)e.copied(3), Error);            // unknown handle
  EXPECT_THROW((void)e.copy_event(-1), Error);
  const BorrowedOffload a = e.offload_borrowed(src, 256, 0, "x");
  const BorrowedOffload b = e.offload_borrowed(src, 256, 0, "x");
  e.end_forward_layer(0);
  EXPECT_THROW(e.reload_into(a.handle, nullptr), Error);
  EXPECT_TRUE(e.set_reload_target(a.handle, dst));
  EXPECT_THROW(e.set_reload_target(a.handle, other), Error);
  EXPECT_THROW(e.reload(a.handle), Error);  // it has a destination
  EXPECT_THROW(e.reload_into(a.handle, other), Error);
  e.reload_into(a.handle, dst);  // the failed calls took nothing
  EXPECT_THROW(e.reload_into(a.handle, dst), Error);
  e.reload_into(b.handle, other);
  EXPECT_THROW(e.set_reload_target(b.handle, other), Error);  // already reloaded
  e.end_step();
  for (void* p : {src, dst, other}) dev->free(p, MemoryKind::kDevice);
  for (int batch : {0, 1025}) {  // in [1, max_tensors]
    OffloadOptions bad = o;
    bad.copy_batch = batch;
    EXPECT_THROW(OffloadEngine(*dev, c.s, MemoryPolicy::uniform(2, {"x"}), bad), Error) << batch;
  }
}

// A hook that takes nothing: OffloadHooks sits second in the composite (owner 1).
class Bystander final : public TrainingHooks {
 public:
  int saved_calls = 0;
  SavedTicket saved(int, std::string_view, const SavedTensor&) override {
    ++saved_calls;
    return {};
  }
};

TEST(CallerOwned, OffloadHooksTakeBorrowedTensorsAndReloadIntoCallerMemory) {
  // The socket's own sequence through CompositeHooks: per layer three saved tensors, one
  // borrowed and reloaded into caller memory, one borrowed and reloaded into the hook's,
  // one given (allocated by the loop, freed by the engine) and reloaded into caller memory.
  std::mt19937 rng = spillway::testing::make_rng();
  auto dev = make_host_device(HostDeviceOptions{int64_t{128} << 20, 2.0, 2.0});
  Compute c{*dev, dev->create_stream(StreamRole::kCompute)};
  const int layers = 5, per_layer = 3;
  MemoryPolicy p = MemoryPolicy::uniform(layers, {"a", "b", "c"});
  p.prefetch_depth = 1;
  OffloadOptions o;
  o.pinned_bytes = int64_t{16} << 20;
  o.device_pool_bytes = int64_t{16} << 20;
  OffloadEngine engine(*dev, c.s, p, o);
  OffloadHooks offload(engine);
  Bystander first;
  CompositeHooks hooks({&first, &offload});
  const char* names[] = {"a", "b", "c"};
  const size_t max_bytes = size_t{128} << 10;
  std::vector<void*> src, dst;
  for (int k = 0; k < per_layer; ++k) src.push_back(must_allocate(*dev, max_bytes));
  for (int k = 0; k < per_layer; ++k) dst.push_back(must_allocate(*dev, max_bytes + kGuard));
  struct Saved {
    std::vector<unsigned char> v = std::vector<unsigned char>(size_t{128} << 10);
    size_t bytes = 0;
    SavedTicket ticket;
    void* kept = nullptr;  // not taken: the loop's own (given tensors of the last layer)
  };
  std::vector<Saved> saved(static_cast<size_t>(layers * per_layer));
  int handed = 0;
  const int64_t after_setup = allocations(*dev);
  int64_t given_allocations = 0;
  std::vector<void*> loop_frees;
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    int64_t given_this_step = 0;
    hooks.step_begin();
    std::vector<Event> last(per_layer, Event{-1});
    for (int l = 0; l < layers; ++l) {
      hooks.forward_begin(l);
      for (int k = 0; k < per_layer; ++k) {
        Saved& s = saved[static_cast<size_t>(l * per_layer + k)];
        s.bytes = 1 + rng() % max_bytes;
        fill_random(s.v, s.bytes, rng);
        SavedTensor t;
        t.bytes = s.bytes;
        t.give = k == 2;
        if (t.give) {
          t.data = must_allocate(*dev, s.bytes);
          ++given_this_step;
        } else {
          t.data = src[static_cast<size_t>(k)];
          if (last[static_cast<size_t>(k)].id >= 0) {
            dev->wait(c.s, last[static_cast<size_t>(k)]);  // reuse after the hook's event
            c.overwrite(t.data, max_bytes);
          }
        }
        c.produce(t.data, &s.v, s.bytes);
        s.ticket = hooks.saved(l, names[k], t);
        s.kept = nullptr;
        if (!s.ticket) {  // the last layer: no hook wants it
          EXPECT_EQ(l, layers - 1);
          s.kept = t.data;
          continue;
        }
        ++handed;
        EXPECT_EQ(s.ticket.owner, 1);
        if (!t.give) {
          EXPECT_GE(s.ticket.copied.id, 0) << "a borrowed ticket carries its event";
          last[static_cast<size_t>(k)] = s.ticket.copied;
        }
      }
      hooks.forward_end(l);
    }
    for (int l = layers - 1; l >= 0; --l) {
      hooks.backward_begin(l);
      for (int k = 0; k < per_layer; ++k) {
        Saved& s = saved[static_cast<size_t>(l * per_layer + k)];
        if (s.kept != nullptr) {
          c.check(s.kept, &s.v, s.bytes, false);
          if (k == 2) loop_frees.push_back(s.kept);  // given but not taken: still the loop's
          continue;
        }
        if (k == 1) {
          void* back = hooks.needed(s.ticket, nullptr);
          ASSERT_NE(back, nullptr);
          c.check(back, &s.v, s.bytes, false);
          hooks.done(s.ticket);
          continue;
        }
        void* d = dst[static_cast<size_t>(k)];
        c.poison(d, &s.v, s.bytes);
        EXPECT_EQ(hooks.needed(s.ticket, d), d);
        c.check(d, &s.v, s.bytes, true);
        hooks.done(s.ticket);  // nothing to give back: a no-op
      }
    }
    hooks.step_end();  // the streams are idle after it
    for (void* q : loop_frees) dev->free(q, MemoryKind::kDevice);
    loop_frees.clear();
    const StepTelemetry& t = offload.telemetry();
    EXPECT_EQ(t.tensors_offloaded, (layers - 1) * per_layer);
    EXPECT_EQ(t.fallback_kept, 0);
    EXPECT_GT(t.reloads_staged, 0) << "depth 1: the hooks prefetch before needed() names dst";
    // The engine allocated nothing; the loop's given tensors are its own allocations.
    EXPECT_EQ(t.device_allocations, given_this_step);
    given_allocations += given_this_step;
  }
  EXPECT_EQ(allocations(*dev) - after_setup, given_allocations);
  EXPECT_EQ(first.saved_calls, 3 * layers * per_layer);
  EXPECT_EQ(c.checked.load(), 3 * layers * per_layer);
  EXPECT_EQ(c.bad.load(), 0) << "of " << handed << " tensors through the hooks";
  for (void* q : src) dev->free(q, MemoryKind::kDevice);
  for (void* q : dst) dev->free(q, MemoryKind::kDevice);
}

TEST(CallerOwned, OffloadHooksLeaveABorrowedTensorWithTheLoopWhenPinnedMemoryIsFull) {
  auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  Compute c{*dev, dev->create_stream(StreamRole::kCompute)};
  OffloadOptions o;
  o.pinned_bytes = int64_t{1} << 20;
  o.pinned_slabs = 1;
  o.device_pool_bytes = int64_t{4} << 20;
  OffloadEngine engine(*dev, c.s, MemoryPolicy::uniform(2, {"a"}), o);
  OffloadHooks offload(engine);
  CompositeHooks hooks({&offload});
  const size_t bytes = size_t{768} << 10;
  std::vector<unsigned char> v(bytes);
  std::mt19937 rng = spillway::testing::make_rng();
  fill_random(v, bytes, rng);
  void* src[2] = {must_allocate(*dev, bytes), must_allocate(*dev, bytes)};
  void* dst = must_allocate(*dev, bytes + kGuard);
  hooks.step_begin();
  hooks.forward_begin(0);
  SavedTensor t;
  t.bytes = bytes;
  t.data = src[0];
  c.produce(src[0], &v, bytes);
  const SavedTicket taken = hooks.saved(0, "a", t);
  t.data = src[1];
  c.produce(src[1], &v, bytes);
  const SavedTicket left = hooks.saved(0, "a", t);
  hooks.forward_end(0);
  ASSERT_TRUE(taken);
  EXPECT_FALSE(left) << "no room to copy it: not taken, the loop keeps it";
  EXPECT_LT(left.owner, 0);
  hooks.backward_begin(0);
  c.poison(dst, &v, bytes);
  EXPECT_EQ(hooks.needed(taken, dst), dst);
  c.check(dst, &v, bytes, true);
  c.check(src[1], &v, bytes, false);  // the loop's own, untouched
  hooks.step_end();
  EXPECT_EQ(offload.telemetry().fallback_kept, 1);
  EXPECT_EQ(offload.telemetry().tensors_offloaded, 1);
  EXPECT_EQ(c.checked.load(), 2);
  EXPECT_EQ(c.bad.load(), 0);
  for (void* p : {src[0], src[1], dst}) dev->free(p, MemoryKind::kDevice);
}

}  // namespace
}  // namespace spillway

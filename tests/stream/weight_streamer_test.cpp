// Layerwise weight streaming on the host backend (its copy and compute streams are threads
// moving the real bytes): outputs bitwise those of the all-resident model, inference and
// training; what is copied and reused; a slow link makes compute wait, a slow reader makes
// the copy wait, never a half-written or overwritten slot; no allocation, no host
// synchronize and no stream-wide wait in steady state; bad calls name what is wrong.
#include "spillway/stream/weight_streamer.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "allocation_count.hpp"
#include "forwarding_device.hpp"
#include "spillway/core/error.hpp"

namespace spillway {
namespace {

// Layer sizes in floats: unequal, so a slot holds layers of every size.
const std::vector<size_t> kFloats = {4096, 1024, 8192, 3000, 4096, 512, 6000};

std::vector<size_t> layer_bytes(size_t layers) {
  std::vector<size_t> b;
  for (size_t i = 0; i < layers; ++i) b.push_back(kFloats[i % kFloats.size()] * sizeof(float));
  return b;
}

float weight(int layer, int version, size_t i) {
  return 0.5f +
         static_cast<float>((layer * 131 + version * 17 + static_cast<int>(i % 97)) % 251) / 512.0f;
}

void fill_slab(WeightStreamer& ws, int layer, int version) {
  auto* w = static_cast<float*>(ws.host_slab(layer));
  const size_t n = layer_bytes(static_cast<size_t>(ws.layers()))[static_cast<size_t>(layer)] / 4;
  for (size_t i = 0; i < n; ++i) w[i] = weight(layer, version, i);
}

// One layer's compute: y <- y * w + w (elementwise over y, w wrapped), in fp32.
void layer_compute(float* y, size_t ny, const float* w, size_t nw) {
  for (size_t i = 0; i < ny; ++i) y[i] = y[i] * w[i % nw] + w[(i * 7) % nw];
}

constexpr size_t kY = 2048;

// A host device whose arena holds the ring.
std::unique_ptr<Device> host_device(double h2d_gbps = 0.0) {
  HostDeviceOptions o;
  o.device_bytes = int64_t{8} << 20;
  o.h2d_gbps = h2d_gbps;
  return make_host_device(o);
}

// Runs `steps` steps of the toy model through the streamer; returns y after each step.
std::vector<std::vector<float>> run_streamed(Device& dev, int layers, int depth, bool training,
                                             int steps, int64_t* total_loads = nullptr) {
  const Stream compute = dev.create_stream(StreamRole::kCompute);
  WeightStreamOptions o;
  o.depth = depth;
  o.training = training;
  std::vector<std::vector<float>> out;
  {
    WeightStreamer ws(dev, compute, layer_bytes(static_cast<size_t>(layers)), o);
    for (int l = 0; l < layers; ++l) fill_slab(ws, l, 0);
    std::vector<float> y(kY, 1.0f);
    const std::vector<size_t> bytes = layer_bytes(static_cast<size_t>(layers));
    for (int step = 0; step < steps; ++step) {
      const int visits = training ? 2 * layers : layers;
      for (int v = 0; v < visits; ++v) {
        const int l = v < layers ? v : 2 * layers - 1 - v;
        const auto* w = static_cast<const float*>(ws.acquire(l));
        const size_t nw = bytes[static_cast<size_t>(l)] / 4;
        float* yp = y.data();
        dev.host_callback(compute, [yp, w, nw] { layer_compute(yp, kY, w, nw); });
        ws.release(l);
      }
      dev.synchronize(compute);
      out.push_back(y);
      if (training) {
        // The "optimizer" writes the next step's weights once the copies read the slabs.
        for (int l = 0; l < layers; ++l) {
          dev.synchronize(ws.host_slab_read(l));
          fill_slab(ws, l, step + 1);
        }
      }
      ws.step_end();
    }
    const WeightStreamTelemetry t = ws.telemetry();
    if (total_loads != nullptr) *total_loads = t.loads;
    EXPECT_EQ(t.visits, static_cast<int64_t>(steps) * (training ? 2 : 1) * layers);
    // Inference wraps around: the last visit's acquire prefetched the next step's first
    // `depth` visits (loads not yet visited); training waits for a step_end() to do so.
    const int64_t ahead = training || layers <= depth + 1 ? 0 : depth;
    EXPECT_EQ(t.loads + t.hits, t.visits + ahead);
  }
  dev.destroy_stream(compute);
  return out;
}

std::vector<std::vector<float>> run_resident(int layers, bool training, int steps) {
  std::vector<std::vector<float>> out;
  std::vector<float> y(kY, 1.0f);
  const std::vector<size_t> bytes = layer_bytes(static_cast<size_t>(layers));
  for (int step = 0; step < steps; ++step) {
    const int visits = training ? 2 * layers : layers;
    for (int v = 0; v < visits; ++v) {
      const int l = v < layers ? v : 2 * layers - 1 - v;
      const size_t nw = bytes[static_cast<size_t>(l)] / 4;
      std::vector<float> w(nw);
      for (size_t i = 0; i < nw; ++i) w[i] = weight(l, training ? step : 0, i);
      layer_compute(y.data(), kY, w.data(), nw);
    }
    out.push_back(y);
  }
  return out;
}

TEST(WeightStreamer, InferenceEqualsAllResidentBitwiseAtEveryDepth) {
  for (int depth : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    auto dev = host_device();
    int64_t loads = 0;
    const auto got = run_streamed(*dev, 7, depth, false, 4, &loads);
    const auto want = run_resident(7, false, 4);
    for (size_t s = 0; s < want.size(); ++s)
      ASSERT_EQ(std::memcmp(got[s].data(), want[s].data(), kY * 4), 0) << "step " << s;
    // 7 layers > depth + 1 slots: every layer copied every step, and the first `depth` of
    // the next step prefetched at the end of the last.
    EXPECT_EQ(loads, 4 * 7 + depth);
  }
}

TEST(WeightStreamer, ALayerSetThatFitsTheRingIsCopiedOnce) {
  auto dev = host_device();
  int64_t loads = 0;
  const auto got = run_streamed(*dev, 3, 2, false, 5, &loads);
  const auto want = run_resident(3, false, 5);
  for (size_t s = 0; s < want.size(); ++s)
    ASSERT_EQ(std::memcmp(got[s].data(), want[s].data(), kY * 4), 0) << "step " << s;
  EXPECT_EQ(loads, 3);  // 15 visits in 5 steps: 3 loads, the rest hits
}

TEST(WeightStreamer, TrainingReusesTheTurnAndStreamsTheNewWeightsAfterStepEnd) {
  for (int depth : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    auto dev = host_device();
    int64_t loads = 0;
    const auto got = run_streamed(*dev, 6, depth, true, 3, &loads);
    const auto want = run_resident(6, true, 3);  // each step's weights are that step's
    for (size_t s = 0; s < want.size(); ++s)
      ASSERT_EQ(std::memcmp(got[s].data(), want[s].data(), kY * 4), 0) << "step " << s;
    // Forward loads 6; backward finds the last depth + 1 layers still in the ring.
    EXPECT_EQ(loads, 3 * (6 + 6 - (depth + 1)));
  }
}

// The telemetry of an inference run: every byte counted, the ring kept full.
TEST(WeightStreamer, TelemetryCountsBytesTimesAndTheRingsOccupancy) {
  auto dev = host_device(2.0);  // 2 GB/s: copies take measurable time
  const Stream compute = dev->create_stream(StreamRole::kCompute);
  {
    WeightStreamOptions o;
    o.depth = 2;
    WeightStreamer ws(*dev, compute, layer_bytes(7), o);
    EXPECT_EQ(ws.slot_bytes(), 8192u * 4);
    for (int l = 0; l < 7; ++l) fill_slab(ws, l, 0);
    for (int step = 0; step < 3; ++step) {
      for (int l = 0; l < 7; ++l) {
        ws.acquire(l);
        ws.release(l);
      }
      ws.step_end();
    }
    const WeightStreamTelemetry t = ws.telemetry();
    const std::vector<size_t> b = layer_bytes(7);
    // Three steps, and the next step's first two layers prefetched (wrap-around).
    EXPECT_EQ(t.bytes, 3 * static_cast<int64_t>(std::accumulate(b.begin(), b.end(), size_t{0})) +
                           static_cast<int64_t>(b[0] + b[1]));
    EXPECT_EQ(t.loads, 23);
    EXPECT_EQ(t.hits, 0);
    EXPECT_EQ(t.steps, 3);
    EXPECT_GT(t.copy_ms, 0.0);
    EXPECT_GT(t.gbps, 0.0);
    EXPECT_LT(t.gbps, 2.5);      // the throttle holds (2 GB/s), with wake-up slack
    EXPECT_GT(t.stall_ms, 0.0);  // compute does nothing: it waits for every copy
    EXPECT_GT(t.late_acquires, 0);
    // At every acquire the visit and the next two have their loads issued.
    EXPECT_DOUBLE_EQ(t.mean_slots_ahead, 3.0);
    for (int l = 0; l < 7; ++l) {
      const int64_t want = l < 2 ? 4 : 3;
      EXPECT_EQ(t.layers[static_cast<size_t>(l)].loads, want);
      EXPECT_EQ(t.layers[static_cast<size_t>(l)].bytes,
                want * static_cast<int64_t>(b[static_cast<size_t>(l)]));
    }
    ws.reset_telemetry();
    EXPECT_EQ(ws.telemetry().bytes, 0);
  }
  dev->destroy_stream(compute);
}

// Checks, when compute reaches a layer, that its slot holds the whole layer: under a slow
// link (compute would read a half-written slot if it did not wait) and under a slow reader
// (the next copy would overwrite a slot being read if it did not wait for the release).
TEST(WeightStreamer, ASlowLinkOrASlowReaderNeverSeesAHalfWrittenSlot) {
  struct Case {
    double gbps;
    int read_sleep_us;
  };
  for (const Case c : {Case{0.05, 0}, Case{0.0, 3000}}) {
    SCOPED_TRACE(::testing::Message()
                 << "link " << c.gbps << " GB/s, reader sleeps " << c.read_sleep_us << " us");
    auto dev = host_device(c.gbps);
    const Stream compute = dev->create_stream(StreamRole::kCompute);
    std::atomic<int> bad{0};
    {
      WeightStreamOptions o;
      o.depth = 2;
      const std::vector<size_t> bytes = layer_bytes(7);
      WeightStreamer ws(*dev, compute, bytes, o);
      for (int l = 0; l < 7; ++l) fill_slab(ws, l, 0);
      for (int step = 0; step < 2; ++step) {
        for (int l = 0; l < 7; ++l) {
          const auto* w = static_cast<const float*>(ws.acquire(l));
          const size_t n = bytes[static_cast<size_t>(l)] / 4;
          const int sleep_us = c.read_sleep_us;
          dev->host_callback(compute, [w, n, l, sleep_us, &bad] {
            auto check = [&] {
              for (size_t i = 0; i < n; ++i)
                if (w[i] != weight(l, 0, i)) return false;
              return true;
            };
            if (!check()) ++bad;
            if (sleep_us > 0) {
              std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
              if (!check()) ++bad;  // overwritten while its reader was still at work
            }
          });
          ws.release(l);
        }
        ws.step_end();
      }
      dev->synchronize(compute);
    }
    EXPECT_EQ(bad.load(), 0);
    dev->destroy_stream(compute);
  }
}

// Counts what the streamer asks of the device after its construction.
class CountingDevice final : public testing::ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  int64_t allocations = 0, synchronizes = 0, waits = 0, copies = 0;
  bool counting = false;
  AllocResult allocate(size_t bytes, MemoryKind kind) override {
    if (counting) ++allocations;
    return inner().allocate(bytes, kind);
  }
  void synchronize(Event e) override {
    if (counting) ++synchronizes;
    inner().synchronize(e);
  }
  void synchronize(Stream s) override {
    if (counting) ++synchronizes;
    inner().synchronize(s);
  }
  void wait(Stream s, Event e) override {
    if (counting) ++waits;
    inner().wait(s, e);
  }
  void copy_async(void* dst, const void* src, size_t bytes, Stream s) override {
    if (counting) ++copies;
    inner().copy_async(dst, src, bytes, s);
  }
};

TEST(WeightStreamer, SteadyStateAllocatesNothingAndOrdersByEventsOnly) {
  auto host = host_device();
  CountingDevice dev(*host);
  const Stream compute = dev.create_stream(StreamRole::kCompute, 0);
  {
    WeightStreamOptions o;
    o.depth = 2;
    o.timing = false;
    WeightStreamer ws(dev, compute, layer_bytes(7), o);
    for (int l = 0; l < 7; ++l) fill_slab(ws, l, 0);
    // The loop's compute: a callback holding one pointer (no allocation of its own).
    struct Job {
      std::vector<float> y = std::vector<float>(kY, 1.0f);
      const float* w = nullptr;
      size_t nw = 0;
    };
    std::vector<Job> jobs(7);
    const std::vector<size_t> bytes = layer_bytes(7);
    auto step = [&] {
      for (int l = 0; l < 7; ++l) {
        Job* j = &jobs[static_cast<size_t>(l)];
        j->w = static_cast<const float*>(ws.acquire(l));
        j->nw = bytes[static_cast<size_t>(l)] / 4;
        dev.host_callback(compute, [j] { layer_compute(j->y.data(), kY, j->w, j->nw); });
        ws.release(l);
      }
      ws.step_end();
      // The loop (not the streamer) keeps the host from running steps ahead of the compute
      // stream, whose queue would grow: its synchronize is not counted.
      const bool was = dev.counting;
      dev.counting = false;
      dev.synchronize(compute);
      dev.counting = was;
    };
    for (int s = 0; s < 3; ++s) step();  // warm-up: the host streams' queues reach their size
    dev.counting = true;
    const int64_t heap0 = testing::heap_allocations();
    for (int s = 0; s < 5; ++s) step();
    const int64_t heap = testing::heap_allocations() - heap0;
    dev.counting = false;
    EXPECT_EQ(heap, 0) << "heap allocations in 5 steady steps";
    EXPECT_EQ(dev.allocations, 0);
    EXPECT_EQ(dev.synchronizes, 0);
    EXPECT_EQ(dev.copies, 5 * 7);  // one copy per layer: each layer one slab
    // One event wait per visit on compute (slot ready) and one per copy on the copy stream
    // (slot free): nothing stream-wide.
    EXPECT_EQ(dev.waits, 5 * 7 * 2);
    dev.synchronize(compute);
  }
  dev.destroy_stream(compute);
}

TEST(WeightStreamer, CallerOwnedHostSlabsAreReadInPlace) {
  auto dev = host_device();
  const Stream compute = dev->create_stream(StreamRole::kCompute);
  {
    const std::vector<size_t> bytes = layer_bytes(4);
    std::vector<std::vector<float>> slabs;
    WeightStreamOptions o;
    o.depth = 1;
    for (size_t l = 0; l < 4; ++l) {
      slabs.emplace_back(bytes[l] / 4);
      for (size_t i = 0; i < slabs.back().size(); ++i)
        slabs.back()[i] = weight(static_cast<int>(l), 0, i);
      o.host_slabs.push_back(slabs.back().data());
    }
    WeightStreamer ws(*dev, compute, bytes, o);
    EXPECT_EQ(ws.host_slab(2), slabs[2].data());
    std::vector<float> first(4);
    for (int l = 0; l < 4; ++l) {
      const auto* w = static_cast<const float*>(ws.acquire(l));
      float* dst = &first[static_cast<size_t>(l)];
      dev->host_callback(compute, [dst, w] { *dst = w[5]; });
      ws.release(l);
    }
    dev->synchronize(compute);
    for (int l = 0; l < 4; ++l) EXPECT_EQ(first[static_cast<size_t>(l)], weight(l, 0, 5));
  }
  dev->destroy_stream(compute);
}

// Note [Sharded streaming]: N emulated GPUs behind one host link. Each rank copies its
// shard of every layer and the group's all-gather assembles the layer: every rank computes
// the all-resident result bitwise, and the link carries each layer once per step instead
// of N times (the full-copy mode, same run).
struct RankRun {
  std::vector<float> y;
  int64_t link_bytes = 0;  // the shared link's host-to-device bytes, all ranks
  int64_t rank_bytes = 0;  // rank 0's, from its telemetry
};

RankRun run_ranks(int ranks, bool sharded, int layers, int depth, int steps) {
  auto link = std::make_shared<HostLink>(8.0, 8.0);
  std::vector<std::unique_ptr<Device>> devs;
  std::vector<Device*> raw;
  for (int r = 0; r < ranks; ++r) {
    HostDeviceOptions o;
    o.device_bytes = int64_t{8} << 20;
    o.link = link;
    devs.push_back(make_host_device(o));
    raw.push_back(devs.back().get());
  }
  std::vector<std::unique_ptr<AllGather>> group;
  if (sharded) group = make_host_all_gather(raw);
  const std::vector<size_t> bytes = layer_bytes(static_cast<size_t>(layers));
  std::vector<Stream> compute;
  std::vector<std::unique_ptr<WeightStreamer>> ws;
  for (int r = 0; r < ranks; ++r) {
    compute.push_back(devs[static_cast<size_t>(r)]->create_stream(StreamRole::kCompute));
    WeightStreamOptions o;
    o.depth = depth;
    o.group = sharded ? group[static_cast<size_t>(r)].get() : nullptr;
    ws.push_back(
        std::make_unique<WeightStreamer>(*devs[static_cast<size_t>(r)], compute.back(), bytes, o));
    // This rank's part of every layer: its bytes of the layer, zero past the end.
    for (int l = 0; l < layers; ++l) {
      WeightStreamer& w = *ws.back();
      auto* slab = static_cast<char*>(w.host_slab(l));
      const size_t off = w.host_slab_offset(l);
      const size_t n = w.host_slab_bytes(l);
      std::vector<float> full(bytes[static_cast<size_t>(l)] / 4);
      for (size_t i = 0; i < full.size(); ++i) full[i] = weight(l, 0, i);
      for (size_t i = 0; i < n; ++i)
        slab[i] = off + i < bytes[static_cast<size_t>(l)]
                      ? reinterpret_cast<const char*>(full.data())[off + i]
                      : char{0};
    }
  }
  std::vector<std::vector<float>> y(static_cast<size_t>(ranks), std::vector<float>(kY, 1.0f));
  // One thread drives every rank, visit by visit (each rank's work is on its streams).
  for (int step = 0; step < steps; ++step) {
    for (int l = 0; l < layers; ++l) {
      for (int r = 0; r < ranks; ++r) {
        const auto* w = static_cast<const float*>(ws[static_cast<size_t>(r)]->acquire(l));
        const size_t nw = bytes[static_cast<size_t>(l)] / 4;
        float* yp = y[static_cast<size_t>(r)].data();
        devs[static_cast<size_t>(r)]->host_callback(compute[static_cast<size_t>(r)],
                                                    [yp, w, nw] { layer_compute(yp, kY, w, nw); });
        ws[static_cast<size_t>(r)]->release(l);
      }
    }
    for (auto& w : ws) w->step_end();
  }
  RankRun out;
  for (int r = 0; r < ranks; ++r)
    devs[static_cast<size_t>(r)]->synchronize(compute[static_cast<size_t>(r)]);
  for (int r = 1; r < ranks; ++r)
    EXPECT_EQ(std::memcmp(y[0].data(), y[static_cast<size_t>(r)].data(), kY * 4), 0)
        << "rank " << r << " differs from rank 0";
  out.y = y[0];
  out.rank_bytes = ws[0]->telemetry().bytes;
  ws.clear();
  out.link_bytes = link->h2d_bytes();
  for (int r = 0; r < ranks; ++r)
    devs[static_cast<size_t>(r)]->destroy_stream(compute[static_cast<size_t>(r)]);
  return out;
}

TEST(WeightStreamer, ShardedRanksComputeTheAllResidentResultAndMoveEachLayerOnce) {
  const int layers = 7, depth = 2, steps = 3;
  const auto want = run_resident(layers, false, steps).back();
  const std::vector<size_t> b = layer_bytes(layers);
  const auto model = static_cast<int64_t>(std::accumulate(b.begin(), b.end(), size_t{0}));
  for (int ranks : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << ranks << " ranks");
    const RankRun full = run_ranks(ranks, false, layers, depth, steps);
    const RankRun sharded = run_ranks(ranks, true, layers, depth, steps);
    ASSERT_EQ(std::memcmp(full.y.data(), want.data(), kY * 4), 0);
    ASSERT_EQ(std::memcmp(sharded.y.data(), want.data(), kY * 4), 0);
    // Full copy: every rank pulls every layer over the link. Sharded: each pulls 1/N
    // (shards rounded up to 256 bytes). Both also prefetched the next step's first
    // `depth` layers.
    const int64_t ahead = static_cast<int64_t>(b[0] + b[1]);
    EXPECT_EQ(full.link_bytes, ranks * (steps * model + ahead));
    EXPECT_EQ(full.rank_bytes, steps * model + ahead);
    EXPECT_EQ(sharded.link_bytes, ranks * sharded.rank_bytes);
    EXPECT_LE(sharded.link_bytes, steps * model + ahead + ranks * 256 * (steps + 1) * layers);
    EXPECT_GE(sharded.link_bytes, steps * model + ahead);
  }
}

// Note [Static slots]: layer l always in slot l % (depth + 1), bitwise the same results,
// whether or not depth + 1 divides the layers, inference and training.
TEST(WeightStreamer, StaticSlotsBindEachLayerToOneSlotAndStayBitwise) {
  for (bool training : {false, true}) {
    for (int layers : {6, 7}) {
      SCOPED_TRACE(::testing::Message()
                   << (training ? "training" : "inference") << ", " << layers << " layers");
      auto dev = host_device(4.0);
      const Stream compute = dev->create_stream(StreamRole::kCompute);
      WeightStreamOptions o;
      o.depth = 2;
      o.training = training;
      o.static_slots = true;
      const std::vector<size_t> bytes = layer_bytes(static_cast<size_t>(layers));
      std::vector<float> y(kY, 1.0f);
      std::vector<const void*> slot_of(static_cast<size_t>(layers), nullptr);
      {
        WeightStreamer ws(*dev, compute, bytes, o);
        for (int l = 0; l < layers; ++l) fill_slab(ws, l, 0);
        std::vector<const void*> slots;
        for (int step = 0; step < 3; ++step) {
          const int visits = training ? 2 * layers : layers;
          for (int v = 0; v < visits; ++v) {
            const int l = v < layers ? v : 2 * layers - 1 - v;
            const auto* w = static_cast<const float*>(ws.acquire(l));
            auto& seen = slot_of[static_cast<size_t>(l)];
            if (seen == nullptr) seen = w;
            ASSERT_EQ(seen, w) << "layer " << l << " moved to another slot";
            const size_t nw = bytes[static_cast<size_t>(l)] / 4;
            float* yp = y.data();
            dev->host_callback(compute, [yp, w, nw] { layer_compute(yp, kY, w, nw); });
            ws.release(l);
          }
          // Training: the same weights every step here (nothing rewrites the slabs).
          ws.step_end();
        }
        dev->synchronize(compute);
        for (int l = 0; l < layers; ++l)
          EXPECT_EQ(slot_of[static_cast<size_t>(l)], slot_of[static_cast<size_t>(l % 3)]);
      }
      dev->destroy_stream(compute);
      // The reference: the same visits over all-resident weights (version 0 every step).
      std::vector<float> want(kY, 1.0f);
      for (int step = 0; step < 3; ++step) {
        const int visits = training ? 2 * layers : layers;
        for (int v = 0; v < visits; ++v) {
          const int l = v < layers ? v : 2 * layers - 1 - v;
          const size_t nw = bytes[static_cast<size_t>(l)] / 4;
          std::vector<float> w(nw);
          for (size_t i = 0; i < nw; ++i) w[i] = weight(l, 0, i);
          layer_compute(want.data(), kY, w.data(), nw);
        }
      }
      EXPECT_EQ(std::memcmp(y.data(), want.data(), kY * 4), 0);
    }
  }
}

TEST(WeightStreamer, UpcomingVisitsNameTheirLayerSlotAndTheEventOfTheirCopy) {
  // A caller moving more data into a slot ahead of its visit (the PyTorch adapter's
  // all-gathers) learns which layer comes, where, and when its copy has landed: waiting on
  // the event, the slot holds the layer's bytes, over a slow link. (6 layers in 3 static
  // slots: no load is deferred; with 5, layer 0's next load would wait for layer 3.)
  auto dev = host_device(0.5);
  const Stream compute = dev->create_stream(StreamRole::kCompute);
  WeightStreamOptions o;
  o.depth = 2;
  o.static_slots = true;
  const std::vector<size_t> bytes = layer_bytes(6);
  {
    WeightStreamer ws(*dev, compute, bytes, o);
    for (int l = 0; l < 6; ++l) fill_slab(ws, l, 0);
    EXPECT_EQ(ws.upcoming(1).layer, -1);  // nothing decided before the first acquire
    for (int pass = 0; pass < 2; ++pass) {
      for (int l = 0; l < 6; ++l) {
        ws.acquire(l);
        for (int ahead = 1; ahead <= 2; ++ahead) {
          const WeightStreamer::Upcoming u = ws.upcoming(ahead);
          const int want = (l + ahead) % 6;
          ASSERT_EQ(u.layer, want) << "layer " << l << ", " << ahead << " ahead";
          dev->synchronize(u.ready);
          EXPECT_EQ(std::memcmp(u.slot, ws.host_slab(want), bytes[static_cast<size_t>(want)]), 0)
              << "layer " << want << " not in its slot after its event";
        }
        EXPECT_EQ(ws.upcoming(3).layer, -1);  // beyond the depth: not issued
        ws.release(l);
        EXPECT_EQ(ws.upcoming(1).layer, (l + 1) % 6);  // between visits: from the last one
      }
    }
    EXPECT_THROW((void)ws.upcoming(0), InputError);
  }
  dev->destroy_stream(compute);
}

TEST(WeightStreamer, BadCallsNameWhatIsWrong) {
  auto dev = host_device();
  const Stream compute = dev->create_stream(StreamRole::kCompute);
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  WeightStreamOptions bad;
  bad.depth = 0;
  EXPECT_NE(message([&] { WeightStreamer(*dev, compute, layer_bytes(3), bad); }).find("depth"),
            std::string::npos);
  EXPECT_NE(message([&] {
              WeightStreamer(*dev, compute, {64, 0}, {});
            }).find("layer 1"),
            std::string::npos);
  EXPECT_NE(message([&] { WeightStreamer(*dev, compute, {}, {}); }).find("layers"),
            std::string::npos);
  WeightStreamOptions huge;
  huge.depth = 1;
  EXPECT_NE(message([&] {
              WeightStreamer(*dev, compute, {size_t{64} << 20}, huge);
            }).find("device slot 0 of 2"),
            std::string::npos);
  {
    WeightStreamOptions o;
    o.training = true;
    WeightStreamer ws(*dev, compute, layer_bytes(3), o);
    EXPECT_NE(message([&] { ws.acquire(1); }).find("visit 0 of the step is layer 0"),
              std::string::npos);
    EXPECT_NE(message([&] { ws.release(0); }).find("without its acquire"), std::string::npos);
    ws.acquire(0);
    EXPECT_NE(message([&] { ws.acquire(1); }).find("before release(0)"), std::string::npos);
    ws.release(0);
    EXPECT_NE(message([&] { ws.step_end(); }).find("after 1 of the step's 6 visits"),
              std::string::npos);
    for (int l : {1, 2, 2, 1, 0}) {
      ws.acquire(l);
      ws.release(l);
    }
    EXPECT_NE(message([&] { ws.acquire(0); }).find("before step_end()"), std::string::npos);
    ws.step_end();
    ws.acquire(0);
    ws.release(0);
  }
  dev->synchronize(compute);
  dev->destroy_stream(compute);
}

}  // namespace
}  // namespace spillway

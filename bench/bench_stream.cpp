// `spillway bench stream`: see bench_stream.hpp.
#include "bench_stream.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/stats.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "spillway/probe/probe.hpp"
#include "spillway/stream/weight_streamer.hpp"

namespace spillway {

namespace {

using Clock = std::chrono::steady_clock;

uint32_t tag(int layer) {
  return 0x5a000000u + static_cast<uint32_t>(layer);
}

// A layer's "kernel": device time `ms` (a timed wait) and a check of the weights' first and
// last words, on the compute stream.
void enqueue_compute(Device& dev, Stream s, const void* w, size_t bytes, int layer, double ms,
                     int* bad) {
  dev.host_callback(s, [w, bytes, layer, ms, bad] {
    const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double, std::milli>(ms));
    uint32_t first = 0, last = 0;
    std::memcpy(&first, w, 4);
    std::memcpy(&last, static_cast<const char*>(w) + bytes - 4, 4);
    if (first != tag(layer) || last != tag(layer)) ++*bad;
    std::this_thread::sleep_until(until);
  });
}

void fill_layer(void* slab, size_t bytes, size_t offset, size_t layer_bytes, int layer) {
  // The layer's bytes [offset, offset + bytes): its first and last words carry its tag.
  auto* p = static_cast<char*>(slab);
  std::memset(p, 0, bytes);
  const uint32_t t = tag(layer);
  if (offset == 0) std::memcpy(p, &t, 4);
  if (offset <= layer_bytes - 4 && layer_bytes - 4 < offset + bytes)
    std::memcpy(p + (layer_bytes - 4 - offset), &t, 4);
}

// One rank's streamed steps; returns the step times (after `steps` steps) and fills bytes.
std::vector<double> streamed_steps(Device& dev, const StreamBenchOptions& o, AllGather* group,
                                   double* gbps, double* stall_ms, int64_t* bytes_per_step,
                                   int* bad) {
  const UniqueStream compute(dev, StreamRole::kCompute);
  std::vector<double> times;
  {
    WeightStreamOptions so;
    so.depth = o.depth;
    so.group = group;
    WeightStreamer ws(dev, compute,
                      std::vector<size_t>(static_cast<size_t>(o.layers), o.layer_bytes), so);
    for (int l = 0; l < o.layers; ++l)
      fill_layer(ws.host_slab(l), ws.host_slab_bytes(l), ws.host_slab_offset(l), o.layer_bytes, l);
    for (int step = 0; step < o.steps; ++step) {
      if (step == 1) ws.reset_telemetry();
      const auto t0 = Clock::now();
      for (int l = 0; l < o.layers; ++l) {
        const void* w = ws.acquire(l);
        enqueue_compute(dev, compute, w, o.layer_bytes, l, o.compute_ms, bad);
        ws.release(l);
      }
      ws.step_end();
      dev.synchronize(compute);
      times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    const WeightStreamTelemetry t = ws.telemetry();
    *gbps = t.gbps;
    *stall_ms = t.stall_ms / std::max(1, o.steps - 1);
    *bytes_per_step = t.bytes / std::max(1, o.steps - 1);
  }
  times.erase(times.begin());  // the warm-up
  return times;
}

std::vector<double> resident_steps(Device& dev, const StreamBenchOptions& o, int* bad) {
  const UniqueStream compute(dev, StreamRole::kCompute);
  std::vector<void*> layers;
  for (int l = 0; l < o.layers; ++l) {
    const AllocResult r = dev.allocate(o.layer_bytes, MemoryKind::kDevice);
    if (!r) SPILLWAY_INPUT_ERROR("bench stream: the resident layers do not fit: {}", r.reason);
    fill_layer(r.ptr, o.layer_bytes, 0, o.layer_bytes, l);
    layers.push_back(r.ptr);
  }
  std::vector<double> times;
  for (int step = 0; step < o.steps; ++step) {
    const auto t0 = Clock::now();
    for (int l = 0; l < o.layers; ++l)
      enqueue_compute(dev, compute, layers[static_cast<size_t>(l)], o.layer_bytes, l, o.compute_ms,
                      bad);
    dev.synchronize(compute);
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  for (void* p : layers) dev.free(p, MemoryKind::kDevice);
  times.erase(times.begin());
  return times;
}

}  // namespace

void check_stream_bench_options(const StreamBenchOptions& o) {
  if (o.layers < 2) SPILLWAY_FIELD_ERROR("layers", o.layers, "must be >= 2");
  if (o.layer_bytes < 1024) SPILLWAY_FIELD_ERROR("layer_bytes", o.layer_bytes, "must be >= 1024");
  if (!(o.compute_ms > 0)) SPILLWAY_FIELD_ERROR("compute_ms", o.compute_ms, "must be > 0");
  if (!(o.link_gbps > 0)) SPILLWAY_FIELD_ERROR("link_gbps", o.link_gbps, "must be > 0");
  if (o.depth < 1 || o.depth > 64) SPILLWAY_FIELD_ERROR("depth", o.depth, "must be in [1, 64]");
  if (o.steps < 2) SPILLWAY_FIELD_ERROR("steps", o.steps, "must be >= 2 (one is the warm-up)");
  for (int n : o.ranks)
    if (n < 2 || n > 16) SPILLWAY_FIELD_ERROR("ranks", n, "must be in [2, 16]");
}

StreamBenchResult run_stream_bench(const StreamBenchOptions& o) {
  check_stream_bench_options(o);
  StreamBenchResult r;
  r.options = o;
  int bad = 0;
  const auto device_bytes =
      static_cast<int64_t>(o.layer_bytes) * (o.layers + o.depth + 2) + (int64_t{64} << 20);
  {
    HostDeviceOptions hd;
    hd.device_bytes = device_bytes;
    hd.h2d_gbps = o.link_gbps;
    auto dev = make_host_device(hd);
    std::vector<double> res, str;
    double gbps = 0, stall = 0;
    int64_t bytes = 0;
    for (int rep = 0; rep < 2; ++rep) {  // interleaved: the machine drifts
      const auto a = resident_steps(*dev, o, &bad);
      res.insert(res.end(), a.begin(), a.end());
      const auto b = streamed_steps(*dev, o, nullptr, &gbps, &stall, &bytes, &bad);
      str.insert(str.end(), b.begin(), b.end());
    }
    r.resident_ms = median(res);
    r.streamed_ms = median(str);
    r.overhead = r.streamed_ms / r.resident_ms - 1.0;
    r.achieved_gbps = gbps;
    r.stall_ms = stall;
  }
  r.memcpy_gbps = measure_host_copy_gbps(o.layer_bytes);  // Note [The machine is the limit]
  for (int n : o.ranks) {
    StreamBenchResult::Sharded s;
    s.ranks = n;
    for (bool sharded : {false, true}) {
      auto link = std::make_shared<HostLink>(o.link_gbps, o.link_gbps);
      std::vector<std::unique_ptr<Device>> devs;
      std::vector<Device*> raw;
      for (int i = 0; i < n; ++i) {
        HostDeviceOptions hd;
        hd.device_bytes = static_cast<int64_t>(o.layer_bytes) * (o.depth + 2) + (int64_t{16} << 20);
        hd.link = link;
        devs.push_back(make_host_device(hd));
        raw.push_back(devs.back().get());
      }
      std::vector<std::unique_ptr<AllGather>> group;
      if (sharded) group = make_host_all_gather(raw);
      std::vector<std::vector<double>> times(static_cast<size_t>(n));
      std::vector<int64_t> bytes(static_cast<size_t>(n), 0);
      std::vector<int> bads(static_cast<size_t>(n), 0);
      std::vector<std::thread> threads;
      threads.reserve(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) {
        threads.emplace_back([&, i] {
          double g = 0, st = 0;
          const auto u = static_cast<size_t>(i);
          times[u] = streamed_steps(*devs[u], o, sharded ? group[u].get() : nullptr, &g, &st,
                                    &bytes[u], &bads[u]);
        });
      }
      for (std::thread& t : threads) t.join();
      for (int b : bads) bad += b;
      std::vector<double> slowest(times[0].size(), 0.0);
      for (const auto& t : times)
        for (size_t k = 0; k < t.size(); ++k) slowest[k] = std::max(slowest[k], t[k]);
      (sharded ? s.sharded_ms : s.full_ms) = median(slowest);
      (sharded ? s.sharded_rank_gb : s.full_rank_gb) = static_cast<double>(bytes[0]) / 1e9;
    }
    r.sharded.push_back(s);
  }
  if (bad > 0)
    throw Error(
        fmt::format("bench stream: {} layer computes read a slot that did not hold their "
                    "layer",
                    bad));
  return r;
}

std::string format_stream_bench(const StreamBenchResult& r) {
  const StreamBenchOptions& o = r.options;
  const double link_ms = static_cast<double>(o.layer_bytes) / (o.link_gbps * 1e6);
  std::string s = fmt::format(
      "{} layers of {:.1f} MiB, compute {:.2f} ms per layer, link {:.2f} GB/s ({:.2f} ms per "
      "layer), depth {}, median of {} steps\n",
      o.layers, static_cast<double>(o.layer_bytes) / (1 << 20), o.compute_ms, o.link_gbps, link_ms,
      o.depth, o.steps - 1);
  s += fmt::format("  all resident   {:9.2f} ms per step\n", r.resident_ms);
  s += fmt::format("  streamed       {:9.2f} ms per step  overhead {:+.2f}% (target <= 3%)  {}\n",
                   r.streamed_ms, 100.0 * r.overhead, r.overhead <= 0.03 ? "met" : "NOT met");
  s += fmt::format(
      "  copy stream    {:9.2f} GB/s achieved, {:.2f} of the link's {:.2f} (target >= 0.9)  "
      "{}; stalls {:.2f} ms per step\n",
      r.achieved_gbps, r.achieved_gbps / o.link_gbps, o.link_gbps,
      r.achieved_gbps >= 0.9 * o.link_gbps ? "met" : "NOT met", r.stall_ms);
  if (r.memcpy_gbps > 0.0) {
    s += fmt::format("  this machine   {:9.2f} GB/s memcpy (the probe, unthrottled, same run)\n",
                     r.memcpy_gbps);
  }
  const std::string limit = machine_limit_note(
      o.link_gbps, r.memcpy_gbps, "the overhead and the copy stream's bandwidth above");
  if (!limit.empty()) s += "  " + limit + "\n";
  for (const StreamBenchResult::Sharded& x : r.sharded) {
    s += fmt::format(
        "  {} GPUs on one link: full copy {:8.2f} ms per step, {:.3f} GB per rank; sharded "
        "{:8.2f} ms, {:.3f} GB per rank ({:.2f}x fewer bytes, {:.2f}x the step speed)\n",
        x.ranks, x.full_ms, x.full_rank_gb, x.sharded_ms, x.sharded_rank_gb,
        x.full_rank_gb / std::max(x.sharded_rank_gb, 1e-12),
        x.full_ms / std::max(x.sharded_ms, 1e-9));
  }
  return s;
}

std::string stream_bench_json(const StreamBenchResult& r) {
  nlohmann::json j;
  j["schema"] = "spillway.bench-stream/1";
  j["layers"] = r.options.layers;
  j["layer_bytes"] = r.options.layer_bytes;
  j["compute_ms"] = r.options.compute_ms;
  j["link_gbps"] = r.options.link_gbps;
  j["depth"] = r.options.depth;
  j["resident_ms"] = r.resident_ms;
  j["streamed_ms"] = r.streamed_ms;
  j["overhead"] = r.overhead;
  j["achieved_gbps"] = r.achieved_gbps;
  j["stall_ms"] = r.stall_ms;
  j["memcpy_gbps"] = r.memcpy_gbps;
  j["machine_is_the_limit"] = !machine_limit_note(r.options.link_gbps, r.memcpy_gbps, "").empty();
  for (const auto& x : r.sharded)
    j["sharded"].push_back({{"ranks", x.ranks},
                            {"full_ms", x.full_ms},
                            {"sharded_ms", x.sharded_ms},
                            {"full_rank_gb", x.full_rank_gb},
                            {"sharded_rank_gb", x.sharded_rank_gb}});
  return j.dump(2) + "\n";
}

}  // namespace spillway

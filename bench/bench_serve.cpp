// `spillway bench serve`: see bench_serve.hpp.
#include "bench_serve.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "spillway/catalog/hardware.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "spillway/serve/serve.hpp"
#include "spillway/serve/slices.hpp"

// OpenBLAS's own threads (spillway links OpenBLAS): each emulated slice is one thread.
extern "C" void openblas_set_num_threads(int num_threads);

namespace spillway {
namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

std::vector<uint16_t> bf16_weights(int64_t count, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<uint16_t> w(static_cast<size_t>(count));
  for (uint16_t& v : w) v = static_cast<uint16_t>(0x3c00 + g() % 512);  // ~[0.008, 0.03)
  return w;
}

// A model of `layers` Linear weights (N x K bf16) as a safetensors file.
void write_model(const std::string& path, int layers, int64_t n, int64_t k, uint32_t seed) {
  std::vector<SafetensorsEntry> t;
  for (int l = 0; l < layers; ++l) {
    const std::vector<uint16_t> w = bf16_weights(n * k, seed + static_cast<uint32_t>(l));
    SafetensorsEntry e{fmt::format("layers.{}.weight", l), DType::kBf16, {n, k}, {}};
    e.bytes.resize(w.size() * 2);
    std::memcpy(e.bytes.data(), w.data(), e.bytes.size());
    t.push_back(std::move(e));
  }
  write_safetensors(path, t);
}

ServeBenchResult::Switch run_switch(const ServeBenchOptions& o, const SliceSetup& setup) {
  ServeBenchResult::Switch r;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      fmt::format("spillway-bench-serve-{}", static_cast<long>(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string a = (dir / "a.safetensors").string(), b = (dir / "b.safetensors").string();
  write_model(a, o.switch_layers, o.n, o.k, 1);
  write_model(b, o.switch_layers, o.n, o.k, 100);
  auto link = std::make_shared<HostLink>(setup.link_gbps, setup.link_gbps);
  EmulatedSlice slice(setup.slices[0], link);
  ModelPool pool(slice.device(), ModelPoolOptions{int64_t{1} << 34});
  pool.add("a", a);
  pool.add("b", b);
  (void)pool.acquire("a");
  // Cold start: b from disk into the pool, then its first token.
  const auto tc = Clock::now();
  {
    PoolAcquire cold = pool.acquire("b");
    SPILLWAY_CHECK(cold.status == PoolStatus::kOk && cold.cold, "bench serve: b was resident");
    std::vector<float> x0(static_cast<size_t>(o.k), 0.5f), y0(static_cast<size_t>(o.n));
    HybridGemmProblem p0{1, o.n, o.k, DType::kBf16, 0.0, {16, 64, 64}, {16, 64, 64}};
    for (int l = 0; l < o.switch_layers; ++l)
      (void)slice.gemm(p0, x0.data(), cold.handle.tensor(fmt::format("layers.{}.weight", l)).host,
                       y0.data());
  }
  r.cold_ms = ms_between(tc, Clock::now());
  r.disk_gbps = static_cast<double>(pool.stats().cold_load_bytes) / 2.0 /
                std::max(pool.stats().cold_load_ms, 1e-9) / 1e6;
  (void)pool.acquire("a");  // both resident; a is active
  std::vector<float> x(static_cast<size_t>(o.k), 0.5f), y(static_cast<size_t>(o.n));
  HybridGemmProblem p{1, o.n, o.k, DType::kBf16, 0.0, {16, 64, 64}, {16, 64, 64}};
  // Switch: re-point at b, then its first token through every layer from host memory.
  const MemoryStats before = slice.device().memory_stats();
  const auto t0 = Clock::now();
  PoolAcquire h = pool.acquire("b");
  SPILLWAY_CHECK(h.status == PoolStatus::kOk && !h.cold, "bench serve: b is not resident");
  for (int l = 0; l < o.switch_layers; ++l)
    (void)slice.gemm(p, x.data(), h.handle.tensor(fmt::format("layers.{}.weight", l)).host,
                     y.data());
  r.switch_ms = ms_between(t0, Clock::now());
  // Note [Pool switches copy nothing]: no device memory was allocated for the switch, so no
  // weight byte can have been copied into it (the slice's device counters).
  const MemoryStats after = slice.device().memory_stats();
  const auto dm = static_cast<size_t>(MemoryKind::kDevice);
  r.switch_device_allocations = after.allocations[dm] - before.allocations[dm];
  r.switch_device_bytes = after.peak[dm] - before.current[dm];
  r.weight_bytes = h.handle.weight_bytes();
  // Reload: every weight copied into the slice's device memory over the link, then the
  // first token with the weights in HBM (each layer: its bytes at HBM bandwidth, or its
  // FLOPs at the slice's rate; the GEMM itself run for real).
  Device& dev = slice.device();
  const AllocResult arena = dev.allocate(static_cast<size_t>(r.weight_bytes), MemoryKind::kDevice);
  SPILLWAY_CHECK(static_cast<bool>(arena), "bench serve: no device memory for the reload: {}",
                 arena.reason);
  const UniqueStream s(dev, StreamRole::kH2D);
  const auto t1 = Clock::now();
  int64_t at = 0;
  for (const PooledTensor& t : h.handle.tensors()) {
    dev.copy_async(static_cast<std::byte*>(arena.ptr) + at, t.host, static_cast<size_t>(t.bytes),
                   s);
    at += t.bytes;
  }
  dev.synchronize(s);
  const SliceSpec& spec = setup.slices[0];
  const double per_layer =
      std::max(static_cast<double>(o.n * o.k * 2 + o.k * 4 + o.n * 4) / (spec.hbm_gbps * 1e6),
               2.0 * static_cast<double>(o.n * o.k) / (spec.gflops * 1e6));
  std::this_thread::sleep_until(Clock::now() +
                                checked_duration_ms(per_layer * o.switch_layers, "reload_ms"));
  r.reload_ms = ms_between(t1, Clock::now());
  dev.free(arena.ptr, MemoryKind::kDevice);
  h.handle.release();
  r.hardware_switch_ms = r.switch_ms * setup.rate_scale;
  r.hardware_cold_ms = r.cold_ms * setup.rate_scale;
  r.hardware_reload_ms = r.reload_ms * setup.rate_scale;
  std::filesystem::remove_all(dir);
  return r;
}

ServeBenchResult::Sweep run_sweep(const ServeBenchOptions& o, const SliceSetup& setup) {
  ServeBenchResult::Sweep sw;
  sw.profile = setup.slices[0].profile;
  sw.slices = static_cast<int>(setup.slices.size());
  const std::vector<uint16_t> w = bf16_weights(o.n * o.k, 7);
  std::vector<float> x(static_cast<size_t>(o.m * o.k), 0.25f);
  double best = 0.0;
  for (double alpha : o.alphas) {
    auto link = std::make_shared<HostLink>(setup.link_gbps, setup.link_gbps);
    std::vector<std::unique_ptr<EmulatedSlice>> slices;
    for (const SliceSpec& k : setup.slices)
      slices.push_back(std::make_unique<EmulatedSlice>(k, link));
    HybridGemmProblem p{o.m, o.n, o.k, DType::kBf16, alpha, {64, 128, 64}, {64, 128, 64}};
    std::vector<SliceGemmTiming> t(slices.size());
    std::vector<std::vector<float>> out(slices.size(),
                                        std::vector<float>(static_cast<size_t>(o.m * o.n)));
    std::vector<std::thread> threads;
    for (size_t i = 0; i < slices.size(); ++i)
      threads.emplace_back(
          [&, i] { t[i] = slices[i]->gemm(p, x.data(), w.data(), out[i].data()); });
    for (std::thread& th : threads) th.join();
    ServeBenchResult::Point pt;
    pt.alpha = alpha;
    size_t worst = 0;
    for (size_t i = 0; i < t.size(); ++i) {
      pt.link_bytes += t[i].traffic.total().link_bytes;
      pt.overrun = pt.overrun || t[i].overrun;
      if (t[i].elapsed_ms > t[worst].elapsed_ms) worst = i;
    }
    pt.slowest_ms = t[worst].elapsed_ms;
    pt.hbm_bytes = t[worst].traffic.total().hbm_bytes();
    pt.link_ms = t[worst].link_ms;
    pt.hbm_ms = t[worst].hbm_ms;
    pt.compute_ms = t[worst].compute_ms;
    if (sw.points.empty() || pt.slowest_ms < best) {
      best = pt.slowest_ms;
      sw.best_alpha = alpha;
    }
    sw.points.push_back(pt);
  }
  return sw;
}

}  // namespace

std::vector<std::string> serve_bench_profiles(const ServeBenchOptions& o) {
  if (!o.profiles.empty()) return o.profiles;
  const HardwareProfile hw = load_hardware(o.hardware);
  if (hw.mig.empty()) {
    std::string with;
    for (const std::string& name : hardware_names())
      if (!load_hardware(name).mig.empty()) with += (with.empty() ? "" : ", ") + name;
    SPILLWAY_INPUT_ERROR(
        "--hardware {}: it has no MIG profiles, and bench serve runs on emulated MIG slices; "
        "the catalog GPUs with MIG profiles: {}",
        o.hardware, with);
  }
  // For each slice count, the profile with the most memory per slice.
  std::vector<std::string> out;
  for (int count : {1, 3, 7}) {
    const MigProfile* best = nullptr;
    for (const MigProfile& m : hw.mig)
      if (m.count == count && (best == nullptr || m.hbm_gb > best->hbm_gb)) best = &m;
    if (best != nullptr) out.push_back(best->profile);
  }
  if (out.empty()) {  // none 1-, 3- or 7-way: the largest slice
    const MigProfile* best = &hw.mig.front();
    for (const MigProfile& m : hw.mig)
      if (m.hbm_gb > best->hbm_gb) best = &m;
    out.push_back(best->profile);
  }
  return out;
}

ServeBenchResult run_serve_bench(const ServeBenchOptions& o) {
  if (o.m < 1 || o.n < 1 || o.k < 1) SPILLWAY_FIELD_ERROR("m", o.m, "m, n and k must be >= 1");
  if (o.alphas.empty()) SPILLWAY_FIELD_ERROR("alphas", 0, "must list at least one alpha");
  if (o.switch_layers < 1) SPILLWAY_FIELD_ERROR("switch_layers", o.switch_layers, "must be >= 1");
  const HardwareProfile hw = load_hardware(o.hardware);
  ServeBenchResult r;
  r.options = o;
  r.options.profiles = serve_bench_profiles(o);
  std::vector<SliceSetup> setups;
  for (const std::string& prof : r.options.profiles)
    setups.push_back(mig_slices(hw, prof, o.rate_scale, 1e-3));
  // The link time alone, at least: the reload copies the switched model's weights, and at
  // alpha 0 every slice of every profile reads the GEMM's weights over the shared link.
  const double weight_bytes = static_cast<double>(o.n * o.k * 2);
  double link_bytes = weight_bytes * o.switch_layers;
  for (const SliceSetup& s : setups)
    link_bytes += weight_bytes * static_cast<double>(s.slices.size());
  const double seconds = link_bytes / (setups.front().link_gbps * 1e9);
  if (!(seconds <= o.max_seconds))
    SPILLWAY_INPUT_ERROR(
        "--rate-scale {}: the run moves at least {:.1f} MB over the emulated link of {:.3g} "
        "GB/s ({} x its rates), {:.3g} s: more than the {:.0f} s a run may take; raise "
        "--rate-scale to {:.3g} or more, or lower --n / --k",
        o.rate_scale, link_bytes / 1e6, setups.front().link_gbps, o.hardware, seconds,
        o.max_seconds, o.rate_scale * seconds / o.max_seconds);
  // The slices run concurrently, one thread each; BLAS threads of their own would fight
  // over the cores and overrun the emulated times.
  openblas_set_num_threads(1);
  for (size_t i = 0; i < setups.size(); ++i) {
    r.link_gbps = setups[i].link_gbps;
    if (i == 0) r.sw = run_switch(o, setups[i]);
    r.sweeps.push_back(run_sweep(o, setups[i]));
  }
  return r;
}

std::string format_serve_bench(const ServeBenchResult& r) {
  const ServeBenchOptions& o = r.options;
  std::string s = fmt::format(
      "emulated {} slices, every rate x {:g} (link {:.4f} GB/s); times are the emulation's, "
      "'at {} rates' divides them back\n",
      o.hardware, o.rate_scale, r.link_gbps, o.hardware);
  s += fmt::format(
      "model switch ({} layers of {}x{} bf16, {:.1f} MB): re-point + first token {:.1f} ms "
      "({:.2f} ms at {} rates, {} device allocations, {} device bytes); reload into device "
      "memory + first token "
      "{:.1f} ms ({:.2f} ms); reload / switch = {:.2f}x\n",
      o.switch_layers, o.n, o.k, static_cast<double>(r.sw.weight_bytes) / 1e6, r.sw.switch_ms,
      r.sw.hardware_switch_ms, o.hardware, r.sw.switch_device_allocations, r.sw.switch_device_bytes,
      r.sw.reload_ms, r.sw.hardware_reload_ms, r.sw.reload_ms / std::max(r.sw.switch_ms, 1e-9));
  s += fmt::format(
      "cold start (the model from disk into the pool, {:.2f} GB/s from this machine's disk and "
      "page cache, then its first token): {:.1f} ms (the disk is this machine's, not scaled)\n",
      r.sw.disk_gbps, r.sw.cold_ms);
  s += fmt::format("HybridGEMM {}x{}x{} (bf16 weights) on every slice at once:\n", o.m, o.n, o.k);
  for (const ServeBenchResult::Sweep& w : r.sweeps) {
    s += fmt::format("  {} x {}:\n", w.slices, w.profile);
    s += "    alpha  slowest ms   link ms    HBM ms  compute ms   link MB (all)  HBM MB/slice\n";
    for (const ServeBenchResult::Point& p : w.points)
      s += fmt::format(
          "    {:5.2f} {:11.1f} {:9.1f} {:9.1f} {:11.1f} {:15.2f} {:13.2f}{}{}\n", p.alpha,
          p.slowest_ms, p.link_ms, p.hbm_ms, p.compute_ms, static_cast<double>(p.link_bytes) / 1e6,
          static_cast<double>(p.hbm_bytes) / 1e6, p.alpha == w.best_alpha ? "  <- best" : "",
          p.overrun ? "  (real work overran the emulated time)" : "");
  }
  return s;
}

std::string serve_bench_json(const ServeBenchResult& r) {
  nlohmann::json j;
  j["schema"] = "spillway.bench-serve/1";
  j["hardware"] = r.options.hardware;
  j["rate_scale"] = r.options.rate_scale;
  j["link_gbps"] = r.link_gbps;
  j["switch"] = {{"weight_bytes", r.sw.weight_bytes},
                 {"switch_ms", r.sw.switch_ms},
                 {"reload_ms", r.sw.reload_ms},
                 {"switch_device_allocations", r.sw.switch_device_allocations},
                 {"switch_device_bytes", r.sw.switch_device_bytes},
                 {"hardware_switch_ms", r.sw.hardware_switch_ms},
                 {"cold_ms", r.sw.cold_ms},
                 {"disk_gbps", r.sw.disk_gbps},
                 {"hardware_reload_ms", r.sw.hardware_reload_ms}};
  for (const ServeBenchResult::Sweep& w : r.sweeps) {
    nlohmann::json sw = {
        {"profile", w.profile}, {"slices", w.slices}, {"best_alpha", w.best_alpha}};
    for (const ServeBenchResult::Point& p : w.points)
      sw["points"].push_back({{"alpha", p.alpha},
                              {"slowest_ms", p.slowest_ms},
                              {"link_bytes", p.link_bytes},
                              {"hbm_bytes_per_slice", p.hbm_bytes},
                              {"link_ms", p.link_ms},
                              {"hbm_ms", p.hbm_ms},
                              {"compute_ms", p.compute_ms},
                              {"overrun", p.overrun}});
    j["sweeps"].push_back(sw);
  }
  return j.dump(2) + "\n";
}

}  // namespace spillway

// The optimizer-offload pipeline benchmark: see bench_stv.hpp.
#include "bench_stv.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "bench_json.hpp"
#include "core/stats.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "spillway/optim/optim.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {

using optim::AdamW;
using optim::AdamWParams;
using optim::Bucket;
using optim::OptimizerOffload;
using optim::OptimOffloadOptions;

namespace {

constexpr double kClip = 1.0;

struct StvWorkload {
  size_t n = 0;
  std::vector<Bucket> buckets;
  std::vector<float> w0;
  std::vector<uint16_t> small, large;  // bf16 gradients: a commit, a clip
};

StvWorkload make_workload(const StvBenchOptions& o) {
  StvWorkload w;
  w.n = o.bucket_elements * static_cast<size_t>(o.buckets);
  for (int b = 0; b < o.buckets; ++b)
    w.buckets.push_back({static_cast<size_t>(b) * o.bucket_elements, o.bucket_elements});
  std::mt19937 g(static_cast<uint32_t>(o.seed));
  std::normal_distribution<float> d(0.0f, 1.0f);
  w.w0.resize(w.n);
  w.small.resize(w.n);
  w.large.resize(w.n);
  // The gradient norm: sqrt(n) x sigma; small stays below the clip threshold, large above.
  const float small_sigma = 0.1f / std::sqrt(static_cast<float>(w.n));
  const float large_sigma = 10.0f / std::sqrt(static_cast<float>(w.n));
  for (size_t i = 0; i < w.n; ++i) {
    const float x = d(g);
    w.w0[i] = 0.02f * x;
    w.small[i] = optim::float_to_bf16(small_sigma * d(g));
    w.large[i] = optim::float_to_bf16(large_sigma * d(g));
  }
  return w;
}

// One pipeline on its own emulated device.
struct Runner {
  std::string name;
  int device_buckets = 0;
  int64_t undo_limit = -1;
  std::unique_ptr<Device> dev;
  UniqueStream compute;
  std::unique_ptr<OptimizerOffload> off;
  StvBenchVariant result;
};

std::unique_ptr<Runner> make_runner(const StvBenchOptions& o, const StvWorkload& w, AdamW& pool,
                                    std::string name, int device_buckets, int64_t undo_limit) {
  auto r = std::make_unique<Runner>();
  r->name = std::move(name);
  r->device_buckets = device_buckets;
  r->undo_limit = undo_limit;
  // Device memory: bf16 weights and gradients (4 B), the split's state (12 B), lanes.
  const int64_t device_bytes = static_cast<int64_t>(w.n) * 16 + (int64_t{64} << 20);
  r->dev = make_host_device(HostDeviceOptions{device_bytes, o.d2h_gbps, o.h2d_gbps});
  r->compute = UniqueStream(*r->dev, StreamRole::kCompute);
  OptimOffloadOptions oo;
  oo.clip = kClip;
  oo.cast = optim::CastSite::kHost;  // a PCIe-like link: move bf16, widen on the CPU
  oo.device_buckets = device_buckets;
  oo.undo_limit_bytes = undo_limit;
  r->off = std::make_unique<OptimizerOffload>(*r->dev, r->compute, w.w0.data(), w.n, w.buckets, oo,
                                              &pool);
  r->result.name = r->name;
  r->result.device_buckets = device_buckets;
  r->result.undo_bytes = r->off->undo_bytes();
  return r;
}

// One step: backward hands the buckets over on schedule, last first. Returns {step ms,
// backward ms} measured from the start of backward.
std::pair<double, double> run_step(Runner& r, const StvWorkload& w, const std::vector<uint16_t>& g,
                                   double backward_ms) {
  Device& dev = *r.dev;
  const int nb = static_cast<int>(w.buckets.size());
  const double per = backward_ms / nb;
  dev.synchronize(r.compute);
  const Clock::time_point t0 = Clock::now();
  uint16_t* grads = r.off->device_grads();
  for (int i = 0; i < nb; ++i) {
    const int b = nb - 1 - i;
    const Bucket k = w.buckets[static_cast<size_t>(b)];
    const auto due = t0 + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double, std::milli>(per * (i + 1)));
    const uint16_t* src = g.data() + k.offset;
    dev.host_callback(r.compute, [due, dst = grads + k.offset, src, n = k.n] {
      std::this_thread::sleep_until(due);
      std::memcpy(dst, src, n * sizeof(uint16_t));
    });
    r.off->on_bucket_grad(b);
  }
  auto backward_end = std::make_shared<double>(0.0);
  dev.host_callback(r.compute, [backward_end, t0] { *backward_end = ms_since(t0); });
  r.off->end_step();
  dev.synchronize(r.compute);
  return {ms_since(t0), *backward_end};
}

void check_state(const Runner& r, const std::vector<float>& p, const std::vector<float>& m,
                 const std::vector<float>& v, int step) {
  const optim::OptimState st = r.off->read_state();
  const std::pair<const std::vector<float>*, const std::vector<float>*> arrays[] = {
      {&st.p, &p}, {&st.m, &m}, {&st.v, &v}};
  const char* names[] = {"p", "m", "v"};
  for (int a = 0; a < 3; ++a) {
    const std::vector<float>& got = *arrays[a].first;
    const std::vector<float>& want = *arrays[a].second;
    for (size_t i = 0; i < want.size(); ++i) {
      // Bits, on purpose: the check is bitwise equality (NaN payloads included).
      // NOLINTNEXTLINE(bugprone-suspicious-memory-comparison)
      if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0)
        SPILLWAY_INPUT_ERROR(
            "optim-offload bench: variant {} differs from the non-speculative optimizer after "
            "step {}: {}[{}] = {} instead of {}",
            r.name, step, names[a], i, got[i], want[i]);
    }
  }
}

template <typename F>
double median_ms(int times, F f) {
  std::vector<double> s;
  for (int i = 0; i < times; ++i) {
    const Clock::time_point t0 = Clock::now();
    f();
    s.push_back(ms_since(t0));
  }
  return median(s);
}

}  // namespace

void check_stv_bench_options(const StvBenchOptions& o) {
  auto at_least = [](const char* field, const char* flag, double v, double min) {
    if (!(v >= min))
      SPILLWAY_INPUT_ERROR("optim-offload bench: {} ({}) is {}; must be >= {}", field, flag, v,
                           min);
  };
  at_least("buckets", "--buckets", o.buckets, 1);
  at_least("bucket_elements", "--bucket-elements", static_cast<double>(o.bucket_elements), 1);
  at_least("backward_ms", "--backward-ms", o.backward_ms, 0.0);
  at_least("d2h_gbps", "--d2h-gbps", o.d2h_gbps, 0.0);
  at_least("h2d_gbps", "--h2d-gbps", o.h2d_gbps, 0.0);
  at_least("device_buckets", "--device-buckets", o.device_buckets, -1);
  at_least("threads", "--threads", o.threads, 0);
  at_least("repeats", "--repeats", o.repeats, 1);
  at_least("steps", "--steps", o.steps, 1);
  if (o.buckets > 4096)
    SPILLWAY_INPUT_ERROR("optim-offload bench: buckets (--buckets) is {}; must be <= 4096",
                         o.buckets);
  if (o.device_buckets > o.buckets)
    SPILLWAY_INPUT_ERROR(
        "optim-offload bench: device_buckets (--device-buckets) is {}; must be <= buckets ({})",
        o.device_buckets, o.buckets);
  const double elements = static_cast<double>(o.bucket_elements) * o.buckets;
  if (elements > 1e9)
    SPILLWAY_INPUT_ERROR(
        "optim-offload bench: buckets x bucket_elements is {:g}; must be <= 1e9 (about 60 "
        "bytes each per variant)",
        elements);
  if (o.threads > 4096)
    SPILLWAY_INPUT_ERROR("optim-offload bench: threads (--threads) is {}; must be <= 4096",
                         o.threads);
}

StvBenchResult run_stv_bench(const StvBenchOptions& options) {
  check_stv_bench_options(options);
  StvBenchResult res;
  res.options = options;
  const StvWorkload w = make_workload(options);
  res.elements = static_cast<int64_t>(w.n);
  AdamW pool(options.threads);
  res.options.threads = pool.threads();

  // Per-bucket timings for the split, as STV does a bucket: the norm lane sums and the
  // step out of place (into a second buffer) on the pool, bf16 gradient in and bf16 copy
  // out; the device-side step (one thread here); the link both ways. Each sample steps a
  // different bucket of full-size state, so that it starts cold, as in the pipeline.
  {
    const size_t bn = options.bucket_elements;
    const int nb = options.buckets;
    AdamWParams hp;
    std::vector<float> p = w.w0, m(w.n), v(w.n);
    std::vector<uint16_t> copy(w.n);
    int next = 0;
    auto args = [&](int b) {
      const size_t at = static_cast<size_t>(b % nb) * bn;
      optim::AdamWArgs a;
      a.p = p.data() + at;
      a.m = m.data() + at;
      a.v = v.data() + at;
      a.copy_out = copy.data() + at;
      a.copy_type = optim::CopyType::kBf16;
      a.n = bn;
      return a;
    };
    std::vector<double> lanes(optim::kNormLanes);
    std::vector<float> second(3 * bn);
    std::vector<double> lane_samples, step_samples;
    for (int i = 0; i < 3; ++i, ++next) {
      optim::AdamWArgs a = args(next);
      const uint16_t* g = w.small.data() + (a.p - p.data());
      const Clock::time_point t0 = Clock::now();
      optim::norm_lane_sums_bf16(g, bn, lanes.data());
      lane_samples.push_back(ms_since(t0));
      a.p_out = second.data();
      a.m_out = second.data() + bn;
      a.v_out = second.data() + 2 * bn;
      a.g = g;
      a.grad_type = optim::GradType::kBf16;
      const Clock::time_point t1 = Clock::now();
      pool.step(hp, a);
      step_samples.push_back(ms_since(t1));
    }
    res.bucket_lanes_ms = median(lane_samples);
    res.bucket_step_ms = median(step_samples);
    res.bucket_device_ms = median_ms(3, [&] {
      optim::AdamWArgs a = args(next);
      a.g = w.small.data() + (a.p - p.data());
      a.grad_type = optim::GradType::kBf16;
      optim::adamw_step_simd(hp, a);
      ++next;
    });
    // A bf16 gradient down and the bf16 weights up (2 bytes each per element).
    const auto copy_ms = [&](double gbps) {
      return gbps > 0 ? static_cast<double>(bn) * 2.0 / (gbps * 1e6) : 0.0;
    };
    const double link_ms = copy_ms(options.d2h_gbps) + copy_ms(options.h2d_gbps);
    res.bucket_link_ms = link_ms;
    res.bucket_cpu_ms = res.bucket_lanes_ms + res.bucket_step_ms + link_ms;
  }
  int split = options.device_buckets;
  {
    std::vector<BucketTiming> arrival;
    arrival.reserve(static_cast<size_t>(options.buckets));
    for (int i = 0; i < options.buckets; ++i)
      arrival.push_back({options.backward_ms / options.buckets * (i + 1), res.bucket_cpu_ms,
                         res.bucket_device_ms, static_cast<int64_t>(options.bucket_elements) * 12});
    const SplitChoice c = choose_device_buckets(arrival, options.backward_ms, int64_t{1} << 50);
    if (split < 0) split = c.device_buckets;
    res.predicted_end_ms = c.end_ms;
  }
  res.options.device_buckets = split;
  const int split_run = std::max(split, 1);  // the variant shows a split even when 0 is best

  std::vector<std::unique_ptr<Runner>> runners;
  runners.push_back(make_runner(options, w, pool, "after-backward", 0, 0));
  runners.push_back(make_runner(options, w, pool, "stv", 0, -1));
  runners.push_back(
      make_runner(options, w, pool, fmt::format("stv+split({})", split_run), split_run, -1));

  // Correctness: a commit and a clip, bitwise the non-speculative optimizer.
  {
    std::vector<float> p = w.w0, m(w.n, 0.0f), v(w.n, 0.0f), g32(w.n);
    int64_t t = 0;
    AdamWParams hp;
    int step = 0;
    for (const std::vector<uint16_t>* g : {&w.small, &w.large}) {
      ++step;
      for (size_t i = 0; i < w.n; ++i) g32[i] = optim::bf16_to_float((*g)[i]);
      optim::reference_adamw_step(hp, kClip, p.data(), m.data(), v.data(), g32.data(), w.buckets,
                                  &t);
      for (auto& r : runners) {
        run_step(*r, w, *g, 0.0);
        check_state(*r, p, m, v, step);
      }
    }
    res.correct = true;
  }

  // Timing: one untimed round, then interleaved.
  for (auto& r : runners) run_step(*r, w, w.small, options.backward_ms);
  std::vector<std::vector<double>> steps(runners.size()), backs(runners.size());
  for (int rep = 0; rep < options.repeats; ++rep) {
    for (size_t i = 0; i < runners.size(); ++i) {
      for (int s = 0; s < options.steps; ++s) {
        const auto [step_ms, backward_ms] = run_step(*runners[i], w, w.small, options.backward_ms);
        steps[i].push_back(step_ms);
        backs[i].push_back(backward_ms);
        runners[i]->result.samples_tail_ms.push_back(step_ms - backward_ms);
      }
    }
  }
  for (size_t i = 0; i < runners.size(); ++i) {
    StvBenchVariant& v = runners[i]->result;
    v.step_ms = median(steps[i]);
    v.backward_ms = median(backs[i]);
    v.tail_ms = median(v.samples_tail_ms);
    res.variants.push_back(v);
  }
  const StvBenchVariant& base = res.variants[0];
  res.stv_tail_ratio = base.tail_ms > 0 ? res.variants[1].tail_ms / base.tail_ms : 0.0;
  res.stv_step_ratio = base.step_ms > 0 ? res.variants[1].step_ms / base.step_ms : 0.0;
  return res;
}

std::string stv_bench_json(const StvBenchResult& r) {
  using bench_json::finite;
  using bench_json::finite_all;
  using bench_json::Json;
  Json j;
  j["schema"] = "spillway.bench.optim_offload/1";
  j["correct"] = r.correct;
  j["stv_tail_ratio"] = finite(r.stv_tail_ratio);
  j["stv_step_ratio"] = finite(r.stv_step_ratio);
  Json vs = Json::array();
  for (const StvBenchVariant& v : r.variants) {
    vs.push_back(Json{{"name", v.name},
                      {"device_buckets", v.device_buckets},
                      {"undo_bytes", v.undo_bytes},
                      {"step_ms", finite(v.step_ms)},
                      {"backward_ms", finite(v.backward_ms)},
                      {"tail_ms", finite(v.tail_ms)},
                      {"samples_tail_ms", finite_all(v.samples_tail_ms)}});
  }
  j["variants"] = vs;
  j["split"] = Json{{"device_buckets", r.options.device_buckets},
                    {"bucket_cpu_ms", finite(r.bucket_cpu_ms)},
                    {"bucket_lanes_ms", finite(r.bucket_lanes_ms)},
                    {"bucket_step_ms", finite(r.bucket_step_ms)},
                    {"bucket_link_ms", finite(r.bucket_link_ms)},
                    {"bucket_device_ms", finite(r.bucket_device_ms)},
                    {"predicted_end_ms", finite(r.predicted_end_ms)}};
  const StvBenchOptions& o = r.options;
  j["workload"] = Json{{"buckets", o.buckets},   {"bucket_elements", o.bucket_elements},
                       {"elements", r.elements}, {"backward_ms", o.backward_ms},
                       {"d2h_gbps", o.d2h_gbps}, {"h2d_gbps", o.h2d_gbps},
                       {"threads", o.threads},   {"repeats", o.repeats},
                       {"steps", o.steps},       {"seed", o.seed}};
  return j.dump(2) + "\n";
}

std::string format_stv_bench(const StvBenchResult& r) {
  const StvBenchOptions& o = r.options;
  std::string out = fmt::format(
      "optimizer offload: {} buckets x {} elements ({:.1f} M parameters), backward {:g} ms, "
      "link D2H {}, H2D {}, {} CPU threads, host backend\n"
      "correctness: every variant bitwise the non-speculative AdamW after a commit and a clip\n\n",
      o.buckets, o.bucket_elements, static_cast<double>(r.elements) / 1e6, o.backward_ms,
      o.d2h_gbps > 0 ? fmt::format("{:g} GB/s", o.d2h_gbps) : std::string("unthrottled"),
      o.h2d_gbps > 0 ? fmt::format("{:g} GB/s", o.h2d_gbps) : std::string("unthrottled"),
      o.threads);
  out += fmt::format("{:<18} {:>9} {:>12} {:>9} {:>9} {:>9}\n", "variant", "undo MB", "backward ms",
                     "step ms", "tail ms", "vs base");
  for (const StvBenchVariant& v : r.variants) {
    const double base = r.variants[0].tail_ms;
    out += fmt::format("{:<18} {:>9.1f} {:>12.1f} {:>9.1f} {:>9.1f} {:>9}\n", v.name,
                       static_cast<double>(v.undo_bytes) / 1048576.0, v.backward_ms, v.step_ms,
                       v.tail_ms, base > 0 ? fmt::format("{:.2f}x", v.tail_ms / base) : "-");
  }
  out += fmt::format(
      "\nstv: the tail after backward is {:.2f}x the non-speculative pipeline's, the step "
      "{:.2f}x (limit: a tail of 0, the step ending with backward).\n",
      r.stv_tail_ratio, r.stv_step_ratio);
  out += fmt::format(
      "split: per bucket the CPU path takes {:.2f} ms (norm lanes {:.2f}, step {:.2f}, link "
      "both ways {:.2f}), the device-side step {:.2f} ms; choose_device_buckets picks {} "
      "(predicted end {:.1f} ms){}.\n",
      r.bucket_cpu_ms, r.bucket_lanes_ms, r.bucket_step_ms, r.bucket_link_ms, r.bucket_device_ms,
      o.device_buckets, r.predicted_end_ms,
      o.device_buckets == 0 ? "; the split variant runs 1 to show its cost" : "");
  out +=
      "\nafter-backward: undo memory 0, every CPU step waits for the norm (copies still "
      "overlap backward).\ntail = step end (device weights ready) - backward end; medians. The "
      "host backend's \"device\" step runs on this CPU, so the split's gain here understates a "
      "GPU's.\n";
  return out;
}

}  // namespace spillway

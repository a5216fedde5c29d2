// The GEMM efficiency benchmark (see bench_gemm.hpp for the method).
#include "bench_gemm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <set>

#include "bench_json.hpp"
#include "cuda/gemm_cuda.hpp"
#include "nn/ops.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/inventory.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"

namespace spillway {

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kMaxBytes = 16e9;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 == 1 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

// Buffers of one shape: `groups` GEMMs (m x k) by (k x n), one after another.
struct GemmBuffers {
  int m = 0, n = 0, k = 0, groups = 1;
  std::vector<float> a, b, c;
};

int as_int(int64_t v, const char* what) {
  if (v < 1 || v > INT_MAX) SPILLWAY_FIELD_ERROR(what, v, "must be in [1, {}] for cblas", INT_MAX);
  return static_cast<int>(v);
}

GemmBuffers make_buffers(const OpShape& s, std::mt19937_64& rng) {
  GemmBuffers g;
  g.m = as_int(s.m, "m");
  g.n = as_int(s.n, "n");
  g.k = as_int(s.k, "k");
  g.groups = s.grouped() ? as_int(s.experts, "experts") : 1;
  const auto count = [&](int r, int c) {
    return static_cast<size_t>(r) * static_cast<size_t>(c) * static_cast<size_t>(g.groups);
  };
  std::uniform_real_distribution<float> u(-1.0F, 1.0F);
  g.a.resize(count(g.m, g.k));
  g.b.resize(count(g.k, g.n));
  for (float& x : g.a) x = u(rng);
  for (float& x : g.b) x = u(rng);
  g.c.assign(count(g.m, g.n), std::numeric_limits<float>::quiet_NaN());
  return g;
}

void run_gemms(GemmBuffers& g) {
  const size_t sa = static_cast<size_t>(g.m) * static_cast<size_t>(g.k);
  const size_t sb = static_cast<size_t>(g.k) * static_cast<size_t>(g.n);
  const size_t sc = static_cast<size_t>(g.m) * static_cast<size_t>(g.n);
  for (int e = 0; e < g.groups; ++e) {
    const auto i = static_cast<size_t>(e);
    nn::gemm<float>(false, false, g.m, g.n, g.k, 1.0F, g.a.data() + i * sa, g.k,
                    g.b.data() + i * sb, g.n, 0.0F, g.c.data() + i * sc, g.n);
  }
}

// Every output finite (the NaN poison overwritten) and `points` random elements per GEMM
// equal to a double dot product within 1e-4 x sqrt(k) relative.
int64_t check_gemms(const GemmBuffers& g, int points, std::mt19937_64& rng,
                    const std::string& label) {
  for (size_t i = 0; i < g.c.size(); ++i) {
    if (!std::isfinite(g.c[i])) {
      SPILLWAY_INPUT_ERROR("bench gemm: {}: output element {} is {} (not written or not finite)",
                           label, i, g.c[i]);
    }
  }
  std::uniform_int_distribution<int> row(0, g.m - 1);
  std::uniform_int_distribution<int> col(0, g.n - 1);
  const size_t sa = static_cast<size_t>(g.m) * static_cast<size_t>(g.k);
  const size_t sb = static_cast<size_t>(g.k) * static_cast<size_t>(g.n);
  const size_t sc = static_cast<size_t>(g.m) * static_cast<size_t>(g.n);
  const double tol = 1e-4 * std::sqrt(static_cast<double>(g.k));
  int64_t checked = 0;
  for (int e = 0; e < g.groups; ++e) {
    const auto ei = static_cast<size_t>(e);
    for (int p = 0; p < points; ++p) {
      const int i = row(rng);
      const int j = col(rng);
      double want = 0.0;
      double scale = 0.0;
      for (int l = 0; l < g.k; ++l) {
        const double x = g.a[ei * sa + static_cast<size_t>(i) * static_cast<size_t>(g.k) +
                             static_cast<size_t>(l)];
        const double y = g.b[ei * sb + static_cast<size_t>(l) * static_cast<size_t>(g.n) +
                             static_cast<size_t>(j)];
        want += x * y;
        scale += std::abs(x * y);
      }
      const double got =
          g.c[ei * sc + static_cast<size_t>(i) * static_cast<size_t>(g.n) + static_cast<size_t>(j)];
      if (std::abs(got - want) > tol * std::max(scale, 1.0)) {
        SPILLWAY_INPUT_ERROR(
            "bench gemm: {}: GEMM {} element ({}, {}) is {} but a double dot product gives {} "
            "(tolerance {} x {})",
            label, e, i, j, got, want, tol, scale);
      }
      ++checked;
    }
  }
  return checked;
}

std::string shape_label(const MeasuredOp& op) {
  const OpShape& s = op.shape;
  if (op.kind == MeasuredKind::kGroupedGemm) {
    return fmt::format("{} experts x ({} x {}) by ({} x {})", s.experts, s.m, s.k, s.k, s.n);
  }
  return fmt::format("({} x {}) by ({} x {})", s.m, s.k, s.k, s.n);
}

double shape_flops(const MeasuredOp& op) {
  const OpShape& s = op.shape;
  const double per =
      2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
  return s.grouped() ? per * static_cast<double>(s.experts) : per;
}

}  // namespace

std::vector<GemmShapeResult> gemm_bench_shapes(const GemmBenchOptions& o) {
  const ModelConfig model = load_model(o.model);
  ShardShape sh;
  sh.micro_batch = o.micro_batch;
  sh.seq_len = o.seq_len;
  sh.tp = o.tp;
  sh.ep = o.ep;
  sh.dtype = DType::kFp32;
  std::vector<GemmShapeResult> out;
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t>, size_t> seen;
  std::vector<LayerSpec> specs;
  for (const LayerSpec& l : model.layers) {
    if (std::find(specs.begin(), specs.end(), l) != specs.end()) continue;
    specs.push_back(l);
    if (l.mlp.kind == MlpKind::kMoe && l.mlp.experts % o.ep != 0)
      SPILLWAY_FIELD_ERROR("ep", o.ep, "must divide the routed experts ({})", l.mlp.experts);
    const LayerInventory inv = build_inventory(l, model.hidden, sh);
    for (const OpCost& op : inv.ops) {
      if (op.kind != OpKind::kGemm) continue;
      MeasuredOp m;
      m.kind = op.shape.grouped() ? MeasuredKind::kGroupedGemm : MeasuredKind::kGemm;
      m.shape = op.shape;
      // The time covers whole rows: tokens per expert as run (ceil).
      if (m.shape.grouped()) m.shape.tokens_per_expert = static_cast<double>(m.shape.m);
      m.dtype = DType::kFp32;
      const auto key = std::make_tuple(static_cast<int>(m.kind), m.shape.m, m.shape.n, m.shape.k,
                                       m.shape.experts);
      auto it = seen.find(key);
      if (it == seen.end()) {
        seen.emplace(key, out.size());
        GemmShapeResult r;
        r.ops = op.name;
        r.op = m;
        out.push_back(std::move(r));
      } else if (out[it->second].ops.find(op.name) == std::string::npos) {
        out[it->second].ops += ", " + op.name;
      }
    }
  }
  return out;
}

void summarize_gemm_bench(GemmBenchResult& r) {
  const GemmBenchOptions& o = r.options;
  r.square_gflops = median(r.samples_square_gflops);
  r.limit_measured = !(o.peak_gflops > 0.0);
  r.limit_gflops = r.limit_measured ? r.square_gflops : o.peak_gflops;
  for (GemmShapeResult& s : r.shapes) {
    s.op.ms = median(s.samples_ms);
    s.gflops = shape_flops(s.op) / (s.op.ms * 1e-3) / 1e9;
    // A shape faster than a measured limit counts as at the limit (efficiency <= 1).
    s.op.efficiency = std::min(1.0, s.gflops / r.limit_gflops);
  }
}

namespace {

// The CUDA twin: the same shapes, in bf16 on the GPU (bench/cuda/gemm_cuda.hpp).
GemmBenchResult run_cuda(GemmBenchResult r) {
  GemmBenchOptions& o = r.options;
  if (!(o.peak_gflops > 0.0)) {
    if (o.hardware.empty()) {
      SPILLWAY_INPUT_ERROR(
          "bench gemm --backend cuda: give --hardware PROFILE (its dense bf16 peak is the "
          "limit efficiencies are taken against) or --peak-gflops");
    }
    const HardwareProfile hw = load_hardware(o.hardware);
    o.peak_gflops = hw.bf16_dense.value * 1e3;
    r.limit_source = fmt::format("{}'s dense bf16 peak", hw.name);
  } else {
    r.limit_source = "--peak-gflops";
  }
  if (!cuda_bench::compiled()) {
    (void)cuda_bench::time_bf16_gemms({}, o.square, o.repeats, o.check_points, o.seed);
  }
  std::vector<cuda_bench::GemmShape> shapes;
  for (GemmShapeResult& s : r.shapes) {
    s.op.dtype = DType::kBf16;
    const OpShape& sh = s.op.shape;
    shapes.push_back({sh.m, sh.n, sh.k, sh.grouped() ? sh.experts : 1});
  }
  const cuda_bench::GemmTiming t =
      cuda_bench::time_bf16_gemms(shapes, o.square, o.repeats, o.check_points, o.seed);
  r.device = "cuda: " + t.device + ", cuBLAS bf16 (fp32 accumulation)";
  r.elements_checked = t.elements_checked;
  const double square_flops = 2.0 * std::pow(static_cast<double>(o.square), 3.0);
  for (double ms : t.square_ms) r.samples_square_gflops.push_back(square_flops / ms / 1e6);
  for (size_t i = 0; i < r.shapes.size(); ++i) r.shapes[i].samples_ms = t.shape_ms[i];
  r.correct = true;
  summarize_gemm_bench(r);
  return r;
}

}  // namespace

GemmBenchResult run_gemm_bench(const GemmBenchOptions& options) {
  GemmBenchResult r;
  r.options = options;
  if (r.options.seed == 0) r.options.seed = std::random_device{}() | 1u;
  const GemmBenchOptions& o = r.options;
  if (o.repeats < 1) SPILLWAY_FIELD_ERROR("repeats", o.repeats, "must be >= 1");
  if (o.threads < 1) SPILLWAY_FIELD_ERROR("threads", o.threads, "must be >= 1");
  if (o.backend != "host" && o.backend != "cuda")
    SPILLWAY_FIELD_ERROR("backend", fmt::format("'{}'", o.backend), "must be host or cuda");
  if (o.backend == "cuda") {
    r.shapes = gemm_bench_shapes(o);
    return run_cuda(std::move(r));
  }
  r.device = fmt::format("host backend (cblas sgemm, fp32, {} thread(s))", o.threads);
  nn::set_blas_threads(o.threads);
  std::mt19937_64 rng(o.seed);
  r.shapes = gemm_bench_shapes(o);

  // Host memory first: inputs and outputs of every shape, 4 bytes an element.
  double bytes = 3.0 * std::pow(static_cast<double>(o.square), 2.0) * 4.0;
  for (const GemmShapeResult& s : r.shapes) {
    const OpShape& sh = s.op.shape;
    const double groups = sh.grouped() ? static_cast<double>(sh.experts) : 1.0;
    const auto m = static_cast<double>(sh.m);
    const auto n = static_cast<double>(sh.n);
    const auto k = static_cast<double>(sh.k);
    bytes += groups * (m * k + k * n + m * n) * 4.0;
  }
  if (bytes > kMaxBytes) {
    SPILLWAY_INPUT_ERROR(
        "bench gemm: the shapes of {} at micro-batch {} x seq {} need {:.1f} GB of host memory "
        "(limit {:.0f} GB); lower --seq-len or --micro-batch, or raise --ep",
        o.model, o.micro_batch, o.seq_len, bytes / 1e9, kMaxBytes / 1e9);
  }

  // Buffers, poisoned outputs, then the check of every shape before anything is timed.
  OpShape square;
  square.m = square.n = square.k = o.square;
  GemmBuffers base = make_buffers(square, rng);
  std::vector<GemmBuffers> bufs;
  for (const GemmShapeResult& s : r.shapes) bufs.push_back(make_buffers(s.op.shape, rng));
  run_gemms(base);
  r.elements_checked += check_gemms(base, o.check_points, rng, "baseline");
  for (size_t i = 0; i < bufs.size(); ++i) {
    run_gemms(bufs[i]);
    r.elements_checked += check_gemms(bufs[i], o.check_points, rng, shape_label(r.shapes[i].op));
  }
  r.correct = true;

  // Timed: the baseline and every shape, interleaved, `repeats` times.
  const double square_flops = 2.0 * std::pow(static_cast<double>(o.square), 3.0);
  for (int rep = 0; rep < o.repeats; ++rep) {
    auto t0 = Clock::now();
    run_gemms(base);
    r.samples_square_gflops.push_back(square_flops / seconds_since(t0) / 1e9);
    for (size_t i = 0; i < bufs.size(); ++i) {
      t0 = Clock::now();
      run_gemms(bufs[i]);
      r.shapes[i].samples_ms.push_back(seconds_since(t0) * 1e3);
    }
  }
  summarize_gemm_bench(r);
  r.limit_source = r.limit_measured ? "the baseline's rate; give --peak-gflops for the "
                                      "machine's theoretical peak"
                                    : "--peak-gflops";
  return r;
}

std::string gemm_bench_json(const GemmBenchResult& r) {
  using bench_json::finite;
  using bench_json::Json;
  Json ops = Json::array();
  for (const GemmShapeResult& s : r.shapes) {
    Json j;
    j["kind"] = to_string(s.op.kind);
    if (s.op.kind == MeasuredKind::kGroupedGemm) {
      j["experts"] = s.op.shape.experts;
      j["tokens_per_expert"] = s.op.shape.tokens_per_expert;
    } else {
      j["m"] = s.op.shape.m;
    }
    j["n"] = s.op.shape.n;
    j["k"] = s.op.shape.k;
    j["dtype"] = to_string(s.op.dtype);
    j["ms"] = finite(s.op.ms);
    j["efficiency"] = finite(s.op.efficiency);
    j["gflops"] = finite(s.gflops);
    j["ops"] = s.ops;
    j["samples_ms"] = bench_json::finite_all(s.samples_ms);
    ops.push_back(j);
  }
  Json doc;
  doc["schema"] = "spillway.profile/1";
  doc["ops"] = ops;
  const GemmBenchOptions& o = r.options;
  doc["bench"] = {
      {"what", o.backend == "cuda" ? "spillway bench gemm: " + r.device
                                   : std::string("spillway bench gemm: host backend (cblas "
                                                 "sgemm), fp32")},
      {"model", o.model},
      {"micro_batch", o.micro_batch},
      {"seq_len", o.seq_len},
      {"tp", o.tp},
      {"ep", o.ep},
      {"threads", o.threads},
      {"seed", o.seed},
      {"repeats", o.repeats},
      {"elements_checked", r.elements_checked},
      {"baseline_square", o.square},
      {"baseline_gflops", finite(r.square_gflops)},
      {"samples_baseline_gflops", bench_json::finite_all(r.samples_square_gflops)},
      {"limit_gflops", finite(r.limit_gflops)},
      {"limit", o.backend == "cuda" ? r.limit_source
                : r.limit_measured  ? "the baseline's rate (no --peak-gflops)"
                                    : "--peak-gflops"}};
  return doc.dump(2) + "\n";
}

std::string format_gemm_bench(const GemmBenchResult& r) {
  const GemmBenchOptions& o = r.options;
  std::string out = fmt::format("bench gemm: {} mb {} x seq {} tp {} ep {}, {}, seed {}\n", o.model,
                                o.micro_batch, o.seq_len, o.tp, o.ep, r.device, o.seed);
  out += fmt::format(
      "  checked     {} output elements against double dot products (all outputs "
      "finite)\n",
      r.elements_checked);
  out += fmt::format("  baseline    square GEMM {}^3: {:.1f} GFLOP/s (median of {})\n", o.square,
                     r.square_gflops, r.samples_square_gflops.size());
  out += fmt::format("  limit       {:.1f} GFLOP/s ({})\n", r.limit_gflops, r.limit_source);
  out += fmt::format("\n  {:<13} {:<40} {:>8} {:>10} {:>9} {:>9}  {}\n", "kind", "shape", "x", "ms",
                     "GFLOP/s", "eff", "ops");
  for (const GemmShapeResult& s : r.shapes) {
    out +=
        fmt::format("  {:<13} {:<40} {:>8.0f} {:>10.3f} {:>9.1f} {:>9.3f}  {}\n",
                    to_string(s.op.kind), shape_label(s.op), curve_abscissa(s.op.kind, s.op.shape),
                    s.op.ms, s.gflops, s.op.efficiency, s.ops);
  }
  out +=
      "\n  x is the curve's abscissa (min(M, N, K); grouped: min(tokens per expert, N, K)); eff "
      "= GFLOP/s over the limit. Write the points with --json FILE and plan with --profile "
      "FILE (with a hardware profile of this machine).\n";
  return out;
}

}  // namespace spillway

// HybridGEMM's benchmark (see bench_hybrid_gemm.hpp for the method).
#include "bench_hybrid_gemm.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>

#include "bench_json.hpp"
#include "core/stats.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"
#include "spillway/device/device.hpp"
#include "spillway/device/device_math.hpp"

namespace spillway {

namespace {

// What runs the GEMMs: the counted run (untimed), the uncounted timed run, and one sample
// of the limit.
class Runner {
 public:
  virtual ~Runner() = default;
  virtual std::string name() const = 0;
  virtual std::string limit() const = 0;
  // The run that counts its traffic; *o (m x n, poisoned by the caller) gets O.
  virtual HybridGemmTraffic counted(const HybridGemmProblem& p, std::vector<float>* o) = 0;
  // One uncounted run, in ms.
  virtual double timed_ms(const HybridGemmProblem& p) = 0;
  // One copy of the W bytes, GB/s (1e9 bytes/s).
  virtual double copy_gbps() = 0;
};

// The host backend: hybrid_gemm_host on host memory (the host backend's device memory).
class HostRunner final : public Runner {
 public:
  HostRunner(const std::vector<float>& x, const std::vector<unsigned char>& w, int64_t m, int64_t n)
      : x_(x), w_(w), o_(static_cast<size_t>(m * n)), copy_(w.size()) {}
  std::string name() const override {
    return "host (hybrid_gemm_host: tile products through BLAS on this CPU)";
  }
  std::string limit() const override {
    return "memcpy of the W bytes between two pre-touched host buffers, single thread";
  }
  HybridGemmTraffic counted(const HybridGemmProblem& p, std::vector<float>* o) override {
    return hybrid_gemm_host(p, x_.data(), w_.data(), o->data());
  }
  double timed_ms(const HybridGemmProblem& p) override {
    const auto t0 = Clock::now();
    (void)hybrid_gemm_host(p, x_.data(), w_.data(), o_.data());
    return ms_since(t0);
  }
  double copy_gbps() override {
    const auto t0 = Clock::now();
    std::memcpy(copy_.data(), w_.data(), w_.size());
    return static_cast<double>(w_.size()) / seconds_since(t0) / 1e9;
  }

 private:
  const std::vector<float>& x_;
  const std::vector<unsigned char>& w_;
  std::vector<float> o_;
  std::vector<unsigned char> copy_;
};

UniqueMemory checked_memory(Device& d, size_t bytes, MemoryKind kind, const char* what) {
  UniqueMemory m(d, std::max<size_t>(bytes, 1), kind);
  if (!m)
    SPILLWAY_INPUT_ERROR("hybrid-gemm bench: cannot allocate {} of {} for {}: {}",
                         to_string(Bytes(static_cast<int64_t>(bytes))), to_string(kind), what,
                         m.reason());
  return m;
}

// CUDA device 0: X and O in device memory, W in mapped host memory the kernels read in
// place; the limit is a pinned copy of the W bytes to device memory on an H2D stream.
class CudaRunner final : public Runner {
 public:
  CudaRunner(std::unique_ptr<Device> device, const std::vector<float>& x,
             const std::vector<unsigned char>& w, int64_t m, int64_t n)
      : device_(std::move(device)),
        compute_(*device_, StreamRole::kCompute),
        h2d_(*device_, StreamRole::kH2D),
        w_bytes_(w.size()),
        o_bytes_(static_cast<size_t>(m * n) * sizeof(float)),
        x_(checked_memory(*device_, x.size() * sizeof(float), MemoryKind::kDevice, "X")),
        o_(checked_memory(*device_, o_bytes_, MemoryKind::kDevice, "O")),
        w_(checked_memory(*device_, w_bytes_, MemoryKind::kMappedHost, "W")),
        pinned_(checked_memory(*device_, w_bytes_, MemoryKind::kPinnedHost, "the copy's source")),
        copy_(checked_memory(*device_, w_bytes_, MemoryKind::kDevice, "the copy's destination")) {
    std::memcpy(w_.get(), w.data(), w_bytes_);
    std::memcpy(pinned_.get(), w.data(), w_bytes_);
    device_->copy_async(x_.get(), x.data(), x.size() * sizeof(float), compute_);
    device_->synchronize(compute_);
  }
  std::string name() const override { return device_->name(); }
  std::string limit() const override {
    return "pinned host -> device copy of the W bytes on a copy stream of the device's own";
  }
  HybridGemmTraffic counted(const HybridGemmProblem& p, std::vector<float>* o) override {
    device_->copy_async(o_.get(), o->data(), o_bytes_, compute_);  // the poison
    HybridGemmTraffic t;
    std::string why;
    if (!hybrid_gemm_counted_on_device(*device_, p, x(), w_.get(), out(), compute_, &t, &why))
      SPILLWAY_INPUT_ERROR("hybrid-gemm bench --backend cuda: {}", why);
    device_->copy_async(o->data(), o_.get(), o_bytes_, compute_);
    device_->synchronize(compute_);
    return t;
  }
  double timed_ms(const HybridGemmProblem& p) override {
    device_->synchronize(compute_);
    std::string why;
    const auto t0 = Clock::now();
    if (!hybrid_gemm_on_device(*device_, p, x(), w_.get(), out(), compute_, &why))
      SPILLWAY_INPUT_ERROR("hybrid-gemm bench --backend cuda: {}", why);
    device_->synchronize(compute_);
    return ms_since(t0);
  }
  double copy_gbps() override {
    const auto t0 = Clock::now();
    device_->copy_async(copy_.get(), pinned_.get(), w_bytes_, h2d_);
    device_->synchronize(h2d_);
    return static_cast<double>(w_bytes_) / seconds_since(t0) / 1e9;
  }

 private:
  const float* x() const { return static_cast<const float*>(x_.get()); }
  float* out() const { return static_cast<float*>(o_.get()); }

  std::unique_ptr<Device> device_;  // first: everything below is freed before it goes
  UniqueStream compute_, h2d_;
  size_t w_bytes_, o_bytes_;
  UniqueMemory x_;       // (m, k) fp32, device memory
  UniqueMemory o_;       // (m, n) fp32, device memory
  UniqueMemory w_;       // (n, k) of the dtype, mapped host memory
  UniqueMemory pinned_;  // W's bytes, pinned: the copy's source
  UniqueMemory copy_;    // W's bytes, device memory: the copy's destination
};

void validate(const HybridGemmBenchOptions& o) {
  if (o.backend != "host" && o.backend != "cuda")
    SPILLWAY_FIELD_ERROR("backend", o.backend, "must be host or cuda");
  if (o.alphas.empty()) SPILLWAY_FIELD_ERROR("alphas", "empty", "give at least one alpha");
  for (double a : o.alphas)
    if (!(a >= 0.0 && a <= 1.0)) SPILLWAY_FIELD_ERROR("alphas", a, "each must be in [0, 1]");
  if (o.repeats < 1) SPILLWAY_FIELD_ERROR("repeats", o.repeats, "must be >= 1");
  if (o.check_points < 1) SPILLWAY_FIELD_ERROR("check_points", o.check_points, "must be >= 1");
}

HybridGemmProblem problem_at(const HybridGemmBenchOptions& o, double alpha) {
  HybridGemmProblem p{o.m, o.n, o.k, o.w_dtype, alpha, o.tiles, o.tiles};
  p.invariant = o.invariant;
  return p;
}

// Refuses inputs this machine cannot hold (the copies the backend makes of W included).
void check_memory(const HybridGemmBenchOptions& o, int64_t w_bytes) {
  const double ws = static_cast<double>(w_bytes);
  const double xo = 4.0 * static_cast<double>(o.m) * static_cast<double>(o.k + 2 * o.n);
  const double needed = (o.backend == "cuda" ? 3.0 : 2.0) * ws + xo;
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return;
  const double physical = static_cast<double>(pages) * static_cast<double>(page);
  if (needed > 0.75 * physical)
    SPILLWAY_INPUT_ERROR(
        "hybrid-gemm bench: {}x{}x{} needs {} of host memory (W and its copies, X, O); this "
        "machine has {}: use a smaller --n or --k",
        o.m, o.n, o.k, to_string(Bytes(static_cast<int64_t>(needed))),
        to_string(Bytes(static_cast<int64_t>(physical))));
}

double w_at(const std::vector<unsigned char>& w, DType t, size_t i) {
  if (t == DType::kBf16) {
    uint16_t b = 0;
    std::memcpy(&b, w.data() + 2 * i, 2);
    return bf16_to_float(b);
  }
  float f = 0.0f;
  std::memcpy(&f, w.data() + 4 * i, 4);
  return f;
}

// O finite everywhere and within the bound at check_points random elements (Note
// [HybridGEMM arithmetic]: 2 K 2^-24 sum |x w|; CUDA twice that). Returns the largest
// |error| / bound.
double check_output(const HybridGemmProblem& p, const std::vector<float>& x,
                    const std::vector<unsigned char>& w, const std::vector<float>& o, int points,
                    double bound_factor, std::mt19937_64& rng) {
  for (size_t e = 0; e < o.size(); ++e)
    if (!std::isfinite(o[e]))
      SPILLWAY_INPUT_ERROR("hybrid-gemm bench: alpha {}: O[{}, {}] is {} (not written?)", p.alpha,
                           static_cast<int64_t>(e) / p.n, static_cast<int64_t>(e) % p.n, o[e]);
  std::uniform_int_distribution<int64_t> row(0, p.m - 1), col(0, p.n - 1);
  double worst = 0.0;
  for (int c = 0; c < points; ++c) {
    const int64_t i = row(rng), j = col(rng);
    double sum = 0.0, mag = 0.0;
    for (int64_t kk = 0; kk < p.k; ++kk) {
      const double v = static_cast<double>(x[static_cast<size_t>(i * p.k + kk)]) *
                       w_at(w, p.w_dtype, static_cast<size_t>(j * p.k + kk));
      sum += v;
      mag += std::fabs(v);
    }
    const double got = o[static_cast<size_t>(i * p.n + j)];
    const double bound = bound_factor * static_cast<double>(p.k) * std::ldexp(1.0, -24) * mag;
    const double err = std::fabs(got - sum);
    if (err > bound)
      SPILLWAY_INPUT_ERROR(
          "hybrid-gemm bench: alpha {}: O[{}, {}] is {}, the double dot product {} (|error| "
          "{:.3g} > bound {:.3g})",
          p.alpha, i, j, got, sum, err, bound);
    if (bound > 0.0) worst = std::max(worst, err / bound);
  }
  return worst;
}

bool same(const GemmTraffic& a, const GemmTraffic& b) {
  return a.link_bytes == b.link_bytes && a.hbm_read_bytes == b.hbm_read_bytes &&
         a.hbm_write_bytes == b.hbm_write_bytes;
}

double mb(int64_t bytes) {
  return static_cast<double>(bytes) / 1e6;
}

}  // namespace

bool HybridGemmBenchResult::all_equal() const {
  for (const HybridGemmBenchRow& r : rows)
    if (!r.equal) return false;
  return true;
}

HybridGemmBenchResult run_hybrid_gemm_bench(const HybridGemmBenchOptions& o) {
  validate(o);
  for (double a : o.alphas) (void)hybrid_gemm_traffic(problem_at(o, a));  // checks the problem
  const int64_t w_bytes = checked_mul(checked_mul(o.n, o.k, "hybrid-gemm bench: W"),
                                      dtype_bytes(o.w_dtype), "hybrid-gemm bench: W bytes");
  check_memory(o, w_bytes);

  HybridGemmBenchResult r;
  r.options = o;
  r.w_bytes = w_bytes;
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(o.m * o.k));
  for (float& v : x) v = u(rng);
  std::vector<unsigned char> w(static_cast<size_t>(w_bytes));
  for (size_t i = 0; i < static_cast<size_t>(o.n * o.k); ++i) {
    if (o.w_dtype == DType::kBf16) {
      const uint16_t b = float_to_bf16(u(rng));
      std::memcpy(w.data() + 2 * i, &b, 2);
    } else {
      const float f = u(rng);
      std::memcpy(w.data() + 4 * i, &f, 4);
    }
  }

  std::unique_ptr<Runner> runner;
  if (o.backend == "cuda") {
    std::string why;
    std::unique_ptr<Device> cuda = make_cuda_device(0, &why);
    if (!cuda) SPILLWAY_INPUT_ERROR("hybrid-gemm bench --backend cuda: {}", why);
    runner = std::make_unique<CudaRunner>(std::move(cuda), x, w, o.m, o.n);
  } else {
    runner = std::make_unique<HostRunner>(x, w, o.m, o.n);
  }
  r.device = runner->name();
  r.limit = runner->limit();

  // Counted and checked first, nothing timed: the runs also warm up the kernels and W.
  const double bound_factor = o.backend == "cuda" ? 4.0 : 2.0;
  std::vector<float> out(static_cast<size_t>(o.m * o.n));
  for (double alpha : o.alphas) {
    const HybridGemmProblem p = problem_at(o, alpha);
    HybridGemmBenchRow row;
    row.alpha = alpha;
    row.closed_form = hybrid_gemm_traffic(p);
    std::fill(out.begin(), out.end(), std::numeric_limits<float>::quiet_NaN());
    row.counted = runner->counted(p, &out);
    row.equal = row.counted.n_symmetric == row.closed_form.n_symmetric &&
                same(row.counted.symmetric, row.closed_form.symmetric) &&
                same(row.counted.asymmetric, row.closed_form.asymmetric);
    row.max_error_over_bound = check_output(p, x, w, out, o.check_points, bound_factor, rng);
    r.elements_checked += o.check_points;
    r.rows.push_back(row);
  }
  (void)runner->copy_gbps();  // warm-up

  for (int rep = 0; rep < o.repeats; ++rep) {
    r.copy_samples_gbps.push_back(runner->copy_gbps());
    for (HybridGemmBenchRow& row : r.rows)
      row.samples_ms.push_back(runner->timed_ms(problem_at(o, row.alpha)));
  }
  r.copy_gbps = median(r.copy_samples_gbps);
  for (HybridGemmBenchRow& row : r.rows) {
    row.ms = median(row.samples_ms);
    row.link_gbps = static_cast<double>(row.closed_form.total().link_bytes) / (row.ms * 1e6);
    row.fraction_of_copy = row.link_gbps / r.copy_gbps;
  }
  return r;
}

void check_hybrid_gemm_bench(const HybridGemmBenchResult& r) {
  for (const HybridGemmBenchRow& row : r.rows) {
    if (row.equal) continue;
    const HybridGemmTraffic& c = row.counted;
    const HybridGemmTraffic& f = row.closed_form;
    const struct {
      const char* what;
      int64_t counted, closed_form;
    } fields[] = {
        {"split n_symmetric", c.n_symmetric, f.n_symmetric},
        {"symmetric link bytes", c.symmetric.link_bytes, f.symmetric.link_bytes},
        {"symmetric HBM read bytes", c.symmetric.hbm_read_bytes, f.symmetric.hbm_read_bytes},
        {"symmetric HBM write bytes", c.symmetric.hbm_write_bytes, f.symmetric.hbm_write_bytes},
        {"asymmetric link bytes", c.asymmetric.link_bytes, f.asymmetric.link_bytes},
        {"asymmetric HBM read bytes", c.asymmetric.hbm_read_bytes, f.asymmetric.hbm_read_bytes},
        {"asymmetric HBM write bytes", c.asymmetric.hbm_write_bytes, f.asymmetric.hbm_write_bytes},
    };
    for (const auto& field : fields)
      if (field.counted != field.closed_form)
        SPILLWAY_INPUT_ERROR(
            "bench hybrid-gemm: alpha {}: the {} counted on {} are {}, the closed form's {}",
            row.alpha, field.what, r.device, field.counted, field.closed_form);
  }
}

std::string hybrid_gemm_bench_json(const HybridGemmBenchResult& r) {
  using bench_json::finite;
  using bench_json::finite_all;
  using bench_json::Json;
  const HybridGemmBenchOptions& o = r.options;
  const auto traffic = [](const HybridGemmTraffic& t) {
    const auto path = [](const GemmTraffic& g) {
      return Json{{"link_bytes", g.link_bytes},
                  {"hbm_read_bytes", g.hbm_read_bytes},
                  {"hbm_write_bytes", g.hbm_write_bytes}};
    };
    const GemmTraffic total = t.total();
    return Json{{"n_symmetric", t.n_symmetric},
                {"symmetric", path(t.symmetric)},
                {"asymmetric", path(t.asymmetric)},
                {"link_bytes", total.link_bytes},
                {"hbm_bytes", total.hbm_bytes()}};
  };
  Json j;
  j["schema"] = "spillway.bench.hybrid-gemm/1";
  j["backend"] = o.backend;
  j["device"] = r.device;
  j["all_equal"] = r.all_equal();
  j["problem"] = Json{{"m", o.m},
                      {"n", o.n},
                      {"k", o.k},
                      {"w_dtype", to_string(o.w_dtype)},
                      {"tiles", fmt::format("{}x{}x{}", o.tiles.m, o.tiles.n, o.tiles.k)},
                      {"invariant", o.invariant},
                      {"w_bytes", r.w_bytes}};
  j["limit"] = Json{{"what", r.limit},
                    {"copy_gbps", finite(r.copy_gbps)},
                    {"samples_gbps", finite_all(r.copy_samples_gbps)}};
  j["gbps_convention"] = "1e9 bytes per second; link_gbps = the run's link bytes / its median time";
  j["correct"] = true;  // a wrong output throws
  j["elements_checked"] = r.elements_checked;
  j["repeats"] = o.repeats;
  j["seed"] = o.seed;
  Json rows = Json::array();
  for (const HybridGemmBenchRow& row : r.rows)
    rows.push_back(Json{{"alpha", row.alpha},
                        {"counted", traffic(row.counted)},
                        {"closed_form", traffic(row.closed_form)},
                        {"equal", row.equal},
                        {"ms", finite(row.ms)},
                        {"link_gbps", finite(row.link_gbps)},
                        {"fraction_of_copy", finite(row.fraction_of_copy)},
                        {"max_error_over_bound", finite(row.max_error_over_bound)},
                        {"samples_ms", finite_all(row.samples_ms)}});
  j["alphas"] = rows;
  return j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

std::string format_hybrid_gemm_bench(const HybridGemmBenchResult& r) {
  const HybridGemmBenchOptions& o = r.options;
  std::string out;
  out += fmt::format("HybridGEMM benchmark on {}\n", r.device);
  out += fmt::format(
      "problem: O ({} x {}) = X ({} x {}) * W^T, W ({} x {}) {}: {} bytes ({:.3f} MB), tiles "
      "{}x{}x{} on both paths{}; {} repeats, the copy and every alpha interleaved; figures are "
      "medians\n",
      o.m, o.n, o.m, o.k, o.n, o.k, to_string(o.w_dtype), r.w_bytes, mb(r.w_bytes), o.tiles.m,
      o.tiles.n, o.tiles.k, o.invariant ? ", invariant split (as the serving engine)" : "",
      o.repeats);
  out += fmt::format(
      "correctness: every output finite and {} random elements per alpha within Note "
      "[HybridGEMM arithmetic]'s bound of a double dot product ({} checked; inputs seed {})\n",
      o.check_points, r.elements_checked, o.seed);
  out += fmt::format("limit: {}: {:.2f} GB/s\n\n", r.limit, r.copy_gbps);
  out += fmt::format("{:>6} {:>18} {:>16} {:>6} {:>10} {:>10} {:>8}\n", "alpha",
                     "link MB (counted)", "closed form MB", "equal", "ms", "link GB/s", "of copy");
  for (const HybridGemmBenchRow& row : r.rows)
    out +=
        fmt::format("{:>6.3g} {:>18.3f} {:>16.3f} {:>6} {:>10.3f} {:>10.2f} {:>8.3f}\n", row.alpha,
                    mb(row.counted.total().link_bytes), mb(row.closed_form.total().link_bytes),
                    row.equal ? "yes" : "NO", row.ms, row.link_gbps, row.fraction_of_copy);
  out +=
      "\nMB: 1e6 bytes; GB/s: 1e9 bytes/s. equal: all six counters (link, HBM read, HBM write "
      "of each path) equal to the closed form (Note [HybridGEMM dataflows]), not the link's "
      "alone. link GB/s: the run's link bytes over its time; of copy: that over the copy of "
      "the W bytes measured in the same run.\n";
  return out;
}

}  // namespace spillway

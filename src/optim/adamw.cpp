// CPU AdamW: the per-step scalars, the scalar reference, the bf16/fp16 conversions and
// the thread pool that tiles the SIMD step (the SIMD kernel is arch/adamw_hwy.cpp).
//
// Invariants: the pool's threads and synchronisation are created once in the
// constructor; step() allocates nothing; every element of p, m, v (and copy_out) in
// [0, n) is written exactly once per step, by exactly one thread.
//
// Note [AdamW operation order] is in spillway/device/device_math.hpp, with the element update
// (adamw_element) that the scalar reference here, the host backend and the CUDA kernel
// share; the SIMD step (arch/adamw_hwy.cpp) follows it lane by lane. Scalar and SIMD must
// agree to the bit on every Highway target (with or without FMA), so both files are
// compiled with -ffp-contract=off and the compiler fuses no multiply-add either.
#include <numa.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "spillway/core/error.hpp"
#include "spillway/device/device_math.hpp"
#include "spillway/optim/optim.hpp"

namespace spillway::optim {

AdamWStepScalars adamw_step_scalars(const AdamWParams& hp, int64_t step) {
  SPILLWAY_CHECK(step >= 1, "adamw: step is {}; must be >= 1", step);
  SPILLWAY_CHECK(std::isfinite(hp.lr) && hp.lr >= 0.0, "adamw: lr is {}; must be >= 0", hp.lr);
  SPILLWAY_CHECK(hp.beta1 >= 0.0 && hp.beta1 < 1.0, "adamw: beta1 is {}; must be in [0, 1)",
                 hp.beta1);
  SPILLWAY_CHECK(hp.beta2 >= 0.0 && hp.beta2 < 1.0, "adamw: beta2 is {}; must be in [0, 1)",
                 hp.beta2);
  SPILLWAY_CHECK(std::isfinite(hp.eps) && hp.eps > 0.0, "adamw: eps is {}; must be > 0", hp.eps);
  SPILLWAY_CHECK(std::isfinite(hp.weight_decay) && hp.weight_decay >= 0.0,
                 "adamw: weight_decay is {}; must be >= 0", hp.weight_decay);
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(hp.beta1, t);
  const double bc2 = 1.0 - std::pow(hp.beta2, t);
  AdamWStepScalars s{};
  s.step_size = static_cast<float>(hp.lr / bc1);
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  s.decay = static_cast<float>(1.0 - hp.lr * hp.weight_decay);
  s.beta1 = static_cast<float>(hp.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - hp.beta1);
  s.beta2 = static_cast<float>(hp.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
  s.eps = static_cast<float>(hp.eps);
  return s;
}

namespace {

// The arrays of one call as byte ranges: an output (p, m, v in place, p_out, m_out, v_out
// out of place, copy_out) overlapping any other array partially would be read after the
// step wrote it, or write another's elements; only the same range (in place) may alias.
struct ByteRange {
  const char* field;
  uintptr_t begin, end;
  bool output;
};

void check_no_partial_overlap(const AdamWArgs& a) {
  const bool out_of_place = a.p_out != nullptr;
  const size_t g_bytes = a.grad_type == GradType::kBf16 ? 2 : 4;
  auto range = [&](const char* field, const void* p, size_t elem_bytes, bool output) {
    const auto b = reinterpret_cast<uintptr_t>(p);
    return ByteRange{field, b, b + a.n * elem_bytes, output};
  };
  ByteRange r[8];
  size_t k = 0;
  r[k++] = range("p", a.p, 4, !out_of_place);
  r[k++] = range("m", a.m, 4, !out_of_place);
  r[k++] = range("v", a.v, 4, !out_of_place);
  r[k++] = range("g", a.g, g_bytes, false);
  if (out_of_place) {
    r[k++] = range("p_out", a.p_out, 4, true);
    r[k++] = range("m_out", a.m_out, 4, true);
    r[k++] = range("v_out", a.v_out, 4, true);
  }
  if (a.copy_out != nullptr)
    r[k++] = range("copy_out", a.copy_out, copy_type_bytes(a.copy_type), true);
  for (size_t i = 0; i < k; ++i) {
    for (size_t j = 0; j < k; ++j) {
      if (i == j || !r[i].output || (r[j].output && j < i)) continue;  // each pair once
      const bool overlap = r[i].begin < r[j].end && r[j].begin < r[i].end;
      const bool same = r[i].begin == r[j].begin && r[i].end == r[j].end;
      if (overlap && !same) {
        SPILLWAY_FIELD_ERROR(r[i].field, reinterpret_cast<const void*>(r[i].begin),
                             "overlaps {} partially ([{:#x}, {:#x}) and [{:#x}, {:#x}), n = {}): "
                             "an output must be disjoint from every other array or be the same",
                             r[j].field, r[i].begin, r[i].end, r[j].begin, r[j].end, a.n);
      }
    }
  }
}

}  // namespace

void check_adamw_args(const AdamWArgs& a) {
  if (a.n == 0) return;
  SPILLWAY_CHECK(a.p != nullptr && a.m != nullptr && a.v != nullptr && a.g != nullptr,
                 "adamw: p, m, v and g must be non-null for n = {}", a.n);
  SPILLWAY_CHECK((a.copy_type == CopyType::kNone) == (a.copy_out == nullptr),
                 "adamw: copy_out must be set exactly when copy_type is not kNone");
  SPILLWAY_CHECK(
      (a.p_out == nullptr) == (a.m_out == nullptr) && (a.p_out == nullptr) == (a.v_out == nullptr),
      "adamw: p_out, m_out and v_out must be set together or not at all");
  // A NaN or infinite scale makes every weight NaN: the caller's bug, not the data's (a
  // clipping coefficient is in [0, 1]; a loss scale's inverse is finite and > 0).
  if (!(std::isfinite(a.grad_scale) && a.grad_scale >= 0.0f)) {
    SPILLWAY_FIELD_ERROR("grad_scale", a.grad_scale, "must be finite and >= 0");
  }
  check_no_partial_overlap(a);
}

// Conversions. bf16 and the normal range of fp16 round to nearest even by adding
// 0x7FF..F plus the lowest kept bit and truncating; fp16 subnormals round through one
// float addition of 0.5f, whose unit in the last place is the fp16 subnormal step
// 2^-24. A NaN stays a quiet NaN of the same sign with the top payload bits (what
// x86's F16C instructions give); overflow goes to inf.

uint16_t float_to_fp16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t a = bits & 0x7FFFFFFFu;
  uint32_t h;
  if (a > 0x7F800000u) {
    h = 0x7E00u | ((a >> 13) & 0x3FFu);
  } else if (a >= 0x477FF000u) {  // >= 65520: rounds past 65504, the largest finite
    h = 0x7C00u;
  } else if (a >= 0x38800000u) {         // >= 2^-14: normal
    const uint32_t r = a - 0x38000000u;  // rebias the exponent 127 -> 15
    h = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;
  } else {
    const float f = std::bit_cast<float>(a) + 0.5f;
    h = std::bit_cast<uint32_t>(f) - 0x3F000000u;
  }
  return static_cast<uint16_t>(h | sign);
}

float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float f = static_cast<float>(mant) * 0x1p-24f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(f) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

void adamw_step_scalar(const AdamWParams& hp, const AdamWArgs& a) {
  const AdamWStepScalars s = adamw_step_scalars(hp, a.step);
  check_adamw_args(a);
  const float* g32 = static_cast<const float*>(a.g);
  const uint16_t* g16 = static_cast<const uint16_t*>(a.g);
  uint16_t* out = static_cast<uint16_t*>(a.copy_out);
  float* out32 = static_cast<float*>(a.copy_out);
  float* po = a.p_out != nullptr ? a.p_out : a.p;
  float* mo = a.m_out != nullptr ? a.m_out : a.m;
  float* vo = a.v_out != nullptr ? a.v_out : a.v;
  for (size_t i = 0; i < a.n; ++i) {
    const float g = a.grad_type == GradType::kBf16 ? bf16_to_float(g16[i]) : g32[i];
    const AdamWElement e = adamw_element(s, a.grad_scale, g, a.p[i], a.m[i], a.v[i]);
    po[i] = e.p;
    mo[i] = e.m;
    vo[i] = e.v;
    if (a.copy_type == CopyType::kBf16) out[i] = float_to_bf16(e.p);
    if (a.copy_type == CopyType::kFp16) out[i] = float_to_fp16(e.p);
    if (a.copy_type == CopyType::kFp32) out32[i] = e.p;
  }
}

// --- the pool -------------------------------------------------------------------------

namespace {

// Elements per tile: 16K fp32 elements are 64 KiB of each of p, m, v, a multiple of every
// SIMD width. Tiles are dealt out statically: worker w takes a contiguous run of them.
constexpr size_t kTileElems = size_t{16} << 10;

// The sub-range [begin, end) of a as its own call (pointers offset, same step).
AdamWArgs slice(const AdamWArgs& a, size_t begin, size_t end) {
  AdamWArgs s = a;
  s.p = a.p + begin;
  s.m = a.m + begin;
  s.v = a.v + begin;
  if (a.p_out != nullptr) {
    s.p_out = a.p_out + begin;
    s.m_out = a.m_out + begin;
    s.v_out = a.v_out + begin;
  }
  const size_t g_bytes = a.grad_type == GradType::kBf16 ? 2 : 4;
  s.g = static_cast<const unsigned char*>(a.g) + begin * g_bytes;
  if (a.copy_out != nullptr)
    s.copy_out = static_cast<unsigned char*>(a.copy_out) + begin * copy_type_bytes(a.copy_type);
  s.n = end - begin;
  return s;
}

}  // namespace

struct AdamW::Impl {
  int numa_node = -1;
  size_t num_workers = 1;  // set before the workers start
  std::vector<std::thread> workers;

  std::mutex mu;
  std::condition_variable wake;  // workers wait here for a new generation or stop
  std::condition_variable done;  // the caller waits here for pending == 0
  uint64_t generation = 0;       // guarded by mu
  bool stop = false;             // guarded by mu
  int pending = 0;               // workers still running the current job; guarded by mu

  // The current job: written by the caller under mu before the generation bump, read by
  // the workers after they see it (the mutex orders the two).
  AdamWParams hp{};
  AdamWArgs args{};
  size_t tiles = 0;
  void (*fn)(void*, size_t, size_t) = nullptr;  // a parallel() job instead of a step
  void* ctx = nullptr;

  void run(int w) {
    if (numa_node >= 0) {
      SPILLWAY_CHECK_WARN(numa_run_on_node(numa_node) == 0,
                          "adamw: cannot bind worker {} to NUMA node {}; it runs unbound", w,
                          numa_node);
    }
    uint64_t seen = 0;
    const size_t nw = num_workers;
    for (;;) {
      std::unique_lock lock(mu);
      wake.wait(lock, [&] { return stop || generation != seen; });
      if (stop) return;
      seen = generation;
      const AdamWParams job_hp = hp;
      const AdamWArgs job = args;
      const size_t job_tiles = tiles;
      auto* const job_fn = fn;
      void* const job_ctx = ctx;
      lock.unlock();

      if (job_fn != nullptr) {
        job_fn(job_ctx, static_cast<size_t>(w), nw);
        lock.lock();
        if (--pending == 0) done.notify_one();
        continue;
      }
      const size_t t0 = job_tiles * static_cast<size_t>(w) / nw;
      const size_t t1 = job_tiles * static_cast<size_t>(w + 1) / nw;
      if (t0 < t1) {
        const size_t begin = t0 * kTileElems;
        const size_t end = std::min(job.n, t1 * kTileElems);
        adamw_step_simd(job_hp, slice(job, begin, end));
      }

      lock.lock();
      if (--pending == 0) done.notify_one();
    }
  }
};

AdamW::AdamW(int threads, int numa_node) : impl_(std::make_unique<Impl>()) {
  if (threads > kAdamWMaxThreads) {
    SPILLWAY_FIELD_ERROR("threads", threads, "must be at most {} (0: every core, {} here)",
                         kAdamWMaxThreads, std::thread::hardware_concurrency());
  }
  if (threads <= 0) threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (numa_node >= 0 && numa_available() >= 0 && numa_num_configured_nodes() > 1) {
    SPILLWAY_CHECK(numa_node < numa_num_configured_nodes(),
                   "adamw: numa_node is {}; the machine has {} nodes", numa_node,
                   numa_num_configured_nodes());
    impl_->numa_node = numa_node;
  }
  impl_->num_workers = static_cast<size_t>(threads);
  impl_->workers.reserve(impl_->num_workers);
  try {
    for (int w = 0; w < threads; ++w) impl_->workers.emplace_back([this, w] { impl_->run(w); });
  } catch (const std::system_error& e) {  // a thread could not start: stop those that did
    const size_t started = impl_->workers.size();
    {
      std::lock_guard lock(impl_->mu);
      impl_->stop = true;
    }
    impl_->wake.notify_all();
    for (std::thread& t : impl_->workers) t.join();
    SPILLWAY_FIELD_ERROR("threads", threads,
                         "only {} of the pool's threads could start ({}: the system's limit on "
                         "threads); ask for fewer, or 0 for one per core",
                         started, e.what());
  }
}

AdamW::~AdamW() {
  {
    std::lock_guard lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->wake.notify_all();
  for (std::thread& t : impl_->workers) t.join();
}

int AdamW::threads() const {
  return static_cast<int>(impl_->num_workers);
}

void AdamW::step(const AdamWParams& hp, const AdamWArgs& a) {
  // Checks here, on the caller, so that no worker can throw.
  (void)adamw_step_scalars(hp, a.step);
  check_adamw_args(a);
  if (a.n <= kTileElems) {
    adamw_step_simd(hp, a);
    return;
  }
  std::unique_lock lock(impl_->mu);
  impl_->fn = nullptr;
  impl_->hp = hp;
  impl_->args = a;
  impl_->tiles = (a.n + kTileElems - 1) / kTileElems;
  impl_->pending = static_cast<int>(impl_->num_workers);
  ++impl_->generation;
  impl_->wake.notify_all();
  impl_->done.wait(lock, [&] { return impl_->pending == 0; });
}

namespace {

// Note [Norm lanes in the step's pass]: lanes [c0, c1) of every row, kRowsPerPass rows at a
// time in row order: their share of the gradient is summed into the lanes (one load and
// store of the lanes per kRowsPerPass rows), then stepped while it is in cache (kRowsPerPass
// x 64 KiB of fp32 gradient split among the workers fits their L2).
constexpr size_t kRowsPerPass = 4;

// Lanes [c0, c1) of the lane sums of a gradient of n values (of `type`) at g, zeroed, then
// added row block by row block (Note [Norm lanes]); after each block, then(first, rows,
// count): the block's elements are count from first, in each of its rows.
template <typename Then>
void lane_sums_by_blocks(const void* g, GradType type, size_t n, size_t c0, size_t c1,
                         double* lanes, Then then) {
  const size_t end = std::min({c1, n, kNormLanes});
  if (c0 >= end) return;
  std::fill(lanes + c0, lanes + end, 0.0);
  const size_t bytes = type == GradType::kBf16 ? 2 : 4;
  const auto* at = static_cast<const unsigned char*>(g);
  const size_t full = n / kNormLanes;  // rows of kNormLanes elements
  for (size_t r0 = 0; r0 < full; r0 += kRowsPerPass) {
    const size_t rows = std::min(kRowsPerPass, full - r0);
    const size_t first = r0 * kNormLanes + c0;
    norm_lanes_add(at + first * bytes, type, kNormLanes, rows, end - c0, lanes + c0);
    then(first, rows, end - c0);
  }
  const size_t row = full * kNormLanes;  // the last, shorter row
  const size_t e = std::min(end, n - row);
  if (row < n && c0 < e) {
    norm_lanes_add(at + (row + c0) * bytes, type, kNormLanes, 1, e - c0, lanes + c0);
    then(row + c0, 1, e - c0);
  }
}

void step_lanes_of_rows(const AdamWParams& hp, const AdamWArgs& a, size_t c0, size_t c1,
                        double* lanes) {
  // One store fence for the worker's whole share, not one per row (Note [Streamed stores]).
  AdamWArgs rows_args = a;
  rows_args.stream_fence = false;
  lane_sums_by_blocks(a.g, a.grad_type, a.n, c0, c1, lanes,
                      [&](size_t first, size_t rows, size_t count) {
                        for (size_t r = 0; r < rows; ++r) {
                          const size_t at = first + r * kNormLanes;
                          adamw_step_simd(hp, slice(rows_args, at, at + count));
                        }
                      });
  if (a.stream && a.stream_fence) stream_fence();
}

// The lane sums on the pool's workers, each a block of lanes over every row (Note [Norm
// lanes]: each lane in index order, the same sums as on one thread).
void pooled_lane_sums(AdamW* pool, const void* g, GradType type, size_t n, double* lanes) {
  if (pool == nullptr || pool->threads() == 1 || n < 4 * kNormLanes) {
    norm_lane_sums_in(g, type, n, 0, kNormLanes, lanes);
    return;
  }
  struct Job {
    const void* g;
    GradType type;
    size_t n;
    double* lanes;
  } job{g, type, n, lanes};
  pool->parallel(
      [](void* c, size_t w, size_t nw) {
        const Job& j = *static_cast<const Job*>(c);
        norm_lane_sums_in(j.g, j.type, j.n, kNormLanes * w / nw, kNormLanes * (w + 1) / nw,
                          j.lanes);
      },
      &job);
}

}  // namespace

void AdamW::step_and_norm_lanes(const AdamWParams& hp, const AdamWArgs& a, double* lanes) {
  (void)adamw_step_scalars(hp, a.step);  // checks, on the caller, so that no worker throws
  check_adamw_args(a);
  SPILLWAY_CHECK(lanes != nullptr || a.n == 0, "adamw: step_and_norm_lanes without lanes");
  if (a.n == 0) return;
  if (threads() == 1 || a.n < 4 * kNormLanes) {
    step_lanes_of_rows(hp, a, 0, kNormLanes, lanes);
    return;
  }
  struct Job {
    const AdamWParams* hp;
    const AdamWArgs* a;
    double* lanes;
  } job{&hp, &a, lanes};
  parallel(
      [](void* c, size_t w, size_t nw) {
        const Job& j = *static_cast<const Job*>(c);
        // Lane blocks on a 16-element grid: each worker's share of a row starts aligned as
        // the row does (Note [Streamed stores]).
        constexpr size_t kGrid = 16;
        const size_t blocks = kNormLanes / kGrid;
        step_lanes_of_rows(*j.hp, *j.a, blocks * w / nw * kGrid, blocks * (w + 1) / nw * kGrid,
                           j.lanes);
      },
      &job);
}

void AdamW::parallel(void (*fn)(void* ctx, size_t worker, size_t workers), void* ctx) {
  SPILLWAY_CHECK(fn != nullptr, "AdamW::parallel: no function");
  std::unique_lock lock(impl_->mu);
  impl_->fn = fn;
  impl_->ctx = ctx;
  impl_->pending = static_cast<int>(impl_->num_workers);
  ++impl_->generation;
  impl_->wake.notify_all();
  impl_->done.wait(lock, [&] { return impl_->pending == 0; });
}

void norm_lane_sums_in(const void* g, GradType type, size_t n, size_t c0, size_t c1,
                       double* lanes) {
  lane_sums_by_blocks(g, type, n, c0, c1, lanes, [](size_t, size_t, size_t) {});
}

void norm_lane_sums(AdamW* pool, const float* g, size_t n, double* lanes) {
  pooled_lane_sums(pool, g, GradType::kFp32, n, lanes);
}

void norm_lane_sums_bf16(AdamW* pool, const uint16_t* g, size_t n, double* lanes) {
  pooled_lane_sums(pool, g, GradType::kBf16, n, lanes);
}

}  // namespace spillway::optim

// Speculation-then-validation: see stv.hpp and Note [STV exactness].
#include "optim/stv.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "spillway/error.hpp"

namespace spillway::optim {

namespace {

void step_range(const AdamWParams& hp, AdamW* pool, float* p, float* m, float* v, const void* g,
                GradType type, uint16_t* copy, size_t n, float scale, int64_t t) {
  AdamWArgs a;
  a.p = p;
  a.m = m;
  a.v = v;
  a.g = g;
  a.grad_type = type;
  a.grad_scale = scale;
  a.copy_out = copy;
  a.copy_type = copy != nullptr ? CopyType::kBf16 : CopyType::kNone;
  a.n = n;
  a.step = t;
  if (pool != nullptr) {
    pool->step(hp, a);
  } else {
    adamw_step_simd(hp, a);
  }
}

void check_buckets(const std::vector<Bucket>& buckets, size_t n) {
  size_t covered = 0;
  std::vector<Bucket> sorted = buckets;
  std::sort(sorted.begin(), sorted.end(),
            [](const Bucket& a, const Bucket& b) { return a.offset < b.offset; });
  for (const Bucket& b : sorted) {
    SPILLWAY_CHECK(b.offset == covered,
                   "STV buckets must tile the state without gap or overlap: a bucket starts "
                   "at {}, expected {}",
                   b.offset, covered);
    covered += b.n;
  }
  SPILLWAY_CHECK(covered == n, "STV buckets cover {} elements; the state has {}", covered, n);
}

}  // namespace

// Note [Norm lanes]: one row of lanes at a time, each lane in index order.
template <typename Load>
void lane_sums(size_t n, double* lanes, Load load) {
  const size_t width = std::min(n, kNormLanes);
  std::fill(lanes, lanes + width, 0.0);
  for (size_t row = 0; row < n; row += kNormLanes) {
    const size_t w = std::min(kNormLanes, n - row);
    for (size_t c = 0; c < w; ++c) {
      const double x = load(row + c);
      lanes[c] += x * x;
    }
  }
}

void norm_lane_sums(const float* g, size_t n, double* lanes) {
  lane_sums(n, lanes, [g](size_t i) { return static_cast<double>(g[i]); });
}

void norm_lane_sums_bf16(const uint16_t* g, size_t n, double* lanes) {
  lane_sums(n, lanes, [g](size_t i) { return static_cast<double>(bf16_to_float(g[i])); });
}

double add_lane_sums(const double* lanes, size_t n) {
  double s = 0.0;
  for (size_t c = 0; c < std::min(n, kNormLanes); ++c) s += lanes[c];
  return s;
}

double bucket_sum_of_squares(const float* g, size_t n) {
  std::vector<double> lanes(std::min(n, kNormLanes));
  norm_lane_sums(g, n, lanes.data());
  return add_lane_sums(lanes.data(), n);
}

float clip_coefficient(double norm, double clip) {
  if (clip <= 0.0 || !(norm > clip)) return 1.0f;
  return static_cast<float>(clip / (norm + 1e-6));
}

StvOutcome reference_adamw_step(const AdamWParams& hp, double clip, float* p, float* m, float* v,
                                const float* g, const std::vector<Bucket>& buckets, int64_t* step) {
  double sq = 0.0;
  for (const Bucket& b : buckets) sq += bucket_sum_of_squares(g + b.offset, b.n);
  const double norm = std::sqrt(sq);
  if (!std::isfinite(norm)) return StvOutcome::kSkip;
  const float scale = clip_coefficient(norm, clip);
  const int64_t t = *step + 1;
  for (const Bucket& b : buckets) {
    step_range(hp, nullptr, p + b.offset, m + b.offset, v + b.offset, g + b.offset, GradType::kFp32,
               nullptr, b.n, scale, t);
  }
  *step = t;
  return scale < 1.0f ? StvOutcome::kReplay : StvOutcome::kCommit;
}

StvAdamW::StvAdamW(const AdamWParams& hp, double clip, float* p, float* m, float* v, size_t n,
                   std::vector<Bucket> buckets, int device_buckets, AdamW* pool,
                   int64_t undo_limit_bytes)
    : hp_(hp),
      clip_(clip),
      p_(p),
      m_(m),
      v_(v),
      buckets_(std::move(buckets)),
      device_buckets_(device_buckets),
      pool_(pool) {
  check_buckets(buckets_, n);
  const int nb = static_cast<int>(buckets_.size());
  if (device_buckets_ < 0 || device_buckets_ > nb)
    SPILLWAY_INPUT_ERROR("STV: {} device buckets of {}; must be in [0, {}]", device_buckets_, nb,
                         nb);
  // Buckets are numbered in forward order; backward delivers them last first, so the
  // first `device_buckets` arrive last: they stay on the device, never speculated.
  size_t undo = 0;
  for (int b = device_buckets_; b < nb; ++b) undo += 3 * buckets_[static_cast<size_t>(b)].n;
  if (undo_limit_bytes >= 0)
    undo = std::min(undo, static_cast<size_t>(undo_limit_bytes) / sizeof(float));
  undo_.assign(undo, 0.0f);
  undo_offset_.assign(buckets_.size(), 0);
  admitted_.assign(buckets_.size(), 0);
  grads_.assign(buckets_.size(), nullptr);
  grad_types_.assign(buckets_.size(), GradType::kFp32);
  sq_.assign(buckets_.size(), 0.0);
  lanes_.assign(kNormLanes, 0.0);
  arrived_.assign(buckets_.size(), 0);
  speculated_.assign(buckets_.size(), 0);
  late_.assign(buckets_.size(), 0);
}

void StvAdamW::run(int b, float scale, int64_t t) {
  const Bucket& k = buckets_[static_cast<size_t>(b)];
  step_range(hp_, pool_, p_ + k.offset, m_ + k.offset, v_ + k.offset,
             grads_[static_cast<size_t>(b)], grad_types_[static_cast<size_t>(b)],
             copy_ != nullptr ? copy_ + k.offset : nullptr, k.n, scale, t);
}

void StvAdamW::check_bucket(int b, bool device) const {
  SPILLWAY_CHECK(b >= 0 && static_cast<size_t>(b) < buckets_.size(), "STV: unknown bucket {}", b);
  SPILLWAY_CHECK((b < device_buckets_) == device,
                 "STV: bucket {} is a {} bucket (the first {} of {} are the device's)", b,
                 device ? "CPU" : "device", device_buckets_, buckets_.size());
  SPILLWAY_CHECK(arrived_[static_cast<size_t>(b)] == 0, "STV: bucket {} arrived twice in one step",
                 b);
}

// Note [Bounded undo]: first come, first served, in arrival order.
bool StvAdamW::admit(int b) {
  check_bucket(b, false);
  char& a = admitted_[static_cast<size_t>(b)];
  if (a == 0) {
    const size_t need = 3 * buckets_[static_cast<size_t>(b)].n;
    if (undo_used_ + need <= undo_.size()) {
      undo_offset_[static_cast<size_t>(b)] = undo_used_;
      undo_used_ += need;
      a = 1;
    } else {
      a = 2;
    }
  }
  return a == 1;
}

void StvAdamW::on_bucket(int b, const float* g) {
  arrive(b, g, GradType::kFp32);
}

void StvAdamW::on_bucket_bf16(int b, const uint16_t* g) {
  arrive(b, g, GradType::kBf16);
}

void StvAdamW::arrive(int b, const void* g, GradType type) {
  const bool speculate = admit(b);  // checks b
  const Bucket& k = buckets_[static_cast<size_t>(b)];
  grads_[static_cast<size_t>(b)] = g;
  grad_types_[static_cast<size_t>(b)] = type;
  if (type == GradType::kBf16) {
    norm_lane_sums_bf16(static_cast<const uint16_t*>(g), k.n, lanes_.data());
  } else {
    norm_lane_sums(static_cast<const float*>(g), k.n, lanes_.data());
  }
  sq_[static_cast<size_t>(b)] = add_lane_sums(lanes_.data(), k.n);
  arrived_[static_cast<size_t>(b)] = 1;
  ++arrivals_;
  if (!speculate) return;  // deferred to finish()
  // Snapshot, then speculate (Note [STV exactness]).
  float* u = undo_.data() + undo_offset_[static_cast<size_t>(b)];
  std::memcpy(u, p_ + k.offset, k.n * sizeof(float));
  std::memcpy(u + k.n, m_ + k.offset, k.n * sizeof(float));
  std::memcpy(u + 2 * k.n, v_ + k.offset, k.n * sizeof(float));
  run(b, 1.0f, step_ + 1);
  speculated_[static_cast<size_t>(b)] = 1;
}

void StvAdamW::on_device_bucket(int b, double sum_of_squares) {
  check_bucket(b, true);
  sq_[static_cast<size_t>(b)] = sum_of_squares;
  arrived_[static_cast<size_t>(b)] = 1;
  ++arrivals_;
}

// Note [STV exactness]: every speculated bucket back to its snapshot, bit for bit.
void StvAdamW::restore_speculated() {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (speculated_[b] == 0) continue;
    const Bucket& k = buckets_[b];
    const float* u = undo_.data() + undo_offset_[b];
    std::memcpy(p_ + k.offset, u, k.n * sizeof(float));
    std::memcpy(m_ + k.offset, u + k.n, k.n * sizeof(float));
    std::memcpy(v_ + k.offset, u + 2 * k.n, k.n * sizeof(float));
  }
}

void StvAdamW::forget_step() {
  std::fill(grads_.begin(), grads_.end(), nullptr);
  std::fill(speculated_.begin(), speculated_.end(), 0);
  std::fill(admitted_.begin(), admitted_.end(), 0);
  std::fill(arrived_.begin(), arrived_.end(), 0);
  arrivals_ = 0;
  undo_used_ = 0;
}

void StvAdamW::abort() {
  restore_speculated();
  forget_step();
}

StvOutcome StvAdamW::finish() {
  SPILLWAY_CHECK(static_cast<size_t>(arrivals_) == buckets_.size(),
                 "STV: finish() after {} of {} buckets", arrivals_, buckets_.size());
  double sq = 0.0;
  for (double s : sq_) sq += s;  // bucket order, whatever the arrival order
  const double norm = std::sqrt(sq);
  const float scale = std::isfinite(norm) ? clip_coefficient(norm, clip_) : 1.0f;
  const bool undo = !std::isfinite(norm) || scale < 1.0f;
  if (undo) restore_speculated();
  std::fill(late_.begin(), late_.end(), 0);
  StvOutcome outcome = StvOutcome::kCommit;
  last_scale_ = scale;
  if (!std::isfinite(norm)) {
    outcome = StvOutcome::kSkip;
    ++counters_.skips;
  } else {
    const int64_t t = step_ + 1;
    for (int b = device_buckets_; b < static_cast<int>(buckets_.size()); ++b) {
      if (undo || speculated_[static_cast<size_t>(b)] == 0) {  // replays go in bucket order
        run(b, scale, t);
        late_[static_cast<size_t>(b)] = 1;
      }
    }
    step_ = t;
    if (undo) {
      outcome = StvOutcome::kReplay;
      ++counters_.replays;
    } else {
      ++counters_.commits;
    }
  }
  for (int b = device_buckets_; b < static_cast<int>(buckets_.size()); ++b)
    counters_.deferred += admitted_[static_cast<size_t>(b)] == 2 ? 1 : 0;
  forget_step();
  return outcome;
}

}  // namespace spillway::optim

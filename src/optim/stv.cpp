// Speculation-then-validation: see stv.hpp and Note [STV exactness].
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "spillway/core/error.hpp"
#include "spillway/optim/optim.hpp"

namespace spillway::optim {

namespace {

// The reference's step of one bucket: in place, fp32 gradient, no copy.
void step_range(const AdamWParams& hp, float* p, float* m, float* v, const float* g, size_t n,
                float scale, int64_t t) {
  AdamWArgs a;
  a.p = p;
  a.m = m;
  a.v = v;
  a.g = g;
  a.grad_scale = scale;
  a.n = n;
  a.step = t;
  adamw_step_simd(hp, a);
}

void check_buckets(const std::vector<Bucket>& buckets, size_t n) {
  size_t covered = 0;
  std::vector<Bucket> sorted = buckets;
  std::sort(sorted.begin(), sorted.end(),
            [](const Bucket& a, const Bucket& b) { return a.offset < b.offset; });
  for (const Bucket& b : sorted) {
    SPILLWAY_CHECK(b.offset >= covered,
                   "STV buckets must not overlap: a bucket starts at {}, the one before ends "
                   "at {}",
                   b.offset, covered);
    covered = b.offset + b.n;
  }
  SPILLWAY_CHECK(covered <= n, "STV buckets reach element {}; the state has {}", covered, n);
}

}  // namespace

// Note [Norm lanes]: a few rows of lanes at a time (norm_lane_sums_in, src/optim/adamw.cpp),
// each lane in index order, with the lane arithmetic of the device layer
// (spillway/device/device_math.hpp), which a device's norm_lanes_bf16 runs too.
void norm_lane_sums(const float* g, size_t n, double* lanes) {
  norm_lane_sums_in(g, GradType::kFp32, n, 0, kNormLanes, lanes);
}

void norm_lane_sums_bf16(const uint16_t* g, size_t n, double* lanes) {
  norm_lane_sums_in(g, GradType::kBf16, n, 0, kNormLanes, lanes);
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
    step_range(hp, p + b.offset, m + b.offset, v + b.offset, g + b.offset, b.n, scale, t);
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
    SPILLWAY_FIELD_ERROR("device_buckets", device_buckets_, "must be in [0, {}] (the buckets)", nb);
  // Buckets are numbered in forward order; backward delivers them last first, so the
  // first `device_buckets` arrive last: they stay on the device, never speculated. Second
  // buffers go to the CPU buckets in delivery order while they fit (Note [Bounded undo]).
  const size_t limit = undo_limit_bytes < 0 ? std::numeric_limits<size_t>::max()
                                            : static_cast<size_t>(undo_limit_bytes) / sizeof(float);
  size_t undo = 0;
  undo_offset_.assign(buckets_.size(), 0);
  has_undo_.assign(buckets_.size(), 0);
  in_undo_.assign(buckets_.size(), 0);
  for (int b = nb - 1; b >= device_buckets_; --b) {
    const size_t need = 3 * state_padded(buckets_[static_cast<size_t>(b)].n);
    if (undo + need > limit) continue;
    undo_offset_[static_cast<size_t>(b)] = undo;
    has_undo_[static_cast<size_t>(b)] = 1;
    undo += need;
  }
  undo_.assign(undo == 0 ? 0 : undo + kStateAlignFloats, 0.0f);
  undo_base_ = undo == 0 ? nullptr : state_aligned(undo_);
  undo_floats_ = undo;
  grads_.assign(buckets_.size(), nullptr);
  grad_types_.assign(buckets_.size(), GradType::kFp32);
  sq_.assign(buckets_.size(), 0.0);
  lanes_.assign(kNormLanes, 0.0);
  arrived_.assign(buckets_.size(), 0);
  speculated_.assign(buckets_.size(), 0);
  late_.assign(buckets_.size(), 0);
  published_late_.assign(buckets_.size(), 0);
  early_.assign(buckets_.size(), nullptr);
  absent_.assign(buckets_.size(), 0);
  bucket_hp_.assign(buckets_.size(), hp_);
  bucket_step_.assign(buckets_.size(), 0);
}

void StvAdamW::set_hparams(int b, const AdamWParams& hp) {
  SPILLWAY_CHECK(b >= 0 && static_cast<size_t>(b) < buckets_.size(), "STV: unknown bucket {}", b);
  SPILLWAY_CHECK(arrivals_ == 0, "STV: set_hparams of bucket {} during a step", b);
  (void)adamw_step_scalars(hp, 1);  // checks the values
  bucket_hp_[static_cast<size_t>(b)] = hp;
}

void StvAdamW::set_bucket_step(int b, int64_t step) {
  SPILLWAY_CHECK(b >= 0 && static_cast<size_t>(b) < buckets_.size(), "STV: unknown bucket {}", b);
  SPILLWAY_CHECK(arrivals_ == 0, "STV: set_bucket_step of bucket {} during a step", b);
  if (step < 0) SPILLWAY_FIELD_ERROR("step", step, "must be >= 0 (bucket {})", b);
  bucket_step_[static_cast<size_t>(b)] = step;
}

void StvAdamW::on_absent_bucket(int b) {
  check_bucket(b, false);
  sq_[static_cast<size_t>(b)] = 0.0;
  absent_[static_cast<size_t>(b)] = 1;
  arrived_[static_cast<size_t>(b)] = 1;
  ++arrivals_;
}

StvAdamW::BucketState StvAdamW::state(int b) const {
  SPILLWAY_CHECK(b >= device_buckets_ && static_cast<size_t>(b) < buckets_.size(),
                 "STV: state of bucket {}: not a CPU bucket", b);
  const Bucket& k = buckets_[static_cast<size_t>(b)];
  if (in_undo_[static_cast<size_t>(b)] == 0) return {p_ + k.offset, m_ + k.offset, v_ + k.offset};
  float* u = undo_base_ + undo_offset_[static_cast<size_t>(b)];
  return {u, u + state_padded(k.n), u + 2 * state_padded(k.n)};
}

StvAdamW::BucketState StvAdamW::speculative_state(int b) const {
  SPILLWAY_CHECK(b >= device_buckets_ && static_cast<size_t>(b) < buckets_.size(),
                 "STV: speculative_state of bucket {}: not a CPU bucket", b);
  SPILLWAY_CHECK(speculated_[static_cast<size_t>(b)] != 0,
                 "STV: speculative_state of bucket {}: not speculated this step", b);
  return other(b);
}

std::pair<float*, float*> StvAdamW::weight_buffers(int b) const {
  SPILLWAY_CHECK(b >= device_buckets_ && static_cast<size_t>(b) < buckets_.size(),
                 "STV: weight_buffers of bucket {}: not a CPU bucket", b);
  const size_t i = static_cast<size_t>(b);
  float* second = has_undo_[i] != 0 ? undo_base_ + undo_offset_[i] : nullptr;
  return {p_ + buckets_[i].offset, second};
}

int StvAdamW::current_buffer(int b) const {
  SPILLWAY_CHECK(b >= device_buckets_ && static_cast<size_t>(b) < buckets_.size(),
                 "STV: current_buffer of bucket {}: not a CPU bucket", b);
  return in_undo_[static_cast<size_t>(b)] != 0 ? 1 : 0;
}

StvAdamW::BucketState StvAdamW::other(int b) const {
  const Bucket& k = buckets_[static_cast<size_t>(b)];
  if (in_undo_[static_cast<size_t>(b)] != 0) return {p_ + k.offset, m_ + k.offset, v_ + k.offset};
  float* u = undo_base_ + undo_offset_[static_cast<size_t>(b)];
  return {u, u + state_padded(k.n), u + 2 * state_padded(k.n)};
}

void StvAdamW::run(int b, float scale, int64_t t, bool out_of_place, double* lanes, void* early) {
  const Bucket& k = buckets_[static_cast<size_t>(b)];
  const BucketState cur = state(b);
  AdamWArgs a;
  a.p = cur.p;
  a.m = cur.m;
  a.v = cur.v;
  a.g = grads_[static_cast<size_t>(b)];
  a.grad_type = grad_types_[static_cast<size_t>(b)];
  a.grad_scale = scale;
  a.copy_out = copy_ != nullptr ? copy_ + k.offset : nullptr;
  a.copy_type = copy_ != nullptr ? CopyType::kBf16 : CopyType::kNone;
  if (early != nullptr) {
    a.copy_out = early;
    a.copy_type = a.grad_type == GradType::kBf16 ? CopyType::kBf16 : CopyType::kFp32;
  }
  a.n = k.n;
  a.step = t;
  if (out_of_place) {
    const BucketState o = other(b);
    a.p_out = o.p;
    a.m_out = o.m;
    a.v_out = o.v;
    a.stream = true;  // the other buffer is not read before the next step
  }
  const AdamWParams& hp = bucket_hp_[static_cast<size_t>(b)];
  if (lanes != nullptr) {
    if (pool_ != nullptr) {
      pool_->step_and_norm_lanes(hp, a, lanes);
    } else {
      norm_lane_sums_in(a.g, a.grad_type, a.n, 0, kNormLanes, lanes);
      adamw_step_simd(hp, a);
    }
  } else if (pool_ != nullptr) {
    pool_->step(hp, a);
  } else {
    adamw_step_simd(hp, a);
  }
}

void StvAdamW::check_bucket(int b, bool device) const {
  SPILLWAY_CHECK(b >= 0 && static_cast<size_t>(b) < buckets_.size(), "STV: unknown bucket {}", b);
  SPILLWAY_CHECK((b < device_buckets_) == device,
                 "STV: bucket {} is a {} bucket (the first {} of {} are the device's)", b,
                 device ? "CPU" : "device", device_buckets_, buckets_.size());
  SPILLWAY_CHECK(arrived_[static_cast<size_t>(b)] == 0, "STV: bucket {} arrived twice in one step",
                 b);
}

bool StvAdamW::admit(int b) const {
  check_bucket(b, false);
  return speculate_ && has_undo_[static_cast<size_t>(b)] != 0;
}

void StvAdamW::set_speculation(bool on) {
  SPILLWAY_CHECK(arrivals_ == 0, "STV: set_speculation during a step");
  speculate_ = on;
}

void StvAdamW::on_bucket(int b, const float* g, void* early) {
  arrive(b, g, GradType::kFp32, early);
}

void StvAdamW::on_bucket_bf16(int b, const uint16_t* g, void* early) {
  arrive(b, g, GradType::kBf16, early);
}

void StvAdamW::arrive(int b, const void* g, GradType type, void* early) {
  const bool speculate = admit(b);  // checks b
  const Bucket& k = buckets_[static_cast<size_t>(b)];
  grads_[static_cast<size_t>(b)] = g;
  grad_types_[static_cast<size_t>(b)] = type;
  SPILLWAY_CHECK(early == nullptr || copy_ == nullptr,
                 "STV: bucket {}: early weights and a bf16 copy", b);
  early_[static_cast<size_t>(b)] = early;
  if (speculate) {
    // Speculate into the other buffer (Note [STV exactness]): the current one stays as it
    // was. The norm lanes are summed in the same pass (Note [Norm lanes in the step's pass]).
    run(b, 1.0f, bucket_step_[static_cast<size_t>(b)] + 1, true, lanes_.data(), early);
    speculated_[static_cast<size_t>(b)] = 1;
  } else if (type == GradType::kBf16) {  // deferred to finish(): the lanes alone now
    norm_lane_sums_bf16(pool_, static_cast<const uint16_t*>(g), k.n, lanes_.data());
  } else {
    norm_lane_sums(pool_, static_cast<const float*>(g), k.n, lanes_.data());
  }
  sq_[static_cast<size_t>(b)] = add_lane_sums(lanes_.data(), k.n);
  arrived_[static_cast<size_t>(b)] = 1;
  ++arrivals_;
}

void StvAdamW::on_device_bucket(int b, double sum_of_squares) {
  check_bucket(b, true);
  sq_[static_cast<size_t>(b)] = sum_of_squares;
  arrived_[static_cast<size_t>(b)] = 1;
  ++arrivals_;
}

void StvAdamW::forget_step() {
  std::fill(grads_.begin(), grads_.end(), nullptr);
  std::fill(early_.begin(), early_.end(), nullptr);
  std::fill(speculated_.begin(), speculated_.end(), 0);
  std::fill(arrived_.begin(), arrived_.end(), 0);
  std::fill(absent_.begin(), absent_.end(), 0);
  arrivals_ = 0;
}

// Note [STV exactness]: the speculative results are in the other buffers; the current
// ones were never written.
void StvAdamW::abort() {
  forget_step();
}

double StvAdamW::sum_of_squares() const {
  SPILLWAY_CHECK(static_cast<size_t>(arrivals_) == buckets_.size(),
                 "STV: sum_of_squares() after {} of {} buckets", arrivals_, buckets_.size());
  double sq = 0.0;
  for (double s : sq_) sq += s;  // bucket order, whatever the arrival order
  return sq;
}

double StvAdamW::arrived_sum_of_squares() const {
  double sq = 0.0;
  for (size_t b = 0; b < sq_.size(); ++b) {
    if (arrived_[b] != 0) sq += sq_[b];
  }
  return sq;
}

StvOutcome StvAdamW::finish() {
  return finish(sum_of_squares());
}

StvOutcome StvAdamW::finish(double global_sum_of_squares) {
  SPILLWAY_CHECK(static_cast<size_t>(arrivals_) == buckets_.size(),
                 "STV: finish() after {} of {} buckets", arrivals_, buckets_.size());
  const double norm = std::sqrt(global_sum_of_squares);
  const float scale = std::isfinite(norm) ? clip_coefficient(norm, clip_) : 1.0f;
  const bool undo = !std::isfinite(norm) || scale < 1.0f;
  std::fill(late_.begin(), late_.end(), 0);
  std::fill(published_late_.begin(), published_late_.end(), 0);
  StvOutcome outcome = StvOutcome::kCommit;
  last_scale_ = scale;
  if (!std::isfinite(norm)) {
    outcome = StvOutcome::kSkip;  // the speculative results are dropped with the buffers
    ++counters_.skips;
  } else {
    for (int b = device_buckets_; b < static_cast<int>(buckets_.size()); ++b) {
      const size_t i = static_cast<size_t>(b);
      if (absent_[i] != 0) continue;  // no gradient: untouched, its counter stays
      const int64_t t = bucket_step_[i] + 1;
      bucket_step_[i] = t;
      if (speculated_[i] != 0) {
        if (undo) {  // replay from the untouched current buffer, in bucket order
          run(b, scale, t, true, nullptr, early_[i]);
          late_[i] = 1;
          published_late_[i] = early_[i] != nullptr ? 1 : 0;
        }
        in_undo_[i] = static_cast<char>(in_undo_[i] ^ 1);  // commit: the other is current
      } else {
        // Deferred: into the second buffer where there is one and the pass also writes the
        // weights elsewhere (Note [Streamed stores]: out of place with a copy costs what in
        // place and a copy cost); in place otherwise, which moves the same bytes for less
        // (Note [Weights shared with the parameters]). The same bits either way.
        const bool out_of_place = has_undo_[i] != 0 && (early_[i] != nullptr || copy_ != nullptr);
        run(b, scale, t, out_of_place, nullptr, early_[i]);
        if (out_of_place) in_undo_[i] = static_cast<char>(in_undo_[i] ^ 1);
        late_[i] = 1;
        published_late_[i] = early_[i] != nullptr ? 1 : 0;
      }
    }
    ++step_;
    if (undo) {
      outcome = StvOutcome::kReplay;
      ++counters_.replays;
    } else {
      ++counters_.commits;
    }
  }
  for (int b = device_buckets_; b < static_cast<int>(buckets_.size()); ++b)
    counters_.deferred += has_undo_[static_cast<size_t>(b)] == 0 ? 1 : 0;
  if (!speculate_) ++counters_.unspeculated_steps;
  forget_step();
  return outcome;
}

}  // namespace spillway::optim

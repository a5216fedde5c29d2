// Speculation-then-validation (STV) for the offloaded AdamW step (DESIGN section 4).
//
// Gradient clipping and the NaN/Inf check need the global gradient norm, known only when
// backward ends. STV steps each gradient bucket as soon as it arrives, speculatively,
// after copying the bucket's p, m and v into an undo buffer; when backward ends:
//   - the norm is finite and at most the clip threshold: commit (the speculation stands);
//   - it is above the threshold: undo every speculative bucket and step it again with the
//     gradient scaled by clip / (norm + 1e-6) (replay);
//   - it is NaN or Inf: undo every speculative bucket and skip the step (the step counter
//     does not advance).
// Note [STV exactness]: undo restores the snapshot (bit copies), never inverts the update
// (which is not bit-exact and cannot undo NaN moments), and the norm is summed per bucket
// in bucket order whatever the arrival order, so the result after every step is bitwise
// that of `reference_adamw_step` (the non-speculative optimizer). tests/optim/stv_test.cpp
// checks it over 1,000 steps with clipping and NaN/Inf in random buckets.
//
// GPU/CPU split: the last `device_buckets` buckets to arrive (the first layers, at the end
// of backward) are not speculated; their step runs on the device once the norm is known
// (here the same code on the host backend's memory; a CUDA kernel on a GPU), so they add
// no CPU step to the critical path. Any split gives bitwise the same result.
//
// Memory: the undo buffers hold 12 bytes per element of the speculative buckets, sized once
// (the buckets in flight between their arrival and the end of backward).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "optim/adamw.hpp"

namespace spillway::optim {

struct Bucket {
  size_t offset = 0;  // into the parameter group's state
  size_t n = 0;
};

enum class StvOutcome { kCommit, kReplay, kSkip };

struct StvCounters {
  int64_t commits = 0;
  int64_t replays = 0;
  int64_t skips = 0;
};

// The global gradient norm as STV computes it: per bucket, the sum of squares in double in
// element order; the buckets' sums added in bucket order; the square root.
double bucket_sum_of_squares(const float* g, size_t n);

// Clipping factor: clip / (norm + 1e-6) rounded to float when norm > clip, else 1.
float clip_coefficient(double norm, double clip);

// The non-speculative optimizer: the whole gradient known, the norm computed as above,
// skip on NaN/Inf, clip, AdamW. `step` is the group's counter, advanced unless skipped.
StvOutcome reference_adamw_step(const AdamWParams& hp, double clip, float* p, float* m, float* v,
                                const float* g, const std::vector<Bucket>& buckets, int64_t* step);

class StvAdamW {
 public:
  // The state (p, m, v of `n` elements) stays the caller's; buckets cover [0, n) without
  // overlap; the last `device_buckets` to arrive run on the device side. `pool` (may be
  // null: the SIMD step on the caller) steps the CPU buckets.
  StvAdamW(const AdamWParams& hp, double clip, float* p, float* m, float* v, size_t n,
           std::vector<Bucket> buckets, int device_buckets, AdamW* pool);

  // Backward: bucket `b`'s gradient (n of that bucket) has arrived; the pointer stays
  // valid until finish(). Arrival order is free (normally last bucket first).
  void on_bucket(int b, const float* g);
  // Backward is done: every bucket has arrived. Validates, then commits, replays or skips.
  StvOutcome finish();
  // The step cannot complete (a gradient never arrived): undo every speculative bucket and
  // forget the step's buckets; the step counter does not advance.
  void abort();

  int64_t step() const { return step_; }
  const StvCounters& counters() const { return counters_; }
  int64_t undo_bytes() const { return static_cast<int64_t>(undo_.size() * sizeof(float)); }

 private:
  void run(int b, float scale, int64_t t);
  void restore_speculated();
  void forget_step();
  AdamWParams hp_;
  double clip_;
  float* p_;
  float* m_;
  float* v_;
  std::vector<Bucket> buckets_;
  int device_buckets_;
  AdamW* pool_;
  int64_t step_ = 0;
  StvCounters counters_;
  std::vector<float> undo_;          // p, m, v of each speculative bucket, back to back
  std::vector<size_t> undo_offset_;  // per bucket (speculative ones)
  std::vector<const float*> grads_;  // per bucket, this step
  std::vector<double> sq_;           // per bucket sum of squares, this step
  std::vector<int> arrival_;         // buckets in arrival order, this step
  std::vector<char> speculated_;     // per bucket: stepped speculatively this step
};

}  // namespace spillway::optim

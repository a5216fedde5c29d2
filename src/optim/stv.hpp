// Speculation-then-validation (STV) for the offloaded AdamW step (DESIGN section 4).
//
// Gradient clipping and the NaN/Inf check need the global gradient norm, known only when
// backward ends. STV steps each gradient bucket as soon as it arrives, speculatively, out
// of place: a speculative bucket has two buffers for its p, m and v (a double buffer), and
// the step reads the current one and writes the other; when backward ends:
//   - the norm is finite and at most the clip threshold: commit (the other buffer becomes
//     the current one);
//   - it is above the threshold: step every speculative bucket again from its current
//     buffer, untouched, with the gradient scaled by clip / (norm + 1e-6) (replay);
//   - it is NaN or Inf: discard the other buffers and skip the step (the step counter
//     does not advance).
// Note [STV exactness]: undo keeps the old state's bits (a buffer the step never wrote),
// never inverts the update (which is not bit-exact and cannot undo NaN moments), and the
// norm is summed per bucket in bucket order whatever the arrival order, so the result
// after every step is bitwise that of `reference_adamw_step` (the non-speculative
// optimizer). tests/optim/stv_test.cpp checks it over 1,000 steps with clipping and
// NaN/Inf in random buckets. The double buffer costs no copy: a snapshot would read and
// write 24 bytes per element more than the step itself.
//
// GPU/CPU split: the last `device_buckets` buckets to arrive (the first layers, at the end
// of backward) keep their state on the device and are not speculated. STV sees only their
// sum of squares (on_device_bucket, computed where the gradient is, in the order of Note
// [Norm lanes]); after finish() the caller steps them with last_scale() at step() unless
// the step was skipped. They add no CPU step to the critical path; any split gives bitwise
// the same result. STV never touches their elements: the state arrays need only hold the
// CPU buckets (the offsets of the device buckets must still tile [0, n) with the others).
//
// Note [Bounded undo]: the second buffers (the undo memory) hold 12 bytes per element of
// the speculative buckets, sized once: by default every CPU bucket has one; with
// `undo_limit_bytes` they go to the buckets in the order backward delivers them (the last
// bucket first), each that still fits. A bucket without one is not speculated but
// deferred: it steps in place in finish(), once the norm is known, on the critical path
// but exact (counted in `deferred`). Limited memory never drops or corrupts a step.
//
// Where a bucket's state is: its current buffer alternates between the caller's arrays
// and STV's second buffer at each commit, so read it through state(b).
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
  int64_t deferred = 0;  // buckets not speculated for want of undo memory (Note [Bounded undo])
};

// Note [Norm lanes]: the global gradient norm as STV computes it, in an order a GPU can
// follow to the bit. A bucket's elements are dealt to kNormLanes lanes (element i to lane
// i % kNormLanes); each lane sums the squares of its elements in double in index order;
// the bucket's sum is its lanes' sums added in lane order; the norm is the square root of
// the buckets' sums added in bucket order. A float squared is exact in double, so a fused
// multiply-add gives the same bits. On the CPU the lanes vectorize (one row of lanes at a
// time); on a GPU one thread per lane reads coalesced.
inline constexpr size_t kNormLanes = 16384;
// lanes (min(n, kNormLanes)) = the lane sums of n fp32 or bf16 (bits) values.
void norm_lane_sums(const float* g, size_t n, double* lanes);
void norm_lane_sums_bf16(const uint16_t* g, size_t n, double* lanes);
// The lane sums added in lane order.
double add_lane_sums(const double* lanes, size_t n);
// The bucket's sum of squares (allocates its lanes: for references and tests).
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
  // overlap; the first `device_buckets` (the last to arrive) are the device's. `pool` (may
  // be null: the SIMD step on the caller) steps the CPU buckets. `undo_limit_bytes` < 0:
  // undo memory for every CPU bucket; else at most that (Note [Bounded undo]).
  StvAdamW(const AdamWParams& hp, double clip, float* p, float* m, float* v, size_t n,
           std::vector<Bucket> buckets, int device_buckets, AdamW* pool,
           int64_t undo_limit_bytes = -1);
  // Every step of a CPU bucket also writes the bf16 copy of its updated weights to `copy`
  // (n, laid out like p), in the same pass (null: no copy). After a skip the copy of the
  // restored buckets is stale: the caller rounds p again.
  void set_bf16_copy(uint16_t* copy) { copy_ = copy; }

  // Whether CPU bucket `b` is speculated when it arrives (it has a second buffer), or
  // deferred to finish() (Note [Bounded undo]); fixed at construction. A pipeline asks when
  // it enqueues the bucket, to know whether to upload its weights then.
  bool admit(int b) const;
  // CPU bucket `b`'s current p, m, v (n of that bucket each). Not while the bucket is being
  // stepped: between its arrival and the end of finish() only the old values are there.
  struct BucketState {
    float* p;
    float* m;
    float* v;
  };
  BucketState state(int b) const;
  // Backward: CPU bucket `b`'s gradient (n of that bucket, fp32 or bf16 bits) has arrived;
  // the pointer stays valid until finish(). Arrival order is free (normally last first).
  void on_bucket(int b, const float* g);
  void on_bucket_bf16(int b, const uint16_t* g);
  // Backward: device bucket `b`'s sum of squares (add_lane_sums of its lanes) is known.
  void on_device_bucket(int b, double sum_of_squares);
  // Backward is done: every bucket has arrived. Validates, then commits, replays or skips
  // the CPU buckets; the device buckets are the caller's (see the split above).
  StvOutcome finish();
  // The step cannot complete (a gradient never arrived): undo every speculative bucket and
  // forget the step's buckets; the step counter does not advance.
  void abort();

  int64_t step() const { return step_; }
  // The gradient scale of the last finish() (1 unless clipped).
  float last_scale() const { return last_scale_; }
  // Whether CPU bucket `b` was stepped only in finish() this step (deferred or replayed):
  // its weights changed after its arrival. Valid between finish() and the next step.
  bool stepped_late(int b) const { return late_[static_cast<size_t>(b)] != 0; }
  const StvCounters& counters() const { return counters_; }
  int64_t undo_bytes() const { return static_cast<int64_t>(undo_.size() * sizeof(float)); }

 private:
  void arrive(int b, const void* g, GradType type);
  // Steps CPU bucket b from its current buffer: into its other one (out of place) or in
  // place.
  void run(int b, float scale, int64_t t, bool out_of_place);
  BucketState other(int b) const;
  void check_bucket(int b, bool device) const;
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
  float last_scale_ = 1.0f;
  std::vector<float> undo_;          // the second buffers: p, m, v of each, back to back
  std::vector<size_t> undo_offset_;  // per bucket with a second buffer
  std::vector<char> has_undo_;       // per bucket: speculated (has a second buffer)
  std::vector<char> in_undo_;        // per bucket: its current buffer is the second one
  uint16_t* copy_ = nullptr;
  std::vector<const void*> grads_;    // per bucket, this step
  std::vector<GradType> grad_types_;  // per bucket, this step
  std::vector<double> sq_;            // per bucket sum of squares, this step
  std::vector<double> lanes_;         // kNormLanes, for the CPU buckets' sums
  std::vector<char> arrived_;         // per bucket, this step
  int arrivals_ = 0;
  std::vector<char> speculated_;  // per bucket: stepped speculatively this step
  std::vector<char> late_;        // per bucket: stepped in finish() this step
};

}  // namespace spillway::optim

// The optimizer-offload engine's public face (docs/optim.md): the CPU AdamW, speculation
// then validation (STV), and the bucketed pipeline that steps parameters and gradients
// as backward produces them. Three sections, each with the invariants it keeps.
//
// ---- AdamW ----------------------------------------------------------------------------
// CPU AdamW over fp32 master weights and moments (docs/optim.md): a scalar reference
// and a SIMD version (Highway, run-time dispatch: AVX-512/AVX2 on x86, SVE/NEON on Arm)
// with the same arithmetic, tiled over a thread pool.
//
// The update, per element i (decoupled weight decay, bias correction; PyTorch's AdamW):
//   p  = p * (1 - lr * wd)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p  = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),   bc1 = 1 - beta1^t, bc2 = 1 - beta2^t
// with the per-step scalars (lr / bc1, 1 / sqrt(bc2), 1 - lr * wd) computed once in double
// and rounded to float. Note [AdamW operation order] (spillway/device/device_math.hpp, where the
// scalar element update is written once for the reference, the host backend and the CUDA
// kernel): scalar and SIMD evaluate each line in the same order, every multiply and add
// rounded on its own (no fused multiply-add, -ffp-contract=off), so they agree to the bit
// on every target.
//
// Invariants: no allocation per step (the pool and tiles are sized at construction);
// outputs are fully written; the low-precision copy of p (bf16 round-to-nearest-even, or
// fp16) is written in the same pass.
//
// ---- STV ------------------------------------------------------------------------------
// Speculation-then-validation (STV) for the offloaded AdamW step (docs/optim.md).
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
// CPU buckets (the offsets of the device buckets must still lie in [0, n) with the others).
// Buckets may leave gaps between them (never overlap): the CPU path starts each at a
// multiple of kStateAlignFloats, as the second buffers are laid out, so that a bucket's
// outputs stream whole vectors from its first element (Note [Streamed stores]).
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
//
// Note [Weights shared with the parameters]: a framework's fp32 parameter may be a view of
// its bucket's current weight buffer (spillway.torch's CPUAdamW(share_weights=True)): the
// master weights are the parameter, so no copy of them is kept or written. A speculated
// step writes the other buffer (the current one, the parameter, stays as it was until the
// step is validated) and a commit makes the other current: the caller then points the
// parameter at it (StvAdamW::weight_buffers, current_buffer) instead of copying the
// weights back. A deferred step that writes no copy runs in place, so its parameter stays
// where it was. Loading or storing a parameter that is the current buffer copies nothing.
// Per element and step: 28 bytes (a speculated or deferred pass), against 32 with the
// weights written into a separate parameter in the same pass, 36 in a second pass.
//
// ---- The pipeline -----------------------------------------------------------------------
// The bucketed optimizer-offload pipeline (docs/optim.md): fp32 master weights and
// AdamW moments live in pinned host memory, the device keeps bf16 weights. As backward
// produces each gradient bucket (last layers first):
//   D2H stream:  wait for the bucket's gradient, copy it to pinned staging (fp32, or bf16
//                when the cast is done on the host: half the link bytes);
//   CPU stream:  wait for that copy, run the speculative AdamW step of the bucket (STV),
//                reading the gradient as staged and writing the bf16 copy of the updated
//                weights into pinned staging in the same pass;
//   H2D stream:  wait for the step, copy the bf16 weights to the device.
// Every stage is ordered by events, never by the host, so the three overlap the rest of
// backward. end_step() validates (StvAdamW::finish): on a replay or a skip every CPU
// bucket's weights go up again, on a commit those of the buckets deferred for want of
// undo memory.
//
// Note [Optimizer copy failures]: a gradient copy that cannot be enqueued (the device
// reports an error) is retried up to `max_retries` times after waiting for the copies in
// flight; if it still fails, the step is abandoned with an error naming the bucket, and
// no bucket is updated from a gradient that did not arrive: the CPU step of a bucket is
// enqueued only after its copy was.
//
// GPU/CPU split: the first `device_buckets` buckets (the last to arrive) keep their fp32
// state in device memory. Their gradients never cross the link: on the compute stream the
// device computes their norm lane sums (Note [Norm lanes]; a few KB go down), and at
// end_step, once STV has validated, it steps them and writes their bf16 weights in the
// same pass. Both are device operations of the backend (Device::norm_lanes_bf16 and
// adamw_step, as the device cast is widen_bf16; Note [Device operations]): kernels on a
// GPU, the same arithmetic as stream-ordered host work on the host backend. The host holds
// state only for the CPU buckets.
//
// Memory: pinned host memory of 12 bytes per CPU-bucket element (p, m, v), its gradient
// staging (4 or 2) and 2 per element of weight staging; STV's second buffers (Note
// [Bounded undo], `undo_limit_bytes`: 12 per speculated element, pageable);
// device memory of 4 bytes per element (bf16 weights and gradients), 4 more per CPU-bucket
// element for the device cast, and 12 per device-bucket element.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "spillway/device/device.hpp"
#include "spillway/device/hooks.hpp"

namespace spillway::optim {

// ---- AdamW ----

struct AdamWParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

enum class GradType { kFp32, kBf16 };
// The copy of the updated p a step writes in the same pass: a bf16 or fp16 copy (the
// device's weights), or an fp32 one (an fp32 framework parameter the master weights feed).
enum class CopyType { kNone, kBf16, kFp16, kFp32 };
inline size_t copy_type_bytes(CopyType t) {
  return t == CopyType::kNone ? 0 : t == CopyType::kFp32 ? 4 : 2;
}

// One call's inputs: n elements of state, the gradient (fp32 or bf16 bits), the step
// counter t (>= 1, of this parameter group) and the optional copy out.
struct AdamWArgs {
  float* p = nullptr;       // (n) fp32 master weights, updated in place
  float* m = nullptr;       // (n) first moment
  float* v = nullptr;       // (n) second moment
  const void* g = nullptr;  // (n) gradient, fp32 or bf16 bits (uint16_t)
  GradType grad_type = GradType::kFp32;
  float grad_scale = 1.0f;   // the gradient is multiplied by this first (clipping); 1: exact;
                             // finite and >= 0 (else an InputError)
  void* copy_out = nullptr;  // (n) elements of copy_type: the updated p, or null
  CopyType copy_type = CopyType::kNone;
  size_t n = 0;
  int64_t step = 1;
  // Out of place (all three or none): the updated p, m, v go here and p, m, v are only
  // read (STV's double buffer). No output (these, copy_out, or p, m, v in place) may
  // overlap another array partially (an InputError naming it); the same array is fine.
  float* p_out = nullptr;
  float* m_out = nullptr;
  float* v_out = nullptr;
  // Note [Streamed stores]: the outputs written out of place (p_out, m_out, v_out) and the
  // copy go to memory with non-temporal stores where their alignment allows, so no cache
  // line is read for ownership first. For outputs nobody reads soon (STV's other buffer, a
  // parameter written for the next forward); the bits are the same either way.
  bool stream = false;
  // With `stream`: whether the call ends with a store fence (the streamed stores visible
  // before it returns). false: the caller fences once after its last call (optim::
  // stream_fence), as a pass that steps a bucket in many short calls does: a fence per call
  // waits for the write-combining buffers each time (Note [Streamed stores]).
  bool stream_fence = true;
};
// The store fence that makes the streamed stores of the calling thread visible.
void stream_fence();

// The per-step scalars of Note [AdamW operation order]: computed in double once per call
// and rounded to float, so the scalar and SIMD paths (and a device's) see the same bits.
// Checks hp and step.
using AdamWStepScalars = spillway::AdamWScalars;
AdamWStepScalars adamw_step_scalars(const AdamWParams& hp, int64_t step);
// Throws spillway::Error when the pointers of `a` do not fit its n and options (every
// step checks its arguments with it).
void check_adamw_args(const AdamWArgs& a);

// The scalar reference: one thread, plain loops, same arithmetic as the SIMD path.
void adamw_step_scalar(const AdamWParams& hp, const AdamWArgs& a);

// The SIMD step on the calling thread (the best target the CPU supports).
void adamw_step_simd(const AdamWParams& hp, const AdamWArgs& a);
// The name of the target the dispatch picked, e.g. "AVX3" or "AVX2", "SVE", "NEON".
const char* adamw_simd_target();
// For tests: the names of the targets compiled in that this CPU supports, best first
// (e.g. "AVX3", "AVX2", "SSE4", "EMU128"), and making adamw_step_simd use one of them
// (nullptr: the best again). Returns false for a name not in the list. Not thread-safe:
// no step may run concurrently.
std::vector<std::string> adamw_simd_targets();
bool adamw_simd_force_target(const char* name);

// The most threads an AdamW pool takes (more is a mistake: a memory-bound step gains
// nothing past the cores; it is an InputError, as is a pool the system cannot start).
inline constexpr int kAdamWMaxThreads = 4096;

// All cores: the SIMD step tiled across a thread pool created once (threads bound to the
// NUMA node `numa_node` when the machine has several; -1: no binding).
class AdamW {
 public:
  explicit AdamW(int threads = 0, int numa_node = -1);  // threads 0: hardware concurrency
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  void step(const AdamWParams& hp, const AdamWArgs& a);
  // Note [Norm lanes in the step's pass]: the step of `a` and the norm lanes of its
  // gradient (lanes: min(a.n, kNormLanes), as norm_lane_sums / norm_lane_sums_bf16 give
  // them, unscaled) in one pass over the gradient: the work is split by lanes, not by
  // rows, so every lane still sums its elements in index order on one thread.
  void step_and_norm_lanes(const AdamWParams& hp, const AdamWArgs& a, double* lanes);
  // Runs fn(ctx, w, threads()) on every worker w and returns when all have (the pool's
  // threads for other memory-bound passes: norm lanes, copies). fn must not throw.
  void parallel(void (*fn)(void* ctx, size_t worker, size_t workers), void* ctx);
  int threads() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// bf16 (round to nearest even, NaN kept NaN) and fp16 conversions used by the copies. The
// bf16 ones are the device layer's (spillway/device/device_math.hpp), inline: loops over them
// vectorize.
using spillway::bf16_to_float;
using spillway::float_to_bf16;
uint16_t float_to_fp16(float x);
float fp16_to_float(uint16_t h);

// ---- STV ----

using spillway::Bucket;  // spillway/device/hooks.hpp: an offset and a count into the group's state

enum class StvOutcome { kCommit, kReplay, kSkip };

struct StvCounters {
  int64_t commits = 0;
  int64_t replays = 0;
  int64_t skips = 0;
  int64_t deferred = 0;  // buckets not speculated for want of undo memory (Note [Bounded undo])
  int64_t unspeculated_steps =
      0;  // steps run with speculation off (Note [Speculation after a clip])
};

// Note [Norm lanes]: the global gradient norm as STV computes it, in an order a GPU can
// follow to the bit. A bucket's elements are dealt to kNormLanes lanes (element i to lane
// i % kNormLanes); each lane sums the squares of its elements in double in index order;
// the bucket's sum is its lanes' sums added in lane order; the norm is the square root of
// the buckets' sums added in bucket order. A float squared is exact in double, so a fused
// multiply-add gives the same bits. On the CPU the lanes vectorize (one row of lanes at a
// time); on a GPU one thread per lane reads coalesced.
inline constexpr size_t kNormLanes = 16384;
// Where optimizer state arrays start: 64 bytes (the widest vector, AVX-512 and 512-bit SVE)
// in floats; n elements rounded up to it.
inline constexpr size_t kStateAlignFloats = 16;
inline constexpr size_t state_padded(size_t n) {
  return (n + kStateAlignFloats - 1) / kStateAlignFloats * kStateAlignFloats;
}
// The first element of `buf` at a kStateAlignFloats boundary (buf holds kStateAlignFloats
// more than it must for that).
inline float* state_aligned(std::vector<float>& buf) {
  const auto at = reinterpret_cast<uintptr_t>(buf.data());
  const size_t bytes = kStateAlignFloats * sizeof(float);
  return buf.data() + (bytes - at % bytes) % bytes / sizeof(float);
}
// lanes (min(n, kNormLanes)) = the lane sums of n fp32 or bf16 (bits) values.
void norm_lane_sums(const float* g, size_t n, double* lanes);
void norm_lane_sums_bf16(const uint16_t* g, size_t n, double* lanes);
// The same sums, the lanes dealt to the pool's workers (null or one thread: the caller).
void norm_lane_sums(AdamW* pool, const float* g, size_t n, double* lanes);
void norm_lane_sums_bf16(AdamW* pool, const uint16_t* g, size_t n, double* lanes);
// For rows r = 0 .. rows - 1 in order, lanes[c] = lane_add_square(lanes[c], g[r * stride +
// c]) for c in [0, count), g fp32 or bf16 bits: rows' shares of the lane sums, in SIMD (the
// same bits).
void norm_lanes_add(const void* g, GradType type, size_t stride, size_t rows, size_t count,
                    double* lanes);
// Lanes [c0, c1) only of the lane sums of n values (a worker's share; the others are not
// touched): each the sum norm_lane_sums gives, row by row through norm_lanes_add.
void norm_lane_sums_in(const void* g, GradType type, size_t n, size_t c0, size_t c1, double* lanes);
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

  // Note [Per-bucket hyperparameters and steps]: each bucket has its own AdamW
  // hyperparameters (all `hp` at construction) and its own step counter (all 0), as a
  // framework's parameter groups and per-parameter steps have: a learning-rate schedule
  // changes them between steps, a parameter without a gradient this step is absent (its
  // counter does not advance, its state is untouched). Set them between steps only (not
  // between a bucket's arrival and finish()). The global norm and the skip stay global.
  void set_hparams(int b, const AdamWParams& hp);
  const AdamWParams& hparams(int b) const { return bucket_hp_.at(static_cast<size_t>(b)); }
  int64_t bucket_step(int b) const { return bucket_step_.at(static_cast<size_t>(b)); }
  void set_bucket_step(int b, int64_t step);
  // Backward: CPU bucket `b` has no gradient this step (counted as arrived, adds nothing
  // to the norm, not stepped).
  void on_absent_bucket(int b);

  // Whether CPU bucket `b` is speculated when it arrives (it has a second buffer, and
  // speculation is on), or deferred to finish() (Note [Bounded undo]). A pipeline asks when
  // it enqueues the bucket, to know whether to upload its weights then.
  bool admit(int b) const;
  // Note [Speculation after a clip]: between steps, speculation on (the default) or off for
  // the next steps: off, every bucket is deferred to finish(), which steps it once with the
  // final scale (out of place into its second buffer where it has one and writes a copy), instead
  // of a speculative pass and a replay. The results are the same bits either way.
  void set_speculation(bool on);
  bool speculation() const { return speculate_; }
  // CPU bucket `b`'s current p, m, v (n of that bucket each). Not while the bucket is being
  // stepped: between its arrival and the end of finish() only the old values are there.
  struct BucketState {
    float* p;
    float* m;
    float* v;
  };
  BucketState state(int b) const;
  // CPU bucket `b`'s speculative result: after its arrival, if it was speculated, and until
  // finish(), the state it will have if the step commits (its other buffer). A caller may
  // read it to publish the weights early (a commit keeps them; after a replay or a skip it
  // publishes state(b) again).
  BucketState speculative_state(int b) const;
  // CPU bucket `b`'s two weight buffers, the first in the caller's `p` and the second (null
  // without one) in the undo memory, and which of them is current (0 or 1): a caller whose
  // parameters view them points each at its current one after finish() (Note [Weights
  // shared with the parameters]). Between steps only.
  std::pair<float*, float*> weight_buffers(int b) const;
  int current_buffer(int b) const;
  // Backward: CPU bucket `b`'s gradient (n of that bucket, fp32 or bf16 bits) has arrived;
  // the pointer stays valid until finish(). Arrival order is free (normally last first).
  // Note [Norm lanes in the step's pass]: a speculated bucket's norm lanes are summed in
  // its step's pass. With `early` (n of fp32 for an fp32 gradient, of bf16 for a bf16
  // one; not with set_bf16_copy), a speculated bucket's step also writes its speculative
  // weights there in the same pass (Note [Early weights]); a deferred one writes nothing.
  void on_bucket(int b, const float* g, void* early = nullptr);
  void on_bucket_bf16(int b, const uint16_t* g, void* early = nullptr);
  // Backward: device bucket `b`'s sum of squares (add_lane_sums of its lanes) is known.
  void on_device_bucket(int b, double sum_of_squares);
  // Backward is done: every bucket has arrived. Validates, then commits, replays or skips
  // the CPU buckets; the device buckets are the caller's (see the split above).
  StvOutcome finish();
  // Sharded training (each process holds a shard of every parameter): the sum of squares
  // of this process's buckets once all have arrived (bucket order), and finish() with the
  // global sum (every process's, e.g. all-reduced), so that every shard clips by the same
  // norm and a NaN anywhere skips the step everywhere.
  double sum_of_squares() const;
  StvOutcome finish(double global_sum_of_squares);
  // The sum of squares of the buckets arrived so far (bucket order; the others add 0):
  // the norm a clip of the gradients handed over sees before finish() (Note [Clips the
  // speculation saw]). Equal to sum_of_squares() once every bucket has arrived.
  double arrived_sum_of_squares() const;
  // The step cannot complete (a gradient never arrived): undo every speculative bucket and
  // forget the step's buckets; the step counter does not advance.
  void abort();

  int64_t step() const { return step_; }
  // The gradient scale of the last finish() (1 unless clipped).
  float last_scale() const { return last_scale_; }
  // Whether CPU bucket `b` was stepped only in finish() this step (deferred or replayed):
  // its weights changed after its arrival. Valid between finish() and the next step.
  bool stepped_late(int b) const { return late_[static_cast<size_t>(b)] != 0; }
  // Whether that late step also wrote its weights to the bucket's `early` destination (given
  // at its arrival) in the same pass: nothing is left to publish.
  bool published_late(int b) const { return published_late_[static_cast<size_t>(b)] != 0; }
  const StvCounters& counters() const { return counters_; }
  // The second buffers' bytes (each bucket's p, m, v padded to kStateAlignFloats).
  int64_t undo_bytes() const { return static_cast<int64_t>(undo_floats_ * sizeof(float)); }

 private:
  void arrive(int b, const void* g, GradType type, void* early);
  // Steps CPU bucket b from its current buffer: into its other one (out of place, streamed:
  // Note [Streamed stores]) or in place; with `lanes`, also sums its gradient's norm lanes
  // in the same pass; with `early`, writes its weights there too (of the gradient's type).
  void run(int b, float scale, int64_t t, bool out_of_place, double* lanes = nullptr,
           void* early = nullptr);
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
  std::vector<float> undo_;     // the second buffers: p, m, v of each, back to back
  float* undo_base_ = nullptr;  // undo_'s first element at a kStateAlignFloats boundary
  size_t undo_floats_ = 0;
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
  std::vector<char> speculated_;      // per bucket: stepped speculatively this step
  std::vector<char> late_;            // per bucket: stepped in finish() this step
  std::vector<char> published_late_;  // per bucket: and its weights written to early_
  std::vector<void*> early_;          // per bucket: where its weights go, this step
  bool speculate_ = true;
  std::vector<char> absent_;            // per bucket: no gradient this step
  std::vector<AdamWParams> bucket_hp_;  // Note [Per-bucket hyperparameters and steps]
  std::vector<int64_t> bucket_step_;
};

// ---- The pipeline ----

enum class CastSite { kAuto, kDevice, kHost };

struct OptimOffloadOptions {
  AdamWParams hp;
  double clip = 1.0;  // global gradient norm threshold (<= 0: no clipping)
  CastSite cast = CastSite::kAuto;
  double link_gbps = 0.0;         // D2H bandwidth for the kAuto decision (0: measure-free guess)
  double cpu_cast_gbps = 0.0;     // CPU bf16->fp32 widening rate (bytes read per second / 1e9)
  int device_buckets = 0;         // GPU/CPU split
  int max_retries = 3;            // Note [Optimizer copy failures]
  int64_t undo_limit_bytes = -1;  // STV undo memory; < 0: every CPU bucket (Note [Bounded undo])
  // Caller-owned device memory (n bf16 elements each, alive as long as the pipeline): the
  // weights the model reads and the gradients it writes. Null: the pipeline allocates its
  // own. The constructor writes the initial weights' bf16 into `device_weights`.
  uint16_t* device_weights = nullptr;
  uint16_t* device_grads = nullptr;
};

// The optimizer state (p, m, v) in the caller's element order, gathered from host and
// device memory.
struct OptimState {
  std::vector<float> p, m, v;
};

// Where to cast (docs/optim.md): widening on the device and moving fp32 costs 4 bytes
// per element on the link; moving bf16 costs 2 bytes on the link plus the CPU widening. kHost when
// 2 / link + 2 / cpu_cast < 4 / link, i.e. when the CPU widens faster than the link moves.
CastSite choose_cast_site(double link_gbps, double cpu_cast_gbps);

class OptimizerOffload {
 public:
  // `weights` (n fp32): the initial master weights. `compute` is the training loop's
  // stream, where the gradients are produced; it must outlive the pipeline (whose
  // destructor waits for it). Allocates everything now.
  OptimizerOffload(Device& dev, Stream compute, const float* weights, size_t n,
                   std::vector<Bucket> buckets, const OptimOffloadOptions& o,
                   AdamW* pool = nullptr);
  ~OptimizerOffload();
  OptimizerOffload(const OptimizerOffload&) = delete;
  OptimizerOffload& operator=(const OptimizerOffload&) = delete;

  // Device buffers: the bf16 weights the model reads (n) and the bf16 gradients it writes
  // (n). Widening bf16 to fp32 is exact, so both cast sites give the same bits.
  uint16_t* device_weights() const;
  uint16_t* device_grads() const;

  // Backward: bucket b's gradient is complete once the work enqueued so far on the
  // compute stream has run. From then on the pipeline may overwrite the bucket's device
  // weights (with the speculative step's): the rest of backward must not read them, which
  // holds for a layerwise backward (a layer's weights are last read by its own backward).
  void on_bucket_grad(int b);
  // After backward: waits for the pipeline, validates, corrects the device weights on a
  // replay or a skip. The compute stream is ordered after the weight uploads. Sharded
  // training (each process holds a shard of every parameter: FSDP2): with the global sum of
  // squares (every process's sum_of_squares(), all-reduced), so that every shard clips by
  // the same norm and a NaN anywhere skips the step everywhere: the processes agree on the
  // outcome, so one's rollback is every one's.
  StvOutcome end_step(std::optional<double> global_sum_of_squares = std::nullopt);
  // After every bucket has arrived: this process's sum of squares of the step's gradients
  // (the CPU buckets' and the device buckets' lane sums; waits for them).
  double sum_of_squares();

  // Note [Per-bucket hyperparameters and steps], for CPU buckets, between steps: a
  // framework's parameter groups and learning-rate schedules (the device buckets of the
  // GPU/CPU split step with the options' hyperparameters).
  void set_hparams(int b, const AdamWParams& hp);
  int64_t bucket_step(int b) const;
  // Backward: CPU bucket b has no gradient this step (its state and step counter stay),
  // in stream order with the buckets that arrived.
  void on_bucket_absent(int b);
  // Drops the step in flight (the training loop will not finish it: its gradients were
  // changed or zeroed): every speculative bucket is undone and its weights are uploaded
  // again; the step counter does not advance. The compute stream is ordered after them.
  void abort_step();
  // Checkpoints (between steps): CPU bucket b's fp32 state, n of the bucket each; writing
  // it sets the bucket's step counter and uploads its bf16 weights.
  void read_bucket(int b, float* p, float* m, float* v) const;
  void write_bucket(int b, const float* p, const float* m, const float* v, int64_t step);
  // Milliseconds of CPU work of the last step: its bucket steps during backward and its
  // end_step (validation, deferred and replayed buckets, uploads enqueued).
  double last_cpu_ms() const;
  // The gradient scale of the last end_step (1 unless clipped).
  float last_scale() const;
  // Backward, before end_step: the sum of squares of the CPU buckets handed over so far,
  // once their steps are done (waits for them; the device buckets' sums are not in it).
  // Note [Clips the speculation saw].
  double arrived_cpu_sum_of_squares() const;

  CastSite cast_site() const;
  const StvCounters& counters() const;
  int64_t step() const;
  int64_t retries() const;  // copy enqueues retried (Note [Optimizer copy failures])
  int64_t undo_bytes() const;
  // The fp32 master weights and moments (waits for the streams), for tests and checkpoints.
  OptimState read_state() const;

 private:
  void fold_device_sums();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- The CPU AdamW over a framework's parameters ----

// Note [Speculative CPU AdamW over parameters]: spillway.torch's CPUAdamW on its CPU path.
// One bucket per parameter; the fp32 master weights and moments are this object's,
// allocated once. A parameter's gradient handed over (grad_ready) is stepped speculatively,
// in order, on a worker thread with the AdamW pool while the caller goes on; finish() waits
// for them and validates (Note [STV exactness]); abort() drops the step. The caller's memory
// named in a call (a gradient, a parameter) must stay valid and unchanged until finish(),
// abort() or the call's own return.
enum class ParamDtype { kFp32 = 0, kBf16 = 1 };  // what a parameter's memory holds
// Weights p (n) into a parameter's memory: an fp32 copy (streamed stores, Note [Streamed
// stores]) or the bf16 rounding (float_to_bf16), in SIMD.
void write_weights(const float* p, void* dst, ParamDtype dtype, size_t n);

// What finish() decided (the gradient scale: 1 unless clipped), the ms the worker spent on
// this step's buckets and the ms finish() took.
struct CpuStepResult {
  StvOutcome outcome = StvOutcome::kCommit;
  float scale = 1.0f;
  double worker_ms = 0.0;
  double finish_ms = 0.0;
};

// The checked inputs of an optimizer over a framework's parameters (SpeculativeCpuAdamW, and
// the Python device path over OptimizerOffload): the elements of `sizes` (at least one
// parameter, each >= 1), and the AdamW pool's threads (>= 0; 0: every core).
size_t parameter_elements(const std::vector<int64_t>& sizes);
int pool_threads(int threads);

class SpeculativeCpuAdamW {
 public:
  // `sizes`: elements per parameter (each >= 1); `clip` the global norm's bound (0: none);
  // not `speculative`: every bucket deferred to finish() (no undo memory: the exact
  // non-speculative optimizer); `threads` of the AdamW pool (0: every core).
  SpeculativeCpuAdamW(const std::vector<int64_t>& sizes, double clip, bool speculative,
                      int threads);
  ~SpeculativeCpuAdamW();
  SpeculativeCpuAdamW(const SpeculativeCpuAdamW&) = delete;
  SpeculativeCpuAdamW& operator=(const SpeculativeCpuAdamW&) = delete;

  // Note [Per-bucket hyperparameters and steps], between steps.
  void set_hparams(int b, const AdamWParams& hp);
  int64_t bucket_step(int b) const;
  void set_bucket_step(int b, int64_t t);
  // Bucket b's master weights from a parameter's memory (bf16 widened), or into it (bf16
  // rounded to nearest even); store_all writes every bucket's where it is not there yet
  // (Note [Early weights]), dealt to the pool's workers (a null destination is skipped).
  void load_weights(int b, const void* src, ParamDtype dtype);
  void store_weights(int b, void* dst, ParamDtype dtype);
  void store_all(const std::vector<void*>& dst, const std::vector<ParamDtype>& dtypes);
  // Bucket b's state (p, m, v; n of the bucket each) copied out or in.
  void read_state(int b, float* p, float* m, float* v);
  void write_state(int b, const float* p, const float* m, const float* v);
  // Bucket b's gradient is final (queued for the worker; returns at once). With `dst`, the
  // worker also writes the speculative weights there once stepped (Note [Early weights]).
  void grad_ready(int b, const void* grad, ParamDtype dtype, void* dst = nullptr);
  void absent(int b);  // bucket b has no gradient this step
  // Waits for the queued steps and validates (with the global sum of squares when given:
  // sharded training).
  CpuStepResult finish(std::optional<double> global_sum_of_squares = std::nullopt);
  // The step's sum of squares once every bucket arrived; of those arrived so far (Note
  // [Clips the speculation saw]). Both wait for the queued steps.
  double sum_of_squares();
  double arrived_sum_of_squares();
  // The step cannot complete: speculative buckets undone, early weights restored.
  void abort();
  // Note [Weights shared with the parameters]: bucket b's two weight buffers (the second
  // null where it has none), and the current buffer (0 or 1) of every bucket, after the
  // queued steps. A parameter may view them: load_weights, store_weights and write_state
  // from or to the current buffer itself copy nothing.
  std::pair<float*, float*> weight_buffers(int b);
  std::vector<uint8_t> current_buffers();

  int64_t step() const;
  const StvCounters& counters() const;
  int threads() const;
  int64_t state_bytes() const;
  int64_t undo_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The pipeline on the socket (spillway/device/hooks.hpp): grad_ready(b) hands bucket b over
// (OptimizerOffload::on_bucket_grad), step_end() validates and finishes the step
// (OptimizerOffload::end_step) and keeps its outcome.
class OptimizerHooks final : public TrainingHooks {
 public:
  explicit OptimizerHooks(OptimizerOffload& pipeline) : pipeline_(pipeline) {}
  void grad_ready(int bucket) override { pipeline_.on_bucket_grad(bucket); }
  void step_end() override { outcome_ = pipeline_.end_step(); }
  // What the last step_end() decided.
  StvOutcome outcome() const { return outcome_; }

 private:
  OptimizerOffload& pipeline_;
  StvOutcome outcome_{};
};

}  // namespace spillway::optim

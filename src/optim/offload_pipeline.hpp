// The bucketed optimizer-offload pipeline (DESIGN section 4): fp32 master weights and
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
// same pass (the AdamW and lane kernels of src/optim/cuda on a GPU; the same arithmetic
// as stream-ordered host work on the host backend). The host holds state only for the CPU
// buckets.
//
// Memory: pinned host memory of 12 bytes per CPU-bucket element (p, m, v), its gradient
// staging (4 or 2) and 2 per element of weight staging; STV's second buffers (Note
// [Bounded undo], `undo_limit_bytes`: 12 per speculated element, pageable);
// device memory of 4 bytes per element (bf16 weights and gradients), 4 more per CPU-bucket
// element for the device cast, and 12 per device-bucket element.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "optim/stv.hpp"
#include "spillway/device.hpp"

namespace spillway::optim {

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
};

// The optimizer state (p, m, v) in the caller's element order, gathered from host and
// device memory.
struct OptimState {
  std::vector<float> p, m, v;
};

// Where to cast (DESIGN section 4): widening on the device and moving fp32 costs 4 bytes
// per element on the link; moving bf16 costs 2 bytes on the link plus the CPU widening. kHost when
// 2 / link + 2 / cpu_cast < 4 / link, i.e. when the CPU widens faster than the link moves.
CastSite choose_cast_site(double link_gbps, double cpu_cast_gbps);

class OptimizerOffload {
 public:
  // `weights` (n fp32): the initial master weights. `compute` is the training loop's
  // stream, where the gradients are produced. Allocates everything now.
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
  // replay or a skip. The compute stream is ordered after the weight uploads.
  StvOutcome end_step();

  CastSite cast_site() const;
  const StvCounters& counters() const;
  int64_t step() const;
  int64_t retries() const;  // copy enqueues retried (Note [Optimizer copy failures])
  int64_t undo_bytes() const;
  // The fp32 master weights and moments (waits for the streams), for tests and checkpoints.
  OptimState read_state() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway::optim

namespace spillway::optim {

// The GPU/CPU split (DESIGN section 4): how many of the buckets that arrive last keep their
// optimizer step on the device. Per bucket, in arrival order: when its gradient is
// complete (ms from the start of backward), its CPU pipeline time (copy down, step, copy
// up; the CPU handles one bucket at a time), its device step time, and the HBM its fp32
// state needs on the device (12 bytes per element). The step ends when backward
// (`backward_ms`) and every bucket's update are done; the device steps its buckets after
// backward. Picks the n (from the last-arriving end) with the earliest end that fits in
// `free_hbm_bytes`; ties go to the smaller n.
struct BucketTiming {
  double arrive_ms = 0.0;
  double cpu_ms = 0.0;
  double device_ms = 0.0;
  int64_t state_bytes = 0;
};
struct SplitChoice {
  int device_buckets = 0;
  double end_ms = 0.0;       // of the optimizer step with that split
  double cpu_only_ms = 0.0;  // with device_buckets = 0
};
SplitChoice choose_device_buckets(const std::vector<BucketTiming>& arrival_order,
                                  double backward_ms, int64_t free_hbm_bytes);

}  // namespace spillway::optim

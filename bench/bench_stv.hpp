// The optimizer-offload pipeline benchmark (`spillway bench optim-offload`): how much of the
// offloaded optimizer step is left after backward ends (the tail on the critical path),
// with speculation-then-validation against the same pipeline without it, on the host
// backend with a throttled link.
//
// Method:
//   workload     `buckets` gradient buckets of `bucket_elements` each; a backward of
//                `backward_ms` on the compute stream hands one bucket over every
//                backward_ms / buckets (sleeping, as a GPU's backward leaves the CPU free,
//                then writing the bucket's bf16 gradients into device memory). Gradients
//                are small: every step commits, the steady state after warm-up.
//   variants     after-backward: undo memory 0, so every CPU step waits for the norm
//                (Note [Bounded undo]): the non-speculative optimizer, copies still
//                overlapped with backward (the baseline);
//                stv: every bucket speculated as it arrives;
//                stv+split: the same with the last `device_buckets` to arrive stepped on
//                the device (-1: chosen by choose_device_buckets from per-bucket
//                timings measured in this run). On the host backend the "device" step runs
//                on the compute stream's thread: the same CPU, so the split's gain here
//                understates a GPU's.
//   correctness  before timing, one step of each variant from the same weights and
//                gradients, and a second with clipping, must give bitwise the state of
//                optim::reference_adamw_step (a mismatch throws spillway::Error).
//   timing       per step, from the start of backward to end_step() returning with the
//                compute stream drained (the device weights are ready): step_ms; minus
//                backward's own end: tail_ms. The variants are interleaved, `repeats` x
//                `steps` samples each after one untimed round; figures are medians.
//   limit        the tail cannot be below 0 (the step ends with backward); without
//                speculation it is at least one CPU step of all buckets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace spillway {

struct StvBenchOptions {
  int buckets = 8;
  size_t bucket_elements = size_t{1} << 21;  // 2M: 16M parameters by default
  double backward_ms = 160.0;
  double d2h_gbps = 16.0;  // copy throttles, PCIe 5 x16-like (0: none)
  double h2d_gbps = 16.0;
  int device_buckets = -1;  // stv+split; -1: chosen from this run's timings
  int threads = 0;          // the CPU AdamW pool; 0: hardware concurrency
  int repeats = 3;
  int steps = 3;
  uint64_t seed = 1;
};

struct StvBenchVariant {
  std::string name;
  int device_buckets = 0;
  int64_t undo_bytes = 0;
  double step_ms = 0.0;  // medians
  double tail_ms = 0.0;
  double backward_ms = 0.0;  // measured
  std::vector<double> samples_tail_ms;
};

struct StvBenchResult {
  StvBenchOptions options;  // as run (threads, device_buckets resolved)
  int64_t elements = 0;
  // Per-bucket timings the split was chosen from (ms).
  double bucket_cpu_ms = 0.0;             // the sum of the next three
  double bucket_lanes_ms = 0.0;           // the norm lane sums (one thread)
  double bucket_step_ms = 0.0;            // the out-of-place step on the pool
  double bucket_link_ms = 0.0;            // down at d2h_gbps and up at h2d_gbps
  double bucket_device_ms = 0.0;          // the device-side step (here: one CPU thread)
  double predicted_end_ms = 0.0;          // choose_device_buckets' end of step for the chosen split
  bool correct = false;                   // the bitwise check passed (else it threw)
  std::vector<StvBenchVariant> variants;  // after-backward, stv, stv+split
  double stv_tail_ratio = 0.0;            // stv tail / after-backward tail
  double stv_step_ratio = 0.0;            // stv step / after-backward step
};

// Throws spillway::Error naming the field and its flag on bad options.
void check_stv_bench_options(const StvBenchOptions& options);
StvBenchResult run_stv_bench(const StvBenchOptions& options);
// spillway.bench.optim_offload/1
std::string stv_bench_json(const StvBenchResult& result);
std::string format_stv_bench(const StvBenchResult& result);

}  // namespace spillway

// The CPU AdamW benchmark (`spillway bench adam`): the multi-threaded SIMD step
// (optim::AdamW) in elements/s and GB/s of state traffic, beside three figures measured in
// the same run: this machine's memory bandwidth by a STREAM-style triad with the same number
// of threads (the limit), the scalar reference adamw_step_scalar on one thread (the
// baseline), and PyTorch's torch.optim.AdamW, foreach=True and fused=True (the stronger
// baseline, torch >= 2.4), in a Python subprocess when `import torch` works (skipped, and
// said so, otherwise). Targets: >= 0.9 x the triad's bytes/s; >= 5 x torch foreach's
// elements/s (fused has no target: it is the figure to quote).
//
// Method:
//   correctness  before anything is timed: the SIMD step (the AdamW class, all threads) and
//                the scalar reference run `check_steps` steps on copies of the same fresh
//                random inputs (the seed is printed); p, m, v and the low-precision copy
//                must agree to the bit (a mismatch throws spillway::Error naming the array,
//                the element and both values). The copies start poisoned with different
//                bits, so that an element neither writes fails.
//   ours         AdamW::step over all n elements, fp32 gradient, bf16 copy-out by default.
//   scalar       adamw_step_scalar over the same buffers, one thread.
//   triad        a[i] = b[i] + s * c[i] over three fp32 arrays much larger than the last-level
//                cache (max(n, 2^25) elements each), `threads` threads (std::thread, static
//                partition, the calling thread takes the first part), the widest vectors the
//                CPU has, ordinary (write-allocate) stores.
//   torch        one Python process for the whole run: it builds p (n, fp32) with a fixed
//                gradient and a copy of both for the fused optimizer, warms each optimizer
//                up (two steps), then times `steps` calls of .step() of each (foreach,
//                then fused) each time it is asked, with torch.set_num_threads(threads).
//   After one untimed round (triad, ours, scalar), each repeat runs triad, ours, scalar, torch
//   in turn (this machine's bandwidth drifts);
//   each runs `steps` timed calls, each call one sample. Figures are medians of the samples.
// Note [AdamW bytes]: a step moves 28 bytes per element (reads p, g, m, v; writes p, m, v;
// the writes go to lines just read, so no write-allocate), plus 2 per element for a bf16 or
// fp16 copy (its write-allocate read, 2 more if the stores are not streaming, is not
// counted: the fraction below is conservative). The triad moves 16 bytes per element (reads
// b, c; writes a, plus the write-allocate read of a). GB/s = 1e9 bytes per second;
// fraction_of_triad = AdamW bytes/s over triad bytes/s on that basis.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace spillway {

struct AdamBenchOptions {
  size_t elements = size_t{1} << 25;  // n: 28-30 B/elem of state, ~1 GB by default
  int repeats = 5;                    // triad, ours, scalar, torch interleaved this many times
  int steps = 3;                      // timed calls per method and repeat (one sample each)
  int threads = 0;                    // ours and the triad; 0: hardware concurrency
  bool copy_bf16 = true;              // write the bf16 copy of p in the same pass
  int check_steps = 3;                // steps of the bitwise check before timing
  uint64_t seed = 0;                  // inputs; 0: a fresh one (printed)
  size_t triad_elements = 0;          // per array; 0: max(n, 2^25)
  bool torch = true;                  // run the PyTorch comparison when torch imports
  std::string python;                 // interpreter; empty: python3, then /usr/bin/python3
  bool passes = false;                // also time the passes of CPUAdamW's paths (below)
};

// Note [The step's passes]: with `passes`, each repeat also times the shapes of pass the
// CPU paths of CPUAdamW run over the same n fp32 elements (docs/optim.md, "One pass per
// parameter"), against the in-place step that DeepSpeedCPUAdam runs:
//   in place                      28 B/element (the baseline: DeepSpeedCPUAdam's step)
//   in place + fp32 copy          32 (a deferred bucket's step writing the parameter)
//   out of place, streamed        28 (STV's second buffer, non-temporal stores)
//   out of place + fp32 copy      32 (a bucket handed over in step(), or early_weights)
//   + norm lanes                  32 (the same through AdamW::step_and_norm_lanes: the
//                                     speculative pass, lanes summed in it)
//   norm lanes alone               4 (a deferred bucket's arrival)
// Each its median ms per step of n elements and its ratio to the in-place step's: what the
// exact rollback (the old state kept) and the norm cost beyond DeepSpeed's pass, measured.
struct AdamPass {
  std::string name;
  double bytes_per_element = 0.0;
  std::vector<double> samples_ms;
  double ms = 0.0;        // median
  double relative = 0.0;  // ms / the in-place step's ms
};

struct AdamBenchResult {
  AdamBenchOptions options;        // as run: threads, seed and triad_elements resolved
  std::string simd_target;         // optim::adamw_simd_target()
  int threads = 0;                 // AdamW::threads() (= the triad's)
  double bytes_per_element = 0.0;  // Note [AdamW bytes]: 28, +2 with a copy
  double triad_bytes_per_element = 16.0;
  size_t llc_bytes = 0;  // last-level cache, 0 when unknown

  // Correctness (a failure throws: a result always has correct == true).
  bool correct = false;
  int64_t elements_checked = 0;  // n x check_steps, each of p, m, v and the copy bitwise

  // Medians over samples; elements/s of the step, GB/s of traffic (Note [AdamW bytes]).
  double elements_per_s = 0.0;  // ours
  double state_gbps = 0.0;
  double triad_gbps = 0.0;
  double fraction_of_triad = 0.0;  // state_gbps / triad_gbps
  double scalar_elements_per_s = 0.0;
  double scalar_gbps = 0.0;
  double scalar_ratio = 0.0;                   // elements_per_s / scalar_elements_per_s
  std::vector<double> samples_elements_per_s;  // ours, one per timed call
  std::vector<double> samples_triad_gbps;
  std::vector<double> samples_scalar_elements_per_s;

  // PyTorch: ran == false with skip_reason when it did not run.
  bool torch_ran = false;
  std::string torch_skip_reason;
  std::string torch_python;   // the interpreter that imported torch
  std::string torch_version;  // torch.__version__
  int torch_threads = 0;      // torch.get_num_threads() after set_num_threads(threads)
  double torch_elements_per_s = 0.0;
  double torch_ratio = 0.0;  // elements_per_s / torch_elements_per_s
  std::vector<double> samples_torch_elements_per_s;
  // torch.optim.AdamW(fused=True) in the same process (torch >= 2.4): the stronger
  // baseline, the one to quote. ran == false with skip_reason when torch has none.
  bool torch_fused_ran = false;
  std::string torch_fused_skip_reason;
  double torch_fused_elements_per_s = 0.0;
  double torch_fused_ratio = 0.0;  // elements_per_s / torch_fused_elements_per_s
  std::vector<double> samples_torch_fused_elements_per_s;

  std::vector<AdamPass> passes;  // Note [The step's passes]; empty unless options.passes

  double target_fraction_of_triad = 0.9;
  double target_torch_ratio = 5.0;
  bool meets_triad_target() const { return fraction_of_triad >= target_fraction_of_triad; }
  bool meets_torch_target() const { return torch_ran && torch_ratio >= target_torch_ratio; }
};

// Runs the benchmark. Throws spillway::Error on bad options (the message names the field
// and its flag), when the run would not fit in the machine's memory, or when the SIMD step
// and the scalar reference disagree in a bit. A torch that cannot run is not an error:
// torch_skip_reason says why.
AdamBenchResult run_adam_bench(const AdamBenchOptions& options);
// The option checks run_adam_bench starts with (for a caller that prints before it runs).
void check_adam_bench_options(const AdamBenchOptions& options);

// spillway.bench.adam/1: elements_per_s, state_gbps, triad_gbps, fraction_of_triad,
// scalar_ratio, torch_ratio and torch_fused_ratio (null when that torch optimizer did not
// run), simd_target, threads, samples,
// then targets, torch details and the workload.
std::string adam_bench_json(const AdamBenchResult& result);

// The table: measured, baseline, ratio, target; then the conventions and the samples.
std::string format_adam_bench(const AdamBenchResult& result);

// The Python script run for the torch comparison (argv: n threads steps lr beta1 beta2 eps
// weight_decay seed); exposed for tests and for reading.
std::string adam_bench_torch_script();

}  // namespace spillway

// The activation offload engine's benchmark (`spillway bench offload`): offload (D2H) and
// reload (H2D) throughput against plain memcpy bandwidth measured in the same run (the
// limit: the host backend's copy engines are worker threads doing memcpy), and the CPU
// overhead per offloaded tensor in microseconds. Targets: >= 0.9 x memcpy; < 2 us/tensor.
//
// Method (host backend, unthrottled; pools hold every tensor twice on the device and once on
// the host, so that no call waits for memory and nothing falls back):
//   bandwidth pass  a training-loop-shaped step: forward allocates each tensor from the
//                   engine, writes it on the compute stream (the "compute"), offload()s
//                   it, end_forward_layer(); backward from the last layer
//                   prefetch(layer - depth), reload()s each tensor, checks it on the
//                   compute stream, free()s it; end_step(). The first step of every repeat
//                   is the warm-up and the correctness pass: every byte is written and
//                   every reloaded byte compared (a mismatch throws spillway::Error). In
//                   the timed steps the compute writes and checks the first and last words
//                   of each tensor only (tags differ per step, so stale data still fails):
//                   a full fill would compete with the copies for this machine's memory
//                   bandwidth, which a GPU's compute does not do with its host link.
//   memcpy          before each timed step (plus one untimed pass after the warm-up):
//                   std::memcpy of the same bytes, in the same chunk size, between two
//                   pre-touched buffers allocated like the host backend's memory
//                   (aligned_alloc, 4 KiB pages), single thread.
//   overhead pass   many small tensors and no compute, so that no call waits for a copy:
//                   host time inside offload + reload + free + prefetch +
//                   end_forward_layer (steady_clock around each call) over the tensors of
//                   the step.
// The passes are interleaved `repeats` times (bandwidth drifts on a shared machine);
// figures are medians over the steady-state steps (all but the first of each repeat) and
// over the memcpy samples.
// Convention: GB/s = 1e9 bytes copied per second, each byte counted once (the memory
// traffic, one read and one write per byte, is twice that); offload_gbps is bytes moved
// device->host over the wall time of the step's D2H copies (StepTelemetry::d2h_gbps), the
// same convention as memcpy_gbps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace spillway {

struct OffloadBenchOptions {
  int layers = 32;
  int tensors_per_layer = 3;
  size_t tensor_bytes = size_t{8} << 20;
  int steps = 5;    // per repeat and pass; the first is the warm-up (and correctness) step
  int repeats = 3;  // memcpy, bandwidth pass and overhead pass, interleaved
  int prefetch_depth = 1;
  // Overhead pass: small tensors, many of them (copy time negligible, no waits).
  int overhead_layers = 20;
  int overhead_tensors_per_layer = 100;
  size_t overhead_tensor_bytes = size_t{64} << 10;
  // The CUDA device 0 instead of the host backend (Note [Offload bench backends]): the limit
  // is then the pinned link, measured in the same run.
  bool cuda = false;
};

struct OffloadBenchResult {
  std::string backend;  // Device::name()
  OffloadBenchOptions options;
  int64_t bytes_per_step = 0;  // layers x tensors_per_layer x tensor_bytes, each way

  // Correctness (a failure throws: a result always has correct == true).
  bool correct = false;
  int64_t bytes_checked = 0;   // compared byte for byte in the warm-up steps
  int64_t stamps_checked = 0;  // tensors whose end words were checked in timed steps

  // Bandwidth, GB/s (1e9 bytes copied per second, each byte counted once): medians.
  std::string limit;  // what the engine's copies are held to: "memcpy" or "pinned link"
  double limit_d2h_gbps = 0.0;
  double limit_h2d_gbps = 0.0;
  std::vector<double> limit_d2h_samples_gbps;
  std::vector<double> limit_h2d_samples_gbps;
  double memcpy_gbps = 0.0;  // the host backend's limit (both directions); 0 on CUDA
  double offload_gbps = 0.0;
  double reload_gbps = 0.0;
  std::vector<double> memcpy_samples_gbps;
  std::vector<double> offload_samples_gbps;  // one per steady-state step
  std::vector<double> reload_samples_gbps;
  double offload_ratio = 0.0;  // offload_gbps / limit_d2h_gbps
  double reload_ratio = 0.0;   // reload_gbps / limit_h2d_gbps

  // CPU overhead, us per offloaded tensor (medians over steady-state steps).
  double overhead_us_per_tensor = 0.0;  // offload + reload + free + prefetch + end_forward_layer
  double offload_us = 0.0;              // its parts
  double reload_us = 0.0;
  double free_us = 0.0;
  double layer_calls_us = 0.0;  // prefetch + end_forward_layer, per tensor
  double allocate_us = 0.0;     // engine.allocate(), not counted in the overhead
  // Cross-check: the whole loop of the overhead pass (every call, allocate and timer reads
  // included), wall time and the host thread's CPU time; wall well above CPU means the
  // thread was descheduled (other threads or processes on the machine's cores).
  double loop_wall_us = 0.0;
  double loop_cpu_us = 0.0;
  std::vector<double> overhead_samples_us;
  int overhead_tensors_per_step = 0;

  // Steady state: every step after each engine's first.
  int64_t allocations_steady_state = 0;  // sum of StepTelemetry::device_allocations
  int64_t allocations_first_step = 0;    // the same for the engines' first steps
  int64_t fallbacks_steady_state = 0;    // kept + direct (pools are sized for zero)
  double backpressure_ms_steady_state = 0.0;
  int steady_steps = 0;  // bandwidth-pass steps timed

  double target_ratio = 0.9;
  double target_overhead_us = 2.0;
  bool meets_bandwidth_target() const {
    return offload_ratio >= target_ratio && reload_ratio >= target_ratio;
  }
  bool meets_overhead_target() const { return overhead_us_per_tensor < target_overhead_us; }
};

// Runs the benchmark on a host backend it creates (or CUDA device 0: options.cuda). Throws
// spillway::Error on bad options, when the run would not fit in the machine's memory, when
// a reloaded byte differs, or (CUDA) when there is no CUDA device.
OffloadBenchResult run_offload_bench(const OffloadBenchOptions& options);

// spillway.bench.offload/1: offload_gbps, reload_gbps, memcpy_gbps, overhead_us_per_tensor,
// allocations_steady_state, then ratios, targets, samples and the workload.
std::string offload_bench_json(const OffloadBenchResult& result);

// The table: baseline (memcpy), measured figures, ratios and targets, and the limit.
std::string format_offload_bench(const OffloadBenchResult& result);

}  // namespace spillway

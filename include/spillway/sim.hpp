// The simulator: replays a plan as discrete events on the resources of one or more GPUs
// (a compute stream, a D2H copy engine and an H2D copy engine each, and a communication
// stream when the plan has collectives), host links whose bandwidth per direction is split
// fairly among the transfers on them (offload copies and collectives through the host),
// per-GPU NVLink / network links, and HBM bandwidth that copies share with memory-bound
// kernels. It reports the timeline, the copy backlog
// at each layer boundary (a growing backlog is a snowball), memory over time and stalls.
//
// Scenarios: one training step of a plan (any strategy) on N GPUs with K of them per
// host link; a layerwise weight-streaming pass (prefetch depth d, d + 1 buffers).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "spillway/plan.hpp"

namespace spillway {

// ---- the engine's vocabulary (used by the scenarios, the trace and the tests) ---------

enum class ResourceKind { kCompute, kD2H, kH2D, kComm };  // kComm: the collectives' stream
std::string to_string(ResourceKind k);

enum class TaskKind {
  kForward,     // a forward op
  kBackward,    // a layer's backward (including its recompute)
  kRecompute,   // forward ops re-run in backward
  kHead,        // LM head + loss, forward and backward
  kOptimizer,   // the optimizer's part of the step on the critical path (after backward)
  kD2H,         // offload copy
  kH2D,         // reload (or weight) copy
  kCollective,  // a layer's collective (CollectivePlan): its ring bytes on its link
};
std::string to_string(TaskKind k);

struct TaskRecord {  // one finished task
  std::string name;  // "L7 mlp.gate", "L7 mlp.gate_out", "W12"
  TaskKind kind = TaskKind::kForward;
  int gpu = 0;
  int layer = -1;
  int micro_batch = 0;
  int64_t bytes = 0;  // copies; collectives: the ring's byte volume (spillway/collectives.hpp)
  std::string link;   // collectives: "nvlink", "network" or "host"
  double start_ms = 0.0;
  double end_ms = 0.0;
  double ready_ms = 0.0;  // when its dependencies were met (start - ready = queueing)
};

struct MemoryPoint {  // device memory of GPU 0 from this time on
  double t_ms = 0.0;
  int64_t bytes = 0;
};

struct SimOptions {
  int gpus = 0;                      // 0: the profile's gpus_per_link (one shared link)
  int gpus_per_link = 0;             // 0: all simulated GPUs on one link
  bool hbm_contention = true;        // copies and memory-bound kernels share HBM bandwidth
  int64_t inflight_bound_bytes = 0;  // D2H bytes in flight before compute waits; 0 = none
  int prefetch_depth = 0;            // 0: the plan's
  bool keep_tasks = true;            // keep every TaskRecord (trace, plots); off for benches
};

struct SimSummary {
  double step_ms = 0.0;     // makespan of the slowest GPU
  double compute_ms = 0.0;  // GPU 0's compute stream busy time
  double recompute_ms = 0.0;
  double stall_ms = 0.0;         // compute waiting on copies (reloads, back-pressure)
  double backpressure_ms = 0.0;  // part of stall_ms spent at the in-flight bound
  double exposed_copy_ms = 0.0;  // copy time after the last compute
  double idle_ms = 0.0;          // makespan - compute - recompute - stall - collective_wait
  double link_d2h_gbps = 0.0;    // achieved: bytes / time with a transfer on the link
  double link_h2d_gbps = 0.0;
  double link_gbps_achieved = 0.0;  // max of the two directions
  int64_t d2h_bytes = 0;            // issued = completed (conservation)
  int64_t h2d_bytes = 0;
  int64_t peak_hbm_bytes = 0;  // GPU 0, static memory included
  double peak_hbm_ms = 0.0;    // when GPU 0 first reaches its peak
  // The memory verdict (Note [Simulated memory verdict] in src/sim/scenarios.cpp): the
  // peak must fit the GPU's HBM and the plan's budget; every GPU runs the same plan, so
  // GPU 0's peak stands for all of them. An infeasible result is a value, not an error.
  bool feasible = true;
  std::vector<std::string> reasons;    // why not, in words and numbers (GB = 1e9 bytes)
  int64_t hbm_capacity_bytes = 0;      // the GPU's HBM (hardware profile); 0 = unknown
  int64_t hbm_budget_bytes = 0;        // the plan's budget; 0 = unknown
  std::vector<int64_t> backlog_bytes;  // GPU 0, per layer, at the end of its forward
  bool snowball = false;
  std::optional<int> snowball_first_layer;
  int64_t events = 0;               // engine events processed
  double hbm_slowdown = 0.0;        // worst slowdown factor applied by HBM sharing
  std::vector<double> gpu_step_ms;  // per GPU
  // Collectives (Note [Collectives in the simulator] in src/sim/scenarios.cpp).
  double collective_ms = 0.0;         // GPU 0's communication stream busy time
  double collective_wait_ms = 0.0;    // GPU 0's compute waiting on collectives (exposed)
  double collective_tail_ms = 0.0;    // collectives after GPU 0's last compute and copy
  int64_t collective_bytes = 0;       // ring bytes issued = completed, every GPU
  int64_t collective_host_bytes = 0;  // the part that crossed the host links
  int collectives = 0;                // collective tasks, every GPU
};

struct SimResult {
  SimSummary summary;
  std::vector<TaskRecord> tasks;         // every task of every GPU (when keep_tasks)
  std::vector<MemoryPoint> memory;       // GPU 0's device memory over time
  std::vector<double> layer_fwd_end_ms;  // GPU 0, micro-batch 0
  std::string scenario;                  // "train-step" or "weight-stream"
  int gpus = 1;
  int gpus_per_link = 1;
  double link_d2h_gbps = 0.0;  // link capacity per direction
  double link_h2d_gbps = 0.0;
};

// One training step (grad_accum micro-batches) of `plan` on every simulated GPU.
// Link capacity per direction = the plan's per-GPU figure x the profile's gpus_per_link.
SimResult simulate_training_step(const Plan& plan, const PlanRequest& request,
                                 const SimOptions& options);

// A forward pass that streams every layer's weights host->device, `depth` layers ahead,
// into depth + 1 device buffers (docs/stream.md).
struct StreamOptions {
  int depth = 1;
  int gpus = 1;
  int gpus_per_link = 1;
  bool keep_tasks = true;
  // Note [Sharded streaming]: the GPUs of one link each copy 1/gpus_per_link of a layer
  // (shards rounded up to 256 bytes, as the engine cuts them) and all-gather the rest from
  // their peers over a link of peer_gbps per GPU (GB/s, > 0) before the layer computes.
  bool sharded = false;
  double peer_gbps = 0.0;
  // A training step's layers: forward, then backward (LayerPlan::bwd_ms) visiting them in
  // reverse, each re-streamed except the depth + 1 still in their buffers at the turn, as
  // the engine does (Note [Streaming across steps]). The optimizer is not simulated.
  bool training = false;
};
SimResult simulate_weight_streaming(const Plan& plan, const PlanRequest& request,
                                    const StreamOptions& options);

// Chrome trace-event JSON (Perfetto, chrome://tracing): one process per GPU, one track
// per resource, each event named and carrying layer, tensor and bytes.
std::string sim_trace_json(const SimResult& result);
// The memory-over-time curve and the per-layer copy backlog as one SVG picture.
std::string sim_plot_svg(const SimResult& result, const std::string& title);
// The summary for scripts.
std::string sim_summary_json(const SimResult& result);
// The human report.
std::string format_sim_report(const SimResult& result, const PlanRequest& request);

}  // namespace spillway

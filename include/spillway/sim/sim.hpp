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
//
// The engine under them (sim::Engine, at the end) is the project's one discrete-event
// engine: serving's trace replay (spillway/serve/replay.hpp) runs on it too.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "spillway/plan/plan.hpp"

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
  int64_t bytes = 0;  // copies; collectives: the ring's byte volume (spillway/plan/collectives.hpp)
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
  // The memory verdict (Note [Simulated memory verdict] in src/sim/scenario_parts.cpp):
  // the peak must fit the GPU's HBM and the plan's budget; every GPU runs the same plan, so
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

// ---- the discrete-event engine ----------------------------------------------------------
//
// A fluid model of streams, copy engines, shared host links and shared HBM bandwidth.
// Tasks run on serial streams (in submission order, as CUDA streams do) once their
// dependencies have finished. A compute task has work in milliseconds at full speed; a
// copy task has work in bytes and a link direction. Between two events every running task
// progresses at a constant rate:
//   - a copy gets an equal share of its link direction's capacity (re-split whenever a
//     transfer starts or ends); a transfer that crosses two link directions (a collective
//     through the host link sends on D2H and receives on H2D) runs at the smaller of its
//     two shares; a transfer's latency_ms (a collective's ring steps) runs first, on its
//     stream but off the link;
//   - Note [HBM sharing]: on a GPU running a memory-bound kernel, the kernel demands the
//     whole HBM bandwidth H and its copies demand their link rates r_i; when H + sum r_i
//     exceeds H, the kernel and the copies all slow by the factor H / (H + sum r_i). GEMMs
//     and attention are compute-bound and are not slowed. The model can be turned off.
// Note [Fixed tasks]: a fixed task takes exactly `work` ms from its start, outside the
// fluid model (no link, no rate, no HBM sharing). It starts when it heads its stream (a
// task on no stream, stream -1, is a timer: it waits for nothing else) and its dependencies
// have finished, and not before not_before_ms; it ends at start_ms + work, computed once
// when it starts, so its end time is exact. Fixed tasks that end at the same time end one
// at a time in the order they were added.
// Note [Engine clients]: run(on_finish) calls on_finish(task) once per task as it ends
// (now_ms() is its end), in the order they end; the client may then add tasks without
// dependencies (each starts at once if it can) and recycle finished tasks. A discrete-event
// simulation of its own (serving's trace replay) is a client whose events are fixed tasks.
// Invariants (checked by tests): time never runs backwards; a stream runs one task at a
// time; every byte issued completes; per-resource busy time <= makespan.
namespace sim {

struct Task {
  TaskKind kind = TaskKind::kForward;
  int gpu = 0;
  int layer = -1;
  int micro_batch = 0;
  int label = -1;  // index into the client's label table (task names)
  int stream = -1;
  int link = -1;   // copies and collectives: link direction
  int link2 = -1;  // a second direction the transfer also occupies (-1: none)
  bool memory_bound = false;
  bool fixed = false;  // Note [Fixed tasks]: work is ms, the end exact
  // filled by the run (placed beside the flags, it fills their padding)
  int last_dep = -1;  // the dependency that finished last (what it waited on)
  double work = 0.0;  // ms (compute, fixed) or bytes (copy)
  // A transfer's fixed time before its bytes move (a collective's ring-step latency), in
  // ms, during which it holds its stream but not its link.
  double latency_ms = 0.0;
  double not_before_ms = 0.0;  // a fixed task starts no earlier (ms)
  // filled by the run
  double ready_ms = -1.0;  // dependencies met (and head of its stream)
  double start_ms = -1.0;
  double end_ms = -1.0;
};

class Engine {
 public:
  // Note [Engine clients]: called for every task as it ends.
  using FinishHook = std::function<void(int task)>;

  // A serial stream of one GPU (compute, D2H engine, H2D engine or communication).
  int add_stream(int gpu, ResourceKind kind);
  // A link direction with a capacity in bytes per millisecond.
  int add_link(double bytes_per_ms);
  // HBM bandwidth of a GPU in bytes per ms (0 = no HBM sharing for that GPU).
  void set_hbm(int gpu, double bytes_per_ms);
  // Appended to the end of t.stream's queue. During run() (from on_finish): a task without
  // dependencies, which starts at once if it can, in the id of a recycled task if any.
  int add_task(const Task& t);
  void add_dep(int task, int depends_on);  // before run()
  void reserve(size_t tasks, size_t deps);

  void run(const FinishHook& on_finish = {});
  // During run(): a finished task without dependents that the client no longer reads, once;
  // a later add_task may reuse its id and record (a long run's memory stays that of its
  // live tasks).
  void recycle(int task);

  const std::vector<Task>& tasks() const { return tasks_; }
  ResourceKind stream_kind(int stream) const { return streams_[static_cast<size_t>(stream)].kind; }
  int stream_gpu(int stream) const { return streams_[static_cast<size_t>(stream)].gpu; }
  double now_ms() const { return now_; }
  double makespan_ms() const { return now_; }
  int64_t events() const { return events_; }
  double worst_hbm_slowdown() const { return worst_slowdown_; }
  // Time during which the link direction carried at least one transfer.
  double link_busy_ms(int link) const { return links_[static_cast<size_t>(link)].busy_ms; }
  double stream_busy_ms(int stream) const { return streams_[static_cast<size_t>(stream)].busy_ms; }

 private:
  struct Stream {
    int gpu = 0;
    ResourceKind kind = ResourceKind::kCompute;
    std::vector<int> queue;  // from head on: not finished (emptied when a client refills it)
    size_t head = 0;
    bool running = false;
    double busy_ms = 0.0;
  };
  struct Link {
    double capacity = 0.0;
    int active = 0;
    double busy_ms = 0.0;
  };
  struct FixedEnd {  // a started fixed task (Note [Fixed tasks])
    double end_ms = 0.0;
    int64_t order = 0;  // add order: equal ends end in it
    int task = 0;
  };

  int add_during_run(const Task& t);  // from on_finish (Note [Engine clients])
  void try_start(int stream);
  void start_fixed(int task);
  void start_timer(int task);  // a task on no stream, if it may start
  void finish(int task);
  void end_next_fixed();  // the earliest fixed end: finish, start what follows, on_finish

  std::vector<Task> tasks_;
  std::vector<Stream> streams_;
  std::vector<Link> links_;
  std::vector<double> hbm_;     // per GPU
  std::vector<int> unmet_;      // per task
  std::vector<int64_t> order_;  // per task: add order (Note [Fixed tasks]); empty: the id
  std::vector<std::pair<int, int>> edges_;  // (depends_on, task), sorted into CSR at run()
  std::vector<int> dep_begin_;
  std::vector<int> dependents_;
  std::vector<int> timers_;        // tasks on no stream added before run()
  std::vector<int> active_;        // running fluid tasks
  std::vector<double> remaining_;  // per task
  std::vector<double> rate_;       // per task
  std::vector<char> in_latency_;   // per task: still in its latency_ms
  std::vector<FixedEnd> fixed_;    // started fixed tasks, a min-heap on (end_ms, order)
  std::vector<int> recycled_;      // ids add_task may reuse
  size_t unfinished_ = 0;
  size_t submitted_ = 0;
  const FinishHook* on_finish_ = nullptr;
  bool running_ = false;
  double now_ = 0.0;
  int64_t events_ = 0;
  double worst_slowdown_ = 1.0;
};

}  // namespace sim
}  // namespace spillway

// `spillway train`: the reference model trained end to end under a memory policy (keep,
// recompute, offload, selective, hybrid, auto, or a plan JSON), on the host backend with
// optionally throttled copy engines, with per-step figures, and `--compare` runs of every
// policy on the same seed beside the planner's predictions; and `spillway stream`'s run of
// the reference model with its weights streamed beside the same model resident.
//
// Invariants: every policy of one run sees the same initial weights and the same batches
// (both from --seed), so losses and gradients are bitwise identical across policies
// (Note [Saved tensors] in model.hpp); the planner is calibrated from measured layer
// times (the keep run's under --compare, else a calibration step's).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "spillway/nn/nn.hpp"
#include "spillway/optim/optim.hpp"
#include "spillway/plan/plan.hpp"
#include "spillway/plan/stream_mode.hpp"
#include "spillway/stream/weight_streamer.hpp"

namespace spillway::train {

// The ranges TrainOptions must be in (run() refuses others, naming the field; the CLI
// states them in --help). keep_last is also <= the model's layers and device_buckets <= its
// optimizer buckets (layers + 2); undo_mb < 0 means every CPU bucket.
struct TrainLimits {
  static constexpr int kMaxSteps = 1000000;
  static constexpr int kMaxMicroBatch = 1 << 20;
  static constexpr int kMaxSeqLen = 4096;  // the reference model's positions
  static constexpr double kMaxDeviceMemoryMb = 1e6;
  static constexpr double kMaxLr = 1.0;
  static constexpr double kMaxClip = 1e6;
  static constexpr double kMaxUndoMb = 1e6;
};

// Note [A link that changes speed]: from step `step` on (1-based, as the step lines count),
// the emulated link runs at `gbps` in both directions (other jobs on the host link, a
// throttle lifted).
struct LinkChange {
  int step = 1;
  double gbps = 0;
};

// Note [A run's link time]: every byte a run copies crosses the emulated link, so the run
// takes at least its link bytes over the link's speed (each direction on its own copy
// engine: the slower direction bounds it). A run whose bound is over max_link_seconds is
// refused before its first step, not after hours: spillway stream (the streamed layer
// weights) and spillway train (the offloaded activations, both ways) share this check.
struct LinkTime {
  double bytes = 0;    // over the run
  double seconds = 0;  // at least: bytes at the link's speed
  void add(double b, double gbps) {
    bytes += b;
    seconds += b / (gbps * 1e9);
  }
  bool over(double max_seconds) const { return !(seconds <= max_seconds); }
};

struct TrainOptions {
  std::string model = "tiny-moe";
  int steps = 20;
  int micro_batch = 8;
  int seq_len = 128;
  std::string policy = "keep";  // keep|recompute|offload|selective|hybrid|checkpoint|auto|PATH.json
  std::string device = "host";
  double device_memory_mb = 256;  // the emulated device's capacity (MiB)
  double d2h_gbps = 0;            // copy throttles (0 = memcpy speed)
  double h2d_gbps = 0;
  uint64_t seed = 1;
  double lr = 3e-3;
  std::string corpus;  // byte-level text; empty: the default corpus
  int prefetch_depth = 1;
  int keep_last = 1;
  double margin = 0.10;
  bool compare = false;
  bool fused_swiglu = false;  // the SwiGLU backward recomputes mlp.act: only gate and up saved
  // Note [Named offload tensors]: exactly these tensors offloaded in every offloading layer
  // (names of docs/plan-schema.md or groups); empty: the planner chooses.
  std::vector<std::string> offload_tensors;
  // Note [A link that changes speed]: needs d2h_gbps and h2d_gbps, the speed before the
  // first change.
  std::vector<LinkChange> link_schedule;
  // Note [A fixed calibration]: the layer forward time (ms) the planner plans with instead
  // of a measured one; adaptive then judges each step by the link's emulated speed and the
  // plan alone, so that its re-plans are the same on every machine. Unset: measured.
  std::optional<double> layer_fwd_ms;
  // Optimizer offload (docs/optim.md): "device" (the model's AdamW on the device) or
  // "offload" (optim::OptimizerOffload: fp32 master weights and moments in host memory,
  // bf16 weights and gradients on the device, STV, the host cast).
  std::string optimizer = "device";
  int device_buckets = 0;  // offload: buckets (embedding first) stepped on the device
  double undo_mb = -1;     // offload: STV undo memory in MiB (< 0: every CPU bucket)
  double clip = 1.0;       // offload: gradient-norm clipping threshold (0: none)
  // Note [A run's link time]: a run whose copies alone would take longer is refused.
  double max_link_seconds = 3600.0;
};

// The default corpus: the GNU GPL v3 text every Debian system ships (base-files).
inline constexpr const char* kDefaultCorpus = "/usr/share/common-licenses/GPL-3";

struct StepRecord {
  int step = 0;
  double loss = 0;
  double step_ms = 0;
  double optimizer_ms = 0;  // the optimizer after backward (AdamW or end_step)
  int64_t peak_device_bytes = 0;
  int64_t offloaded_bytes = 0;
  int64_t reloaded_bytes = 0;
  double stall_ms = 0;
  bool snowball = false;
  std::optional<int> snowball_layer;
};

struct PolicyResult {
  std::string name;
  std::vector<StepRecord> steps;
  double loss = 0;                // of the last step
  double step_ms = 0;             // median over the steps after the first
  int64_t peak_device_bytes = 0;  // max over the steps
  // Note [Auto covers the copies' pace]: the offload engine's bound on D2H bytes in flight;
  // how much more a step's peak may be when the copies run slower (0 without offload).
  int64_t inflight_bound_bytes = 0;
  int64_t offloaded_bytes = 0;  // per step (the last)
  double stall_ms = 0;          // median
  bool snowball = false;
  std::optional<int> snowball_layer;
  std::vector<double> layer_fwd_ms;  // mean over the steps after the first
  std::vector<double> layer_bwd_ms;
  // The planner's prediction for this policy (calibrated from measured layer times).
  double predicted_step_ms = 0;
  int64_t predicted_peak_bytes = 0;
  bool predicted_feasible = true;
  // False for a plan file: its prediction is the file's own (its hardware, its layer
  // times), not calibrated to this run's measured layers.
  bool prediction_calibrated = true;
  std::string plan_note;               // e.g. "auto chose recompute in 3 layers, offload in 1"
  int64_t recomputed_ops = 0;          // forward ops run again in backward, per step (the last)
  int64_t recomputed_scans = 0;        // of them, Mamba selective scans
  std::vector<float> final_gradients;  // of the last step (for identity checks)
  // The optimizer's median time after backward (steps after the first: the model's AdamW,
  // or the offloaded end_step); offloaded: STV's counters and the fp32 master weights
  // after the last step (for identity checks).
  double optimizer_ms = 0;
  optim::StvCounters optimizer_counters;
  std::vector<float> final_master_weights;
  std::string error;  // --compare: why this policy could not run
  // --policy adaptive (Note [Re-planning while training]): each re-plan between steps, with
  // its numbers, in order.
  std::vector<std::string> replans;
};

struct TrainReport {
  std::vector<PolicyResult> policies;
  std::string corpus;
  int64_t corpus_bytes = 0;
  int64_t parameters = 0;
  // Across the policies that ran (compare): meaningful only with policies_compared >= 2
  // (the JSON then writes true or false, else null: nothing was compared).
  bool losses_identical = true;
  int policies_compared = 0;
  // This machine's memcpy through the host backend's copy engine, measured in the run (the
  // probe, unthrottled): a throttle above it, or the 20 GB/s an unthrottled link is planned
  // at, is out of reach, and the report says the machine is the limit (Note [The machine is
  // the limit] in spillway/probe/probe.hpp). 0: not measured.
  double memcpy_gbps = 0.0;
};

// Note [The model's own update] (spillway/nn/nn.hpp): the reference model's optimizer when it
// is not offloaded, AdamW as Loshchilov and Hutter write it: the decay inside the update,
// the bias corrections on the moments, float throughout (the per-step scalars too):
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g;
//   p -= lr (m / bc1 / (sqrt(v / bc2) + eps) + wd p)
// with betas (0.9, 0.95), eps 1e-8 and decay 0.1 on every parameter alike (the reference
// model keeps it simple). Its losses are pinned by tests: it differs from the PyTorch form
// of spillway::optim in the last bits, so the two are kept apart. One thread.
class TextbookAdamW {
 public:
  explicit TextbookAdamW(double lr);
  // One step over the parameters (its counter advances first: the first step is 1).
  void operator()(const nn::DeviceParameters& p);
  // This optimizer as a step's update (it must outlive the steps it is given to).
  nn::ParameterUpdate update();
  int64_t steps() const { return step_; }

 private:
  double lr_;
  int64_t step_ = 0;
};

// Byte-level tokens of a text file; errors name the path.
std::vector<int32_t> load_corpus(const std::string& path);

// Runs `spillway train`. `progress` receives one line per step (may be empty).
TrainReport run(const TrainOptions& o, const std::function<void(const std::string&)>& progress);

// The human tables and the JSON (`policies[] {name, loss, peak_device_bytes, step_ms,
// offloaded_bytes, stall_ms, snowball, ...}`).
std::string format_train_report(const TrainReport& r, const TrainOptions& o);
std::string train_report_json(const TrainReport& r, const TrainOptions& o);

// `spillway stream` without --explain (Note [Streamed weights] in spillway/nn/nn.hpp,
// docs/stream.md): the reference model on gpus_per_link emulated GPUs behind one throttled
// host link, each GPU with the model all-resident and the same model with its weights
// streamed (same seed, same batches), interleaved step by step, their losses compared bit
// for bit. Inference: every GPU its own batch (replicas serving); training: the same batch
// on every GPU (the reference model has no gradient all-reduce, so data-parallel GPUs on
// different batches would drift apart; the link traffic is the same either way).
struct StreamedRunOptions {
  std::string ref_model = "small-moe";  // an embedded reference config or a config.json path
  bool training = false;  // training steps (forward, backward re-streamed, AdamW), else forward
  int steps = 5;          // of each model; the first is the warm-up (>= 2)
  int micro_batch = 2;
  int seq_len = 256;
  int prefetch_depth = 1;         // layers streamed ahead: a ring of prefetch_depth + 1 slots
  double link_gbps = 1.0;         // the emulated host->device link, shared by its GPUs
  double device_memory_mb = 512;  // each emulated GPU's memory (MiB)
  uint64_t seed = 1;              // the weights and the batches
  int gpus_per_link = 1;          // emulated GPUs (one thread each) behind the link
  std::string mode = "auto";      // auto (Note [Stream mode model] picks), full-copy, sharded
  // A run whose link copies alone would take longer is not started (refused, below).
  double max_link_seconds = 3600.0;
};

struct StreamedRunReport {
  // Refused before the first step: the link time alone, min_link_seconds, is more than
  // max_link_seconds. Then only the sizes and the link figures are set.
  bool refused = false;
  double min_link_bytes = 0;    // steps x link_copies x model_bytes
  double min_link_seconds = 0;  // min_link_bytes at link_gbps
  int link_copies = 1;          // each layer's copies over the link per pass: N for full-copy
  int layers = 0;
  int64_t model_bytes = 0;  // the layer weights (fp32): what one pass streams
  std::string mode;         // the mode run: the one asked for, or the one auto chose
  int64_t slot_bytes = 0;   // one slot of the ring on each GPU
  // Per step: the medians over the steps after the warm-up, of the slowest GPU's time.
  double resident_ms = 0;
  double streamed_ms = 0;
  int timed_steps = 0;
  WeightStreamTelemetry telemetry;  // GPU 0's streamer over the whole run
  bool bitwise_identical = true;    // every step's losses on every GPU
  // The prediction for the same setup (Note [Stream mode model]) and its input: the
  // measured per-layer compute (training), or the resident pass spread evenly over the
  // layers (inference: forward_loss does not time layers); the link; the peer copies at
  // this machine's memcpy rate (the emulated all-gather).
  StreamModeInput prediction_input;
  StreamModeChoice prediction;
  double predicted_ms = 0;  // the mode run's estimate (0 when the choice lacks it)
};

// Runs it. `progress` receives one line per step (may be empty). Bad options throw
// spillway::InputError naming the field; losses that differ are a report, not an error.
StreamedRunReport run_streamed_reference(const StreamedRunOptions& o,
                                         const std::function<void(const std::string&)>& progress);

}  // namespace spillway::train

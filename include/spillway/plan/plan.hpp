// The planner: for a model, a workload and a hardware profile, decide per layer which
// saved tensors to keep, offload to host memory or recompute, under the HBM budget and
// the no-snowball condition with margin, minimizing step time; and say what it costs.
//
// Policies per layer (docs/offload.md, docs/planner.md):
//   keep       every saved tensor stays in HBM;
//   recompute  block-type checkpointing: attention recomputed from its input; dense MLP
//              recomputed from its input; MoE recomputes only the expert GEMMs (router and
//              dispatch results kept);
//   offload    as recompute, but the MLP tensors (mlp.gate_out, mlp.up_out, mlp.act) are
//              offloaded and reloaded instead of recomputed;
//   selective  a knapsack over the whole layer's tensors: the subset to offload that fits
//              the forward window, the rest recomputed (block policy) or kept;
//   checkpoint full-layer checkpointing (torch.utils.checkpoint around each block): only
//              the layer input kept, everything else recomputed, a Mamba scan included;
//              the baseline the block-type policy is measured against (never chosen by auto);
//   hybrid     the GEMM/attention outputs are offloaded (as many as the window holds) and
//              the cheap element-wise tensors are recomputed from the reloaded ones.
// The last layer(s) never offload: backward starts there, so there is no window.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/inventory.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/policy.hpp"
#include "spillway/core/units.hpp"

namespace spillway {

// PlanRequest::strategy is what the planner is asked for: one Policy in every layer, or the
// best per layer (Policy::kAuto); LayerPlan::policy what it chose (never kAuto). One
// vocabulary with the engines (spillway/core/policy.hpp).

// The physical ranges of a request (make_plan refuses others, naming the field; the CLI
// states them in --help): bandwidths from 1 KB/s to 1 PB/s, an HBM budget from 1 MB to
// 1 EB, a layer time from 1 ps to 10^9 ms, a prefetch depth up to 64; a micro-batch up to
// 2^20 sequences of up to 2^26 tokens, parallel group sizes and gradient accumulation up
// to 2^20, keep_last_layers up to the model's layers. Products of sizes must not overflow.
struct PlanLimits {
  static constexpr int64_t kMaxMicroBatch = int64_t{1} << 20;
  static constexpr int64_t kMaxSeqLen = int64_t{1} << 26;
  static constexpr int64_t kMaxGroup = int64_t{1} << 20;      // tp, ep, cp, pp, dp, grad_accum
  static constexpr int64_t kMaxLossChunk = int64_t{1} << 30;  // tokens per loss chunk
  static constexpr double kMinGbps = 1e-6;
  static constexpr double kMaxGbps = 1e6;
  static constexpr double kMinBudgetGb = 1e-3;
  static constexpr double kMaxBudgetGb = 1e9;
  static constexpr double kMinLayerMs = 1e-9;
  static constexpr double kMaxLayerMs = 1e9;
  static constexpr int kMaxPrefetchDepth = 64;
};

// An efficiency the caller may fix. Given (assigned a number), it is a constant that
// replaces the hardware profile's curve for its kernel class; not given, the curve is
// used (Note [Efficiency curves], hardware.hpp) and the number is only the former
// default, shown where a single figure is printed. It reads as a double either way.
class EfficiencyFactor {
 public:
  // Implicit on purpose: `r.efficiency.gemm = 0.6` gives a constant, as before the curves.
  constexpr EfficiencyFactor(double value) : value_(value), given_(true) {}  // NOLINT
  static constexpr EfficiencyFactor unset(double shown) {
    EfficiencyFactor f(shown);
    f.given_ = false;
    return f;
  }
  constexpr operator double() const { return value_; }  // NOLINT
  constexpr double value() const { return value_; }
  constexpr bool given() const { return given_; }

 private:
  double value_;
  bool given_;
};

// A measured kernel from a timed run (a calibration profile's "ops", e.g. written by
// `spillway bench gemm`): its class, its shape (OpShape: m, n, k for a GEMM; experts,
// tokens_per_expert, n, k for a grouped GEMM; keys for attention) and either its
// efficiency or its time (ms, with flops for attention; a GEMM's flops are 2mnk per
// expert), turned into an efficiency against the hardware profile's peak for `dtype`.
// Points of one class replace that curve's points inside their range of abscissae.
enum class MeasuredKind { kGemm, kGroupedGemm, kAttention };
std::string to_string(MeasuredKind k);  // "gemm", "grouped_gemm", "attention"
MeasuredKind parse_measured_kind(const std::string& s);

struct MeasuredOp {
  MeasuredKind kind = MeasuredKind::kGemm;
  OpShape shape;
  DType dtype = DType::kBf16;
  double ms = 0.0;          // measured time of one call; 0 when efficiency is given
  double flops = 0.0;       // of one call; 0: 2mnk (x experts) for a GEMM
  double efficiency = 0.0;  // fraction of dense peak; 0: from ms and flops
};

// The curve abscissa of a shape (Note [Efficiency curves]): min(m, n, k) for a GEMM,
// min(tokens per expert, n, k) for a grouped GEMM, keys for attention.
double curve_abscissa(MeasuredKind kind, const OpShape& shape);

// Roofline efficiencies: the hardware profile's curves, unless a constant is given here
// (--gemm-efficiency, --attention-efficiency, --hbm-efficiency), with measured points
// (--profile "ops") merged into the curves first.
struct Efficiency {
  EfficiencyFactor gemm = EfficiencyFactor::unset(0.70);  // dense and grouped GEMMs
  EfficiencyFactor attention = EfficiencyFactor::unset(0.50);
  EfficiencyFactor hbm = EfficiencyFactor::unset(0.80);
  std::vector<MeasuredOp> measured;
};

// The curves a request runs with: the profile's, measured points merged (they replace the
// curve's points between the smallest and the largest measured abscissa; points at one
// abscissa are averaged). Throws naming efficiency.measured[i] on a point out of range.
EfficiencyCurves effective_curves(const HardwareProfile& hw, const Efficiency& eff);
// The fraction of HBM bandwidth memory-bound kernels reach: the given constant, else the
// profile's figure.
double hbm_efficiency(const HardwareProfile& hw, const Efficiency& eff);

struct Workload {
  ShardShape shape;
  int64_t pp = 1;
  int64_t dp = 1;
  int64_t grad_accum = 1;
};

struct LayerTiming {  // a measured layer (calibration profile)
  int index = 0;
  double fwd_ms = 0.0;
  double bwd_ms = 0.0;
};

// One saved tensor of a layer as measured where the model runs: its planner name (Note
// [Names of Hugging Face tensors], docs/python.md) and its bytes, all tensors of that name
// summed.
struct SavedTensorBytes {
  std::string name;
  int64_t bytes = 0;
};

struct PlanRequest {
  ModelConfig model;
  HardwareProfile hardware;
  Workload work;
  Policy strategy = Policy::kAuto;
  double margin = 0.10;                 // transfers must fit window / (1 + margin)
  std::optional<double> layer_fwd_ms;   // calibration: the repeating layer's forward
  std::vector<LayerTiming> profile;     // calibration: measured per-layer times
  std::optional<double> hbm_budget_gb;  // default: profile HBM minus the reserve
  std::optional<double> d2h_gbps;       // default: typical measured / gpus_per_link
  std::optional<double> h2d_gbps;
  Efficiency efficiency;
  int keep_last_layers = 1;  // layers at the end that never offload
  int prefetch_depth = 1;    // backward reloads issued this many layers ahead
  // Note [Training state] (src/plan/stage.cpp, docs/planner.md): what the data-parallel group
  // shards and what lives in host memory. ZeRO stage over dp: 0 nothing, 1 the optimizer
  // states (fp32 master weights and AdamW moments, 12 bytes per parameter), 2 also the
  // gradients, 3 (FSDP) also the weights, with gathered-layer buffers.
  int zero = 1;
  bool optimizer_offload = false;       // the 12 bytes per parameter in host memory, CPU AdamW
  bool grad_offload = false;            // gradient buckets stream to the host as they are final
  std::optional<double> cpu_adam_gbps;  // CPU AdamW state GB/s (default kDefaultCpuAdamGbps)
  int64_t loss_chunk = 0;  // tokens per loss chunk; 0: the planner's choice (Note [Loss chunks])
  // Note [Named offload tensors] (src/plan/offload_tensors.cpp): when not empty, exactly these
  // saved tensors (names of docs/plan-schema.md, or groups: attn, mlp, moe, ssm, lin, rec) are
  // offloaded in every layer that offloads; the rest follows `strategy` (keep: kept; recompute,
  // offload, auto: the block policy's recompute). Empty: the planner chooses the tensors.
  std::vector<std::string> offload_tensors;
  // Note [A model as PyTorch runs it] (src/plan/saved_as_run.cpp): when not empty, one entry
  // per layer of the model, the saved tensors as the framework that runs the model saves them
  // (measured: spillway.torch.measure_saved), which replace the inventory's sizes. Empty:
  // the inventory (fused kernels, docs/plan-schema.md).
  std::vector<std::vector<SavedTensorBytes>> saved_as_run;
};

// The saved tensors `names` stand for in the blocks of `model` under `shape` (Note [Named
// offload tensors]): each name is a tensor name or a group, expanded in the order of the
// blocks' tensors, without repeats. A name no block of the model saves, or a group with no
// member in them, throws spillway::InputError naming "offload_tensors", the name, and the
// names the model's blocks save.
std::vector<std::string> resolve_offload_tensors(const ModelConfig& model, const ShardShape& shape,
                                                 const std::vector<std::string>& names);
// The groups a name may be: "attn", "mlp", "moe", "ssm", "lin", "rec"; the members of group
// `g` are the saved tensors named "g.*" but the sub-block's input and norm output.
const std::vector<std::string>& offload_tensor_groups();
bool in_offload_group(std::string_view group, std::string_view tensor);

// FP8 delayed scaling (Transformer Engine's default recipe): per fp8 GEMM an amax history
// of this many steps for each of its three fp8 operands (input, weight, output gradient),
// fp32, and their three scales.
inline constexpr int64_t kFp8AmaxHistory = 1024;
inline constexpr int64_t kFp8ScalingStateBytesPerGemm = 3 * kFp8AmaxHistory * 4 + int64_t{3} * 4;

// The CPU AdamW's state traffic rate assumed when none is given (GB/s, 28 bytes per
// element): a conservative figure for a server CPU; `spillway bench adam` measures it.
inline constexpr double kDefaultCpuAdamGbps = 50.0;

// The fraction of HBM the default budget leaves for the CUDA context, allocator
// fragmentation and communication buffers.
inline constexpr double kHbmReserveFraction = 0.05;

struct TensorPlan {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;
  int64_t bytes = 0;
  Action action = Action::kKeep;
  double recompute_flops = 0.0;  // FLOPs of the op that produces it
  double recompute_ms = 0.0;     // time of the op that produces it
  double produced_at_ms = 0.0;   // offset in the layer's forward when it exists
  int producer = -1;             // index into LayerPlan::ops; -1 = the layer input
};

struct OpPlan {  // one forward op of a layer and its backward
  std::string name;
  OpKind kind = OpKind::kMemory;
  double fwd_flops = 0.0;
  int64_t fwd_bytes = 0;  // HBM traffic
  double bwd_flops = 0.0;
  int64_t bwd_bytes = 0;
  double fwd_ms = 0.0;
  double bwd_ms = 0.0;
  // The tensors it reads and writes, by name (saved ones and the transient intermediates
  // between ops): the graph a plan's recompute closure is re-derived from (Note [Plans
  // re-timed from their actions], src/plan/plan_json.cpp).
  std::vector<std::string> inputs;
  std::vector<std::string> outputs;
};

// A collective a layer issues (docs/collectives.md): its ring time from the message size S
// per GPU, the group size n and the bandwidth B of the slowest link it crosses:
// all-reduce 2(n-1)/n x S / B; all-gather, reduce-scatter and all-to-all (n-1)/n x S / B.
// `link` names what it crosses: "nvlink" (the GPUs' own scale-up fabric), "network"
// (InfiniBand/Ethernet between nodes) or "host" (through the host link, e.g. PCIe GPUs
// without NVLink: it shares the root complex with the offload copies).
enum class CollectiveKind { kAllReduce, kAllGather, kReduceScatter, kAllToAll };
std::string to_string(CollectiveKind k);  // "all-reduce", "all-gather", ...
CollectiveKind parse_collective_kind(const std::string& s);

struct CollectivePlan {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  std::string what;       // "dp.grad_reduce", "zero.weight_gather", "ep.dispatch", "ep.combine"
  bool backward = false;  // issued in the layer's backward (else its forward)
  int64_t bytes = 0;      // message size S per GPU
  int64_t group = 1;      // GPUs in the group (n)
  std::string link;       // "nvlink", "network", "host"
  double gbps = 0.0;      // B: per-GPU bandwidth of the link crossed
  double ms = 0.0;        // ring time
  bool exposed = false;   // on the critical path (all-to-all); else overlapped with compute
};

struct LayerPlan {
  int index = 0;
  std::string block;
  Policy policy = Policy::kKeep;
  std::vector<TensorPlan> tensors;
  std::vector<OpPlan> ops;
  double fwd_flops = 0.0;
  double bwd_flops = 0.0;
  int64_t fwd_bytes = 0;  // HBM traffic of the forward
  int64_t bwd_bytes = 0;
  int64_t params = 0;  // parameters of the layer on this GPU
  int64_t offload_bytes = 0;
  int64_t kept_bytes = 0;
  int64_t rematerialized_bytes = 0;  // offloaded + recomputed: live again in its backward
  double fwd_ms = 0.0;
  double bwd_ms = 0.0;
  double recompute_ms = 0.0;
  double recompute_avoided_ms = 0.0;  // against the block-type recompute policy
  double d2h_ms = 0.0;        // offload_bytes / D2H bandwidth, + what host-link rings take of it
  double window_ms = 0.0;     // from its first offloaded tensor to the end of the next forward
  double late_ms = 0.0;       // how late its last copy ends (with margin and backlog)
  double margin = 0.0;        // window / d2h - 1 (0 when nothing is offloaded)
  double h2d_ms = 0.0;        // offload_bytes / H2D bandwidth, + what host-link rings take of it
  double stall_ms = 0.0;      // backward waiting on this layer's reload
  int64_t backlog_bytes = 0;  // D2H bytes not yet copied when this layer's forward ends
  // Note [FP8 recompute] (src/plan/timeline.cpp): with --dtype fp8, the scaling state the forward's
  // fp8 GEMMs used, kept so that their recompute in backward reuses it exactly.
  int fp8_recomputed_gemms = 0;
  int64_t fp8_scaling_state_bytes = 0;
  bool snowball = false;                    // the copy misses its window (with margin)
  std::vector<CollectivePlan> collectives;  // in issue order
};

// HBM by category at the peak. `logits` is non-zero when the peak is while the LM head
// and the loss run (a loss chunk's fp32 logits and their gradient), `activations` holds
// the saved tensors (and, when the peak is in a layer's backward, its re-materialized
// set); `buffers` the sharding and offload buffers (ZeRO-3 gathered layers, gradient
// buckets being reduced or copied to the host).
struct MemoryBreakdown {
  int64_t weights = 0;
  int64_t gradients = 0;
  int64_t optimizer_states = 0;
  int64_t activations = 0;
  int64_t logits = 0;
  int64_t buffers = 0;
  int64_t in_flight_copies = 0;
  int64_t total() const {
    return weights + gradients + optimizer_states + activations + logits + buffers +
           in_flight_copies;
  }
};

// The training state's placement and the optimizer's cost in the step (Note [Training
// state]).
struct TrainingStatePlan {
  int zero = 1;
  bool optimizer_offload = false;
  bool grad_offload = false;
  int64_t state_params = 0;         // parameters whose optimizer state this GPU holds
  int64_t host_state_bytes = 0;     // in host memory: master weights, moments, gradients
  double cpu_adam_gbps = 0.0;       // used (offload only)
  bool cpu_adam_assumed = false;    // the default, not given
  int device_buckets = 0;           // offload: layers stepped on the GPU (the split)
  bool cast_on_host = true;         // offload: bf16 over the link, cast on the CPU (else fp32)
  double optimizer_ms = 0.0;        // on the critical path: the device step, or the CPU tail
  double optimizer_total_ms = 0.0;  // its whole work (device step, or the CPU pipeline)
  int64_t loss_chunk_tokens = 0;    // tokens per loss chunk (= tokens per GPU: unchunked)
  double loss_recompute_ms = 0.0;   // the logits recomputed in backward, per micro-batch
};

// Note [Per-block policy] (src/plan/summary.cpp): what the block-type policy of docs/planner.md
// does to one kind of block, against full-layer checkpointing, per layer.
struct BlockSummary {
  std::string block;                  // LayerSpec::block_name
  int layers = 0;                     // of the stage
  std::string chosen;                 // the plan's policies for them, "recompute x3"
  std::vector<std::string> kept;      // what the block policy keeps besides the layer input
  int64_t block_kept_bytes = 0;       // saved bytes the block policy keeps
  double block_recompute_ms = 0.0;    // what it reruns in backward
  int64_t checkpoint_kept_bytes = 0;  // full-layer checkpointing: the layer input
  double checkpoint_recompute_ms = 0.0;
  // The offload candidates: the saved tensors the block policy recomputes, which an
  // offload moves to the host instead, largest first, with their bytes per layer.
  std::vector<std::pair<std::string, int64_t>> candidates;
};

struct PlanSummary {
  bool feasible = true;
  std::vector<std::string> reasons;  // why not, in words and numbers
  MemoryBreakdown peak;
  int64_t hbm_budget_bytes = 0;
  int64_t host_pinned_bytes = 0;
  double step_ms = 0.0;
  double recompute_step_ms = 0.0;
  double keep_step_ms = 0.0;
  double speedup_vs_recompute = 1.0;
  double stall_ms = 0.0;
  double d2h_gbps = 0.0;  // the per-GPU figures used
  double h2d_gbps = 0.0;
  double time_scale = 1.0;   // calibration factor applied to modelled times
  double head_ms = 0.0;      // LM head and loss, forward + backward, per micro-batch
  int64_t logits_bytes = 0;  // logits and their gradient (fp32) while the head runs
  int gpus_per_link = 1;     // from the hardware profile (the simulator's default topology)
  std::string calibration;   // "roofline", "layer-fwd-ms", "profile"
  TrainingStatePlan state;
  // Note [Collectives in the plan] (src/plan/plan_collectives.cpp): the collectives' time on the
  // critical path per step (exposed ones, and what the overlapped ones do not hide), and all of it.
  double collective_ms = 0.0;
  double collective_total_ms = 0.0;
  std::vector<BlockSummary> blocks;  // one per block kind, in order of first appearance
};

struct Plan {
  Policy strategy = Policy::kAuto;
  // The tensors --offload-tensors named, resolved (Note [Named offload tensors]); empty when
  // the planner chose them.
  std::vector<std::string> offload_tensors;
  // What reading the plan back found (Note [Plans re-timed from their actions]): a file
  // whose stored times disagree with its actions, re-timed; empty for a plan as written.
  std::vector<std::string> notes;
  std::vector<LayerPlan> layers;  // this pipeline stage's layers (the first stage)
  PlanSummary summary;
  int64_t params_total = 0;
  int64_t params_per_gpu = 0;
  int64_t tokens_per_gpu = 0;
};

// Validates the request (positive sizes, divisibility) and plans. Bad input throws
// spillway::InputError naming the field ("micro_batch is 0; must be >= 1"); an infeasible
// strategy is a value (summary.feasible == false).
Plan make_plan(const PlanRequest& request);

// Note [Plans re-timed from their actions] (src/plan/plan_json.cpp): the plan `given` (read
// from a file, perhaps edited) judged for `request` as make_plan judges a choice: each layer
// of the first stage runs the actions `given` has for its saved tensors (by name; a tensor
// it does not list is kept), under the policy label it has; times, peak, step and verdict
// are derived from those actions. `given` must be of the request's model and workload
// (check_plan_matches).
Plan retime_plan(const PlanRequest& request, const Plan& given);

// Reads a calibration profile (schema spillway.profile/1: {"layers": [{"index", "fwd_ms",
// "bwd_ms"}], "ops": [...]}); "layers" may be absent when "ops" is given.
std::vector<LayerTiming> load_profile(const std::string& path);
// The profile's measured kernels: "ops": [{"kind", "m", "n", "k", "experts",
// "tokens_per_expert", "keys", "dtype", "ms", "flops", "efficiency"}] (MeasuredOp; the
// fields a kind does not use may be left out). Empty when the profile has none.
std::vector<MeasuredOp> load_profile_ops(const std::string& path);

// The plan as JSON, schema spillway.plan/1 (docs/plan-schema.md).
std::string plan_to_json(const Plan& plan, const PlanRequest& request);
// Reads a plan written by plan_to_json back, with the request fields the engines and the
// simulator need (model and hardware names, HBM bandwidth, workload, prefetch depth).
// Every field is validated; a plan of another schema version is refused.
// Beyond the fields, the plan must hold together: its layers are the first pipeline stage
// in order (0, 1, ..., none dropped or repeated; as many as model.layers / pp), each
// tensor name is one of docs/plan-schema.md and fits the layer's block, no name repeats in
// a layer, and a tensor's bytes are its shape times its dtype's size. An error names the
// field and its value.
Plan load_plan_json(const std::string& path, PlanRequest* request);
// The same from JSON text; `path` names it in messages.
Plan parse_plan_json(std::string_view text, const std::string& path, PlanRequest* request);
// Checks a plan read by load_plan_json (with its request `planned`) against the model and
// workload it is used with (`used_with`: model, work). Compared, in order: the model (the
// first stage's layer count, hidden size); the workload (micro_batch, seq_len, dtype, tp,
// ep, cp, pp, dp, fused_swiglu); per layer, its index, and its tensors against the
// model's inventory for that workload (the same names; each one's bytes, shape and
// dtype). Throws spillway::Error naming what differs and both values, e.g.
//   plan.json: made for micro_batch 2; used with micro_batch 4
//   plan.json: layer 3 tensor "mlp.act" is 1048576 bytes ([2048, 256] bf16); the model's is
//   2097152 bytes ([2048, 512] bf16)
// `plan_name` starts every message (the file name).
void check_plan_matches(const Plan& plan, const PlanRequest& planned, const PlanRequest& used_with,
                        std::string_view plan_name);
// The human report: a table per layer and the summary.
std::string format_plan_report(const Plan& plan, const PlanRequest& request);
// Note [Fused-kernel inventory] (docs/planner.md): what the activation inventory assumes
// the model's kernels save, and how much more an eager Hugging Face model saves, for the
// kinds of layers `model` has; the report's `inventory` line and the JSON's
// `workload.inventory_assumes`.
std::string inventory_assumption(const ModelConfig& model);
// Every term of one layer's time and memory with the formula it comes from (`spillway plan
// --explain LAYER`): per op the roofline's compute and memory terms, efficiency and time;
// recompute, the copies against their window, the stall, each collective's ring formula;
// each saved tensor and its action, the kept and re-materialized bytes, the layer's
// training state. `layer` indexes the plan's layers (InputError naming "explain" otherwise).
std::string format_plan_explain(const Plan& plan, const PlanRequest& request, int layer);

// The GPU/CPU split (docs/optim.md): how many of the buckets that arrive last keep their
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

// The GPU/CPU split of optimizer offload, planned (docs/optim.md): one
// gradient bucket per layer (this GPU's ZeRO shard of it at stage >= 1), arriving as
// backward passes it (last layer first, after its stall and recompute); on the CPU a bucket
// costs its gradient copy down, its AdamW step at the measured CPU rate (`spillway bench
// adam`) and its weight copy up, bf16 with the casts on the CPU or fp32 with the casts on
// the GPU, whichever is sooner; on the device its AdamW step at HBM speed after backward;
// its fp32 state (12 bytes per parameter) needs free HBM. The split is
// choose_device_buckets over those timings. The planner's --optimizer offload uses it
// (Note [Training state]); `spillway plan --cpu-adam-gbps` reports it for a GPU optimizer.
// `cpu_adam_gbps` > 0 (the figure of `spillway bench adam`); throws spillway::Error
// naming it otherwise.
struct OptimizerSplit {
  int layers = 0;            // buckets (one per layer of this stage)
  int layers_on_device = 0;  // the last to arrive (the first layers), stepped on the GPU
  double backward_ms = 0.0;  // of one micro-batch, from the plan
  double end_ms = 0.0;       // the optimizer step's end with that split, from backward's start
  double cpu_only_ms = 0.0;  // with every layer on the CPU
  int64_t device_state_bytes = 0;
  int64_t free_hbm_bytes = 0;  // budget - peak + the optimizer states offload removes
  double cpu_adam_gbps = 0.0;  // state traffic rate of the CPU AdamW (28 bytes per element)
  double cpu_total_ms = 0.0;   // every bucket's CPU pipeline, summed
  bool cast_on_host = true;    // bf16 over the link, casts on the CPU (else fp32, on the GPU)
};

// `cpu_adam_gbps` > 0 (the figure of `spillway bench adam`); throws spillway::Error
// naming it otherwise.
OptimizerSplit plan_optimizer_split(const Plan& plan, const PlanRequest& request,
                                    double cpu_adam_gbps);

// The plan's memory policy: per layer, its tensors in the plan's order and their actions
// (the one converter from a plan to what the engines and models read), named `name`.
MemoryPolicy memory_policy(const Plan& plan, const std::string& name, int prefetch_depth = 1);

}  // namespace spillway

// What the planner's files share (make_plan in planner.cpp reads them top to bottom):
// the first pipeline stage (stage.cpp, with its collectives from plan_collectives.cpp),
// the options of each layer (options.cpp), the timeline that judges a choice of them
// (timeline.cpp), the choice under the HBM budget (search.cpp) and the plan's summary
// (summary.cpp). Pure arithmetic over the cost model (cost_model.hpp): no engine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/cost_model.hpp"
#include "spillway/plan/collectives.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway::planner {

// One way to run a layer: an action per tensor and what it costs.
struct Option {
  Policy policy = Policy::kKeep;
  std::vector<Action> actions;
  ActionCost cost;
};

struct Stage {
  std::vector<CostedLayer> layers;
  double d2h_bytes_per_ms = 0.0;  // real per-GPU bandwidth
  double h2d_bytes_per_ms = 0.0;
  double margin = 0.1;
  int64_t mb_inflight = 1;
  int64_t static_bytes = 0;  // weights + gradients + optimizer states + buffers
  MemoryBreakdown static_mem;
  int64_t host_static = 0;  // optimizer state and gradients in host memory
  int64_t logits_bytes = 0;
  double head_ms = 0.0;  // LM head + loss, forward and backward
  int64_t budget = 0;
  int keep_last = 1;
  int prefetch = 1;
  bool fp8 = false;  // Note [FP8 recompute]
  // Note [Named offload tensors]: the saved tensors an offloading layer offloads, resolved;
  // empty: the options choose them.
  std::vector<std::string> offload_named;
  std::vector<int64_t> layer_params;  // per GPU
  std::vector<std::vector<CollectivePlan>>
      collectives;                  // per layer (Note [Collectives in the plan])
  std::vector<double> comm_fwd_ms;  // exposed collectives in a layer's forward
  std::vector<double> comm_bwd_ms;  // and before its backward
  // Host-link collectives running beside the copies (Note [The host link is shared]): ms of
  // ring issued as layer l's forward starts, and as its backward starts.
  std::vector<double> host_comm_fwd_ms;
  std::vector<double> host_comm_bwd_ms;
  // Note [Forward paced by the gathers] (timeline.cpp): per layer, the overlapped forward
  // weight gathers it waits for (ms; whether on the host link) and its exposed forward
  // collectives (the op they follow, ms), on the one communication stream.
  std::vector<double> gather_fwd_ms;
  std::vector<char> gather_fwd_host;
  std::vector<std::vector<std::pair<int, double>>> exposed_fwd;
};

struct OptionSet {
  Option keep, recompute, offload, hybrid, selective_recompute, selective_keep, checkpoint;
  // With named offload tensors (Note [Named offload tensors]): `offload` offloads them with
  // the rest recomputed, `offload_keep` with the rest kept.
  Option offload_keep;
  bool can_offload = false;
};

// The options of every layer: identical layers share one set (see build_layer_options).
struct LayerOptions {
  std::vector<OptionSet> unique;
  std::vector<size_t> set_of;        // per layer: its set in `unique`
  std::vector<double> recompute_ms;  // per layer: recompute time of the block policy
  const OptionSet& at(size_t l) const { return unique[set_of[l]]; }
};

// Per layer, the options the strategy may choose from; the searches strike options that
// fail, so each layer's list only shrinks.
using Allowed = std::vector<std::vector<const Option*>>;

struct Timeline {
  std::vector<LayerPlan> layers;
  double fwd_ms = 0.0;
  double step_ms = 0.0;  // one micro-batch
  double stall_ms = 0.0;
  int64_t max_backlog = 0;
  MemoryBreakdown peak;
  int64_t host_pinned = 0;
  std::vector<size_t> snowball_layers;
};

// One option per layer and the timeline that judges it.
struct Choice {
  std::vector<const Option*> options;
  Timeline timeline;
};

// Timelines of the chosen options (with the per-tensor detail) and of the two references.
struct Timelines {
  Timeline chosen;
  Timeline recompute;  // every layer block-recomputed
  Timeline keep;       // every layer keeps everything
};

// ---- the request and the stage (validate.cpp, stage.cpp) -------------------------------

// Throws spillway::InputError, naming the field, on a request no plan can be made for
// (sizes, divisibility, ranges).
void validate(const PlanRequest& r);

// The first pipeline stage: its layers costed once per distinct spec and calibrated, the
// per-GPU link rates, static memory, the LM head and the budget (also set in plan.summary).
Stage build_stage(const PlanRequest& r, Plan& plan);

// ---- collectives (plan_collectives.cpp: Note [Collectives in the plan]) ----------------

// The collectives layer `spec` (`params` parameters per GPU, T tokens) carries.
std::vector<CollectivePlan> layer_collectives(const PlanRequest& r, const LayerSpec& spec,
                                              int64_t params, int64_t T);

// Weaves a layer's exposed collectives into its timing (Note [Collectives in the plan]):
// the forward ones delay every tensor produced after them and lengthen the forward.
void weave_exposed(const std::vector<CollectivePlan>& cs, CostedLayer& c, double& fwd_extra,
                   double& bwd_extra);

// How long a transfer of `own_ms` alone takes beside one of `other_ms` started with it on
// a fairly shared link (Note [The host link is shared]).
double shared_link_ms(double own_ms, double other_ms);

// Fills st.host_comm_fwd_ms and st.host_comm_bwd_ms from st.collectives (Note [The host
// link is shared]).
void host_link_collectives(const PlanRequest& r, Stage& st);

// What the overlapped collectives add to a step of grad_accum micro-batches of timeline
// `tl` (Note [Collectives in the plan]): the first micro-batch gathers the updated weights
// (ZeRO-1/2), the last reduces the gradients, the others only gather (ZeRO-3). The exposed
// ones are in the timeline's micro-batch already.
double overlapped_step_delay(const Stage& st, const std::vector<LayerPlan>& layers,
                             int64_t grad_accum);

// The collectives on the critical path (`overlapped`, from overlapped_step_delay, plus
// the exposed ones) and in all, into the summary (Note [Collectives in the plan]).
void plan_collective_time(const PlanRequest& r, double overlapped, Plan& plan);

// ---- the options of each layer (options.cpp) -------------------------------------------

// The option set of each layer, built once per distinct layer.
LayerOptions build_layer_options(const Stage& st, Policy strategy);

// The options each layer may take under the strategy (auto: keep, recompute, and those
// offloading options that fit the layer's window alone).
Allowed allowed_options(const LayerOptions& lo, const Stage& st, Policy strategy);

// Recompute plus the reload stall layer l would see under option `o`.
double option_time(const Option& o, const Stage& st, size_t l);

// The fastest of layer l's allowed options (ties: the one keeping fewer bytes).
const Option* fastest_option(const std::vector<const Option*>& allowed, const Stage& st, size_t l);

// ---- the timeline of a choice (timeline.cpp) -------------------------------------------

// The forward copies, the backward reloads and the memory of one micro-batch under
// `choice` (Note [Forward window], Note [Peak memory]). `detail` fills the per-tensor
// report; the budget search only needs the totals.
Timeline run_timeline(const Stage& st, const std::vector<const Option*>& choice,
                      const std::vector<double>& recompute_policy_ms, bool detail);

// The timelines a plan reports, for the chosen options and the two references.
Timelines final_timelines(const Stage& st, const LayerOptions& lo,
                          const std::vector<const Option*>& choice);

// ---- the choice under the budget (search.cpp) ------------------------------------------

// The greedy choice: the fastest allowed option of each layer, then the best time-per-byte
// trade at a time until the plan fits the budget; auto then strikes the offloads that
// snowball with their neighbours' copies and tries again.
Choice choose_greedy(const Stage& st, const LayerOptions& lo, Allowed& allowed, Policy strategy);

// The final choice: the greedy one, unless the budget binds; then the fastest fitting
// result of Note [Budget search] from several starts.
Choice choose_under_budget(const Stage& st, const LayerOptions& lo, Allowed& allowed,
                           Policy strategy, double host_limit, Choice greedy);

// ---- the summary and its reasons (summary.cpp) -----------------------------------------

// The plan's layers (moved out of tl.chosen) and its step times (grad_accum micro-batches),
// stall, peak and pinned host memory.
void fill_summary(Timelines& tl, int64_t grad_accum, Plan& plan);

// The offloaded optimizer's time (Note [Training state]): fills plan.summary.state and
// adds the device buckets' state to the peak.
void plan_offloaded_optimizer(const PlanRequest& r, Plan& plan);

// Note [Per-block policy]: the numbers behind the per-block choice, into the summary.
void summarize_blocks(const Stage& st, const PlanRequest& r, Plan& plan);

// Why the plan is infeasible, in words and numbers (empty when it is feasible): the layers
// that miss their window, the snowball, the peak over budget, the host memory.
std::vector<std::string> infeasibility_reasons(const Plan& plan, const Timelines& tl,
                                               const Stage& st, const PlanRequest& r);

}  // namespace spillway::planner

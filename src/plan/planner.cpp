// The planner: options per layer, a global choice under the HBM budget, and a timeline
// that judges the choice (snowball, stalls, peak memory, step time). make_plan runs the
// steps in order; planner.hpp says which file holds each.
#include "plan/planner.hpp"

#include <algorithm>

#include "spillway/plan/plan.hpp"

namespace spillway {

namespace {

// What every plan gets once its layers' options are chosen: the summary, the offloaded
// optimizer, the collectives' time and the step, the per-block numbers and the verdict.
void finish_plan(const PlanRequest& r, const planner::Stage& st, planner::Timelines& timelines,
                 double unhidden, double rec_unhidden, double keep_unhidden, Plan& plan) {
  using namespace planner;
  fill_summary(timelines, r.work.grad_accum, plan);
  if (r.optimizer_offload) plan_offloaded_optimizer(r, plan);
  plan_collective_time(r, unhidden, plan);
  {
    PlanSummary& s = plan.summary;
    s.step_ms += s.state.optimizer_ms + unhidden;
    s.recompute_step_ms += s.state.optimizer_ms + rec_unhidden;
    s.keep_step_ms += s.state.optimizer_ms + keep_unhidden;
    s.speedup_vs_recompute = s.recompute_step_ms / s.step_ms;
  }
  summarize_blocks(st, r, plan);
  plan.summary.reasons = infeasibility_reasons(plan, timelines, st, r);
  plan.summary.feasible = plan.summary.reasons.empty();
}

}  // namespace

Plan make_plan(const PlanRequest& r) {
  using namespace planner;
  validate(r);
  Plan plan;
  plan.strategy = r.strategy;
  const Stage st = build_stage(r, plan);
  const LayerOptions options = build_layer_options(st, r.strategy);
  Allowed allowed = allowed_options(options, st, r.strategy);
  Choice greedy = choose_greedy(st, options, allowed, r.strategy);
  const double host_limit = r.hardware.host_memory_gb / r.hardware.gpus_per_host_memory * 1e9;
  const Choice chosen =
      choose_under_budget(st, options, allowed, r.strategy, host_limit, std::move(greedy));
  Timelines timelines = final_timelines(st, options, chosen.options);
  const int64_t ga = r.work.grad_accum;
  double unhidden = overlapped_step_delay(st, timelines.chosen.layers, ga);
  const double rec_unhidden = overlapped_step_delay(st, timelines.recompute.layers, ga);
  const double keep_unhidden = overlapped_step_delay(st, timelines.keep.layers, ga);
  // Note [Auto is never slower than recompute]: the search scores a choice by its
  // timeline; the overlapped collectives, slowed by the copies beside them on a host link
  // (Note [The host link is shared]), come after. When they make the choice slower than
  // recomputing every layer, auto takes the all-recompute plan (if it fits where the
  // choice fits).
  if (r.strategy == Policy::kAuto &&
      timelines.recompute.peak.total() <= std::max(st.budget, timelines.chosen.peak.total()) &&
      timelines.recompute.step_ms * static_cast<double>(ga) + rec_unhidden <
          timelines.chosen.step_ms * static_cast<double>(ga) + unhidden) {
    std::vector<const Option*> all_rec(st.layers.size());
    for (size_t l = 0; l < all_rec.size(); ++l) all_rec[l] = &options.at(l).recompute;
    timelines = final_timelines(st, options, all_rec);
    unhidden = rec_unhidden;
  }
  finish_plan(r, st, timelines, unhidden, rec_unhidden, keep_unhidden, plan);
  return plan;
}

Plan retime_plan(const PlanRequest& r, const Plan& given) {
  using namespace planner;
  validate(r);
  Plan plan;
  plan.strategy = r.strategy;
  const Stage st = build_stage(r, plan);
  plan.offload_tensors = given.offload_tensors;
  // The references (keep, block recompute) as make_plan has them; the choice is the file's.
  const LayerOptions options = build_layer_options(st, Policy::kKeep);
  const size_t n = st.layers.size();
  std::vector<Option> own(n);
  std::vector<const Option*> choice(n);
  for (size_t l = 0; l < n; ++l) {
    const CostedLayer& c = st.layers[l];
    Option& o = own[l];
    o.actions.assign(c.inv.tensors.size(), Action::kKeep);
    if (l < given.layers.size()) {
      o.policy = given.layers[l].policy;
      for (const TensorPlan& t : given.layers[l].tensors) {
        const int i = c.inv.find(t.name);
        if (i >= 0 && c.inv.tensors[static_cast<size_t>(i)].saved)
          o.actions[static_cast<size_t>(i)] = t.action;
      }
    }
    o.cost = evaluate_actions(c, o.actions);
    choice[l] = &o;
  }
  Timelines timelines = final_timelines(st, options, choice);
  const int64_t ga = r.work.grad_accum;
  finish_plan(r, st, timelines, overlapped_step_delay(st, timelines.chosen.layers, ga),
              overlapped_step_delay(st, timelines.recompute.layers, ga),
              overlapped_step_delay(st, timelines.keep.layers, ga), plan);
  return plan;
}

}  // namespace spillway

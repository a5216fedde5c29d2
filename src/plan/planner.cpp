// The planner: options per layer, a global choice under the HBM budget, and a timeline
// that judges the choice (snowball, stalls, peak memory, step time). make_plan runs the
// steps in order; planner.hpp says which file holds each.
#include "plan/planner.hpp"

#include <algorithm>

#include "spillway/plan.hpp"

namespace spillway {

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
  fill_summary(timelines, ga, plan);
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
  return plan;
}

}  // namespace spillway

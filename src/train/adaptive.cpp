// Note [Re-planning while training]: `--policy adaptive` starts from auto's plan (calibrated
// by the measured layer times, for the link the run starts on, within the HBM auto's plan
// was measured to fit) and checks, after every step, the link (a 1 MiB probe copy between
// steps: the step's own copies run at the pace their tensors are made, not the link's) and
// the engine's telemetry: whether a layer's copies were still running when the next
// layer's forward ended (its backlog at the boundary: a snowball). When the link is off by
// more than a quarter from what the plan assumed, or a layer was late (then with a margin
// half as large again, as often as it stays late), the plan is made again for the measured
// link and the step's measured layer times, within the first plan's planned peak HBM; if its
// actions differ, the next step runs it (offload demoted to recompute where the window no
// longer holds, promoted back when it does). Never inside a step: the engine is made again
// between steps for the new policy. Where tensors live never changes the arithmetic, so
// losses and gradients are bitwise those of any fixed policy.
//
// Note [Re-plans within the measured budget]: the planner's peak leaves out the offload
// engine's reload staging (the device pool holds prefetch_depth + 1 layers of offloaded
// bytes: Note [Train offload sizing]), which auto's first plan was measured with (Note
// [Auto fits the arena]). A re-plan with the same planned peak that offloads more of one
// layer (a faster link, a smaller margin) holds more staging and can run out of the arena
// the first plan fit. So a re-plan's peak plus its staging stays within the first plan's:
// when it does not, the plan is made again with the budget lowered by the excess (three
// times at most), then for the largest budget between the one that fits and the one that
// did not (four halvings); when none fits the plan is not taken (the plan in use stays, and
// the next step tries again). (The staging belongs in the planner's peak itself; until it
// is there, this rule is adaptive's alone, and auto measures instead.)
#include "train/adaptive.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

#include "spillway/core/error.hpp"

namespace spillway::train {

namespace {

// Per layer: how many of its tensors it offloads, as the change is told.
std::vector<int> offloaded_per_layer(const MemoryPolicy& p) {
  std::vector<int> n;
  for (const LayerActions& l : p.layers)
    n.push_back(static_cast<int>(std::count(l.actions.begin(), l.actions.end(), Action::kOffload)));
  return n;
}

bool same_actions(const MemoryPolicy& a, const MemoryPolicy& b) {
  if (a.layers.size() != b.layers.size()) return false;
  for (size_t l = 0; l < a.layers.size(); ++l) {
    if (a.layers[l].tensors != b.layers[l].tensors || a.layers[l].actions != b.layers[l].actions)
      return false;
  }
  return true;
}

}  // namespace

int64_t AdaptivePlanner::staging_bytes(const Plan& plan, int prefetch_depth) {
  int64_t layer_max = 0;
  for (const LayerPlan& l : plan.layers) layer_max = std::max(layer_max, l.offload_bytes);
  return static_cast<int64_t>(prefetch_depth + 1) * layer_max;
}

AdaptivePlanner::AdaptivePlanner(const nn::RefConfig& config, PlanRequest request,
                                 MemoryPolicy first, const Plan& first_plan, int prefetch_depth)
    : config_(config),
      request_(std::move(request)),
      current_(std::move(first)),
      planned_gbps_(request_.d2h_gbps.value_or(request_.hardware.d2h_typical.value)),
      margin_(request_.margin),
      prefetch_depth_(prefetch_depth),
      budget_bytes_(first_plan.summary.peak.total() + staging_bytes(first_plan, prefetch_depth)),
      plan_(first_plan) {}

std::optional<MemoryPolicy> AdaptivePlanner::after_step(int step, const nn::StepStats& stats,
                                                        const StepTelemetry& telemetry,
                                                        Device& device) {
  // The link's capacity: a probe copy (the step's own copies start as their tensors are
  // made, so their rate is the production's when the link keeps up, not the link's).
  return after_step(step, stats, telemetry, measure_d2h_gbps(device, kProbeBytes));
}

std::optional<MemoryPolicy> AdaptivePlanner::after_step(int step, const nn::StepStats& stats,
                                                        const StepTelemetry& telemetry,
                                                        double measured) {
  if (!(measured > 0)) return std::nullopt;
  const bool late = telemetry.snowball;
  const double drift = std::abs(measured - planned_gbps_) / planned_gbps_;
  // The layers drift too (clocks, another job on the device, a longer sequence).
  double mean_fwd = 0.0;
  for (double v : stats.layer_fwd_ms) mean_fwd += v;
  if (!stats.layer_fwd_ms.empty()) mean_fwd /= static_cast<double>(stats.layer_fwd_ms.size());
  const double planned_fwd = request_.layer_fwd_ms.value_or(0.0);
  const double layers =
      planned_fwd > 0 && mean_fwd > 0 ? std::abs(mean_fwd - planned_fwd) / planned_fwd : 0.0;
  if (!late && drift <= kLinkDrift && layers <= kLinkDrift) return std::nullopt;
  // A layer late on a link the plan has right: the windows are shorter than planned, so
  // the margin grows (x1.5 a time) until the plan moves less; a drifted link (or no
  // lateness) starts again from the margin asked for.
  request_.margin = late && drift <= kLinkDrift
                        ? std::min(10.0, std::max(margin_, request_.margin) * 1.5)
                        : margin_;
  const double link = std::clamp(measured, PlanLimits::kMinGbps * 10, PlanLimits::kMaxGbps / 10);
  request_.d2h_gbps = link;
  request_.h2d_gbps = link;
  if (mean_fwd >= PlanLimits::kMinLayerMs && mean_fwd <= PlanLimits::kMaxLayerMs)
    request_.layer_fwd_ms = mean_fwd;
  // Note [Re-plans within the measured budget].
  const double budget_gb = request_.hbm_budget_gb.value_or(request_.hardware.hbm_gb);
  // The plan for a budget (in GB), and by how much its peak and staging exceed the first
  // plan's (<= 0: it fits).
  auto plan_for = [&](double gb) {
    request_.hbm_budget_gb = gb;
    Plan p = make_plan(request_);
    const int64_t over = p.summary.peak.total() + staging_bytes(p, prefetch_depth_) - budget_bytes_;
    return std::make_pair(std::move(p), over);
  };
  auto [plan, over] = plan_for(budget_gb);
  if (over > 0) {
    // A budget that fits: lowered by the excess (the staging shrinks with it), three times
    // at most; then the largest that fits between it and the one that did not, halving the
    // interval four times.
    double fits = budget_gb, fails = budget_gb;
    for (int attempt = 0; attempt < 3 && over > 0; ++attempt) {
      fails = fits;
      fits -= static_cast<double>(over) / 1e9;
      std::tie(plan, over) = plan_for(fits);
    }
    if (over > 0) {  // none fits: the plan in use stays (the next step tries again)
      request_.hbm_budget_gb = budget_gb;
      return std::nullopt;
    }
    for (int i = 0; i < 4; ++i) {
      const double mid = (fits + fails) / 2;
      auto [p, o] = plan_for(mid);
      if (o <= 0) {
        fits = mid;
        plan = std::move(p);
      } else {
        fails = mid;
      }
    }
  }
  request_.hbm_budget_gb = budget_gb;
  const double assumed = planned_gbps_;
  planned_gbps_ = link;
  MemoryPolicy next = policy_from_plan(config_, plan, current_.name);
  next.prefetch_depth = prefetch_depth_;
  if (same_actions(next, current_)) return std::nullopt;
  const std::string why =
      late ? fmt::format("layer {}'s copies were late", telemetry.snowball_first_layer.value_or(-1))
      : drift > kLinkDrift
          ? fmt::format("off by {:.0f}%", drift * 100.0)
          : fmt::format("the layers' forward {:.3f} ms, off by {:.0f}%", mean_fwd, layers * 100.0);
  next.note = fmt::format(
      "re-planned after step {}: link {:.3f} GB/s {}, the plan assumed {:.3f} ({}; margin "
      "{:.0f}%); offloaded tensors per layer [{}] -> [{}], {} -> {} recomputed",
      step + 1, measured, link_word_, assumed, why, request_.margin * 100.0,
      fmt::join(offloaded_per_layer(current_), ", "), fmt::join(offloaded_per_layer(next), ", "),
      current_.count(Action::kRecompute), next.count(Action::kRecompute));
  current_ = next;
  plan_ = std::move(plan);
  return next;
}

}  // namespace spillway::train

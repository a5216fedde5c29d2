// `spillway train --policy adaptive`: the plan re-made between steps when the link or the
// layers drift from what it assumed (Note [Re-planning while training], adaptive.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "spillway/core/policy.hpp"
#include "spillway/device/device.hpp"
#include "spillway/nn/nn.hpp"
#include "spillway/offload/offload.hpp"
#include "spillway/plan/plan.hpp"
#include "spillway/train/train.hpp"

namespace spillway::train {

// The host backend's device as a hardware profile (HBM: the arena; the link: the
// throttles), and a training run's request to the planner on it (trainer.cpp).
HardwareProfile host_profile(const TrainOptions& o);
PlanRequest plan_request(const nn::RefConfig& c, const TrainOptions& o, Policy s,
                         std::optional<double> layer_fwd_ms);

// Re-plans between steps. `request` is the auto request the first plan came from (calibrated
// by the measured layer times, the link the run starts on, and its budget: the HBM the first
// plan was measured to fit), `first` that plan's policy.
class AdaptivePlanner {
 public:
  // Drift past which the plan is made again: the measured link or the layers' forward time
  // off by more than this fraction of what the plan assumed (either way), or a layer's
  // copies late.
  static constexpr double kLinkDrift = 0.25;
  // The bytes of the probe copy that measures the link when a step moved nothing.
  static constexpr size_t kProbeBytes = size_t{1} << 20;

  // The device bytes a plan's offloads hold beyond its planned peak: the offload engine's
  // reload staging, prefetch_depth + 1 of its layers' offloaded bytes at most (Note [Train
  // offload sizing], policy_run.cpp; Note [Re-plans within the measured budget]).
  static int64_t staging_bytes(const Plan& plan, int prefetch_depth);

  // `first_plan`: the plan `first` came from (its peak is `request`'s budget).
  AdaptivePlanner(const nn::RefConfig& config, PlanRequest request, MemoryPolicy first,
                  const Plan& first_plan, int prefetch_depth);

  // After step `step` (0-based): the policy to run from the next step on when the plan was
  // re-made and its actions changed, with the change and its numbers in its note.
  std::optional<MemoryPolicy> after_step(int step, const nn::StepStats& stats,
                                         const StepTelemetry& telemetry, Device& device);
  // The same with the link's D2H bandwidth given (GB/s), as the probe copy measured it.
  std::optional<MemoryPolicy> after_step(int step, const nn::StepStats& stats,
                                         const StepTelemetry& telemetry, double measured_gbps);
  // Its notes say the link is the schedule's, not measured (Note [A fixed calibration],
  // trainer.cpp: the caller passes the scheduled speed as measured_gbps).
  void link_as_scheduled() { link_word_ = "as scheduled"; }
  // The plan of the policy in use (the first plan until a re-plan is taken).
  const Plan& plan() const { return plan_; }

 private:
  const nn::RefConfig& config_;
  PlanRequest request_;
  MemoryPolicy current_;
  double planned_gbps_;
  double margin_;  // the margin asked for
  const char* link_word_ = "measured";
  int prefetch_depth_;
  int64_t budget_bytes_;  // the first plan's peak and staging: what ran within the arena
  Plan plan_;
};

}  // namespace spillway::train

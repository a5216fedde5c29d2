// `spillway train --policy adaptive`: the plan re-made between steps when the link or the
// layers drift from what it assumed (Note [Re-planning while training], adaptive.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "spillway/device.hpp"
#include "spillway/nn.hpp"
#include "spillway/offload.hpp"
#include "spillway/plan.hpp"
#include "spillway/policy.hpp"

namespace spillway::train {

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

  AdaptivePlanner(const nn::RefConfig& config, PlanRequest request, MemoryPolicy first,
                  int prefetch_depth);

  // After step `step` (0-based): the policy to run from the next step on when the plan was
  // re-made and its actions changed, with the change and its numbers in its note.
  std::optional<MemoryPolicy> after_step(int step, const nn::StepStats& stats,
                                         const StepTelemetry& telemetry, Device& device);

 private:
  const nn::RefConfig& config_;
  PlanRequest request_;
  MemoryPolicy current_;
  double planned_gbps_;
  double margin_;  // the margin asked for
  int prefetch_depth_;
};

}  // namespace spillway::train

// What the pieces of `spillway train` share (trainer.cpp: the run and its policies;
// policy_run.cpp: one policy's steps; train_report.cpp: the report): one policy run, the
// mean layer time the planner is calibrated with, and the report's megabytes.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "spillway/core/policy.hpp"
#include "spillway/device/device.hpp"
#include "spillway/nn/nn.hpp"
#include "spillway/offload/offload.hpp"
#include "spillway/train/train.hpp"

namespace spillway::train::detail {

inline std::string mb(int64_t bytes) {
  return fmt::format("{:.2f}", static_cast<double>(bytes) / 1e6);
}

// Between two steps (never inside one): the step that ended (0-based), its measurements,
// the device; a policy to run from the next step on, or nothing to keep the one in use.
using Replanner = std::function<std::optional<MemoryPolicy>(
    int step, const nn::StepStats& stats, const StepTelemetry& telemetry, Device& device)>;

// The steps of one policy on a fresh host device (policy_run.cpp), from `first`, re-planned
// between steps by `replan` when it is given.
PolicyResult run_policy(const nn::RefConfig& c, const TrainOptions& o, const MemoryPolicy& first,
                        const std::vector<int32_t>& corpus,
                        const std::function<void(const std::string&)>& progress,
                        const Replanner& replan = nullptr);

// The mean of a run's per-layer forward times (ms): what the planner is calibrated with.
double mean_layer_fwd_ms(const PolicyResult& r);

}  // namespace spillway::train::detail

// The planner's cost model of one layer: its inventory with a time for every op (a
// roofline, optionally calibrated) and the evaluation of a choice of per-tensor actions
// (what stays, what recompute costs, which bytes cross the link and when they exist).
#pragma once

#include <vector>

#include "spillway/catalog/inventory.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {

struct CostedLayer {
  LayerSpec spec;
  LayerInventory inv;
  std::vector<double> op_fwd_ms;
  std::vector<double> op_bwd_ms;
  std::vector<double> produced_at_ms;  // per tensor: end of its producer (0 = layer input)
  double fwd_ms = 0.0;
  double bwd_ms = 0.0;
};

// Dense peak of the profile for a dtype (fp8: its own figure; fp32: TF32, half of bf16).
double peak_tflops(const HardwareProfile& hw, DType dtype);

// The compute efficiency of an op's shape (Note [Efficiency curves]): the given constant
// of its class, else its curve at its abscissa; an op without a shape runs at the curve's
// last point (a large kernel).
double compute_efficiency(const OpCost& op, const EfficiencyCurves& curves, const Efficiency& eff);

// Roofline time of one op: max(FLOPs / (peak * efficiency), bytes / (HBM * efficiency)).
// This form has no shape: a GEMM runs at the end of the dense curve (a large GEMM).
double op_time_ms(OpKind kind, double flops, int64_t bytes, const HardwareProfile& hw, DType dtype,
                  const Efficiency& eff);
// The same with the op's shape and curves (effective_curves(hw, eff)), forward or backward.
double op_time_ms(const OpCost& op, bool backward, const HardwareProfile& hw,
                  const EfficiencyCurves& curves, DType dtype, const Efficiency& eff);

CostedLayer cost_layer(const LayerSpec& spec, int64_t hidden, const ShardShape& shape,
                       const HardwareProfile& hw, const Efficiency& eff);
// Note [A model as PyTorch runs it] (saved_as_run.cpp): the layer's saved tensors replaced by
// those measured where the model runs (before any calibration of its times).
void apply_saved_as_run(CostedLayer& c, const std::vector<SavedTensorBytes>& measured);

// Scales every op time of the layer by `factor` (calibration).
void scale_layer(CostedLayer& layer, double fwd_factor, double bwd_factor);

// The per-layer consequences of a vector of actions (one per tensor; unsaved tensors are
// ignored).
struct ActionCost {
  int64_t kept_bytes = 0;
  int64_t offload_bytes = 0;
  int64_t rematerialized_bytes = 0;
  double recompute_ms = 0.0;  // forward ops re-run in backward (closure over inputs)
  bool valid = true;          // false when a recompute needs an input that no longer exists
  uint64_t rerun_ops = 0;     // bit k: op k runs again in backward
};
ActionCost evaluate_actions(const CostedLayer& layer, const std::vector<Action>& actions);

// The block-type recompute policy of docs/planner.md for this layer.
std::vector<Action> recompute_actions(const CostedLayer& layer);
// Full-layer checkpointing: the layer input kept, every other saved tensor recomputed.
std::vector<Action> checkpoint_actions(const CostedLayer& layer);

// Time (ms after the layer's start) at which a D2H engine, free at `engine_free_ms`, ends
// copying the offloaded tensors of the layer in production order at `bytes_per_ms`.
double copy_finish_ms(const CostedLayer& layer, const std::vector<Action>& actions,
                      double bytes_per_ms, double engine_free_ms, double* first_start_ms);

}  // namespace spillway

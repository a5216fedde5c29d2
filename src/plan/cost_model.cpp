// Roofline costing of a layer's ops and evaluation of per-tensor actions.
//
// Note [Recompute closure]: recomputing a tensor re-runs its producing op in backward;
// that op's inputs must then exist: a kept or reloaded (offloaded) saved tensor is fine,
// a recomputed one has its own producer re-run first, and an unsaved intermediate (e.g.
// mlp.act under a fused SwiGLU) has its producer re-run too. The cost is the forward time
// of every op in that closure, each counted once. The layer input is always available
// (kept or reloaded).
#include "plan/cost_model.hpp"

#include <algorithm>

#include "spillway/core/error.hpp"

namespace spillway {

double peak_tflops(const HardwareProfile& hw, DType dtype) {
  if (dtype == DType::kFp8) return hw.fp8_dense.value;
  if (dtype == DType::kFp32) return hw.bf16_dense.value / 2.0;  // TF32 tensor cores
  return hw.bf16_dense.value;
}

namespace {

double roofline_ms(OpKind kind, double flops, int64_t bytes, const HardwareProfile& hw, DType dtype,
                   double compute_eff, double hbm_eff) {
  const double compute_ms =
      kind == OpKind::kMemory ? 0.0 : flops / (peak_tflops(hw, dtype) * compute_eff * 1e12) * 1e3;
  const double memory_ms = static_cast<double>(bytes) / (hw.hbm_tbps * hbm_eff * 1e12) * 1e3;
  return std::max(compute_ms, memory_ms);
}

}  // namespace

double op_time_ms(OpKind kind, double flops, int64_t bytes, const HardwareProfile& hw, DType dtype,
                  const Efficiency& eff) {
  OpCost op;
  op.kind = kind;
  return roofline_ms(kind, flops, bytes, hw, dtype,
                     compute_efficiency(op, effective_curves(hw, eff), eff),
                     hbm_efficiency(hw, eff));
}

double op_time_ms(const OpCost& op, bool backward, const HardwareProfile& hw,
                  const EfficiencyCurves& curves, DType dtype, const Efficiency& eff) {
  const double compute_eff = compute_efficiency(op, curves, eff);
  const double hbm_eff = eff.hbm.given() ? eff.hbm.value() : curves.hbm;
  return backward
             ? roofline_ms(op.kind, op.bwd_flops, op.bwd_bytes, hw, dtype, compute_eff, hbm_eff)
             : roofline_ms(op.kind, op.fwd_flops, op.fwd_bytes, hw, dtype, compute_eff, hbm_eff);
}

CostedLayer cost_layer(const LayerSpec& spec, int64_t hidden, const ShardShape& shape,
                       const HardwareProfile& hw, const Efficiency& eff) {
  CostedLayer c;
  c.spec = spec;
  c.inv = build_inventory(spec, hidden, shape);
  c.produced_at_ms.assign(c.inv.tensors.size(), 0.0);
  const EfficiencyCurves curves = effective_curves(hw, eff);
  double t = 0.0;
  for (const OpCost& op : c.inv.ops) {
    const double f = op_time_ms(op, false, hw, curves, shape.dtype, eff);
    const double b = op_time_ms(op, true, hw, curves, shape.dtype, eff);
    c.op_fwd_ms.push_back(f);
    c.op_bwd_ms.push_back(b);
    t += f;
    for (int out : op.outputs) c.produced_at_ms[static_cast<size_t>(out)] = t;
    c.bwd_ms += b;
  }
  c.fwd_ms = t;
  return c;
}

void scale_layer(CostedLayer& c, double fwd_factor, double bwd_factor) {
  for (double& v : c.op_fwd_ms) v *= fwd_factor;
  for (double& v : c.op_bwd_ms) v *= bwd_factor;
  for (double& v : c.produced_at_ms) v *= fwd_factor;
  c.fwd_ms *= fwd_factor;
  c.bwd_ms *= bwd_factor;
}

std::vector<Action> recompute_actions(const CostedLayer& c) {
  std::vector<Action> a(c.inv.tensors.size(), Action::kRecompute);
  const bool moe = c.spec.mlp.kind == MlpKind::kMoe;
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string& n = c.inv.tensors[i].name;
    // Block inputs are the checkpoints; MoE keeps router and dispatch results and the
    // input of the expert GEMMs, recomputing only the expert GEMMs; a Mamba or Gated
    // DeltaNet block keeps its scan's output and chunk states and recomputes only its
    // projections, convolution and gate: the scan never runs again (docs/planner.md).
    const bool block_input = n == "attn.input" || n == "mlp.input" || n == "ssm.input" ||
                             n == "lin.input" || n == "rec.input";
    const bool moe_kept =
        moe && (n == "mlp.norm_out" || n == "moe.router_probs" || n == "moe.topk_idx" ||
                n == "moe.topk_weights" || n == "moe.dispatch_in");
    // A recurrent block is recomputed whole from its input but keeps the recurrence's
    // chunk states (full-block plus a narrow recompute of the recurrence).
    const bool scan_kept = n == "ssm.scan_out" || n == "ssm.chunk_states" || n == "lin.core_out" ||
                           n == "lin.chunk_states" || n == "rec.chunk_states";
    if (block_input || moe_kept || scan_kept) a[i] = Action::kKeep;
  }
  return a;
}

std::vector<Action> checkpoint_actions(const CostedLayer& c) {
  std::vector<Action> a(c.inv.tensors.size(), Action::kRecompute);
  for (size_t i = 0; i < a.size(); ++i) {
    if (c.inv.tensors[i].producer < 0) a[i] = Action::kKeep;  // the layer input
  }
  return a;
}

ActionCost evaluate_actions(const CostedLayer& c, const std::vector<Action>& actions) {
  constexpr const char* kWhat = "plan: a layer's saved bytes";
  SPILLWAY_CHECK(actions.size() == c.inv.tensors.size(), "one action per tensor");
  const size_t n_ops = c.inv.ops.size();
  SPILLWAY_CHECK(n_ops <= 64, "a layer has at most 64 ops ({} here)", n_ops);
  ActionCost r;
  uint64_t rerun = 0;  // bit k: op k runs again in backward (Note [Recompute closure])
  for (size_t i = 0; i < actions.size(); ++i) {
    const TensorInfo& t = c.inv.tensors[i];
    if (!t.saved) continue;
    switch (actions[i]) {
      case Action::kKeep:
        r.kept_bytes = checked_add(r.kept_bytes, t.bytes, kWhat);
        break;
      case Action::kOffload:
        r.offload_bytes = checked_add(r.offload_bytes, t.bytes, kWhat);
        r.rematerialized_bytes = checked_add(r.rematerialized_bytes, t.bytes, kWhat);
        break;
      case Action::kRecompute:
        r.rematerialized_bytes = checked_add(r.rematerialized_bytes, t.bytes, kWhat);
        if (t.producer < 0) {
          r.valid = false;  // the layer input cannot be recomputed inside the layer
        } else {
          rerun |= uint64_t{1} << t.producer;
        }
        break;
    }
  }
  // Ops are in forward order, so walking backwards reaches every input's producer after
  // its consumer.
  for (size_t k = n_ops; k-- > 0;) {
    if (!(rerun >> k & 1u)) continue;
    for (int in : c.inv.ops[k].inputs) {
      const TensorInfo& t = c.inv.tensors[static_cast<size_t>(in)];
      const bool available = t.saved && actions[static_cast<size_t>(in)] != Action::kRecompute;
      if (available || t.producer < 0) continue;
      rerun |= uint64_t{1} << t.producer;
    }
  }
  for (size_t k = 0; k < n_ops; ++k) {
    if (rerun >> k & 1u) r.recompute_ms += c.op_fwd_ms[k];
  }
  r.rerun_ops = rerun;
  return r;
}

double copy_finish_ms(const CostedLayer& c, const std::vector<Action>& actions, double bytes_per_ms,
                      double engine_free_ms, double* first_start_ms) {
  // Tensors are produced in forward order, so index order is production order except for
  // outputs of one op (same time); a stable pass over producers keeps FIFO order.
  double t = engine_free_ms;
  bool first = true;
  std::vector<size_t> order;
  for (size_t i = 0; i < actions.size(); ++i) {
    if (c.inv.tensors[i].saved && actions[i] == Action::kOffload) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return c.produced_at_ms[a] < c.produced_at_ms[b]; });
  for (size_t i : order) {
    const double start = std::max(t, c.produced_at_ms[i]);
    if (first && first_start_ms != nullptr) *first_start_ms = start;
    first = false;
    t = start + static_cast<double>(c.inv.tensors[i].bytes) / bytes_per_ms;
  }
  if (first && first_start_ms != nullptr) *first_start_ms = engine_free_ms;
  return t;
}

}  // namespace spillway

// `spillway plan --explain LAYER`: every term of one layer's memory and time, each with the
// formula it comes from (docs/planner.md), so a figure of the plan can be traced by hand.
#include <fmt/format.h>

#include <algorithm>

#include "plan/cost_model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/collectives.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {

namespace {

std::string mb(int64_t bytes) {
  return fmt::format("{:.1f} MB", static_cast<double>(bytes) / 1e6);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::string format_plan_explain(const Plan& plan, const PlanRequest& r, int layer) {
  if (layer < 0 || layer >= static_cast<int>(plan.layers.size())) {
    SPILLWAY_FIELD_ERROR("explain", layer, "must be a layer of the plan's first stage: [0, {}]",
                         plan.layers.size() - 1);
  }
  const LayerPlan& lp = plan.layers[static_cast<size_t>(layer)];
  const ShardShape& s = r.work.shape;
  const PlanSummary& m = plan.summary;
  const LayerSpec& spec = r.model.layers[static_cast<size_t>(layer)];
  const LayerInventory inv = build_inventory(spec, r.model.hidden, s);
  const EfficiencyCurves curves = effective_curves(r.hardware, r.efficiency);
  const double peak = peak_tflops(r.hardware, s.dtype);
  const double hbm = r.hardware.hbm_tbps * hbm_efficiency(r.hardware, r.efficiency);
  std::string out;
  out += fmt::format("\nexplain layer {} ({}, policy {})\n", layer, lp.block, to_string(lp.policy));

  // ---- time ----
  out += fmt::format(
      "\n  time: per op, roofline max(FLOPs / (peak x efficiency), bytes / (HBM x {:.2f}))\n"
      "  with peak {:.0f} TFLOP/s ({}) and HBM {:.2f} TB/s; calibration x{:.3f} ({})\n",
      hbm_efficiency(r.hardware, r.efficiency), peak, to_string(s.dtype), r.hardware.hbm_tbps,
      m.time_scale, m.calibration);
  out += fmt::format("  {:<16} {:<9} {:>10} {:>9} {:>5} {:>10} {:>9} {:>8} {:>8}\n", "op", "kind",
                     "fwd GFLOP", "fwd MB", "eff", "compute ms", "memory ms", "fwd ms", "bwd ms");
  for (size_t k = 0; k < lp.ops.size() && k < inv.ops.size(); ++k) {
    const OpPlan& op = lp.ops[k];
    const double eff =
        op.kind == OpKind::kMemory ? 0.0 : compute_efficiency(inv.ops[k], curves, r.efficiency);
    const double compute_ms =
        op.kind == OpKind::kMemory ? 0.0 : op.fwd_flops / (peak * eff * 1e12) * 1e3;
    const double memory_ms = static_cast<double>(op.fwd_bytes) / (hbm * 1e12) * 1e3;
    out += fmt::format(
        "  {:<16} {:<9} {:>10.2f} {:>9.1f} {:>5} {:>10.3f} {:>9.3f} {:>8.3f} {:>8.3f}\n", op.name,
        to_string(op.kind), op.fwd_flops / 1e9, static_cast<double>(op.fwd_bytes) / 1e6,
        op.kind == OpKind::kMemory ? std::string("-") : fmt::format("{:.2f}", eff), compute_ms,
        memory_ms, op.fwd_ms, op.bwd_ms);
  }
  out += fmt::format(
      "  forward {:.3f} ms, backward {:.3f} ms (sums of the ops; fwd ms = max(compute, memory) "
      "x calibration)\n",
      lp.fwd_ms, lp.bwd_ms);
  out += fmt::format(
      "  recompute in backward {:.3f} ms (the producers of the recomputed tensors and what they "
      "need, Note [Recompute closure]); the block policy's would be {:.3f} ms\n",
      lp.recompute_ms, lp.recompute_ms + lp.recompute_avoided_ms);
  if (lp.offload_bytes > 0) {
    // Beside a host-link ring a copy takes longer than alone (Note [The host link is
    // shared] in plan_collectives.cpp).
    auto shared = [&](double gbps, double ms) {
      const double alone = static_cast<double>(lp.offload_bytes) / (gbps * 1e6);
      return ms > alone * (1.0 + 1e-9)
                 ? fmt::format(
                       "{:.3f} ms alone, {:.3f} ms sharing the host link with "
                       "collectives (+min(copy, ring))",
                       alone, ms)
                 : fmt::format("{:.3f} ms", ms);
    };
    out += fmt::format(
        "  D2H  {} / {:.1f} GB/s = {}; window {:.3f} ms (first offloaded tensor to the "
        "end of layer {}'s forward); margin window / D2H - 1 = {:+.0f}% (needs >= {:.0f}%){}\n",
        mb(lp.offload_bytes), m.d2h_gbps, shared(m.d2h_gbps, lp.d2h_ms), lp.window_ms, layer + 1,
        lp.margin * 100.0, r.margin * 100.0, lp.snowball ? "; SNOWBALL" : "");
    out += fmt::format(
        "  H2D  {} / {:.1f} GB/s = {}, issued {} layer(s) ahead; backward stall {:.3f} ms\n",
        mb(lp.offload_bytes), m.h2d_gbps, shared(m.h2d_gbps, lp.h2d_ms), r.prefetch_depth,
        lp.stall_ms);
  } else {
    out += "  no copies: nothing offloaded\n";
  }
  for (const CollectivePlan& c : lp.collectives) {
    out += fmt::format(
        "  {:<19} {} {} of {} over {} GPUs on {} at {:.0f} GB/s: {:.2f} x S / B + {} x {:.0f} us = "
        "{:.3f} ms, {}\n",
        c.what, c.backward ? "bwd" : "fwd", to_string(c.kind), mb(c.bytes), c.group, c.link, c.gbps,
        ring_volume_factor(c.kind, c.group), ring_steps(c.kind, c.group),
        r.hardware.interconnect.collective_latency_us, c.ms,
        c.exposed ? "on the critical path" : "overlapped with compute");
  }

  // ---- memory ----
  out += "\n  memory: saved tensors (per GPU, one micro-batch)\n";
  out += fmt::format("  {:<20} {:<16} {:<6} {:>10}  {}\n", "tensor", "shape", "dtype", "bytes",
                     "action");
  for (const TensorPlan& t : lp.tensors) {
    out += fmt::format("  {:<20} {:<16} {:<6} {:>10}  {}\n", t.name, shape_text(t.shape), t.dtype,
                       mb(t.bytes), to_string(t.action));
  }
  out += fmt::format(
      "  kept {} x {} micro-batch(es) in flight = {} until its backward; offloaded {} (host "
      "pinned); live again in its backward (reloaded + recomputed) {}\n",
      mb(lp.kept_bytes), r.work.pp, mb(lp.kept_bytes * r.work.pp), mb(lp.offload_bytes),
      mb(lp.rematerialized_bytes));
  const int64_t w = s.dtype == DType::kFp32 ? 4 : 2;
  const int64_t dp = r.work.dp;
  const auto shard = [&](int64_t b, int stage) { return r.zero >= stage ? (b + dp - 1) / dp : b; };
  out += fmt::format(
      "  training state of its {} parameters on this GPU (ZeRO-{} over dp {}): weights {} x {} "
      "B{} = {}, gradients {}, optimizer states {}\n",
      lp.params, r.zero, dp, lp.params, w, r.zero >= 3 && dp > 1 ? " / dp" : "",
      mb(shard(lp.params * w, 3)),
      r.grad_offload ? std::string("streamed to the host") : mb(shard(lp.params * w, 2)),
      r.optimizer_offload ? fmt::format("{} in host memory", mb(shard(lp.params, 1) * 12))
                          : mb(shard(lp.params, 1) * 12));
  return out;
}

}  // namespace spillway

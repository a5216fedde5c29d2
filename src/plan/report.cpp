// The human report of a plan: the workload, a table per layer (runs of identical rows
// shown once with their index range), the summary by memory category, and the reasons
// when the strategy is infeasible.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "plan/cost_model.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {

namespace {

std::string gb(int64_t b) {
  return fmt::format("{:.2f} GB", static_cast<double>(b) / 1e9);
}

std::string layer_row(const LayerPlan& l) {
  const bool off = l.offload_bytes > 0;
  const std::string margin = off ? fmt::format("{:+.0f}%", l.margin * 100.0) : "-";
  return fmt::format("{:<14} {:<10} {:>10} {:>8} {:>9} {:>7} {:>9.2f} {:>9.2f}{}", l.block,
                     to_string(l.policy), off ? gb(l.offload_bytes) : "-",
                     off ? fmt::format("{:.2f}", l.d2h_ms) : "-",
                     off ? fmt::format("{:.2f}", l.window_ms) : "-", margin, l.recompute_ms,
                     l.recompute_avoided_ms, l.snowball ? "  SNOWBALL" : "");
}

}  // namespace

// Note [Fused-kernel inventory]: the inventory (src/model/inventory.cpp) saves what fused
// kernels keep for backward: flash attention's output and log-sum-exp (no score matrix),
// norms that save their input alone, a chunked selective scan's chunk states. An eager
// Hugging Face model keeps more, measured against transformers: 1.3-1.5x per attention or
// MLP layer (the SiLU output beside the SwiGLU product, RMSNorm's tensors before its
// weight, int64 router indices) and 6-8x per Mamba layer (the slow path's per-step states).
std::string inventory_assumption(const ModelConfig& model) {
  bool mamba = false;
  bool moe = false;
  bool attn = false;
  bool attn_or_mlp = false;
  for (const LayerSpec& l : model.layers) {
    mamba |= l.mixer == MixerKind::kMamba || l.parallel_ssm;
    moe |= l.mlp.kind == MlpKind::kMoe;
    attn |= l.mixer == MixerKind::kAttention || l.shared_block >= 0;
    attn_or_mlp |= l.mixer == MixerKind::kAttention || l.mlp.kind != MlpKind::kNone;
  }
  std::string out = fmt::format(
      "activations as fused kernels save them ({}fused norms and activations{}); an eager "
      "Hugging Face model saves more",
      attn ? "flash attention, " : "", mamba ? ", a chunked selective scan" : "");
  if (attn_or_mlp) {
    out += fmt::format(
        ": 1.3-1.5x per attention/MLP layer (the SiLU output, RMSNorm's pre-weight tensors{})",
        moe ? ", int64 router indices" : "");
  }
  if (mamba) {
    out += fmt::format("{} 6-8x per Mamba layer (the slow path's per-step states)",
                       attn_or_mlp ? " and" : ":");
  }
  return out;
}

std::string format_plan_report(const Plan& plan, const PlanRequest& r) {
  const ShardShape& s = r.work.shape;
  const PlanSummary& m = plan.summary;
  std::string out;
  out += fmt::format("spillway plan: {} on {} (policy {})\n", r.model.name, r.hardware.name,
                     to_string(r.strategy));
  out += fmt::format("  model     {} layers, hidden {}, {:.1f}B parameters ({:.2f}B on this GPU)\n",
                     r.model.layers.size(), r.model.hidden,
                     static_cast<double>(plan.params_total) / 1e9,
                     static_cast<double>(plan.params_per_gpu) / 1e9);
  for (const std::string& note : r.model.notes) out += fmt::format("  note      {}\n", note);
  out += fmt::format(
      "  workload  micro-batch {} x seq {} = {} tokens/GPU, {}, tp {} ep {} cp {} pp {} dp {}, "
      "grad-accum {}{}\n",
      s.micro_batch, s.seq_len, plan.tokens_per_gpu, to_string(s.dtype), s.tp, s.ep, s.cp,
      r.work.pp, r.work.dp, r.work.grad_accum, s.fused_swiglu ? ", fused SwiGLU" : "");
  out += fmt::format("  link      D2H {:.0f} GB/s, H2D {:.0f} GB/s per GPU ({}); margin {:.0f}%\n",
                     m.d2h_gbps, m.h2d_gbps,
                     r.d2h_gbps || r.h2d_gbps ? "given"
                                              : fmt::format("typical measured, {} GPU(s) per link",
                                                            r.hardware.gpus_per_link),
                     r.margin * 100.0);
  // Note [Efficiency curves]: the efficiencies this plan's ops ran at, per kernel class (a
  // given constant prints as itself).
  const EfficiencyCurves curves = effective_curves(r.hardware, r.efficiency);
  struct Range {
    double lo = 2.0;
    double hi = -1.0;
    void add(double v) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    std::string text() const {
      return lo == hi || hi - lo < 0.005 ? fmt::format("{:.2f}", lo)
                                         : fmt::format("{:.2f}-{:.2f}", lo, hi);
    }
  };
  Range dense, grouped, attention;
  std::vector<const LayerSpec*> seen;
  for (size_t i = 0; i < plan.layers.size() && i < r.model.layers.size(); ++i) {
    const LayerSpec& spec = r.model.layers[i];
    if (std::any_of(seen.begin(), seen.end(), [&](const LayerSpec* p) { return *p == spec; }))
      continue;
    seen.push_back(&spec);
    for (const OpCost& op : build_inventory(spec, r.model.hidden, s).ops) {
      if (op.kind == OpKind::kMemory) continue;
      Range& into = op.kind == OpKind::kAttention ? attention
                    : op.shape.grouped()          ? grouped
                                                  : dense;
      into.add(compute_efficiency(op, curves, r.efficiency));
    }
  }
  std::string used;
  if (dense.hi > 0.0) used += fmt::format("gemm {}, ", dense.text());
  if (grouped.hi > 0.0) used += fmt::format("grouped gemm {}, ", grouped.text());
  if (attention.hi > 0.0) used += fmt::format("attention {}, ", attention.text());
  const bool any_curve = !r.efficiency.gemm.given() || !r.efficiency.attention.given();
  out +=
      fmt::format("  times     {} ({}hbm {:.2f} of peak{}{}{})\n", m.calibration, used,
                  hbm_efficiency(r.hardware, r.efficiency), any_curve ? "; efficiency curves" : "",
                  r.efficiency.measured.empty()
                      ? ""
                      : fmt::format(" + {} measured kernels", r.efficiency.measured.size()),
                  m.calibration == "roofline" ? "" : fmt::format("; scaled x{:.3f}", m.time_scale));
  out += fmt::format("  inventory {}\n", inventory_assumption(r.model));
  if (!plan.offload_tensors.empty()) {
    out += fmt::format(
        "  offload   exactly {} in every layer that offloads (--offload-tensors); "
        "the rest {}\n",
        fmt::join(plan.offload_tensors, ", "),
        r.strategy == Policy::kKeep   ? "kept"
        : r.strategy == Policy::kAuto ? "kept or recomputed by the block policy, per layer"
                                      : "recomputed by the block policy");
  }
  {
    const TrainingStatePlan& ts = m.state;
    std::string state = fmt::format("  state     ZeRO-{} over dp {}", ts.zero, r.work.dp);
    if (r.work.dp == 1) state += " (nothing to shard)";
    state += ts.optimizer_offload
                 ? fmt::format(
                       "; optimizer offloaded: CPU AdamW at {:.0f} GB/s{}, {} layer(s) "
                       "stepped on the GPU, {}{}",
                       ts.cpu_adam_gbps,
                       ts.cpu_adam_assumed ? " (assumed: measure with `spillway bench adam`, pass "
                                             "--cpu-adam-gbps)"
                                           : "",
                       ts.device_buckets,
                       ts.cast_on_host ? "bf16 over the link (casts on the CPU)"
                                       : "fp32 over the link (casts on the GPU)",
                       ts.grad_offload ? "; gradients offloaded" : "")
                 : "; optimizer on the GPU";
    state += fmt::format("; loss in chunks of {} tokens{}\n", ts.loss_chunk_tokens,
                         ts.loss_chunk_tokens < plan.tokens_per_gpu ? "" : " (unchunked)");
    out += state;
  }
  if (s.dtype == DType::kFp8) {  // Note [FP8 recompute]
    int gemms = 0;
    int64_t bytes = 0;
    int layers = 0;
    for (const LayerPlan& l : plan.layers) {
      gemms += l.fp8_recomputed_gemms;
      bytes += l.fp8_scaling_state_bytes;
      layers += l.fp8_recomputed_gemms > 0 ? 1 : 0;
    }
    out += fmt::format(
        "  fp8       GEMMs at the fp8 peak ({:.0f} TFLOP/s), activations saved in fp8; {} "
        "recomputed fp8 GEMM(s) in {} layer(s) reuse the forward's scaling state (amax "
        "history of {} and scales kept: {:.2f} MB), never re-derive or step it\n",
        r.hardware.fp8_dense.value, gemms, layers, kFp8AmaxHistory,
        static_cast<double>(bytes) / 1e6);
  }
  if (r.model.layers.size() != plan.layers.size()) {
    out +=
        fmt::format("  stage     the first pipeline stage: layers 0-{}\n", plan.layers.size() - 1);
  }
  // Note [Per-block policy]: the numbers behind the per-block choice, when the stack mixes
  // kinds of blocks.
  if (m.blocks.size() > 1) {
    for (const BlockSummary& b : m.blocks) {
      out += fmt::format(
          "  block     {} x{}: {}; the block policy keeps {}{:.2f} MB a layer and reruns {:.2f} "
          "ms; full-layer checkpointing {:.2f} MB and {:.2f} ms\n",
          b.block, b.layers, b.chosen,
          b.kept.empty() ? std::string("the input, ")
                         : fmt::format("the input and {}: ", fmt::join(b.kept, ", ")),
          static_cast<double>(b.block_kept_bytes) / 1e6, b.block_recompute_ms,
          static_cast<double>(b.checkpoint_kept_bytes) / 1e6, b.checkpoint_recompute_ms);
      std::string cands;
      for (size_t i = 0; i < b.candidates.size() && i < 4; ++i) {
        cands += fmt::format("{}{} {:.2f} MB", i == 0 ? "" : ", ", b.candidates[i].first,
                             static_cast<double>(b.candidates[i].second) / 1e6);
      }
      if (b.candidates.size() > 4) cands += fmt::format(", {} more", b.candidates.size() - 4);
      if (!cands.empty()) out += fmt::format("            offload candidates: {}\n", cands);
    }
  }
  out += "\n";
  out +=
      fmt::format("{:>7}  {:<14} {:<10} {:>10} {:>8} {:>9} {:>7} {:>9} {:>9}\n", "layer", "block",
                  "policy", "offload", "D2H ms", "window ms", "margin", "recomp ms", "avoided");
  for (size_t i = 0; i < plan.layers.size();) {
    const std::string row = layer_row(plan.layers[i]);
    size_t j = i + 1;
    while (j < plan.layers.size() && layer_row(plan.layers[j]) == row) ++j;
    const std::string idx = j - i > 1 ? fmt::format("{}-{}", i, j - 1) : std::to_string(i);
    out += fmt::format("{:>7}  {}\n", idx, row);
    i = j;
  }
  out += "\nsummary\n";
  out += fmt::format("  feasible       {}\n", m.feasible ? "yes" : "NO");
  for (const std::string& reason : m.reasons) out += fmt::format("    - {}\n", reason);
  out +=
      fmt::format("  peak HBM       {} of {} budget\n", gb(m.peak.total()), gb(m.hbm_budget_bytes));
  out += fmt::format("    weights            {:>10}\n", gb(m.peak.weights));
  out += fmt::format("    gradients          {:>10}\n", gb(m.peak.gradients));
  out += fmt::format("    optimizer states   {:>10}\n", gb(m.peak.optimizer_states));
  out += fmt::format("    activations        {:>10}\n", gb(m.peak.activations));
  out += fmt::format("    logits             {:>10}\n", gb(m.peak.logits));
  out += fmt::format("    buffers            {:>10}\n", gb(m.peak.buffers));
  out += fmt::format("    in-flight copies   {:>10}\n", gb(m.peak.in_flight_copies));
  out += fmt::format("  host pinned    {}", gb(m.host_pinned_bytes));
  if (m.state.host_state_bytes > 0) {
    out += fmt::format(" (optimizer state and gradients {}, activations {})",
                       gb(m.state.host_state_bytes),
                       gb(m.host_pinned_bytes - m.state.host_state_bytes));
  }
  out += "\n";
  out += fmt::format("  step time      {:.1f} ms (all-recompute {:.1f} ms, all-keep {:.1f} ms)\n",
                     m.step_ms, m.recompute_step_ms, m.keep_step_ms);
  out += fmt::format(
      "    optimizer    {:.1f} ms on the critical path{}\n", m.state.optimizer_ms,
      m.state.optimizer_offload
          ? fmt::format(
                " (the CPU pipeline's tail past backward; {:.1f} ms of CPU work overlap it)",
                m.state.optimizer_total_ms)
          : " (AdamW on the GPU after backward)");
  if (m.collective_total_ms > 0.0) {
    out += fmt::format(
        "    collectives  {:.1f} ms on the critical path ({:.1f} ms in all, the rest hidden under "
        "compute; per layer in --json)\n",
        m.collective_ms, m.collective_total_ms);
  }
  if (m.state.loss_recompute_ms > 0.0) {
    out += fmt::format("    loss chunks  {:.1f} ms per micro-batch recomputing the logits\n",
                       m.state.loss_recompute_ms);
  }
  out += fmt::format("  speedup        {:.3f}x against all-recompute", m.speedup_vs_recompute);
  if (m.stall_ms > 0.0) out += fmt::format("; {:.1f} ms of backward stalls on reloads", m.stall_ms);
  out += "\n";
  return out;
}

}  // namespace spillway

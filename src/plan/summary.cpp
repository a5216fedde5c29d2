// The plan's summary: its step times and memory from the final timelines, the offloaded
// optimizer's tail, the per-block numbers (Note [Per-block policy]) and, when the plan does
// not fit, why.
#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "plan/planner.hpp"
#include "spillway/core/units.hpp"

namespace spillway::planner {

void fill_summary(Timelines& tl, int64_t grad_accum, Plan& plan) {
  PlanSummary& s = plan.summary;
  const double ga = static_cast<double>(grad_accum);
  s.step_ms = tl.chosen.step_ms * ga;
  s.recompute_step_ms = tl.recompute.step_ms * ga;
  s.keep_step_ms = tl.keep.step_ms * ga;
  s.speedup_vs_recompute = s.recompute_step_ms / s.step_ms;
  s.stall_ms = tl.chosen.stall_ms * ga;
  s.peak = tl.chosen.peak;
  s.host_pinned_bytes = tl.chosen.host_pinned;
  plan.layers = std::move(tl.chosen.layers);
}

// The offloaded optimizer's time (Note [Training state]): each layer's bucket (its share
// of the sharded state) goes down as its backward ends, through the CPU AdamW and back up;
// the split keeps the last-arriving layers' state and step on the GPU when that ends the
// step sooner and their state fits the HBM the plan leaves free. Only the tail past the
// end of backward is on the critical path. Fills plan.summary.state and adds the device
// buckets' state to the peak.
void plan_offloaded_optimizer(const PlanRequest& r, Plan& plan) {
  TrainingStatePlan& ts = plan.summary.state;
  const OptimizerSplit split = plan_optimizer_split(plan, r, ts.cpu_adam_gbps);
  ts.cast_on_host = split.cast_on_host;
  ts.device_buckets = split.layers_on_device;
  ts.optimizer_ms = split.end_ms - split.backward_ms;
  ts.optimizer_total_ms = split.cpu_total_ms;
  plan.summary.peak.optimizer_states += split.device_state_bytes;
}

// Note [Per-block policy]: per kind of block (LayerSpec::block_name) in the stage, the
// block-type policy of docs/planner.md (recompute_actions: attention from its input, MoE
// only the expert GEMMs, a Mamba or Gated DeltaNet mixer keeping its scan's output and
// chunk states) against full-layer checkpointing (checkpoint_actions), per layer, and the
// policies the plan chose for those layers: the numbers behind the per-block choice.
void summarize_blocks(const Stage& st, const PlanRequest& r, Plan& plan) {
  std::vector<BlockSummary>& out = plan.summary.blocks;
  std::vector<std::map<std::string, int>> chosen;
  for (size_t l = 0; l < st.layers.size(); ++l) {
    const CostedLayer& c = st.layers[l];
    const std::string name = c.spec.block_name();
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const BlockSummary& b) { return b.block == name; });
    if (it == out.end()) {
      BlockSummary b;
      b.block = name;
      const std::vector<Action> rec = recompute_actions(c);
      const ActionCost rc = evaluate_actions(c, rec);
      const ActionCost ck = evaluate_actions(c, checkpoint_actions(c));
      b.block_kept_bytes = rc.kept_bytes;
      b.block_recompute_ms = rc.recompute_ms;
      b.checkpoint_kept_bytes = ck.kept_bytes;
      b.checkpoint_recompute_ms = ck.recompute_ms;
      for (size_t i = 0; i < rec.size(); ++i) {
        const TensorInfo& t = c.inv.tensors[i];
        if (t.saved && t.producer >= 0 && rec[i] == Action::kKeep) b.kept.push_back(t.name);
        if (t.saved && rec[i] == Action::kRecompute) b.candidates.emplace_back(t.name, t.bytes);
      }
      std::stable_sort(b.candidates.begin(), b.candidates.end(),
                       [](const auto& x, const auto& y) { return x.second > y.second; });
      out.push_back(std::move(b));
      chosen.emplace_back();
      it = out.end() - 1;
    }
    ++it->layers;
    ++chosen[static_cast<size_t>(it - out.begin())][to_string(plan.layers[l].policy)];
  }
  for (size_t b = 0; b < out.size(); ++b) {
    std::string s;
    for (const auto& [policy, count] : chosen[b])
      s += fmt::format("{}{} x{}", s.empty() ? "" : ", ", policy, count);
    out[b].chosen = s;
  }
  (void)r;
}

std::vector<std::string> infeasibility_reasons(const Plan& plan, const Timelines& tl,
                                               const Stage& st, const PlanRequest& r) {
  const PlanSummary& s = plan.summary;
  std::vector<std::string> reasons;
  const double margin_pct = r.margin * 100.0;
  size_t listed = 0;
  for (size_t l : tl.chosen.snowball_layers) {
    const LayerPlan& lp = plan.layers[l];
    if (listed++ >= 4) continue;
    const double need = lp.d2h_ms * (1.0 + r.margin);
    const double alone = static_cast<double>(lp.offload_bytes) / st.d2h_bytes_per_ms;
    // Note [The host link is shared].
    const std::string shared =
        lp.d2h_ms > alone * (1.0 + 1e-9)
            ? fmt::format(
                  ", {:.1f} ms beside the {:.1f} ms of host-link collectives issued with it",
                  lp.d2h_ms, st.host_comm_fwd_ms[l])
            : std::string();
    if (need > lp.window_ms) {
      reasons.push_back(fmt::format(
          "layer {}: {} at {:.0f} GB/s = {:.1f} ms{} ({:.1f} ms with the {:.0f}% margin) > {:.1f} "
          "ms forward window",
          l, to_string(Bytes(lp.offload_bytes)), s.d2h_gbps, alone, shared, need, margin_pct,
          lp.window_ms));
    } else {
      reasons.push_back(fmt::format(
          "layer {}: {} would fit its {:.1f} ms window alone, but earlier layers' copies still "
          "occupy the link: it ends {:.1f} ms late",
          l, to_string(Bytes(lp.offload_bytes)), lp.window_ms, lp.late_ms));
    }
  }
  if (tl.chosen.snowball_layers.size() > 4) {
    reasons.push_back(fmt::format("... and {} more layers miss their window",
                                  tl.chosen.snowball_layers.size() - 4));
  }
  if (!tl.chosen.snowball_layers.empty()) {
    const LayerPlan& last = plan.layers.back();
    reasons.push_back(fmt::format(
        "the D2H queue snowballs from layer {}: {} still waiting to be copied when the forward "
        "ends (largest backlog {})",
        tl.chosen.snowball_layers.front(), to_string(Bytes(last.backlog_bytes)),
        to_string(Bytes(tl.chosen.max_backlog))));
  }
  if (s.peak.total() > st.budget) {
    reasons.push_back(fmt::format(
        "peak HBM {} > budget {} (weights {}, gradients {}, optimizer states {}, activations {}, "
        "logits {}, buffers {}, in-flight copies {})",
        to_string(Bytes(s.peak.total())), to_string(Bytes(st.budget)),
        to_string(Bytes(s.peak.weights)), to_string(Bytes(s.peak.gradients)),
        to_string(Bytes(s.peak.optimizer_states)), to_string(Bytes(s.peak.activations)),
        to_string(Bytes(s.peak.logits)), to_string(Bytes(s.peak.buffers)),
        to_string(Bytes(s.peak.in_flight_copies))));
    if (r.strategy == Policy::kAuto || r.strategy == Policy::kRecompute) {
      std::string hint = "lower --micro-batch or --seq-len, or raise --tp/--pp/--dp/--ep";
      if (!r.optimizer_offload) hint += ", or --optimizer offload";
      if (r.work.dp > 1 && r.zero < 3) hint += ", or shard more (--zero 3)";
      reasons.push_back(fmt::format("even with every layer recomputed the peak is {}: {}",
                                    to_string(Bytes(tl.recompute.peak.total())), hint));
    }
  }
  const double host_gb = r.hardware.host_memory_gb / r.hardware.gpus_per_host_memory;
  if (static_cast<double>(s.host_pinned_bytes) > host_gb * 1e9) {
    reasons.push_back(fmt::format("pinned host memory {} > {:.0f} GB of host memory per GPU",
                                  to_string(Bytes(s.host_pinned_bytes)), host_gb));
  }
  return reasons;
}

}  // namespace spillway::planner

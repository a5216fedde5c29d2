// The planner's input check: a request no plan can be made for (sizes, divisibility,
// ranges) throws spillway::InputError naming the field and its value.
#include <algorithm>
#include <numeric>

#include "plan/planner.hpp"
#include "spillway/core/error.hpp"

namespace spillway::planner {

void validate(const PlanRequest& r) {
  const ShardShape& s = r.work.shape;
  using L = PlanLimits;
  auto size = [](const char* field, int64_t v, int64_t hi) {
    if (v < 1) SPILLWAY_FIELD_ERROR(field, v, "must be >= 1");
    if (v > hi) SPILLWAY_FIELD_ERROR(field, v, "must be in [1, {}]", hi);
  };
  size("micro_batch", s.micro_batch, L::kMaxMicroBatch);
  size("seq_len", s.seq_len, L::kMaxSeqLen);
  size("tp", s.tp, L::kMaxGroup);
  size("cp", s.cp, L::kMaxGroup);
  size("ep", s.ep, L::kMaxGroup);
  size("pp", r.work.pp, L::kMaxGroup);
  size("dp", r.work.dp, L::kMaxGroup);
  size("grad_accum", r.work.grad_accum, L::kMaxGroup);
  if (int64_t tokens = 0; __builtin_mul_overflow(s.micro_batch, s.seq_len, &tokens)) {
    SPILLWAY_FIELD_ERROR("micro_batch", s.micro_batch,
                         "micro_batch * seq_len overflows 64 bits (seq_len is {})", s.seq_len);
  }
  if (s.seq_len % s.cp != 0)
    SPILLWAY_FIELD_ERROR("cp", s.cp, "must divide seq_len ({})", s.seq_len);
  const int64_t layers = static_cast<int64_t>(r.model.layers.size());
  if (r.work.pp > layers) {
    SPILLWAY_FIELD_ERROR("pp", r.work.pp, "must be <= the model's layers ({})", layers);
  }
  for (const LayerSpec& l : r.model.layers) {
    if ((l.mixer == MixerKind::kAttention || l.shared_block >= 0) && l.attn.heads % s.tp != 0) {
      SPILLWAY_FIELD_ERROR("tp", s.tp, "must divide the attention heads ({}) of {}", l.attn.heads,
                           r.model.name);
    }
    // A Mamba or Gated DeltaNet mixer splits over tp by heads (Mamba-1 by channels).
    const int64_t mixer_heads =
        l.mixer == MixerKind::kMamba ? (l.ssm.version == 1 ? l.ssm.inner : l.ssm.heads)
        : l.mixer == MixerKind::kRecurrent
            ? l.recurrent.heads
            : (l.mixer == MixerKind::kLinearAttention ? std::gcd(l.linear.k_heads, l.linear.v_heads)
                                                      : 0);
    if (l.parallel_ssm && l.ssm.heads % s.tp != 0) {
      SPILLWAY_FIELD_ERROR("tp", s.tp,
                           "must divide the Mamba heads ({}) beside the attention of {}",
                           l.ssm.heads, r.model.name);
    }
    if (mixer_heads > 0 && mixer_heads % s.tp != 0) {
      SPILLWAY_FIELD_ERROR("tp", s.tp, "must divide the {} heads ({}) of {}", l.block_name(),
                           mixer_heads, r.model.name);
    }
    if (l.mlp.kind == MlpKind::kMoe && l.mlp.experts % s.ep != 0) {
      SPILLWAY_FIELD_ERROR("ep", s.ep, "must divide the routed experts ({}) of {}", l.mlp.experts,
                           r.model.name);
    }
  }
  if (s.ep > 1 && std::none_of(r.model.layers.begin(), r.model.layers.end(),
                               [](const LayerSpec& l) { return l.mlp.kind == MlpKind::kMoe; })) {
    SPILLWAY_FIELD_ERROR("ep", s.ep, "must be 1: {} has no MoE layers", r.model.name);
  }
  if (!(r.margin >= 0.0 && r.margin <= 10.0))
    SPILLWAY_FIELD_ERROR("margin", r.margin, "must be in [0, 10] (0.1 = 10%)");
  auto frac = [](const char* field, double v) {
    if (!(v > 0.0 && v <= 1.0)) SPILLWAY_FIELD_ERROR(field, v, "must be in (0, 1]");
  };
  frac("efficiency.gemm", r.efficiency.gemm);
  frac("efficiency.attention", r.efficiency.attention);
  frac("efficiency.hbm", r.efficiency.hbm);
  // Physical ranges: a value outside them would print absurd figures, not a plan.
  auto within = [](const char* field, const std::optional<double>& v, double lo, double hi) {
    if (v && !(*v >= lo && *v <= hi))
      SPILLWAY_FIELD_ERROR(field, *v, "must be in [{}, {}]", lo, hi);
  };
  within("d2h_gbps", r.d2h_gbps, L::kMinGbps, L::kMaxGbps);
  within("h2d_gbps", r.h2d_gbps, L::kMinGbps, L::kMaxGbps);
  within("hbm_budget_gb", r.hbm_budget_gb, L::kMinBudgetGb, L::kMaxBudgetGb);
  within("layer_fwd_ms", r.layer_fwd_ms, L::kMinLayerMs, L::kMaxLayerMs);
  if (r.layer_fwd_ms && !r.profile.empty()) {
    SPILLWAY_FIELD_ERROR("layer_fwd_ms", *r.layer_fwd_ms,
                         "must be unset when profile is given (both calibrate layer times)");
  }
  if (r.keep_last_layers < 1) {
    SPILLWAY_FIELD_ERROR("keep_last_layers", r.keep_last_layers,
                         "must be >= 1 (the last layer never offloads)");
  }
  if (r.keep_last_layers > layers) {
    SPILLWAY_FIELD_ERROR("keep_last_layers", r.keep_last_layers,
                         "must be <= the model's layers ({})", layers);
  }
  if (r.prefetch_depth < 1)
    SPILLWAY_FIELD_ERROR("prefetch_depth", r.prefetch_depth, "must be >= 1");
  if (r.prefetch_depth > L::kMaxPrefetchDepth)
    SPILLWAY_FIELD_ERROR("prefetch_depth", r.prefetch_depth, "must be in [1, {}]",
                         L::kMaxPrefetchDepth);
  if (r.zero < 0 || r.zero > 3) SPILLWAY_FIELD_ERROR("zero", r.zero, "must be 0, 1, 2 or 3");
  if (r.grad_offload && !r.optimizer_offload) {
    SPILLWAY_FIELD_ERROR("grad_offload", "true",
                         "needs optimizer_offload (gradients go to the optimizer on the host)");
  }
  within("cpu_adam_gbps", r.cpu_adam_gbps, L::kMinGbps, L::kMaxGbps);
  // Note [Named offload tensors]: the strategies that choose their own tensors refuse a set.
  if (!r.offload_tensors.empty()) {
    if (r.strategy == Policy::kSelective || r.strategy == Policy::kHybrid ||
        r.strategy == Policy::kCheckpoint) {
      SPILLWAY_FIELD_ERROR(
          "strategy", to_string(r.strategy),
          "chooses its own tensors; with offload_tensors use keep (the rest kept), recompute or "
          "offload (the rest recomputed by the block policy), or auto");
    }
    (void)resolve_offload_tensors(r.model, s, r.offload_tensors);
  }
  // Note [A model as PyTorch runs it]: one measured layer per layer of the model, measured
  // without tensor or context parallelism (the sizes are one GPU's of the whole sequence).
  if (!r.saved_as_run.empty()) {
    if (r.saved_as_run.size() != r.model.layers.size()) {
      SPILLWAY_FIELD_ERROR("saved", fmt::format("{} layers", r.saved_as_run.size()),
                           "must give one per layer of the model ({} layers)",
                           r.model.layers.size());
    }
    if (s.tp != 1 || s.cp != 1) {
      SPILLWAY_FIELD_ERROR("saved", fmt::format("tp={} cp={}", s.tp, s.cp),
                           "is measured on one GPU holding the whole sequence: plan it with tp=1 "
                           "and cp=1");
    }
    for (size_t l = 0; l < r.saved_as_run.size(); ++l) {
      const std::vector<SavedTensorBytes>& layer = r.saved_as_run[l];
      for (size_t a = 0; a < layer.size(); ++a) {
        const SavedTensorBytes& t = layer[a];
        if (t.name.empty())
          SPILLWAY_FIELD_ERROR("saved", fmt::format("layer {} tensor {}", l, a), "has no name");
        if (t.bytes < 0) {
          SPILLWAY_FIELD_ERROR("saved", fmt::format("layer {} \"{}\" {} bytes", l, t.name, t.bytes),
                               "must be >= 0");
        }
        for (size_t b = 0; b < a; ++b) {
          if (layer[b].name == t.name) {
            SPILLWAY_FIELD_ERROR("saved", fmt::format("layer {} \"{}\"", l, t.name),
                                 "is given twice; give each name once, its tensors summed");
          }
        }
      }
    }
  }
  if (r.loss_chunk < 0 || r.loss_chunk > L::kMaxLossChunk) {
    SPILLWAY_FIELD_ERROR("loss_chunk", r.loss_chunk, "must be in [0, {}] (0: the planner's choice)",
                         L::kMaxLossChunk);
  }
}

}  // namespace spillway::planner

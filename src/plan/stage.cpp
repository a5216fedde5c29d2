// The first pipeline stage the planner works on: its layers costed and calibrated, the
// per-GPU link rates, the training state's memory and time, the LM head and the budget.
//
// Note [Training state] (docs/planner.md): per GPU, P parameters (after TP, EP and PP
// divide them: TP splits every weight matrix, EP the routed experts, PP the layers) in
// mixed precision: weights 2 bytes (4 in fp32), gradients the same, and the optimizer's
// fp32 master weights and AdamW moments 12 bytes. Over the data-parallel group of N GPUs,
// ZeRO-1 shards the 12 optimizer bytes, ZeRO-2 also the gradients, ZeRO-3 (FSDP) also the
// weights; CP splits only the activations (the sequence). The shards' buffers are HBM too:
// ZeRO-3 gathers a whole layer before it runs and prefetches the next (2 x the largest
// layer's weights), and a gradient bucket is whole while it is reduce-scattered (ZeRO-2/3)
// or copied to the host (--grad-offload) while the next one is produced (2 x the largest
// layer's gradients). --optimizer offload moves the 12 bytes to host memory (plus a 2-byte
// landing buffer per parameter for the gradients) and steps them on the CPU; --grad-offload
// (with it) keeps no full gradient in HBM. The optimizer's time: on the device, 28 bytes
// of state traffic per parameter at HBM speed after backward; offloaded, each layer's
// bucket goes down, through the CPU AdamW at --cpu-adam-gbps and back up as backward hands
// it over (STV), the last-arriving layers stepped on the GPU when that ends sooner and
// their state fits (choose_device_buckets), and only the tail past backward's end is on
// the critical path.
//
// Note [Loss chunks]: the LM head's fp32 logits and their gradient take tokens x vocab x 8
// bytes (151,936 words x 16,384 tokens: ~20 GB). The loss is computed in chunks of C
// tokens: C x vocab x 8 bytes live at once, and each chunk's logits are recomputed in
// backward (one more head forward GEMM per micro-batch). --loss-chunk 0 lets the planner
// choose: unchunked when the logits take at most 2% of the HBM budget, else the largest
// power of two of tokens (at least 128) whose logits do.
#include <algorithm>

#include "plan/planner.hpp"
#include "spillway/core/error.hpp"

namespace spillway::planner {

namespace {

// Parameters of one layer on one GPU: experts split over ep * tp, the rest over tp.
int64_t layer_params_per_gpu(const LayerSpec& l, int64_t hidden, const ShardShape& s) {
  const int64_t all = layer_parameter_count(l, hidden);
  int64_t experts = 0;
  if (l.mlp.kind == MlpKind::kMoe) {
    LayerSpec none = l;
    none.mlp.experts = 0;
    experts = all - layer_parameter_count(none, hidden);
  }
  return (all - experts) / s.tp + experts / (s.ep * s.tp);
}

}  // namespace

Stage build_stage(const PlanRequest& r, Plan& plan) {
  const ShardShape& s = r.work.shape;
  Stage st;
  if (!r.offload_tensors.empty()) {
    st.offload_named = resolve_offload_tensors(r.model, s, r.offload_tensors);
    plan.offload_tensors = st.offload_named;
  }
  const int64_t total_layers = static_cast<int64_t>(r.model.layers.size());
  const int64_t n = (total_layers + r.work.pp - 1) / r.work.pp;
  // Cost each distinct layer spec once.
  std::vector<std::pair<LayerSpec, CostedLayer>> unique;
  for (int64_t i = 0; i < n; ++i) {
    const LayerSpec& spec = r.model.layers[static_cast<size_t>(i)];
    auto it =
        std::find_if(unique.begin(), unique.end(), [&](const auto& u) { return u.first == spec; });
    if (it == unique.end()) {
      unique.emplace_back(spec, cost_layer(spec, r.model.hidden, s, r.hardware, r.efficiency));
      it = unique.end() - 1;
    }
    st.layers.push_back(it->second);
    // Note [A model as PyTorch runs it]: the layer's saved tensors as measured.
    if (!r.saved_as_run.empty())
      apply_saved_as_run(st.layers.back(), r.saved_as_run[static_cast<size_t>(i)]);
  }

  // Calibration.
  plan.summary.calibration = "roofline";
  if (r.layer_fwd_ms) {
    // The repeating layer: the spec with the most layers in this stage.
    size_t best = 0;
    size_t best_count = 0;
    for (size_t u = 0; u < unique.size(); ++u) {
      const size_t count = static_cast<size_t>(
          std::count_if(st.layers.begin(), st.layers.end(),
                        [&](const CostedLayer& c) { return c.spec == unique[u].first; }));
      if (count > best_count) {
        best = u;
        best_count = count;
      }
    }
    const double factor = *r.layer_fwd_ms / unique[best].second.fwd_ms;
    for (CostedLayer& c : st.layers) scale_layer(c, factor, factor);
    plan.summary.time_scale = factor;
    plan.summary.calibration = "layer-fwd-ms";
  } else if (!r.profile.empty()) {
    std::vector<const LayerTiming*> by_index(static_cast<size_t>(n), nullptr);
    for (const LayerTiming& t : r.profile) {
      if (t.index < 0) {
        SPILLWAY_FIELD_ERROR("profile", fmt::format("layer index {}", t.index), "must be >= 0");
      }
      if (t.index >= n) {
        SPILLWAY_FIELD_ERROR("profile", fmt::format("layer index {}", t.index),
                             "must be < the layers of the first pipeline stage ({})", n);
      }
      by_index[static_cast<size_t>(t.index)] = &t;
    }
    for (int64_t i = 0; i < n; ++i) {
      const LayerTiming* t = by_index[static_cast<size_t>(i)];
      if (t == nullptr)
        SPILLWAY_FIELD_ERROR("profile", fmt::format("missing layer {}", i),
                             "give fwd_ms and bwd_ms for every layer");
      CostedLayer& c = st.layers[static_cast<size_t>(i)];
      scale_layer(c, t->fwd_ms / c.fwd_ms, t->bwd_ms / c.bwd_ms);
    }
    plan.summary.calibration = "profile";
  }

  // Link figures: per GPU, sharing the link with the GPUs behind it.
  const double d2h =
      r.d2h_gbps ? *r.d2h_gbps : r.hardware.d2h_typical.value / r.hardware.gpus_per_link;
  const double h2d =
      r.h2d_gbps ? *r.h2d_gbps : r.hardware.h2d_typical.value / r.hardware.gpus_per_link;
  plan.summary.d2h_gbps = d2h;
  plan.summary.h2d_gbps = h2d;
  st.d2h_bytes_per_ms = d2h * 1e6;
  st.h2d_bytes_per_ms = h2d * 1e6;
  st.margin = r.margin;
  st.mb_inflight = r.work.pp;  // 1F1B: the first stage holds pp micro-batches
  st.keep_last = r.keep_last_layers;
  st.prefetch = r.prefetch_depth;
  st.fp8 = s.dtype == DType::kFp8;

  // Static memory of the first stage: a shared block's weights (Zamba2) once, though each
  // layer using it gathers or streams them as its own (layer_params).
  int64_t params = 0;
  std::vector<int> shared_seen;
  for (int64_t i = 0; i < n; ++i) {
    const LayerSpec& l = r.model.layers[static_cast<size_t>(i)];
    st.layer_params.push_back(layer_params_per_gpu(l, r.model.hidden, s));
    params = checked_add(params, st.layer_params.back(), "parameters per GPU");
    if (l.shared_block < 0) continue;
    if (std::find(shared_seen.begin(), shared_seen.end(), l.shared_block) != shared_seen.end()) {
      params -= shared_block_parameter_count(l, r.model.hidden) / s.tp;
    } else {
      shared_seen.push_back(l.shared_block);
    }
  }
  const int64_t emb = checked_mul(r.model.vocab, r.model.hidden, "embedding size") / s.tp;
  params += emb;
  if (r.work.pp == 1 && !r.model.tied_embeddings) params += emb;
  // The final norm lives on the last stage (the only one at pp = 1), whole on every TP rank.
  if (r.work.pp == 1) params += r.model.hidden;
  plan.params_per_gpu = params;
  plan.params_total = parameter_count(r.model);
  // Note [Collectives in the plan].
  {
    const int64_t tokens = s.micro_batch * s.seq_len / s.cp;
    st.collectives.resize(static_cast<size_t>(n));
    st.comm_fwd_ms.assign(static_cast<size_t>(n), 0.0);
    st.comm_bwd_ms.assign(static_cast<size_t>(n), 0.0);
    for (size_t l = 0; l < static_cast<size_t>(n); ++l) {
      st.collectives[l] = layer_collectives(r, r.model.layers[l], st.layer_params[l], tokens);
      weave_exposed(st.collectives[l], st.layers[l], st.comm_fwd_ms[l], st.comm_bwd_ms[l]);
    }
    host_link_collectives(r, st);
    // Note [Forward paced by the gathers]: ZeRO-3's gathers run in every micro-batch;
    // ZeRO-1/2's only in the first, so with grad_accum > 1 the others (unpaced, the worse
    // for the windows) are the ones judged.
    st.gather_fwd_ms.assign(static_cast<size_t>(n), 0.0);
    st.gather_fwd_host.assign(static_cast<size_t>(n), 0);
    st.exposed_fwd.assign(static_cast<size_t>(n), {});
    for (size_t l = 0; l < static_cast<size_t>(n); ++l) {
      const CostedLayer& cl = st.layers[l];
      for (const CollectivePlan& c : st.collectives[l]) {
        if (c.backward) continue;
        if (c.exposed) {
          const int after = exposed_forward_position(
              c, cl.inv.ops.size(), [&](size_t k) { return std::string_view(cl.inv.ops[k].name); });
          st.exposed_fwd[l].emplace_back(after, c.ms);
        } else if (c.what == "zero.weight_gather" ||
                   (c.what == "zero.param_gather" && r.work.grad_accum == 1)) {
          st.gather_fwd_ms[l] += c.ms;
          if (c.link == "host") st.gather_fwd_host[l] = 1;
        }
      }
      std::stable_sort(st.exposed_fwd[l].begin(), st.exposed_fwd[l].end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
    }
  }

  // Note [Training state].
  const double budget_gb =
      r.hbm_budget_gb ? *r.hbm_budget_gb : r.hardware.hbm_gb * (1.0 - kHbmReserveFraction);
  st.budget = static_cast<int64_t>(budget_gb * 1e9);
  const int64_t wbytes = s.dtype == DType::kFp32 ? 4 : 2;
  const int64_t dp = r.work.dp;
  const auto shard = [&](int64_t bytes, int stage) {
    return r.zero >= stage ? (bytes + dp - 1) / dp : bytes;
  };
  TrainingStatePlan& ts = plan.summary.state;
  ts.zero = r.zero;
  ts.optimizer_offload = r.optimizer_offload;
  ts.grad_offload = r.grad_offload;
  ts.state_params = shard(params, 1);
  st.static_mem.weights = shard(checked_mul(params, wbytes, "weight bytes"), 3);
  st.static_mem.gradients =
      r.grad_offload ? 0 : shard(checked_mul(params, wbytes, "gradient bytes"), 2);
  const int64_t state_bytes = checked_mul(ts.state_params, 12, "optimizer bytes");
  st.static_mem.optimizer_states = r.optimizer_offload ? 0 : state_bytes;
  if (r.optimizer_offload) {
    ts.host_state_bytes = checked_add(
        state_bytes, checked_mul(ts.state_params, 2, "gradient bytes"), "optimizer bytes");
    ts.cpu_adam_gbps = r.cpu_adam_gbps.value_or(kDefaultCpuAdamGbps);
    ts.cpu_adam_assumed = !r.cpu_adam_gbps;
  }
  st.host_static = ts.host_state_bytes;
  int64_t largest = emb;
  for (int64_t p : st.layer_params) largest = std::max(largest, p);
  const int64_t largest_bytes = checked_mul(largest, wbytes, "weight bytes");
  if (r.zero >= 3 && dp > 1) st.static_mem.buffers += 2 * largest_bytes;
  if ((r.zero >= 2 && dp > 1) || r.grad_offload) st.static_mem.buffers += 2 * largest_bytes;
  st.static_bytes = st.static_mem.weights + st.static_mem.gradients +
                    st.static_mem.optimizer_states + st.static_mem.buffers;
  if (!r.optimizer_offload) {
    // The device AdamW after backward: 28 bytes of state traffic per parameter.
    ts.optimizer_total_ms = static_cast<double>(ts.state_params) * 28.0 /
                            (r.hardware.hbm_tbps * r.efficiency.hbm * 1e12) * 1e3;
    ts.optimizer_ms = ts.optimizer_total_ms;
  }

  // Note [Loss chunks].
  const int64_t T = s.micro_batch * s.seq_len / s.cp;
  plan.tokens_per_gpu = T;
  const int64_t vocab_shard = (r.model.vocab + s.tp - 1) / s.tp;
  const int64_t per_token = checked_mul(vocab_shard, 8, "logits size");
  int64_t chunk = r.loss_chunk;
  if (chunk == 0) {
    const int64_t cap = st.budget / 50;
    chunk = T;
    if (checked_mul(T, per_token, "logits size") > cap) {
      chunk = 128;
      while (chunk * 2 <= T && chunk * 2 * per_token <= cap) chunk *= 2;
    }
  }
  chunk = std::min(chunk, T);
  ts.loss_chunk_tokens = chunk;
  if (r.work.pp == 1) st.logits_bytes = checked_mul(chunk, per_token, "logits size");
  const double head_flops = 2.0 * static_cast<double>(T) * static_cast<double>(r.model.hidden) *
                            static_cast<double>(vocab_shard);
  const int64_t head_bytes =
      checked_mul(checked_mul(T, vocab_shard, "logits size"), 4, "logits size");
  const double head_fwd_ms = r.work.pp == 1 ? op_time_ms(OpKind::kGemm, head_flops, head_bytes,
                                                         r.hardware, s.dtype, r.efficiency) *
                                                  plan.summary.time_scale
                                            : 0.0;
  ts.loss_recompute_ms = chunk < T ? head_fwd_ms : 0.0;
  st.head_ms = 3.0 * head_fwd_ms + ts.loss_recompute_ms;
  plan.summary.hbm_budget_bytes = st.budget;
  plan.summary.head_ms = st.head_ms;
  plan.summary.logits_bytes = st.logits_bytes;
  plan.summary.gpus_per_link = r.hardware.gpus_per_link;
  return st;
}

}  // namespace spillway::planner

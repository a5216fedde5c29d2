// The planner: options per layer, a global choice under the HBM budget, and a timeline
// that judges the choice (snowball, stalls, peak memory, step time).
//
// Note [Forward window]: layer l's offloaded tensors are copied by the D2H engine in
// production order (a tensor can start when its producing op ends and the engine is
// free, carrying over the previous layer's backlog); they must all be copied by the end
// of layer l+1's forward, at the bandwidth derated by the margin: bytes / (B / (1 +
// margin)). This is the no-snowball condition (docs/offload.md) V_l / B_d2h <= T_fwd(l+1), extended
// to tensors produced earlier in the layer (which start earlier: the reason selective
// offload spreads transfers over the attention and MLP phases).
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
//
// Note [FP8 recompute] (docs/planner.md): with fp8 GEMMs (--dtype fp8: GEMMs at the fp8
// peak, activations saved in fp8), a recomputed GEMM must run with the scaling state its
// forward used: delayed scaling derives each step's scales from an amax history, and a
// recompute that updated or re-derived it would produce different fp8 values and a wrong
// gradient. So a layer that recomputes fp8 GEMMs keeps that state, per GEMM an amax
// history of kFp8AmaxHistory steps for its three fp8 operands and their scales
// (kFp8ScalingStateBytesPerGemm), counted with its kept activations, and the plan names
// how many GEMMs of each layer it covers; the recompute must not step the history.
//
// Note [Peak memory]: at the start of backward the device holds every layer's kept
// tensors (times the micro-batches in flight: pp for the first 1F1B stage), plus either
// the logits and their gradient (fp32) or, while a layer runs backward, its re-
// materialized tensors (reloaded + recomputed); plus the copies in flight (the prefetched
// reloads, prefetch_depth layers, or the D2H backlog if the forward outran the link).
#include <algorithm>
#include <bit>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>

#include "core/json_io.hpp"
#include "plan/cost_model.hpp"
#include "spillway/collectives.hpp"
#include "spillway/error.hpp"
#include "spillway/plan.hpp"

namespace spillway {

std::vector<LayerTiming> load_profile(const std::string& path) {
  const Json doc = load_json_file(path, "profile");
  JsonObject root(doc, "profile", path);
  if (root.has("schema") && root.req_str("schema") != "spillway.profile/1") {
    root.fail("schema",
              fmt::format("is \"{}\"; must be \"spillway.profile/1\"", root.req_str("schema")));
  }
  std::vector<LayerTiming> out;
  for (const JsonObject& l : root.obj_array("layers")) {
    LayerTiming t;
    t.index = static_cast<int>(l.req_int("index", 0, 1000000));
    t.fwd_ms = l.req_num("fwd_ms", 1e-9, 1e9);
    t.bwd_ms = l.req_num("bwd_ms", 1e-9, 1e9);
    out.push_back(t);
  }
  if (out.empty() && !root.has("ops")) {
    root.fail("layers", "is missing or empty; give one entry per layer (or measured \"ops\")");
  }
  return out;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr const char* kBytesWhat =
    "plan: the memory total (micro-batch * seq-len * widths * layers)";
constexpr size_t kMaxKnapsackGroups = 14;

struct Option {
  Policy policy = Policy::kKeep;
  std::vector<Action> actions;
  ActionCost cost;
};

struct Stage {
  std::vector<CostedLayer> layers;
  double d2h_bytes_per_ms = 0.0;  // real per-GPU bandwidth
  double h2d_bytes_per_ms = 0.0;
  double margin = 0.1;
  int64_t mb_inflight = 1;
  int64_t static_bytes = 0;  // weights + gradients + optimizer states + buffers
  MemoryBreakdown static_mem;
  int64_t host_static = 0;  // optimizer state and gradients in host memory
  int64_t logits_bytes = 0;
  double head_ms = 0.0;  // LM head + loss, forward and backward
  int64_t budget = 0;
  int keep_last = 1;
  int prefetch = 1;
  bool fp8 = false;                   // Note [FP8 recompute]
  std::vector<int64_t> layer_params;  // per GPU
  std::vector<std::vector<CollectivePlan>>
      collectives;                  // per layer (Note [Collectives in the plan])
  std::vector<double> comm_fwd_ms;  // exposed collectives in a layer's forward
  std::vector<double> comm_bwd_ms;  // and before its backward
  // Host-link collectives running beside the copies (Note [The host link is shared]): ms of
  // ring issued as layer l's forward starts, and as its backward starts.
  std::vector<double> host_comm_fwd_ms;
  std::vector<double> host_comm_bwd_ms;
};

// Note [Collectives in the plan]: per layer, the collectives its parallelism needs
// (docs/collectives.md), with ranks laid out tp fastest, then cp, ep
// and dp (a group's members are spaced by the product of the faster sizes):
//   - tp > 1 (Megatron with sequence parallelism): an all-gather and a reduce-scatter of
//     the T x d activation around attention and around the MLP, forward and backward;
//     exposed (they feed the next GEMM);
//   - ep > 1: the MoE dispatch and combine all-to-alls of T x top_k / tp rows of d,
//     forward and backward; exposed;
//   - dp > 1: the layer's gradients after its backward (an all-reduce at ZeRO 0; a
//     reduce-scatter at 1-3, each GPU stepping its shard, as Megatron's distributed
//     optimizer does: with the gather of the updated weights it moves what one all-reduce
//     moves), once per step (the last micro-batch); at ZeRO 3 the layer's
//     weights gathered before its forward and again before its backward; at ZeRO 1-2 the
//     updated weights gathered once per step, in the first micro-batch's forward. These
//     overlap compute on one communication stream per GPU, in issue order, as the
//     simulator runs them (overlapped_delay): a layer waits for its gathered weights, and
//     the step's end for the last gradient reduction; what they do not hide is on the
//     critical path.
// Each is ring_ms over collective_link (spillway/collectives.hpp). The exposed ones sit
// where the simulator puts them (Note [Collectives in the simulator]): a dispatch after
// the op moe.dispatch, a combine before moe.combine, the others at the end of the forward,
// the backward ones before the layer's backward; the timeline waits for them, so they
// widen the forward windows and delay the tensors produced after them. Not modelled: CP's
// key/value exchange and pipeline sends. Host-link collectives share the link with the
// offload copies (Note [The host link is shared]).
std::vector<CollectivePlan> layer_collectives(const PlanRequest& r, const LayerSpec& spec,
                                              int64_t params, int64_t T) {
  const ShardShape& s = r.work.shape;
  const double lat = r.hardware.interconnect.collective_latency_us;
  const int64_t bytes = s.dtype == DType::kFp32 ? 4 : 2;
  const int64_t d = r.model.hidden;
  std::vector<CollectivePlan> out;
  auto add = [&](CollectiveKind k, const char* what, bool backward, int64_t b, int64_t group,
                 const CollectiveLink& link, bool exposed) {
    if (group <= 1 || b <= 0) return;
    CollectivePlan c = make_collective(k, what, backward, b, group, link, lat);
    c.exposed = exposed;
    out.push_back(std::move(c));
  };
  const char* what = "collective bytes";
  const int64_t tokens = checked_mul(checked_mul(T, d, what), bytes, what);
  for (bool bwd : {false, true}) {
    if (s.tp > 1) {
      const CollectiveLink tp = collective_link(r.hardware, s.tp, 1);
      add(CollectiveKind::kAllGather, "tp.attn_gather", bwd, tokens, s.tp, tp, true);
      add(CollectiveKind::kReduceScatter, "tp.attn_scatter", bwd, tokens, s.tp, tp, true);
      add(CollectiveKind::kAllGather, "tp.mlp_gather", bwd, tokens, s.tp, tp, true);
      add(CollectiveKind::kReduceScatter, "tp.mlp_scatter", bwd, tokens, s.tp, tp, true);
    }
    if (spec.mlp.kind == MlpKind::kMoe && s.ep > 1) {
      const CollectiveLink ep = collective_link(r.hardware, s.ep, s.tp * s.cp);
      const int64_t rows = checked_mul(T, spec.mlp.top_k, what) / s.tp;
      const int64_t b = checked_mul(checked_mul(rows, d, what), bytes, what);
      add(CollectiveKind::kAllToAll, "ep.dispatch", bwd, b, s.ep, ep, true);
      add(CollectiveKind::kAllToAll, "ep.combine", bwd, b, s.ep, ep, true);
    }
  }
  if (r.work.dp > 1) {
    const CollectiveLink dp = collective_link(r.hardware, r.work.dp, s.tp * s.cp * s.ep);
    const int64_t layer = checked_mul(params, bytes, what);
    if (r.zero >= 3) {
      add(CollectiveKind::kAllGather, "zero.weight_gather", false, layer, r.work.dp, dp, false);
      add(CollectiveKind::kAllGather, "zero.weight_gather", true, layer, r.work.dp, dp, false);
    } else if (r.zero >= 1) {
      add(CollectiveKind::kAllGather, "zero.param_gather", false, layer, r.work.dp, dp, false);
    }
    add(r.zero >= 1 ? CollectiveKind::kReduceScatter : CollectiveKind::kAllReduce, "dp.grad_reduce",
        true, layer, r.work.dp, dp, false);
  }
  return out;
}

// Weaves a layer's exposed collectives into its timing (Note [Collectives in the plan]):
// the forward ones delay every tensor produced after them and lengthen the forward.
void weave_exposed(const std::vector<CollectivePlan>& cs, CostedLayer& c, double& fwd_extra,
                   double& bwd_extra) {
  fwd_extra = 0.0;
  bwd_extra = 0.0;
  for (const CollectivePlan& col : cs) {
    if (!col.exposed) continue;
    if (col.backward) {
      bwd_extra += col.ms;
      continue;
    }
    // The delay applies to the ops after this one.
    const int after = exposed_forward_position(
        col, c.inv.ops.size(), [&](size_t k) -> std::string_view { return c.inv.ops[k].name; });
    fwd_extra += col.ms;
    for (size_t t = 0; t < c.inv.tensors.size(); ++t) {
      if (c.inv.tensors[t].producer > after) c.produced_at_ms[t] += col.ms;
    }
  }
}

// Note [The host link is shared]: a collective on the "host" link (docs/collectives.md)
// runs through the root complex the offload copies use, in both directions, and the link
// is shared fairly between what runs on it, as the simulator shares it. Two transfers that
// start together and would take c and x ms alone both run at half rate until the shorter
// ends: the longer ends at max(c, x) + min(c, x), the shorter at 2 min(c, x), both having
// lost min(c, x) (shared_link_ms). The planner applies this per window:
//   - the ring issued as layer l's forward starts (the weight gather of layer l + 1: ZeRO-3
//     every micro-batch, ZeRO-1/2 in one micro-batch of grad_accum) beside layer l's D2H
//     copies: the copies run at rate x / (x + min(c, x)) of the link (forward_copy_rate),
//     which the forward window judges; the ring runs min(c, x) longer (overlapped_delay);
//   - the rings issued as layer l's backward starts (the weight gather of layer l - 1, the
//     gradient reduction of layer l + 1 in one micro-batch of grad_accum) beside the
//     reloads issued then, the same way.
// The ring issued before layer 0 and the reductions after the last backward find no
// copies. Exposed collectives (all-to-alls) are on the critical path already and are not
// shared here. Not modelled: copies that spill from one window into the next (a backlog)
// sharing with the next window's ring.
double shared_link_ms(double own_ms, double other_ms) {
  return own_ms + std::min(own_ms, other_ms);
}

void host_link_collectives(const PlanRequest& r, Stage& st) {
  const size_t n = st.collectives.size();
  const double per_mb = 1.0 / static_cast<double>(r.work.grad_accum);
  st.host_comm_fwd_ms.assign(n, 0.0);
  st.host_comm_bwd_ms.assign(n, 0.0);
  for (size_t l = 0; l < n; ++l) {
    for (const CollectivePlan& c : st.collectives[l]) {
      if (c.link != "host" || c.exposed) continue;
      if (c.what == "zero.weight_gather" && !c.backward) {
        if (l > 0) st.host_comm_fwd_ms[l - 1] += c.ms;
      } else if (c.what == "zero.param_gather") {
        if (l > 0) st.host_comm_fwd_ms[l - 1] += c.ms * per_mb;
      } else if (c.what == "zero.weight_gather") {
        if (l + 1 < n) st.host_comm_bwd_ms[l + 1] += c.ms;
      } else if (c.what == "dp.grad_reduce") {
        if (l > 0) st.host_comm_bwd_ms[l - 1] += c.ms * per_mb;
      }
    }
  }
}

// Throws spillway::InputError, naming the field, on a request no plan can be made for
// (sizes, divisibility, ranges).
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
    if (l.mixer == MixerKind::kAttention && l.attn.heads % s.tp != 0) {
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
  if (r.loss_chunk < 0 || r.loss_chunk > L::kMaxLossChunk) {
    SPILLWAY_FIELD_ERROR("loss_chunk", r.loss_chunk, "must be in [0, {}] (0: the planner's choice)",
                         L::kMaxLossChunk);
  }
}

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

// The first pipeline stage: its layers costed once per distinct spec and calibrated, the
// per-GPU link rates, static memory, the LM head and the budget (also set in plan.summary).
Stage build_stage(const PlanRequest& r, Plan& plan) {
  const ShardShape& s = r.work.shape;
  Stage st;
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

  // Static memory of the first stage.
  int64_t params = 0;
  for (int64_t i = 0; i < n; ++i) {
    st.layer_params.push_back(
        layer_params_per_gpu(r.model.layers[static_cast<size_t>(i)], r.model.hidden, s));
    params = checked_add(
        params, layer_params_per_gpu(r.model.layers[static_cast<size_t>(i)], r.model.hidden, s),
        "parameters per GPU");
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

// ---- options of one layer ------------------------------------------------------------

Option make_option(const CostedLayer& c, Policy p, std::vector<Action> actions) {
  Option o;
  o.policy = p;
  o.cost = evaluate_actions(c, actions);
  o.actions = std::move(actions);
  return o;
}

// The MLP's saved outputs the offload policy moves: with them (and, in an MoE layer, the
// experts' down-projection output that the combine's backward reads) on the host, no MLP
// GEMM runs again in backward.
bool is_mlp_tensor(const std::string& n) {
  return n == "mlp.gate_out" || n == "mlp.up_out" || n == "mlp.act" || n == "moe.expert_out";
}

struct OptionSet {
  Option keep, recompute, offload, hybrid, selective_recompute, selective_keep, checkpoint;
  bool can_offload = false;
};

// Forward deadline of layer l alone (engine free at its start): end of layer l+1.
double standalone_deadline(const Stage& st, size_t l) {
  return st.layers[l].fwd_ms + st.comm_fwd_ms[l] + st.layers[l + 1].fwd_ms + st.comm_fwd_ms[l + 1];
}

// The bytes layer l may move at the derated rate: in steady state the engine has one
// next-layer forward per layer (the no-snowball condition, docs/offload.md: V_l / B_d2h <=
// T_fwd(l+1)), whatever the production times.
double standalone_capacity_bytes(const Stage& st, size_t l) {
  return st.d2h_bytes_per_ms / (1.0 + st.margin) *
         (st.layers[l + 1].fwd_ms + st.comm_fwd_ms[l + 1]);
}

// Builds the options a strategy can use (the knapsack only where it is needed).
OptionSet build_options(const Stage& st, size_t l, Policy strategy) {
  const bool need_hybrid = strategy == Policy::kAuto || strategy == Policy::kHybrid;
  const bool need_selective = strategy == Policy::kAuto || strategy == Policy::kSelective;
  const CostedLayer& c = st.layers[l];
  OptionSet os;
  const size_t nt = c.inv.tensors.size();
  os.keep = make_option(c, Policy::kKeep, std::vector<Action>(nt, Action::kKeep));
  const std::vector<Action> rec = recompute_actions(c);
  os.recompute = make_option(c, Policy::kRecompute, rec);
  if (strategy == Policy::kCheckpoint)
    os.checkpoint = make_option(c, Policy::kCheckpoint, checkpoint_actions(c));
  os.can_offload = l + static_cast<size_t>(st.keep_last) < st.layers.size();
  if (!os.can_offload) return os;

  std::vector<Action> off = rec;
  for (size_t i = 0; i < nt; ++i) {
    if (c.inv.tensors[i].saved && is_mlp_tensor(c.inv.tensors[i].name)) off[i] = Action::kOffload;
  }
  os.offload = make_option(c, Policy::kOffload, off);

  const double rate = st.d2h_bytes_per_ms / (1.0 + st.margin);
  const double deadline = standalone_deadline(st, l);
  const double capacity = standalone_capacity_bytes(st, l);

  // Hybrid: offload GEMM/attention outputs that the block policy would recompute, most
  // expensive per byte first, while they fit the window; recompute the cheap rest.
  if (need_hybrid) {
    std::vector<size_t> cand;
    for (size_t i = 0; i < nt; ++i) {
      const TensorInfo& t = c.inv.tensors[i];
      if (!t.saved || rec[i] != Action::kRecompute || t.producer < 0 || t.bytes == 0) continue;
      if (c.inv.ops[static_cast<size_t>(t.producer)].kind == OpKind::kMemory) continue;
      cand.push_back(i);
    }
    std::stable_sort(cand.begin(), cand.end(), [&](size_t a, size_t b) {
      const auto& ta = c.inv.tensors[a];
      const auto& tb = c.inv.tensors[b];
      return c.op_fwd_ms[static_cast<size_t>(ta.producer)] / static_cast<double>(ta.bytes) >
             c.op_fwd_ms[static_cast<size_t>(tb.producer)] / static_cast<double>(tb.bytes);
    });
    std::vector<Action> hyb = rec;
    for (size_t i : cand) {
      hyb[i] = Action::kOffload;
      if (static_cast<double>(evaluate_actions(c, hyb).offload_bytes) > capacity ||
          copy_finish_ms(c, hyb, rate, 0.0, nullptr) > deadline) {
        hyb[i] = Action::kRecompute;
      }
    }
    os.hybrid = make_option(c, Policy::kHybrid, hyb);
  }

  // Selective: an exhaustive knapsack over groups of tensors, a group being the saved
  // outputs of one op (offloading half of an op's outputs saves no recompute), at most
  // kMaxKnapsackGroups of the largest; two variants: the rest recomputed by the block
  // policy (minimize recompute time, then kept bytes) or the rest kept (maximize bytes
  // offloaded). Both must fit the window (capacity and deadline).
  if (need_selective) {
    std::vector<std::vector<size_t>> groups;
    std::vector<int64_t> group_bytes;
    std::vector<double> group_time;  // production time of the group
    for (int op = -1; op < static_cast<int>(c.inv.ops.size()); ++op) {
      std::vector<size_t> g;
      int64_t bytes = 0;
      for (size_t i = 0; i < nt; ++i) {
        const TensorInfo& t = c.inv.tensors[i];
        if (t.saved && t.producer == op && t.bytes > 0) {
          g.push_back(i);
          bytes += t.bytes;
        }
      }
      if (g.empty()) continue;
      groups.push_back(std::move(g));
      group_bytes.push_back(bytes);
      group_time.push_back(c.produced_at_ms[groups.back().front()]);
    }
    // Keep the largest groups, in production order.
    if (groups.size() > kMaxKnapsackGroups) {
      std::vector<size_t> idx(groups.size());
      for (size_t k = 0; k < idx.size(); ++k) idx[k] = k;
      std::stable_sort(idx.begin(), idx.end(),
                       [&](size_t x, size_t y) { return group_bytes[x] > group_bytes[y]; });
      idx.resize(kMaxKnapsackGroups);
      std::sort(idx.begin(), idx.end());
      std::vector<std::vector<size_t>> g2;
      std::vector<int64_t> b2;
      std::vector<double> t2;
      for (size_t k : idx) {
        g2.push_back(groups[k]);
        b2.push_back(group_bytes[k]);
        t2.push_back(group_time[k]);
      }
      groups = std::move(g2);
      group_bytes = std::move(b2);
      group_time = std::move(t2);
    }

    Option best_r = os.recompute;
    best_r.policy = Policy::kSelective;
    Option best_k = os.keep;
    best_k.policy = Policy::kSelective;
    int64_t best_k_bytes = 0;
    uint32_t best_k_mask = 0;
    std::vector<Action> trial(nt);
    const uint32_t limit = 1u << groups.size();
    for (uint32_t mask = 1; mask < limit; ++mask) {
      double t = 0.0;
      int64_t bytes = 0;
      for (size_t k = 0; k < groups.size(); ++k) {
        if (!(mask >> k & 1u)) continue;
        t = std::max(t, group_time[k]) + static_cast<double>(group_bytes[k]) / rate;
        bytes += group_bytes[k];
      }
      if (t > deadline || static_cast<double>(bytes) > capacity) continue;
      if (bytes > best_k_bytes) {
        best_k_bytes = bytes;
        best_k_mask = mask;
      }
      trial = rec;
      for (size_t k = 0; k < groups.size(); ++k) {
        if (!(mask >> k & 1u)) continue;
        for (size_t i : groups[k]) trial[i] = Action::kOffload;
      }
      const ActionCost ac = evaluate_actions(c, trial);
      if (!ac.valid) continue;
      const bool better = ac.recompute_ms < best_r.cost.recompute_ms - 1e-12 ||
                          (ac.recompute_ms <= best_r.cost.recompute_ms + 1e-12 &&
                           ac.kept_bytes < best_r.cost.kept_bytes);
      if (better) {
        best_r.actions = trial;
        best_r.cost = ac;
      }
    }
    if (best_k_mask != 0) {
      std::vector<Action> keep_rest(nt, Action::kKeep);
      for (size_t k = 0; k < groups.size(); ++k) {
        if (!(best_k_mask >> k & 1u)) continue;
        for (size_t i : groups[k]) keep_rest[i] = Action::kOffload;
      }
      best_k = make_option(c, Policy::kSelective, std::move(keep_rest));
    }
    os.selective_recompute = best_r;
    os.selective_keep = best_k;
  }
  return os;
}

// ---- the timeline of a choice ----------------------------------------------------------

struct Timeline {
  std::vector<LayerPlan> layers;
  double fwd_ms = 0.0;
  double step_ms = 0.0;  // one micro-batch
  double stall_ms = 0.0;
  int64_t max_backlog = 0;
  MemoryBreakdown peak;
  int64_t host_pinned = 0;
  std::vector<size_t> snowball_layers;
};

// `detail` fills the per-tensor report; the budget search only needs the totals.
Timeline run_timeline(const Stage& st, const std::vector<const Option*>& choice,
                      const std::vector<double>& recompute_policy_ms, bool detail) {
  const size_t n = st.layers.size();
  Timeline tl;
  tl.layers.resize(n);
  std::vector<double> start(n + 1, 0.0);
  for (size_t l = 0; l < n; ++l) start[l + 1] = start[l] + st.layers[l].fwd_ms + st.comm_fwd_ms[l];
  tl.fwd_ms = start[n];

  // Forward D2H: FIFO across layers, once at the real rate (timeline, backlog) and once
  // derated by the margin (the feasibility judgement). See Note [Forward window].
  const double rate_real = st.d2h_bytes_per_ms;
  const double rate_margin = st.d2h_bytes_per_ms / (1.0 + st.margin);
  double free_real = 0.0;
  double free_margin = 0.0;
  std::vector<double> d2h_done(n, 0.0);
  struct Copy {
    double produced, begin, end;
    int64_t bytes;
  };
  std::vector<Copy> copies;
  for (size_t l = 0; l < n; ++l) {
    const CostedLayer& c = st.layers[l];
    const Option& o = *choice[l];
    LayerPlan& lp = tl.layers[l];
    lp.offload_bytes = o.cost.offload_bytes;
    if (o.cost.offload_bytes == 0) continue;
    // The host-link ring issued as this layer starts takes its share of the link (Note
    // [The host link is shared]).
    const double alone = static_cast<double>(o.cost.offload_bytes) / rate_real;
    const double share = alone / shared_link_ms(alone, st.host_comm_fwd_ms[l]);
    const double rate_real_l = rate_real * share;
    const double fin_margin =
        copy_finish_ms(c, o.actions, rate_margin * share, free_margin - start[l], nullptr) +
        start[l];
    free_margin = fin_margin;
    // Real-rate copies, recorded for the backlog.
    std::vector<size_t> order;
    for (size_t i = 0; i < o.actions.size(); ++i) {
      if (c.inv.tensors[i].saved && o.actions[i] == Action::kOffload) order.push_back(i);
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return c.produced_at_ms[a] < c.produced_at_ms[b]; });
    for (size_t i : order) {
      const double produced = start[l] + c.produced_at_ms[i];
      const double b = std::max(free_real, produced);
      const double e = b + static_cast<double>(c.inv.tensors[i].bytes) / rate_real_l;
      copies.push_back({produced, b, e, c.inv.tensors[i].bytes});
      free_real = e;
    }
    d2h_done[l] = free_real;
    const double deadline = start[std::min(l + 2, n)];
    lp.d2h_ms = static_cast<double>(o.cost.offload_bytes) / rate_real_l;
    // The layer's own window: from its first offloaded tensor to the end of the next
    // forward (what it would have with an idle engine); lateness includes the backlog.
    lp.window_ms = deadline - (start[l] + c.produced_at_ms[order.front()]);
    lp.margin = lp.window_ms / lp.d2h_ms - 1.0;
    lp.late_ms = std::max(0.0, fin_margin - deadline);
    if (fin_margin > deadline + 1e-9) {
      lp.snowball = true;
      tl.snowball_layers.push_back(l);
    }
  }
  // Backlog at the end of each layer's forward (real rate): bytes of tensors that exist
  // but are not yet on the host, counting the unfinished part of a running copy. Copies
  // are in FIFO order, so production, begin and end times all increase along the list:
  // at boundary t the pending copies are a contiguous range [done, produced).
  // Only the first of them can be running (one engine), so prefix sums give each
  // boundary in O(1).
  {
    std::vector<double> prefix(copies.size() + 1, 0.0);
    for (size_t k = 0; k < copies.size(); ++k)
      prefix[k + 1] = prefix[k] + static_cast<double>(copies[k].bytes);
    size_t done = 0;
    size_t produced = 0;
    for (size_t l = 0; l < n; ++l) {
      const double t = start[l + 1];
      while (done < copies.size() && copies[done].end <= t) ++done;
      while (produced < copies.size() && copies[produced].produced <= t) ++produced;
      double pending = 0.0;
      if (produced > done) {
        pending = prefix[produced] - prefix[done];
        const Copy& cp = copies[done];
        if (cp.begin < t)
          pending -= static_cast<double>(cp.bytes) * (t - cp.begin) / (cp.end - cp.begin);
      }
      tl.layers[l].backlog_bytes = static_cast<int64_t>(pending);
    }
  }
  for (const LayerPlan& lp : tl.layers) tl.max_backlog = std::max(tl.max_backlog, lp.backlog_bytes);

  // Backward: layers in reverse; reload of layer l issued when layer l + prefetch starts
  // its backward (or at the start of backward), never before its offload finished.
  double t = tl.fwd_ms + st.head_ms;
  std::vector<double> bwd_start(n, 0.0);
  double h2d_free = 0.0;
  std::vector<double> reload_done(n, 0.0);
  std::vector<char> issued(n, 0);
  // The reloads issued as a layer's backward starts share the link with the host-link
  // rings issued then (Note [The host link is shared]): `ring` ms of them are left.
  std::vector<double> reload_ms(n, 0.0);
  auto issue = [&](size_t l, double now, double& ring) {
    if (issued[l] || choice[l]->cost.offload_bytes == 0) return;
    issued[l] = 1;
    const double b = std::max({h2d_free, now, d2h_done[l]});
    const double alone = static_cast<double>(choice[l]->cost.offload_bytes) / st.h2d_bytes_per_ms;
    reload_ms[l] = shared_link_ms(alone, ring);
    ring -= std::min(ring, alone);
    h2d_free = b + reload_ms[l];
    reload_done[l] = h2d_free;
  };
  for (size_t l = n; l-- > 0;) {
    // When layer l starts its backward, its own reload (if not yet issued: the first
    // layers of backward) and those of the next `prefetch` layers are issued.
    double ring = st.host_comm_bwd_ms[l];
    for (size_t k = 0; k <= static_cast<size_t>(st.prefetch) && k <= l; ++k) issue(l - k, t, ring);
    bwd_start[l] = t;
    const Option& o = *choice[l];
    const double ready = o.cost.offload_bytes > 0 ? reload_done[l] : t;
    const double stall = std::max(0.0, ready - t);
    LayerPlan& lp = tl.layers[l];
    lp.stall_ms = stall;
    lp.h2d_ms = reload_ms[l];
    tl.stall_ms += stall;
    t += stall + o.cost.recompute_ms + st.comm_bwd_ms[l] + st.layers[l].bwd_ms;
  }
  tl.step_ms = t;

  // Per-layer report fields and memory (Note [Peak memory]).
  int64_t kept = 0;
  int64_t working = 0;
  int64_t max_offload = 0;
  for (size_t l = 0; l < n; ++l) {
    const CostedLayer& c = st.layers[l];
    const Option& o = *choice[l];
    LayerPlan& lp = tl.layers[l];
    lp.index = static_cast<int>(l);
    lp.block = c.spec.block_name();
    lp.policy = o.policy;
    lp.kept_bytes = o.cost.kept_bytes;
    lp.params = st.layer_params[l];
    lp.rematerialized_bytes = o.cost.rematerialized_bytes;
    if (st.fp8) {  // Note [FP8 recompute]
      uint64_t gemms = 0;
      for (size_t i = 0; i < c.inv.tensors.size(); ++i) {
        const TensorInfo& ti = c.inv.tensors[i];
        if (ti.saved && o.actions[i] == Action::kRecompute && ti.producer >= 0 &&
            c.inv.ops[static_cast<size_t>(ti.producer)].kind == OpKind::kGemm)
          gemms |= uint64_t{1} << ti.producer;
      }
      lp.fp8_recomputed_gemms = std::popcount(gemms);
      lp.fp8_scaling_state_bytes = lp.fp8_recomputed_gemms * kFp8ScalingStateBytesPerGemm;
      kept = checked_add(kept, lp.fp8_scaling_state_bytes, kBytesWhat);
    }
    lp.fwd_ms = c.fwd_ms;
    lp.bwd_ms = c.bwd_ms;
    if (detail) lp.collectives = st.collectives[l];
    for (size_t k = 0; k < c.inv.ops.size(); ++k) {
      const OpCost& op = c.inv.ops[k];
      lp.fwd_flops += op.fwd_flops;
      lp.bwd_flops += op.bwd_flops;
      lp.fwd_bytes = checked_add(lp.fwd_bytes, op.fwd_bytes, kBytesWhat);
      lp.bwd_bytes = checked_add(lp.bwd_bytes, op.bwd_bytes, kBytesWhat);
      if (detail) {
        lp.ops.push_back({op.name, op.kind, op.fwd_flops, op.fwd_bytes, op.bwd_flops, op.bwd_bytes,
                          c.op_fwd_ms[k], c.op_bwd_ms[k]});
      }
    }
    lp.recompute_ms = o.cost.recompute_ms;
    lp.recompute_avoided_ms = recompute_policy_ms[l] - o.cost.recompute_ms;
    for (size_t i = 0; detail && i < c.inv.tensors.size(); ++i) {
      const TensorInfo& ti = c.inv.tensors[i];
      if (!ti.saved) continue;
      TensorPlan tp;
      tp.name = ti.name;
      tp.shape = ti.shape;
      tp.dtype = ti.dtype;
      tp.bytes = ti.bytes;
      tp.action = o.actions[i];
      tp.recompute_ms = ti.producer >= 0 ? c.op_fwd_ms[static_cast<size_t>(ti.producer)] : 0.0;
      tp.recompute_flops =
          ti.producer >= 0 ? c.inv.ops[static_cast<size_t>(ti.producer)].fwd_flops : 0.0;
      tp.produced_at_ms = c.produced_at_ms[i];
      tp.producer = ti.producer;
      lp.tensors.push_back(std::move(tp));
    }
    kept = checked_add(kept, o.cost.kept_bytes, kBytesWhat);
    working = std::max(working, o.cost.rematerialized_bytes);
    max_offload = std::max(max_offload, o.cost.offload_bytes);
    tl.host_pinned = checked_add(tl.host_pinned, o.cost.offload_bytes, kBytesWhat);
  }
  tl.host_pinned = checked_add(checked_mul(tl.host_pinned, st.mb_inflight, kBytesWhat),
                               st.host_static, kBytesWhat);
  tl.peak = st.static_mem;
  // The peak is while the head runs (the logits) or in a layer's backward (its
  // re-materialized set), whichever holds more.
  tl.peak.activations = checked_mul(kept, st.mb_inflight, kBytesWhat);
  if (st.logits_bytes > working) {
    tl.peak.logits = st.logits_bytes;
  } else {
    tl.peak.activations = checked_add(tl.peak.activations, working, kBytesWhat);
  }
  tl.peak.in_flight_copies =
      std::max(checked_mul(max_offload, st.prefetch, kBytesWhat), tl.max_backlog);
  // The total must fit too (MemoryBreakdown::total() adds without checks).
  (void)checked_add(
      checked_add(checked_add(tl.peak.weights, tl.peak.gradients, kBytesWhat),
                  checked_add(tl.peak.optimizer_states, tl.peak.activations, kBytesWhat),
                  kBytesWhat),
      checked_add(checked_add(tl.peak.in_flight_copies, tl.peak.logits, kBytesWhat),
                  tl.peak.buffers, kBytesWhat),
      kBytesWhat);
  return tl;
}

double option_time(const Option& o, const Stage& st, size_t l) {
  // Recompute plus the reload stall this layer would see behind the next layers' backward
  // (taken to run the same policy: their recompute counts in the window too).
  double t = o.cost.recompute_ms;
  if (o.cost.offload_bytes > 0 && l + 1 < st.layers.size()) {
    const double h2d = static_cast<double>(o.cost.offload_bytes) / st.h2d_bytes_per_ms;
    const double window =
        (st.layers[l + 1].bwd_ms + o.cost.recompute_ms) * static_cast<double>(st.prefetch);
    t += std::max(0.0, h2d - window);
  }
  return t;
}

bool fits_window(const Option& o, const Stage& st, size_t l) {
  if (o.cost.offload_bytes == 0) return true;
  const double rate = st.d2h_bytes_per_ms / (1.0 + st.margin);
  return static_cast<double>(o.cost.offload_bytes) <=
             standalone_capacity_bytes(st, l) * (1 + 1e-12) &&
         copy_finish_ms(st.layers[l], o.actions, rate, 0.0, nullptr) <=
             standalone_deadline(st, l) + 1e-9;
}

// ---- the choice under the budget -------------------------------------------------------

// The options of every layer: identical layers share one set (see build_layer_options).
struct LayerOptions {
  std::vector<OptionSet> unique;
  std::vector<size_t> set_of;        // per layer: its set in `unique`
  std::vector<double> recompute_ms;  // per layer: recompute time of the block policy
  const OptionSet& at(size_t l) const { return unique[set_of[l]]; }
};

// Per layer, the options the strategy may choose from; the searches strike options that
// fail, so each layer's list only shrinks.
using Allowed = std::vector<std::vector<const Option*>>;

// One option per layer and the timeline that judges it.
struct Choice {
  std::vector<const Option*> options;
  Timeline timeline;
};

// The option set of each layer, built once per distinct layer.
LayerOptions build_layer_options(const Stage& st, Policy strategy) {
  // Options depend only on the layer, its forward time, the next layer's and whether it
  // may offload: identical layers (the common case) share one set.
  const size_t n = st.layers.size();
  LayerOptions lo;
  std::vector<size_t> first_of_set;
  lo.set_of.resize(n);
  lo.unique.reserve(n);
  for (size_t l = 0; l < n; ++l) {
    const bool can_offload = l + static_cast<size_t>(st.keep_last) < n;
    const double next_fwd = l + 1 < n ? st.layers[l + 1].fwd_ms : 0.0;
    size_t k = 0;
    for (; k < lo.unique.size(); ++k) {
      const size_t m = first_of_set[k];
      const double m_next = m + 1 < n ? st.layers[m + 1].fwd_ms : 0.0;
      if (st.layers[m].spec == st.layers[l].spec && st.layers[m].fwd_ms == st.layers[l].fwd_ms &&
          st.layers[m].op_fwd_ms == st.layers[l].op_fwd_ms && m_next == next_fwd &&
          lo.unique[k].can_offload == can_offload) {
        break;
      }
    }
    if (k == lo.unique.size()) {
      lo.unique.push_back(build_options(st, l, strategy));
      first_of_set.push_back(l);
    }
    lo.set_of[l] = k;
  }
  lo.recompute_ms.resize(n);
  for (size_t l = 0; l < n; ++l) lo.recompute_ms[l] = lo.at(l).recompute.cost.recompute_ms;
  return lo;
}

// The options each layer may take under the strategy (auto: keep, recompute, and those
// offloading options that fit the layer's window alone).
Allowed allowed_options(const LayerOptions& lo, const Stage& st, Policy strategy) {
  const size_t n = st.layers.size();
  Allowed allowed(n);
  for (size_t l = 0; l < n; ++l) {
    const OptionSet& os = lo.at(l);
    auto& a = allowed[l];
    switch (strategy) {
      case Policy::kKeep:
        a = {&os.keep};
        break;
      case Policy::kRecompute:
        a = {&os.recompute};
        break;
      case Policy::kCheckpoint:
        a = {&os.checkpoint};
        break;
      case Policy::kOffload:
        a = {os.can_offload ? &os.offload : &os.recompute};
        break;
      case Policy::kHybrid:
        a = {os.can_offload ? &os.hybrid : &os.recompute};
        break;
      case Policy::kSelective:
        if (os.can_offload) {
          a = {&os.selective_keep, &os.selective_recompute};
        } else {
          a = {&os.recompute};
        }
        break;
      case Policy::kAuto:
        a = {&os.keep, &os.recompute};
        if (os.can_offload) {
          for (const Option* o :
               {&os.offload, &os.hybrid, &os.selective_keep, &os.selective_recompute}) {
            if (fits_window(*o, st, l)) a.push_back(o);
          }
        }
        break;
    }
  }
  return allowed;
}

// The fastest of layer l's allowed options (ties: the one keeping fewer bytes).
const Option* fastest_option(const std::vector<const Option*>& allowed, const Stage& st, size_t l) {
  const Option* best = nullptr;
  for (const Option* o : allowed) {
    if (best == nullptr || option_time(*o, st, l) < option_time(*best, st, l) - 1e-12 ||
        (option_time(*o, st, l) <= option_time(*best, st, l) + 1e-12 &&
         o->cost.kept_bytes < best->cost.kept_bytes)) {
      best = o;
    }
  }
  return best;
}

// The greedy choice: the fastest allowed option of each layer, then the best time-per-byte
// trade at a time until the plan fits the budget; auto then strikes the offloads that
// snowball with their neighbours' copies and tries again.
Choice choose_greedy(const Stage& st, const LayerOptions& lo, Allowed& allowed, Policy strategy) {
  const size_t n = st.layers.size();
  Choice c;
  c.options.resize(n);
  std::vector<const Option*>& choice = c.options;
  for (size_t l = 0; l < n; ++l) choice[l] = fastest_option(allowed[l], st, l);

  Timeline& tl = c.timeline;
  for (int round = 0; round < 4 * static_cast<int>(n) + 8; ++round) {
    tl = run_timeline(st, choice, lo.recompute_ms, false);
    while (tl.peak.total() > st.budget) {
      double best_ratio = kInf;
      size_t best_l = n;
      const Option* best_o = nullptr;
      for (size_t l = 0; l < n; ++l) {
        const Option* cur = choice[l];
        for (const Option* o : allowed[l]) {
          const int64_t saved = cur->cost.kept_bytes - o->cost.kept_bytes;
          if (saved <= 0) continue;
          const double dt = option_time(*o, st, l) - option_time(*cur, st, l);
          const double ratio = dt / static_cast<double>(saved);
          if (ratio < best_ratio) {
            best_ratio = ratio;
            best_l = l;
            best_o = o;
          }
        }
      }
      if (best_o == nullptr) break;  // nothing left to trade
      choice[best_l] = best_o;
      tl = run_timeline(st, choice, lo.recompute_ms, false);
    }
    if (strategy != Policy::kAuto || tl.snowball_layers.empty()) break;
    // Auto: a layer that misses its window once neighbours' copies are counted gives up
    // its offload for the fastest option that moves fewer bytes.
    for (size_t l : tl.snowball_layers) {
      const int64_t cur = choice[l]->cost.offload_bytes;
      auto& a = allowed[l];
      a.erase(std::remove_if(a.begin(), a.end(),
                             [&](const Option* o) { return o->cost.offload_bytes >= cur; }),
              a.end());
      choice[l] = fastest_option(a, st, l);
    }
  }
  return c;
}

// Whether a timeline fits: peak HBM within the budget, pinned host memory within the
// host's share of one GPU, and no snowball.
bool fits(const Timeline& t, const Stage& st, double host_limit) {
  return t.peak.total() <= st.budget && static_cast<double>(t.host_pinned) <= host_limit &&
         t.snowball_layers.empty();
}

// Note [Budget search]: take the move that saves the most step time and keeps the plan
// feasible, until none is left. A move is screened with an O(1) estimate of the peak (the
// kept sum and the two max terms, the layer's own contribution taken out through the top
// two values) and confirmed by a timeline; a move the timeline rejects (a snowball, a
// real peak over budget) is struck from that layer's options.
// `repair` (when the choice does not fit): the move that lowers the estimated peak most
// per millisecond it costs; `improve` (when it fits): the move that saves the most time
// per byte it adds (moves that add none first), keeping the estimate within the budget.
void search_moves(const Stage& st, const LayerOptions& lo, double host_limit, Allowed& allowed,
                  Choice& c, bool repair) {
  const size_t n = st.layers.size();
  std::vector<const Option*>& ch = c.options;
  Timeline& t = c.timeline;
  for (int moves = 0; moves < 8 * static_cast<int>(n) + 16; ++moves) {
    if (repair && fits(t, st, host_limit)) return;
    int64_t kept = 0;
    int64_t pinned = 0;
    int64_t w1 = 0, w2 = 0, f1 = 0, f2 = 0;  // top two re-materialized / offload bytes
    for (size_t l = 0; l < n; ++l) {
      const ActionCost& cost = ch[l]->cost;
      kept += cost.kept_bytes;
      pinned += cost.offload_bytes;
      const int64_t w = cost.rematerialized_bytes;
      if (w > w1) {
        w2 = w1;
        w1 = w;
      } else if (w > w2) {
        w2 = w;
      }
      const int64_t f = cost.offload_bytes;
      if (f > f1) {
        f2 = f1;
        f1 = f;
      } else if (f > f2) {
        f2 = f;
      }
    }
    auto estimate = [&](int64_t k, int64_t w, int64_t f) {
      return st.static_bytes + k * st.mb_inflight + std::max(w, st.logits_bytes) + f * st.prefetch;
    };
    const int64_t peak_now = estimate(kept, w1, f1);
    double best_score = 0.0;
    size_t best_l = n;
    const Option* best_o = nullptr;
    for (size_t l = 0; l < n; ++l) {
      const ActionCost& cur = ch[l]->cost;
      const double t_cur = option_time(*ch[l], st, l);
      const int64_t w_rest = cur.rematerialized_bytes == w1 ? w2 : w1;
      const int64_t f_rest = cur.offload_bytes == f1 ? f2 : f1;
      for (const Option* o : allowed[l]) {
        if (o == ch[l]) continue;
        const double gain = t_cur - option_time(*o, st, l);
        const int64_t peak = estimate(kept - cur.kept_bytes + o->cost.kept_bytes,
                                      std::max(w_rest, o->cost.rematerialized_bytes),
                                      std::max(f_rest, o->cost.offload_bytes));
        const int64_t pin = (pinned - cur.offload_bytes + o->cost.offload_bytes) * st.mb_inflight;
        const double added = static_cast<double>(peak - peak_now);
        double score = 0.0;
        if (repair) {
          if (added >= 0.0) continue;
          score = -added / std::max(-gain, 1e-6);
        } else {
          if (gain <= 1e-9 || peak > st.budget || static_cast<double>(pin) > host_limit) continue;
          score = added <= 0.0 ? 1e30 + gain : gain / added;
        }
        if (score > best_score) {
          best_score = score;
          best_l = l;
          best_o = o;
        }
      }
    }
    if (best_o == nullptr) return;
    const Option* before = ch[best_l];
    ch[best_l] = best_o;
    Timeline t2 = run_timeline(st, ch, lo.recompute_ms, false);
    if (repair ? t2.snowball_layers.empty() : fits(t2, st, host_limit)) {
      t = std::move(t2);
    } else {
      ch[best_l] = before;
      auto& a = allowed[best_l];
      a.erase(std::remove(a.begin(), a.end(), best_o), a.end());
    }
  }
}

// The starts of the budget search: the smallest-memory choice, block recompute everywhere
// (auto and selective), each offloading policy on every layer that allows it (auto), and
// the greedy choice last.
std::vector<std::vector<const Option*>> search_starts(const LayerOptions& lo,
                                                      const Allowed& allowed, Policy strategy,
                                                      const std::vector<const Option*>& greedy) {
  const size_t n = allowed.size();
  std::vector<std::vector<const Option*>> starts;
  std::vector<const Option*> small(n);
  for (size_t l = 0; l < n; ++l) {
    small[l] = allowed[l].front();
    for (const Option* o : allowed[l]) {
      const Option* b = small[l];
      if (o->cost.kept_bytes < b->cost.kept_bytes ||
          (o->cost.kept_bytes == b->cost.kept_bytes &&
           o->cost.offload_bytes < b->cost.offload_bytes)) {
        small[l] = o;
      }
    }
  }
  starts.push_back(std::move(small));
  if (strategy == Policy::kAuto || strategy == Policy::kSelective) {
    std::vector<const Option*> rec(n);
    for (size_t l = 0; l < n; ++l) rec[l] = &lo.at(l).recompute;
    starts.push_back(std::move(rec));
  }
  if (strategy == Policy::kAuto) {
    // Uniform starts (one policy on every layer that allows it, recompute elsewhere): a
    // policy that pays only once in the peak (in-flight copies) is reached as a whole.
    for (Option OptionSet::*member :
         {&OptionSet::hybrid, &OptionSet::offload, &OptionSet::selective_recompute}) {
      std::vector<const Option*> uni(n);
      for (size_t l = 0; l < n; ++l) {
        const Option* o = &(lo.at(l).*member);
        const bool ok = std::find(allowed[l].begin(), allowed[l].end(), o) != allowed[l].end();
        uni[l] = ok ? o : &lo.at(l).recompute;
      }
      starts.push_back(std::move(uni));
    }
  }
  starts.push_back(greedy);
  return starts;
}

// The final choice: the greedy one, unless the budget binds; then the fastest fitting
// result of Note [Budget search] from several starts (the greedy trades by kept bytes and
// can miss what the max terms of the peak, in-flight copies and one layer's re-materialized
// set, or the host memory decide, and it can stop in a local optimum).
Choice choose_under_budget(const Stage& st, const LayerOptions& lo, Allowed& allowed,
                           Policy strategy, double host_limit, Choice greedy) {
  const size_t n = st.layers.size();
  // The budget binds when the plan does not fit or some layer runs slower than its fastest
  // allowed option.
  bool binds = !fits(greedy.timeline, st, host_limit);
  for (size_t l = 0; l < n && !binds; ++l) {
    for (const Option* o : allowed[l]) {
      if (option_time(*o, st, l) < option_time(*greedy.options[l], st, l) - 1e-9) binds = true;
    }
  }
  if (!binds) return greedy;
  std::vector<std::vector<const Option*>> starts =
      search_starts(lo, allowed, strategy, greedy.options);
  Choice best = std::move(greedy);
  for (std::vector<const Option*>& start : starts) {
    Choice c;
    c.timeline = run_timeline(st, start, lo.recompute_ms, false);
    c.options = std::move(start);
    if (!fits(c.timeline, st, host_limit)) search_moves(st, lo, host_limit, allowed, c, true);
    if (!fits(c.timeline, st, host_limit)) continue;
    search_moves(st, lo, host_limit, allowed, c, false);
    if (!fits(best.timeline, st, host_limit) || c.timeline.step_ms < best.timeline.step_ms) {
      best = std::move(c);
    }
  }
  return best;
}

// ---- the summary and its reasons -------------------------------------------------------

// Timelines of the chosen options (with the per-tensor detail) and of the two references.
struct Timelines {
  Timeline chosen;
  Timeline recompute;  // every layer block-recomputed
  Timeline keep;       // every layer keeps everything
};

// The timelines a plan reports, for the chosen options and the two references.
Timelines final_timelines(const Stage& st, const LayerOptions& lo,
                          const std::vector<const Option*>& choice) {
  const size_t n = st.layers.size();
  std::vector<const Option*> all_rec(n);
  std::vector<const Option*> all_keep(n);
  for (size_t l = 0; l < n; ++l) {
    all_rec[l] = &lo.at(l).recompute;
    all_keep[l] = &lo.at(l).keep;
  }
  Timelines t;
  t.recompute = run_timeline(st, all_rec, lo.recompute_ms, false);
  t.keep = run_timeline(st, all_keep, lo.recompute_ms, false);
  t.chosen = run_timeline(st, choice, lo.recompute_ms, true);
  return t;
}

// The plan's layers (moved out of tl.chosen) and its step times (grad_accum micro-batches),
// stall, peak and pinned host memory.
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

// The overlapped collectives of one micro-batch on the GPU's one communication stream (as
// the simulator runs them, in issue order): a forward weight gather of layer l issued when
// layer l - 1 starts (layer 0's at the start) and waited for by layer l; a backward gather
// of layer l issued when layer l + 1 starts its backward (the last layer's when the head
// starts) and waited for by layer l's backward; with `reduce`, each layer's gradient
// reduction after its backward, which the step's end (the optimizer) waits for; with
// `param_gather`, the ZeRO-1/2 weight gathers as forward gathers. Returns how much later
// the micro-batch ends than without them.
double overlapped_delay(const Stage& st, const std::vector<LayerPlan>& layers, bool reduce,
                        bool param_gather) {
  const size_t n = layers.size();
  // Per layer: forward compute, its exposed collectives (offset into the forward's ops,
  // ms), the backward before its exposed ones (stall, recompute) and after (backward).
  std::vector<double> f(n), b_pre(n), b_post(n), gf(n, 0.0), gb(n, 0.0), rd(n, 0.0);
  std::vector<std::vector<std::pair<double, double>>> fx(n);
  std::vector<std::vector<double>> bx(n);
  // Host-link rings share the link with the copies beside them (Note [The host link is
  // shared]): per window, the ring ms issued as the layer's forward (backward) starts and
  // the copy ms running then alone.
  std::vector<double> ring_f(n, 0.0), ring_b(n, 0.0), copy_f(n, 0.0), copy_b(n, 0.0);
  const double d2h = st.d2h_bytes_per_ms;
  const double h2d = st.h2d_bytes_per_ms;
  double base = st.head_ms;
  for (size_t l = 0; l < n; ++l) {
    const LayerPlan& lp = layers[l];
    const CostedLayer& cl = st.layers[l];
    f[l] = lp.fwd_ms;
    b_pre[l] = lp.stall_ms + lp.recompute_ms;
    b_post[l] = lp.bwd_ms;
    base += f[l] + b_pre[l] + b_post[l];
    const bool host_copies = d2h > 0.0 && h2d > 0.0 && lp.offload_bytes > 0;
    if (host_copies) {
      copy_f[l] = static_cast<double>(lp.offload_bytes) / d2h;
      // The reload issued as layer w = l + prefetch starts its backward (the last layers'
      // own reloads as backward starts).
      copy_b[std::min(n - 1, l + static_cast<size_t>(st.prefetch))] +=
          static_cast<double>(lp.offload_bytes) / h2d;
    }
    double op_sum = 0.0;
    for (double ms : cl.op_fwd_ms) op_sum += ms;
    const double scale = op_sum > 0.0 ? f[l] / op_sum : 0.0;
    for (const CollectivePlan& c : st.collectives[l]) {
      const bool host = c.link == "host";
      if (c.exposed) {
        base += c.ms;
        if (c.backward) {
          bx[l].push_back(c.ms);
          continue;
        }
        const int after = exposed_forward_position(
            c, cl.inv.ops.size(), [&](size_t k) -> std::string_view { return cl.inv.ops[k].name; });
        double offset = 0.0;
        for (int k = 0; k <= after && k < static_cast<int>(cl.op_fwd_ms.size()); ++k)
          offset += cl.op_fwd_ms[static_cast<size_t>(k)] * scale;
        fx[l].emplace_back(std::min(offset, f[l]), c.ms);
      } else if (c.what == "zero.weight_gather") {
        (c.backward ? gb[l] : gf[l]) += c.ms;
        if (host && !c.backward && l > 0) ring_f[l - 1] += c.ms;
        if (host && c.backward && l + 1 < n) ring_b[l + 1] += c.ms;
      } else if (c.what == "zero.param_gather" && param_gather) {
        gf[l] += c.ms;
        if (host && l > 0) ring_f[l - 1] += c.ms;
      } else if (c.what == "dp.grad_reduce" && reduce) {
        rd[l] += c.ms;
        if (host && l > 0) ring_b[l - 1] += c.ms;
      }
    }
    std::stable_sort(fx[l].begin(), fx[l].end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
  }
  if (n == 0) return 0.0;
  // Each window's rings lose min(ring, copies) in all, spread over them pro rata.
  auto share = [](double ring, double copies, double& ms) {
    if (ring > 0.0) ms *= shared_link_ms(ring, copies) / ring;
  };
  for (size_t l = 0; l + 1 < n; ++l) share(ring_f[l], copy_f[l], gf[l + 1]);
  for (size_t l = 0; l < n; ++l) {
    if (l > 0) share(ring_b[l], copy_b[l], gb[l - 1]);
    if (l + 1 < n) share(ring_b[l], copy_b[l], rd[l + 1]);
  }
  // One communication stream in issue order: a layer's exposed collectives queue behind
  // the gather issued as the layer started (and anything before it).
  double comm = gf[0];
  double t = comm;  // layer 0 waits for its weights
  std::vector<double> ready(n, 0.0);
  for (size_t l = 0; l < n; ++l) {
    double next = 0.0;
    if (l + 1 < n) {
      comm = std::max(comm, t) + gf[l + 1];
      next = comm;
    }
    double cur = t;
    double done = 0.0;  // ms of the layer's ops run
    for (const auto& [offset, ms] : fx[l]) {
      cur += offset - done;
      done = offset;
      cur = std::max(cur, comm) + ms;
      comm = cur;
    }
    t = std::max(cur + f[l] - done, next);
  }
  t += st.head_ms;
  comm = std::max(comm, t - st.head_ms) + gb[n - 1];
  ready[n - 1] = comm;
  for (size_t l = n; l-- > 0;) {
    t = std::max(t, ready[l]);
    if (l > 0) {
      comm = std::max(comm, t) + gb[l - 1];
      ready[l - 1] = comm;
    }
    t += b_pre[l];
    for (double ms : bx[l]) {
      t = std::max(t, comm) + ms;
      comm = t;
    }
    t += b_post[l];
    if (rd[l] > 0.0) comm = std::max(comm, t) + rd[l];
  }
  const double end = reduce ? std::max(t, comm) : t;
  return std::max(0.0, end - base);
}

// What the overlapped collectives add to a step of grad_accum micro-batches of timeline
// `tl` (Note [Collectives in the plan]): the first micro-batch gathers the updated weights
// (ZeRO-1/2), the last reduces the gradients, the others only gather (ZeRO-3). The exposed
// ones are in the timeline's micro-batch already.
double overlapped_step_delay(const Stage& st, const std::vector<LayerPlan>& layers,
                             int64_t grad_accum) {
  if (grad_accum == 1) return overlapped_delay(st, layers, true, true);
  return overlapped_delay(st, layers, false, true) + overlapped_delay(st, layers, true, false) +
         static_cast<double>(grad_accum - 2) * overlapped_delay(st, layers, false, false);
}

// The collectives on the critical path (`overlapped`, from overlapped_step_delay, plus
// the exposed ones) and in all, into the summary (Note [Collectives in the plan]).
void plan_collective_time(const PlanRequest& r, double overlapped, Plan& plan) {
  const double ga = static_cast<double>(r.work.grad_accum);
  double total = 0.0;
  double exposed = 0.0;
  for (const LayerPlan& lp : plan.layers) {
    for (const CollectivePlan& c : lp.collectives) {
      const bool per_step = c.what == "dp.grad_reduce" || c.what == "zero.param_gather";
      total += c.ms * (per_step ? 1.0 : ga);
      if (c.exposed) exposed += c.ms * ga;
    }
  }
  plan.summary.collective_ms = exposed + overlapped;
  plan.summary.collective_total_ms = total;
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

// Why the plan is infeasible, in words and numbers (empty when it is feasible): the layers
// that miss their window, the snowball, the peak over budget, the host memory.
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

}  // namespace

Plan make_plan(const PlanRequest& r) {
  validate(r);
  Plan plan;
  plan.strategy = r.strategy;
  const Stage st = build_stage(r, plan);
  const LayerOptions options = build_layer_options(st, r.strategy);
  Allowed allowed = allowed_options(options, st, r.strategy);
  Choice greedy = choose_greedy(st, options, allowed, r.strategy);
  const double host_limit = r.hardware.host_memory_gb / r.hardware.gpus_per_host_memory * 1e9;
  const Choice chosen =
      choose_under_budget(st, options, allowed, r.strategy, host_limit, std::move(greedy));
  Timelines timelines = final_timelines(st, options, chosen.options);
  const int64_t ga = r.work.grad_accum;
  double unhidden = overlapped_step_delay(st, timelines.chosen.layers, ga);
  const double rec_unhidden = overlapped_step_delay(st, timelines.recompute.layers, ga);
  const double keep_unhidden = overlapped_step_delay(st, timelines.keep.layers, ga);
  // Note [Auto is never slower than recompute]: the search scores a choice by its
  // timeline; the overlapped collectives, slowed by the copies beside them on a host link
  // (Note [The host link is shared]), come after. When they make the choice slower than
  // recomputing every layer, auto takes the all-recompute plan (if it fits where the
  // choice fits).
  if (r.strategy == Policy::kAuto &&
      timelines.recompute.peak.total() <= std::max(st.budget, timelines.chosen.peak.total()) &&
      timelines.recompute.step_ms * static_cast<double>(ga) + rec_unhidden <
          timelines.chosen.step_ms * static_cast<double>(ga) + unhidden) {
    std::vector<const Option*> all_rec(st.layers.size());
    for (size_t l = 0; l < all_rec.size(); ++l) all_rec[l] = &options.at(l).recompute;
    timelines = final_timelines(st, options, all_rec);
    unhidden = rec_unhidden;
  }
  fill_summary(timelines, ga, plan);
  if (r.optimizer_offload) plan_offloaded_optimizer(r, plan);
  plan_collective_time(r, unhidden, plan);
  {
    PlanSummary& s = plan.summary;
    s.step_ms += s.state.optimizer_ms + unhidden;
    s.recompute_step_ms += s.state.optimizer_ms + rec_unhidden;
    s.keep_step_ms += s.state.optimizer_ms + keep_unhidden;
    s.speedup_vs_recompute = s.recompute_step_ms / s.step_ms;
  }
  summarize_blocks(st, r, plan);
  plan.summary.reasons = infeasibility_reasons(plan, timelines, st, r);
  plan.summary.feasible = plan.summary.reasons.empty();
  return plan;
}

}  // namespace spillway

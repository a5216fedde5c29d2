// The plan as JSON, schema spillway.plan/1 (documented field by field in
// docs/plan-schema.md). Bytes are integers, times are milliseconds.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string_view>

#include "core/json_io.hpp"
#include "plan/cost_model.hpp"
#include "spillway/catalog/inventory.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {

namespace {
// options.efficiency: the constants given ("curve": the curve was used), the HBM fraction
// used, and the curves the plan ran with (measured points merged).
Json efficiency_json(const PlanRequest& r) {
  const EfficiencyCurves c = effective_curves(r.hardware, r.efficiency);
  const auto given = [](const EfficiencyFactor& f) {
    return f.given() ? Json(f.value()) : Json("curve");
  };
  const auto curve = [](const EfficiencyCurve& e) {
    Json points = Json::array();
    for (const auto& [x, v] : e.points) points.push_back({x, v});
    return points;
  };
  return {{"gemm", given(r.efficiency.gemm)},
          {"attention", given(r.efficiency.attention)},
          {"hbm", hbm_efficiency(r.hardware, r.efficiency)},
          {"measured_ops", r.efficiency.measured.size()},
          {"curves",
           {{"gemm", curve(c.gemm)},
            {"grouped_gemm", curve(c.grouped_gemm)},
            {"attention", curve(c.attention)}}}};
}

// JSON has no infinity: a margin with nothing offloaded is written as null.
Json finite_or_null(double v) {
  return std::isfinite(v) ? Json(v) : Json(nullptr);
}

// Every saved-tensor name of docs/plan-schema.md ("Tensor names"), and the block kinds a
// name needs, '|' between alternatives ("" = any block).
struct KnownTensor {
  std::string_view name;
  std::string_view needs;
};
constexpr KnownTensor kKnownTensors[] = {
    {"attn.input", ""},
    {"attn.norm_out", ""},
    {"attn.q_latent", "mla"},
    {"attn.kv_latent", "mla"},
    {"attn.qkv_out", ""},
    {"attn.out_proj_in", ""},
    {"attn.core_lse", ""},
    {"mlp.input", ""},
    {"mlp.norm_out", ""},
    {"moe.router_probs", "moe"},
    {"moe.topk_idx", "moe"},
    {"moe.topk_weights", "moe"},
    {"moe.dispatch_in", "moe"},
    {"mlp.gate_out", ""},
    {"mlp.up_out", ""},
    {"mlp.act", ""},
    {"moe.expert_out", "moe"},
    {"ssm.input", "mamba"},
    {"ssm.norm_out", "mamba"},
    {"ssm.in_proj_out", "mamba"},
    {"ssm.conv_out", "mamba"},
    {"ssm.x_proj_out", "mamba"},
    {"ssm.dt", "mamba"},
    {"ssm.scan_out", "mamba"},
    {"ssm.chunk_states", "mamba"},
    {"ssm.out_proj_in", "mamba"},
    {"lin.input", "gdn|kda|lightning"},
    {"lin.norm_out", "gdn|kda|lightning"},
    {"lin.in_proj_out", "gdn|kda|lightning"},
    {"lin.conv_out", "gdn|kda|lightning"},
    {"lin.core_out", "gdn|kda|lightning"},
    {"lin.chunk_states", "gdn|kda|lightning"},
    {"lin.out_proj_in", "gdn|kda|lightning"},
    {"rec.input", "rglru"},
    {"rec.norm_out", "rglru"},
    {"rec.y_out", "rglru"},
    {"rec.x_out", "rglru"},
    {"rec.conv_out", "rglru"},
    {"rec.lru_out", "rglru"},
    {"rec.chunk_states", "rglru"},
    {"rec.out_proj_in", "rglru"},
};

// Bytes of one element of a tensor dtype as the plan writes it; 0 when unknown.
int64_t tensor_dtype_bytes(std::string_view dtype) {
  if (dtype == "bf16" || dtype == "fp16") return 2;
  if (dtype == "fp8") return 1;
  if (dtype == "fp32" || dtype == "int32") return 4;
  return 0;
}

// One entry of a layer's "collectives" (docs/plan-schema.md); an absent array is empty.
CollectivePlan collective_of(const JsonObject& c) {
  constexpr int64_t kBig = int64_t{1} << 62;
  CollectivePlan cp;
  const std::string kind = c.req_str("kind");
  bool known = false;
  for (CollectiveKind k : {CollectiveKind::kAllReduce, CollectiveKind::kAllGather,
                           CollectiveKind::kReduceScatter, CollectiveKind::kAllToAll}) {
    if (to_string(k) == kind) {
      cp.kind = k;
      known = true;
    }
  }
  if (!known) {
    c.fail("kind", fmt::format("is \"{}\"; must be all-reduce, all-gather, reduce-scatter or "
                               "all-to-all",
                               kind));
  }
  cp.what = c.req_str("what");
  if (cp.what.empty()) c.fail("what", "is \"\"; must name the collective");
  cp.backward = c.bool_or("backward", false);
  cp.bytes = c.req_int("bytes", 0, kBig);
  cp.group = c.req_int("group", 1, PlanLimits::kMaxGroup);
  cp.link = c.req_str("link");
  if (cp.link != "nvlink" && cp.link != "network" && cp.link != "host")
    c.fail("link", fmt::format("is \"{}\"; must be nvlink, network or host", cp.link));
  cp.gbps = c.req_num("gbps", PlanLimits::kMinGbps, PlanLimits::kMaxGbps);
  cp.ms = c.req_num("ms", 0.0, 1e9);
  cp.exposed = c.bool_or("exposed", cp.kind == CollectiveKind::kAllToAll);
  return cp;
}

// Note [Per-block policy]: written for readers; the planner recomputes it, so a plan read
// back does not carry it.
Json blocks_json(const std::vector<BlockSummary>& blocks) {
  Json a = Json::array();
  for (const BlockSummary& b : blocks) {
    a.push_back({{"block", b.block},
                 {"layers", b.layers},
                 {"chosen", b.chosen},
                 {"block_policy_keeps", b.kept},
                 {"block_policy_kept_bytes", b.block_kept_bytes},
                 {"block_policy_recompute_ms", b.block_recompute_ms},
                 {"checkpoint_kept_bytes", b.checkpoint_kept_bytes},
                 {"checkpoint_recompute_ms", b.checkpoint_recompute_ms},
                 {"offload_candidates", [&] {
                    Json c = Json::array();
                    for (const auto& [name, bytes] : b.candidates)
                      c.push_back({{"name", name}, {"bytes", bytes}});
                    return c;
                  }()}});
  }
  return a;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Checks one tensor of a plan layer on its own: a known name that fits the layer's block,
// a known dtype, and bytes = shape x dtype size.
void check_tensor(const JsonObject& t, const TensorPlan& tp, const std::string& block) {
  const auto known = std::find_if(std::begin(kKnownTensors), std::end(kKnownTensors),
                                  [&](const KnownTensor& k) { return k.name == tp.name; });
  if (known == std::end(kKnownTensors)) {
    t.fail("name",
           fmt::format("is \"{}\"; not a tensor name of spillway.plan/1 (docs/plan-schema.md)",
                       tp.name));
  }
  if (!known->needs.empty() && !block.empty()) {
    bool fits = false;
    std::vector<std::string_view> kinds;
    for (size_t at = 0; at <= known->needs.size();) {
      const size_t bar = std::min(known->needs.find('|', at), known->needs.size());
      kinds.push_back(known->needs.substr(at, bar - at));
      fits = fits || block.find(kinds.back()) != std::string::npos;
      at = bar + 1;
    }
    if (!fits) {
      t.fail("name", fmt::format("is \"{}\"; a {} tensor in a layer of block \"{}\"", tp.name,
                                 fmt::join(kinds, " or "), block));
    }
  }
  const int64_t elem = tensor_dtype_bytes(tp.dtype);
  if (!tp.dtype.empty() && elem == 0) {
    t.fail("dtype", fmt::format("is \"{}\"; must be bf16, fp16, fp8, fp32 or int32", tp.dtype));
  }
  if (tp.shape.empty()) return;
  if (tp.shape.size() != 2) {
    t.fail("shape", fmt::format("is {}; must be [rows, columns]", shape_text(tp.shape)));
  }
  if (elem == 0) t.fail("dtype", "is missing; a tensor with a shape needs its dtype");
  int64_t expect = elem;
  for (int64_t d : tp.shape) {
    if (d != 0 && expect > (int64_t{1} << 62) / d) {
      t.fail("shape", fmt::format("is {}; its bytes overflow", shape_text(tp.shape)));
    }
    expect *= d;
  }
  if (expect != tp.bytes) {
    t.fail("bytes", fmt::format("is {}; shape {} {} is {} bytes", tp.bytes, shape_text(tp.shape),
                                tp.dtype, expect));
  }
}
}  // namespace

std::string plan_to_json(const Plan& plan, const PlanRequest& r) {
  const ShardShape& s = r.work.shape;
  Json j;
  j["schema"] = "spillway.plan/1";
  j["generator"] = "spillway 0.1.0";
  j["model"] = {{"name", r.model.name},
                {"model_type", r.model.model_type},
                {"source", r.model.source},
                {"layers", r.model.layers.size()},
                {"hidden_size", r.model.hidden},
                {"params", plan.params_total},
                {"params_per_gpu", plan.params_per_gpu}};
  j["hardware"] = {{"name", r.hardware.name},
                   {"source", r.hardware.source},
                   {"d2h_gbps", plan.summary.d2h_gbps},
                   {"h2d_gbps", plan.summary.h2d_gbps},
                   {"gpus_per_link", plan.summary.gpus_per_link},
                   {"hbm_gb", r.hardware.hbm_gb},
                   {"hbm_tbps", r.hardware.hbm_tbps}};
  j["workload"] = {{"micro_batch", s.micro_batch},
                   {"seq_len", s.seq_len},
                   {"dtype", to_string(s.dtype)},
                   {"tp", s.tp},
                   {"ep", s.ep},
                   {"cp", s.cp},
                   {"pp", r.work.pp},
                   {"dp", r.work.dp},
                   {"grad_accum", r.work.grad_accum},
                   {"fused_swiglu", s.fused_swiglu},
                   {"tokens_per_gpu", plan.tokens_per_gpu},
                   {"inventory_assumes", inventory_assumption(r.model)}};
  j["options"] = {{"strategy", to_string(r.strategy)},
                  {"margin", r.margin},
                  {"keep_last_layers", r.keep_last_layers},
                  {"prefetch_depth", r.prefetch_depth},
                  {"calibration", plan.summary.calibration},
                  {"time_scale", plan.summary.time_scale},
                  {"efficiency", efficiency_json(r)},
                  {"zero", r.zero},
                  {"optimizer_offload", r.optimizer_offload},
                  {"grad_offload", r.grad_offload},
                  {"loss_chunk", r.loss_chunk}};
  if (r.cpu_adam_gbps) j["options"]["cpu_adam_gbps"] = *r.cpu_adam_gbps;
  if (!plan.offload_tensors.empty()) j["options"]["offload_tensors"] = plan.offload_tensors;
  // Note [A model as PyTorch runs it]: the tensors are the ones measured, not the inventory's.
  if (!r.saved_as_run.empty()) {
    j["options"]["saved_as_run"] = true;
    j["workload"]["inventory_assumes"] = "the saved tensors as measured where the model runs";
  }
  Json layers = Json::array();
  for (const LayerPlan& l : plan.layers) {
    Json tensors = Json::array();
    for (const TensorPlan& t : l.tensors) {
      tensors.push_back({{"name", t.name},
                         {"shape", t.shape},
                         {"dtype", t.dtype},
                         {"bytes", t.bytes},
                         {"action", to_string(t.action)},
                         {"recompute_flops", t.recompute_flops},
                         {"recompute_ms", t.recompute_ms},
                         {"produced_at_ms", t.produced_at_ms},
                         {"producer", t.producer}});
    }
    Json ops = Json::array();
    for (const OpPlan& o : l.ops) {
      ops.push_back({{"name", o.name},
                     {"kind", to_string(o.kind)},
                     {"fwd_flops", o.fwd_flops},
                     {"fwd_bytes", o.fwd_bytes},
                     {"bwd_flops", o.bwd_flops},
                     {"bwd_bytes", o.bwd_bytes},
                     {"fwd_ms", o.fwd_ms},
                     {"bwd_ms", o.bwd_ms},
                     {"inputs", o.inputs},
                     {"outputs", o.outputs}});
    }
    Json collectives = Json::array();
    for (const CollectivePlan& c : l.collectives) {
      collectives.push_back({{"kind", to_string(c.kind)},
                             {"what", c.what},
                             {"backward", c.backward},
                             {"bytes", c.bytes},
                             {"group", c.group},
                             {"link", c.link},
                             {"gbps", c.gbps},
                             {"ms", c.ms},
                             {"exposed", c.exposed}});
    }
    layers.push_back({{"index", l.index},
                      {"block", l.block},
                      {"policy", to_string(l.policy)},
                      {"fwd_ms", l.fwd_ms},
                      {"bwd_ms", l.bwd_ms},
                      {"fwd_flops", l.fwd_flops},
                      {"bwd_flops", l.bwd_flops},
                      {"fwd_bytes", l.fwd_bytes},
                      {"bwd_bytes", l.bwd_bytes},
                      {"recompute_ms", l.recompute_ms},
                      {"recompute_avoided_ms", l.recompute_avoided_ms},
                      {"params", l.params},
                      {"offload_bytes", l.offload_bytes},
                      {"kept_bytes", l.kept_bytes},
                      {"d2h_ms", l.d2h_ms},
                      {"window_ms", l.window_ms},
                      {"late_ms", l.late_ms},
                      {"margin", l.offload_bytes > 0 ? finite_or_null(l.margin) : Json(nullptr)},
                      {"h2d_ms", l.h2d_ms},
                      {"stall_ms", l.stall_ms},
                      {"backlog_bytes", l.backlog_bytes},
                      {"snowball", l.snowball},
                      {"fp8_recomputed_gemms", l.fp8_recomputed_gemms},
                      {"fp8_scaling_state_bytes", l.fp8_scaling_state_bytes},
                      {"tensors", tensors},
                      {"ops", ops},
                      {"collectives", collectives}});
  }
  j["layers"] = layers;
  const PlanSummary& m = plan.summary;
  j["summary"] = {{"feasible", m.feasible},
                  {"reasons", m.reasons},
                  {"peak_hbm_bytes", m.peak.total()},
                  {"hbm_budget_bytes", m.hbm_budget_bytes},
                  {"peak_hbm_by_category",
                   {{"weights", m.peak.weights},
                    {"gradients", m.peak.gradients},
                    {"optimizer_states", m.peak.optimizer_states},
                    {"activations", m.peak.activations},
                    {"logits", m.peak.logits},
                    {"buffers", m.peak.buffers},
                    {"in_flight_copies", m.peak.in_flight_copies}}},
                  {"training_state",
                   {{"zero", m.state.zero},
                    {"optimizer_offload", m.state.optimizer_offload},
                    {"grad_offload", m.state.grad_offload},
                    {"state_params", m.state.state_params},
                    {"host_state_bytes", m.state.host_state_bytes},
                    {"cpu_adam_gbps", m.state.cpu_adam_gbps},
                    {"cpu_adam_assumed", m.state.cpu_adam_assumed},
                    {"device_buckets", m.state.device_buckets},
                    {"cast_on_host", m.state.cast_on_host},
                    {"optimizer_ms", m.state.optimizer_ms},
                    {"optimizer_total_ms", m.state.optimizer_total_ms},
                    {"loss_chunk_tokens", m.state.loss_chunk_tokens},
                    {"loss_recompute_ms", m.state.loss_recompute_ms}}},
                  {"host_pinned_bytes", m.host_pinned_bytes},
                  {"step_ms", m.step_ms},
                  {"recompute_step_ms", m.recompute_step_ms},
                  {"keep_step_ms", m.keep_step_ms},
                  {"speedup_vs_recompute", m.speedup_vs_recompute},
                  {"stall_ms", m.stall_ms},
                  {"head_ms", m.head_ms},
                  {"collective_ms", m.collective_ms},
                  {"collective_total_ms", m.collective_total_ms},
                  {"blocks", blocks_json(m.blocks)},
                  {"logits_bytes", m.logits_bytes}};
  return j.dump(2) + "\n";
}

namespace {

// Note [Plans re-timed from their actions]: a plan file's per-layer figures follow from its
// tensors' actions. The recompute time is the forward time of the closure of ops that the
// recomputed tensors need (Note [Recompute closure], src/plan/cost_model.cpp), over the
// layer's op graph the file carries (each op's `inputs` and `outputs`, saved tensors and
// the transient ones between ops) and the ops' forward times; the kept, offloaded and
// re-materialized bytes are sums over the actions. Reading a plan derives them again with
// the planner's own evaluate_actions, so a plan as written reads back bit for bit. A file
// whose stored figures disagree with its actions by more than rounding was edited (an
// action changed, not its times): the derived figures replace the stored ones, and a note
// names the file as edited with the layers and numbers. What the simulator replays
// (`simulate --plan`) is then what the actions cost; `train --plan` re-plans an edited
// file's actions for its prediction (retime_plan in plan.hpp). A file written before the
// op graph was (no `inputs`/`outputs`) keeps its stored recompute times; when its bytes
// disagree with its actions the note says that the times could not be re-derived.

// The layer as the cost model sees it, from the file: its ops (times and graph) and its
// tensors (the saved ones with their actions, then the transient ones the ops name).
CostedLayer costed_from_file(const LayerPlan& lp, std::vector<Action>* actions) {
  CostedLayer c;
  auto index_of = [&](const std::string& name, int producer) -> int {
    for (size_t i = 0; i < c.inv.tensors.size(); ++i) {
      if (c.inv.tensors[i].name == name) return static_cast<int>(i);
    }
    TensorInfo t;
    t.name = name;
    t.saved = false;
    t.producer = producer;
    c.inv.tensors.push_back(std::move(t));
    actions->push_back(Action::kKeep);
    return static_cast<int>(c.inv.tensors.size()) - 1;
  };
  for (const TensorPlan& t : lp.tensors) {
    TensorInfo ti;
    ti.name = t.name;
    ti.bytes = t.bytes;
    ti.producer = t.producer;
    c.inv.tensors.push_back(std::move(ti));
    actions->push_back(t.action);
  }
  for (size_t k = 0; k < lp.ops.size(); ++k) {
    OpCost op;
    op.name = lp.ops[k].name;
    for (const std::string& out : lp.ops[k].outputs)
      op.outputs.push_back(index_of(out, static_cast<int>(k)));
    c.inv.ops.push_back(std::move(op));
    c.op_fwd_ms.push_back(lp.ops[k].fwd_ms);
  }
  // Inputs after every output is known (a transient tensor is named by its producer).
  for (size_t k = 0; k < lp.ops.size(); ++k) {
    for (const std::string& in : lp.ops[k].inputs) c.inv.ops[k].inputs.push_back(index_of(in, -1));
  }
  return c;
}

bool differs(double derived, double stored) {
  return std::abs(derived - stored) > 1e-9 * std::max(1.0, std::abs(stored));
}

Plan parse_plan_document(const Json& doc, const std::string& path, PlanRequest* request) {
  constexpr const char* kWhat = "plan";
  JsonObject root(doc, kWhat, path);
  const std::string schema = root.req_str("schema");
  if (schema != "spillway.plan/1") {
    root.fail("schema", fmt::format("is \"{}\"; this spillway reads \"spillway.plan/1\"", schema));
  }
  constexpr int64_t kBig = int64_t{1} << 62;
  Plan plan;
  PlanRequest& r = *request;
  const JsonObject model = root.req_obj("model");
  r.model.name = model.req_str("name");
  r.model.model_type = model.str_or("model_type", "");
  r.model.hidden = model.req_int("hidden_size", 1, kBig);
  const int64_t model_layers = model.int_or("layers", 0, 0, 1 << 24);  // 0: not written
  plan.params_total = model.int_or("params", 0, 0, kBig);
  plan.params_per_gpu = model.int_or("params_per_gpu", 0, 0, kBig);
  const JsonObject hw = root.req_obj("hardware");
  r.hardware.name = hw.req_str("name");
  r.hardware.hbm_gb = hw.num_or("hbm_gb", 80.0, 0.001, 1e6);
  r.hardware.hbm_tbps = hw.req_num("hbm_tbps", 0.001, 1e4);
  plan.summary.d2h_gbps = hw.req_num("d2h_gbps", 1e-6, 1e6);
  plan.summary.h2d_gbps = hw.req_num("h2d_gbps", 1e-6, 1e6);
  plan.summary.gpus_per_link = static_cast<int>(hw.int_or("gpus_per_link", 1, 1, 1024));
  r.hardware.gpus_per_link = plan.summary.gpus_per_link;
  const JsonObject work = root.req_obj("workload");
  r.work.shape.micro_batch = work.req_int("micro_batch", 1, kBig);
  r.work.shape.seq_len = work.req_int("seq_len", 1, kBig);
  r.work.shape.dtype = parse_dtype(work.str_or("dtype", "bf16"));
  r.work.shape.tp = work.int_or("tp", 1, 1, 1 << 20);
  r.work.shape.ep = work.int_or("ep", 1, 1, 1 << 20);
  r.work.shape.cp = work.int_or("cp", 1, 1, 1 << 20);
  r.work.pp = work.int_or("pp", 1, 1, 1 << 20);
  r.work.dp = work.int_or("dp", 1, 1, 1 << 20);
  r.work.grad_accum = work.int_or("grad_accum", 1, 1, 1 << 20);
  r.work.shape.fused_swiglu = work.bool_or("fused_swiglu", false);
  plan.tokens_per_gpu = work.int_or("tokens_per_gpu", 0, 0, kBig);
  const JsonObject opts = root.req_obj("options");
  r.strategy = parse_policy(opts.str_or("strategy", "auto"));
  plan.strategy = r.strategy;
  r.margin = opts.num_or("margin", 0.1, 0.0, 10.0);
  r.prefetch_depth = static_cast<int>(opts.int_or("prefetch_depth", 1, 1, 64));
  r.keep_last_layers = static_cast<int>(opts.int_or("keep_last_layers", 1, 1, 1 << 20));
  r.zero = static_cast<int>(opts.int_or("zero", 1, 0, 3));
  r.optimizer_offload = opts.bool_or("optimizer_offload", false);
  r.grad_offload = opts.bool_or("grad_offload", false);
  r.loss_chunk = opts.int_or("loss_chunk", 0, 0, PlanLimits::kMaxLossChunk);
  if (opts.has("offload_tensors")) {
    r.offload_tensors = opts.str_array_or("offload_tensors");
    plan.offload_tensors = r.offload_tensors;
  }
  if (opts.bool_or("saved_as_run", false)) {
    SPILLWAY_INPUT_ERROR(
        "{}: the plan was made from the saved tensors measured where its model runs "
        "(options.saved_as_run, spillway.plan(saved=...)), which this model's inventory does "
        "not have; give it to spillway.torch.offload_activations, or plan again without saved",
        path);
  }
  if (opts.has("cpu_adam_gbps"))
    r.cpu_adam_gbps = opts.num_or("cpu_adam_gbps", 0.0, PlanLimits::kMinGbps, PlanLimits::kMaxGbps);

  auto action_of = [](const JsonObject& t) -> Action {
    const std::string a = t.req_str("action");
    if (a == "keep") return Action::kKeep;
    if (a == "offload") return Action::kOffload;
    if (a == "recompute") return Action::kRecompute;
    t.fail("action", fmt::format("is \"{}\"; must be keep, offload or recompute", a));
  };
  auto policy_of = [](const JsonObject& l) -> Policy {
    const std::string p = l.req_str("policy");
    for (Policy v : {Policy::kKeep, Policy::kRecompute, Policy::kOffload, Policy::kSelective,
                     Policy::kHybrid, Policy::kCheckpoint}) {
      if (to_string(v) == p) return v;
    }
    l.fail("policy",
           fmt::format(
               "is \"{}\"; must be keep, recompute, offload, selective, hybrid or checkpoint", p));
  };
  std::vector<int> edited;     // layers whose stored figures disagree with their actions
  std::vector<int> ungraphed;  // the same in a file without the op graph
  std::string first_edit;
  for (const JsonObject& l : root.obj_array("layers")) {
    LayerPlan lp;
    lp.index = static_cast<int>(l.req_int("index", 0, 1 << 24));
    // The first pipeline stage, in order: layers 0, 1, ... with none dropped or repeated.
    const int position = static_cast<int>(plan.layers.size());
    if (lp.index != position) {
      if (lp.index < position) {
        l.fail("index", fmt::format("is {}; layer {} is listed twice", lp.index, lp.index));
      }
      l.fail("index", fmt::format("is {}; expected {} (layers are listed in order from 0: layer {} "
                                  "is missing)",
                                  lp.index, position, position));
    }
    lp.block = l.str_or("block", "");
    lp.policy = policy_of(l);
    lp.fwd_ms = l.req_num("fwd_ms", 0.0, 1e9);
    lp.bwd_ms = l.req_num("bwd_ms", 0.0, 1e9);
    lp.recompute_ms = l.req_num("recompute_ms", 0.0, 1e9);
    lp.params = l.int_or("params", 0, 0, kBig);
    bool graph = true;  // every op names its inputs and outputs
    for (const JsonObject& o : l.obj_array("ops")) {
      OpPlan op;
      op.name = o.req_str("name");
      op.kind = parse_op_kind(o.str_or("kind", "gemm"));
      op.fwd_ms = o.req_num("fwd_ms", 0.0, 1e9);
      op.bwd_ms = o.num_or("bwd_ms", 0.0, 0.0, 1e9);
      op.fwd_flops = o.num_or("fwd_flops", 0.0, 0.0, 1e30);
      op.fwd_bytes = o.int_or("fwd_bytes", 0, 0, kBig);
      if (o.has("inputs") && o.has("outputs")) {
        op.inputs = o.str_array_or("inputs");
        op.outputs = o.str_array_or("outputs");
      } else {
        graph = false;
      }
      lp.ops.push_back(std::move(op));
    }
    if (lp.ops.empty()) l.fail("ops", "is missing or empty; the simulator needs the layer's ops");
    if (lp.ops.size() > 64)
      l.fail("ops", fmt::format("has {} entries; a layer has at most 64 ops", lp.ops.size()));
    for (const JsonObject& c : l.obj_array("collectives"))
      lp.collectives.push_back(collective_of(c));
    for (const JsonObject& t : l.obj_array("tensors")) {
      TensorPlan tp;
      tp.name = t.req_str("name");
      tp.bytes = t.req_int("bytes", 0, kBig);
      tp.action = action_of(t);
      tp.producer =
          static_cast<int>(t.req_int("producer", -1, static_cast<int64_t>(lp.ops.size()) - 1));
      tp.produced_at_ms = t.num_or("produced_at_ms", 0.0, 0.0, 1e9);
      tp.dtype = t.str_or("dtype", "");
      tp.shape = t.int_array_or("shape", 0, kBig);
      check_tensor(t, tp, lp.block);
      for (const TensorPlan& other : lp.tensors) {
        if (other.name == tp.name) t.fail("name", fmt::format("is \"{}\" again", tp.name));
      }
      int64_t* sum = tp.action == Action::kOffload ? &lp.offload_bytes
                     : tp.action == Action::kKeep  ? &lp.kept_bytes
                                                   : nullptr;
      if (sum != nullptr && __builtin_add_overflow(*sum, tp.bytes, sum)) {
        t.fail("bytes", fmt::format("is {}; the layer's {} bytes overflow 64 bits", tp.bytes,
                                    to_string(tp.action)));
      }
      lp.tensors.push_back(std::move(tp));
    }
    // Note [Plans re-timed from their actions].
    const int64_t stored_kept = l.int_or("kept_bytes", lp.kept_bytes, 0, kBig);
    const int64_t stored_offload = l.int_or("offload_bytes", lp.offload_bytes, 0, kBig);
    const bool bytes_differ = stored_kept != lp.kept_bytes || stored_offload != lp.offload_bytes;
    if (graph) {
      std::vector<Action> actions;
      const CostedLayer c = costed_from_file(lp, &actions);
      const ActionCost cost = evaluate_actions(c, actions);
      if (bytes_differ || differs(cost.recompute_ms, lp.recompute_ms)) {
        if (edited.empty()) {
          std::vector<std::string> rerun;
          for (size_t k = 0; k < c.inv.ops.size(); ++k) {
            if (cost.rerun_ops >> k & 1u) rerun.push_back(c.inv.ops[k].name);
          }
          first_edit = fmt::format(
              "layer {}: its actions re-run {} in backward, {:.3f} ms, the file says {:.3f} ms; "
              "kept {} bytes, the file says {}; offloaded {} bytes, the file says {}",
              lp.index,
              rerun.empty() ? std::string("nothing") : fmt::format("{}", fmt::join(rerun, ", ")),
              cost.recompute_ms, lp.recompute_ms, lp.kept_bytes, stored_kept, lp.offload_bytes,
              stored_offload);
        }
        edited.push_back(lp.index);
      }
      lp.recompute_ms = cost.recompute_ms;
      lp.rematerialized_bytes = cost.rematerialized_bytes;
    } else if (bytes_differ) {
      ungraphed.push_back(lp.index);
    }
    plan.layers.push_back(std::move(lp));
  }
  if (plan.layers.empty()) root.fail("layers", "is missing or empty");
  if (!edited.empty()) {
    plan.notes.push_back(fmt::format(
        "{} was edited: the actions of {} layer(s) ({}) disagree with the times and bytes it "
        "stores ({}); re-timed from the actions (the summary's predictions are from before the "
        "edit)",
        path, edited.size(), fmt::join(edited, ", "), first_edit));
  }
  if (!ungraphed.empty()) {
    plan.notes.push_back(fmt::format(
        "{} was edited: the actions of {} layer(s) ({}) disagree with the bytes it stores, and "
        "the file carries no op graph (written before ops had inputs and outputs), so their "
        "recompute times are the file's, not their actions'; plan again",
        path, ungraphed.size(), fmt::join(ungraphed, ", ")));
  }
  if (model_layers > 0) {
    const int64_t stage = (model_layers + r.work.pp - 1) / r.work.pp;
    if (static_cast<int64_t>(plan.layers.size()) != stage) {
      root.fail("layers", fmt::format("has {} entries; the first pipeline stage of a model of {} "
                                      "layers at pp {} has {}",
                                      plan.layers.size(), model_layers, r.work.pp, stage));
    }
  }
  const JsonObject sum = root.req_obj("summary");
  PlanSummary& s = plan.summary;
  s.feasible = sum.bool_or("feasible", true);
  s.step_ms = sum.num_or("step_ms", 0.0, 0.0, 1e12);
  s.recompute_step_ms = sum.num_or("recompute_step_ms", 0.0, 0.0, 1e12);
  s.head_ms = sum.num_or("head_ms", 0.0, 0.0, 1e9);
  s.collective_ms = sum.num_or("collective_ms", 0.0, 0.0, 1e12);
  s.collective_total_ms = sum.num_or("collective_total_ms", 0.0, 0.0, 1e12);
  s.logits_bytes = sum.int_or("logits_bytes", 0, 0, kBig);
  s.hbm_budget_bytes = sum.int_or("hbm_budget_bytes", 0, 0, kBig);
  const JsonObject cat = sum.req_obj("peak_hbm_by_category");
  s.peak.weights = cat.req_int("weights", 0, kBig);
  s.peak.gradients = cat.req_int("gradients", 0, kBig);
  s.peak.optimizer_states = cat.req_int("optimizer_states", 0, kBig);
  s.peak.activations = cat.req_int("activations", 0, kBig);
  s.peak.in_flight_copies = cat.req_int("in_flight_copies", 0, kBig);
  s.peak.logits = cat.int_or("logits", 0, 0, kBig);
  s.peak.buffers = cat.int_or("buffers", 0, 0, kBig);
  s.state.zero = r.zero;
  s.state.optimizer_offload = r.optimizer_offload;
  s.state.grad_offload = r.grad_offload;
  if (sum.has("training_state")) {
    const JsonObject ts = sum.req_obj("training_state");
    s.state.state_params = ts.int_or("state_params", 0, 0, kBig);
    s.state.host_state_bytes = ts.int_or("host_state_bytes", 0, 0, kBig);
    s.state.device_buckets = static_cast<int>(ts.int_or("device_buckets", 0, 0, 1 << 24));
    s.state.cast_on_host = ts.bool_or("cast_on_host", true);
    s.state.optimizer_ms = ts.num_or("optimizer_ms", 0.0, 0.0, 1e12);
    s.state.optimizer_total_ms = ts.num_or("optimizer_total_ms", 0.0, 0.0, 1e12);
    s.state.loss_chunk_tokens = ts.int_or("loss_chunk_tokens", 0, 0, kBig);
    s.state.loss_recompute_ms = ts.num_or("loss_recompute_ms", 0.0, 0.0, 1e9);
  }
  return plan;
}

}  // namespace

Plan load_plan_json(const std::string& path, PlanRequest* request) {
  return parse_plan_document(load_json_file(path, "plan"), path, request);
}

Plan parse_plan_json(std::string_view text, const std::string& path, PlanRequest* request) {
  return parse_plan_document(parse_json_text(text, "plan", path), path, request);
}

void check_plan_matches(const Plan& plan, const PlanRequest& planned, const PlanRequest& used,
                        std::string_view plan_name) {
  const ShardShape& a = planned.work.shape;
  const ShardShape& b = used.work.shape;
  // The model first: another model's plan differs in everything else too.
  const int64_t total = static_cast<int64_t>(used.model.layers.size());
  const int64_t pp = std::max<int64_t>(used.work.pp, 1);
  const int64_t stage = (total + pp - 1) / pp;
  if (planned.model.hidden != used.model.hidden ||
      static_cast<int64_t>(plan.layers.size()) != stage) {
    SPILLWAY_INPUT_ERROR(
        "{}: made for model \"{}\" ({} layers of hidden size {} in the first pipeline stage); used "
        "with \"{}\" ({} layers of hidden size {})",
        plan_name, planned.model.name, plan.layers.size(), planned.model.hidden, used.model.name,
        stage, used.model.hidden);
  }
  auto differ = [&](std::string_view field, const auto& made, const auto& used_value) {
    if (made != used_value) {
      SPILLWAY_INPUT_ERROR("{}: made for {} {}; used with {} {}", plan_name, field, made, field,
                           used_value);
    }
  };
  differ("micro_batch", a.micro_batch, b.micro_batch);
  differ("seq_len", a.seq_len, b.seq_len);
  differ("dtype", to_string(a.dtype), to_string(b.dtype));
  differ("tp", a.tp, b.tp);
  differ("ep", a.ep, b.ep);
  differ("cp", a.cp, b.cp);
  differ("pp", planned.work.pp, used.work.pp);
  differ("dp", planned.work.dp, used.work.dp);
  differ("fused_swiglu", a.fused_swiglu, b.fused_swiglu);
  // Layer by layer: the tensors the model saves for this workload, with their sizes.
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerPlan& l = plan.layers[i];
    if (l.index != static_cast<int>(i)) {
      SPILLWAY_INPUT_ERROR("{}: layers[{}] is layer {}; expected layer {}", plan_name, i, l.index,
                           i);
    }
    const LayerInventory inv = build_inventory(used.model.layers[i], used.model.hidden, b);
    std::vector<std::string> saved;
    for (const TensorInfo& t : inv.tensors) {
      if (t.saved) saved.push_back(t.name);
    }
    for (const TensorPlan& t : l.tensors) {
      const int k = inv.find(t.name);
      if (k < 0 || !inv.tensors[static_cast<size_t>(k)].saved) {
        SPILLWAY_INPUT_ERROR(
            "{}: layer {} tensor \"{}\" is not saved by layer {} of \"{}\" (it "
            "saves {})",
            plan_name, l.index, t.name, i, used.model.name, fmt::join(saved, ", "));
      }
      const TensorInfo& m = inv.tensors[static_cast<size_t>(k)];
      if (t.bytes != m.bytes || (!t.shape.empty() && t.shape != m.shape) ||
          (!t.dtype.empty() && t.dtype != m.dtype)) {
        SPILLWAY_INPUT_ERROR(
            "{}: layer {} tensor \"{}\" is {} bytes ({} {}); the model's is {} "
            "bytes ({} {})",
            plan_name, l.index, t.name, t.bytes, shape_text(t.shape), t.dtype, m.bytes,
            shape_text(m.shape), m.dtype);
      }
    }
    for (const std::string& name : saved) {
      const bool listed = std::any_of(l.tensors.begin(), l.tensors.end(),
                                      [&](const TensorPlan& t) { return t.name == name; });
      if (!listed) {
        SPILLWAY_INPUT_ERROR("{}: layer {} lacks tensor \"{}\", which layer {} of \"{}\" saves",
                             plan_name, l.index, name, i, used.model.name);
      }
    }
  }
}

}  // namespace spillway

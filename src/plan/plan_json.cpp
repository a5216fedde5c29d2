// The plan as JSON, schema spillway.plan/1 (documented field by field in
// docs/plan-schema.md). Bytes are integers, times are milliseconds.
#include <fmt/format.h>

#include <cmath>

#include "core/json_io.hpp"
#include "spillway/plan.hpp"

namespace spillway {

namespace {
// JSON has no infinity: a margin with nothing offloaded is written as null.
Json finite_or_null(double v) {
  return std::isfinite(v) ? Json(v) : Json(nullptr);
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
                   {"tokens_per_gpu", plan.tokens_per_gpu}};
  j["options"] = {{"strategy", to_string(r.strategy)},
                  {"margin", r.margin},
                  {"keep_last_layers", r.keep_last_layers},
                  {"prefetch_depth", r.prefetch_depth},
                  {"calibration", plan.summary.calibration},
                  {"time_scale", plan.summary.time_scale},
                  {"efficiency",
                   {{"gemm", r.efficiency.gemm},
                    {"attention", r.efficiency.attention},
                    {"hbm", r.efficiency.hbm}}}};
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
                     {"bwd_ms", o.bwd_ms}});
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
                      {"tensors", tensors},
                      {"ops", ops}});
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
                    {"in_flight_copies", m.peak.in_flight_copies}}},
                  {"host_pinned_bytes", m.host_pinned_bytes},
                  {"step_ms", m.step_ms},
                  {"recompute_step_ms", m.recompute_step_ms},
                  {"keep_step_ms", m.keep_step_ms},
                  {"speedup_vs_recompute", m.speedup_vs_recompute},
                  {"stall_ms", m.stall_ms},
                  {"head_ms", m.head_ms},
                  {"logits_bytes", m.logits_bytes}};
  return j.dump(2) + "\n";
}

Plan load_plan_json(const std::string& path, PlanRequest* request) {
  constexpr const char* kWhat = "plan";
  const Json doc = load_json_file(path, kWhat);
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
                     Policy::kHybrid}) {
      if (to_string(v) == p) return v;
    }
    l.fail("policy",
           fmt::format("is \"{}\"; must be keep, recompute, offload, selective or hybrid", p));
  };
  for (const JsonObject& l : root.obj_array("layers")) {
    LayerPlan lp;
    lp.index = static_cast<int>(l.req_int("index", 0, 1 << 24));
    lp.block = l.str_or("block", "");
    lp.policy = policy_of(l);
    lp.fwd_ms = l.req_num("fwd_ms", 0.0, 1e9);
    lp.bwd_ms = l.req_num("bwd_ms", 0.0, 1e9);
    lp.recompute_ms = l.req_num("recompute_ms", 0.0, 1e9);
    lp.params = l.int_or("params", 0, 0, kBig);
    for (const JsonObject& o : l.obj_array("ops")) {
      OpPlan op;
      op.name = o.req_str("name");
      op.kind = parse_op_kind(o.str_or("kind", "gemm"));
      op.fwd_ms = o.req_num("fwd_ms", 0.0, 1e9);
      op.bwd_ms = o.num_or("bwd_ms", 0.0, 0.0, 1e9);
      op.fwd_flops = o.num_or("fwd_flops", 0.0, 0.0, 1e30);
      op.fwd_bytes = o.int_or("fwd_bytes", 0, 0, kBig);
      lp.ops.push_back(std::move(op));
    }
    if (lp.ops.empty()) l.fail("ops", "is missing or empty; the simulator needs the layer's ops");
    for (const JsonObject& t : l.obj_array("tensors")) {
      TensorPlan tp;
      tp.name = t.req_str("name");
      tp.bytes = t.req_int("bytes", 0, kBig);
      tp.action = action_of(t);
      tp.producer =
          static_cast<int>(t.req_int("producer", -1, static_cast<int64_t>(lp.ops.size()) - 1));
      tp.produced_at_ms = t.num_or("produced_at_ms", 0.0, 0.0, 1e9);
      tp.dtype = t.str_or("dtype", "");
      if (tp.action == Action::kOffload) lp.offload_bytes += tp.bytes;
      if (tp.action == Action::kKeep) lp.kept_bytes += tp.bytes;
      lp.tensors.push_back(std::move(tp));
    }
    plan.layers.push_back(std::move(lp));
  }
  if (plan.layers.empty()) root.fail("layers", "is missing or empty");
  const JsonObject sum = root.req_obj("summary");
  PlanSummary& s = plan.summary;
  s.feasible = sum.bool_or("feasible", true);
  s.step_ms = sum.num_or("step_ms", 0.0, 0.0, 1e12);
  s.recompute_step_ms = sum.num_or("recompute_step_ms", 0.0, 0.0, 1e12);
  s.head_ms = sum.num_or("head_ms", 0.0, 0.0, 1e9);
  s.logits_bytes = sum.int_or("logits_bytes", 0, 0, kBig);
  s.hbm_budget_bytes = sum.int_or("hbm_budget_bytes", 0, 0, kBig);
  const JsonObject cat = sum.req_obj("peak_hbm_by_category");
  s.peak.weights = cat.req_int("weights", 0, kBig);
  s.peak.gradients = cat.req_int("gradients", 0, kBig);
  s.peak.optimizer_states = cat.req_int("optimizer_states", 0, kBig);
  s.peak.activations = cat.req_int("activations", 0, kBig);
  s.peak.in_flight_copies = cat.req_int("in_flight_copies", 0, kBig);
  return plan;
}

}  // namespace spillway

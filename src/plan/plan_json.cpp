// The plan as JSON, schema spillway.plan/1 (documented field by field in
// docs/plan-schema.md). Bytes are integers, times are milliseconds.
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
                   {"hbm_gb", r.hardware.hbm_gb}};
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
                  {"stall_ms", m.stall_ms}};
  return j.dump(2) + "\n";
}

}  // namespace spillway

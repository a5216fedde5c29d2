// libFuzzer target for the config loaders and what consumes them.
//
// Arbitrary bytes go to parse_json_text, then to parse_model_config and to
// parse_hardware_profile. A model that parses goes on to parameter_count, build_inventory
// (small shard shape) and make_plan (tiny workload, embedded "gh200" profile, a strategy
// picked by the input); a hardware profile that parses plans a small built-in model.
// The only allowed failure is spillway::Error without an internal check in its message;
// anything else (a crash, UB, another exception, a non-finite step time) is a finding.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/json_io.hpp"
#include "fuzz_support.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/inventory.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace {

using spillway::Json;

// Plans of huge stacks are valid but slow (the loader accepts up to 100000 layers); the
// planner is exercised on stacks up to this size to keep the fuzzer fast.
constexpr size_t kMaxPlanLayers = 256;

[[noreturn]] void finding(const char* what, const std::string& detail) {
  fuzz_support::finding("fuzz_model_config", what, detail);
}
void accept_error(const spillway::Error& e) {
  fuzz_support::accept_error("fuzz_model_config", e);
}

const spillway::HardwareProfile& gh200() {
  static const spillway::HardwareProfile h = spillway::load_hardware("gh200");
  return h;
}

const spillway::ModelConfig& small_model() {
  static const spillway::ModelConfig m = spillway::parse_model_config(
      Json::parse(R"({"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 4,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                      "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 128, "intermediate_size": 512,
                      "mlp_only_layers": [0]})"),
      "fuzz-small", "fuzz-small.json");
  return m;
}

void check_plan(const spillway::Plan& p, const spillway::PlanRequest& r) {
  const spillway::PlanSummary& s = p.summary;
  if (!std::isfinite(s.step_ms) || !(s.step_ms > 0.0)) {
    finding("non-finite or non-positive step time", std::to_string(s.step_ms));
  }
  if (!std::isfinite(s.speedup_vs_recompute)) {
    finding("non-finite speedup", std::to_string(s.speedup_vs_recompute));
  }
  if (p.layers.empty()) finding("plan without layers", r.model.name);
  (void)spillway::plan_to_json(p, r);
  (void)spillway::format_plan_report(p, r);
}

void plan_model(const spillway::ModelConfig& m, uint64_t pick) {
  if (m.layers.size() > kMaxPlanLayers) return;
  spillway::PlanRequest r;
  r.model = m;
  r.hardware = gh200();
  r.work.shape.micro_batch = 1;
  r.work.shape.seq_len = 128;
  r.strategy = static_cast<spillway::Policy>(pick % 6);
  r.work.shape.fused_swiglu = (pick / 6) % 2 == 1;
  try {
    check_plan(spillway::make_plan(r), r);
  } catch (const spillway::Error& e) {
    accept_error(e);
  }
}

void plan_hardware(const spillway::HardwareProfile& h, uint64_t pick) {
  spillway::PlanRequest r;
  r.model = small_model();
  r.hardware = h;
  r.work.shape.micro_batch = 1;
  r.work.shape.seq_len = 256;
  r.strategy = static_cast<spillway::Policy>(pick % 6);
  try {
    check_plan(spillway::make_plan(r), r);
  } catch (const spillway::Error& e) {
    accept_error(e);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  uint64_t pick = 0;
  for (size_t i = 0; i < size; ++i) pick = pick * 31 + data[i];

  Json doc;
  try {
    doc = spillway::parse_json_text(text, "model config", "fuzz.json");
  } catch (const spillway::Error& e) {
    accept_error(e);
    return 0;
  }

  try {
    const spillway::HardwareProfile h = spillway::parse_hardware_profile(doc, "fuzz.json");
    plan_hardware(h, pick);
  } catch (const spillway::Error& e) {
    accept_error(e);
  }

  spillway::ModelConfig m;
  try {
    m = spillway::parse_model_config(doc, "fuzz", "fuzz.json");
  } catch (const spillway::Error& e) {
    accept_error(e);
    return 0;
  }
  if (m.layers.empty()) finding("model without layers", m.model_type);

  try {
    (void)spillway::parameter_count(m);
    (void)spillway::active_parameter_count(m);
    spillway::ShardShape shape;
    shape.micro_batch = 1;
    shape.seq_len = 64;
    shape.fused_swiglu = pick % 2 == 1;
    const spillway::LayerSpec* last = nullptr;
    for (const spillway::LayerSpec& l : m.layers) {
      if (last != nullptr && l == *last) continue;  // distinct specs only
      last = &l;
      const spillway::LayerInventory inv = spillway::build_inventory(l, m.hidden, shape);
      // A gated MLP saves its gate's output; a layer without an MLP saves no MLP tensor
      // (Note [Block inventories]).
      const bool gated = l.mlp.kind != spillway::MlpKind::kNone && l.mlp.gated;
      if (gated && inv.find("mlp.gate_out") < 0)
        finding("inventory without mlp.gate_out", l.block_name());
      if (l.mlp.kind == spillway::MlpKind::kNone && inv.find("mlp.up_out") >= 0)
        finding("an MLP tensor in a layer without an MLP", l.block_name());
      if (inv.saved_bytes() <= 0) finding("a layer that saves nothing", l.block_name());
    }
  } catch (const spillway::Error& e) {
    accept_error(e);
  }

  plan_model(m, pick);
  return 0;
}

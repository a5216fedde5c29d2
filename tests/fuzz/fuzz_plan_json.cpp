// libFuzzer target for plan JSON read against a model and workload.
//
// Arbitrary bytes go to parse_plan_json (schema spillway.plan/1), then to
// check_plan_matches against a fixed small model (4 layers: a dense one, three MoE) and
// workload (micro-batch 1 x 128 tokens, bf16); a plan that matches goes on to
// memory_policy. The only allowed failure is spillway::Error without an internal check in
// its message; anything else (a crash, UB, another exception, a matched plan whose layers
// or tensors disagree with the model) is a finding.
//
// Seeds: with SPILLWAY_FUZZ_SEED_DIR set (scripts/run-fuzz.sh sets it to the corpus), the
// planner's own plans for the model are written there first: every strategy on the fixed
// workload (they match) and a few on other workloads (they do not).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>

#include "core/json_io.hpp"
#include "fuzz_support.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/inventory.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/policy.hpp"
#include "spillway/plan/plan.hpp"

namespace {

using spillway::Json;

[[noreturn]] void finding(const char* what, const std::string& detail) {
  fuzz_support::finding("fuzz_plan_json", what, detail);
}
void accept_error(const spillway::Error& e) {
  fuzz_support::accept_error("fuzz_plan_json", e);
}

// The model and workload every fuzzed plan is checked against.
const spillway::PlanRequest& used_with() {
  static const spillway::PlanRequest r = [] {
    spillway::PlanRequest q;
    q.model = spillway::parse_model_config(
        Json::parse(R"({"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                        "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 128, "intermediate_size": 512,
                        "mlp_only_layers": [0]})"),
        "fuzz-small", "fuzz-small.json");
    q.hardware = spillway::load_hardware("gh200");
    q.work.shape.micro_batch = 1;
    q.work.shape.seq_len = 128;
    return q;
  }();
  return r;
}

void write_seeds(const std::string& dir) {
  int n = 0;
  auto write = [&](const spillway::PlanRequest& r) {
    std::ofstream(dir + "/plan-seed-" + std::to_string(n++) + ".json")
        << spillway::plan_to_json(spillway::make_plan(r), r);
  };
  for (int s = 0; s < 6; ++s) {
    spillway::PlanRequest r = used_with();
    r.strategy = static_cast<spillway::Policy>(s);
    write(r);
  }
  spillway::PlanRequest r = used_with();
  r.work.shape.fused_swiglu = true;
  write(r);
  r = used_with();
  r.work.shape.micro_batch = 2;
  r.strategy = spillway::Policy::kOffload;
  write(r);
  r = used_with();
  r.work.pp = 2;
  write(r);
}

// A plan that check_plan_matches accepted agrees with the model, layer by layer.
void check_matched(const spillway::Plan& p) {
  const spillway::PlanRequest& r = used_with();
  if (p.layers.size() != r.model.layers.size()) {
    finding("matched plan with another layer count", std::to_string(p.layers.size()));
  }
  for (size_t i = 0; i < p.layers.size(); ++i) {
    const spillway::LayerInventory inv =
        spillway::build_inventory(r.model.layers[i], r.model.hidden, r.work.shape);
    for (const spillway::TensorPlan& t : p.layers[i].tensors) {
      const int k = inv.find(t.name);
      if (k < 0 || inv.tensors[static_cast<size_t>(k)].bytes != t.bytes) {
        finding("matched plan with a tensor the model does not save", t.name);
      }
    }
  }
  const spillway::MemoryPolicy m = spillway::memory_policy(p, "fuzz");
  if (m.layer_count() != static_cast<int64_t>(p.layers.size())) {
    finding("memory policy with another layer count", std::to_string(m.layer_count()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("SPILLWAY_FUZZ_SEED_DIR")) write_seeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  spillway::PlanRequest planned;
  spillway::Plan plan;
  try {
    plan = spillway::parse_plan_json(text, "fuzz-plan.json", &planned);
  } catch (const spillway::Error& e) {
    accept_error(e);
    return 0;
  }
  if (plan.layers.empty()) finding("loaded plan without layers", planned.model.name);
  try {
    spillway::check_plan_matches(plan, planned, used_with(), "fuzz-plan.json");
  } catch (const spillway::Error& e) {
    accept_error(e);
    return 0;
  }
  try {
    check_matched(plan);
  } catch (const spillway::Error& e) {
    accept_error(e);
  }
  return 0;
}

// Note [Named offload tensors]: a plan that states an experiment offloads exactly the
// named tensors in every layer that offloads, the rest following the strategy; names the
// model does not save, and strategies that choose their own tensors, are refused.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "plan_helpers.hpp"
#include "spillway/catalog/inventory.hpp"
#include "spillway/core/error.hpp"

namespace spillway {
namespace {

using spillway::testing::generous;
using spillway::testing::request;

const std::set<std::string> kMlp = {"mlp.gate_out", "mlp.up_out", "mlp.act"};

std::set<std::string> offloaded(const LayerPlan& l) {
  std::set<std::string> s;
  for (const TensorPlan& t : l.tensors) {
    if (t.action == Action::kOffload) s.insert(t.name);
  }
  return s;
}

// Seed 000: Qwen3-30B-A3B at micro-batch 24 x 4096 tokens, ep 8, dp 8, offloading exactly
// the three MLP activations (3.7 GB a layer in the published run); the planner's own
// offload policy also moves moe.expert_out.
PlanRequest seed000(Policy s) {
  PlanRequest r = request("Qwen3-30B-A3B", "gh200", 24, 4096, s);
  r.work.shape.ep = 8;
  r.work.dp = 8;
  return r;
}

TEST(NamedOffload, TheGroupMlpOffloadsExactlySeed000sThreeTensors) {
  PlanRequest r = seed000(Policy::kOffload);
  const Plan own = make_plan(r);
  r.offload_tensors = {"mlp"};
  const Plan p = make_plan(r);
  EXPECT_EQ(p.offload_tensors, (std::vector<std::string>{"mlp.gate_out", "mlp.up_out", "mlp.act"}));
  ASSERT_EQ(p.layers.size(), 48u);
  const int64_t tokens = int64_t{24} * 4096;
  const int64_t f_act = int64_t{8} * 768;  // top-8 of 768-wide experts
  for (size_t i = 0; i + 1 < p.layers.size(); ++i) {
    const LayerPlan& l = p.layers[i];
    EXPECT_EQ(offloaded(l), kMlp) << "layer " << i;
    EXPECT_EQ(l.offload_bytes, 3 * tokens * f_act * 2) << "layer " << i;
    EXPECT_EQ(l.policy, Policy::kOffload);
    // What is not named follows the block policy: the experts' output is recomputed.
    for (const TensorPlan& t : l.tensors) {
      if (t.name == "moe.expert_out") {
        EXPECT_EQ(t.action, Action::kRecompute);
      }
    }
    // The planner's own choice moved more.
    EXPECT_GT(own.layers[i].offload_bytes, l.offload_bytes);
    EXPECT_TRUE(offloaded(own.layers[i]).count("moe.expert_out"));
  }
  EXPECT_TRUE(offloaded(p.layers.back()).empty());  // keep_last: no window
  EXPECT_NEAR(static_cast<double>(p.layers[0].offload_bytes) / 1e9, 3.62, 0.01);
}

TEST(NamedOffload, NamesAndTheirGroupAreTheSamePlan) {
  PlanRequest a = seed000(Policy::kOffload);
  a.offload_tensors = {"mlp"};
  PlanRequest b = a;
  b.offload_tensors = {"mlp.act", "mlp.gate_out", "mlp.up_out", "mlp.act"};
  const Plan pa = make_plan(a);
  const Plan pb = make_plan(b);
  EXPECT_EQ(pa.offload_tensors, pb.offload_tensors);  // block order, no repeats
  EXPECT_EQ(plan_to_json(pa, a), plan_to_json(pb, b));
}

TEST(NamedOffload, TheRestFollowsTheStrategy) {
  for (Policy s : {Policy::kKeep, Policy::kRecompute, Policy::kOffload}) {
    SCOPED_TRACE(to_string(s));
    PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 4096, s));
    r.offload_tensors = {"mlp.up_out", "attn.out_proj_in"};
    const Plan p = make_plan(r);
    const Plan plain =
        make_plan(generous(request("Llama-3.1-8B", "gh200", 1, 4096,
                                   s == Policy::kKeep ? Policy::kKeep : Policy::kRecompute)));
    for (size_t i = 0; i < p.layers.size(); ++i) {
      const LayerPlan& l = p.layers[i];
      const bool last = i + 1 == p.layers.size();
      for (size_t k = 0; k < l.tensors.size(); ++k) {
        const TensorPlan& t = l.tensors[k];
        const bool named = t.name == "mlp.up_out" || t.name == "attn.out_proj_in";
        if (named && !last) {
          EXPECT_EQ(t.action, Action::kOffload) << i << " " << t.name;
        } else {
          // Not named (or the last layer): what the strategy alone does with it.
          EXPECT_EQ(t.action, plain.layers[i].tensors[k].action) << i << " " << t.name;
        }
      }
    }
  }
}

TEST(NamedOffload, AutoOffloadsTheNamedSetOrNothing) {
  PlanRequest r = request("Qwen3-30B-A3B", "gh200", 2, 8192, Policy::kAuto);
  r.offload_tensors = {"attn.qkv_out", "mlp.gate_out"};
  const Plan p = make_plan(r);
  int offloading = 0;
  for (const LayerPlan& l : p.layers) {
    const std::set<std::string> o = offloaded(l);
    if (o.empty()) continue;
    ++offloading;
    EXPECT_EQ(o, (std::set<std::string>{"attn.qkv_out", "mlp.gate_out"})) << l.index;
  }
  EXPECT_GT(offloading, 0);
}

TEST(NamedOffload, ASetThatMissesItsWindowIsASnowballNamedInTheReasons) {
  PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kOffload));
  r.d2h_gbps = 0.5;
  r.offload_tensors = {"mlp"};
  const Plan p = make_plan(r);
  EXPECT_FALSE(p.summary.feasible);
  EXPECT_TRUE(p.layers[0].snowball);
  EXPECT_EQ(offloaded(p.layers[0]), kMlp);  // stated, not chosen: never dropped
}

TEST(NamedOffload, UnknownNamesAreRefusedWithTheModelsNames) {
  auto refused = [](PlanRequest r, std::vector<std::string> names) -> std::string {
    r.offload_tensors = std::move(names);
    try {
      (void)make_plan(r);
    } catch (const InputError& e) {
      EXPECT_EQ(e.field(), "offload_tensors");
      return e.what();
    }
    ADD_FAILURE() << "not refused";
    return "";
  };
  const PlanRequest llama = request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kOffload);
  std::string m = refused(llama, {"mlp.gate"});
  EXPECT_NE(m.find("mlp.gate;"), std::string::npos) << m;
  EXPECT_NE(m.find("attn.input, attn.norm_out, attn.qkv_out"), std::string::npos) << m;
  EXPECT_NE(m.find("groups: attn, mlp, moe"), std::string::npos) << m;
  m = refused(llama, {"moe"});  // a dense model
  EXPECT_NE(m.find("a group with no member"), std::string::npos) << m;
  m = refused(llama, {"moe.expert_out"});
  EXPECT_NE(m.find("no tensor of that name"), std::string::npos) << m;
  m = refused(llama, {"mlp", ""});
  EXPECT_NE(m.find("empty name"), std::string::npos) << m;
  PlanRequest fused = llama;
  fused.work.shape.fused_swiglu = true;
  m = refused(fused, {"mlp.act"});
  EXPECT_NE(m.find("recomputes mlp.act"), std::string::npos) << m;
}

TEST(NamedOffload, StrategiesThatChooseTheirOwnTensorsRefuseANamedSet) {
  for (Policy s : {Policy::kSelective, Policy::kHybrid, Policy::kCheckpoint}) {
    PlanRequest r = request("Llama-3.1-8B", "gh200", 1, 4096, s);
    r.offload_tensors = {"mlp"};
    try {
      (void)make_plan(r);
      ADD_FAILURE() << to_string(s) << " took a named set";
    } catch (const InputError& e) {
      EXPECT_EQ(e.field(), "strategy");
      EXPECT_EQ(e.value(), to_string(s));
    }
  }
}

TEST(NamedOffload, GroupsAreASubBlocksTensorsButItsInputAndNorm) {
  EXPECT_TRUE(in_offload_group("mlp", "mlp.gate_out"));
  EXPECT_TRUE(in_offload_group("mlp", "mlp.act"));
  EXPECT_FALSE(in_offload_group("mlp", "mlp.input"));
  EXPECT_FALSE(in_offload_group("mlp", "mlp.norm_out"));
  EXPECT_FALSE(in_offload_group("mlp", "moe.expert_out"));
  EXPECT_FALSE(in_offload_group("ml", "mlp.act"));
  EXPECT_TRUE(in_offload_group("attn", "attn.core_lse"));
  EXPECT_FALSE(in_offload_group("attn", "attn.input"));
  EXPECT_TRUE(in_offload_group("moe", "moe.topk_idx"));
  EXPECT_TRUE(in_offload_group("ssm", "ssm.scan_out"));
  // A hybrid model: the Mamba layers offload their named scan output, the attention layers
  // their named MLP tensors; a layer saving none of the names offloads nothing.
  PlanRequest r = generous(request("Jamba-Mini-1.5", "gh200", 1, 4096, Policy::kRecompute));
  r.offload_tensors = {"ssm.in_proj_out", "mlp.up_out"};
  const Plan p = make_plan(r);
  for (size_t i = 0; i + 1 < p.layers.size(); ++i) {
    std::set<std::string> want;
    for (const TensorPlan& t : p.layers[i].tensors) {
      if (t.name == "ssm.in_proj_out" || t.name == "mlp.up_out") want.insert(t.name);
    }
    EXPECT_EQ(offloaded(p.layers[i]), want) << i;
  }
}

TEST(NamedOffload, ThePlanFileCarriesTheNamesAndReadsThemBack) {
  PlanRequest r = seed000(Policy::kOffload);
  r.offload_tensors = {"mlp"};
  const Plan p = make_plan(r);
  const std::string json = plan_to_json(p, r);
  EXPECT_NE(json.find("\"offload_tensors\""), std::string::npos);
  PlanRequest back;
  const Plan q = parse_plan_json(json, "plan.json", &back);
  EXPECT_EQ(back.offload_tensors, p.offload_tensors);
  EXPECT_EQ(q.offload_tensors, p.offload_tensors);
  // A plan without names writes no field (files of before stay byte for byte).
  PlanRequest plain = seed000(Policy::kOffload);
  EXPECT_EQ(plan_to_json(make_plan(plain), plain).find("offload_tensors"), std::string::npos);
}

}  // namespace
}  // namespace spillway

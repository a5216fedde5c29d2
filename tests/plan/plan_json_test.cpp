// The plan as JSON (schema spillway.plan/1, docs/plan-schema.md) and the human report:
// the JSON parses, carries every documented field with its type, agrees with the Plan it
// was written from, and holds no NaN or infinity. Read back, a plan must hold together
// (layers in order, known tensor names, bytes = shape x dtype) and match the model and
// workload it is used with (check_plan_matches).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <set>
#include <tuple>

#include "core/json_io.hpp"
#include "plan_helpers.hpp"
#include "spillway/plan/collectives.hpp"
#include "spillway/sim/sim.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::describe;
using spillway::testing::generous;
using spillway::testing::request;

const std::set<std::string> kActions = {"keep", "offload", "recompute"};
const std::set<std::string> kPolicies = {"keep", "recompute", "offload", "selective", "hybrid"};
const std::set<std::string> kBlocks = {"gqa+dense", "gqa+moe", "swa+dense",    "swa+moe",
                                       "mla+dense", "mla+moe", "gqa+moe+dense"};

void expect_fields(const Json& obj, std::initializer_list<const char*> keys,
                   const std::string& where) {
  ASSERT_TRUE(obj.is_object()) << where;
  for (const char* k : keys) EXPECT_TRUE(obj.contains(k)) << where << " lacks \"" << k << "\"";
}

// Every number in the document is finite: nlohmann writes NaN and infinity as null, so
// a null is only allowed where the schema says so (layers[].margin).
void expect_no_null(const Json& j, const std::string& path) {
  if (j.is_null()) {
    ADD_FAILURE() << "null at " << path;
  } else if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "margin" && it->is_null()) continue;
      expect_no_null(*it, path + "." + it.key());
    }
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i)
      expect_no_null(j[i], path + "[" + std::to_string(i) + "]");
  }
}

void check_plan_json(const PlanRequest& r) {
  SCOPED_TRACE(describe(r));
  const Plan p = make_plan(r);
  const std::string text = plan_to_json(p, r);
  Json j;
  ASSERT_NO_THROW(j = Json::parse(text));
  EXPECT_EQ(j.value("schema", ""), "spillway.plan/1");
  EXPECT_TRUE(j["generator"].is_string());
  expect_fields(
      j, {"schema", "generator", "model", "hardware", "workload", "options", "layers", "summary"},
      "top level");
  expect_fields(
      j["model"],
      {"name", "model_type", "source", "layers", "hidden_size", "params", "params_per_gpu"},
      "model");
  expect_fields(j["hardware"], {"name", "source", "d2h_gbps", "h2d_gbps", "hbm_gb"}, "hardware");
  expect_fields(j["workload"],
                {"micro_batch", "seq_len", "dtype", "tp", "ep", "cp", "pp", "dp", "grad_accum",
                 "fused_swiglu", "tokens_per_gpu"},
                "workload");
  expect_fields(
      j["options"],
      {"strategy", "margin", "keep_last_layers", "prefetch_depth", "calibration", "time_scale",
       "efficiency", "zero", "optimizer_offload", "grad_offload", "loss_chunk"},
      "options");
  EXPECT_EQ(j["model"]["name"], r.model.name);
  EXPECT_EQ(j["model"]["params"].get<int64_t>(), p.params_total);
  EXPECT_EQ(j["options"]["strategy"], to_string(r.strategy));
  EXPECT_DOUBLE_EQ(j["options"]["margin"].get<double>(), r.margin);
  EXPECT_EQ(j["workload"]["micro_batch"].get<int64_t>(), r.work.shape.micro_batch);
  EXPECT_EQ(j["workload"]["tokens_per_gpu"].get<int64_t>(), p.tokens_per_gpu);
  EXPECT_DOUBLE_EQ(j["hardware"]["d2h_gbps"].get<double>(), p.summary.d2h_gbps);

  const Json& layers = j["layers"];
  ASSERT_TRUE(layers.is_array());
  ASSERT_EQ(layers.size(), p.layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const Json& l = layers[i];
    const std::string where = "layers[" + std::to_string(i) + "]";
    expect_fields(l,
                  {"index", "block", "policy", "fwd_ms", "bwd_ms", "recompute_ms",
                   "recompute_avoided_ms", "offload_bytes", "kept_bytes", "d2h_ms", "window_ms",
                   "margin", "h2d_ms", "stall_ms", "backlog_bytes", "snowball", "tensors"},
                  where);
    EXPECT_TRUE(l["index"].is_number_integer()) << where;
    EXPECT_EQ(l["index"].get<int>(), static_cast<int>(i));
    EXPECT_TRUE(kBlocks.count(l["block"].get<std::string>())) << where << " " << l["block"];
    EXPECT_TRUE(kPolicies.count(l["policy"].get<std::string>())) << where << " " << l["policy"];
    EXPECT_TRUE(l["offload_bytes"].is_number_integer()) << where;
    EXPECT_TRUE(l["kept_bytes"].is_number_integer()) << where;
    EXPECT_TRUE(l["d2h_ms"].is_number()) << where;
    EXPECT_TRUE(l["window_ms"].is_number()) << where;
    EXPECT_TRUE(l["snowball"].is_boolean()) << where;
    const int64_t off = l["offload_bytes"].get<int64_t>();
    EXPECT_EQ(off, p.layers[i].offload_bytes);
    EXPECT_EQ(l["snowball"].get<bool>(), p.layers[i].snowball);
    EXPECT_EQ(l["margin"].is_null(), off == 0)
        << where << ": margin is null iff nothing is offloaded";
    ASSERT_TRUE(l["tensors"].is_array()) << where;
    ASSERT_FALSE(l["tensors"].empty()) << where;
    int64_t offloaded = 0;
    int64_t kept = 0;
    std::set<std::string> names;
    for (const Json& t : l["tensors"]) {
      expect_fields(t,
                    {"name", "shape", "dtype", "bytes", "action", "recompute_ms", "produced_at_ms"},
                    where + ".tensors[]");
      const std::string name = t["name"].get<std::string>();
      EXPECT_TRUE(names.insert(name).second) << where << " repeats " << name;
      EXPECT_TRUE(t["bytes"].is_number_integer()) << name;
      EXPECT_GT(t["bytes"].get<int64_t>(), 0) << name;
      ASSERT_TRUE(t["shape"].is_array()) << name;
      EXPECT_EQ(t["shape"].size(), 2u) << name;
      const std::string action = t["action"].get<std::string>();
      EXPECT_TRUE(kActions.count(action)) << name << " " << action;
      if (action == "offload") offloaded += t["bytes"].get<int64_t>();
      if (action == "keep") kept += t["bytes"].get<int64_t>();
    }
    EXPECT_EQ(offloaded, off) << where << ": offload_bytes is the sum of the offloaded tensors";
    EXPECT_EQ(kept, l["kept_bytes"].get<int64_t>()) << where;
  }

  const Json& s = j["summary"];
  expect_fields(s,
                {"feasible", "reasons", "peak_hbm_bytes", "hbm_budget_bytes",
                 "peak_hbm_by_category", "host_pinned_bytes", "step_ms", "recompute_step_ms",
                 "keep_step_ms", "speedup_vs_recompute", "stall_ms", "training_state"},
                "summary");
  EXPECT_TRUE(s["feasible"].is_boolean());
  EXPECT_EQ(s["feasible"].get<bool>(), p.summary.feasible);
  ASSERT_TRUE(s["reasons"].is_array());
  EXPECT_EQ(s["reasons"].size(), p.summary.reasons.size());
  EXPECT_EQ(s["feasible"].get<bool>(), s["reasons"].empty());
  const Json& cat = s["peak_hbm_by_category"];
  expect_fields(cat,
                {"weights", "gradients", "optimizer_states", "activations", "logits", "buffers",
                 "in_flight_copies"},
                "peak_hbm_by_category");
  int64_t sum = 0;
  for (const char* k : {"weights", "gradients", "optimizer_states", "activations", "logits",
                        "buffers", "in_flight_copies"}) {
    EXPECT_TRUE(cat[k].is_number_integer()) << k;
    sum += cat[k].get<int64_t>();
  }
  EXPECT_EQ(s["peak_hbm_bytes"].get<int64_t>(), sum);
  EXPECT_EQ(s["peak_hbm_bytes"].get<int64_t>(), p.summary.peak.total());
  EXPECT_DOUBLE_EQ(s["step_ms"].get<double>(), p.summary.step_ms);
  EXPECT_DOUBLE_EQ(s["speedup_vs_recompute"].get<double>(),
                   s["recompute_step_ms"].get<double>() / s["step_ms"].get<double>());
  expect_no_null(j, "$");
}

TEST(PlanJson, EveryStrategyWritesTheSchema) {
  for (Policy s : {Policy::kAuto, Policy::kKeep, Policy::kRecompute, Policy::kOffload,
                   Policy::kSelective, Policy::kHybrid}) {
    check_plan_json(request("Qwen3-30B-A3B", "gh200", 1, 4096, s));
    check_plan_json(generous(request("Llama-3.1-8B", "h100-sxm", 2, 4096, s)));
  }
}

TEST(PlanJson, MixedStacksAndInfeasiblePlans) {
  PlanRequest ds = request("DeepSeek-V3", "gb200", 1, 4096, Policy::kAuto);
  ds.work.pp = 16;
  ds.work.shape.tp = 8;
  ds.work.shape.ep = 8;
  check_plan_json(ds);
  check_plan_json(request("GPT-OSS-20B", "b200", 1, 8192, Policy::kSelective));
  check_plan_json(request("Grok-2", "rubin", 1, 4096, Policy::kHybrid));
  PlanRequest slow = generous(request("Mixtral-8x7B", "gh200", 1, 4096, Policy::kOffload));
  slow.d2h_gbps = 1.0;  // every offloading layer snowballs
  check_plan_json(slow);
  const Plan p = make_plan(slow);
  EXPECT_FALSE(p.summary.feasible);
  const Json j = Json::parse(plan_to_json(p, slow));
  EXPECT_FALSE(j["summary"]["reasons"].empty());
  EXPECT_TRUE(j["layers"][0]["snowball"].get<bool>());
}

TEST(PlanJson, FusedPlansHaveNoActTensor) {
  PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kOffload));
  r.work.shape.fused_swiglu = true;
  check_plan_json(r);
  const Json j = Json::parse(plan_to_json(make_plan(r), r));
  EXPECT_TRUE(j["workload"]["fused_swiglu"].get<bool>());
  for (const Json& l : j["layers"]) {
    for (const Json& t : l["tensors"]) EXPECT_NE(t["name"], "mlp.act");
  }
}

TEST(PlanReport, TableSummaryAndReasons) {
  PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kOffload));
  r.d2h_gbps = 2.0;
  const Plan p = make_plan(r);
  const std::string text = format_plan_report(p, r);
  for (const char* s : {"spillway plan: Llama-3.1-8B on gh200 (policy offload)", "layer", "block",
                        "policy", "summary", "feasible", "NO", "SNOWBALL", "peak HBM", "weights",
                        "activations", "in-flight copies", "step time", "speedup"}) {
    EXPECT_NE(text.find(s), std::string::npos) << "report lacks [" << s << "]\n" << text;
  }
  for (const std::string& reason : p.summary.reasons)
    EXPECT_NE(text.find(reason), std::string::npos);

  const PlanRequest ok = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kRecompute));
  const std::string ok_text = format_plan_report(make_plan(ok), ok);
  EXPECT_EQ(ok_text.find("SNOWBALL"), std::string::npos);
  EXPECT_NE(ok_text.find("yes"), std::string::npos);
}

// Plans read back: load_plan_json refuses a plan that does not hold together, and
// check_plan_matches one made for another model or workload. `mutate` edits the JSON the
// planner wrote; the error must hold every string of `message`.
struct Mutated {
  PlanRequest planned;
  Plan plan;
};

std::string plan_text(const PlanRequest& r) {
  return plan_to_json(make_plan(r), r);
}

Mutated read_back(const std::string& text) {
  Mutated m;
  m.plan = parse_plan_json(text, "plan.json", &m.planned);
  return m;
}

std::string load_error(const PlanRequest& r, const std::function<void(Json&)>& mutate) {
  Json j = Json::parse(plan_text(r));
  mutate(j);
  try {
    (void)read_back(j.dump());
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

std::string match_error(const Mutated& m, const PlanRequest& used) {
  try {
    check_plan_matches(m.plan, m.planned, used, "plan.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

void expect_holds(const std::string& message, std::initializer_list<const char*> parts) {
  for (const char* p : parts)
    EXPECT_NE(message.find(p), std::string::npos) << "[" << p << "] in: " << message;
}

PlanRequest small_moe() {
  return generous(request("Qwen3-30B-A3B", "gh200", 2, 1024, Policy::kAuto));
}

TEST(PlanJsonCheck, APlanMatchesTheRequestItWasMadeFor) {
  PlanRequest ds = request("DeepSeek-V3", "gb200", 1, 4096, Policy::kAuto);
  ds.work.pp = 16;
  ds.work.shape.tp = 8;
  ds.work.shape.ep = 8;
  PlanRequest fused = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kOffload));
  fused.work.shape.fused_swiglu = true;
  for (const PlanRequest& r :
       {small_moe(), ds, fused, request("GPT-OSS-20B", "b200", 1, 8192, Policy::kSelective)}) {
    SCOPED_TRACE(describe(r));
    const Mutated m = read_back(plan_text(r));
    EXPECT_EQ(match_error(m, r), "(accepted)");
  }
  // Through a file too.
  testing::TempDir dir;
  const std::string path = dir.file("plan.json");
  std::ofstream(path) << plan_text(small_moe());
  PlanRequest back;
  const Plan p = load_plan_json(path, &back);
  EXPECT_NO_THROW(check_plan_matches(p, back, small_moe(), path));
}

TEST(PlanJsonCheck, ADroppedLayerIsRefused) {
  const std::string e = load_error(small_moe(), [](Json& j) { j["layers"].erase(3); });
  expect_holds(e, {"layers[3].index", "is 4", "layer 3 is missing"});
  // The last one: the count no longer matches the model's.
  const std::string last = load_error(small_moe(), [](Json& j) { j["layers"].erase(47); });
  expect_holds(last, {"layers", "47 entries", "48 layers", "has 48"});
}

TEST(PlanJsonCheck, ADuplicatedLayerIsRefused) {
  const std::string e = load_error(small_moe(), [](Json& j) {
    Json& l = j["layers"];
    l.insert(l.begin() + 3, l[2]);
    l.erase(48);
  });
  expect_holds(e, {"layers[3].index", "is 2", "layer 2 is listed twice"});
}

TEST(PlanJsonCheck, AnUnknownOrRepeatedTensorIsRefused) {
  const std::string unknown =
      load_error(small_moe(), [](Json& j) { j["layers"][1]["tensors"][2]["name"] = "mlp.bogus"; });
  expect_holds(unknown, {"layers[1].tensors[2].name", "\"mlp.bogus\"", "not a tensor name"});
  // A MoE tensor in a dense layer of another model.
  const PlanRequest dense = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kOffload));
  const std::string moe =
      load_error(dense, [](Json& j) { j["layers"][0]["tensors"][1]["name"] = "moe.topk_idx"; });
  expect_holds(moe, {"layers[0].tensors[1].name", "\"moe.topk_idx\"", "gqa+dense"});
  const std::string twice = load_error(small_moe(), [](Json& j) {
    Json& t = j["layers"][5]["tensors"];
    t[1]["name"] = t[0]["name"];
  });
  expect_holds(twice, {"layers[5].tensors[1].name", "\"attn.input\" again"});
}

TEST(PlanJsonCheck, BytesThatDisagreeWithShapeAndDtypeAreRefused) {
  int64_t bytes = 0;
  const std::string e = load_error(small_moe(), [&](Json& j) {
    Json& t = j["layers"][2]["tensors"][0];
    bytes = t["bytes"].get<int64_t>();
    t["bytes"] = bytes + 2;
  });
  // attn.input: (T/tp, d) = (2 * 1024, 2048) bf16.
  EXPECT_EQ(bytes, 2048 * 2048 * 2);
  expect_holds(
      e, {"layers[2].tensors[0].bytes", "is 8388610", "shape [2048, 2048] bf16", "8388608 bytes"});
  const std::string dtype =
      load_error(small_moe(), [](Json& j) { j["layers"][2]["tensors"][0]["dtype"] = "fp4"; });
  expect_holds(dtype, {"layers[2].tensors[0].dtype", "\"fp4\""});
}

TEST(PlanJsonCheck, APlanForAnotherMicroBatchOrWorkloadIsRefused) {
  const Mutated m = read_back(plan_text(small_moe()));
  PlanRequest used = small_moe();
  used.work.shape.micro_batch = 4;
  EXPECT_EQ(match_error(m, used), "plan.json: made for micro_batch 2; used with micro_batch 4");
  used = small_moe();
  used.work.shape.seq_len = 2048;
  EXPECT_EQ(match_error(m, used), "plan.json: made for seq_len 1024; used with seq_len 2048");
  used = small_moe();
  used.work.shape.ep = 8;
  EXPECT_EQ(match_error(m, used), "plan.json: made for ep 1; used with ep 8");
  used = small_moe();
  used.work.shape.dtype = DType::kFp32;
  EXPECT_EQ(match_error(m, used), "plan.json: made for dtype bf16; used with dtype fp32");
  used = small_moe();
  used.work.shape.fused_swiglu = true;
  EXPECT_EQ(match_error(m, used),
            "plan.json: made for fused_swiglu false; used with fused_swiglu true");
}

TEST(PlanJsonCheck, APlanForAnotherModelIsRefused) {
  const Mutated m = read_back(plan_text(small_moe()));
  const PlanRequest llama = generous(request("Llama-3.1-8B", "gh200", 2, 1024, Policy::kAuto));
  expect_holds(match_error(m, llama),
               {"plan.json: made for model \"Qwen3-30B-A3B\" (48 layers", "hidden size 2048",
                "used with \"Llama-3.1-8B\" (32 layers", "hidden size 4096"});
}

TEST(PlanJsonCheck, TensorsThatDisagreeWithTheModelAreRefused) {
  // Consistent in itself (bytes = shape x dtype), but not this model's mlp.act.
  Json j = Json::parse(plan_text(small_moe()));
  Json* act = nullptr;
  for (Json& t : j["layers"][3]["tensors"]) {
    if (t["name"] == "mlp.act") act = &t;
  }
  ASSERT_NE(act, nullptr);
  const int64_t rows = (*act)["shape"][0].get<int64_t>();
  const int64_t cols = (*act)["shape"][1].get<int64_t>();
  (*act)["shape"][1] = cols / 2;
  (*act)["bytes"] = rows * (cols / 2) * 2;
  const Mutated m = read_back(j.dump());
  expect_holds(match_error(m, small_moe()),
               {"plan.json: layer 3 tensor \"mlp.act\" is",
                fmt::format("[{}, {}] bf16); the model's is", rows, cols / 2).c_str(),
                fmt::format("[{}, {}] bf16)", rows, cols).c_str()});
  // A tensor the model saves is missing from the plan.
  Json k = Json::parse(plan_text(small_moe()));
  k["layers"][4]["tensors"].erase(1);
  expect_holds(match_error(read_back(k.dump()), small_moe()),
               {"plan.json: layer 4 lacks tensor \"attn.norm_out\""});
  // A tensor the model does not save (mlp.act under a fused SwiGLU backward).
  PlanRequest fused = small_moe();
  fused.work.shape.fused_swiglu = true;
  Mutated unfused_plan = read_back(plan_text(small_moe()));
  unfused_plan.planned.work.shape.fused_swiglu = true;  // the workload agrees, the tensors not
  expect_holds(match_error(unfused_plan, fused), {"tensor \"mlp.act\" is not saved by layer 0"});
}

// Each layer's collectives are written and read back field for field; a plan without the
// array (written before it existed) reads as none; bad entries are named by field, value
// and file.
TEST(PlanJsonCollectives, RoundTripAbsentAndBadEntries) {
  const PlanRequest r = small_moe();
  Plan p = make_plan(r);
  const CollectiveLink nvl = collective_link(r.hardware, 8, 1);
  p.layers[0].collectives.push_back(make_collective(CollectiveKind::kAllToAll, "ep.dispatch", false,
                                                    123456789, 8, {"nvlink", 450.0}, 5.0));
  p.layers[0].collectives.push_back(make_collective(CollectiveKind::kAllToAll, "ep.combine", false,
                                                    123456789, 8, {"nvlink", 450.0}, 5.0));
  p.layers[3].collectives.push_back(make_collective(
      CollectiveKind::kReduceScatter, "dp.grad_reduce", true, int64_t{3} << 30, 64, nvl, 5.0));
  p.layers[5].collectives.push_back(make_collective(
      CollectiveKind::kAllGather, "zero.weight_gather", false, 7, 2, {"host", 52.0}, 10.0));
  const std::string text = plan_to_json(p, r);
  const Mutated m = read_back(text);
  ASSERT_EQ(m.plan.layers.size(), p.layers.size());
  for (size_t l = 0; l < p.layers.size(); ++l) {
    const std::vector<CollectivePlan>& a = p.layers[l].collectives;
    const std::vector<CollectivePlan>& b = m.plan.layers[l].collectives;
    ASSERT_EQ(a.size(), b.size()) << "layer " << l;
    for (size_t k = 0; k < a.size(); ++k) {
      EXPECT_EQ(a[k].kind, b[k].kind);
      EXPECT_EQ(a[k].what, b[k].what);
      EXPECT_EQ(a[k].backward, b[k].backward);
      EXPECT_EQ(a[k].bytes, b[k].bytes);
      EXPECT_EQ(a[k].group, b[k].group);
      EXPECT_EQ(a[k].link, b[k].link);
      EXPECT_EQ(a[k].gbps, b[k].gbps);
      EXPECT_EQ(a[k].ms, b[k].ms);
      EXPECT_EQ(a[k].exposed, b[k].exposed);
    }
  }
  Json j = Json::parse(text);
  EXPECT_EQ(j["layers"][0]["collectives"][0]["kind"], "all-to-all");
  EXPECT_TRUE(j["layers"][1]["collectives"].is_array());
  EXPECT_TRUE(j["layers"][1]["collectives"].empty());
  // Old plans: no array at all.
  for (Json& l : j["layers"]) l.erase("collectives");
  const Mutated old = read_back(j.dump());
  for (const LayerPlan& l : old.plan.layers) EXPECT_TRUE(l.collectives.empty());
  // Bad entries.
  auto bad = [&](const char* key, Json value) {
    Json k = Json::parse(text);
    k["layers"][3]["collectives"][0][key] = std::move(value);
    try {
      (void)read_back(k.dump());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  expect_holds(bad("kind", "allreduce"),
               {"\"layers[3].collectives[0].kind\" is \"allreduce\"", "(file: plan.json)"});
  expect_holds(bad("link", "pcie"), {"\"layers[3].collectives[0].link\" is \"pcie\""});
  expect_holds(bad("group", 0), {"\"layers[3].collectives[0].group\" is 0"});
  expect_holds(bad("bytes", -5), {"\"layers[3].collectives[0].bytes\" is -5"});
  expect_holds(bad("gbps", 0), {"\"layers[3].collectives[0].gbps\" is 0"});
  expect_holds(bad("what", ""), {"\"layers[3].collectives[0].what\" is \"\""});
  expect_holds(bad("ms", -1), {"\"layers[3].collectives[0].ms\" is -1"});
  Json missing = Json::parse(text);
  missing["layers"][3]["collectives"][0].erase("bytes");
  expect_holds(load_error(r, [&](Json& d) { d = missing; }),
               {"\"layers[3].collectives[0].bytes\" is missing"});
  Json not_array = Json::parse(text);
  not_array["layers"][2]["collectives"] = 3;
  expect_holds(load_error(r, [&](Json& d) { d = not_array; }),
               {"\"layers[2].collectives\" is 3; must be an array"});
}

// Note [Plans re-timed from their actions]: an action edited by hand in a plan file is
// re-timed from the file's op graph; the recompute time follows the action, the file is
// named as edited, and a plan as written reads back with its own figures bit for bit.
TEST(PlanRetimed, EditingAnActionMakesTheRecomputeTimeFollow) {
  const PlanRequest off = generous(request("Qwen3-30B-A3B", "gh200", 2, 8192, Policy::kOffload));
  PlanRequest rec = off;
  rec.strategy = Policy::kRecompute;
  const Plan p_off = make_plan(off);
  const Plan p_rec = make_plan(rec);
  Json doc = Json::parse(plan_to_json(p_off, off));
  // As written: every figure reads back bit for bit, no note.
  PlanRequest back;
  const Plan same = parse_plan_json(doc.dump(), "offload.json", &back);
  EXPECT_TRUE(same.notes.empty());
  for (size_t l = 0; l < same.layers.size(); ++l) {
    EXPECT_EQ(same.layers[l].recompute_ms, p_off.layers[l].recompute_ms) << l;
    EXPECT_EQ(same.layers[l].rematerialized_bytes, p_off.layers[l].rematerialized_bytes) << l;
  }
  // Layer 0 recomputes moe.expert_out instead of offloading it: the experts' down
  // projection runs again in backward, and the file's stored time no longer holds.
  Json& t0 = doc["layers"][0]["tensors"];
  for (Json& t : t0) {
    if (t["name"] == "moe.expert_out") t["action"] = "recompute";
  }
  const Plan edited = parse_plan_json(doc.dump(), "offload.json", &back);
  ASSERT_EQ(edited.notes.size(), 1u);
  EXPECT_NE(edited.notes[0].find("offload.json was edited: the actions of 1 layer(s) (0)"),
            std::string::npos)
      << edited.notes[0];
  EXPECT_NE(edited.notes[0].find("re-run attn.norm, attn.qkv, attn.core, mlp.down in backward"),
            std::string::npos)
      << edited.notes[0];
  EXPECT_GT(edited.layers[0].recompute_ms, p_off.layers[0].recompute_ms);
  EXPECT_EQ(edited.layers[1].recompute_ms, p_off.layers[1].recompute_ms);
  // Every layer edited to the recompute plan's actions: its recompute times, bit for bit.
  for (size_t l = 0; l < p_rec.layers.size(); ++l) {
    Json& ts = doc["layers"][l]["tensors"];
    for (size_t i = 0; i < ts.size(); ++i)
      ts[i]["action"] = to_string(p_rec.layers[l].tensors[i].action);
  }
  const Plan all = parse_plan_json(doc.dump(), "offload.json", &back);
  ASSERT_EQ(all.notes.size(), 1u);
  for (size_t l = 0; l < all.layers.size(); ++l) {
    EXPECT_EQ(all.layers[l].recompute_ms, p_rec.layers[l].recompute_ms) << l;
    EXPECT_EQ(all.layers[l].offload_bytes, 0) << l;
    EXPECT_EQ(all.layers[l].kept_bytes, p_rec.layers[l].kept_bytes) << l;
  }
  // The simulator replays what the actions cost, not what the file said.
  SimOptions o;
  o.keep_tasks = false;
  const SimResult sim_edited = simulate_training_step(all, back, o);
  PlanRequest rec_back;
  const Plan rec_read = parse_plan_json(plan_to_json(p_rec, rec), "recompute.json", &rec_back);
  const SimResult sim_rec = simulate_training_step(rec_read, rec_back, o);
  EXPECT_EQ(sim_edited.summary.recompute_ms, sim_rec.summary.recompute_ms);
  EXPECT_EQ(sim_edited.summary.d2h_bytes, 0);
}

// retime_plan judges a given choice as make_plan judges its own: a plan re-timed for its
// own request is the same plan, field for field, for every strategy.
TEST(PlanRetimed, APlanReTimedForItsOwnRequestIsTheSamePlan) {
  for (const char* name : {"Qwen3-30B-A3B", "Llama-3.1-8B", "DeepSeek-V3", "Jamba-Mini-1.5"}) {
    for (Policy s : {Policy::kAuto, Policy::kKeep, Policy::kRecompute, Policy::kOffload,
                     Policy::kSelective, Policy::kHybrid, Policy::kCheckpoint}) {
      SCOPED_TRACE(std::string(name) + " " + to_string(s));
      PlanRequest r = request(name, "gh200", 2, 8192, s);
      if (std::string(name) == "DeepSeek-V3") {
        r.work.shape.ep = 8;
        r.work.shape.tp = 8;
      }
      const Plan p = make_plan(r);
      EXPECT_EQ(plan_to_json(retime_plan(r, p), r), plan_to_json(p, r));
    }
  }
}

TEST(PlanRetimed, AFileWithoutTheOpGraphKeepsItsTimesAndSaysSoWhenEdited) {
  const PlanRequest off = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kOffload));
  const Plan p = make_plan(off);
  Json doc = Json::parse(plan_to_json(p, off));
  for (Json& l : doc["layers"]) {
    for (Json& op : l["ops"]) {
      op.erase("inputs");
      op.erase("outputs");
    }
  }
  PlanRequest back;
  EXPECT_TRUE(parse_plan_json(doc.dump(), "old.json", &back).notes.empty());
  doc["layers"][2]["tensors"][0]["action"] = "offload";  // attn.input
  const Plan q = parse_plan_json(doc.dump(), "old.json", &back);
  ASSERT_EQ(q.notes.size(), 1u);
  EXPECT_NE(q.notes[0].find("no op graph"), std::string::npos) << q.notes[0];
  EXPECT_EQ(q.layers[2].recompute_ms, p.layers[2].recompute_ms);
}

// Note [Fused-kernel inventory]: the report and the JSON say that the tensors assume fused
// kernels, with the eager model's factors for the kinds of layers the model has.
TEST(PlanJson, TheInventorysFusedKernelAssumptionIsStated) {
  for (const auto& [name, mamba, attention] :
       {std::tuple{"Qwen3-30B-A3B", false, true}, std::tuple{"Mamba2-2.7B", true, false},
        std::tuple{"Jamba-Mini-1.5", true, true}}) {
    SCOPED_TRACE(name);
    const PlanRequest r = generous(request(name, "gh200", 1, 4096, Policy::kRecompute));
    const Plan plan = make_plan(r);
    const std::string report = format_plan_report(plan, r);
    const std::string said = inventory_assumption(r.model);
    EXPECT_NE(report.find("  inventory activations as fused kernels save them"), std::string::npos)
        << report;
    EXPECT_NE(report.find(said), std::string::npos);
    EXPECT_EQ(Json::parse(plan_to_json(plan, r))["workload"]["inventory_assumes"], said);
    EXPECT_EQ(said.find("6-8x per Mamba layer") != std::string::npos, mamba) << said;
    EXPECT_EQ(said.find("chunked selective scan") != std::string::npos, mamba) << said;
    EXPECT_EQ(said.find("flash attention") != std::string::npos, attention) << said;
    EXPECT_EQ(said.find("1.3-1.5x per attention/MLP layer") != std::string::npos,
              std::string(name) != "Mamba2-2.7B")
        << said;
  }
}

}  // namespace
}  // namespace spillway

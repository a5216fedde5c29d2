// Note [A model as PyTorch runs it]: a plan made from the saved tensors measured where the
// model runs has their sizes, layer by layer, under the adapter's names; what it does not
// know is refused, and such a plan is never read back as the model's own.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "plan_helpers.hpp"
#include "spillway/core/error.hpp"

namespace spillway {
namespace {

using spillway::testing::generous;
using spillway::testing::request;

const TensorPlan* find(const LayerPlan& l, const std::string& name) {
  for (const TensorPlan& t : l.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

int64_t saved_sum(const LayerPlan& l) {
  int64_t s = 0;
  for (const TensorPlan& t : l.tensors) s += t.bytes;
  return s;
}

// Each layer as an eager model saves it: every tensor of the inventory but one, each 1.5x
// its fused size, and two the inventory lacks.
std::vector<std::vector<SavedTensorBytes>> eager(const Plan& from, const std::string& dropped) {
  std::vector<std::vector<SavedTensorBytes>> out;
  for (const LayerPlan& l : from.layers) {
    std::vector<SavedTensorBytes>& layer = out.emplace_back();
    for (const TensorPlan& t : l.tensors) {
      if (t.name != dropped) layer.push_back({t.name, t.bytes + t.bytes / 2});
    }
    layer.push_back({"block", 1 << 20});
    layer.push_back({"mlp.silu_out", 3 << 20});
  }
  return out;
}

TEST(SavedAsRun, EachLayerSavesWhatWasMeasured) {
  PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 2048, Policy::kKeep));
  const Plan own = make_plan(r);
  r.saved_as_run = eager(own, "attn.qkv_out");
  const Plan p = make_plan(r);
  ASSERT_EQ(p.layers.size(), own.layers.size());
  for (size_t i = 0; i < p.layers.size(); ++i) {
    const LayerPlan& l = p.layers[i];
    int64_t measured = 0;
    for (const SavedTensorBytes& t : r.saved_as_run[i]) measured += t.bytes;
    EXPECT_EQ(saved_sum(l), measured) << "layer " << i;
    EXPECT_EQ(l.kept_bytes, measured) << "layer " << i;  // keep: all of it stays
    // Not measured: the model does not save it as such.
    ASSERT_NE(find(l, "attn.qkv_out"), nullptr);
    EXPECT_EQ(find(l, "attn.qkv_out")->bytes, 0);
    // Measured, unknown to the inventory: saved under its name, produced by its sub-block's
    // last op (mlp.*), or the layer's last op ("block").
    const TensorPlan* silu = find(l, "mlp.silu_out");
    const TensorPlan* block = find(l, "block");
    ASSERT_NE(silu, nullptr);
    ASSERT_NE(block, nullptr);
    EXPECT_EQ(silu->bytes, 3 << 20);
    ASSERT_GE(silu->producer, 0);
    EXPECT_EQ(l.ops[static_cast<size_t>(silu->producer)].name.rfind("mlp.", 0), 0u)
        << l.ops[static_cast<size_t>(silu->producer)].name;
    EXPECT_EQ(block->producer, static_cast<int>(l.ops.size()) - 1);
  }
  EXPECT_GT(p.summary.peak.total(), own.summary.peak.total());
}

TEST(SavedAsRun, ACheckpointKeepsTheLayerInputWhateverAutogradSaved) {
  PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 2048, Policy::kCheckpoint));
  const Plan own = make_plan(r);
  // Autograd kept only an fp32 copy of the input (named otherwise): the input measures 0.
  std::vector<std::vector<SavedTensorBytes>> m(own.layers.size());
  for (auto& layer : m) layer = {{"attn.input", 0}, {"attn.norm_out", 64 << 20}};
  r.saved_as_run = m;
  const Plan p = make_plan(r);
  for (size_t i = 0; i < p.layers.size(); ++i) {
    const TensorPlan* in = find(p.layers[i], "attn.input");
    ASSERT_NE(in, nullptr);
    EXPECT_EQ(in->bytes, find(own.layers[i], "attn.input")->bytes) << "layer " << i;
    EXPECT_EQ(p.layers[i].kept_bytes, own.layers[i].kept_bytes) << "layer " << i;
  }
}

TEST(SavedAsRun, TheOffloadedBytesAreTheMeasuredOnes) {
  PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 4096, Policy::kKeep));
  r.offload_tensors = {"mlp"};
  const Plan own = make_plan(r);
  r.saved_as_run = eager(own, "");
  const Plan p = make_plan(r);
  for (size_t i = 0; i + 1 < p.layers.size(); ++i) {
    EXPECT_EQ(p.layers[i].offload_bytes, own.layers[i].offload_bytes * 3 / 2) << "layer " << i;
  }
}

TEST(SavedAsRun, WhatCannotBeMeasuredSoIsRefused) {
  PlanRequest base = generous(request("Llama-3.1-8B", "gh200", 1, 2048, Policy::kAuto));
  const size_t n = base.model.layers.size();
  auto refused = [&](PlanRequest r, const std::string& what) {
    try {
      (void)make_plan(r);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const InputError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("saved"), std::string::npos) << m;
      EXPECT_NE(m.find(what), std::string::npos) << m;
    }
  };
  PlanRequest r = base;
  r.saved_as_run.assign(n - 1, {{"attn.input", 1}});
  refused(r, std::to_string(n - 1) + " layers");
  r = base;
  r.saved_as_run.assign(n, {{"attn.input", 1}});
  r.work.shape.tp = 2;
  refused(r, "tp=2");
  r = base;
  r.saved_as_run.assign(n, {{"attn.input", 1}, {"attn.input", 2}});
  refused(r, "given twice");
  r = base;
  r.saved_as_run.assign(n, {{"attn.input", -1}});
  refused(r, "-1 bytes");
  r = base;
  r.saved_as_run.assign(n, {{"", 1}});
  refused(r, "has no name");
}

TEST(SavedAsRun, ThePlanSaysSoAndIsNotReadBackAsTheModels) {
  PlanRequest r = generous(request("Llama-3.1-8B", "gh200", 1, 2048, Policy::kAuto));
  const Plan own = make_plan(r);
  r.saved_as_run = eager(own, "");
  const std::string text = plan_to_json(make_plan(r), r);
  EXPECT_NE(text.find("\"saved_as_run\": true"), std::string::npos);
  PlanRequest back;
  try {
    (void)parse_plan_json(text, "as-run.json", &back);
    ADD_FAILURE() << "a plan of measured tensors was read back";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("options.saved_as_run"), std::string::npos) << e.what();
  }
  // Without them, as before.
  PlanRequest plain = generous(request("Llama-3.1-8B", "gh200", 1, 2048, Policy::kAuto));
  EXPECT_EQ(plan_to_json(make_plan(plain), plain).find("saved_as_run"), std::string::npos);
}

}  // namespace
}  // namespace spillway

// The per-layer inventory: the stable tensor names, shapes and bytes, the offload volume
// formulas (V = 3 T f_act b unfused, 2 T f_act b fused; 6 T d f_act recompute FLOPs), exact
// linearity in tokens for every catalog model, and a well-formed op graph.
#include "spillway/catalog/inventory.hpp"

#include <gtest/gtest.h>

#include <map>
#include <set>

#include "spillway/catalog/model.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::expect_error;

const char* kMlpNames[] = {"mlp.gate_out", "mlp.up_out", "mlp.act"};

// Sum of the saved MLP tensors (what strategy offload moves).
int64_t mlp_bytes(const LayerInventory& inv) {
  int64_t total = 0;
  for (const TensorInfo& t : inv.tensors) {
    if (!t.saved) continue;
    for (const char* n : kMlpNames) {
      if (t.name == n) total += t.bytes;
    }
  }
  return total;
}

std::set<std::string> saved_names(const LayerInventory& inv) {
  std::set<std::string> s;
  for (const TensorInfo& t : inv.tensors) {
    if (t.saved) s.insert(t.name);
  }
  return s;
}

// The distinct layer specs of a model (e.g. DeepSeek-V3's dense and MoE layers).
std::vector<LayerSpec> distinct_layers(const ModelConfig& m) {
  std::vector<LayerSpec> out;
  for (const LayerSpec& l : m.layers) {
    if (std::find(out.begin(), out.end(), l) == out.end()) out.push_back(l);
  }
  return out;
}

ShardShape shape(int64_t mb, int64_t seq) {
  ShardShape s;
  s.micro_batch = mb;
  s.seq_len = seq;
  return s;
}

TEST(Inventory, DenseTensorNames) {
  const ModelConfig m = load_model("Llama-3.1-8B");
  const LayerInventory inv = build_inventory(m.layers[0], m.hidden, shape(1, 4096));
  const std::set<std::string> names = saved_names(inv);
  for (const char* n : {"attn.input", "attn.qkv_out", "attn.out_proj_in", "mlp.gate_out",
                        "mlp.up_out", "mlp.act"}) {
    EXPECT_TRUE(names.count(n)) << "missing " << n;
  }
  for (const std::string& n : names) {
    EXPECT_NE(n.rfind("moe.", 0), 0u) << "a dense layer has no MoE tensor: " << n;
  }
  // Names are unique.
  std::set<std::string> all;
  for (const TensorInfo& t : inv.tensors) EXPECT_TRUE(all.insert(t.name).second) << t.name;
  EXPECT_EQ(inv.find("no.such.tensor"), -1);
  EXPECT_GE(inv.find("mlp.act"), 0);
}

TEST(Inventory, MoeTensorNames) {
  for (const char* model : {"Qwen3-30B-A3B", "Mixtral-8x7B", "GPT-OSS-20B", "Grok-2"}) {
    SCOPED_TRACE(model);
    const ModelConfig m = load_model(model);
    const std::set<std::string> names =
        saved_names(build_inventory(m.layers[0], m.hidden, shape(1, 1024)));
    for (const char* n : {"attn.input", "attn.qkv_out", "attn.out_proj_in", "moe.router_probs",
                          "moe.topk_idx", "moe.topk_weights", "moe.dispatch_in", "moe.expert_out",
                          "mlp.gate_out", "mlp.up_out", "mlp.act"}) {
      EXPECT_TRUE(names.count(n)) << "missing " << n;
    }
  }
}

TEST(Inventory, MlaTensorNames) {
  const ModelConfig m = load_model("DeepSeek-V3");
  const std::set<std::string> dense =
      saved_names(build_inventory(m.layers[0], m.hidden, shape(1, 1024)));
  const std::set<std::string> moe =
      saved_names(build_inventory(m.layers[3], m.hidden, shape(1, 1024)));
  for (const auto* names : {&dense, &moe}) {
    EXPECT_TRUE(names->count("attn.kv_latent"));
    EXPECT_TRUE(names->count("attn.q_latent"));
    EXPECT_TRUE(names->count("attn.qkv_out"));
  }
  EXPECT_FALSE(dense.count("moe.router_probs"));
  EXPECT_TRUE(moe.count("moe.router_probs"));
}

TEST(Inventory, FusedSwigluDoesNotSaveAct) {
  const ModelConfig m = load_model("Llama-3.1-8B");
  ShardShape s = shape(1, 4096);
  s.fused_swiglu = true;
  const LayerInventory inv = build_inventory(m.layers[0], m.hidden, s);
  const int act = inv.find("mlp.act");
  EXPECT_TRUE(act < 0 || !inv.tensors[static_cast<size_t>(act)].saved)
      << "mlp.act must be absent or unsaved under a fused SwiGLU";
  EXPECT_FALSE(saved_names(inv).count("mlp.act"));
  EXPECT_TRUE(saved_names(inv).count("mlp.gate_out"));
  EXPECT_TRUE(saved_names(inv).count("mlp.up_out"));
}

TEST(Inventory, MlpVolumeIsTheDesignFormula) {
  // V = 3 * T * f_act * b unfused, 2 * T * f_act * b fused (docs/offload.md); an ungated
  // MLP (up and down, Nemotron-H) saves 2 * T * f_act * b either way; none, nothing.
  for (const ModelCatalogEntry& e : model_catalog()) {
    const ModelConfig m = load_model(e.name);
    for (const LayerSpec& l : distinct_layers(m)) {
      SCOPED_TRACE(e.name + " " + l.block_name());
      for (int64_t mb : {1, 3}) {
        ShardShape s = shape(mb, 2048);
        const int64_t T = mb * 2048;
        const int64_t f = l.mlp.kind == MlpKind::kNone ? 0 : l.mlp.active_ffn();
        const int64_t unfused = l.mlp.gated ? 3 : 2;
        EXPECT_EQ(mlp_bytes(build_inventory(l, m.hidden, s)), unfused * T * f * 2);
        s.fused_swiglu = true;
        EXPECT_EQ(mlp_bytes(build_inventory(l, m.hidden, s)), 2 * T * f * 2);
        s.dtype = DType::kFp32;
        EXPECT_EQ(mlp_bytes(build_inventory(l, m.hidden, s)), 2 * T * f * 4);
      }
    }
  }
}

TEST(Inventory, LinearInTokensForEveryCatalogModel) {
  for (const ModelCatalogEntry& e : model_catalog()) {
    const ModelConfig m = load_model(e.name);
    for (const LayerSpec& l : distinct_layers(m)) {
      SCOPED_TRACE(e.name + " " + l.block_name());
      const LayerInventory base = build_inventory(l, m.hidden, shape(1, 4096));
      const LayerInventory mb2 = build_inventory(l, m.hidden, shape(2, 4096));
      const LayerInventory seq2 = build_inventory(l, m.hidden, shape(1, 8192));
      ASSERT_EQ(mlp_bytes(base) > 0, l.mlp.kind != MlpKind::kNone);
      EXPECT_EQ(mlp_bytes(mb2), 2 * mlp_bytes(base));
      EXPECT_EQ(mlp_bytes(seq2), 2 * mlp_bytes(base));
      // Every saved tensor is token-major: the whole layer doubles too.
      EXPECT_EQ(mb2.saved_bytes(), 2 * base.saved_bytes());
      EXPECT_EQ(seq2.saved_bytes(), 2 * base.saved_bytes());
      ASSERT_EQ(mb2.tensors.size(), base.tensors.size());
      for (size_t i = 0; i < base.tensors.size(); ++i) {
        EXPECT_EQ(mb2.tensors[i].bytes, 2 * base.tensors[i].bytes) << base.tensors[i].name;
      }
    }
  }
}

TEST(Inventory, ShapesAndBytesAgree) {
  const std::map<std::string, int64_t> elem = {
      {"bf16", 2}, {"fp16", 2}, {"fp8", 1}, {"fp32", 4}, {"int32", 4}};
  for (const char* model : {"Llama-3.1-8B", "Qwen3-30B-A3B", "DeepSeek-V3", "GPT-OSS-20B"}) {
    const ModelConfig m = load_model(model);
    for (DType dt : {DType::kBf16, DType::kFp8, DType::kFp32}) {
      ShardShape s = shape(2, 1024);
      s.dtype = dt;
      for (const LayerSpec& l : distinct_layers(m)) {
        const LayerInventory inv = build_inventory(l, m.hidden, s);
        for (const TensorInfo& t : inv.tensors) {
          SCOPED_TRACE(std::string(model) + " " + t.name + " " + t.dtype);
          ASSERT_TRUE(elem.count(t.dtype));
          int64_t n = 1;
          for (int64_t d : t.shape) n *= d;
          EXPECT_EQ(t.bytes, n * elem.at(t.dtype));
          EXPECT_GT(t.bytes, 0);
        }
      }
    }
  }
}

TEST(Inventory, GateShapeIsTokensByActiveWidthOverTp) {
  const ModelConfig m = load_model("Llama-3.1-70B");  // 64 heads, ffn 28672
  for (int64_t tp : {1, 2, 4, 8}) {
    ShardShape s = shape(1, 4096);
    s.tp = tp;
    const LayerInventory inv = build_inventory(m.layers[0], m.hidden, s);
    const TensorInfo& g = inv.tensors[static_cast<size_t>(inv.find("mlp.gate_out"))];
    EXPECT_EQ(g.shape, (std::vector<int64_t>{4096, 28672 / tp}));
    EXPECT_EQ(g.bytes, 4096 * 28672 / tp * 2);
    // Sequence parallelism splits the token-major block inputs.
    const TensorInfo& x = inv.tensors[static_cast<size_t>(inv.find("attn.input"))];
    EXPECT_EQ(x.shape, (std::vector<int64_t>{4096 / tp, 8192}));
  }
  // Context parallelism splits the tokens; expert parallelism spreads experts, not rows.
  ShardShape cp = shape(1, 4096);
  cp.cp = 4;
  const LayerInventory inv_cp = build_inventory(m.layers[0], m.hidden, cp);
  EXPECT_EQ(inv_cp.tensors[static_cast<size_t>(inv_cp.find("mlp.gate_out"))].shape[0], 1024);
  const ModelConfig moe = load_model("Qwen3-30B-A3B");
  ShardShape ep = shape(1, 4096);
  ep.ep = 8;
  EXPECT_EQ(mlp_bytes(build_inventory(moe.layers[0], moe.hidden, ep)),
            mlp_bytes(build_inventory(moe.layers[0], moe.hidden, shape(1, 4096))));
}

TEST(Inventory, RecomputeFlopsOfTheProjectionsAreSixTdf) {
  // docs/offload.md: the three projections cost 6 * T * d * f_act FLOPs forward (an ungated MLP's
  // two, 4 * T * d * f_act; no MLP, none).
  for (const ModelCatalogEntry& e : model_catalog()) {
    const ModelConfig m = load_model(e.name);
    for (const LayerSpec& l : distinct_layers(m)) {
      SCOPED_TRACE(e.name + " " + l.block_name());
      const int64_t T = 4096;
      const LayerInventory inv = build_inventory(l, m.hidden, shape(1, T));
      double proj = 0.0;
      int found = 0;
      for (const OpCost& op : inv.ops) {
        if (op.name == "mlp.gate" || op.name == "mlp.up" || op.name == "mlp.down") {
          proj += op.fwd_flops;
          ++found;
          EXPECT_EQ(op.kind, OpKind::kGemm);
          EXPECT_DOUBLE_EQ(op.bwd_flops, 2.0 * op.fwd_flops);
        }
      }
      const int projections = l.mlp.kind == MlpKind::kNone ? 0 : (l.mlp.gated ? 3 : 2);
      EXPECT_EQ(found, projections);
      if (projections == 0) continue;
      const double want = 2.0 * projections * T * static_cast<double>(m.hidden) *
                          static_cast<double>(l.mlp.active_ffn());
      EXPECT_NEAR(proj, want, want * 1e-12);
    }
  }
}

TEST(Inventory, OpGraphIsInForwardOrder) {
  for (const ModelCatalogEntry& e : model_catalog()) {
    const ModelConfig m = load_model(e.name);
    for (const LayerSpec& l : distinct_layers(m)) {
      SCOPED_TRACE(e.name + " " + l.block_name());
      const LayerInventory inv = build_inventory(l, m.hidden, shape(1, 2048));
      std::set<int> produced;
      for (size_t k = 0; k < inv.ops.size(); ++k) {
        const OpCost& op = inv.ops[k];
        EXPECT_GT(op.fwd_flops + static_cast<double>(op.fwd_bytes), 0.0) << op.name;
        for (int in : op.inputs) {
          ASSERT_GE(in, 0);
          ASSERT_LT(static_cast<size_t>(in), inv.tensors.size());
          const int p = inv.tensors[static_cast<size_t>(in)].producer;
          EXPECT_LT(p, static_cast<int>(k)) << op.name << " reads a tensor produced later";
        }
        for (int out : op.outputs) {
          EXPECT_EQ(inv.tensors[static_cast<size_t>(out)].producer, static_cast<int>(k));
          EXPECT_TRUE(produced.insert(out).second) << "tensor produced twice";
        }
      }
      // Only the layer input comes from outside the layer: the mixer's input, or the MLP's
      // in an MLP-only layer (Note [Block inventories]).
      int inputs = 0;
      for (const TensorInfo& t : inv.tensors) {
        if (t.producer < 0) {
          ++inputs;
          EXPECT_TRUE(t.name == "attn.input" || t.name == "ssm.input" || t.name == "lin.input" ||
                      t.name == "rec.input" ||
                      (t.name == "mlp.input" && l.mixer == MixerKind::kNone))
              << t.name;
        }
      }
      EXPECT_EQ(inputs, 1);
    }
  }
}

TEST(Inventory, SlidingWindowCutsAttentionFlops) {
  const ModelConfig m = load_model("GPT-OSS-20B");
  const LayerInventory swa = build_inventory(m.layers[0], m.hidden, shape(1, 8192));
  const LayerInventory full = build_inventory(m.layers[1], m.hidden, shape(1, 8192));
  auto core = [](const LayerInventory& inv) {
    for (const OpCost& op : inv.ops) {
      if (op.kind == OpKind::kAttention) return op.fwd_flops;
    }
    return 0.0;
  };
  EXPECT_GT(core(full), 0.0);
  // Window 128 over 8192 positions: ~128 keys per query against ~4096.
  EXPECT_NEAR(core(swa) / core(full), causal_average_keys(8192, 128) / causal_average_keys(8192, 0),
              1e-12);
  EXPECT_LT(core(swa), core(full) / 30.0);
}

TEST(Inventory, CausalAverageKeys) {
  EXPECT_DOUBLE_EQ(causal_average_keys(4096, 0), 2048.5);
  EXPECT_DOUBLE_EQ(causal_average_keys(4096, 4096), 2048.5);
  EXPECT_DOUBLE_EQ(causal_average_keys(4096, 10000), 2048.5);
  EXPECT_DOUBLE_EQ(causal_average_keys(4096, 1), 1.0);
  // Brute force: sum over positions i = 1..s of min(i, w), over s.
  for (int64_t s : {7, 100, 1000}) {
    for (int64_t w : {1, 3, 50, 99}) {
      double sum = 0.0;
      for (int64_t i = 1; i <= s; ++i) sum += static_cast<double>(std::min(i, w));
      EXPECT_NEAR(causal_average_keys(s, w), sum / static_cast<double>(s), 1e-9) << s << " " << w;
    }
  }
}

TEST(Inventory, DtypeNames) {
  EXPECT_EQ(dtype_bytes(DType::kBf16), 2);
  EXPECT_EQ(dtype_bytes(DType::kFp16), 2);
  EXPECT_EQ(dtype_bytes(DType::kFp8), 1);
  EXPECT_EQ(dtype_bytes(DType::kFp32), 4);
  for (DType t : {DType::kBf16, DType::kFp16, DType::kFp8, DType::kFp32}) {
    EXPECT_EQ(parse_dtype(to_string(t)), t);
  }
}

TEST(Inventory, OverflowingActivationsThrow) {
  const ModelConfig m = load_model("Llama-3.1-8B");
  ShardShape s = shape(1LL << 30, 1LL << 30);
  expect_error([&] { (void)build_inventory(m.layers[0], m.hidden, s); },
               {"activation size", "overflows 64 bits"});
  ShardShape bad = shape(0, 4096);
  expect_error([&] { (void)build_inventory(m.layers[0], m.hidden, bad); }, {"positive"});
}

}  // namespace
}  // namespace spillway

// The hybrid block families: Mamba-1 and Mamba-2 mixers, Gated
// DeltaNet, MLP-only and mixer-only layers, read from the pattern keys of Nemotron-H,
// Jamba, Qwen3-Next, Granite 4.0-H and Mamba2; their parameters counted by hand, their
// inventories (Note [Block inventories]) and their block policy (the scan is never rerun).
#include <gtest/gtest.h>

#include <string>

#include "core/json_io.hpp"
#include "plan/cost_model.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/inventory.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {
namespace {

std::string error_of(const Json& j) {
  try {
    (void)parse_model_config(j, "m", "m.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// d 8; Mamba-2: 4 heads of 4 (inner 16), 1 group, N 2, conv 4, no biases but the conv's.
Json nemotron() {
  return Json::parse(R"({
    "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
    "hidden_size": 8, "num_hidden_layers": 4, "hybrid_override_pattern": "M-*-",
    "num_attention_heads": 2, "num_key_value_heads": 1, "attention_head_dim": 4,
    "intermediate_size": 16, "vocab_size": 10, "ssm_state_size": 2, "mamba_num_heads": 4,
    "mamba_head_dim": 4, "n_groups": 1, "conv_kernel": 4, "expand": 2, "chunk_size": 8,
    "use_conv_bias": true, "use_bias": false, "mlp_hidden_act": "relu2",
    "tie_word_embeddings": false})");
}

TEST(HybridBlocks, NemotronHPatternAndParameters) {
  const ModelConfig m = parse_model_config(nemotron(), "n", "n.json");
  ASSERT_EQ(m.layers.size(), 4u);
  EXPECT_EQ(m.layers[0].block_name(), "mamba2");
  EXPECT_EQ(m.layers[1].block_name(), "dense");
  EXPECT_EQ(m.layers[2].block_name(), "gqa");
  // Mamba-2: in_proj 8 x (16 + 20 + 4) = 320; conv_dim 16 + 2*1*2 = 20: conv 80 + bias 20;
  // dt_bias, A_log, D 12; gated norm 16; out_proj 128; + the block's norm 8 = 584.
  EXPECT_EQ(layer_parameter_count(m.layers[0], 8), 320 + 100 + 12 + 16 + 128 + 8);
  // Squared-ReLU MLP: up and down only, 2 * 8 * 16 = 256, + norm 8.
  EXPECT_EQ(layer_parameter_count(m.layers[1], 8), 256 + 8);
  // Attention alone: norm 8 + q 64 + k, v 64 + o 64 = 200.
  EXPECT_EQ(layer_parameter_count(m.layers[2], 8), 200);
  EXPECT_EQ(parameter_count(m), 584 + 264 + 200 + 264 + 160 + 8);

  Json bad = nemotron();
  bad["hybrid_override_pattern"] = "M-*";
  EXPECT_NE(error_of(bad).find("\"hybrid_override_pattern\" has 3 characters; must have one per "
                               "layer (4)"),
            std::string::npos);
  bad["hybrid_override_pattern"] = "M-*X";
  EXPECT_NE(error_of(bad).find("has 'X' at layer 3"), std::string::npos);
}

TEST(HybridBlocks, JambaPeriodsAndMambaOne) {
  const Json j = Json::parse(R"({
    "model_type": "jamba", "hidden_size": 8, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
    "vocab_size": 10, "num_experts": 4, "num_experts_per_tok": 2,
    "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2,
    "expert_layer_offset": 1, "mamba_d_state": 2, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_dt_rank": "auto", "mamba_conv_bias": true, "mamba_proj_bias": false})");
  const ModelConfig m = parse_model_config(j, "j", "j.json");
  ASSERT_EQ(m.layers.size(), 4u);
  EXPECT_EQ(m.layers[0].block_name(), "mamba+dense");
  EXPECT_EQ(m.layers[1].block_name(), "mamba+moe");
  EXPECT_EQ(m.layers[2].block_name(), "gqa+dense");
  EXPECT_EQ(m.layers[3].block_name(), "mamba+moe");
  EXPECT_EQ(m.layers[0].ssm.dt_rank, 1);  // ceil(8 / 16)
  // Mamba-1 (inner 16, N 2, dt_rank 1): in_proj 8 x 32 = 256; conv 16 x 4 + 16 = 80;
  // x_proj 16 x 5 = 80; dt_proj 16 + 16 = 32; A_log 32 + D 16 = 48; dt/B/C norms 5;
  // out_proj 128; + norm 8 -> 637. Dense SwiGLU 384 + norm 8.
  EXPECT_EQ(layer_parameter_count(m.layers[0], 8), 637 + 392);
}

TEST(HybridBlocks, Qwen3NextGatedDeltaNetAndGatedAttention) {
  const Json j = Json::parse(R"({
    "model_type": "qwen3_next", "hidden_size": 8, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10,
    "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4,
    "linear_value_head_dim": 4, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6,
    "shared_expert_intermediate_size": 6, "intermediate_size": 16,
    "decoder_sparse_step": 1, "mlp_only_layers": []})");
  const ModelConfig m = parse_model_config(j, "q", "q.json");
  ASSERT_EQ(m.layers.size(), 4u);
  EXPECT_EQ(m.layers[0].block_name(), "gdn+moe");
  EXPECT_EQ(m.layers[3].block_name(), "gqa+moe");
  // GDN (key 4, value 8): in_proj_qkvz 8 x 24 = 192, in_proj_ba 8 x 4 = 32, conv 16 x 4 = 64,
  // dt_bias + A_log 4, norm 4, out_proj 64; + norm 8 -> 368.
  // MoE: experts 4 x 144, router 32, shared 144 + its gate 8; + norm 8 -> 768.
  EXPECT_EQ(layer_parameter_count(m.layers[0], 8), 368 + 768);
  // Gated attention: norm 8, q 8 x 16 = 128, k, v 64, o 64, q/k norms 8 -> 272.
  EXPECT_EQ(layer_parameter_count(m.layers[3], 8), 272 + 768);
  Json types = j;
  types["layer_types"] = {"linear_attention", "full_attention", "linear_attention",
                          "linear_attention"};
  EXPECT_EQ(parse_model_config(types, "q", "q.json").layers[1].block_name(), "gqa+moe");
}

TEST(HybridBlocks, GraniteHybridAndMamba2) {
  const Json g = Json::parse(R"({
    "model_type": "granitemoehybrid", "hidden_size": 8, "num_hidden_layers": 2,
    "layer_types": ["mamba", "attention"], "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 10, "num_local_experts": 4,
    "num_experts_per_tok": 2, "intermediate_size": 6, "shared_intermediate_size": 16,
    "mamba_n_heads": 4, "mamba_d_head": 4, "mamba_n_groups": 1, "mamba_d_state": 2,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": true, "mamba_proj_bias": false})");
  const ModelConfig m = parse_model_config(g, "g", "g.json");
  EXPECT_EQ(m.layers[0].block_name(), "mamba2+moe");
  EXPECT_EQ(m.layers[1].block_name(), "gqa+moe");
  EXPECT_EQ(m.layers[0].mlp.shared_ffn, 16);
  Json bad = g;
  bad["mamba_expand"] = 3;
  EXPECT_NE(error_of(bad).find("expand x hidden_size (24) must equal the Mamba heads x head dim"),
            std::string::npos)
      << error_of(bad);

  const Json m2 = Json::parse(R"({
    "model_type": "mamba2", "hidden_size": 8, "num_hidden_layers": 3, "vocab_size": 10,
    "state_size": 2, "num_heads": 4, "head_dim": 4, "n_groups": 1, "expand": 2,
    "conv_kernel": 4, "use_conv_bias": true, "use_bias": false, "chunk_size": 8,
    "tie_word_embeddings": true})");
  const ModelConfig mm = parse_model_config(m2, "m", "m.json");
  EXPECT_EQ(mm.layers[0].block_name(), "mamba2");
  EXPECT_EQ(parameter_count(mm), 3 * 584 + 80 + 8);
}

// Note [Block inventories] and the block policy: a Mamba layer saves its scan's output and
// chunk states, which the recompute policy keeps; recomputing the rest reruns in_proj,
// conv and gate, never the scan.
TEST(HybridBlocks, InventoriesAndTheScanIsNeverRerun) {
  const ModelConfig m = parse_model_config(nemotron(), "n", "n.json");
  ShardShape sh;
  sh.seq_len = 64;
  const HardwareProfile hw = load_hardware("h100-sxm");
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const CostedLayer c = cost_layer(m.layers[l], 8, sh, hw, Efficiency{});
    const std::vector<Action> rec = recompute_actions(c);
    const ActionCost cost = evaluate_actions(c, rec);
    EXPECT_TRUE(cost.valid) << l;
    if (m.layers[l].mixer == MixerKind::kMamba) {
      const int states = c.inv.find("ssm.chunk_states");
      ASSERT_GE(states, 0);
      EXPECT_EQ(c.inv.tensors[static_cast<size_t>(states)].shape,
                (std::vector<int64_t>{8, 4 * 4 * 2}));  // 64 / chunk 8; H P N
      EXPECT_EQ(rec[static_cast<size_t>(states)], Action::kKeep);
      EXPECT_EQ(rec[static_cast<size_t>(c.inv.find("ssm.scan_out"))], Action::kKeep);
      // The scan's time is not in the recompute; in_proj, conv and gate are.
      double scan = 0.0;
      double rest = 0.0;
      for (size_t k = 0; k < c.inv.ops.size(); ++k) {
        const std::string& name = c.inv.ops[k].name;
        if (name == "ssm.scan") scan = c.op_fwd_ms[k];
        if (name == "ssm.in_proj" || name == "ssm.conv" || name == "ssm.gate" || name == "ssm.norm")
          rest += c.op_fwd_ms[k];
      }
      EXPECT_GT(scan, 0.0);
      EXPECT_NEAR(cost.recompute_ms, rest, 1e-9 * rest);
      EXPECT_EQ(c.inv.find("layer.output") >= 0, true);
      EXPECT_FALSE(c.inv.tensors[static_cast<size_t>(c.inv.find("layer.output"))].saved);
    }
    if (m.layers[l].mixer == MixerKind::kNone) {
      const int in = c.inv.find("mlp.input");
      ASSERT_GE(in, 0);
      EXPECT_EQ(c.inv.tensors[static_cast<size_t>(in)].producer, -1);  // the layer input
      EXPECT_LT(c.inv.find("mlp.gate_out"), 0);                        // ungated
    }
  }
}

// Every hybrid family plans end to end (the planner, its block policy and the report).
TEST(HybridBlocks, EachFamilyPlans) {
  for (const Json& j : {nemotron()}) {
    PlanRequest r;
    r.model = parse_model_config(j, "n", "n.json");
    r.hardware = load_hardware("h100-sxm");
    r.work.shape.seq_len = 64;
    const Plan p = make_plan(r);
    EXPECT_EQ(p.layers.size(), 4u);
    EXPECT_EQ(p.params_per_gpu, p.params_total);
    EXPECT_GT(p.summary.step_ms, 0.0);
  }
}

// The checkpoint policy (full-layer checkpointing) keeps only each layer's input: less
// memory than the block policy, more recompute, on attention and Mamba layers alike.
TEST(HybridBlocks, CheckpointKeepsOnlyTheLayerInput) {
  Json j = nemotron();
  j["num_hidden_layers"] = 8;  // enough layers that the kept bytes make the peak
  j["hybrid_override_pattern"] = "M-M-M*M-";
  PlanRequest r;
  r.model = parse_model_config(j, "n", "n.json");
  r.hardware = load_hardware("h100-sxm");
  r.work.shape.seq_len = 256;
  r.strategy = Policy::kRecompute;
  const Plan rec = make_plan(r);
  r.strategy = Policy::kCheckpoint;
  const Plan ck = make_plan(r);
  double rec_ms = 0.0;
  double ck_ms = 0.0;
  for (size_t l = 0; l < ck.layers.size(); ++l) {
    const LayerPlan& lp = ck.layers[l];
    EXPECT_EQ(lp.policy, Policy::kCheckpoint);
    for (const TensorPlan& t : lp.tensors) {
      const bool input = t.name == "ssm.input" || t.name == "attn.input" ||
                         (t.name == "mlp.input" && r.model.layers[l].mixer == MixerKind::kNone);
      EXPECT_EQ(t.action, input ? Action::kKeep : Action::kRecompute) << l << " " << t.name;
    }
    EXPECT_LE(lp.kept_bytes, rec.layers[l].kept_bytes);
    rec_ms += rec.layers[l].recompute_ms;
    ck_ms += lp.recompute_ms;
  }
  EXPECT_GT(ck_ms, rec_ms);  // the Mamba scan and attention's output projection rerun
  EXPECT_LT(ck.summary.peak.activations, rec.summary.peak.activations);
}

// Note [Per-block policy]: the plan says, per kind of block, what the block policy keeps
// and reruns against full-layer checkpointing, and what it chose.
TEST(HybridBlocks, ThePlanSaysPerBlockWhyInNumbers) {
  PlanRequest r;
  r.model = parse_model_config(nemotron(), "n", "n.json");
  r.hardware = load_hardware("h100-sxm");
  r.work.shape.seq_len = 256;
  const Plan p = make_plan(r);
  ASSERT_EQ(p.summary.blocks.size(), 3u);  // mamba2, dense, gqa
  const BlockSummary& m = p.summary.blocks[0];
  EXPECT_EQ(m.block, "mamba2");
  EXPECT_EQ(m.layers, 1);
  EXPECT_EQ(m.kept, (std::vector<std::string>{"ssm.scan_out", "ssm.chunk_states"}));
  EXPECT_GT(m.block_kept_bytes, m.checkpoint_kept_bytes);
  EXPECT_LT(m.block_recompute_ms, m.checkpoint_recompute_ms);  // the scan is not rerun
  EXPECT_FALSE(m.chosen.empty());
  ASSERT_FALSE(m.candidates.empty());
  for (size_t i = 1; i < m.candidates.size(); ++i)
    EXPECT_GE(m.candidates[i - 1].second, m.candidates[i].second);
  int64_t candidate_bytes = 0;
  for (const auto& [name, bytes] : m.candidates) {
    EXPECT_NE(name, "ssm.scan_out");  // kept, not a candidate
    candidate_bytes += bytes;
  }
  EXPECT_EQ(p.summary.blocks[1].block, "dense");
  EXPECT_EQ(p.summary.blocks[2].block, "gqa");
  const std::string report = format_plan_report(p, r);
  EXPECT_NE(report.find("  block     mamba2 x1: "), std::string::npos) << report;
  EXPECT_NE(report.find("the block policy keeps the input and ssm.scan_out, ssm.chunk_states"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("offload candidates: "), std::string::npos) << report;
  const std::string json = plan_to_json(p, r);
  EXPECT_NE(json.find("\"offload_candidates\""), std::string::npos);
  EXPECT_NE(json.find("\"checkpoint_recompute_ms\""), std::string::npos);
}

// Griffin's recurrent block (RecurrentGemma): parameters by hand, and its block policy:
// the whole block recomputed from its input, the recurrence's chunk states kept.
TEST(HybridBlocks, RecurrentGemmaBlocks) {
  const Json j = Json::parse(R"({
    "model_type": "recurrent_gemma", "hidden_size": 8, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "lru_width": 8,
    "conv1d_width": 4, "attention_window_size": 16, "intermediate_size": 32,
    "vocab_size": 10, "_block_types": ["recurrent", "recurrent", "attention"],
    "embeddings_scale_by_sqrt_dim": true})");
  const ModelConfig m = parse_model_config(j, "rg", "rg.json");
  ASSERT_EQ(m.layers.size(), 4u);
  EXPECT_EQ(m.layers[0].block_name(), "rglru+dense");
  EXPECT_EQ(m.layers[2].block_name(), "swa+dense");
  EXPECT_EQ(m.layers[3].block_name(), "rglru+dense");  // the pattern cycles
  EXPECT_TRUE(m.tied_embeddings);
  // Recurrent (w 8, 2 blocks of 4): linear_y, linear_x 2 * (64 + 8); linear_out 64 + 8;
  // conv 32 + 8; recurrent_param 8; gates 2 * (8 * 4 + 8) -> 344; + norm 8.
  // MLP of 32 / 2 = 16 with biases: 3 * 8 * 16 + 2 * 16 + 8 = 424; + norm 8.
  EXPECT_EQ(layer_parameter_count(m.layers[0], 8), 352 + 432);
  ShardShape sh;
  sh.seq_len = 512;
  const CostedLayer c = cost_layer(m.layers[0], 8, sh, load_hardware("h100-sxm"), Efficiency{});
  const std::vector<Action> rec = recompute_actions(c);
  for (size_t i = 0; i < rec.size(); ++i) {
    const std::string& n = c.inv.tensors[i].name;
    if (n.rfind("rec.", 0) != 0) continue;
    EXPECT_EQ(rec[i],
              n == "rec.input" || n == "rec.chunk_states" ? Action::kKeep : Action::kRecompute)
        << n;
  }
}

}  // namespace
}  // namespace spillway

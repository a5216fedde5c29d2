// The hybrid families: Falcon-H1's parallel attention + Mamba-2 layer,
// Kimi-Linear's Kimi Delta Attention with MLA, MiniMax's lightning attention, Zamba2's shared
// transformer blocks. Tiny configs whose parameters are counted by hand; the shipped configs
// counted to the parameter against their checkpoints; inventories and block policies;
// refusals of configs the families cannot mean.
#include <gtest/gtest.h>

#include <string>

#include "core/json_io.hpp"
#include "plan/cost_model.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/inventory.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

// The error a config's loading raises (the test fails when there is none).
std::string error_of(const Json& j) {
  return testing::error_of([&] { (void)parse_model_config(j, "m", "m.json"); });
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// d 8; attention 2 heads of 4 (kv 1); Mamba-2 2 heads of 4 (inner 8), N 2, conv 4.
Json falcon_h1() {
  return Json::parse(R"({
    "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"],
    "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 10,
    "mamba_d_ssm": 8, "mamba_expand": 2, "mamba_n_heads": 2, "mamba_d_head": 4,
    "mamba_n_groups": 1, "mamba_d_state": 2, "mamba_d_conv": 4, "mamba_chunk_size": 8,
    "mamba_conv_bias": true, "mamba_proj_bias": false, "projectors_bias": false,
    "mamba_rms_norm": false, "attention_bias": false, "mlp_bias": false,
    "attn_layer_indices": null, "tie_word_embeddings": false})");
}

TEST(HybridFamilies, FalconH1RunsAttentionAndMambaSideBySide) {
  const ModelConfig m = parse_model_config(falcon_h1(), "f", "f.json");
  ASSERT_EQ(m.layers.size(), 2u);
  const LayerSpec& l = m.layers[0];
  EXPECT_EQ(l.block_name(), "gqa|mamba2+dense");
  // Attention: q 8 x 8, k, v 8 x 4 each, o 8 x 8 = 192. Mamba-2: in_proj 8 x (8 + 12 + 2)
  // = 176 (conv_dim 8 + 2 x 2 = 12); conv 48 + bias 12; dt_bias, A_log, D 6; no gated norm;
  // out_proj 64 = 306. MLP 3 x 8 x 16 = 384. Two norms 16.
  EXPECT_EQ(layer_parameter_count(l, 8), 192 + 306 + 384 + 16);
  EXPECT_EQ(parameter_count(m), 2 * 898 + 2 * 80 + 8);

  // The mixer reads the attention's norm output and is summed by its out_proj.
  ShardShape sh;
  sh.seq_len = 64;
  const HardwareProfile hw = load_hardware("h100-sxm");
  const CostedLayer c = cost_layer(l, 8, sh, hw, Efficiency{});
  EXPECT_LT(c.inv.find("ssm.input"), 0);
  EXPECT_LT(c.inv.find("ssm.norm_out"), 0);
  const int out = c.inv.find("ssm.out");
  ASSERT_GE(out, 0);
  EXPECT_FALSE(c.inv.tensors[static_cast<size_t>(out)].saved);
  const int in_proj = c.inv.tensors[static_cast<size_t>(c.inv.find("ssm.in_proj_out"))].producer;
  EXPECT_EQ(c.inv.ops[static_cast<size_t>(in_proj)].inputs,
            std::vector<int>{c.inv.find("attn.norm_out")});
  const int h = c.inv.tensors[static_cast<size_t>(c.inv.find("mlp.input"))].producer;
  EXPECT_EQ(c.inv.ops[static_cast<size_t>(h)].name, "attn.out_proj");
  EXPECT_EQ(c.inv.ops[static_cast<size_t>(h)].inputs.back(), out);
  // The block policy keeps the scan's outputs and mlp.input: the mixer's projections and
  // gate rerun, the scan and the out_projs do not. Full-layer checkpointing reruns both
  // mixers whole, the Mamba mixer's out_proj included (mlp.input needs both).
  const std::vector<Action> rec = recompute_actions(c);
  EXPECT_EQ(rec[static_cast<size_t>(c.inv.find("ssm.scan_out"))], Action::kKeep);
  const ActionCost cost = evaluate_actions(c, rec);
  const ActionCost full = evaluate_actions(c, checkpoint_actions(c));
  EXPECT_TRUE(cost.valid);
  EXPECT_TRUE(full.valid);
  for (size_t k = 0; k < c.inv.ops.size(); ++k) {
    const std::string& name = c.inv.ops[k].name;
    const bool rerun = (cost.rerun_ops >> k & 1u) != 0;
    if (name == "ssm.scan" || name == "ssm.out_proj" || name == "attn.out_proj") {
      EXPECT_FALSE(rerun) << name;
    }
    if (name == "ssm.in_proj" || name == "ssm.gate") {
      EXPECT_TRUE(rerun) << name;
    }
    if (name.starts_with("ssm.") || name.starts_with("attn.")) {
      EXPECT_TRUE((full.rerun_ops >> k & 1u) != 0) << name;
    }
  }

  Json bad = falcon_h1();
  bad["mamba_d_ssm"] = 16;
  EXPECT_TRUE(has(error_of(bad),
                  "\"mamba_d_ssm\" gives the Mamba inner width 16; it must be "
                  "mamba_n_heads x mamba_d_head (2 x 4 = 8)"))
      << error_of(bad);
  bad = falcon_h1();
  bad.erase("mamba_d_ssm");  // mamba_expand x hidden = 16
  EXPECT_TRUE(has(error_of(bad), "\"mamba_expand\" gives the Mamba inner width 16"));
  bad = falcon_h1();
  bad["projectors_bias"] = true;
  EXPECT_TRUE(has(error_of(bad), "\"projectors_bias\" is true but mamba_proj_bias is false"));
  bad = falcon_h1();
  bad["attn_layer_indices"] = Json::array({0});
  EXPECT_TRUE(has(error_of(bad), "\"attn_layer_indices\""));
}

// d 8; layers 1 and 3 (counted from 1) KDA with 2 heads of 4, layer 2 MLA; layer 0 dense.
Json kimi_linear() {
  return Json::parse(R"({
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
    "hidden_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 4, "q_lora_rank": null, "kv_lora_rank": 4,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4, "mla_use_nope": true,
    "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2], "num_heads": 2,
                           "head_dim": 4, "short_conv_kernel_size": 4},
    "intermediate_size": 16, "moe_intermediate_size": 4, "num_experts": 4,
    "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "vocab_size": 10, "tie_word_embeddings": false})");
}

TEST(HybridFamilies, KimiLinearKdaAndMla) {
  const ModelConfig m = parse_model_config(kimi_linear(), "k", "k.json");
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[0].block_name(), "kda+dense");
  EXPECT_EQ(m.layers[1].block_name(), "mla+moe");
  EXPECT_EQ(m.layers[2].block_name(), "kda+moe");
  // KDA, P = 8: q, k, v 3 x 8 x 8 = 192; convs 3 x 8 x 4 = 96; f_a, f_b 8 x 4 + 4 x 8 = 64;
  // b_proj 8 x 2 = 16; A_log 2, dt_bias 8; g_a, g_b 64; o_norm 4; o_proj 64 = 510.
  // Dense MLP 384; two norms 16.
  EXPECT_EQ(layer_parameter_count(m.layers[0], 8), 510 + 384 + 16);
  // MLA: q 8 x 12 = 96; kv_a 8 x 6 = 48; its norm 4; kv_b 4 x 2 x 8 = 64; o 8 x 8 = 64 =
  // 276. MoE: 4 experts x 96 = 384, router 32 + bias 4, shared 96 = 516.
  EXPECT_EQ(layer_parameter_count(m.layers[1], 8), 276 + 516 + 16);

  Json bad = kimi_linear();
  bad["linear_attn_config"]["full_attn_layers"] = Json::array({2, 3});
  EXPECT_TRUE(has(error_of(bad), "lists layer 3 (counted from 1) twice")) << error_of(bad);
  bad = kimi_linear();
  bad["linear_attn_config"]["full_attn_layers"] = Json::array();
  EXPECT_TRUE(has(error_of(bad), "list 2 layers together; the model has 3")) << error_of(bad);
}

// d 8; 2 heads of 4 (kv 1); layers 0, 1 lightning, 2 softmax; 4 experts of 16, top 2.
Json minimax() {
  return Json::parse(R"({
    "model_type": "minimax_m1", "architectures": ["MiniMaxM1ForCausalLM"],
    "hidden_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 4, "rotary_dim": 2, "attn_type_list": [0, 0, 1],
    "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
    "shared_intermediate_size": 0, "postnorm": true, "layernorm_mlp_alpha": 3.5,
    "vocab_size": 10, "tie_word_embeddings": false})");
}

TEST(HybridFamilies, MiniMaxLightningAttention) {
  const ModelConfig m = parse_model_config(minimax(), "x", "x.json");
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[0].block_name(), "lightning+moe");
  EXPECT_EQ(m.layers[2].block_name(), "gqa+moe");
  // Lightning: qkv 8 x 24 = 192, output_gate 64, norm 8, out_proj 64 = 328. MoE: 4 x 384 +
  // router 32 = 1568. Two norms.
  EXPECT_EQ(layer_parameter_count(m.layers[0], 8), 328 + 1568 + 16);
  // No convolution: the core reads the projection directly.
  ShardShape sh;
  sh.seq_len = 64;
  const CostedLayer c = cost_layer(m.layers[0], 8, sh, load_hardware("h100-sxm"), Efficiency{});
  EXPECT_LT(c.inv.find("lin.conv_out"), 0);
  EXPECT_EQ(c.inv.tensors[static_cast<size_t>(c.inv.find("lin.in_proj_out"))].shape,
            (std::vector<int64_t>{64, 32}));  // q, k, v and the gate
  EXPECT_TRUE(evaluate_actions(c, recompute_actions(c)).valid);

  Json bad = minimax();
  bad["shared_intermediate_size"] = 16;
  EXPECT_TRUE(has(error_of(bad), "\"shared_intermediate_size\" is not 0"));
  bad = minimax();
  bad.erase("attn_type_list");
  EXPECT_TRUE(has(error_of(bad), "\"attn_type_list\" is missing"));
  bad["model_type"] = "minimax";  // transformers' default: softmax, linear, softmax
  bad["architectures"] = Json::array({"MiniMaxForCausalLM"});
  const ModelConfig alt = parse_model_config(bad, "x", "x.json");
  EXPECT_EQ(alt.layers[0].block_name(), "gqa+moe");
  EXPECT_EQ(alt.layers[1].block_name(), "lightning+moe");
}

// d 8; 3 layers, layers 1 and 2 hybrid over 1 shared block (2 heads over 2d = 16: head 8);
// Mamba-2 inner 16 in heads of 4, N 2; MLP 16; adapters of rank 2.
Json zamba2() {
  return Json::parse(R"({
    "model_type": "zamba2", "architectures": ["Zamba2ForCausalLM"],
    "hidden_size": 8, "num_hidden_layers": 3, "layers_block_type": ["mamba", "hybrid", "hybrid"],
    "num_mem_blocks": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "intermediate_size": 16, "adapter_rank": 2, "use_shared_attention_adapter": false,
    "mamba_d_state": 2, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1,
    "n_mamba_heads": 4, "add_bias_linear": false, "vocab_size": 10})");
}

TEST(HybridFamilies, Zamba2SharedBlocksAreCountedOnce) {
  const ModelConfig m = parse_model_config(zamba2(), "z", "z.json");
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_TRUE(m.tied_embeddings);
  EXPECT_EQ(m.layers[0].block_name(), "mamba2");
  EXPECT_EQ(m.layers[1].block_name(), "shared+mamba2");
  // Mamba-2: in_proj 8 x (16 + 20 + 4) = 320, conv 80 + 20, 12, gated norm 16, out_proj
  // 128, its norm 8 = 584.
  EXPECT_EQ(layer_parameter_count(m.layers[0], 8), 584);
  // The shared block: norm 16; q, k, v 16 x 16 each = 768; o 16 x 8 = 128; MLP 384 and its
  // norm 8 = 1304. The layer's own: projection 64, MLP adapter 2 x (8 + 32) = 80.
  const int64_t shared = 16 + 768 + 128 + 384 + 8;
  EXPECT_EQ(shared_block_parameter_count(m.layers[1], 8), shared);
  EXPECT_EQ(layer_parameter_count(m.layers[1], 8), 584 + 144 + shared);
  EXPECT_EQ(parameter_count(m), 3 * 584 + 2 * 144 + shared + 80 + 8);  // block once

  // The block reads [hidden, embedding] and adds no residual; its projection makes the
  // mixer's input.
  ShardShape sh;
  sh.seq_len = 64;
  const CostedLayer c = cost_layer(m.layers[1], 8, sh, load_hardware("h100-sxm"), Efficiency{});
  EXPECT_EQ(c.inv.tensors[static_cast<size_t>(c.inv.find("attn.input"))].shape,
            (std::vector<int64_t>{64, 16}));
  const int in = c.inv.find("ssm.input");
  ASSERT_GE(in, 0);
  EXPECT_EQ(c.inv.ops[static_cast<size_t>(c.inv.tensors[static_cast<size_t>(in)].producer)].name,
            "shared.proj");
  EXPECT_FALSE(c.inv.tensors[static_cast<size_t>(c.inv.find("layer.output"))].saved);
  EXPECT_TRUE(evaluate_actions(c, recompute_actions(c)).valid);
  EXPECT_TRUE(evaluate_actions(c, checkpoint_actions(c)).valid);

  // A stage holds the block once; each layer's own figure has it.
  PlanRequest r;
  r.model = m;
  r.hardware = load_hardware("h100-sxm");
  r.work.shape.seq_len = 64;
  const Plan p = make_plan(r);
  EXPECT_EQ(p.params_per_gpu, p.params_total);

  Json bad = zamba2();
  bad["hybrid_layer_ids"] = Json::array({1});
  EXPECT_TRUE(has(error_of(bad), "\"hybrid_layer_ids\" disagrees"));
  bad = zamba2();
  bad["n_mamba_heads"] = 5;
  EXPECT_TRUE(has(error_of(bad), "\"n_mamba_heads\" is 5; must divide the Mamba inner width (16)"));
  bad = zamba2();
  bad["layers_block_type"][0] = "attention";
  EXPECT_TRUE(has(error_of(bad), "\"layers_block_type[0]\" is \"attention\""));
}

// The shipped configs count what their checkpoints hold, to the parameter where the
// checkpoint's tensors are known (Kimi-Linear's listing, MiniMax-M1's index and modeling
// code), else the count the transformers code gives (Falcon-H1, Zamba2).
TEST(HybridFamilies, ShippedConfigsCountTheirCheckpoints) {
  EXPECT_EQ(parameter_count(load_model("Kimi-Linear-48B-A3B-Instruct")), 49122681728);
  EXPECT_EQ(parameter_count(load_model("MiniMax-M1")), 456089655296);
  EXPECT_EQ(parameter_count(load_model("Falcon-H1-0.5B")), 521411104);
  EXPECT_EQ(parameter_count(load_model("Zamba2-7B")), 7356749648);
  const ModelConfig minimax = load_model("MiniMax-M1");
  int softmax = 0;
  for (const LayerSpec& l : minimax.layers) softmax += l.mixer == MixerKind::kAttention;
  EXPECT_EQ(softmax, 10);
  const ModelConfig kimi = load_model("Kimi-Linear-48B-A3B-Instruct");
  for (const size_t i : {3u, 7u, 11u, 15u, 19u, 23u, 26u})
    EXPECT_EQ(kimi.layers[i].attn.kind, AttentionKind::kMla) << i;
  EXPECT_EQ(kimi.layers[0].mlp.kind, MlpKind::kDense);
}

}  // namespace
}  // namespace spillway

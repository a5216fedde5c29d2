// Model configs: each family of the catalog maps onto the right layer stack (dense and
// MoE, GQA and MLA, sliding windows, shared and residual experts), parameter counts are
// exact on configs small enough to count by hand, and configs load from files and
// directories.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/json_io.hpp"
#include "spillway/catalog/model.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

using spillway::testing::TempDir;

TEST(ModelFamilies, Llama) {
  const ModelConfig m = load_model("Llama-3.1-8B");
  EXPECT_EQ(m.model_type, "llama");
  EXPECT_EQ(m.hidden, 4096);
  EXPECT_EQ(m.vocab, 128256);
  EXPECT_FALSE(m.tied_embeddings);
  ASSERT_EQ(m.layers.size(), 32u);
  for (const LayerSpec& l : m.layers) {
    EXPECT_EQ(l, m.layers[0]);
  }
  const LayerSpec& l = m.layers[0];
  EXPECT_EQ(l.attn.kind, AttentionKind::kGqa);
  EXPECT_EQ(l.attn.heads, 32);
  EXPECT_EQ(l.attn.kv_heads, 8);
  EXPECT_EQ(l.attn.qk_head_dim, 128);
  EXPECT_EQ(l.attn.v_head_dim, 128);
  EXPECT_EQ(l.attn.sliding_window, 0);
  EXPECT_FALSE(l.attn.qkv_bias);
  EXPECT_FALSE(l.attn.qk_norm);
  EXPECT_EQ(l.mlp.kind, MlpKind::kDense);
  EXPECT_EQ(l.mlp.ffn, 14336);
  EXPECT_EQ(l.mlp.active_ffn(), 14336);
  EXPECT_EQ(l.block_name(), "gqa+dense");
}

TEST(ModelFamilies, MistralSlidingWindowOnEveryLayer) {
  const ModelConfig m = load_model("Mistral-7B");
  EXPECT_EQ(m.model_type, "mistral");
  ASSERT_EQ(m.layers.size(), 32u);
  for (const LayerSpec& l : m.layers) {
    EXPECT_EQ(l.attn.sliding_window, 4096);
    EXPECT_EQ(l.block_name(), "swa+dense");
  }
}

TEST(ModelFamilies, Qwen2Dense) {
  const ModelConfig m = load_model("Qwen2.5-7B");
  EXPECT_EQ(m.model_type, "qwen2");
  ASSERT_EQ(m.layers.size(), 28u);
  const LayerSpec& l = m.layers[0];
  EXPECT_TRUE(l.attn.qkv_bias);  // Qwen2 has q/k/v biases but none on o_proj
  EXPECT_FALSE(l.attn.o_bias);
  EXPECT_FALSE(l.attn.qk_norm);
  EXPECT_EQ(l.attn.sliding_window, 0);  // use_sliding_window is false
  EXPECT_EQ(l.attn.heads, 28);
  EXPECT_EQ(l.attn.kv_heads, 4);
  EXPECT_EQ(l.attn.qk_head_dim, 128);
  EXPECT_EQ(l.mlp.ffn, 18944);
}

TEST(ModelFamilies, Qwen3Dense) {
  const ModelConfig m = load_model("Qwen3-14B");
  EXPECT_EQ(m.model_type, "qwen3");
  ASSERT_EQ(m.layers.size(), 40u);
  const LayerSpec& l = m.layers[0];
  EXPECT_TRUE(l.attn.qk_norm);
  EXPECT_FALSE(l.attn.qkv_bias);
  EXPECT_EQ(l.attn.qk_head_dim, 128);
  EXPECT_EQ(l.mlp.kind, MlpKind::kDense);
  EXPECT_EQ(l.mlp.ffn, 17408);
}

TEST(ModelFamilies, Qwen2MoeSharedExpert) {
  const ModelConfig m = load_model("Qwen2-57B-A14B");
  EXPECT_EQ(m.model_type, "qwen2_moe");
  ASSERT_EQ(m.layers.size(), 28u);
  for (const LayerSpec& l : m.layers) {
    ASSERT_EQ(l.mlp.kind, MlpKind::kMoe);
    EXPECT_EQ(l.mlp.experts, 64);
    EXPECT_EQ(l.mlp.top_k, 8);
    EXPECT_EQ(l.mlp.ffn, 2560);
    EXPECT_EQ(l.mlp.shared_ffn, 20480);
    EXPECT_TRUE(l.mlp.shared_gate);
    EXPECT_EQ(l.mlp.active_ffn(), 8 * 2560 + 20480);
    EXPECT_TRUE(l.attn.qkv_bias);
    EXPECT_EQ(l.block_name(), "gqa+moe");
  }
}

TEST(ModelFamilies, Qwen3Moe) {
  const ModelConfig m = load_model("Qwen3-30B-A3B");
  EXPECT_EQ(m.model_type, "qwen3_moe");
  ASSERT_EQ(m.layers.size(), 48u);
  for (const LayerSpec& l : m.layers) {
    ASSERT_EQ(l.mlp.kind, MlpKind::kMoe);
    EXPECT_EQ(l.mlp.experts, 128);
    EXPECT_EQ(l.mlp.top_k, 8);
    EXPECT_EQ(l.mlp.ffn, 768);
    EXPECT_EQ(l.mlp.shared_ffn, 0);
    EXPECT_EQ(l.mlp.active_ffn(), 6144);
    EXPECT_TRUE(l.attn.qk_norm);
    EXPECT_EQ(l.attn.heads, 32);
    EXPECT_EQ(l.attn.kv_heads, 4);
    EXPECT_EQ(l.attn.qk_head_dim, 128);  // head_dim given, not hidden / heads (64)
  }
}

TEST(ModelFamilies, Mixtral) {
  const ModelConfig m = load_model("Mixtral-8x7B");
  EXPECT_EQ(m.model_type, "mixtral");
  ASSERT_EQ(m.layers.size(), 32u);
  const LayerSpec& l = m.layers[0];
  EXPECT_EQ(l.mlp.kind, MlpKind::kMoe);
  EXPECT_EQ(l.mlp.experts, 8);
  EXPECT_EQ(l.mlp.top_k, 2);
  EXPECT_EQ(l.mlp.ffn, 14336);
  EXPECT_EQ(l.attn.sliding_window, 0);  // null in the config
}

TEST(ModelFamilies, DeepSeekV3ThreeDenseLayersThenMoe) {
  const ModelConfig m = load_model("DeepSeek-V3");
  EXPECT_EQ(m.model_type, "deepseek_v3");
  ASSERT_EQ(m.layers.size(), 61u);
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const LayerSpec& l = m.layers[i];
    SCOPED_TRACE(i);
    EXPECT_EQ(l.attn.kind, AttentionKind::kMla);
    EXPECT_EQ(l.attn.heads, 128);
    EXPECT_EQ(l.attn.q_lora_rank, 1536);
    EXPECT_EQ(l.attn.kv_lora_rank, 512);
    EXPECT_EQ(l.attn.qk_head_dim, 192);
    EXPECT_EQ(l.attn.qk_rope_head_dim, 64);
    EXPECT_EQ(l.attn.v_head_dim, 128);
    if (i < 3) {
      EXPECT_EQ(l.mlp.kind, MlpKind::kDense);
      EXPECT_EQ(l.mlp.ffn, 18432);
      EXPECT_EQ(l.block_name(), "mla+dense");
    } else {
      EXPECT_EQ(l.mlp.kind, MlpKind::kMoe);
      EXPECT_EQ(l.mlp.experts, 256);
      EXPECT_EQ(l.mlp.top_k, 8);
      EXPECT_EQ(l.mlp.ffn, 2048);
      EXPECT_EQ(l.mlp.shared_ffn, 2048);
      EXPECT_TRUE(l.mlp.router_bias);
      EXPECT_EQ(l.block_name(), "mla+moe");
    }
  }
}

TEST(ModelFamilies, GptOssAlternatingSlidingWindow) {
  const ModelConfig m = load_model("GPT-OSS-20B");
  EXPECT_EQ(m.model_type, "gpt_oss");
  ASSERT_EQ(m.layers.size(), 24u);
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const LayerSpec& l = m.layers[i];
    SCOPED_TRACE(i);
    EXPECT_EQ(l.attn.sliding_window, i % 2 == 0 ? 128 : 0);
    EXPECT_EQ(l.block_name(), i % 2 == 0 ? "swa+moe" : "gqa+moe");
    EXPECT_TRUE(l.attn.sinks);
    EXPECT_TRUE(l.attn.qkv_bias);
    EXPECT_EQ(l.mlp.experts, 32);
    EXPECT_EQ(l.mlp.top_k, 4);
    EXPECT_EQ(l.mlp.ffn, 2880);
    EXPECT_TRUE(l.mlp.bias);
    EXPECT_TRUE(l.mlp.router_bias);
  }
}

TEST(ModelFamilies, GrokResidualDenseMlp) {
  const ModelConfig m = load_model("Grok-2");
  ASSERT_EQ(m.layers.size(), 64u);
  const LayerSpec& l = m.layers[0];
  EXPECT_EQ(l.mlp.kind, MlpKind::kMoe);
  EXPECT_EQ(l.mlp.experts, 8);
  EXPECT_EQ(l.mlp.top_k, 2);
  EXPECT_EQ(l.mlp.ffn, 16384);
  EXPECT_EQ(l.mlp.residual_ffn, 32768);
  EXPECT_EQ(l.mlp.active_ffn(), 2 * 16384 + 32768);
  EXPECT_EQ(l.block_name(), "gqa+moe+dense");
}

TEST(ModelFamilies, EveryCatalogModelTypeIsListedAsSupported) {
  const std::vector<std::string>& types = supported_model_types();
  for (const char* t : {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral",
                        "deepseek_v2", "deepseek_v3", "gpt_oss"}) {
    EXPECT_TRUE(std::find(types.begin(), types.end(), t) != types.end()) << t;
  }
  std::vector<std::string> unlisted;
  for (const ModelCatalogEntry& e : model_catalog()) {
    const std::string t = load_model(e.name).model_type;
    if (std::find(types.begin(), types.end(), t) == types.end())
      unlisted.push_back(e.name + ": " + t);
  }
  EXPECT_TRUE(unlisted.empty())
      << "supported_model_types() (\"the model_type values the loader knows\", also printed by "
         "the unknown-type error) omits a type the loader accepts: "
      << (unlisted.empty() ? "" : unlisted[0]);
}

// --- configs small enough to count by hand ------------------------------------------

Json tiny_llama() {
  return Json::parse(R"({
    "model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
    "vocab_size": 10})");
}

TEST(ParameterCount, TinyDenseByHand) {
  // Per layer: norm 8 + q 8*8 + k,v 8*(1*(4+4)) + o 8*8 + norm 8 + SwiGLU 3*8*16 = 592.
  // Embeddings untied 2*10*8 = 160, final norm 8.
  const ModelConfig m = parse_model_config(tiny_llama(), "tiny", "tiny.json");
  ASSERT_EQ(m.layers.size(), 2u);
  EXPECT_EQ(m.layers[0].attn.qk_head_dim, 4);
  EXPECT_EQ(layer_parameter_count(m.layers[0], 8), 592);
  EXPECT_EQ(parameter_count(m), 2 * 592 + 160 + 8);
  EXPECT_EQ(active_parameter_count(m), parameter_count(m));

  Json tied = tiny_llama();
  tied["tie_word_embeddings"] = true;
  EXPECT_EQ(parameter_count(parse_model_config(tied, "t", "t.json")), 2 * 592 + 80 + 8);

  Json bias = tiny_llama();
  bias["attention_bias"] = true;  // q (8) + k,v (8) + o (8) biases
  EXPECT_EQ(layer_parameter_count(parse_model_config(bias, "b", "b.json").layers[0], 8), 592 + 24);
}

TEST(ParameterCount, TinyMoeByHand) {
  // Attention 8 + 64 + 64 + 64 + qk_norm 2*4 = 208; norm 8; experts 4 * 3*8*6 = 576;
  // router 8*4 = 32 -> 824 per layer. Active: 2 experts (288) and router 8*2 (16) -> 520.
  const Json j = Json::parse(R"({
    "model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6})");
  const ModelConfig m = parse_model_config(j, "tiny-moe", "tiny-moe.json");
  ASSERT_EQ(m.layers.size(), 2u);
  EXPECT_EQ(layer_parameter_count(m.layers[0], 8), 824);
  EXPECT_EQ(parameter_count(m), 2 * 824 + 168);
  EXPECT_EQ(active_parameter_count(m), 2 * 520 + 168);
}

TEST(ModelConfigParse, QwenMoeSparseStepAndMlpOnlyLayers) {
  const Json j = Json::parse(R"({
    "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 4, "vocab_size": 100, "intermediate_size": 96,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "decoder_sparse_step": 2, "mlp_only_layers": [3]})");
  const ModelConfig m = parse_model_config(j, "m", "m.json");
  ASSERT_EQ(m.layers.size(), 6u);
  // MoE where (i + 1) % 2 == 0 and i not in mlp_only_layers: 1 and 5.
  const std::vector<MlpKind> want = {MlpKind::kDense, MlpKind::kMoe,   MlpKind::kDense,
                                     MlpKind::kDense, MlpKind::kDense, MlpKind::kMoe};
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(m.layers[i].mlp.kind, want[i]) << "layer " << i;
    if (want[i] == MlpKind::kDense) {
      EXPECT_EQ(m.layers[i].mlp.ffn, 96);
    }
  }
}

TEST(ModelConfigParse, Qwen2SlidingWindowFromMaxWindowLayers) {
  const Json j = Json::parse(R"({
    "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "vocab_size": 100, "intermediate_size": 96,
    "use_sliding_window": true, "sliding_window": 32, "max_window_layers": 2})");
  const ModelConfig m = parse_model_config(j, "m", "m.json");
  EXPECT_EQ(m.layers[0].attn.sliding_window, 0);
  EXPECT_EQ(m.layers[1].attn.sliding_window, 0);
  EXPECT_EQ(m.layers[2].attn.sliding_window, 32);
  EXPECT_EQ(m.layers[3].attn.sliding_window, 32);
}

TEST(ModelConfigParse, GptOssWithoutLayerTypesAlternates) {
  const Json j = Json::parse(R"({
    "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 4, "head_dim": 16,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
    "intermediate_size": 32, "num_local_experts": 4, "experts_per_token": 2,
    "sliding_window": 8})");
  const ModelConfig m = parse_model_config(j, "m", "m.json");
  ASSERT_EQ(m.layers.size(), 4u);
  EXPECT_EQ(m.layers[0].attn.sliding_window, 8);
  EXPECT_EQ(m.layers[1].attn.sliding_window, 0);
  EXPECT_EQ(m.layers[2].attn.sliding_window, 8);
  EXPECT_EQ(m.layers[3].attn.sliding_window, 0);
  EXPECT_EQ(m.layers[0].mlp.top_k, 2);  // experts_per_token read when num_experts_per_tok is absent
}

TEST(ModelConfigParse, DeepSeekV2WithoutExpertsIsDense) {
  const Json j = Json::parse(R"({
    "model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 4, "vocab_size": 100, "intermediate_size": 96,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8})");
  const ModelConfig m = parse_model_config(j, "m", "m.json");
  for (const LayerSpec& l : m.layers) {
    EXPECT_EQ(l.mlp.kind, MlpKind::kDense);
    EXPECT_EQ(l.attn.kind, AttentionKind::kMla);
    EXPECT_EQ(l.attn.q_lora_rank, 0);
    EXPECT_FALSE(l.mlp.router_bias);
  }
}

TEST(ModelConfigParse, GrokWithoutResidual) {
  const Json j = Json::parse(R"({
    "model_type": "grok-1", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "vocab_size": 100, "intermediate_size": 96,
    "num_experts": 8, "num_experts_per_tok": 2})");
  const ModelConfig m = parse_model_config(j, "m", "m.json");
  EXPECT_EQ(m.layers[0].mlp.ffn, 96);
  EXPECT_EQ(m.layers[0].mlp.residual_ffn, 0);
  EXPECT_EQ(m.layers[0].block_name(), "gqa+moe");
}

TEST(ModelConfigParse, ModelTypeIsCaseInsensitive) {
  Json j = tiny_llama();
  j["model_type"] = "LLaMA";
  const ModelConfig m = parse_model_config(j, "m", "m.json");
  EXPECT_EQ(m.model_type, "LLaMA");
  EXPECT_EQ(m.layers.size(), 2u);
}

TEST(ModelConfigLoad, FromFileAndDirectory) {
  TempDir dir;
  const std::string file = dir.write("tiny-llama.json", tiny_llama().dump());
  const ModelConfig a = load_model(file);
  EXPECT_EQ(a.name, "tiny-llama");
  EXPECT_EQ(a.source, file);
  EXPECT_EQ(parameter_count(a), 1352);

  dir.write("my-model/config.json", tiny_llama().dump());
  const ModelConfig b = load_model(dir.file("my-model"));
  EXPECT_EQ(b.name, "my-model");
  EXPECT_EQ(b.layers, a.layers);
  const ModelConfig c = load_model(dir.file("my-model/config.json"));
  EXPECT_EQ(c.name, "my-model");
}

}  // namespace
}  // namespace spillway

// Note [Reading a config] (src/model/model_config.cpp, docs/models.md): the key names of
// transformers 4 and 5 (aliases), nested text_config, `architectures` as a fallback and as
// the judge of a mislabelled model_type, and the families added with the model families work (Gemma
// 2/3, Phi-3, GLM-4.5, DeepSeek V1 and V3.2, Kimi-K2, Llama 4), each on a config small enough to
// count by hand.
#include <gtest/gtest.h>

#include <string>

#include "core/embedded_data.hpp"
#include "core/json_io.hpp"
#include "model/config_test_support.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"

namespace spillway {
namespace {

using spillway::testing::embedded;

using spillway::testing::config_error;

bool has_note(const ModelConfig& m, const std::string& part) {
  for (const std::string& n : m.notes)
    if (n.find(part) != std::string::npos) return true;
  return false;
}

// --- aliases --------------------------------------------------------------------------

TEST(ConfigAliases, Qwen3MoeWrittenByTransformers5) {
  Json t4 = embedded("qwen3-30b-a3b.json");
  Json t5 = t4;
  t5["num_local_experts"] = t5["num_experts"];
  t5.erase("num_experts");
  t5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", t5["rope_theta"]}};
  t5.erase("rope_theta");
  const ModelConfig a = parse_model_config(t4, "a", "a.json");
  const ModelConfig b = parse_model_config(t5, "b", "b.json");
  EXPECT_EQ(a.layers, b.layers);
  EXPECT_EQ(parameter_count(a), parameter_count(b));
  // Both spellings with different values: refused, both named.
  Json both = t4;
  both["num_local_experts"] = 64;
  const std::string e = config_error(both);
  EXPECT_NE(e.find("\"num_local_experts\" is 64 but its alias \"num_experts\" is 128"),
            std::string::npos)
      << e;
}

TEST(ConfigAliases, DeepSeekV3RoutedExpertsUnderEitherName) {
  const Json hf = embedded("deepseek-v3.json");
  Json copy = hf;
  copy["num_routed_experts"] = copy["n_routed_experts"];
  copy["num_shared_experts"] = copy["n_shared_experts"];
  copy.erase("n_routed_experts");
  copy.erase("n_shared_experts");
  const ModelConfig a = parse_model_config(hf, "a", "a.json");
  const ModelConfig b = parse_model_config(copy, "b", "b.json");
  EXPECT_EQ(b.layers.back().mlp.experts, 256);
  EXPECT_EQ(parameter_count(a), parameter_count(b));
  EXPECT_NEAR(static_cast<double>(parameter_count(b)) / 1e9, 671.0, 0.671 * 1.0);
  // Neither: refused, not planned as a 37B dense model.
  Json none = hf;
  none.erase("n_routed_experts");
  const std::string e = config_error(none);
  EXPECT_NE(e.find("\"n_routed_experts\" is missing"), std::string::npos) << e;
  // Kimi-K2 is DeepSeek-V3's architecture under its own model_type.
  Json kimi = hf;
  kimi["model_type"] = "kimi_k2";
  EXPECT_EQ(parse_model_config(kimi, "k", "k.json").layers, a.layers);
}

TEST(ConfigAliases, GptOssTopKUnderEitherName) {
  Json j = embedded("gpt-oss-20b.json");
  const int64_t k = j.contains("num_experts_per_tok") ? j["num_experts_per_tok"].get<int64_t>()
                                                      : j["experts_per_token"].get<int64_t>();
  Json other = j;
  other.erase("num_experts_per_tok");
  other.erase("experts_per_token");
  other["experts_per_token"] = k;
  EXPECT_EQ(parse_model_config(other, "o", "o.json").layers.front().mlp.top_k, k);
}

// --- where the model is described -----------------------------------------------------

TEST(ConfigNesting, TextConfigOfAMultimodalWrapper) {
  Json text = Json::parse(R"({
    "model_type": "gemma3_text", "hidden_size": 8, "num_hidden_layers": 6,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
    "intermediate_size": 16, "vocab_size": 10, "sliding_window": 3})");
  Json wrapper = {{"model_type", "gemma3"},
                  {"architectures", {"Gemma3ForConditionalGeneration"}},
                  {"text_config", text},
                  {"vision_config", {{"hidden_size", 1152}, {"num_hidden_layers", 27}}}};
  const ModelConfig m = parse_model_config(wrapper, "g", "g.json");
  EXPECT_EQ(m.model_type, "gemma3_text");
  EXPECT_EQ(m.hidden, 8);
  ASSERT_EQ(m.layers.size(), 6u);
  EXPECT_TRUE(has_note(m, "vision tower")) << (m.notes.empty() ? "" : m.notes[0]);
  // The text config without its model_type: the wrapper's text family.
  wrapper["text_config"].erase("model_type");
  EXPECT_EQ(parse_model_config(wrapper, "g", "g.json").model_type, "gemma3_text");
  // Used to be "hidden_size is missing".
  EXPECT_EQ(parse_model_config(wrapper, "g", "g.json").layers.size(), 6u);
}

TEST(ConfigNesting, ArchitecturesWhenModelTypeIsMissingOrWrong) {
  Json j = Json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "intermediate_size": 16, "vocab_size": 10})");
  EXPECT_EQ(parse_model_config(j, "l", "l.json").model_type, "llama");
  j["architectures"] = {"BertModel"};
  std::string e = config_error(j);
  EXPECT_NE(e.find("\"model_type\" is missing, and \"architectures\" (BertModel)"),
            std::string::npos)
      << e;
  j.erase("architectures");
  e = config_error(j);
  EXPECT_NE(e.find("\"model_type\" is missing, and so is \"architectures\""), std::string::npos)
      << e;
  // model_type mixtral on a Grok-1 checkpoint: planned as Grok (its own sliding-window and
  // residual keys read), with a note; before, it planned as Mixtral.
  Json grok = Json::parse(R"({
    "model_type": "mixtral", "architectures": ["Grok1ModelForCausalLM"], "hidden_size": 8,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "intermediate_size": 16, "vocab_size": 10, "num_local_experts": 8,
    "num_experts_per_tok": 2})");
  const ModelConfig g = parse_model_config(grok, "g", "g.json");
  EXPECT_EQ(g.model_type, "grok-1");
  EXPECT_TRUE(has_note(g, "planned as \"grok-1\"")) << (g.notes.empty() ? "" : g.notes[0]);
}

// --- the families ---------------------------------------------------------------------

// Per layer (d 8, 2 heads of 4, 1 KV head, ffn 16): norm 8 + q 64 + kv 64 + o 64 + norm 8 +
// MLP 3*8*16 = 384 -> 592; the sandwich norms add 16; Gemma 3's q/k norms 8.
TEST(ConfigFamilies, GemmaSandwichNormsTiedEmbeddingsAndWindows) {
  const Json g2 = Json::parse(R"({
    "model_type": "gemma2", "hidden_size": 8, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
    "intermediate_size": 16, "vocab_size": 10, "sliding_window": 3,
    "query_pre_attn_scalar": 4, "final_logit_softcapping": 30.0})");
  const ModelConfig m2 = parse_model_config(g2, "g2", "g2.json");
  EXPECT_TRUE(m2.tied_embeddings);  // Gemma's default
  EXPECT_EQ(layer_parameter_count(m2.layers[0], 8), 592 + 16);
  EXPECT_EQ(parameter_count(m2), 4 * 608 + 80 + 8);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(m2.layers[i].attn.sliding_window, i % 2 == 0 ? 3 : 0);

  Json g3 = g2;
  g3["model_type"] = "gemma3_text";
  g3["num_hidden_layers"] = 6;
  g3.erase("final_logit_softcapping");
  const ModelConfig m3 = parse_model_config(g3, "g3", "g3.json");
  EXPECT_EQ(layer_parameter_count(m3.layers[0], 8), 592 + 16 + 8);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(m3.layers[i].attn.sliding_window, i == 5 ? 0 : 3);
  g3["sliding_window_pattern"] = 2;
  const ModelConfig p2 = parse_model_config(g3, "g3", "g3.json");
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(p2.layers[i].attn.sliding_window, i % 2 == 1 ? 0 : 3);
  g3["layer_types"] = {"full_attention",    "sliding_attention", "sliding_attention",
                       "sliding_attention", "sliding_attention", "full_attention"};
  const ModelConfig lt = parse_model_config(g3, "g3", "g3.json");
  for (size_t i = 0; i < 6; ++i)
    EXPECT_EQ(lt.layers[i].attn.sliding_window, i == 0 || i == 5 ? 0 : 3);
  g3["tie_word_embeddings"] = false;
  EXPECT_FALSE(parse_model_config(g3, "g3", "g3.json").tied_embeddings);
}

TEST(ConfigFamilies, Phi3SlidingWindowOnEveryLayer) {
  const Json j = Json::parse(R"({
    "model_type": "phi3", "hidden_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2,
    "num_key_value_heads": 2, "intermediate_size": 16, "vocab_size": 10,
    "sliding_window": 5, "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": 4096})");
  const ModelConfig m = parse_model_config(j, "p", "p.json");
  for (const LayerSpec& l : m.layers) EXPECT_EQ(l.attn.sliding_window, 5);
  // Fused qkv_proj and gate_up_proj hold what q, k, v and gate, up hold: norm 8 + q 64 +
  // k, v 2 * 2 * 4 * 8 + o 64 + norm 8 + MLP 384.
  EXPECT_EQ(layer_parameter_count(m.layers[0], 8), 8 + 64 + 128 + 64 + 8 + 384);
}

TEST(ConfigFamilies, Glm4MoeDenseFirstLayersSharedExpertAndMtp) {
  const Json j = Json::parse(R"({
    "model_type": "glm4_moe", "hidden_size": 8, "num_hidden_layers": 3,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "attention_bias": true,
    "use_qk_norm": true, "intermediate_size": 16, "vocab_size": 10,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
    "n_group": 1, "topk_group": 1, "partial_rotary_factor": 0.5})");
  const ModelConfig m = parse_model_config(j, "glm", "glm.json");
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[0].mlp.kind, MlpKind::kDense);
  EXPECT_EQ(m.layers[1].mlp.kind, MlpKind::kMoe);
  EXPECT_EQ(m.layers[1].mlp.shared_ffn, 6);
  EXPECT_TRUE(m.layers[1].mlp.router_bias);
  EXPECT_TRUE(m.layers[1].attn.qkv_bias);
  EXPECT_FALSE(m.layers[1].attn.o_bias);
  EXPECT_TRUE(m.layers[1].attn.qk_norm);
  EXPECT_EQ(m.mtp_layers, 1);
  EXPECT_TRUE(has_note(m, "multi-token-prediction"));
  // Attention: norm 8 + q 64 + k, v 64 + o 64 + q, k, v biases 16 + q/k norms 8 = 224;
  // norm 8; experts 4 * 3 * 8 * 6 = 576, router 32 + its bias 4, shared 144 -> 988.
  EXPECT_EQ(layer_parameter_count(m.layers[1], 8), 224 + 8 + 576 + 36 + 144);
}

TEST(ConfigFamilies, DeepSeekV1IsMultiHeadAttentionWithExperts) {
  const Json j = Json::parse(R"({
    "model_type": "deepseek", "hidden_size": 8, "num_hidden_layers": 3,
    "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 16,
    "vocab_size": 10, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1})");
  const ModelConfig m = parse_model_config(j, "d", "d.json");
  EXPECT_EQ(m.layers[1].attn.kind, AttentionKind::kGqa);
  EXPECT_EQ(m.layers[0].mlp.kind, MlpKind::kDense);
  EXPECT_EQ(m.layers[2].mlp.shared_ffn, 12);
  EXPECT_FALSE(m.layers[2].mlp.router_bias);
}

TEST(ConfigFamilies, DeepSeekV32IndexerParameters) {
  Json j = embedded("deepseek-v3.json");
  j["model_type"] = "deepseek_v32";
  j["index_n_heads"] = 64;
  j["index_head_dim"] = 128;
  j["index_topk"] = 2048;
  const ModelConfig v3 = parse_model_config(embedded("deepseek-v3.json"), "a", "a.json");
  const ModelConfig v32 = parse_model_config(j, "b", "b.json");
  // wq_b 1536 x 64 x 128, wk 7168 x 128, k_norm 2 x 128, weights_proj 7168 x 64.
  const int64_t indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64;
  EXPECT_EQ(layer_parameter_count(v32.layers[5], 7168) - layer_parameter_count(v3.layers[5], 7168),
            indexer);
  j.erase("index_head_dim");
  EXPECT_NE(config_error(j).find("\"index_head_dim\" is missing"), std::string::npos);
}

TEST(ConfigFamilies, Llama4InterleavedExpertsWithASharedOne) {
  const Json j = Json::parse(R"({
    "model_type": "llama4_text", "hidden_size": 8, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
    "intermediate_size": 6, "intermediate_size_mlp": 16, "vocab_size": 10,
    "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
    "attention_chunk_size": 8192, "no_rope_layers": [1, 1, 1, 0]})");
  const ModelConfig m = parse_model_config(j, "l4", "l4.json");
  ASSERT_EQ(m.layers.size(), 4u);
  EXPECT_EQ(m.layers[0].mlp.kind, MlpKind::kDense);
  EXPECT_EQ(m.layers[0].mlp.ffn, 16);
  EXPECT_EQ(m.layers[1].mlp.kind, MlpKind::kMoe);
  EXPECT_EQ(m.layers[1].mlp.ffn, 6);
  EXPECT_EQ(m.layers[1].mlp.shared_ffn, 6);
  EXPECT_EQ(m.layers[1].mlp.top_k, 1);
  Json listed = j;
  listed["moe_layers"] = {0, 3};
  const ModelConfig l = parse_model_config(listed, "l4", "l4.json");
  EXPECT_EQ(l.layers[0].mlp.kind, MlpKind::kMoe);
  EXPECT_EQ(l.layers[1].mlp.kind, MlpKind::kDense);
  EXPECT_EQ(l.layers[3].mlp.kind, MlpKind::kMoe);
}

TEST(ConfigFamilies, QwenLayerTypesAndIgnoredWindowKeys) {
  Json j = embedded("qwen3-14b.json");
  const int64_t n = j["num_hidden_layers"].get<int64_t>();
  j["layer_types"] = Json::array();
  for (int64_t i = 0; i < n; ++i) j["layer_types"].push_back("full_attention");
  const ModelConfig m = parse_model_config(j, "q", "q.json");
  for (const LayerSpec& l : m.layers) EXPECT_EQ(l.attn.sliding_window, 0);
  j["layer_types"][0] = "local";
  EXPECT_NE(config_error(j).find("\"layer_types[0]\" is \"local\""), std::string::npos);
}

// MTP layers: counted apart and left out by default (the notes say so), planned with
// with_mtp_layers (`spillway plan --mtp`): each a copy of the last layer with the module's
// two norms and 2d x d projection.
TEST(ConfigFamilies, MtpLayersAreOptional) {
  const ModelConfig m = parse_model_config(embedded("deepseek-v3.json"), "d", "d.json");
  EXPECT_EQ(m.mtp_layers, 1);
  EXPECT_TRUE(has_note(m, "are not planned"));
  const ModelConfig w = with_mtp_layers(m);
  ASSERT_EQ(w.layers.size(), m.layers.size() + 1);
  EXPECT_EQ(w.layers.back().block_name(), "mla+moe+mtp");
  const int64_t d = m.hidden;
  EXPECT_EQ(parameter_count(w) - parameter_count(m),
            layer_parameter_count(m.layers.back(), d) + 2 * d * d + 2 * d);
  EXPECT_FALSE(has_note(w, "are not planned"));
  EXPECT_TRUE(has_note(w, "planned after the last layer (--mtp)"));
  const ModelConfig llama = parse_model_config(embedded("llama-3.1-8b.json"), "l", "l.json");
  try {
    (void)with_mtp_layers(llama);
    ADD_FAILURE() << "no MTP layers to add";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("declares no multi-token-prediction layers"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace spillway

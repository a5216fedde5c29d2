// Configs as transformers 5 writes them (save_pretrained, and whole with use_diff=False):
// the keys it derives (qk_head_dim, num_hidden_layers from layers_block_type, mlp_layer_types,
// Llama 4's layer_types), its layer-kind spellings ("linear_attention" for a Mamba layer), the
// generic PretrainedConfig fields, a wrapper's own tie_word_embeddings, and the refusal of a
// model_type spillway does not plan. The Python suite checks the same against transformers'
// config classes (python/tests/test_catalog_transformers.py).
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

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != s.npos;
}

bool has_note(const ModelConfig& m, const std::string& part) {
  for (const std::string& n : m.notes)
    if (has(n, part)) return true;
  return false;
}

void expect_same_model(const Json& a, const Json& b) {
  const ModelConfig ma = parse_model_config(a, "a", "a.json");
  const ModelConfig mb = parse_model_config(b, "b", "b.json");
  EXPECT_EQ(ma.layers, mb.layers);
  EXPECT_EQ(parameter_count(ma), parameter_count(mb));
}

TEST(Transformers5, GenericPretrainedConfigFieldsAreIgnored) {
  const Json t4 = embedded("llama-3.1-8b.json");
  Json whole = t4;
  whole["chunk_size_feed_forward"] = 0;
  whole["id2label"] = {{"0", "LABEL_0"}, {"1", "LABEL_1"}};
  whole["label2id"] = {{"LABEL_0", 0}, {"LABEL_1", 1}};
  whole["is_encoder_decoder"] = false;
  whole["output_hidden_states"] = false;
  whole["return_dict"] = true;
  whole["num_beams"] = 1;  // transformers 4's generation defaults
  whole["no_repeat_ngram_size"] = 0;
  whole["_name_or_path"] = "";
  expect_same_model(t4, whole);
}

TEST(Transformers5, MlaQkHeadDimIsCheckedAgainstNopePlusRope) {
  const Json t4 = embedded("deepseek-v3.json");
  Json t5 = t4;
  t5["qk_head_dim"] = 192;  // 128 + 64
  expect_same_model(t4, t5);
  t5["qk_head_dim"] = 128;
  const std::string e = config_error(t5);
  EXPECT_TRUE(has(e, "\"qk_head_dim\" is 128; transformers derives it as")) << e;
  EXPECT_TRUE(has(e, "(128 + 64 = 192)")) << e;
}

TEST(Transformers5, Mamba2TimeStepRankIsNoWeight) {
  const Json t4 = Json::parse(R"({
    "model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100,
    "state_size": 16, "num_heads": 8, "head_dim": 16, "n_groups": 1, "expand": 2})");
  Json t5 = t4;
  t5["time_step_rank"] = 4;  // ceil(64 / 16), as transformers 5 writes it
  expect_same_model(t4, t5);
  t5["time_step_rank"] = "auto";
  expect_same_model(t4, t5);
  t5["time_step_rank"] = "wide";
  EXPECT_TRUE(has(config_error(t5), "\"time_step_rank\" must be an integer or \"auto\""));
}

TEST(Transformers5, NemotronHLayersBlockTypeGivesTheLayers) {
  const Json t4 = embedded("nemotron-3-nano-30b-a3b.json");
  Json t5 = t4;
  const std::string pattern = t4.at("hybrid_override_pattern").get<std::string>();
  Json types = Json::array();
  for (char ch : pattern) {
    types.push_back(ch == 'M'   ? "linear_attention"
                    : ch == '*' ? "full_attention"
                    : ch == '-' ? "mlp"
                                : "moe");
  }
  t5["layers_block_type"] = types;
  t5["mtp_layers_block_type"] = Json::array({"full_attention", "moe"});
  t5.erase("hybrid_override_pattern");
  t5.erase("num_hidden_layers");  // transformers 5 derives it
  expect_same_model(t4, t5);
  Json count = t5;
  count["num_hidden_layers"] = 51;
  EXPECT_TRUE(has(config_error(count),
                  "\"num_hidden_layers\" is 51; transformers derives it from "
                  "\"layers_block_type\", which has 52 entries"));
  Json both = t5;
  both["hybrid_override_pattern"] = "M" + pattern.substr(1, pattern.size() - 2) + "M";
  EXPECT_TRUE(has(config_error(both), "\"hybrid_override_pattern\" is"));
  Json kind = t5;
  kind["layers_block_type"][3] = "mamba3";
  EXPECT_TRUE(has(config_error(kind), "\"layers_block_type[3]\" is \"mamba3\""));
}

TEST(Transformers5, LinearAttentionIsTheMambaLayerOfZamba2AndGranite) {
  const Json t4 = embedded("zamba2-7b.json");
  Json t5 = t4;
  for (Json& t : t5["layers_block_type"])
    if (t == "mamba") t = "linear_attention";
  expect_same_model(t4, t5);

  const Json granite = Json::parse(R"({
    "model_type": "granitemoehybrid", "hidden_size": 64, "num_hidden_layers": 3,
    "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 32, "shared_intermediate_size": 48, "num_local_experts": 4,
    "num_experts_per_tok": 2, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
    "mamba_n_groups": 1, "mamba_expand": 2, "layer_types": ["mamba", "attention", "mamba"]})");
  Json g5 = granite;
  g5["layer_types"] = Json::array({"linear_attention", "full_attention", "linear_attention"});
  expect_same_model(granite, g5);
  g5["layer_types"][1] = "sliding_attention";
  EXPECT_TRUE(has(config_error(g5), "\"layer_types[1]\" is \"sliding_attention\""));
}

// A Llama 4 wrapper, its text model small enough to count by hand.
Json llama4_wrapper() {
  return Json::parse(R"({
    "model_type": "llama4", "tie_word_embeddings": false,
    "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 8},
    "text_config": {"model_type": "llama4_text", "hidden_size": 8, "num_hidden_layers": 4,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
      "intermediate_size": 6, "intermediate_size_mlp": 16, "vocab_size": 10,
      "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
      "attention_chunk_size": 8192, "no_rope_layers": [1, 1, 1, 0],
      "tie_word_embeddings": false}})");
}

TEST(Transformers5, Llama4LayerTypesAndNoRopeInterval) {
  const Json t4 = llama4_wrapper();
  Json t5 = t4;
  Json& text = t5["text_config"];
  text["layer_types"] = {"chunked_attention", "chunked_attention", "chunked_attention",
                         "full_attention"};
  text["no_rope_layer_interval"] = 4;
  text["moe_layers"] = {1, 3};
  expect_same_model(t4, t5);
  text["layer_types"][0] = "sliding_attention";
  EXPECT_TRUE(has(config_error(t5), "\"text_config.layer_types[0]\" is \"sliding_attention\""));
}

TEST(Transformers5, DeepSeekV32MlpLayerTypesAgreeWithFirstDenseLayers) {
  const Json t4 = embedded("deepseek-v3.2.json");
  Json t5 = t4;
  const int64_t layers = t4.at("num_hidden_layers").get<int64_t>();
  Json mlp = Json::array();
  Json attn = Json::array();
  for (int64_t i = 0; i < layers; ++i) {
    mlp.push_back(i < 3 ? "dense" : "sparse");
    attn.push_back("indexed_attention");
  }
  t5["mlp_layer_types"] = mlp;
  t5["layer_types"] = attn;
  t5["qk_head_dim"] = 192;
  expect_same_model(t4, t5);
  Json off = t5;
  off["first_k_dense_replace"] = 2;
  EXPECT_TRUE(has(config_error(off),
                  "\"first_k_dense_replace\" is 2 but \"mlp_layer_types\"[2] is "
                  "\"dense\""));
  Json alone = t5;
  alone.erase("first_k_dense_replace");  // mlp_layer_types alone decides
  expect_same_model(t4, alone);
}

TEST(Transformers5, KimiLinearInTransformersOwnKeys) {
  const Json t4 = embedded("kimi-linear-48b-a3b-instruct.json");
  Json t5 = t4;
  const Json lin = t4.at("linear_attn_config");
  const int64_t layers = t4.at("num_hidden_layers").get<int64_t>();
  Json types = Json::array();
  for (int64_t i = 0; i < layers; ++i) types.push_back("linear_attention");
  for (const Json& one_based : lin.at("full_attn_layers"))
    types[one_based.get<size_t>() - 1] = "full_attention";
  Json mlp = Json::array();
  for (int64_t i = 0; i < layers; ++i) mlp.push_back(i < 1 ? "dense" : "sparse");
  t5.erase("linear_attn_config");
  t5.erase("moe_layer_freq");
  t5["layer_types"] = types;
  t5["mlp_layer_types"] = mlp;
  t5["linear_num_heads"] = lin.at("num_heads");
  t5["linear_head_dim"] = lin.at("head_dim");
  t5["linear_conv_kernel_dim"] = lin.at("short_conv_kernel_size");
  t5["qk_head_dim"] =
      t4.at("qk_nope_head_dim").get<int64_t>() + t4.at("qk_rope_head_dim").get<int64_t>();
  expect_same_model(t4, t5);
  // Both forms written: they must agree.
  Json both = t5;
  both["linear_attn_config"] = lin;
  expect_same_model(t4, both);
  both["linear_num_heads"] = lin.at("num_heads").get<int64_t>() + 1;
  EXPECT_TRUE(has(config_error(both), "\"linear_num_heads\" is"));
  Json kinds = t5;
  kinds["linear_attn_config"] = lin;
  kinds["layer_types"][0] = "full_attention";
  EXPECT_TRUE(has(config_error(kinds), "\"layer_types[0]\" is \"full_attention\" but"));
}

// moss_transcribe_diarize as transformers 5.23 writes its default: the wrapper ties the
// head (its own tie_word_embeddings), its Qwen3 text_config says false.
Json moss_like() {
  return Json::parse(R"({
    "model_type": "moss_transcribe_diarize", "tie_word_embeddings": true,
    "audio_config": {"model_type": "moss_transcribe_diarize_audio", "hidden_size": 32,
                     "num_hidden_layers": 2},
    "text_config": {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "intermediate_size": 128, "vocab_size": 1000,
                    "tie_word_embeddings": false}})");
}

TEST(Transformers5, AWrappersTieWordEmbeddingsRulesItsTextConfigs) {
  const ModelConfig m = parse_model_config(moss_like(), "moss", "moss.json");
  EXPECT_TRUE(m.tied_embeddings);
  EXPECT_TRUE(has_note(m, "the wrapper's tie_word_embeddings (true) rules")) << m.notes.size();
  EXPECT_TRUE(has_note(m,
                       "the audio encoder (audio_config of \"moss_transcribe_diarize\") is "
                       "not planned"));
  Json untied = moss_like();
  untied["tie_word_embeddings"] = false;
  untied["text_config"]["tie_word_embeddings"] = true;
  EXPECT_FALSE(parse_model_config(untied, "m", "m.json").tied_embeddings);
  // Left out of the file: the wrapper class's default (Llama 4's is false).
  Json llama4 = llama4_wrapper();
  llama4.erase("tie_word_embeddings");
  llama4["text_config"]["tie_word_embeddings"] = true;
  EXPECT_FALSE(parse_model_config(llama4, "l", "l.json").tied_embeddings);
}

TEST(Transformers5, AnUnsupportedTypeIsRefusedByName) {
  const Json gpt2 = Json::parse(R"({"model_type": "gpt2", "n_embd": 768, "n_layer": 12,
                                    "n_head": 12, "vocab_size": 50257})");
  const std::string e = config_error(gpt2);
  EXPECT_TRUE(has(e, "model_type \"gpt2\" is not supported (supported: llama, ")) << e;
  EXPECT_FALSE(has(e, "hidden_size")) << e;
  // "git" is transformers' GIT, not Grok-2 (whose config says "git" with a Grok class).
  const Json git = Json::parse(R"({"model_type": "git", "hidden_size": 768,
                                   "num_hidden_layers": 6, "vocab_size": 30522})");
  EXPECT_TRUE(has(config_error(git), "model_type \"git\" is not supported"));
  const ModelConfig grok = load_model("Grok-2");
  EXPECT_TRUE(has_note(grok, "model_type \"git\" with architectures Grok1ForCausalLM"));
}

}  // namespace
}  // namespace spillway

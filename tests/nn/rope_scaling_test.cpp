// Note [RoPE scaling]: a config's RoPE read as transformers computes it (default, linear,
// llama3, yarn, dynamic; rope_theta beside or inside rope_parameters; Gemma 3's per layer
// type), Gemma's extras (Note [Served Gemma]), the unserved types refused by
// name, and the training reference model refusing what only the decoder runs (Note [Served
// attention extras]). The expected frequencies are transformers 5.23's own
// (ROPE_INIT_FUNCTIONS), in float32: compared to 1e-6.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "spillway/device/device.hpp"
#include "spillway/nn/nn.hpp"
#include "test_support.hpp"

namespace spillway::nn {
namespace {

using Json = nlohmann::json;

// A tiny Llama config (head_dim 16, or `head_dim`) with `rope` merged into it.
Json llama(const Json& rope, int head_dim = 16) {
  Json j = {{"model_type", "llama"},       {"architectures", {"LlamaForCausalLM"}},
            {"hidden_size", 64},           {"intermediate_size", 128},
            {"num_hidden_layers", 1},      {"num_attention_heads", 4},
            {"num_key_value_heads", 2},    {"head_dim", head_dim},
            {"vocab_size", 300},           {"max_position_embeddings", 128},
            {"tie_word_embeddings", false}};
  j.update(rope);
  return j;
}

RefConfig load(const Json& j, const testing::TempDir& dir) {
  const std::string path = dir.file("config.json");
  std::ofstream(path) << j.dump();
  return load_reference_config(path);
}

void expect_freqs(const RefConfig& c, const std::vector<double>& want) {
  ASSERT_EQ(c.rope_inv_freq.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(c.rope_inv_freq[i], want[i], 1e-6 * want[i]) << i;
}

TEST(RopeScaling, DefaultReadsThetaBesideOrInside) {
  testing::TempDir dir;
  const RefConfig beside = load(llama({{"rope_theta", 5e5}}), dir);
  EXPECT_EQ(beside.rope_type, "default");
  EXPECT_EQ(beside.rope_theta, 5e5);
  // The frequencies the training model's RoPE uses, to the bit.
  for (int i = 0; i < 8; ++i)
    EXPECT_EQ(beside.rope_inv_freq[static_cast<size_t>(i)], std::pow(5e5, -2.0 * i / 16));
  const RefConfig inside =
      load(llama({{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 5e5}}}}), dir);
  EXPECT_EQ(inside.rope_inv_freq, beside.rope_inv_freq);
  EXPECT_EQ(inside.rope_attention_factor, 1.0);
}

TEST(RopeScaling, Llama3LinearAndYarnAsTransformers) {
  testing::TempDir dir;
  const RefConfig l3 = load(llama({{"rope_parameters",
                                    {{"rope_type", "llama3"},
                                     {"rope_theta", 5e5},
                                     {"factor", 8.0},
                                     {"low_freq_factor", 1.0},
                                     {"high_freq_factor", 4.0},
                                     {"original_max_position_embeddings", 16}}}}),
                            dir);
  expect_freqs(l3, {0.576056361, 0.0242403448, 0.00470075384, 0.000911583134, 0.000176776681,
                    3.42810235e-05, 6.64786967e-06, 1.28917316e-06});
  // transformers 4's spelling: rope_scaling with "type", rope_theta beside it.
  const RefConfig lin = load(
      llama({{"rope_theta", 1e4}, {"rope_scaling", {{"type", "linear"}, {"factor", 4.0}}}}), dir);
  for (int i = 0; i < 8; ++i)
    EXPECT_EQ(lin.rope_inv_freq[static_cast<size_t>(i)], std::pow(1e4, -2.0 * i / 16) / 4.0);
  const RefConfig yarn = load(llama({{"rope_parameters",
                                      {{"rope_type", "yarn"},
                                       {"rope_theta", 1e4},
                                       {"factor", 4.0},
                                       {"original_max_position_embeddings", 64},
                                       {"truncate", false},
                                       {"mscale", 1.0},
                                       {"mscale_all_dim", 0.5}}}},
                                    32),
                              dir);
  expect_freqs(
      yarn, {1, 0.457739174, 0.198583528, 0.0785936117, 0.0255952496, 0.0140585322, 0.00790569466,
             0.00444569858, 0.00249999994, 0.00140585331, 0.000790569466, 0.000444569858,
             0.000250000012, 0.000140585325, 7.90569466e-05, 4.44569851e-05});
  EXPECT_NEAR(yarn.rope_attention_factor, 1.0648216253695715, 1e-12);
}

TEST(RopeScaling, UnservedRopeIsRefusedByName) {
  testing::TempDir dir;
  testing::expect_error(
      [&] {
        (void)load(llama({{"rope_parameters", {{"rope_type", "longrope"}, {"factor", 2.0}}}}), dir);
      },
      {"rope type \"longrope\" is not served", "config.json"});
  testing::expect_error(
      [&] {
        (void)load(llama({{"partial_rotary_factor", 0.5}}), dir);
      },
      {"\"partial_rotary_factor\" is 0.5"});
  testing::expect_error(
      [&] {
        (void)load(
            llama({{"rope_parameters", {{"chunked_attention", {{"rope_type", "default"}}}}}}), dir);
      },
      {"for layer type \"chunked_attention\""});
  testing::expect_error(
      [&] {
        (void)load(llama({{"rope_parameters", {{"rope_type", "llama3"}, {"factor", 8}}}}), dir);
      },
      {"rope type \"llama3\" needs \"low_freq_factor\""});
  testing::expect_error(
      [&] {
        (void)load(llama({{"rope_parameters", {{"rope_type", "dynamic"}, {"factor", 0.5}}}}), dir);
      },
      {"dynamic RoPE needs \"factor\" >= 1 (it is 0.5)"});
}

// Note [Dynamic RoPE]: the default frequencies and what the decoder recomputes them from;
// Gemma 3's RoPE per layer type (transformers 5's rope_parameters, or transformers 4's
// rope_theta, rope_scaling and rope_local_base_freq beside them).
TEST(RopeScaling, DynamicAndPerLayerTypeAreRead) {
  testing::TempDir dir;
  const RefConfig dyn =
      load(llama({{"rope_parameters", {{"rope_type", "dynamic"}, {"factor", 2.0}}}}), dir);
  EXPECT_EQ(dyn.rope_type, "dynamic");
  EXPECT_EQ(dyn.rope_dynamic_factor, 2.0);
  EXPECT_EQ(dyn.rope_dynamic_length, 128);
  EXPECT_EQ(dyn.rope_inv_freq, load(llama(Json::object()), dir).rope_inv_freq);
  Json g =
      llama({{"rope_parameters",
              {{"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1e6}}},
               {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 1e4}}}}},
             {"sliding_window", 4},
             {"layer_types", {"sliding_attention"}}});
  g["model_type"] = "gemma3_text";
  g["architectures"] = {"Gemma3ForCausalLM"};
  const RefConfig g3 = load(g, dir);
  ASSERT_EQ(g3.rope_local_inv_freq.size(), 8u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(g3.rope_inv_freq[static_cast<size_t>(i)], std::pow(1e6, -2.0 * i / 16) / 8.0);
    EXPECT_EQ(g3.rope_local_inv_freq[static_cast<size_t>(i)], std::pow(1e4, -2.0 * i / 16));
  }
  g.erase("rope_parameters");
  g["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  const RefConfig old = load(g, dir);  // rope_theta 1e6 and the local base 1e4 by default
  EXPECT_EQ(old.rope_inv_freq, g3.rope_inv_freq);
  EXPECT_EQ(old.rope_local_inv_freq, g3.rope_local_inv_freq);
}

// Note [Served Gemma]: what a Gemma 2 config makes the decoder compute, and the training
// model refusing it.
TEST(RopeScaling, GemmaIsReadAndRefusedByTheTrainingModel) {
  testing::TempDir dir;
  Json g = llama({{"sliding_window", 4}, {"query_pre_attn_scalar", 24}});
  g["model_type"] = "gemma2";
  g["architectures"] = {"Gemma2ForCausalLM"};
  g["hidden_activation"] = "gelu_pytorch_tanh";
  const RefConfig c = load(g, dir);
  EXPECT_EQ(c.norm_offset, 1.0);
  EXPECT_EQ(c.embed_scale, 8.0f);
  EXPECT_TRUE(c.sandwich_norms);
  EXPECT_TRUE(c.gelu_mlp);
  EXPECT_EQ(c.attn_scale, std::pow(24.0, -0.5));
  EXPECT_EQ(c.attn_softcap, 50.0);  // Gemma 2's defaults
  EXPECT_EQ(c.final_softcap, 30.0);
  g["final_logit_softcapping"] = nullptr;
  EXPECT_EQ(load(g, dir).final_softcap, 0.0);
  g["attn_logit_softcapping"] = -1;
  testing::expect_error([&] { (void)load(g, dir); }, {"\"attn_logit_softcapping\" is -1"});
  g.erase("attn_logit_softcapping");
  g["use_bidirectional_attention"] = true;
  testing::expect_error([&] { (void)load(g, dir); }, {"\"use_bidirectional_attention\""});
  g.erase("use_bidirectional_attention");
  g["hidden_activation"] = "relu";
  testing::expect_error([&] { (void)load(g, dir); }, {"\"hidden_activation\" is \"relu\""});
  const auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  g["hidden_activation"] = "gelu_pytorch_tanh";
  g.erase("sliding_window");  // (refused first)
  testing::expect_error([&] { Model m(load(g, dir), *dev, 1); },
                        {"(1 + w) norms (Gemma)", "spillway serve"});
  bool sandwich = false;
  for (const WeightSpec& s : weight_specs(c))
    sandwich = sandwich || s.name == "model.layers.0.post_feedforward_layernorm.weight";
  EXPECT_TRUE(sandwich);
}

// What the decoder serves and the training model does not run is refused by the latter.
TEST(RopeScaling, TheTrainingModelRefusesWhatOnlyTheDecoderRuns) {
  testing::TempDir dir;
  const auto dev = make_host_device(HostDeviceOptions{int64_t{64} << 20, 0.0, 0.0});
  const RefConfig scaled =
      load(llama({{"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}}}), dir);
  testing::expect_error([&] { Model m(scaled, *dev, 1); }, {"rope type \"linear\""});
  Json qwen2 = llama(Json::object());
  qwen2["model_type"] = "qwen2";
  qwen2["architectures"] = {"Qwen2ForCausalLM"};
  const RefConfig biased = load(qwen2, dir);
  EXPECT_TRUE(biased.qkv_bias);
  testing::expect_error([&] { Model m(biased, *dev, 1); }, {"biases on q, k and v"});
  // The decoder's weights gain the fused q, k, v bias.
  bool has_bias = false;
  for (const WeightSpec& s : weight_specs(biased))
    has_bias = has_bias || s.name == "model.layers.0.self_attn.qkv_proj.bias";
  EXPECT_TRUE(has_bias);
}

}  // namespace
}  // namespace spillway::nn

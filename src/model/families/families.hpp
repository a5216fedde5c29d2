// What the model families' config parsers share: the size limits, the readers of fields
// several families spell alike (config_readers.cpp), and the one signature every parser
// has. The registry, kFamilies in model_config.cpp, lists each model_type with its parser:
// a new family is a file in this folder, its declaration below and its rows there.
//
// Ranges are checked field by field (JsonObject); cross-field rules (heads divisible by kv
// heads, top-k <= experts) are checked by the readers and parsers with messages that name
// both fields and their values.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/json_io.hpp"
#include "spillway/catalog/model.hpp"

namespace spillway::families {

inline constexpr int64_t kMaxDim = 1LL << 31;  // any single size field
inline constexpr int64_t kMaxLayers = 100000;

// ---- the shared readers (config_readers.cpp) ------------------------------------------

// The first of `keys` the config has (aliases of one field across transformers versions
// and copies), else the first: the one an error names. Two present with different values
// is an error.
const char* alias(const JsonObject& c, std::initializer_list<const char*> keys);

// Common GQA fields of the Llama-like families.
AttentionSpec read_gqa(const JsonObject& c, int64_t hidden);
// DeepSeek's multi-head latent attention (V2, V3, V3.2, Kimi-K2, Kimi-Linear).
AttentionSpec read_mla(const JsonObject& c);

// A dense MLP whose width is the field `key`.
MlpSpec dense_mlp(const JsonObject& c, const char* key = "intermediate_size");

// A Mixtral-style MoE: num_local_experts routed experts of intermediate_size, the top
// num_experts_per_tok of them a token (Mixtral, MiniMax).
MlpSpec local_experts_moe(const JsonObject& c);

// Fails on `k_key` when top-k `k` exceeds the `e_key` experts `e`.
void check_topk(const JsonObject& c, const char* k_key, int64_t k, const char* e_key, int64_t e);

// Sliding window of a Mistral/Qwen2-style config: null or absent means full attention.
int64_t read_window(const JsonObject& c);

// `layer_types` (transformers >= 4.56 writes it for many families): one entry per layer,
// "full_attention" or "sliding_attention" (the latter with `window`, which must then be
// given). Empty when absent.
std::vector<char> read_layer_types(const JsonObject& c, int64_t layers, int64_t window);

// `layer_types` of the linear-attention hybrids: one entry per layer, "full_attention" (1)
// or "linear_attention" (0). Empty when absent.
std::vector<char> read_full_attention_layers(const JsonObject& c, int64_t layers);

// `mlp_layer_types` (transformers 5, DeepSeek-V3.2, Kimi-Linear): one entry a layer, "dense"
// (0) or "sparse" (1, an MoE), what transformers builds from. It derives the list from
// first_k_dense_replace, so a `first_k_dense_replace` also given must agree with it.
// Empty when absent.
std::vector<char> read_mlp_layer_types(const JsonObject& c, int64_t layers);

// Multi-token-prediction layers (num_nextn_predict_layers): counted, not planned.
void read_mtp(const JsonObject& c, ModelConfig& m);

// A Mamba-2 mixer from the keys of Mamba2, Nemotron-H and Granite 4.0-H (aliases: the
// mamba_-prefixed names of the latter two and the plain ones of Mamba2 and remote-code
// Nemotron-H copies).
SsmSpec read_mamba2(const JsonObject& c, int64_t hidden);
// A Mamba-1 dt rank under `key`: an integer, or "auto" (ceil(hidden / 16), also when absent).
int64_t read_dt_rank(const JsonObject& c, const char* key, int64_t hidden);

// ---- the family parsers (one file each, or one per group) ------------------------------

// A family's parser: reads the language model's keys from `c` (its reads tracked, Note
// [Reading a config] in model_config.cpp) into `m`, whose name, source, model_type, hidden
// size, vocabulary and tied embeddings are already set, for model_type `type`.
using Parser = ModelConfig (*)(const JsonObject& c, ModelConfig m, const std::string& type);

ModelConfig parse_llama_like(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_llama4(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_gemma(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_recurrent_gemma(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_qwen_moe(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_qwen3_next(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_mixtral(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_deepseek(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_glm4_moe(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_gpt_oss(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_grok(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_mamba2(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_mamba1(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_nemotron_h(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_jamba(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_granite_hybrid(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_falcon_h1(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_kimi_linear(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_minimax(const JsonObject& c, ModelConfig m, const std::string& type);
ModelConfig parse_zamba2(const JsonObject& c, ModelConfig m, const std::string& type);

// The mamba_ssm package's own config.json (no model_type): the whole config, hidden size
// and vocabulary included; parse_model_config recognises it by its keys.
ModelConfig parse_mamba_ssm(const JsonObject& c, ModelConfig m);

}  // namespace spillway::families

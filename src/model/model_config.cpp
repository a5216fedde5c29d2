// Hugging Face config.json -> ModelConfig, and parameter counts.
//
// Each supported model_type maps its fields onto LayerSpecs. Ranges are checked field by
// field (JsonObject); cross-field rules (heads divisible by kv heads, top-k <= experts)
// are checked here with messages that name both fields and their values.
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <set>

#include "core/embedded_data.hpp"
#include "core/json_io.hpp"
#include "spillway/error.hpp"
#include "spillway/model.hpp"
#include "spillway/units.hpp"

namespace spillway {

namespace {

constexpr int64_t kMaxDim = 1LL << 31;  // any single size field
constexpr int64_t kMaxLayers = 100000;
constexpr const char* kWhat = "model config";

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// The first of `keys` the config has (aliases of one field across transformers versions
// and copies), else the first: the one an error names. Two present with different values
// is an error.
const char* alias(const JsonObject& c, std::initializer_list<const char*> keys) {
  const char* found = nullptr;
  for (const char* k : keys) {
    if (!c.has(k)) continue;
    if (found == nullptr) {
      found = k;
    } else if (c.raw().at(found) != c.raw().at(k)) {
      c.fail(k, fmt::format("is {} but its alias \"{}\" is {}; they name one field",
                            json_value_text(c.raw().at(k)), found,
                            json_value_text(c.raw().at(found))));
    }
  }
  return found != nullptr ? found : *keys.begin();
}

// Common GQA fields of the Llama-like families.
AttentionSpec read_gqa(const JsonObject& c, int64_t hidden) {
  AttentionSpec a;
  a.kind = AttentionKind::kGqa;
  a.heads = c.req_int("num_attention_heads", 1, kMaxDim);
  a.kv_heads = c.int_or("num_key_value_heads", a.heads, 1, kMaxDim);
  if (a.heads % a.kv_heads != 0) {
    c.fail("num_key_value_heads",
           fmt::format("is {}; must divide \"num_attention_heads\" ({})", a.kv_heads, a.heads));
  }
  if (c.has("head_dim")) {
    a.qk_head_dim = c.req_int("head_dim", 1, kMaxDim);
  } else {
    if (hidden % a.heads != 0) {
      c.fail("num_attention_heads",
             fmt::format("is {}; must divide \"hidden_size\" ({}) when \"head_dim\" is not given",
                         a.heads, hidden));
    }
    a.qk_head_dim = hidden / a.heads;
  }
  a.v_head_dim = a.qk_head_dim;
  a.qkv_bias = c.bool_or("attention_bias", false);
  a.o_bias = a.qkv_bias;
  return a;
}

MlpSpec dense_mlp(const JsonObject& c, const char* key = "intermediate_size") {
  MlpSpec m;
  m.kind = MlpKind::kDense;
  m.ffn = c.req_int(key, 1, kMaxDim);
  return m;
}

void check_topk(const JsonObject& c, const char* k_key, int64_t k, const char* e_key, int64_t e) {
  if (k > e) {
    c.fail(k_key, fmt::format("is {}; must be <= \"{}\" ({})", k, e_key, e));
  }
}

// Sliding window of a Mistral/Qwen2-style config: null or absent means full attention.
int64_t read_window(const JsonObject& c) {
  if (!c.has("sliding_window")) return 0;
  return c.req_int("sliding_window", 1, kMaxDim);
}

// `layer_types` (transformers >= 4.56 writes it for many families): one entry per layer,
// "full_attention" or "sliding_attention" (the latter with `window`, which must then be
// given). Empty when absent.
std::vector<char> read_layer_types(const JsonObject& c, int64_t layers, int64_t window) {
  const std::vector<std::string> types = c.str_array_or("layer_types");
  if (types.empty()) return {};
  if (static_cast<int64_t>(types.size()) != layers) {
    c.fail("layer_types",
           fmt::format("has {} entries; must have one per layer ({})", types.size(), layers));
  }
  std::vector<char> sliding(types.size(), 0);
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] == "sliding_attention") {
      if (window <= 0) {
        c.fail(fmt::format("layer_types[{}]", i),
               "is \"sliding_attention\" but \"sliding_window\" is not given");
      }
      sliding[i] = 1;
    } else if (types[i] != "full_attention") {
      c.fail(
          fmt::format("layer_types[{}]", i),
          fmt::format("is \"{}\"; must be \"sliding_attention\" or \"full_attention\"", types[i]));
    }
  }
  return sliding;
}

ModelConfig parse_llama_like(const JsonObject& c, ModelConfig m, const std::string& type) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  MlpSpec mlp = dense_mlp(c);
  mlp.bias = c.bool_or("mlp_bias", false);
  int64_t window = 0;
  int64_t window_from = 0;
  if (type == "qwen2" || type == "qwen3") {
    a.qkv_bias = (type == "qwen2") ? true : c.bool_or("attention_bias", false);
    a.o_bias = false;
    a.qk_norm = (type == "qwen3");
    // Qwen's sliding window applies only with use_sliding_window, from layer
    // max_window_layers on; both are read (and ignored) otherwise.
    const bool use = c.bool_or("use_sliding_window", false);
    const int64_t w = read_window(c);
    const int64_t from = c.int_or("max_window_layers", 0, 0, kMaxLayers);
    if (use) {
      window = w;
      window_from = from;
    }
  } else if (type == "mistral" || type == "phi3") {
    window = read_window(c);
  }
  const std::vector<char> sliding =
      read_layer_types(c, layers, window > 0 ? window : read_window(c));
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l{a, mlp};
    if (!sliding.empty()) {
      if (sliding[static_cast<size_t>(i)]) l.attn.sliding_window = read_window(c);
    } else if (window > 0 && i >= window_from) {
      l.attn.sliding_window = window;
    }
    m.layers.push_back(l);
  }
  return m;
}

// Gemma 2 and Gemma 3 (text): GQA with a given head_dim, four RMSNorms a layer (the
// sandwich: pre- and post-feedforward besides the usual two), GeGLU MLP (three matrices,
// as SwiGLU), tied embeddings by default. Sliding windows: layer_types when given; else
// Gemma 2 slides on even layers, Gemma 3 on all but every sliding_window_pattern-th
// (default 6). Gemma 3 adds per-head q/k norms.
ModelConfig parse_gemma(const JsonObject& c, ModelConfig m, const std::string& type) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.qk_norm = type != "gemma2";
  const MlpSpec mlp = dense_mlp(c);
  // Early Gemma 2 configs also spell the window sliding_window_size.
  const char* window_key = alias(c, {"sliding_window", "sliding_window_size"});
  const int64_t window = c.has(window_key) ? c.req_int(window_key, 1, kMaxDim) : 0;
  std::vector<char> sliding = read_layer_types(c, layers, window);
  if (sliding.empty() && window > 0) {
    sliding.assign(static_cast<size_t>(layers), 0);
    const int64_t pattern =
        type == "gemma2" ? 2 : c.int_or("sliding_window_pattern", 6, 1, kMaxLayers);
    for (int64_t i = 0; i < layers; ++i) {
      sliding[static_cast<size_t>(i)] = type == "gemma2" ? (i % 2 == 0) : ((i + 1) % pattern != 0);
    }
  } else {
    (void)c.has("sliding_window_pattern");  // layer_types decides
  }
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l{a, mlp};
    l.extra_norms = 2;
    if (!sliding.empty() && sliding[static_cast<size_t>(i)]) l.attn.sliding_window = window;
    m.layers.push_back(l);
  }
  return m;
}

// Qwen2-MoE and Qwen3-MoE: decoder_sparse_step and mlp_only_layers pick the MoE layers.
ModelConfig parse_qwen_moe(const JsonObject& c, ModelConfig m, const std::string& type) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.qkv_bias = (type == "qwen2_moe") ? true : c.bool_or("attention_bias", false);
  a.o_bias = false;
  a.qk_norm = (type == "qwen3_moe");
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  // transformers 5 spells the expert count num_local_experts.
  const char* experts_key = alias(c, {"num_experts", "num_local_experts"});
  moe.experts = c.req_int(experts_key, 1, kMaxDim);
  moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, experts_key, moe.experts);
  moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
  // Qwen's sliding-window keys, read as in parse_llama_like (MoE releases have it off).
  if (c.bool_or("use_sliding_window", false)) {
    a.sliding_window = read_window(c);
    if (c.int_or("max_window_layers", 0, 0, kMaxLayers) > 0) {
      c.fail("use_sliding_window",
             "is true with \"max_window_layers\" > 0 on an MoE model; spillway reads sliding "
             "windows on every layer or none here");
    }
  } else {
    (void)read_window(c);
    (void)c.has("max_window_layers");
  }
  if (type == "qwen2_moe") {
    moe.shared_ffn = c.int_or("shared_expert_intermediate_size", 0, 0, kMaxDim);
    moe.shared_gate = moe.shared_ffn > 0;
  }
  const int64_t step = c.int_or("decoder_sparse_step", 1, 1, kMaxLayers);
  const std::vector<int64_t> dense_only = c.int_array_or("mlp_only_layers", 0, layers - 1);
  const std::set<int64_t> dense_set(dense_only.begin(), dense_only.end());
  const bool any_dense = !dense_set.empty() || step > 1;  // only then is intermediate_size needed
  MlpSpec dense;
  if (any_dense) dense = dense_mlp(c);
  (void)c.has("intermediate_size");  // the dense layers' width: unused when there are none
  for (int64_t i = 0; i < layers; ++i) {
    const bool sparse = !dense_set.count(i) && (i + 1) % step == 0;
    m.layers.push_back(LayerSpec{a, sparse ? moe : dense});
  }
  return m;
}

ModelConfig parse_mixtral(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.sliding_window = read_window(c);
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  moe.experts = c.req_int("num_local_experts", 1, kMaxDim);
  moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, "num_local_experts", moe.experts);
  moe.ffn = c.req_int("intermediate_size", 1, kMaxDim);
  m.layers.assign(static_cast<size_t>(layers), LayerSpec{a, moe});
  return m;
}

// DeepSeek's multi-head latent attention (V2, V3, V3.2, Kimi-K2).
AttentionSpec read_mla(const JsonObject& c) {
  AttentionSpec a;
  a.kind = AttentionKind::kMla;
  a.heads = c.req_int("num_attention_heads", 1, kMaxDim);
  a.kv_heads = a.heads;
  (void)c.has("num_key_value_heads");  // MLA: every head has its own K and V
  a.q_lora_rank = c.int_or("q_lora_rank", 0, 0, kMaxDim);
  a.kv_lora_rank = c.req_int("kv_lora_rank", 1, kMaxDim);
  const int64_t nope = c.req_int("qk_nope_head_dim", 0, kMaxDim);
  a.qk_rope_head_dim = c.req_int("qk_rope_head_dim", 0, kMaxDim);
  a.qk_head_dim = nope + a.qk_rope_head_dim;
  if (a.qk_head_dim == 0)
    c.fail("qk_nope_head_dim",
           "and \"qk_rope_head_dim\" are both 0; the query/key head needs a width");
  a.v_head_dim = c.req_int("v_head_dim", 1, kMaxDim);
  (void)c.has("head_dim");  // transformers sets it to qk_rope_head_dim; the widths above rule
  a.qkv_bias = c.bool_or("attention_bias", false);
  return a;
}

// Multi-token-prediction layers (num_nextn_predict_layers): counted, not planned.
void read_mtp(const JsonObject& c, ModelConfig& m) {
  m.mtp_layers =
      c.int_or(alias(c, {"num_nextn_predict_layers", "mtp_num_hidden_layers"}), 0, 0, kMaxLayers);
  if (m.mtp_layers > 0) {
    m.notes.push_back(fmt::format(
        "{} multi-token-prediction layer(s) (num_nextn_predict_layers) are not planned and not "
        "in the parameter counts (published counts leave them out)",
        m.mtp_layers));
  }
}

ModelConfig parse_deepseek(const JsonObject& c, ModelConfig m, const std::string& type) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a;
  if (type == "deepseek") {
    // DeepSeek V1 (DeepSeekMoE): standard multi-head attention, no MLA.
    a = read_gqa(c, m.hidden);
  } else {
    a = read_mla(c);
  }
  if (type == "deepseek_v32") {
    a.indexer_heads = c.req_int("index_n_heads", 1, kMaxDim);
    a.indexer_head_dim = c.req_int("index_head_dim", 1, kMaxDim);
    if (a.q_lora_rank == 0)
      c.fail("q_lora_rank", "is 0; DeepSeek-V3.2's indexer projects from the query's LoRA rank");
  }

  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  // transformers 5 and some copies spell these num_routed_experts / num_shared_experts.
  const char* routed = alias(c, {"n_routed_experts", "num_routed_experts"});
  const char* shared = alias(c, {"n_shared_experts", "num_shared_experts"});
  if (type == "deepseek_v2") {
    moe.experts = c.int_or(routed, 0, 0, kMaxDim);  // transformers: None -> a dense model
  } else {
    // transformers' DeepseekV3Config would default a missing count to 256 experts; a
    // copy that drops it is more likely damaged than relying on that: name it.
    moe.experts = c.req_int(routed, 1, kMaxDim);
  }
  MlpSpec dense = dense_mlp(c);
  const int64_t first_dense = c.int_or("first_k_dense_replace", 0, 0, kMaxLayers);
  const int64_t freq = c.int_or("moe_layer_freq", 1, 1, kMaxLayers);
  if (moe.experts > 0) {
    moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
    check_topk(c, "num_experts_per_tok", moe.top_k, routed, moe.experts);
    moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
    moe.shared_ffn = checked_mul(c.int_or(shared, 0, 0, kMaxDim), moe.ffn,
                                 "model config: n_shared_experts * moe_intermediate_size");
    // e_score_correction_bias (V3 routing: sigmoid scores with a bias)
    moe.router_bias = type != "deepseek" && type != "deepseek_v2";
  }
  for (int64_t i = 0; i < layers; ++i) {
    const bool sparse = moe.experts > 0 && i >= first_dense && i % freq == 0;
    m.layers.push_back(LayerSpec{a, sparse ? moe : dense});
  }
  read_mtp(c, m);
  return m;
}

ModelConfig parse_gpt_oss(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.qkv_bias = c.bool_or("attention_bias", true);
  a.o_bias = a.qkv_bias;
  a.sinks = true;
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  moe.experts = c.req_int("num_local_experts", 1, kMaxDim);
  const char* top_k_key = alias(c, {"num_experts_per_tok", "experts_per_token"});
  moe.top_k = c.req_int(top_k_key, 1, kMaxDim);
  check_topk(c, top_k_key, moe.top_k, "num_local_experts", moe.experts);
  moe.ffn = c.req_int("intermediate_size", 1, kMaxDim);
  moe.bias = true;
  moe.router_bias = true;
  const int64_t window = c.int_or("sliding_window", 0, 0, kMaxDim);
  std::vector<std::string> types = c.str_array_or("layer_types");
  if (!types.empty() && static_cast<int64_t>(types.size()) != layers) {
    c.fail("layer_types",
           fmt::format("has {} entries; must have one per layer ({})", types.size(), layers));
  }
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l{a, moe};
    // Without layer_types, GPT-OSS alternates sliding (even) and full (odd) attention.
    const std::string kind = types.empty() ? (i % 2 == 0 ? "sliding_attention" : "full_attention")
                                           : types[static_cast<size_t>(i)];
    if (kind == "sliding_attention") {
      l.attn.sliding_window = window;
    } else if (kind != "full_attention") {
      c.fail(fmt::format("layer_types[{}]", i),
             fmt::format("is \"{}\"; must be \"sliding_attention\" or \"full_attention\"", kind));
    }
    m.layers.push_back(l);
  }
  return m;
}

// GLM-4.5/4.6 (glm4_moe): GQA with q/k/v biases (attention_bias) and optional per-head
// q/k norms (use_qk_norm), the first first_k_dense_replace layers dense, the others
// n_routed_experts experts plus n_shared_experts shared ones of moe_intermediate_size, a
// sigmoid router with a correction bias (as DeepSeek-V3); MTP layers counted apart.
ModelConfig parse_glm4_moe(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.o_bias = false;
  a.qk_norm = c.bool_or("use_qk_norm", false);
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  const char* routed = alias(c, {"n_routed_experts", "num_routed_experts"});
  moe.experts = c.req_int(routed, 1, kMaxDim);
  moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, routed, moe.experts);
  moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
  moe.shared_ffn =
      checked_mul(c.int_or(alias(c, {"n_shared_experts", "num_shared_experts"}), 0, 0, kMaxDim),
                  moe.ffn, "model config: n_shared_experts * moe_intermediate_size");
  moe.router_bias = true;
  const MlpSpec dense = dense_mlp(c);
  const int64_t first_dense = c.int_or("first_k_dense_replace", 0, 0, kMaxLayers);
  for (int64_t i = 0; i < layers; ++i)
    m.layers.push_back(LayerSpec{a, i >= first_dense ? moe : dense});
  read_mtp(c, m);
  return m;
}

// Llama 4 (text): GQA, MoE layers every interleave_moe_layer_step-th layer (or the list
// moe_layers) with num_local_experts experts of intermediate_size, top-k routing and one
// shared expert of the same width; the other layers a dense MLP of intermediate_size_mlp.
// Its q/k norm is an L2 norm without weights, and chunked attention (attention_chunk_size
// on the RoPE layers) is planned as full causal attention (an upper bound on its FLOPs).
ModelConfig parse_llama4(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  (void)c.has("attention_chunk_size");
  (void)c.has("no_rope_layers");
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  const char* experts_key = alias(c, {"num_local_experts", "num_experts"});
  moe.experts = c.req_int(experts_key, 1, kMaxDim);
  moe.top_k = c.int_or("num_experts_per_tok", 1, 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, experts_key, moe.experts);
  moe.ffn = c.req_int("intermediate_size", 1, kMaxDim);
  moe.shared_ffn = moe.ffn;
  std::vector<char> sparse(static_cast<size_t>(layers), 0);
  if (c.has("moe_layers")) {
    for (int64_t i : c.int_array_or("moe_layers", 0, layers - 1))
      sparse[static_cast<size_t>(i)] = 1;
    (void)c.has("interleave_moe_layer_step");
  } else {
    const int64_t step = c.int_or("interleave_moe_layer_step", 1, 1, kMaxLayers);
    for (int64_t i = 0; i < layers; ++i) sparse[static_cast<size_t>(i)] = (i + 1) % step == 0;
  }
  const bool any_dense = std::find(sparse.begin(), sparse.end(), 0) != sparse.end();
  MlpSpec dense;
  if (any_dense) dense = dense_mlp(c, "intermediate_size_mlp");
  (void)c.has("intermediate_size_mlp");
  for (int64_t i = 0; i < layers; ++i)
    m.layers.push_back(LayerSpec{a, sparse[static_cast<size_t>(i)] ? moe : dense});
  return m;
}

// A Mamba-2 mixer from the keys of Mamba2, Nemotron-H and Granite 4.0-H (aliases: the
// mamba_-prefixed names of the latter two and the plain ones of Mamba2 and remote-code
// Nemotron-H copies).
SsmSpec read_mamba2(const JsonObject& c, int64_t hidden) {
  SsmSpec s;
  s.version = 2;
  s.state = c.req_int(alias(c, {"ssm_state_size", "state_size", "mamba_d_state"}), 1, kMaxDim);
  s.heads = c.req_int(alias(c, {"mamba_num_heads", "num_heads", "mamba_n_heads"}), 1, kMaxDim);
  s.head_dim = c.req_int(alias(c, {"mamba_head_dim", "head_dim", "mamba_d_head"}), 1, kMaxDim);
  s.groups = c.int_or(alias(c, {"n_groups", "mamba_n_groups"}), 1, 1, kMaxDim);
  s.conv = c.int_or(alias(c, {"conv_kernel", "mamba_d_conv"}), 4, 1, kMaxDim);
  s.chunk = c.int_or(alias(c, {"chunk_size", "mamba_chunk_size"}), 256, 1, kMaxDim);
  s.conv_bias = c.bool_or(alias(c, {"use_conv_bias", "mamba_conv_bias"}), true);
  s.proj_bias = c.bool_or(alias(c, {"use_bias", "mamba_proj_bias"}), false);
  s.inner = checked_mul(s.heads, s.head_dim, "model config: mamba heads * head_dim");
  const char* expand_key = alias(c, {"expand", "mamba_expand"});
  if (c.has(expand_key)) {
    const int64_t expand = c.req_int(expand_key, 1, 1024);
    if (s.inner != expand * hidden) {
      c.fail(expand_key,
             fmt::format("is {}: expand x hidden_size ({}) must equal the Mamba heads x head "
                         "dim ({} x {} = {})",
                         expand, expand * hidden, s.heads, s.head_dim, s.inner));
    }
  }
  if (s.heads % s.groups != 0) {
    c.fail(alias(c, {"n_groups", "mamba_n_groups"}),
           fmt::format("is {}; must divide the Mamba heads ({})", s.groups, s.heads));
  }
  return s;
}

// Nemotron-H: one block a layer, by hybrid_override_pattern: 'M' a Mamba-2 mixer, '*'
// attention, '-' a squared-ReLU MLP (up and down), 'E' an MoE (routed experts plus a shared
// one, squared-ReLU as well).
ModelConfig parse_nemotron_h(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  const std::string pattern = c.req_str("hybrid_override_pattern");
  if (static_cast<int64_t>(pattern.size()) != layers) {
    c.fail("hybrid_override_pattern",
           fmt::format("has {} characters; must have one per layer ({})", pattern.size(), layers));
  }
  AttentionSpec a;
  a.heads = c.req_int("num_attention_heads", 1, kMaxDim);
  a.kv_heads = c.int_or("num_key_value_heads", a.heads, 1, kMaxDim);
  a.qk_head_dim = c.req_int(alias(c, {"attention_head_dim", "head_dim"}), 1, kMaxDim);
  a.v_head_dim = a.qk_head_dim;
  a.qkv_bias = c.bool_or("attention_bias", false);
  a.o_bias = a.qkv_bias;
  // Mamba's head_dim is mamba_head_dim here; head_dim, when present, is attention's.
  SsmSpec ssm;
  if (pattern.find('M') != std::string::npos) {
    ssm.version = 2;
    ssm.state = c.req_int("ssm_state_size", 1, kMaxDim);
    ssm.heads = c.req_int("mamba_num_heads", 1, kMaxDim);
    ssm.head_dim = c.req_int("mamba_head_dim", 1, kMaxDim);
    ssm.groups = c.int_or(alias(c, {"n_groups", "mamba_n_groups"}), 1, 1, kMaxDim);
    ssm.conv = c.int_or(alias(c, {"conv_kernel", "mamba_d_conv"}), 4, 1, kMaxDim);
    ssm.chunk = c.int_or(alias(c, {"chunk_size", "mamba_chunk_size"}), 256, 1, kMaxDim);
    ssm.conv_bias = c.bool_or(alias(c, {"use_conv_bias", "mamba_conv_bias"}), true);
    ssm.proj_bias = c.bool_or(alias(c, {"use_bias", "mamba_proj_bias"}), false);
    ssm.inner = checked_mul(ssm.heads, ssm.head_dim, "model config: mamba heads * head_dim");
    (void)c.has(alias(c, {"expand", "mamba_expand"}));  // heads x head_dim rule
  }
  MlpSpec mlp;
  mlp.gated = false;
  mlp.bias = c.bool_or("mlp_bias", false);
  if (pattern.find('-') != std::string::npos) mlp.ffn = c.req_int("intermediate_size", 1, kMaxDim);
  (void)c.has("intermediate_size");  // the '-' layers' width: unused without them
  MlpSpec moe;
  if (pattern.find('E') != std::string::npos) {
    moe.kind = MlpKind::kMoe;
    moe.gated = false;
    const char* routed = alias(c, {"n_routed_experts", "num_experts"});
    moe.experts = c.req_int(routed, 1, kMaxDim);
    moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
    check_topk(c, "num_experts_per_tok", moe.top_k, routed, moe.experts);
    moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
    moe.shared_ffn = c.int_or("moe_shared_expert_intermediate_size", 0, 0, kMaxDim) *
                     c.int_or(alias(c, {"n_shared_experts", "num_shared_experts"}), 1, 0, 64);
    moe.router_bias = true;  // e_score_correction_bias
  }
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l;
    l.mlp.kind = MlpKind::kNone;
    switch (pattern[static_cast<size_t>(i)]) {
      case 'M':
        l.mixer = MixerKind::kMamba;
        l.ssm = ssm;
        break;
      case '*':
        l.mixer = MixerKind::kAttention;
        l.attn = a;
        break;
      case '-':
        l.mixer = MixerKind::kNone;
        l.mlp = mlp;
        break;
      case 'E':
        l.mixer = MixerKind::kNone;
        l.mlp = moe;
        break;
      default:
        c.fail("hybrid_override_pattern",
               fmt::format("has '{}' at layer {}; must be M (Mamba-2), * (attention), - (MLP) or "
                           "E (MoE)",
                           pattern[static_cast<size_t>(i)], i));
    }
    m.layers.push_back(l);
  }
  return m;
}

// Mamba2 (transformers' Mamba2ForCausalLM): every layer a norm and a Mamba-2 mixer.
ModelConfig parse_mamba2(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  LayerSpec l;
  l.mixer = MixerKind::kMamba;
  l.ssm = read_mamba2(c, m.hidden);
  l.ssm.gated_norm = c.bool_or("rms_norm", true);
  l.mlp.kind = MlpKind::kNone;
  m.layers.assign(static_cast<size_t>(layers), l);
  return m;
}

// Jamba: attention where i % attn_layer_period == attn_layer_offset, else a Mamba-1 mixer
// (with dt, B and C norms); MoE where i % expert_layer_period == expert_layer_offset,
// else a dense SwiGLU MLP. mamba_dt_rank "auto" is ceil(hidden / 16).
ModelConfig parse_jamba(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  const AttentionSpec a = read_gqa(c, m.hidden);
  SsmSpec ssm;
  ssm.version = 1;
  ssm.state = c.int_or("mamba_d_state", 16, 1, kMaxDim);
  ssm.conv = c.int_or("mamba_d_conv", 4, 1, kMaxDim);
  ssm.inner = checked_mul(c.int_or("mamba_expand", 2, 1, 1024), m.hidden, "model config: inner");
  if (c.has("mamba_dt_rank") && c.raw().at("mamba_dt_rank").is_string()) {
    if (c.req_str("mamba_dt_rank") != "auto")
      c.fail("mamba_dt_rank", "must be an integer or \"auto\"");
    ssm.dt_rank = (m.hidden + 15) / 16;
  } else {
    ssm.dt_rank = c.int_or("mamba_dt_rank", (m.hidden + 15) / 16, 1, kMaxDim);
  }
  ssm.conv_bias = c.bool_or("mamba_conv_bias", true);
  ssm.proj_bias = c.bool_or("mamba_proj_bias", false);
  ssm.bcdt_norms = true;
  ssm.gated_norm = false;
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  moe.experts = c.req_int("num_experts", 1, kMaxDim);
  moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, "num_experts", moe.experts);
  moe.ffn = c.req_int("intermediate_size", 1, kMaxDim);
  MlpSpec dense = dense_mlp(c);
  const int64_t ap = c.int_or("attn_layer_period", 8, 1, kMaxLayers);
  const int64_t ao = c.int_or("attn_layer_offset", 4, 0, kMaxLayers);
  const int64_t ep = c.int_or("expert_layer_period", 2, 1, kMaxLayers);
  const int64_t eo = c.int_or("expert_layer_offset", 1, 0, kMaxLayers);
  if (ao >= ap)
    c.fail("attn_layer_offset", fmt::format("is {}; must be < attn_layer_period ({})", ao, ap));
  if (eo >= ep)
    c.fail("expert_layer_offset", fmt::format("is {}; must be < expert_layer_period ({})", eo, ep));
  const int64_t window = read_window(c);
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l;
    if (i % ap == ao) {
      l.attn = a;
      l.attn.sliding_window = window;
    } else {
      l.mixer = MixerKind::kMamba;
      l.ssm = ssm;
    }
    l.mlp = moe.experts > 1 && i % ep == eo ? moe : dense;
    m.layers.push_back(l);
  }
  return m;
}

// Qwen3-Next: full attention where layer_types says "full_attention" (else every
// full_attention_interval-th layer), Gated DeltaNet elsewhere; the attention is gated (its
// Q projection is twice as wide) with q/k norms; the MLP as Qwen2-MoE's (routed experts, a
// shared expert with its sigmoid gate; decoder_sparse_step, mlp_only_layers).
ModelConfig parse_qwen3_next(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.o_bias = false;
  a.qk_norm = true;
  a.output_gate = c.bool_or("attn_output_gate", true);
  LinearAttentionSpec lin;
  lin.k_heads = c.req_int("linear_num_key_heads", 1, kMaxDim);
  lin.v_heads = c.req_int("linear_num_value_heads", 1, kMaxDim);
  lin.k_head_dim = c.req_int("linear_key_head_dim", 1, kMaxDim);
  lin.v_head_dim = c.req_int("linear_value_head_dim", 1, kMaxDim);
  lin.conv = c.int_or("linear_conv_kernel_dim", 4, 1, kMaxDim);
  if (lin.v_heads % lin.k_heads != 0) {
    c.fail("linear_num_value_heads", fmt::format("is {}; must be a multiple of "
                                                 "\"linear_num_key_heads\" ({})",
                                                 lin.v_heads, lin.k_heads));
  }
  std::vector<char> full(static_cast<size_t>(layers), 0);
  const std::vector<std::string> types = c.str_array_or("layer_types");
  if (!types.empty()) {
    if (static_cast<int64_t>(types.size()) != layers) {
      c.fail("layer_types",
             fmt::format("has {} entries; must have one per layer ({})", types.size(), layers));
    }
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] != "full_attention" && types[i] != "linear_attention") {
        c.fail(
            fmt::format("layer_types[{}]", i),
            fmt::format("is \"{}\"; must be \"full_attention\" or \"linear_attention\"", types[i]));
      }
      full[i] = types[i] == "full_attention";
    }
    (void)c.has("full_attention_interval");
  } else {
    const int64_t interval = c.int_or("full_attention_interval", 4, 1, kMaxLayers);
    for (int64_t i = 0; i < layers; ++i) full[static_cast<size_t>(i)] = (i + 1) % interval == 0;
  }
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  const char* experts_key = alias(c, {"num_experts", "num_local_experts"});
  moe.experts = c.req_int(experts_key, 1, kMaxDim);
  moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, experts_key, moe.experts);
  moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
  moe.shared_ffn = c.int_or("shared_expert_intermediate_size", 0, 0, kMaxDim);
  moe.shared_gate = moe.shared_ffn > 0;
  const int64_t step = c.int_or("decoder_sparse_step", 1, 1, kMaxLayers);
  const std::vector<int64_t> dense_only = c.int_array_or("mlp_only_layers", 0, layers - 1);
  const std::set<int64_t> dense_set(dense_only.begin(), dense_only.end());
  MlpSpec dense;
  if (!dense_set.empty() || step > 1) dense = dense_mlp(c);
  (void)c.has("intermediate_size");
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l;
    if (full[static_cast<size_t>(i)]) {
      l.attn = a;
    } else {
      l.mixer = MixerKind::kLinearAttention;
      l.linear = lin;
    }
    l.mlp = !dense_set.count(i) && (i + 1) % step == 0 ? moe : dense;
    m.layers.push_back(l);
  }
  read_mtp(c, m);
  return m;
}

// Granite 4.0-H (granitemoehybrid): layer_types ("mamba" or "attention") pick the mixer;
// every layer has an MLP: routed experts (num_local_experts, if any) plus a shared SwiGLU
// MLP of shared_intermediate_size.
ModelConfig parse_granite_hybrid(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  const std::vector<std::string> types = c.str_array_or("layer_types");
  if (static_cast<int64_t>(types.size()) != layers) {
    c.fail("layer_types",
           fmt::format("has {} entries; must have one per layer ({})", types.size(), layers));
  }
  const bool any_mamba = std::find(types.begin(), types.end(), "mamba") != types.end();
  SsmSpec ssm;
  if (any_mamba) ssm = read_mamba2(c, m.hidden);
  MlpSpec mlp;
  const int64_t experts = c.int_or(alias(c, {"num_local_experts", "num_experts"}), 0, 0, kMaxDim);
  const int64_t shared = c.int_or("shared_intermediate_size", 0, 0, kMaxDim);
  if (experts > 0) {
    mlp.kind = MlpKind::kMoe;
    mlp.experts = experts;
    mlp.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
    check_topk(c, "num_experts_per_tok", mlp.top_k, "num_local_experts", experts);
    mlp.ffn = c.req_int("intermediate_size", 1, kMaxDim);
    mlp.shared_ffn = shared;
  } else {
    mlp.kind = MlpKind::kDense;
    mlp.ffn = shared > 0 ? shared : c.req_int("intermediate_size", 1, kMaxDim);
    (void)c.has("intermediate_size");
    (void)c.has("num_experts_per_tok");
  }
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l;
    const std::string& t = types[static_cast<size_t>(i)];
    if (t == "mamba") {
      l.mixer = MixerKind::kMamba;
      l.ssm = ssm;
    } else if (t == "attention") {
      l.attn = a;
    } else {
      c.fail(fmt::format("layer_types[{}]", i),
             fmt::format("is \"{}\"; must be \"mamba\" or \"attention\"", t));
    }
    l.mlp = mlp;
    m.layers.push_back(l);
  }
  return m;
}

// RecurrentGemma (Griffin): block_types cycles over the layers (transformers' default
// recurrent, recurrent, attention); attention is local (attention_window_size) MQA with a
// bias on its output projection; the MLP is a gated GeLU of intermediate_size / 2 with
// biases; embeddings tied.
ModelConfig parse_recurrent_gemma(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.qkv_bias = false;
  a.o_bias = true;
  (void)c.has("attention_bias");
  a.sliding_window = c.int_or("attention_window_size", 2048, 1, kMaxDim);
  RecurrentSpec r;
  r.width = c.int_or("lru_width", m.hidden, 1, kMaxDim);
  r.heads = a.heads;
  r.conv = c.int_or("conv1d_width", 4, 1, kMaxDim);
  if (r.width % r.heads != 0) {
    c.fail("lru_width", fmt::format("is {}; must be a multiple of \"num_attention_heads\" ({})",
                                    r.width, r.heads));
  }
  MlpSpec mlp;
  const int64_t inter = c.req_int("intermediate_size", 2, kMaxDim);
  mlp.ffn = inter / 2;
  mlp.bias = true;
  // Transformers saves the pattern as _block_types (a property over it).
  std::vector<std::string> types = c.str_array_or(alias(c, {"block_types", "_block_types"}));
  if (types.empty()) types = {"recurrent", "recurrent", "attention"};
  for (int64_t i = 0; i < layers; ++i) {
    const std::string& t = types[static_cast<size_t>(i) % types.size()];
    LayerSpec l;
    if (t == "recurrent") {
      l.mixer = MixerKind::kRecurrent;
      l.recurrent = r;
    } else if (t == "attention") {
      l.attn = a;
    } else {
      c.fail(fmt::format("block_types[{}]", static_cast<size_t>(i) % types.size()),
             fmt::format("is \"{}\"; must be \"recurrent\" or \"attention\"", t));
    }
    l.mlp = mlp;
    m.layers.push_back(l);
  }
  return m;
}

// The mamba_ssm package's own config.json (state-spaces/mamba2-*: no model_type): d_model,
// n_layer, the vocabulary padded to pad_vocab_size_multiple, ssm_cfg with the Mamba2
// module's arguments (its defaults: d_state 128, d_conv 4, expand 2, headdim 64, ngroups 1,
// chunk_size 256, conv bias, no projection bias, the gated norm), d_intermediate 0 (no MLP).
// Attention layers (attn_layer_idx) and MLPs are refused, not ignored.
ModelConfig parse_mamba_ssm(const JsonObject& c, ModelConfig m) {
  m.model_type = "mamba_ssm";
  m.hidden = c.req_int("d_model", 1, kMaxDim);
  const int64_t vocab = c.req_int("vocab_size", 1, kMaxDim);
  const int64_t pad = c.int_or("pad_vocab_size_multiple", 1, 1, kMaxDim);
  m.vocab = (vocab + pad - 1) / pad * pad;
  m.tied_embeddings = c.bool_or("tie_embeddings", true);
  const int64_t layers = c.req_int("n_layer", 1, kMaxLayers);
  if (c.int_or("d_intermediate", 0, 0, kMaxDim) != 0)
    c.fail("d_intermediate", "is not 0: spillway plans mamba_ssm configs without MLPs");
  if (!c.int_array_or("attn_layer_idx", 0, layers - 1).empty())
    c.fail("attn_layer_idx", "is not empty: spillway plans mamba_ssm configs without attention");
  (void)c.has("attn_cfg");
  const JsonObject s = c.has("ssm_cfg") ? c.req_obj("ssm_cfg") : c;
  if (s.str_or("layer", "Mamba1") != "Mamba2")
    c.fail("ssm_cfg", "has no \"layer\": \"Mamba2\"; spillway plans Mamba-2 mamba_ssm models");
  LayerSpec l;
  l.mixer = MixerKind::kMamba;
  l.mlp.kind = MlpKind::kNone;
  SsmSpec& ssm = l.ssm;
  ssm.version = 2;
  ssm.state = s.int_or("d_state", 128, 1, kMaxDim);
  ssm.conv = s.int_or("d_conv", 4, 1, kMaxDim);
  ssm.head_dim = s.int_or("headdim", 64, 1, kMaxDim);
  ssm.groups = s.int_or("ngroups", 1, 1, kMaxDim);
  ssm.chunk = s.int_or("chunk_size", 256, 1, kMaxDim);
  ssm.inner = checked_mul(s.int_or("expand", 2, 1, 1024), m.hidden, "model config: inner");
  if (ssm.inner % ssm.head_dim != 0)
    c.fail("ssm_cfg", fmt::format("has expand x d_model = {}, not a multiple of headdim ({})",
                                  ssm.inner, ssm.head_dim));
  ssm.heads = ssm.inner / ssm.head_dim;
  ssm.conv_bias = s.bool_or("conv_bias", true);
  ssm.proj_bias = s.bool_or("bias", false);
  ssm.gated_norm = s.bool_or("rmsnorm", true);
  m.layers.assign(static_cast<size_t>(layers), l);
  return m;
}

// Grok-1 and Grok-2: 8 experts, top-2; Grok-2 adds a dense MLP beside the experts
// ("residual_moe"), sized by intermediate_size, with experts sized by moe_intermediate_size.
ModelConfig parse_grok(const JsonObject& c, ModelConfig m) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  moe.experts = c.has("num_local_experts") ? c.req_int("num_local_experts", 1, kMaxDim)
                                           : c.req_int("num_experts", 1, kMaxDim);
  moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, "num_local_experts", moe.experts);
  const bool residual = c.bool_or("residual_moe", false);
  if (c.has("moe_intermediate_size")) {
    moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
    if (residual) moe.residual_ffn = c.req_int("intermediate_size", 1, kMaxDim);
  } else {
    moe.ffn = c.req_int("intermediate_size", 1, kMaxDim);
    if (residual)
      c.fail("moe_intermediate_size", "is missing; it is required when \"residual_moe\" is true");
  }
  // Grok's sliding_window_size: -1 (or absent) is full attention.
  const int64_t window = c.int_or("sliding_window_size", -1, -1, kMaxDim);
  if (window == 0) c.fail("sliding_window_size", "is 0; must be -1 (full attention) or >= 1");
  if (window > 0) a.sliding_window = window;
  m.layers.assign(static_cast<size_t>(layers), LayerSpec{a, moe});
  return m;
}

[[noreturn]] void unknown_type(const JsonObject& c, const std::string& type) {
  std::string known;
  for (const std::string& t : supported_model_types()) known += (known.empty() ? "" : ", ") + t;
  c.fail("model_type",
         fmt::format("is \"{}\", which spillway cannot plan yet. Known: {}. Relabelling the "
                     "config as a known type would plan a different model (tied embeddings, "
                     "sliding windows, dense first layers, shared experts, linear attention and "
                     "extra norms would be lost or invented); docs/models.md says what each "
                     "family reads",
                     type, known));
}

// Note [Reading a config] (docs/models.md):
//   - the language model's keys are the root's, or those of a nested `text_config` (the
//     multimodal wrappers: Gemma 3, Llama 4); a vision tower is not planned (a note says so);
//   - the family is `model_type` (the text config's, else the wrapper's text family), else
//     the one of `architectures`; when both are known and name different families, the
//     architecture wins (it is the class that holds the weights) and a note says so;
//   - each family reads its keys under their transformers 4 and 5 names (alias());
//   - after reading, a key of the language model that looks like a size, a count or a
//     layer pattern (shape_like) and that the family did not read is an error naming it:
//     an unread shape key would plan a different model silently.
struct FamilyName {
  const char* type;
  const char* family;  // the parser
};
constexpr FamilyName kFamilies[] = {{"llama", "llama"},
                                    {"mistral", "llama"},
                                    {"qwen2", "llama"},
                                    {"qwen3", "llama"},
                                    {"phi3", "llama"},
                                    {"qwen2_moe", "qwen_moe"},
                                    {"qwen3_moe", "qwen_moe"},
                                    {"mixtral", "mixtral"},
                                    {"deepseek", "deepseek"},
                                    {"deepseek_v2", "deepseek"},
                                    {"deepseek_v3", "deepseek"},
                                    {"deepseek_v32", "deepseek"},
                                    {"kimi_k2", "deepseek"},
                                    {"gpt_oss", "gpt_oss"},
                                    {"grok-1", "grok"},
                                    {"grok-2", "grok"},
                                    {"grok", "grok"},
                                    {"git", "grok"},
                                    {"gemma2", "gemma"},
                                    {"gemma3_text", "gemma"},
                                    {"glm4_moe", "glm4_moe"},
                                    {"llama4_text", "llama4"},
                                    {"nemotron_h", "nemotron_h"},
                                    {"mamba2", "mamba2"},
                                    {"jamba", "jamba"},
                                    {"qwen3_next", "qwen3_next"},
                                    {"granitemoehybrid", "granite_hybrid"},
                                    {"recurrent_gemma", "recurrent_gemma"},
                                    {"qwen3_5_moe_text", "qwen3_next"}};

const char* family_of(const std::string& type) {
  for (const FamilyName& f : kFamilies)
    if (type == f.type) return f.family;
  return nullptr;
}

// The model_type an architecture class stands for.
std::string type_of_architecture(const std::string& arch) {
  static const std::pair<const char*, const char*> kArch[] = {
      {"LlamaForCausalLM", "llama"},
      {"MistralForCausalLM", "mistral"},
      {"Qwen2ForCausalLM", "qwen2"},
      {"Qwen3ForCausalLM", "qwen3"},
      {"Phi3ForCausalLM", "phi3"},
      {"Qwen2MoeForCausalLM", "qwen2_moe"},
      {"Qwen3MoeForCausalLM", "qwen3_moe"},
      {"MixtralForCausalLM", "mixtral"},
      {"DeepseekForCausalLM", "deepseek"},
      {"DeepseekV2ForCausalLM", "deepseek_v2"},
      {"DeepseekV3ForCausalLM", "deepseek_v3"},
      {"DeepseekV32ForCausalLM", "deepseek_v32"},
      {"GptOssForCausalLM", "gpt_oss"},
      {"Grok1ForCausalLM", "grok-1"},
      {"Grok1ModelForCausalLM", "grok-1"},
      {"GrokForCausalLM", "grok"},
      {"Gemma2ForCausalLM", "gemma2"},
      {"Gemma3ForCausalLM", "gemma3_text"},
      {"Gemma3ForConditionalGeneration", "gemma3_text"},
      {"Glm4MoeForCausalLM", "glm4_moe"},
      {"Llama4ForCausalLM", "llama4_text"},
      {"Llama4ForConditionalGeneration", "llama4_text"},
      {"NemotronHForCausalLM", "nemotron_h"},
      {"Mamba2ForCausalLM", "mamba2"},
      {"JambaForCausalLM", "jamba"},
      {"Qwen3NextForCausalLM", "qwen3_next"},
      {"GraniteMoeHybridForCausalLM", "granitemoehybrid"},
      {"RecurrentGemmaForCausalLM", "recurrent_gemma"},
      {"Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"}};
  for (const auto& [a, t] : kArch)
    if (arch == a) return t;
  return {};
}

// The text family of a multimodal wrapper's model_type.
std::string text_type_of_wrapper(const std::string& type) {
  if (type == "gemma3") return "gemma3_text";
  if (type == "qwen3_5_moe") return "qwen3_5_moe_text";
  if (type == "llama4") return "llama4_text";
  return type;
}

// A key that looks like a size, a count or a layer pattern.
bool shape_like(std::string_view k) {
  static constexpr std::string_view kNotShape[] = {"max_position_embeddings",
                                                   "original_max_position_embeddings",
                                                   "initializer_range",
                                                   "ep_size",
                                                   "n_group",
                                                   "topk_group",
                                                   "num_nextn_predict_layers",
                                                   "max_batch_size",
                                                   "index_topk",
                                                   "rope_scaling",
                                                   "rope_parameters",
                                                   "num_logits_to_keep",
                                                   "rope_local_base_freq",
                                                   "embeddings_scale_by_sqrt_dim",
                                                   "mtp_use_dedicated_embeddings"};
  for (std::string_view n : kNotShape)
    if (k == n) return false;
  if (k.find("eps") != std::string_view::npos) return false;  // norm epsilons
  if (k.starts_with("num_") || k.starts_with("n_")) return true;
  static constexpr std::string_view kParts[] = {
      "size",   "dim",    "heads",   "layer",    "expert", "rank",        "window",
      "period", "offset", "pattern", "interval", "freq",   "replace",     "ffn",
      "groups", "chunk",  "state",   "conv",     "expand", "block_types", "attn_type"};
  for (std::string_view p : kParts)
    if (k.find(p) != std::string_view::npos) return true;
  return false;
}

void refuse_unread(const JsonObject& c, const std::set<std::string, std::less<>>& reads,
                   const std::string& type) {
  for (const auto& [key, value] : c.raw().items()) {
    if (reads.count(key) != 0 || value.is_null() || value == false) continue;
    if (!shape_like(key)) continue;
    c.fail(key, fmt::format("is {}: it looks like it shapes the model, but spillway does not read "
                            "it for model_type \"{}\", so the plan would be of another model. "
                            "docs/models.md lists the keys each family reads",
                            json_value_text(value), type));
  }
}

}  // namespace

const std::vector<std::string>& supported_model_types() {
  static const std::vector<std::string> types = [] {
    std::vector<std::string> t;
    for (const FamilyName& f : kFamilies) t.emplace_back(f.type);
    t.emplace_back("gemma3");  // wrappers of a text_config
    t.emplace_back("llama4");
    t.emplace_back("qwen3_5_moe");
    t.emplace_back("mamba_ssm");  // the mamba_ssm package's format (no model_type)
    return t;
  }();
  return types;
}

int64_t MlpSpec::active_ffn() const {
  if (kind == MlpKind::kDense) return ffn;
  return checked_add(
      checked_add(checked_mul(top_k, ffn, "active MLP width"), shared_ffn, "active MLP width"),
      residual_ffn, "active MLP width");
}

std::string LayerSpec::block_name() const {
  std::string s;
  switch (mixer) {
    case MixerKind::kAttention:
      s = attn.kind == AttentionKind::kMla ? "mla" : (attn.sliding_window > 0 ? "swa" : "gqa");
      break;
    case MixerKind::kMamba:
      s = ssm.version == 1 ? "mamba" : "mamba2";
      break;
    case MixerKind::kLinearAttention:
      s = "gdn";
      break;
    case MixerKind::kRecurrent:
      s = "rglru";
      break;
    case MixerKind::kNone:
      break;
  }
  auto add = [&](const char* part) { s += s.empty() ? part : std::string("+") + part; };
  const bool is_mtp = mtp;
  if (mlp.kind == MlpKind::kMoe) {
    add("moe");
    if (mlp.residual_ffn > 0) add("dense");
  } else if (mlp.kind == MlpKind::kDense) {
    add("dense");
  }
  if (is_mtp) add("mtp");
  return s;
}

ModelConfig with_mtp_layers(ModelConfig m) {
  if (m.mtp_layers <= 0 || m.layers.empty())
    SPILLWAY_INPUT_ERROR("--mtp: {} declares no multi-token-prediction layers", m.name);
  LayerSpec l = m.layers.back();
  l.mtp = true;
  l.extra_norms += 2;  // enorm, hnorm
  l.extra_params = checked_mul(2 * m.hidden, m.hidden, "model config: MTP projection");
  for (int64_t i = 0; i < m.mtp_layers; ++i) m.layers.push_back(l);
  m.notes.push_back(fmt::format(
      "{} multi-token-prediction layer(s) planned after the last layer (--mtp), each a copy of "
      "it with the MTP module's norms and {} x {} projection",
      m.mtp_layers, 2 * m.hidden, m.hidden));
  // The notes said they were left out: no longer.
  std::erase_if(m.notes, [](const std::string& n) { return n.find("are not planned") != n.npos; });
  m.mtp_layers = 0;
  return m;
}

ModelConfig parse_model_config(const nlohmann::json& config, const std::string& name,
                               const std::string& file) {
  JsonObject root(config, kWhat, file);
  ModelConfig m;
  m.name = name;
  m.source = file;
  // The language model's object (Note [Reading a config]).
  // The mamba_ssm package's own format (no model_type, no architectures).
  if (!root.has("model_type") && !root.has("architectures") && root.has("d_model") &&
      root.has("n_layer")) {
    auto reads = std::make_shared<std::set<std::string, std::less<>>>();
    JsonObject tracked = root;
    tracked.track_reads(reads);
    m = parse_mamba_ssm(tracked, std::move(m));
    refuse_unread(root, *reads, "mamba_ssm");
    return m;
  }
  const bool nested = root.has("text_config") && !root.has("hidden_size");
  const JsonObject c = nested ? root.req_obj("text_config") : root;
  auto reads = std::make_shared<std::set<std::string, std::less<>>>();
  JsonObject tracked = c;
  tracked.track_reads(reads);
  const std::string root_type = root.has("model_type") ? lower(root.req_str("model_type")) : "";
  std::string type;
  if (nested) {
    type = c.has("model_type") ? lower(c.req_str("model_type")) : text_type_of_wrapper(root_type);
    if (root.has("vision_config")) {
      m.notes.push_back(
          fmt::format("the vision tower (vision_config of \"{}\") is not planned: "
                      "the language model of text_config is",
                      root_type));
    }
  } else {
    type = root_type;
    (void)tracked.has("model_type");
  }
  const std::vector<std::string> archs = root.str_array_or("architectures");
  (void)tracked.has("architectures");
  const std::string arch_type = archs.empty() ? "" : type_of_architecture(archs.front());
  if (type.empty()) {
    if (arch_type.empty()) {
      root.fail("model_type", archs.empty()
                                  ? std::string("is missing, and so is \"architectures\"; one of "
                                                "them must say which model this is")
                                  : fmt::format("is missing, and \"architectures\" ({}) is not "
                                                "one spillway knows",
                                                archs.front()));
    }
    type = arch_type;
  } else if (!arch_type.empty() && family_of(type) != nullptr &&
             std::string_view(family_of(type)) != family_of(arch_type)) {
    m.notes.push_back(
        fmt::format("model_type \"{}\" but architectures {}: planned as \"{}\", "
                    "the architecture's family (the class that holds the weights)",
                    type, archs.front(), arch_type));
    type = arch_type;
  }
  // As written in the config (case kept), unless the architecture decided.
  const JsonObject& typed = nested && c.has("model_type") ? c : root;
  m.model_type = typed.has("model_type") && lower(typed.req_str("model_type")) == type
                     ? typed.req_str("model_type")
                     : type;
  m.hidden = tracked.req_int("hidden_size", 1, kMaxDim);
  if (!tracked.has("vocab_size") && type == "gemma3_text") {
    // Gemma 3's wrapper configs leave the text vocabulary at transformers' default.
    m.vocab = 262208;
    m.notes.push_back(
        "vocab_size is not given: transformers' Gemma3TextConfig default, 262,208, is used");
  } else {
    m.vocab = tracked.req_int("vocab_size", 1, kMaxDim);
  }
  const char* fam = family_of(type);
  const bool tied_default = fam != nullptr && (std::string_view(fam) == "gemma" ||
                                               std::string_view(fam) == "recurrent_gemma");
  m.tied_embeddings = tracked.has("tie_word_embeddings")
                          ? tracked.bool_or("tie_word_embeddings", tied_default)
                          : root.bool_or("tie_word_embeddings", tied_default);
  const std::string f = fam != nullptr ? fam : "";
  if (f == "llama") {
    m = parse_llama_like(tracked, std::move(m), type);
  } else if (f == "qwen_moe") {
    m = parse_qwen_moe(tracked, std::move(m), type);
  } else if (f == "mixtral") {
    m = parse_mixtral(tracked, std::move(m));
  } else if (f == "deepseek") {
    m = parse_deepseek(tracked, std::move(m), type == "kimi_k2" ? "deepseek_v3" : type);
  } else if (f == "gpt_oss") {
    m = parse_gpt_oss(tracked, std::move(m));
  } else if (f == "grok") {
    m = parse_grok(tracked, std::move(m));
  } else if (f == "gemma") {
    m = parse_gemma(tracked, std::move(m), type);
  } else if (f == "glm4_moe") {
    m = parse_glm4_moe(tracked, std::move(m));
  } else if (f == "llama4") {
    m = parse_llama4(tracked, std::move(m));
  } else if (f == "nemotron_h") {
    m = parse_nemotron_h(tracked, std::move(m));
  } else if (f == "mamba2") {
    m = parse_mamba2(tracked, std::move(m));
  } else if (f == "jamba") {
    m = parse_jamba(tracked, std::move(m));
  } else if (f == "qwen3_next") {
    m = parse_qwen3_next(tracked, std::move(m));
  } else if (f == "granite_hybrid") {
    m = parse_granite_hybrid(tracked, std::move(m));
  } else if (f == "recurrent_gemma") {
    m = parse_recurrent_gemma(tracked, std::move(m));
  } else {
    unknown_type(nested ? c : root, nested ? type : m.model_type);
  }
  refuse_unread(c, *reads, type);
  // Validate that the totals fit 64 bits once, here, naming the sizes and the file.
  try {
    (void)parameter_count(m);
  } catch (const Error& e) {
    const LayerSpec& l = m.layers.front();
    SPILLWAY_INPUT_ERROR(
        "{}: the parameter count does not fit 64 bits with \"hidden_size\" {}, \"vocab_size\" {}, "
        "\"num_hidden_layers\" {}, \"intermediate_size\" (or the experts' width) {}, {} experts "
        "({}){}",
        kWhat, m.hidden, m.vocab, m.layers.size(), l.mlp.ffn, l.mlp.experts, e.what(),
        file.empty() ? "" : fmt::format(" (file: {})", file));
  }
  return m;
}

std::vector<ModelCatalogEntry> model_catalog() {
  const EmbeddedFile* f = find_embedded("models", "catalog.json");
  SPILLWAY_CHECK(f != nullptr, "the embedded model catalog (data/models/catalog.json) is missing");
  const Json doc = parse_json_text(f->text, "model catalog", "data/models/catalog.json");
  JsonObject root(doc, "model catalog", "data/models/catalog.json");
  std::vector<ModelCatalogEntry> out;
  for (const JsonObject& e : root.obj_array("models")) {
    ModelCatalogEntry m;
    m.name = e.req_str("name");
    m.file = e.req_str("file");
    m.hf_repo = e.str_or("hf_repo", "");
    m.published_params_b = e.req_num("published_params_b", 0.0, 1e6);
    m.published_active_params_b = e.num_or("published_active_params_b", 0.0, 0.0, 1e6);
    m.params_tolerance = e.num_or("params_tolerance", 0.01, 0.0, 0.5);
    m.active_tolerance = e.num_or("active_tolerance", 0.01, 0.0, 0.5);
    m.active_counts_embedding = e.bool_or("active_counts_embedding", true);
    out.push_back(std::move(m));
  }
  return out;
}

ModelConfig load_model(const std::string& name_or_path) {
  const std::string key = lower(name_or_path);
  for (const ModelCatalogEntry& e : model_catalog()) {
    if (lower(e.name) == key || lower(e.file) == key) {
      const EmbeddedFile* f = find_embedded("models", e.file);
      SPILLWAY_CHECK(f != nullptr, "catalog entry {} names a missing file {}", e.name, e.file);
      const std::string label = "data/models/" + e.file;
      return parse_model_config(parse_json_text(f->text, kWhat, label), e.name, label);
    }
  }
  // The reference model's embedded configs (data/nn/: tiny-moe, small-moe, tiny-hybrid, what
  // `spillway train` runs) plan by the same name.
  if (const EmbeddedFile* f = find_embedded("nn", key + ".json"); f != nullptr) {
    const std::string label = "data/nn/" + key + ".json";
    return parse_model_config(parse_json_text(f->text, kWhat, label), key, label);
  }
  std::error_code ec;
  if (!std::filesystem::exists(name_or_path, ec)) {
    std::string names;
    for (const ModelCatalogEntry& e : model_catalog())
      names += (names.empty() ? "" : ", ") + e.name;
    SPILLWAY_INPUT_ERROR(
        "model: '{}' is neither a catalog model nor an existing file. Catalog: {}; the reference "
        "models of `spillway train`: tiny-moe, small-moe, tiny-hybrid (or pass the path of a "
        "Hugging Face "
        "config.json)",
        name_or_path, names);
  }
  std::filesystem::path p(name_or_path);
  if (std::filesystem::is_directory(p, ec)) p /= "config.json";
  std::string stem = p.stem().string();
  if (stem == "config" && p.has_parent_path()) stem = p.parent_path().filename().string();
  return parse_model_config(load_json_file(p.string(), kWhat), stem, p.string());
}

namespace {

using ParamFn = int64_t (*)(int64_t, int64_t);
int64_t pmul(int64_t a, int64_t b) {
  return checked_mul(a, b, "model config: parameter count");
}
int64_t padd(int64_t a, int64_t b) {
  return checked_add(a, b, "model config: parameter count");
}

int64_t attention_parameters(const AttentionSpec& a, int64_t d) {
  int64_t p = 0;
  if (a.kind == AttentionKind::kGqa) {
    const int64_t q = pmul(pmul(a.heads, a.qk_head_dim), a.output_gate ? 2 : 1);
    p = padd(p, pmul(d, q));                                               // q (and its gate)
    p = padd(p, pmul(d, pmul(a.kv_heads, a.qk_head_dim + a.v_head_dim)));  // k, v
    if (a.qkv_bias) p = padd(p, q + pmul(a.kv_heads, a.qk_head_dim + a.v_head_dim));
  } else {
    const int64_t q_out = pmul(a.heads, a.qk_head_dim);
    if (a.q_lora_rank > 0) {
      p = padd(p, padd(pmul(d, a.q_lora_rank), a.q_lora_rank));  // q_a + its norm
      p = padd(p, pmul(a.q_lora_rank, q_out));                   // q_b
    } else {
      p = padd(p, pmul(d, q_out));
    }
    p = padd(p, pmul(d, a.kv_lora_rank + a.qk_rope_head_dim));  // kv_a
    p = padd(p, a.kv_lora_rank);                                // kv_a norm
    p = padd(
        p, pmul(a.kv_lora_rank, pmul(a.heads, a.qk_head_dim - a.qk_rope_head_dim + a.v_head_dim)));
  }
  p = padd(p, pmul(pmul(a.heads, a.v_head_dim), d));  // o
  if (a.o_bias) p = padd(p, d);
  if (a.qk_norm) p = padd(p, 2 * a.qk_head_dim);
  if (a.sinks) p = padd(p, a.heads);
  if (a.indexer_heads > 0) {  // DeepSeek-V3.2's lightning indexer
    p = padd(p, pmul(a.q_lora_rank, pmul(a.indexer_heads, a.indexer_head_dim)));  // wq_b
    p = padd(p, pmul(d, a.indexer_head_dim));                                     // wk
    p = padd(p, pmul(2, a.indexer_head_dim));                                     // k_norm
    p = padd(p, pmul(d, a.indexer_heads));                                        // weights_proj
  }
  return p;
}

// Transformers' MambaMixer (version 1) and Mamba2Mixer (version 2).
int64_t ssm_parameters(const SsmSpec& s, int64_t d) {
  int64_t p = 0;
  const int64_t e = s.inner;
  if (s.version == 1) {
    p = padd(p, pmul(d, 2 * e));  // in_proj: x and z
    if (s.proj_bias) p = padd(p, 2 * e);
    p = padd(p, pmul(e, s.conv));  // conv1d
    if (s.conv_bias) p = padd(p, e);
    p = padd(p, pmul(e, s.dt_rank + 2 * s.state));           // x_proj: dt, B, C
    p = padd(p, padd(pmul(s.dt_rank, e), e));                // dt_proj with its bias
    p = padd(p, padd(pmul(e, s.state), e));                  // A_log, D
    if (s.bcdt_norms) p = padd(p, s.dt_rank + 2 * s.state);  // Jamba's dt, B, C norms
  } else {
    const int64_t conv_dim = padd(e, pmul(2, pmul(s.groups, s.state)));
    const int64_t in_out = padd(padd(e, conv_dim), s.heads);  // z, x B C, dt
    p = padd(p, pmul(d, in_out));
    if (s.proj_bias) p = padd(p, in_out);
    p = padd(p, pmul(conv_dim, s.conv));
    if (s.conv_bias) p = padd(p, conv_dim);
    p = padd(p, pmul(3, s.heads));  // dt_bias, A_log, D
    if (s.gated_norm) p = padd(p, e);
  }
  p = padd(p, pmul(e, d));  // out_proj
  if (s.proj_bias) p = padd(p, d);
  return p;
}

// Qwen3-Next's Gated DeltaNet.
int64_t linear_attention_parameters(const LinearAttentionSpec& g, int64_t d) {
  const int64_t key = pmul(g.k_heads, g.k_head_dim);
  const int64_t value = pmul(g.v_heads, g.v_head_dim);
  int64_t p = pmul(d, padd(pmul(2, key), pmul(2, value)));  // in_proj_qkvz
  p = padd(p, pmul(d, 2 * g.v_heads));                      // in_proj_ba
  p = padd(p, pmul(padd(pmul(2, key), value), g.conv));     // conv1d (no bias)
  p = padd(p, pmul(2, g.v_heads));                          // dt_bias, A_log
  p = padd(p, g.v_head_dim);                                // gated RMSNorm
  p = padd(p, pmul(value, d));                              // out_proj
  return p;
}

// Griffin's recurrent block (transformers' RecurrentGemmaRecurrentBlock).
int64_t recurrent_parameters(const RecurrentSpec& r, int64_t d) {
  const int64_t w = r.width;
  const int64_t block = w / r.heads;
  int64_t p = pmul(2, padd(pmul(d, w), w));       // linear_y, linear_x with biases
  p = padd(p, padd(pmul(w, d), d));               // linear_out with its bias
  p = padd(p, padd(pmul(w, r.conv), w));          // conv_1d with its bias
  p = padd(p, w);                                 // recurrent_param
  p = padd(p, pmul(2, padd(pmul(w, block), w)));  // input and recurrence gates
  return p;
}

int64_t mlp_parameters(const MlpSpec& m, int64_t d) {
  auto ffn = [&](int64_t f, bool bias, bool gated) {
    const int64_t w = pmul(gated ? 3 : 2, pmul(d, f));
    return bias ? padd(w, padd(pmul(gated ? 2 : 1, f), d)) : w;
  };
  if (m.kind == MlpKind::kNone) return 0;
  if (m.kind == MlpKind::kDense) return ffn(m.ffn, m.bias, m.gated);
  int64_t p = pmul(m.experts, ffn(m.ffn, m.bias, m.gated));
  p = padd(p, pmul(d, m.experts));  // router
  if (m.router_bias) p = padd(p, m.experts);
  if (m.shared_ffn > 0) p = padd(p, ffn(m.shared_ffn, false, m.gated));
  if (m.shared_gate) p = padd(p, d);
  if (m.residual_ffn > 0) p = padd(p, ffn(m.residual_ffn, false, m.gated));
  return p;
}

}  // namespace

int64_t layer_parameter_count(const LayerSpec& l, int64_t d) {
  // Each part brings its pre-norm (RMSNorm, d): the input norm of the mixer, the
  // post-attention norm of the MLP; Gemma's sandwich norms are extra_norms.
  int64_t p = padd(pmul(l.extra_norms, d), l.extra_params);
  switch (l.mixer) {
    case MixerKind::kAttention:
      p = padd(p, padd(d, attention_parameters(l.attn, d)));
      break;
    case MixerKind::kMamba:
      p = padd(p, padd(d, ssm_parameters(l.ssm, d)));
      break;
    case MixerKind::kLinearAttention:
      p = padd(p, padd(d, linear_attention_parameters(l.linear, d)));
      break;
    case MixerKind::kRecurrent:
      p = padd(p, padd(d, recurrent_parameters(l.recurrent, d)));
      break;
    case MixerKind::kNone:
      break;
  }
  if (l.mlp.kind != MlpKind::kNone) p = padd(p, padd(d, mlp_parameters(l.mlp, d)));
  return p;
}

namespace {
int64_t embedding_parameters(const ModelConfig& m) {
  const int64_t emb = checked_mul(m.vocab, m.hidden, "model config: embedding size");
  const int64_t both =
      m.tied_embeddings ? emb : checked_mul(2, emb, "model config: embedding size");
  return checked_add(both, m.hidden, "model config: parameter count");  // + final norm
}
}  // namespace

int64_t parameter_count(const ModelConfig& m) {
  int64_t p = embedding_parameters(m);
  for (const LayerSpec& l : m.layers) {
    p = checked_add(p, layer_parameter_count(l, m.hidden), "model config: parameter count");
  }
  return p;
}

int64_t active_parameter_count(const ModelConfig& m) {
  int64_t p = embedding_parameters(m);
  for (const LayerSpec& l : m.layers) {
    // Only the routed experts a token uses count (the router is then counted at top_k
    // width, a difference of d * (E - k) parameters per layer, well under 0.1%).
    LayerSpec active = l;
    if (l.mlp.kind == MlpKind::kMoe) active.mlp.experts = l.mlp.top_k;
    p = checked_add(p, layer_parameter_count(active, m.hidden), "model config: parameter count");
  }
  return p;
}

}  // namespace spillway

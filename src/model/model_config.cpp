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
    if (c.bool_or("use_sliding_window", false)) {
      window = read_window(c);
      window_from = c.int_or("max_window_layers", 0, 0, kMaxLayers);
    }
  } else if (type == "mistral") {
    window = read_window(c);
  }
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l{a, mlp};
    if (window > 0 && i >= window_from) l.attn.sliding_window = window;
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
  moe.experts = c.req_int("num_experts", 1, kMaxDim);
  moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, "num_experts", moe.experts);
  moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
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

ModelConfig parse_deepseek(const JsonObject& c, ModelConfig m, const std::string& type) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a;
  a.kind = AttentionKind::kMla;
  a.heads = c.req_int("num_attention_heads", 1, kMaxDim);
  a.kv_heads = a.heads;
  a.q_lora_rank = c.int_or("q_lora_rank", 0, 0, kMaxDim);
  a.kv_lora_rank = c.req_int("kv_lora_rank", 1, kMaxDim);
  const int64_t nope = c.req_int("qk_nope_head_dim", 0, kMaxDim);
  a.qk_rope_head_dim = c.req_int("qk_rope_head_dim", 0, kMaxDim);
  a.qk_head_dim = nope + a.qk_rope_head_dim;
  if (a.qk_head_dim == 0)
    c.fail("qk_nope_head_dim",
           "and \"qk_rope_head_dim\" are both 0; the query/key head needs a width");
  a.v_head_dim = c.req_int("v_head_dim", 1, kMaxDim);
  a.qkv_bias = c.bool_or("attention_bias", false);

  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  moe.experts = c.int_or("n_routed_experts", 0, 0, kMaxDim);
  MlpSpec dense = dense_mlp(c);
  const int64_t first_dense = c.int_or("first_k_dense_replace", 0, 0, kMaxLayers);
  const int64_t freq = c.int_or("moe_layer_freq", 1, 1, kMaxLayers);
  if (moe.experts > 0) {
    moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
    check_topk(c, "num_experts_per_tok", moe.top_k, "n_routed_experts", moe.experts);
    moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
    moe.shared_ffn = checked_mul(c.int_or("n_shared_experts", 0, 0, kMaxDim), moe.ffn,
                                 "model config: n_shared_experts * moe_intermediate_size");
    moe.router_bias = (type == "deepseek_v3");  // e_score_correction_bias
  }
  for (int64_t i = 0; i < layers; ++i) {
    const bool sparse = moe.experts > 0 && i >= first_dense && i % freq == 0;
    m.layers.push_back(LayerSpec{a, sparse ? moe : dense});
  }
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
  moe.top_k = c.has("num_experts_per_tok") ? c.req_int("num_experts_per_tok", 1, kMaxDim)
                                           : c.req_int("experts_per_token", 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, "num_local_experts", moe.experts);
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
  m.layers.assign(static_cast<size_t>(layers), LayerSpec{a, moe});
  return m;
}

[[noreturn]] void unknown_type(const JsonObject& c, const std::string& type) {
  std::string known;
  for (const std::string& t : supported_model_types()) known += (known.empty() ? "" : ", ") + t;
  c.fail("model_type",
         fmt::format("is \"{}\", which spillway does not know. Known: {}. To plan another "
                     "architecture, describe it as the nearest known type: a dense model needs "
                     "model_type \"llama\" with hidden_size, num_hidden_layers, "
                     "num_attention_heads, num_key_value_heads, head_dim, intermediate_size, "
                     "vocab_size; an MoE model needs model_type \"qwen3_moe\" with those plus "
                     "num_experts, num_experts_per_tok, moe_intermediate_size",
                     type, known));
}

}  // namespace

const std::vector<std::string>& supported_model_types() {
  static const std::vector<std::string> types = {
      "llama",       "mistral",     "qwen2",   "qwen3",  "qwen2_moe", "qwen3_moe", "mixtral",
      "deepseek_v2", "deepseek_v3", "gpt_oss", "grok-1", "grok-2",    "grok",      "git"};
  return types;
}

int64_t MlpSpec::active_ffn() const {
  if (kind == MlpKind::kDense) return ffn;
  return checked_add(
      checked_add(checked_mul(top_k, ffn, "active MLP width"), shared_ffn, "active MLP width"),
      residual_ffn, "active MLP width");
}

std::string LayerSpec::block_name() const {
  std::string s =
      attn.kind == AttentionKind::kMla ? "mla" : (attn.sliding_window > 0 ? "swa" : "gqa");
  s += mlp.kind == MlpKind::kMoe ? "+moe" : "+dense";
  if (mlp.kind == MlpKind::kMoe && mlp.residual_ffn > 0) s += "+dense";
  return s;
}

ModelConfig parse_model_config(const nlohmann::json& config, const std::string& name,
                               const std::string& file) {
  JsonObject c(config, kWhat, file);
  ModelConfig m;
  m.name = name;
  m.source = file;
  m.model_type = c.req_str("model_type");
  const std::string type = lower(m.model_type);
  m.hidden = c.req_int("hidden_size", 1, kMaxDim);
  m.vocab = c.req_int("vocab_size", 1, kMaxDim);
  m.tied_embeddings = c.bool_or("tie_word_embeddings", false);
  if (type == "llama" || type == "mistral" || type == "qwen2" || type == "qwen3") {
    m = parse_llama_like(c, std::move(m), type);
  } else if (type == "qwen2_moe" || type == "qwen3_moe") {
    m = parse_qwen_moe(c, std::move(m), type);
  } else if (type == "mixtral") {
    m = parse_mixtral(c, std::move(m));
  } else if (type == "deepseek_v2" || type == "deepseek_v3") {
    m = parse_deepseek(c, std::move(m), type);
  } else if (type == "gpt_oss") {
    m = parse_gpt_oss(c, std::move(m));
  } else if (type == "grok-1" || type == "grok-2" || type == "grok" || type == "git") {
    m = parse_grok(c, std::move(m));
  } else {
    unknown_type(c, m.model_type);
  }
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
  // The reference model's embedded configs (data/nn/: tiny-moe, small-moe, what `spillway
  // train` runs) plan by the same name.
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
        "models of `spillway train`: tiny-moe, small-moe (or pass the path of a Hugging Face "
        "config.json)",
        name_or_path, names);
  }
  std::filesystem::path p(name_or_path);
  if (std::filesystem::is_directory(p, ec)) p /= "config.json";
  std::string stem = p.stem().string();
  if (stem == "config" && p.has_parent_path()) stem = p.parent_path().filename().string();
  return parse_model_config(load_json_file(p.string(), kWhat), stem, p.string());
}

int64_t layer_parameter_count(const LayerSpec& l, int64_t d) {
  auto mul = [](int64_t a, int64_t b) {
    return checked_mul(a, b, "model config: parameter count");
  };
  auto add = [](int64_t a, int64_t b) {
    return checked_add(a, b, "model config: parameter count");
  };
  const AttentionSpec& a = l.attn;
  int64_t p = d;  // input RMSNorm
  if (a.kind == AttentionKind::kGqa) {
    p = add(p, mul(d, mul(a.heads, a.qk_head_dim)));                    // q
    p = add(p, mul(d, mul(a.kv_heads, a.qk_head_dim + a.v_head_dim)));  // k, v
    if (a.qkv_bias)
      p = add(p, mul(a.heads, a.qk_head_dim) + mul(a.kv_heads, a.qk_head_dim + a.v_head_dim));
  } else {
    const int64_t q_out = mul(a.heads, a.qk_head_dim);
    if (a.q_lora_rank > 0) {
      p = add(p, add(mul(d, a.q_lora_rank), a.q_lora_rank));  // q_a + its norm
      p = add(p, mul(a.q_lora_rank, q_out));                  // q_b
    } else {
      p = add(p, mul(d, q_out));
    }
    p = add(p, mul(d, a.kv_lora_rank + a.qk_rope_head_dim));  // kv_a
    p = add(p, a.kv_lora_rank);                               // kv_a norm
    p = add(p,
            mul(a.kv_lora_rank, mul(a.heads, a.qk_head_dim - a.qk_rope_head_dim + a.v_head_dim)));
  }
  p = add(p, mul(mul(a.heads, a.v_head_dim), d));  // o
  if (a.o_bias) p = add(p, d);
  if (a.qk_norm) p = add(p, 2 * a.qk_head_dim);
  if (a.sinks) p = add(p, a.heads);

  const MlpSpec& m = l.mlp;
  p = add(p, d);  // post-attention RMSNorm
  auto swiglu = [&](int64_t f, bool bias) {
    int64_t w = mul(3, mul(d, f));
    return bias ? add(w, add(mul(2, f), d)) : w;
  };
  if (m.kind == MlpKind::kDense) {
    p = add(p, swiglu(m.ffn, m.bias));
  } else {
    p = add(p, mul(m.experts, swiglu(m.ffn, m.bias)));
    p = add(p, mul(d, m.experts));  // router
    if (m.router_bias) p = add(p, m.experts);
    if (m.shared_ffn > 0) p = add(p, swiglu(m.shared_ffn, false));
    if (m.shared_gate) p = add(p, d);
    if (m.residual_ffn > 0) p = add(p, swiglu(m.residual_ffn, false));
  }
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

// The readers of config fields that several model families spell alike (families.hpp says
// what each reads); the family parsers under families/ build on them.
#include <fmt/format.h>

#include "model/families/families.hpp"
#include "spillway/core/units.hpp"

namespace spillway::families {

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

MlpSpec dense_mlp(const JsonObject& c, const char* key) {
  MlpSpec m;
  m.kind = MlpKind::kDense;
  m.ffn = c.req_int(key, 1, kMaxDim);
  return m;
}

MlpSpec local_experts_moe(const JsonObject& c) {
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  moe.experts = c.req_int("num_local_experts", 1, kMaxDim);
  moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, "num_local_experts", moe.experts);
  moe.ffn = c.req_int("intermediate_size", 1, kMaxDim);
  return moe;
}

void check_topk(const JsonObject& c, const char* k_key, int64_t k, const char* e_key, int64_t e) {
  if (k > e) {
    c.fail(k_key, fmt::format("is {}; must be <= \"{}\" ({})", k, e_key, e));
  }
}

int64_t read_window(const JsonObject& c) {
  if (!c.has("sliding_window")) return 0;
  return c.req_int("sliding_window", 1, kMaxDim);
}

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

std::vector<char> read_full_attention_layers(const JsonObject& c, int64_t layers) {
  const std::vector<std::string> types = c.str_array_or("layer_types");
  if (types.empty()) return {};
  if (static_cast<int64_t>(types.size()) != layers) {
    c.fail("layer_types",
           fmt::format("has {} entries; must have one per layer ({})", types.size(), layers));
  }
  std::vector<char> full(types.size(), 0);
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] != "full_attention" && types[i] != "linear_attention") {
      c.fail(
          fmt::format("layer_types[{}]", i),
          fmt::format("is \"{}\"; must be \"full_attention\" or \"linear_attention\"", types[i]));
    }
    full[i] = types[i] == "full_attention";
  }
  return full;
}

std::vector<char> read_mlp_layer_types(const JsonObject& c, int64_t layers) {
  const std::vector<std::string> types = c.str_array_or("mlp_layer_types");
  if (types.empty()) return {};
  if (static_cast<int64_t>(types.size()) != layers) {
    c.fail("mlp_layer_types",
           fmt::format("has {} entries; must have one per layer ({})", types.size(), layers));
  }
  std::vector<char> sparse(types.size(), 0);
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] != "dense" && types[i] != "sparse") {
      c.fail(fmt::format("mlp_layer_types[{}]", i),
             fmt::format("is \"{}\"; must be \"dense\" or \"sparse\"", types[i]));
    }
    sparse[i] = types[i] == "sparse";
  }
  if (c.has("first_k_dense_replace")) {
    const int64_t first = c.req_int("first_k_dense_replace", 0, kMaxLayers);
    for (size_t i = 0; i < sparse.size(); ++i) {
      if ((static_cast<int64_t>(i) >= first) != (sparse[i] != 0)) {
        c.fail("first_k_dense_replace",
               fmt::format("is {} but \"mlp_layer_types\"[{}] is \"{}\"; transformers builds "
                           "the layers from mlp_layer_types, derived from first_k_dense_replace",
                           first, i, types[i]));
      }
    }
  }
  return sparse;
}

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

int64_t read_dt_rank(const JsonObject& c, const char* key, int64_t hidden) {
  const int64_t automatic = (hidden + 15) / 16;
  if (c.has(key) && c.raw().at(key).is_string()) {
    if (c.req_str(key) != "auto") c.fail(key, "must be an integer or \"auto\"");
    return automatic;
  }
  return c.int_or(key, automatic, 1, kMaxDim);
}

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
  // transformers 5 writes what it derives: qk_head_dim = nope + rope.
  if (c.has("qk_head_dim") && c.req_int("qk_head_dim", 1, kMaxDim) != a.qk_head_dim) {
    c.fail("qk_head_dim", fmt::format("is {}; transformers derives it as \"qk_nope_head_dim\" + "
                                      "\"qk_rope_head_dim\" ({} + {} = {})",
                                      c.req_int("qk_head_dim", 1, kMaxDim), nope,
                                      a.qk_rope_head_dim, a.qk_head_dim));
  }
  a.v_head_dim = c.req_int("v_head_dim", 1, kMaxDim);
  (void)c.has("head_dim");  // transformers sets it to qk_rope_head_dim; the widths above rule
  a.qkv_bias = c.bool_or("attention_bias", false);
  return a;
}

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
  if (const char* expand_key = alias(c, {"expand", "mamba_expand"}); c.has(expand_key)) {
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

}  // namespace spillway::families

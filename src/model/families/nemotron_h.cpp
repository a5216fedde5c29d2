// Nemotron-H: Mamba-2, attention, MLP and MoE layers by a pattern string.
#include <fmt/format.h>

#include "model/families/families.hpp"
#include "spillway/core/units.hpp"

namespace spillway::families {

namespace {

// transformers 5 writes the pattern as layers_block_type, one name a layer
// ("linear_attention" M, "full_attention" *, "mlp" -, "moe" E), and derives
// num_hidden_layers from its length: when given, both are checked against it.
std::string read_pattern(const JsonObject& c) {
  if (!c.has("layers_block_type")) {
    const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
    const std::string pattern = c.req_str("hybrid_override_pattern");
    if (static_cast<int64_t>(pattern.size()) != layers) {
      c.fail(
          "hybrid_override_pattern",
          fmt::format("has {} characters; must have one per layer ({})", pattern.size(), layers));
    }
    return pattern;
  }
  const std::vector<std::string> types = c.str_array_or("layers_block_type");
  if (types.empty() || static_cast<int64_t>(types.size()) > kMaxLayers)
    c.fail("layers_block_type",
           fmt::format("has {} entries; must have 1 to {}", types.size(), kMaxLayers));
  std::string pattern;
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string& t = types[i];
    if (t == "linear_attention" || t == "mamba") {
      pattern += 'M';
    } else if (t == "full_attention" || t == "attention") {
      pattern += '*';
    } else if (t == "mlp") {
      pattern += '-';
    } else if (t == "moe") {
      pattern += 'E';
    } else {
      c.fail(fmt::format("layers_block_type[{}]", i),
             fmt::format("is \"{}\"; must be \"linear_attention\" (Mamba-2), \"full_attention\", "
                         "\"mlp\" or \"moe\"",
                         t));
    }
  }
  if (c.has("num_hidden_layers") &&
      c.req_int("num_hidden_layers", 1, kMaxLayers) != static_cast<int64_t>(types.size())) {
    c.fail("num_hidden_layers",
           fmt::format("is {}; transformers derives it from \"layers_block_type\", which has {} "
                       "entries",
                       c.req_int("num_hidden_layers", 1, kMaxLayers), types.size()));
  }
  if (c.has("hybrid_override_pattern") && c.req_str("hybrid_override_pattern") != pattern) {
    c.fail("hybrid_override_pattern", fmt::format("is \"{}\"; \"layers_block_type\" says \"{}\"",
                                                  c.req_str("hybrid_override_pattern"), pattern));
  }
  return pattern;
}

}  // namespace

// Nemotron-H: one block a layer, by hybrid_override_pattern: 'M' a Mamba-2 mixer, '*'
// attention, '-' a squared-ReLU MLP (up and down), 'E' an MoE (routed experts plus a shared
// one, squared-ReLU as well).
ModelConfig parse_nemotron_h(const JsonObject& c, ModelConfig m, const std::string&) {
  const std::string pattern = read_pattern(c);
  const auto layers = static_cast<int64_t>(pattern.size());
  // The multi-token-prediction layers' pattern: those layers are not planned.
  (void)c.has("mtp_layers_block_type");
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
    moe.router_bias = true;                    // e_score_correction_bias
    (void)c.has("moe_shared_expert_overlap");  // overlaps the shared expert's compute: no weight
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

}  // namespace spillway::families

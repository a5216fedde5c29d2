// Kimi-Linear: Kimi Delta Attention layers with a multi-head latent attention layer among
// them, DeepSeek-V3-style MoE after a dense first layer.
#include <fmt/format.h>

#include <set>

#include "model/families/families.hpp"
#include "spillway/core/units.hpp"

namespace spillway::families {

// Kimi-Linear (its checkpoint's modeling_kimi and vLLM's kimi_linear): the layers listed in
// linear_attn_config.kda_layers are KDA, those in full_attn_layers MLA (both lists count
// from 1, as the checkpoint's is_kda_layer does); without it, transformers 5's keys
// (linear_num_heads, linear_head_dim, linear_conv_kernel_dim, layer_types).
// KDA (num_heads heads of head_dim): q, k, v projections with their short convolutions, the
// per-channel decay and the output gate each through a head_dim-rank pair, beta per head,
// A_log and dt_bias, a gated RMSNorm and o_proj, no biases. MLA as DeepSeek's (without RoPE
// when mla_use_nope, which changes no parameter). The MLP: a dense SwiGLU below
// first_k_dense_replace, else num_experts routed experts of moe_intermediate_size,
// num_shared_experts shared ones, a router with its score-correction bias.
ModelConfig parse_kimi_linear(const JsonObject& c, ModelConfig m, const std::string&) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  const AttentionSpec mla = read_mla(c);
  (void)c.has("mla_use_nope");
  std::vector<char> kda(static_cast<size_t>(layers), 0);
  LinearAttentionSpec lin;
  if (c.has("linear_attn_config")) {
    const JsonObject k = c.req_obj("linear_attn_config");
    lin.kind = LinearKind::kKimiDelta;
    lin.k_heads = lin.v_heads = k.req_int("num_heads", 1, kMaxDim);
    lin.k_head_dim = lin.v_head_dim = k.req_int("head_dim", 1, kMaxDim);
    lin.gate_rank = lin.k_head_dim;
    lin.conv = k.int_or("short_conv_kernel_size", 4, 1, kMaxDim);
    std::set<int64_t> seen;
    for (const char* key : {"kda_layers", "full_attn_layers"}) {
      for (const int64_t one_based : k.int_array_or(key, 1, layers)) {
        if (!seen.insert(one_based).second) {
          k.fail(key, fmt::format("lists layer {} (counted from 1) twice, or also in the other "
                                  "list",
                                  one_based));
        }
        kda[static_cast<size_t>(one_based - 1)] = std::string_view(key) == "kda_layers";
      }
    }
    if (static_cast<int64_t>(seen.size()) != layers) {
      k.fail("kda_layers", fmt::format("and \"full_attn_layers\" list {} layers together; the "
                                       "model has {} (num_hidden_layers), each in one list",
                                       seen.size(), layers));
    }
    // transformers 5 also writes what it derived from linear_attn_config: it must agree.
    const std::pair<const char*, int64_t> derived[] = {{"linear_num_heads", lin.k_heads},
                                                       {"linear_head_dim", lin.k_head_dim},
                                                       {"linear_conv_kernel_dim", lin.conv}};
    for (const auto& [key, want] : derived) {
      if (c.has(key) && c.req_int(key, 1, kMaxDim) != want)
        c.fail(key, fmt::format("is {}; \"linear_attn_config\" says {}", c.req_int(key, 1, kMaxDim),
                                want));
    }
  } else {
    // transformers 5's own form: linear_num_heads heads of linear_head_dim, layer_types
    // ("linear_attention" KDA, "full_attention" MLA), by default MLA every 4th layer from
    // layer 4 (0-based i > 0 and i % 4 == 0), as KimiLinearConfig derives it.
    lin.kind = LinearKind::kKimiDelta;
    lin.k_heads = lin.v_heads = c.int_or("linear_num_heads", 32, 1, kMaxDim);
    lin.k_head_dim = lin.v_head_dim = c.int_or("linear_head_dim", 128, 1, kMaxDim);
    lin.gate_rank = lin.k_head_dim;
    lin.conv = c.int_or("linear_conv_kernel_dim", 4, 1, kMaxDim);
    const std::vector<char> full = read_full_attention_layers(c, layers);
    for (int64_t i = 0; i < layers; ++i) {
      kda[static_cast<size_t>(i)] =
          full.empty() ? !(i > 0 && i % 4 == 0) : full[static_cast<size_t>(i)] == 0;
    }
  }
  if (c.has("linear_attn_config")) {  // layer_types, when also given, must agree
    const std::vector<char> full = read_full_attention_layers(c, layers);
    for (size_t i = 0; i < full.size(); ++i) {
      if ((full[i] == 0) != (kda[i] != 0))
        c.fail(fmt::format("layer_types[{}]", i),
               fmt::format("is \"{}\" but \"linear_attn_config\" makes layer {} (counted from "
                           "1) {}",
                           full[i] != 0 ? "full_attention" : "linear_attention", i + 1,
                           kda[i] != 0 ? "KDA" : "MLA"));
    }
  }
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  moe.experts = c.req_int("num_experts", 1, kMaxDim);
  moe.top_k = c.req_int("num_experts_per_token", 1, kMaxDim);
  check_topk(c, "num_experts_per_token", moe.top_k, "num_experts", moe.experts);
  moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
  moe.shared_ffn = checked_mul(c.int_or("num_shared_experts", 0, 0, kMaxDim), moe.ffn,
                               "model config: num_shared_experts * moe_intermediate_size");
  moe.router_bias = true;  // e_score_correction_bias
  for (const char* k : {"num_expert_group", "topk_group", "use_grouped_topk", "moe_renormalize",
                        "moe_router_activation_func", "routed_scaling_factor"}) {
    (void)c.has(k);
  }
  const MlpSpec dense = dense_mlp(c);
  // transformers 5: mlp_layer_types ("dense", "sparse") rules, derived from
  // first_k_dense_replace (default 1, KimiLinearConfig's).
  const std::vector<char> mlp_types = read_mlp_layer_types(c, layers);
  const int64_t first_dense = c.int_or("first_k_dense_replace", 1, 0, kMaxLayers);
  const int64_t freq = c.int_or("moe_layer_freq", 1, 1, kMaxLayers);
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l;
    if (kda[static_cast<size_t>(i)]) {
      l.mixer = MixerKind::kLinearAttention;
      l.linear = lin;
    } else {
      l.attn = mla;
    }
    const bool sparse = mlp_types.empty() ? i >= first_dense && i % freq == 0
                                          : mlp_types[static_cast<size_t>(i)] != 0;
    l.mlp = sparse ? moe : dense;
    m.layers.push_back(l);
  }
  read_mtp(c, m);
  return m;
}

}  // namespace spillway::families

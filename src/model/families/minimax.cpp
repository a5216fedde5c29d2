// MiniMax-Text-01 and MiniMax-M1: lightning attention with a softmax attention layer among
// them, a Mixtral-style MoE in every layer.
#include <fmt/format.h>

#include "model/families/families.hpp"

namespace spillway::families {

// MiniMax (model_type minimax_m1 and minimax_text_01 of the checkpoints' own code, minimax of
// transformers). Which layers are softmax attention: `attn_type_list` (the checkpoints': 0
// lightning, 1 softmax) or `layer_types` (transformers': "linear_attention",
// "full_attention"); transformers' MiniMaxConfig without either alternates, softmax first.
// Lightning attention (num_attention_heads heads of head_dim, no convolution): qkv_proj,
// output_gate, an RMSNorm over all heads and out_proj, no biases; its decay is a fixed
// slope per head (a buffer). The softmax layers are GQA; the rotary part (rotary_dim) and
// the residual scalings (layernorm_*_alpha/beta, postnorm) have no parameters. The MoE:
// num_local_experts of intermediate_size, a router, no shared expert (a non-zero
// shared_intermediate_size is refused: the checkpoints' code and vLLM size it differently).
ModelConfig parse_minimax(const JsonObject& c, ModelConfig m, const std::string& type) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  (void)c.has("rotary_dim");
  if (c.int_or("sliding_window", 0, 0, kMaxDim) != 0)
    c.fail("sliding_window", "is set; spillway plans MiniMax's softmax layers as full attention");
  LinearAttentionSpec lin;
  lin.kind = LinearKind::kLightning;
  lin.k_heads = lin.v_heads = a.heads;
  lin.k_head_dim = lin.v_head_dim = a.qk_head_dim;
  lin.conv = 0;
  lin.chunk = c.int_or("block_size", 256, 1, kMaxDim);
  std::vector<char> softmax(static_cast<size_t>(layers), 0);
  if (c.has("attn_type_list")) {
    const std::vector<int64_t> list = c.int_array_or("attn_type_list", 0, 1);
    if (static_cast<int64_t>(list.size()) != layers) {
      c.fail("attn_type_list",
             fmt::format("has {} entries; must have one per layer ({})", list.size(), layers));
    }
    for (size_t i = 0; i < list.size(); ++i) softmax[i] = list[i] == 1;
  } else if (c.has("layer_types")) {
    softmax = read_full_attention_layers(c, layers);
  } else if (type == "minimax") {
    for (int64_t i = 0; i < layers; ++i) softmax[static_cast<size_t>(i)] = (i + 1) % 2 != 0;
  } else {
    c.fail("attn_type_list",
           "is missing; it says which layers are softmax attention (1) and "
           "which lightning attention (0)");
  }
  for (const char* k :
       {"layernorm_full_attention_alpha", "layernorm_full_attention_beta",
        "layernorm_linear_attention_alpha", "layernorm_linear_attention_beta",
        "layernorm_mlp_alpha", "layernorm_mlp_beta", "full_attn_alpha_factor",
        "full_attn_beta_factor", "linear_attn_alpha_factor", "linear_attn_beta_factor",
        "mlp_alpha_factor", "mlp_beta_factor", "postnorm"}) {
    (void)c.has(k);
  }
  const MlpSpec moe = local_experts_moe(c);
  if (c.int_or("shared_intermediate_size", 0, 0, kMaxDim) != 0) {
    c.fail("shared_intermediate_size",
           "is not 0: MiniMax's shared expert is sized from intermediate_size by the "
           "checkpoints' code and from shared_intermediate_size by vLLM; spillway plans MiniMax "
           "without one");
  }
  (void)c.has("shared_moe_mode");
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l;
    if (softmax[static_cast<size_t>(i)]) {
      l.attn = a;
    } else {
      l.mixer = MixerKind::kLinearAttention;
      l.linear = lin;
    }
    l.mlp = moe;
    m.layers.push_back(l);
  }
  return m;
}

}  // namespace spillway::families

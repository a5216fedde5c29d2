// Jamba: Mamba-1 and attention layers, MoE and dense MLPs, each by a period and offset.
#include <fmt/format.h>

#include "model/families/families.hpp"
#include "spillway/core/units.hpp"

namespace spillway::families {

// Jamba: attention where i % attn_layer_period == attn_layer_offset, else a Mamba-1 mixer
// (with dt, B and C norms); MoE where i % expert_layer_period == expert_layer_offset,
// else a dense SwiGLU MLP. mamba_dt_rank "auto" is ceil(hidden / 16).
ModelConfig parse_jamba(const JsonObject& c, ModelConfig m, const std::string&) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  const AttentionSpec a = read_gqa(c, m.hidden);
  SsmSpec ssm;
  ssm.version = 1;
  ssm.state = c.int_or("mamba_d_state", 16, 1, kMaxDim);
  ssm.conv = c.int_or("mamba_d_conv", 4, 1, kMaxDim);
  ssm.inner = checked_mul(c.int_or("mamba_expand", 2, 1, 1024), m.hidden, "model config: inner");
  ssm.dt_rank = read_dt_rank(c, "mamba_dt_rank", m.hidden);
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

}  // namespace spillway::families

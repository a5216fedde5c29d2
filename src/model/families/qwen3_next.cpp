// Qwen3-Next (and Qwen3.5-MoE's text model): full attention and Gated DeltaNet layers
// over a Qwen2-MoE-style MLP.
#include <fmt/format.h>

#include <set>

#include "model/families/families.hpp"

namespace spillway::families {

// Qwen3-Next: full attention where layer_types says "full_attention" (else every
// full_attention_interval-th layer), Gated DeltaNet elsewhere; the attention is gated (its
// Q projection is twice as wide) with q/k norms; the MLP as Qwen2-MoE's (routed experts, a
// shared expert with its sigmoid gate; decoder_sparse_step, mlp_only_layers).
ModelConfig parse_qwen3_next(const JsonObject& c, ModelConfig m, const std::string&) {
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
  std::vector<char> full = read_full_attention_layers(c, layers);
  if (!full.empty()) {
    (void)c.has("full_attention_interval");
  } else {
    const int64_t interval = c.int_or("full_attention_interval", 4, 1, kMaxLayers);
    full.assign(static_cast<size_t>(layers), 0);
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

}  // namespace spillway::families

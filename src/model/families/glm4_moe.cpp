// GLM-4.5 and GLM-4.6 (glm4_moe).
#include "model/families/families.hpp"
#include "spillway/core/units.hpp"

namespace spillway::families {

// GLM-4.5/4.6 (glm4_moe): GQA with q/k/v biases (attention_bias) and optional per-head
// q/k norms (use_qk_norm), the first first_k_dense_replace layers dense, the others
// n_routed_experts experts plus n_shared_experts shared ones of moe_intermediate_size, a
// sigmoid router with a correction bias (as DeepSeek-V3); MTP layers counted apart.
ModelConfig parse_glm4_moe(const JsonObject& c, ModelConfig m, const std::string&) {
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

}  // namespace spillway::families

// Mixtral: GQA (with a sliding window when given), every layer an MoE.
#include "model/families/families.hpp"

namespace spillway::families {

ModelConfig parse_mixtral(const JsonObject& c, ModelConfig m, const std::string&) {
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

}  // namespace spillway::families

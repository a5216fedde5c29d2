// Mixtral: GQA (with a sliding window when given), every layer an MoE.
#include "model/families/families.hpp"

namespace spillway::families {

ModelConfig parse_mixtral(const JsonObject& c, ModelConfig m, const std::string&) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.sliding_window = read_window(c);
  m.layers.assign(static_cast<size_t>(layers), LayerSpec{a, local_experts_moe(c)});
  return m;
}

}  // namespace spillway::families

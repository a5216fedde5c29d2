// Grok-1 and Grok-2.
#include "model/families/families.hpp"

namespace spillway::families {

// Grok-1 and Grok-2: 8 experts, top-2; Grok-2 adds a dense MLP beside the experts
// ("residual_moe"), sized by intermediate_size, with experts sized by moe_intermediate_size.
ModelConfig parse_grok(const JsonObject& c, ModelConfig m, const std::string&) {
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
  // Grok's sliding_window_size: -1 (or absent) is full attention.
  const int64_t window = c.int_or("sliding_window_size", -1, -1, kMaxDim);
  if (window == 0) c.fail("sliding_window_size", "is 0; must be -1 (full attention) or >= 1");
  if (window > 0) a.sliding_window = window;
  m.layers.assign(static_cast<size_t>(layers), LayerSpec{a, moe});
  return m;
}

}  // namespace spillway::families

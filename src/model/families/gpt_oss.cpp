// GPT-OSS: attention sinks, alternating sliding and full attention, biased experts.
#include <fmt/format.h>

#include "model/families/families.hpp"

namespace spillway::families {

ModelConfig parse_gpt_oss(const JsonObject& c, ModelConfig m, const std::string&) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.qkv_bias = c.bool_or("attention_bias", true);
  a.o_bias = a.qkv_bias;
  a.sinks = true;
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  moe.experts = c.req_int("num_local_experts", 1, kMaxDim);
  const char* top_k_key = alias(c, {"num_experts_per_tok", "experts_per_token"});
  moe.top_k = c.req_int(top_k_key, 1, kMaxDim);
  check_topk(c, top_k_key, moe.top_k, "num_local_experts", moe.experts);
  moe.ffn = c.req_int("intermediate_size", 1, kMaxDim);
  moe.bias = true;
  moe.router_bias = true;
  const int64_t window = c.int_or("sliding_window", 0, 0, kMaxDim);
  std::vector<std::string> types = c.str_array_or("layer_types");
  if (!types.empty() && static_cast<int64_t>(types.size()) != layers) {
    c.fail("layer_types",
           fmt::format("has {} entries; must have one per layer ({})", types.size(), layers));
  }
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l{a, moe};
    // Without layer_types, GPT-OSS alternates sliding (even) and full (odd) attention.
    const std::string kind = types.empty() ? (i % 2 == 0 ? "sliding_attention" : "full_attention")
                                           : types[static_cast<size_t>(i)];
    if (kind == "sliding_attention") {
      l.attn.sliding_window = window;
    } else if (kind != "full_attention") {
      c.fail(fmt::format("layer_types[{}]", i),
             fmt::format("is \"{}\"; must be \"sliding_attention\" or \"full_attention\"", kind));
    }
    m.layers.push_back(l);
  }
  return m;
}

}  // namespace spillway::families

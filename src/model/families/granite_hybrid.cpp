// Granite 4.0-H (granitemoehybrid): Mamba-2 and attention layers by layer_types.
#include <fmt/format.h>

#include <algorithm>

#include "model/families/families.hpp"

namespace spillway::families {

// Granite 4.0-H (granitemoehybrid): layer_types ("mamba" or "attention"; transformers 5
// spells them "linear_attention" and "full_attention") pick the mixer;
// every layer has an MLP: routed experts (num_local_experts, if any) plus a shared SwiGLU
// MLP of shared_intermediate_size.
ModelConfig parse_granite_hybrid(const JsonObject& c, ModelConfig m, const std::string&) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  const std::vector<std::string> types = c.str_array_or("layer_types");
  if (static_cast<int64_t>(types.size()) != layers) {
    c.fail("layer_types",
           fmt::format("has {} entries; must have one per layer ({})", types.size(), layers));
  }
  auto is_mamba = [](const std::string& t) { return t == "mamba" || t == "linear_attention"; };
  const bool any_mamba = std::any_of(types.begin(), types.end(), is_mamba);
  SsmSpec ssm;
  if (any_mamba) ssm = read_mamba2(c, m.hidden);
  MlpSpec mlp;
  const int64_t experts = c.int_or(alias(c, {"num_local_experts", "num_experts"}), 0, 0, kMaxDim);
  const int64_t shared = c.int_or("shared_intermediate_size", 0, 0, kMaxDim);
  if (experts > 0) {
    mlp.kind = MlpKind::kMoe;
    mlp.experts = experts;
    mlp.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
    check_topk(c, "num_experts_per_tok", mlp.top_k, "num_local_experts", experts);
    mlp.ffn = c.req_int("intermediate_size", 1, kMaxDim);
    mlp.shared_ffn = shared;
  } else {
    mlp.kind = MlpKind::kDense;
    mlp.ffn = shared > 0 ? shared : c.req_int("intermediate_size", 1, kMaxDim);
    (void)c.has("intermediate_size");
    (void)c.has("num_experts_per_tok");
  }
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l;
    const std::string& t = types[static_cast<size_t>(i)];
    if (is_mamba(t)) {
      l.mixer = MixerKind::kMamba;
      l.ssm = ssm;
    } else if (t == "attention" || t == "full_attention") {
      l.attn = a;
    } else {
      c.fail(fmt::format("layer_types[{}]", i),
             fmt::format("is \"{}\"; must be \"linear_attention\" (\"mamba\") or "
                         "\"full_attention\" (\"attention\")",
                         t));
    }
    l.mlp = mlp;
    m.layers.push_back(l);
  }
  return m;
}

}  // namespace spillway::families

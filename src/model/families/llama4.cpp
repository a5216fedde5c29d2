// Llama 4 (text): interleaved MoE and dense layers.
#include <fmt/format.h>

#include <algorithm>

#include "model/families/families.hpp"

namespace spillway::families {

// Llama 4 (text): GQA, MoE layers every interleave_moe_layer_step-th layer (or the list
// moe_layers) with num_local_experts experts of intermediate_size, top-k routing and one
// shared expert of the same width; the other layers a dense MLP of intermediate_size_mlp.
// Its q/k norm is an L2 norm without weights, and chunked attention (attention_chunk_size
// on the RoPE layers) is planned as full causal attention (an upper bound on its FLOPs).
ModelConfig parse_llama4(const JsonObject& c, ModelConfig m, const std::string&) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  (void)c.has("attention_chunk_size");
  // RoPE or not, chunked or full attention: the same weights. transformers 5 writes
  // layer_types ("chunked_attention" on the RoPE layers, "full_attention" on the others) and
  // no_rope_layer_interval, from which it derives no_rope_layers.
  (void)c.has("no_rope_layers");
  (void)c.int_or("no_rope_layer_interval", 4, 1, kMaxLayers);
  const std::vector<std::string> kinds = c.str_array_or("layer_types");
  if (!kinds.empty() && static_cast<int64_t>(kinds.size()) != layers)
    c.fail("layer_types",
           fmt::format("has {} entries; must have one per layer ({})", kinds.size(), layers));
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] != "chunked_attention" && kinds[i] != "full_attention")
      c.fail(
          fmt::format("layer_types[{}]", i),
          fmt::format("is \"{}\"; must be \"chunked_attention\" or \"full_attention\"", kinds[i]));
  }
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  const char* experts_key = alias(c, {"num_local_experts", "num_experts"});
  moe.experts = c.req_int(experts_key, 1, kMaxDim);
  moe.top_k = c.int_or("num_experts_per_tok", 1, 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, experts_key, moe.experts);
  moe.ffn = c.req_int("intermediate_size", 1, kMaxDim);
  moe.shared_ffn = moe.ffn;
  std::vector<char> sparse(static_cast<size_t>(layers), 0);
  if (c.has("moe_layers")) {
    for (int64_t i : c.int_array_or("moe_layers", 0, layers - 1))
      sparse[static_cast<size_t>(i)] = 1;
    (void)c.has("interleave_moe_layer_step");
  } else {
    const int64_t step = c.int_or("interleave_moe_layer_step", 1, 1, kMaxLayers);
    for (int64_t i = 0; i < layers; ++i) sparse[static_cast<size_t>(i)] = (i + 1) % step == 0;
  }
  const bool any_dense = std::find(sparse.begin(), sparse.end(), 0) != sparse.end();
  MlpSpec dense;
  if (any_dense) dense = dense_mlp(c, "intermediate_size_mlp");
  (void)c.has("intermediate_size_mlp");
  for (int64_t i = 0; i < layers; ++i)
    m.layers.push_back(LayerSpec{a, sparse[static_cast<size_t>(i)] ? moe : dense});
  return m;
}

}  // namespace spillway::families

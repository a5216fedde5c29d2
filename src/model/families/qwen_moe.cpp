// Qwen2-MoE and Qwen3-MoE.
#include <set>

#include "model/families/families.hpp"

namespace spillway::families {

// Qwen2-MoE and Qwen3-MoE: decoder_sparse_step and mlp_only_layers pick the MoE layers.
ModelConfig parse_qwen_moe(const JsonObject& c, ModelConfig m, const std::string& type) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.qkv_bias = (type == "qwen2_moe") ? true : c.bool_or("attention_bias", false);
  a.o_bias = false;
  a.qk_norm = (type == "qwen3_moe");
  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  // transformers 5 spells the expert count num_local_experts.
  const char* experts_key = alias(c, {"num_experts", "num_local_experts"});
  moe.experts = c.req_int(experts_key, 1, kMaxDim);
  moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
  check_topk(c, "num_experts_per_tok", moe.top_k, experts_key, moe.experts);
  moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
  // Qwen's sliding-window keys, read as in parse_llama_like (MoE releases have it off).
  if (c.bool_or("use_sliding_window", false)) {
    a.sliding_window = read_window(c);
    if (c.int_or("max_window_layers", 0, 0, kMaxLayers) > 0) {
      c.fail("use_sliding_window",
             "is true with \"max_window_layers\" > 0 on an MoE model; spillway reads sliding "
             "windows on every layer or none here");
    }
  } else {
    // Unused: any window, 0 included (transformers 5's Qwen2MoeConfig writes 0 then).
    (void)c.has("sliding_window");
    (void)c.has("max_window_layers");
  }
  if (type == "qwen2_moe") {
    moe.shared_ffn = c.int_or("shared_expert_intermediate_size", 0, 0, kMaxDim);
    moe.shared_gate = moe.shared_ffn > 0;
  }
  const int64_t step = c.int_or("decoder_sparse_step", 1, 1, kMaxLayers);
  const std::vector<int64_t> dense_only = c.int_array_or("mlp_only_layers", 0, layers - 1);
  const std::set<int64_t> dense_set(dense_only.begin(), dense_only.end());
  const bool any_dense = !dense_set.empty() || step > 1;  // only then is intermediate_size needed
  MlpSpec dense;
  if (any_dense) dense = dense_mlp(c);
  (void)c.has("intermediate_size");  // the dense layers' width: unused when there are none
  // transformers 5 writes layer_types (sliding where the window applies): when given, it
  // says which layers slide.
  const std::vector<char> sliding = read_layer_types(c, layers, a.sliding_window);
  for (int64_t i = 0; i < layers; ++i) {
    const bool sparse = !dense_set.count(i) && (i + 1) % step == 0;
    LayerSpec l{a, sparse ? moe : dense};
    if (!sliding.empty() && !sliding[static_cast<size_t>(i)]) l.attn.sliding_window = 0;
    m.layers.push_back(l);
  }
  return m;
}

}  // namespace spillway::families

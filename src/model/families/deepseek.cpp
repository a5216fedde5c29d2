// DeepSeek V1 (DeepSeekMoE), V2, V3, V3.2 and Kimi-K2: multi-head latent attention (V2 on),
// dense first layers, routed and shared experts, multi-token-prediction layers counted apart.
#include <fmt/format.h>

#include "model/families/families.hpp"
#include "spillway/core/units.hpp"

namespace spillway::families {

ModelConfig parse_deepseek(const JsonObject& c, ModelConfig m, const std::string& model_type) {
  // Kimi-K2 is DeepSeek-V3's architecture.
  const std::string type = model_type == "kimi_k2" ? "deepseek_v3" : model_type;
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a;
  if (type == "deepseek") {
    // DeepSeek V1 (DeepSeekMoE): standard multi-head attention, no MLA.
    a = read_gqa(c, m.hidden);
  } else {
    a = read_mla(c);
  }
  if (type == "deepseek_v32") {
    a.indexer_heads = c.req_int("index_n_heads", 1, kMaxDim);
    a.indexer_head_dim = c.req_int("index_head_dim", 1, kMaxDim);
    if (a.q_lora_rank == 0)
      c.fail("q_lora_rank", "is 0; DeepSeek-V3.2's indexer projects from the query's LoRA rank");
  }

  MlpSpec moe;
  moe.kind = MlpKind::kMoe;
  // transformers 5 and some copies spell these num_routed_experts / num_shared_experts.
  const char* routed = alias(c, {"n_routed_experts", "num_routed_experts"});
  const char* shared = alias(c, {"n_shared_experts", "num_shared_experts"});
  if (type == "deepseek_v2") {
    moe.experts = c.int_or(routed, 0, 0, kMaxDim);  // transformers: None -> a dense model
  } else {
    // transformers' DeepseekV3Config would default a missing count to 256 experts; a
    // copy that drops it is more likely damaged than relying on that: name it.
    moe.experts = c.req_int(routed, 1, kMaxDim);
  }
  MlpSpec dense = dense_mlp(c);
  const int64_t first_dense = c.int_or("first_k_dense_replace", 0, 0, kMaxLayers);
  const int64_t freq = c.int_or("moe_layer_freq", 1, 1, kMaxLayers);
  if (moe.experts > 0) {
    moe.top_k = c.req_int("num_experts_per_tok", 1, kMaxDim);
    check_topk(c, "num_experts_per_tok", moe.top_k, routed, moe.experts);
    moe.ffn = c.req_int("moe_intermediate_size", 1, kMaxDim);
    moe.shared_ffn = checked_mul(c.int_or(shared, 0, 0, kMaxDim), moe.ffn,
                                 "model config: n_shared_experts * moe_intermediate_size");
    // e_score_correction_bias (V3 routing: sigmoid scores with a bias)
    moe.router_bias = type != "deepseek" && type != "deepseek_v2";
  }
  const std::vector<char> mlp_types = read_mlp_layer_types(c, layers);
  // transformers 5's layer_types: every V3.2 layer "indexed_attention" (the sparse attention's
  // indexer); the attention's weights are those above whatever the name.
  const std::vector<std::string> kinds = c.str_array_or("layer_types");
  if (!kinds.empty() && static_cast<int64_t>(kinds.size()) != layers)
    c.fail("layer_types",
           fmt::format("has {} entries; must have one per layer ({})", kinds.size(), layers));
  const char* kind = type == "deepseek_v32" ? "indexed_attention" : "full_attention";
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] != kind)
      c.fail(fmt::format("layer_types[{}]", i),
             fmt::format("is \"{}\"; every layer of \"{}\" is \"{}\"", kinds[i], type, kind));
  }
  for (int64_t i = 0; i < layers; ++i) {
    const bool sparse =
        moe.experts > 0 && (mlp_types.empty() ? i >= first_dense && i % freq == 0
                                              : mlp_types[static_cast<size_t>(i)] != 0);
    m.layers.push_back(LayerSpec{a, sparse ? moe : dense});
  }
  read_mtp(c, m);
  return m;
}

}  // namespace spillway::families

// The Llama-like dense families: llama, mistral, qwen2, qwen3 and phi3 (GQA, a SwiGLU MLP,
// sliding windows as each spells them).
#include "model/families/families.hpp"

namespace spillway::families {

ModelConfig parse_llama_like(const JsonObject& c, ModelConfig m, const std::string& type) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  MlpSpec mlp = dense_mlp(c);
  mlp.bias = c.bool_or("mlp_bias", false);
  int64_t window = 0;
  int64_t window_from = 0;
  if (type == "qwen2" || type == "qwen3") {
    // Qwen2: biases on q, k and v; Qwen3: on all four with attention_bias.
    a.qkv_bias = (type == "qwen2") ? true : c.bool_or("attention_bias", false);
    a.o_bias = type == "qwen3" && a.qkv_bias;
    a.qk_norm = (type == "qwen3");
    // Qwen's sliding window applies only with use_sliding_window, from layer
    // max_window_layers on; both are read (and ignored) otherwise.
    const bool use = c.bool_or("use_sliding_window", false);
    const int64_t w = read_window(c);
    const int64_t from = c.int_or("max_window_layers", 0, 0, kMaxLayers);
    if (use) {
      window = w;
      window_from = from;
    }
  } else if (type == "mistral" || type == "phi3") {
    window = read_window(c);
  }
  const std::vector<char> sliding =
      read_layer_types(c, layers, window > 0 ? window : read_window(c));
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l{a, mlp};
    if (!sliding.empty()) {
      if (sliding[static_cast<size_t>(i)]) l.attn.sliding_window = read_window(c);
    } else if (window > 0 && i >= window_from) {
      l.attn.sliding_window = window;
    }
    m.layers.push_back(l);
  }
  return m;
}

}  // namespace spillway::families

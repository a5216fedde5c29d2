// The Gemma families: Gemma 2 and Gemma 3 (text), and RecurrentGemma (Griffin).
#include <fmt/format.h>

#include "model/families/families.hpp"

namespace spillway::families {

// Gemma 2 and Gemma 3 (text): GQA with a given head_dim, four RMSNorms a layer (the
// sandwich: pre- and post-feedforward besides the usual two), GeGLU MLP (three matrices,
// as SwiGLU), tied embeddings by default. Sliding windows: layer_types when given; else
// Gemma 2 slides on even layers, Gemma 3 on all but every sliding_window_pattern-th
// (default 6). Gemma 3 adds per-head q/k norms.
ModelConfig parse_gemma(const JsonObject& c, ModelConfig m, const std::string& type) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.qk_norm = type != "gemma2";
  const MlpSpec mlp = dense_mlp(c);
  // Early Gemma 2 configs also spell the window sliding_window_size.
  const char* window_key = alias(c, {"sliding_window", "sliding_window_size"});
  const int64_t window = c.has(window_key) ? c.req_int(window_key, 1, kMaxDim) : 0;
  std::vector<char> sliding = read_layer_types(c, layers, window);
  if (sliding.empty() && window > 0) {
    sliding.assign(static_cast<size_t>(layers), 0);
    const int64_t pattern =
        type == "gemma2" ? 2 : c.int_or("sliding_window_pattern", 6, 1, kMaxLayers);
    for (int64_t i = 0; i < layers; ++i) {
      sliding[static_cast<size_t>(i)] = type == "gemma2" ? (i % 2 == 0) : ((i + 1) % pattern != 0);
    }
  } else {
    (void)c.has("sliding_window_pattern");   // layer_types decides
    (void)c.has("_sliding_window_pattern");  // (transformers 5 saves the pattern so)
  }
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec l{a, mlp};
    l.extra_norms = 2;
    if (!sliding.empty() && sliding[static_cast<size_t>(i)]) l.attn.sliding_window = window;
    m.layers.push_back(l);
  }
  return m;
}

// RecurrentGemma (Griffin): block_types cycles over the layers (transformers' default
// recurrent, recurrent, attention); attention is local (attention_window_size) MQA with a
// bias on its output projection; the MLP is a gated GeLU of intermediate_size / 2 with
// biases; embeddings tied.
ModelConfig parse_recurrent_gemma(const JsonObject& c, ModelConfig m, const std::string&) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  AttentionSpec a = read_gqa(c, m.hidden);
  a.qkv_bias = false;
  a.o_bias = true;
  (void)c.has("attention_bias");
  a.sliding_window = c.int_or("attention_window_size", 2048, 1, kMaxDim);
  RecurrentSpec r;
  r.width = c.int_or("lru_width", m.hidden, 1, kMaxDim);
  r.heads = a.heads;
  r.conv = c.int_or("conv1d_width", 4, 1, kMaxDim);
  if (r.width % r.heads != 0) {
    c.fail("lru_width", fmt::format("is {}; must be a multiple of \"num_attention_heads\" ({})",
                                    r.width, r.heads));
  }
  MlpSpec mlp;
  const int64_t inter = c.req_int("intermediate_size", 2, kMaxDim);
  mlp.ffn = inter / 2;
  mlp.bias = true;
  // Transformers saves the pattern as _block_types (a property over it).
  std::vector<std::string> types = c.str_array_or(alias(c, {"block_types", "_block_types"}));
  if (types.empty()) types = {"recurrent", "recurrent", "attention"};
  for (int64_t i = 0; i < layers; ++i) {
    const std::string& t = types[static_cast<size_t>(i) % types.size()];
    LayerSpec l;
    if (t == "recurrent") {
      l.mixer = MixerKind::kRecurrent;
      l.recurrent = r;
    } else if (t == "attention") {
      l.attn = a;
    } else {
      c.fail(fmt::format("block_types[{}]", static_cast<size_t>(i) % types.size()),
             fmt::format("is \"{}\"; must be \"recurrent\" or \"attention\"", t));
    }
    l.mlp = mlp;
    m.layers.push_back(l);
  }
  return m;
}

}  // namespace spillway::families

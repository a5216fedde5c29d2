// Zamba2: a Mamba-2 backbone with shared transformer blocks run before some of its layers.
#include <fmt/format.h>

#include "model/families/families.hpp"
#include "spillway/core/units.hpp"

namespace spillway::families {

// Zamba2 (transformers' Zamba2Model; the keys of transformers >= 4.48 and those of Zyphra's
// first release, aliased): every layer has its own Mamba-2 mixer (inner mamba_expand x
// hidden, a conv bias and the gated norm always, in/out_proj biases with add_bias_linear);
// the layers layers_block_type calls "hybrid" first run shared transformer block j mod
// num_mem_blocks (j counting the hybrid layers): attention over [hidden, input embedding]
// (2 x hidden wide, heads of 2 x hidden / num_attention_heads, no biases) and a gated MLP of
// intermediate_size, then the layer's own hidden x hidden projection. Each hybrid layer owns
// a rank-adapter_rank adapter of the MLP's gate/up projection (transformers builds it
// whatever use_shared_mlp_adapter says) and, with use_shared_attention_adapter, three of the
// attention's q, k, v. The head is tied unless the config says otherwise.
ModelConfig parse_zamba2(const JsonObject& c, ModelConfig m, const std::string&) {
  const int64_t d = m.hidden;
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  const std::vector<std::string> types = c.str_array_or("layers_block_type");
  if (static_cast<int64_t>(types.size()) != layers) {
    c.fail("layers_block_type",
           fmt::format("has {} entries; must have one per layer ({})", types.size(), layers));
  }
  std::vector<int64_t> hybrid;
  for (size_t i = 0; i < types.size(); ++i) {
    // transformers 5 spells the Mamba-2 layer "linear_attention".
    if (types[i] != "mamba" && types[i] != "linear_attention" && types[i] != "hybrid") {
      c.fail(fmt::format("layers_block_type[{}]", i),
             fmt::format("is \"{}\"; must be \"linear_attention\" (\"mamba\") or \"hybrid\"",
                         types[i]));
    }
    if (types[i] == "hybrid") hybrid.push_back(static_cast<int64_t>(i));
  }
  if (c.has("hybrid_layer_ids") && c.int_array_or("hybrid_layer_ids", 0, layers - 1) != hybrid)
    c.fail("hybrid_layer_ids", "disagrees with the \"hybrid\" entries of layers_block_type");
  const int64_t blocks = c.int_or("num_mem_blocks", 1, 1, kMaxLayers);
  const bool bias = c.bool_or("add_bias_linear", false);

  // The Mamba-2 mixer of every layer.
  SsmSpec s;
  s.version = 2;
  s.state = c.int_or(alias(c, {"mamba_d_state", "state_size"}), 64, 1, kMaxDim);
  s.conv = c.int_or(alias(c, {"mamba_d_conv", "conv_dimension"}), 4, 1, kMaxDim);
  s.groups = c.int_or("mamba_ngroups", 1, 1, kMaxDim);
  s.chunk = c.int_or("chunk_size", 256, 1, kMaxDim);
  s.inner = checked_mul(c.int_or(alias(c, {"mamba_expand", "expansion_factor"}), 2, 1, 1024), d,
                        "model config: mamba_expand x hidden_size");
  if (c.has("n_mamba_heads")) {  // transformers derives the head dim from it
    s.heads = c.req_int("n_mamba_heads", 1, kMaxDim);
    if (s.inner % s.heads != 0)
      c.fail("n_mamba_heads",
             fmt::format("is {}; must divide the Mamba inner width ({})", s.heads, s.inner));
    s.head_dim = s.inner / s.heads;
    (void)c.has("mamba_headdim");
  } else {  // the first release gives the head dim
    s.head_dim = c.req_int("mamba_headdim", 1, kMaxDim);
    if (s.inner % s.head_dim != 0)
      c.fail("mamba_headdim",
             fmt::format("is {}; must divide the Mamba inner width ({})", s.head_dim, s.inner));
    s.heads = s.inner / s.head_dim;
  }
  if (s.heads % s.groups != 0)
    c.fail("mamba_ngroups",
           fmt::format("is {}; must divide the Mamba heads ({})", s.groups, s.heads));
  s.conv_bias = true;
  s.gated_norm = true;
  s.proj_bias = bias;
  (void)c.has("use_conv_bias");

  // The shared transformer blocks.
  AttentionSpec a;
  a.heads = c.req_int("num_attention_heads", 1, kMaxDim);
  a.kv_heads = c.int_or("num_key_value_heads", a.heads, 1, kMaxDim);
  if (a.heads % a.kv_heads != 0) {
    c.fail("num_key_value_heads",
           fmt::format("is {}; must divide \"num_attention_heads\" ({})", a.kv_heads, a.heads));
  }
  a.input_width = 2 * d;
  if ((2 * d) % a.heads != 0) {
    c.fail("num_attention_heads",
           fmt::format("is {}; must divide the shared attention's width 2 x hidden_size ({})",
                       a.heads, 2 * d));
  }
  a.qk_head_dim = a.v_head_dim = 2 * d / a.heads;
  for (const char* k : {"attention_hidden_size", "attention_head_dim"}) {
    const int64_t want = std::string_view(k) == "attention_hidden_size" ? 2 * d : a.qk_head_dim;
    if (c.has(k) && c.req_int(k, 1, kMaxDim) != want)
      c.fail(k, fmt::format("is {}; transformers derives {} from hidden_size and the heads",
                            c.req_int(k, 1, kMaxDim), want));
  }
  (void)c.has("kv_channels");       // hidden / heads, derived and unused
  (void)c.has("num_query_groups");  // = num_attention_heads, derived
  const char* ffn_key = alias(c, {"intermediate_size", "ffn_hidden_size"});
  MlpSpec mlp;
  mlp.ffn = c.has(ffn_key) ? c.req_int(ffn_key, 1, kMaxDim)
                           : checked_mul(4, d, "model config: 4 x hidden_size");
  mlp.bias = bias;
  const int64_t rank = c.int_or(alias(c, {"adapter_rank", "lora_rank"}), 128, 1, kMaxDim);
  const bool attn_adapters =
      c.bool_or(alias(c, {"use_shared_attention_adapter", "use_shared_attention_lora"}), false);
  (void)c.has(alias(c, {"use_shared_mlp_adapter", "use_shared_block_lora"}));
  (void)c.has("ft_lora");
  // The hybrid layer's own weights: its projection, the MLP adapter (hidden -> rank -> the
  // gate and up widths), the q, k, v adapters (2 hidden -> rank -> 2 hidden each).
  int64_t own = checked_mul(d, d, "model config: the hybrid projection");
  own = checked_add(own, checked_mul(rank, d + 2 * mlp.ffn, "model config: MLP adapter"),
                    "model config: adapters");
  if (attn_adapters) {
    own = checked_add(own, checked_mul(12 * rank, d, "model config: attention adapters"),
                      "model config: adapters");
  }
  LayerSpec plain;
  plain.mixer = MixerKind::kMamba;
  plain.ssm = s;
  plain.mlp.kind = MlpKind::kNone;
  for (int64_t i = 0; i < layers; ++i) m.layers.push_back(plain);
  for (size_t j = 0; j < hybrid.size(); ++j) {
    LayerSpec& l = m.layers[static_cast<size_t>(hybrid[j])];
    l.shared_block = static_cast<int>(static_cast<int64_t>(j) % blocks);
    l.attn = a;
    l.mlp = mlp;
    l.extra_params = own;
  }
  return m;
}

}  // namespace spillway::families

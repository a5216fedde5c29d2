// Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, then a SwiGLU MLP.
#include <fmt/format.h>

#include "model/families/families.hpp"
#include "spillway/core/units.hpp"

namespace spillway::families {

// Falcon-H1 (transformers' FalconH1DecoderLayer): one input norm feeds the attention and the
// Mamba-2 mixer, whose outputs are summed into the residual; a pre-FFN norm and the MLP
// follow. The attention's head_dim is the config's (not hidden / heads); the mixer's inner
// width is mamba_d_ssm, or mamba_expand x hidden when that is null, and must be
// mamba_n_heads x mamba_d_head; its in_proj bias is mamba_proj_bias, its out_proj bias
// projectors_bias; the gated norm exists only with mamba_rms_norm. The muP multipliers
// (embedding, attention, key, ssm, mlp, lm_head) are scalars, not parameters.
ModelConfig parse_falcon_h1(const JsonObject& c, ModelConfig m, const std::string&) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  LayerSpec l;
  l.attn = read_gqa(c, m.hidden);
  l.parallel_ssm = true;
  SsmSpec& s = l.ssm;
  s.version = 2;
  s.state = c.req_int("mamba_d_state", 1, kMaxDim);
  s.heads = c.req_int("mamba_n_heads", 1, kMaxDim);
  s.head_dim = c.req_int("mamba_d_head", 1, kMaxDim);
  s.groups = c.int_or("mamba_n_groups", 1, 1, kMaxDim);
  s.conv = c.int_or("mamba_d_conv", 4, 1, kMaxDim);
  s.chunk = c.int_or("mamba_chunk_size", 256, 1, kMaxDim);
  s.conv_bias = c.bool_or("mamba_conv_bias", true);
  s.gated_norm = c.bool_or("mamba_rms_norm", false);
  (void)c.has("mamba_norm_before_gate");
  s.inner = checked_mul(s.heads, s.head_dim, "model config: mamba_n_heads * mamba_d_head");
  const char* inner_key = c.has("mamba_d_ssm") ? "mamba_d_ssm" : "mamba_expand";
  const int64_t inner = c.has("mamba_d_ssm") ? c.req_int("mamba_d_ssm", 1, kMaxDim)
                                             : checked_mul(c.int_or("mamba_expand", 2, 1, 1024),
                                                           m.hidden, "model config: inner");
  if (inner != s.inner) {
    c.fail(inner_key, fmt::format("gives the Mamba inner width {}; it must be mamba_n_heads x "
                                  "mamba_d_head ({} x {} = {})",
                                  inner, s.heads, s.head_dim, s.inner));
  }
  (void)c.has("mamba_expand");
  if (s.heads % s.groups != 0) {
    c.fail("mamba_n_groups",
           fmt::format("is {}; must divide mamba_n_heads ({})", s.groups, s.heads));
  }
  s.proj_bias = c.bool_or("mamba_proj_bias", false);
  if (c.bool_or("projectors_bias", false) != s.proj_bias) {
    c.fail("projectors_bias",
           fmt::format("is {} but mamba_proj_bias is {}: spillway counts one bias setting for "
                       "the mixer's in_proj and out_proj",
                       !s.proj_bias, s.proj_bias));
  }
  // transformers' modeling code reads neither (the MLP inside the mixer is not built).
  (void)c.has("mamba_use_mlp");
  (void)c.has("mlp_expansion_factor");
  l.mlp = dense_mlp(c);
  l.mlp.bias = c.bool_or("mlp_bias", false);
  m.layers.assign(static_cast<size_t>(layers), l);
  return m;
}

}  // namespace spillway::families

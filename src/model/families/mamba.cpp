// The pure Mamba-2 models: transformers' Mamba2 and the mamba_ssm package's own format.
#include <fmt/format.h>

#include "model/families/families.hpp"
#include "spillway/core/units.hpp"

namespace spillway::families {

// Mamba2 (transformers' Mamba2ForCausalLM): every layer a norm and a Mamba-2 mixer.
ModelConfig parse_mamba2(const JsonObject& c, ModelConfig m, const std::string&) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  LayerSpec l;
  l.mixer = MixerKind::kMamba;
  l.ssm = read_mamba2(c, m.hidden);
  l.ssm.gated_norm = c.bool_or("rms_norm", true);
  // Mamba-1's dt rank: transformers 5 writes it resolved (ceil(hidden / 16)); its Mamba2
  // mixer keeps it but no weight has that width (dt is one value a head, from in_proj).
  (void)read_dt_rank(c, "time_step_rank", m.hidden);
  l.mlp.kind = MlpKind::kNone;
  m.layers.assign(static_cast<size_t>(layers), l);
  return m;
}

// Mamba-1 (transformers' Mamba and FalconMamba): every layer a norm and a Mamba-1 mixer
// (in_proj to x and z, a causal conv, x_proj to dt, B and C, dt_proj, the selective scan,
// out_proj), no MLP. The inner width is intermediate_size (FalconMamba's config also says
// "expand": 16, which transformers does not read: its intermediate_size is the width);
// time_step_rank "auto" is ceil(hidden / 16). FalconMamba normalises dt, B and C by RMS
// without weights (mixer_rms_eps): no parameters, a negligible op, not counted.
ModelConfig parse_mamba1(const JsonObject& c, ModelConfig m, const std::string& type) {
  const int64_t layers = c.req_int("num_hidden_layers", 1, kMaxLayers);
  (void)c.has("n_layer");  // the mamba_ssm name of the same count, when both are written
  if (c.has("n_layer") && c.req_int("n_layer", 1, kMaxLayers) != layers)
    c.fail("n_layer", fmt::format("is {}; num_hidden_layers is {}",
                                  c.req_int("n_layer", 1, kMaxLayers), layers));
  LayerSpec l;
  l.mixer = MixerKind::kMamba;
  l.mlp.kind = MlpKind::kNone;
  SsmSpec& ssm = l.ssm;
  ssm.version = 1;
  ssm.state = c.int_or("state_size", 16, 1, kMaxDim);
  ssm.conv = c.int_or("conv_kernel", 4, 1, kMaxDim);
  const int64_t expand = c.int_or("expand", 2, 1, 1024);
  ssm.inner = c.has("intermediate_size")
                  ? c.req_int("intermediate_size", 1, kMaxDim)
                  : checked_mul(expand, m.hidden, "model config: expand x hidden_size");
  ssm.dt_rank = read_dt_rank(c, "time_step_rank", m.hidden);
  ssm.conv_bias = c.bool_or("use_conv_bias", true);
  ssm.proj_bias = c.bool_or("use_bias", false);
  ssm.bcdt_norms = false;  // FalconMamba's are weightless
  ssm.gated_norm = false;
  (void)c.has("mixer_rms_eps");
  // The vocabulary as the embedding holds it: mamba_ssm pads it to a multiple.
  const int64_t pad = c.int_or("pad_vocab_size_multiple", 1, 1, kMaxDim);
  m.vocab = (m.vocab + pad - 1) / pad * pad;
  m.layers.assign(static_cast<size_t>(layers), l);
  (void)type;
  return m;
}

// The mamba_ssm package's own config.json (state-spaces/mamba2-*: no model_type): d_model,
// n_layer, the vocabulary padded to pad_vocab_size_multiple, ssm_cfg with the Mamba2
// module's arguments (its defaults: d_state 128, d_conv 4, expand 2, headdim 64, ngroups 1,
// chunk_size 256, conv bias, no projection bias, the gated norm), d_intermediate 0 (no MLP).
// Attention layers (attn_layer_idx) and MLPs are refused, not ignored.
ModelConfig parse_mamba_ssm(const JsonObject& c, ModelConfig m) {
  m.model_type = "mamba_ssm";
  m.hidden = c.req_int("d_model", 1, kMaxDim);
  const int64_t vocab = c.req_int("vocab_size", 1, kMaxDim);
  const int64_t pad = c.int_or("pad_vocab_size_multiple", 1, 1, kMaxDim);
  m.vocab = (vocab + pad - 1) / pad * pad;
  m.tied_embeddings = c.bool_or("tie_embeddings", true);
  const int64_t layers = c.req_int("n_layer", 1, kMaxLayers);
  if (c.int_or("d_intermediate", 0, 0, kMaxDim) != 0)
    c.fail("d_intermediate", "is not 0: spillway plans mamba_ssm configs without MLPs");
  if (!c.int_array_or("attn_layer_idx", 0, layers - 1).empty())
    c.fail("attn_layer_idx", "is not empty: spillway plans mamba_ssm configs without attention");
  (void)c.has("attn_cfg");
  const JsonObject s = c.has("ssm_cfg") ? c.req_obj("ssm_cfg") : c;
  if (s.str_or("layer", "Mamba1") != "Mamba2")
    c.fail("ssm_cfg", "has no \"layer\": \"Mamba2\"; spillway plans Mamba-2 mamba_ssm models");
  LayerSpec l;
  l.mixer = MixerKind::kMamba;
  l.mlp.kind = MlpKind::kNone;
  SsmSpec& ssm = l.ssm;
  ssm.version = 2;
  ssm.state = s.int_or("d_state", 128, 1, kMaxDim);
  ssm.conv = s.int_or("d_conv", 4, 1, kMaxDim);
  ssm.head_dim = s.int_or("headdim", 64, 1, kMaxDim);
  ssm.groups = s.int_or("ngroups", 1, 1, kMaxDim);
  ssm.chunk = s.int_or("chunk_size", 256, 1, kMaxDim);
  ssm.inner = checked_mul(s.int_or("expand", 2, 1, 1024), m.hidden, "model config: inner");
  if (ssm.inner % ssm.head_dim != 0)
    c.fail("ssm_cfg", fmt::format("has expand x d_model = {}, not a multiple of headdim ({})",
                                  ssm.inner, ssm.head_dim));
  ssm.heads = ssm.inner / ssm.head_dim;
  ssm.conv_bias = s.bool_or("conv_bias", true);
  ssm.proj_bias = s.bool_or("bias", false);
  ssm.gated_norm = s.bool_or("rmsnorm", true);
  m.layers.assign(static_cast<size_t>(layers), l);
  return m;
}

}  // namespace spillway::families

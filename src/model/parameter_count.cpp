// Parameter counts: of one layer (by its mixer and MLP, as transformers' modules hold them),
// of a model, and of the part a token uses (the active MLP width and active parameters).
#include <set>

#include "spillway/catalog/model.hpp"
#include "spillway/core/units.hpp"

namespace spillway {

int64_t MlpSpec::active_ffn() const {
  if (kind == MlpKind::kDense) return ffn;
  return checked_add(
      checked_add(checked_mul(top_k, ffn, "active MLP width"), shared_ffn, "active MLP width"),
      residual_ffn, "active MLP width");
}

namespace {

int64_t pmul(int64_t a, int64_t b) {
  return checked_mul(a, b, "model config: parameter count");
}
int64_t padd(int64_t a, int64_t b) {
  return checked_add(a, b, "model config: parameter count");
}

int64_t attention_parameters(const AttentionSpec& a, int64_t d) {
  int64_t p = 0;
  if (a.kind == AttentionKind::kGqa) {
    const int64_t in = a.input_width > 0 ? a.input_width : d;
    const int64_t q = pmul(pmul(a.heads, a.qk_head_dim), a.output_gate ? 2 : 1);
    p = padd(p, pmul(in, q));                                               // q (and its gate)
    p = padd(p, pmul(in, pmul(a.kv_heads, a.qk_head_dim + a.v_head_dim)));  // k, v
    if (a.qkv_bias) p = padd(p, q + pmul(a.kv_heads, a.qk_head_dim + a.v_head_dim));
  } else {
    const int64_t q_out = pmul(a.heads, a.qk_head_dim);
    if (a.q_lora_rank > 0) {
      p = padd(p, padd(pmul(d, a.q_lora_rank), a.q_lora_rank));  // q_a + its norm
      p = padd(p, pmul(a.q_lora_rank, q_out));                   // q_b
    } else {
      p = padd(p, pmul(d, q_out));
    }
    p = padd(p, pmul(d, a.kv_lora_rank + a.qk_rope_head_dim));  // kv_a
    p = padd(p, a.kv_lora_rank);                                // kv_a norm
    p = padd(
        p, pmul(a.kv_lora_rank, pmul(a.heads, a.qk_head_dim - a.qk_rope_head_dim + a.v_head_dim)));
  }
  p = padd(p, pmul(pmul(a.heads, a.v_head_dim), d));  // o
  if (a.o_bias) p = padd(p, d);
  if (a.qk_norm) p = padd(p, 2 * a.qk_head_dim);
  if (a.sinks) p = padd(p, a.heads);
  if (a.indexer_heads > 0) {  // DeepSeek-V3.2's lightning indexer
    p = padd(p, pmul(a.q_lora_rank, pmul(a.indexer_heads, a.indexer_head_dim)));  // wq_b
    p = padd(p, pmul(d, a.indexer_head_dim));                                     // wk
    p = padd(p, pmul(2, a.indexer_head_dim));                                     // k_norm
    p = padd(p, pmul(d, a.indexer_heads));                                        // weights_proj
  }
  return p;
}

// Transformers' MambaMixer (version 1) and Mamba2Mixer (version 2).
int64_t ssm_parameters(const SsmSpec& s, int64_t d) {
  int64_t p = 0;
  const int64_t e = s.inner;
  if (s.version == 1) {
    p = padd(p, pmul(d, 2 * e));  // in_proj: x and z
    if (s.proj_bias) p = padd(p, 2 * e);
    p = padd(p, pmul(e, s.conv));  // conv1d
    if (s.conv_bias) p = padd(p, e);
    p = padd(p, pmul(e, s.dt_rank + 2 * s.state));           // x_proj: dt, B, C
    p = padd(p, padd(pmul(s.dt_rank, e), e));                // dt_proj with its bias
    p = padd(p, padd(pmul(e, s.state), e));                  // A_log, D
    if (s.bcdt_norms) p = padd(p, s.dt_rank + 2 * s.state);  // Jamba's dt, B, C norms
  } else {
    const int64_t conv_dim = padd(e, pmul(2, pmul(s.groups, s.state)));
    const int64_t in_out = padd(padd(e, conv_dim), s.heads);  // z, x B C, dt
    p = padd(p, pmul(d, in_out));
    if (s.proj_bias) p = padd(p, in_out);
    p = padd(p, pmul(conv_dim, s.conv));
    if (s.conv_bias) p = padd(p, conv_dim);
    p = padd(p, pmul(3, s.heads));  // dt_bias, A_log, D
    if (s.gated_norm) p = padd(p, e);
  }
  p = padd(p, pmul(e, d));  // out_proj
  if (s.proj_bias) p = padd(p, d);
  return p;
}

// Linear attention: Qwen3-Next's Gated DeltaNet, Kimi-Linear's Kimi Delta Attention and
// MiniMax's lightning attention, as transformers' and the checkpoints' modules hold them.
int64_t linear_attention_parameters(const LinearAttentionSpec& g, int64_t d) {
  const int64_t key = pmul(g.k_heads, g.k_head_dim);
  const int64_t value = pmul(g.v_heads, g.v_head_dim);
  const int64_t qkv = padd(pmul(2, key), value);
  switch (g.kind) {
    case LinearKind::kGatedDeltaNet: {
      int64_t p = pmul(d, padd(qkv, value));  // in_proj_qkvz
      p = padd(p, pmul(d, 2 * g.v_heads));    // in_proj_ba
      p = padd(p, pmul(qkv, g.conv));         // conv1d (no bias)
      p = padd(p, pmul(2, g.v_heads));        // dt_bias, A_log
      p = padd(p, g.v_head_dim);              // gated RMSNorm
      return padd(p, pmul(value, d));         // out_proj
    }
    case LinearKind::kKimiDelta: {
      int64_t p = pmul(d, qkv);        // q_proj, k_proj, v_proj
      p = padd(p, pmul(qkv, g.conv));  // q, k, v short convs (no bias)
      p = padd(p, padd(pmul(d, g.gate_rank), pmul(g.gate_rank, key)));    // f_a, f_b: decay
      p = padd(p, pmul(d, g.v_heads));                                    // b_proj: beta
      p = padd(p, padd(g.v_heads, key));                                  // A_log, dt_bias
      p = padd(p, padd(pmul(d, g.gate_rank), pmul(g.gate_rank, value)));  // g_a, g_b: gate
      p = padd(p, g.v_head_dim);                                          // o_norm
      return padd(p, pmul(value, d));                                     // o_proj
    }
    case LinearKind::kLightning: {
      int64_t p = pmul(d, qkv);        // qkv_proj
      p = padd(p, pmul(d, value));     // output_gate
      p = padd(p, value);              // norm
      return padd(p, pmul(value, d));  // out_proj
    }
  }
  return 0;
}

// Griffin's recurrent block (transformers' RecurrentGemmaRecurrentBlock).
int64_t recurrent_parameters(const RecurrentSpec& r, int64_t d) {
  const int64_t w = r.width;
  const int64_t block = w / r.heads;
  int64_t p = pmul(2, padd(pmul(d, w), w));       // linear_y, linear_x with biases
  p = padd(p, padd(pmul(w, d), d));               // linear_out with its bias
  p = padd(p, padd(pmul(w, r.conv), w));          // conv_1d with its bias
  p = padd(p, w);                                 // recurrent_param
  p = padd(p, pmul(2, padd(pmul(w, block), w)));  // input and recurrence gates
  return p;
}

int64_t mlp_parameters(const MlpSpec& m, int64_t d) {
  auto ffn = [&](int64_t f, bool bias, bool gated) {
    const int64_t w = pmul(gated ? 3 : 2, pmul(d, f));
    return bias ? padd(w, padd(pmul(gated ? 2 : 1, f), d)) : w;
  };
  if (m.kind == MlpKind::kNone) return 0;
  if (m.kind == MlpKind::kDense) return ffn(m.ffn, m.bias, m.gated);
  int64_t p = pmul(m.experts, ffn(m.ffn, m.bias, m.gated));
  p = padd(p, pmul(d, m.experts));  // router
  if (m.router_bias) p = padd(p, m.experts);
  if (m.shared_ffn > 0) p = padd(p, ffn(m.shared_ffn, false, m.gated));
  if (m.shared_gate) p = padd(p, d);
  if (m.residual_ffn > 0) p = padd(p, ffn(m.residual_ffn, false, m.gated));
  return p;
}

}  // namespace

int64_t shared_block_parameter_count(const LayerSpec& l, int64_t d) {
  if (l.shared_block < 0) return 0;
  // The attention with its norm over the concatenated input, the MLP with its norm.
  const int64_t in = l.attn.input_width > 0 ? l.attn.input_width : d;
  return padd(padd(in, attention_parameters(l.attn, d)), padd(d, mlp_parameters(l.mlp, d)));
}

int64_t layer_parameter_count(const LayerSpec& l, int64_t d) {
  // Each part brings its pre-norm (RMSNorm, d): the input norm of the mixer, the
  // post-attention norm of the MLP; Gemma's sandwich norms are extra_norms.
  int64_t p = padd(pmul(l.extra_norms, d), l.extra_params);
  switch (l.mixer) {
    case MixerKind::kAttention:
      p = padd(p, padd(d, attention_parameters(l.attn, d)));
      if (l.parallel_ssm) p = padd(p, ssm_parameters(l.ssm, d));  // on the same norm
      break;
    case MixerKind::kMamba:
      p = padd(p, padd(d, ssm_parameters(l.ssm, d)));
      break;
    case MixerKind::kLinearAttention:
      p = padd(p, padd(d, linear_attention_parameters(l.linear, d)));
      break;
    case MixerKind::kRecurrent:
      p = padd(p, padd(d, recurrent_parameters(l.recurrent, d)));
      break;
    case MixerKind::kNone:
      break;
  }
  if (l.shared_block >= 0) return padd(p, shared_block_parameter_count(l, d));
  if (l.mlp.kind != MlpKind::kNone) p = padd(p, padd(d, mlp_parameters(l.mlp, d)));
  return p;
}

namespace {
int64_t embedding_parameters(const ModelConfig& m) {
  const int64_t emb = checked_mul(m.vocab, m.hidden, "model config: embedding size");
  const int64_t both =
      m.tied_embeddings ? emb : checked_mul(2, emb, "model config: embedding size");
  return checked_add(both, m.hidden, "model config: parameter count");  // + final norm
}

// A shared block's weights are in every layer that uses it; the model holds them once.
int64_t repeated_shared_parameters(const ModelConfig& m) {
  int64_t repeated = 0;
  std::set<int> seen;
  for (const LayerSpec& l : m.layers) {
    if (l.shared_block >= 0 && !seen.insert(l.shared_block).second)
      repeated = padd(repeated, shared_block_parameter_count(l, m.hidden));
  }
  return repeated;
}
}  // namespace

int64_t parameter_count(const ModelConfig& m) {
  int64_t p = embedding_parameters(m);
  for (const LayerSpec& l : m.layers) {
    p = checked_add(p, layer_parameter_count(l, m.hidden), "model config: parameter count");
  }
  return p - repeated_shared_parameters(m);
}

int64_t active_parameter_count(const ModelConfig& m) {
  int64_t p = embedding_parameters(m) - repeated_shared_parameters(m);
  for (const LayerSpec& l : m.layers) {
    // Only the routed experts a token uses count (the router is then counted at top_k
    // width, a difference of d * (E - k) parameters per layer, well under 0.1%).
    LayerSpec active = l;
    if (l.mlp.kind == MlpKind::kMoe) active.mlp.experts = l.mlp.top_k;
    p = checked_add(p, layer_parameter_count(active, m.hidden), "model config: parameter count");
  }
  return p;
}

}  // namespace spillway

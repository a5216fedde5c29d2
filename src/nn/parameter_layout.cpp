// The reference model's parameter layout and initial weights (parameter_layout.hpp).
#include "nn/parameter_layout.hpp"

#include <algorithm>
#include <cmath>
#include <random>

namespace spillway::nn {

ParameterLayout layout_parameters(const RefConfig& c) {
  ParameterLayout m;
  m.d = c.hidden;
  m.q_dim = c.heads * c.head_dim;
  m.qkv_dim = (c.heads + 2 * c.kv_heads) * c.head_dim;
  size_t at = 0;
  auto take = [&](size_t n) {
    const size_t o = at;
    at += n;
    return o;
  };
  const size_t d = static_cast<size_t>(m.d);
  m.embed = take(static_cast<size_t>(c.vocab) * d);
  for (int l = 0; l < c.layers(); ++l) {
    const MlpSpec& mlp = c.model.layers[static_cast<size_t>(l)].mlp;
    LayerParams L;
    L.moe = mlp.kind == MlpKind::kMoe;
    L.experts = L.moe ? to_int(mlp.experts, "num_experts") : 1;
    L.top_k = L.moe ? to_int(mlp.top_k, "num_experts_per_tok") : 1;
    L.ffn = to_int(mlp.ffn, L.moe ? "moe_intermediate_size" : "intermediate_size");
    L.attn_norm = take(d);
    const LayerSpec& spec = c.model.layers[static_cast<size_t>(l)];
    if (spec.mixer == MixerKind::kMamba) {  // Note [Mamba slots]
      const SsmSpec& s = spec.ssm;
      L.mamba = true;
      L.heads = to_int(s.heads, "mamba heads");
      L.head_dim = to_int(s.head_dim, "mamba head_dim");
      L.groups = to_int(s.groups, "mamba groups");
      L.state = to_int(s.state, "mamba state size");
      L.conv = to_int(s.conv, "mamba conv kernel");
      L.chunk = to_int(s.chunk, "mamba chunk size");
      L.inner = L.heads * L.head_dim;
      L.conv_dim = L.inner + 2 * L.groups * L.state;
      L.in_width = L.inner + L.conv_dim + L.heads;
      L.w_in = take(static_cast<size_t>(L.in_width) * d);
      L.conv_w = take(static_cast<size_t>(L.conv_dim) * static_cast<size_t>(L.conv));
      L.conv_b = take(static_cast<size_t>(L.conv_dim));
      L.dt_bias = take(static_cast<size_t>(L.heads));
      L.a_log = take(static_cast<size_t>(L.heads));
      L.dskip = take(static_cast<size_t>(L.heads));
      L.gnorm = take(static_cast<size_t>(L.inner));
      L.w_out = take(d * static_cast<size_t>(L.inner));
    } else {
      L.wqkv = take(static_cast<size_t>(m.qkv_dim) * d);
      if (c.qk_norm) {  // Note [Q/K norms]: weight_specs' order, after the projection
        L.qk_norm = true;
        L.q_norm = take(static_cast<size_t>(c.head_dim));
        L.k_norm = take(static_cast<size_t>(c.head_dim));
      }
      L.wo = take(d * static_cast<size_t>(m.q_dim));
    }
    L.mlp_norm = take(d);
    if (L.moe) L.router = take(static_cast<size_t>(L.experts) * d);
    const size_t ew = static_cast<size_t>(L.experts) * static_cast<size_t>(L.ffn) * d;
    L.w1 = take(ew);
    L.w3 = take(ew);
    L.w2 = take(ew);
    m.lp.push_back(L);
  }
  m.final_norm = take(d);
  m.tied = c.model.tied_embeddings;  // Note [Tied embeddings]
  m.lm_head = m.tied ? m.embed : take(static_cast<size_t>(c.vocab) * d);
  m.n_params = at;
  // Optimizer buckets: the embedding, each layer, the final norm with the head (tied: the
  // final norm alone).
  m.buckets.push_back({m.embed, (m.lp.empty() ? m.final_norm : m.lp[0].attn_norm) - m.embed});
  for (size_t l = 0; l < m.lp.size(); ++l) {
    const size_t end = l + 1 < m.lp.size() ? m.lp[l + 1].attn_norm : m.final_norm;
    m.buckets.push_back({m.lp[l].attn_norm, end - m.lp[l].attn_norm});
  }
  m.buckets.push_back({m.final_norm, m.n_params - m.final_norm});
  return m;
}

void init_parameters(const ParameterLayout& p, uint64_t seed, float* w) {
  const size_t d = static_cast<size_t>(p.d);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (size_t i = 0; i < p.n_params; ++i) w[i] = normal(rng);
  auto ones = [&](size_t ofs) { std::fill(w + ofs, w + ofs + d, 1.0f); };
  for (const LayerParams& L : p.lp) {
    ones(L.attn_norm);
    ones(L.mlp_norm);
    if (L.qk_norm) {
      std::fill(w + L.q_norm, w + L.k_norm + (L.k_norm - L.q_norm), 1.0f);
    }
    if (!L.mamba) continue;
    // Mamba-2's usual start: A = -(1 .. 16) over the heads, dt from 0.001 to 0.1
    // (log-spaced; dt_bias its inverse softplus), D = 1, the gated norm's weight 1.
    for (int h = 0; h < L.heads; ++h) {
      const double f = L.heads > 1 ? static_cast<double>(h) / (L.heads - 1) : 0.0;
      const double dt = 0.001 * std::pow(100.0, f);
      w[L.a_log + static_cast<size_t>(h)] = static_cast<float>(std::log(1.0 + 15.0 * f));
      w[L.dt_bias + static_cast<size_t>(h)] = static_cast<float>(dt + std::log(-std::expm1(-dt)));
      w[L.dskip + static_cast<size_t>(h)] = 1.0f;
    }
    std::fill(w + L.gnorm, w + L.gnorm + L.inner, 1.0f);
  }
  ones(p.final_norm);
}

}  // namespace spillway::nn

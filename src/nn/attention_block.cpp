// The reference model's attention mixer: input RMSNorm, the fused q k v projection,
// causal GQA attention with RoPE, the output projection and the residual; forward op by op
// into its saved tensors (attn.*, mlp.input), and backward to the gradient at its norm.
//
// Note [Q/K norms]: Qwen3 and Qwen3-MoE norm each head of q and of k (RMSNorm over head_dim,
// one weight of head_dim for all q heads, one for all k heads) after the projection and
// before RoPE, as transformers' Qwen3Attention does. Here the norms run in place on the
// projection's output, so attn.qkv_out (the saved tensor, the planner's name and size) holds
// the normed q and k beside v; the backward needs the projection's output before the norms
// and recomputes it from attn.norm_out (the same GEMM: bitwise the forward's) into
// attn.qkv_out's own buffer, which nothing reads after attention's backward (kept, reloaded
// or recomputed, it is released when the layer's backward ends), and the norms' backward
// runs in place on the gradient: no device memory beyond the layer without norms.
#include "nn/model_impl.hpp"
#include "nn/ops.hpp"
#include "nn/slots.hpp"

namespace spillway::nn {

bool Model::Impl::produce_attention(int layer, int s, int batch, int seq) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const int T = batch * seq;
  auto out = [&](int o) { return out_slot(layer, o, batch, seq); };
  const auto eps = c.rms_eps;
  switch (s) {
    case kNorm1:
      rmsnorm_fwd(F(layer, kInput), lw(L.attn_norm), out(kNorm1), T, d, eps);
      return true;
    case kQkv:
      linear_fwd(F(layer, kNorm1), lw(L.wqkv), out(kQkv), T, d, qkv_dim);
      if (L.qk_norm) qk_norm_fwd(L, out(kQkv), T);  // Note [Q/K norms]
      return true;
    case kCoreOut:
    case kLse: {
      float* o = out(kCoreOut);
      float* lse = out(kLse);
      attention_fwd(F(layer, kQkv), o, lse, batch, seq, c.heads, c.kv_heads, c.head_dim,
                    c.rope_theta);
      return true;
    }
    case kMid: {
      float* mid = out(kMid);
      linear_fwd(F(layer, kCoreOut), lw(L.wo), mid, T, q_dim, d);
      add(F(layer, kInput), mid, mid, static_cast<size_t>(T) * static_cast<size_t>(d));
      return true;
    }
    default:
      return false;
  }
}

void Model::Impl::attention_backward(int layer, const float* dmid, float* dnorm, int batch,
                                     int seq) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const int T = batch * seq;
  float* dcore = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(q_dim));
  linear_bwd(F(layer, kCoreOut), lw(L.wo), dmid, dcore, g + L.wo, T, q_dim, d, false);
  float* dqkv = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(qkv_dim));
  attention_bwd(F(layer, kQkv), F(layer, kCoreOut), F(layer, kLse), dcore, dqkv, batch, seq,
                c.heads, c.kv_heads, c.head_dim, c.rope_theta);
  release(dcore);
  if (L.qk_norm) {                // Note [Q/K norms]: dqkv becomes the gradient before the norms
    float* pre = F(layer, kQkv);  // read by attention_bwd only, now done
    linear_fwd(F(layer, kNorm1), lw(L.wqkv), pre, T, d, qkv_dim);
    const size_t q_width = static_cast<size_t>(c.heads) * static_cast<size_t>(c.head_dim);
    for (int t = 0; t < T; ++t) {
      const size_t row = static_cast<size_t>(t) * static_cast<size_t>(qkv_dim);
      float* dq = dqkv + row;  // in place (rmsnorm_bwd allows dx == dy)
      rmsnorm_bwd(pre + row, lw(L.q_norm), dq, dq, g + L.q_norm, c.heads, c.head_dim, c.rms_eps);
      rmsnorm_bwd(pre + row + q_width, lw(L.k_norm), dq + q_width, dq + q_width, g + L.k_norm,
                  c.kv_heads, c.head_dim, c.rms_eps);
    }
  }
  linear_bwd(F(layer, kNorm1), lw(L.wqkv), dqkv, dnorm, g + L.wqkv, T, d, qkv_dim, false);
  release(dqkv);
}

void Model::Impl::qk_norm_fwd(const LayerParams& L, float* qkv, int T) const {
  const size_t q_width = static_cast<size_t>(c.heads) * static_cast<size_t>(c.head_dim);
  for (int t = 0; t < T; ++t) {
    float* row = qkv + static_cast<size_t>(t) * static_cast<size_t>(qkv_dim);
    rmsnorm_fwd(row, lw(L.q_norm), row, c.heads, c.head_dim, c.rms_eps);
    rmsnorm_fwd(row + q_width, lw(L.k_norm), row + q_width, c.kv_heads, c.head_dim, c.rms_eps);
  }
}

}  // namespace spillway::nn

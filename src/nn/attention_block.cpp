// The reference model's attention mixer: input RMSNorm, the fused q k v projection,
// causal GQA attention with RoPE, the output projection and the residual; forward op by op
// into its saved tensors (attn.*, mlp.input), and backward to the gradient at its norm.
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
  linear_bwd(F(layer, kNorm1), lw(L.wqkv), dqkv, dnorm, g + L.wqkv, T, d, qkv_dim, false);
  release(dqkv);
}

}  // namespace spillway::nn

// The reference model's MLPs after the mixer: RMSNorm, then a dense SwiGLU MLP or a top-k
// routed MoE of SwiGLU experts (router softmax, top-k, dispatch by expert, each expert's
// GEMMs over its rows, the weighted combine), with the residual; forward op by op into
// their saved tensors (mlp.*, moe.*), and backward to the gradient at the MLP's norm.
#include <algorithm>

#include "nn/model_impl.hpp"
#include "nn/ops.hpp"
#include "nn/slots.hpp"
#include "spillway/core/error.hpp"

namespace spillway::nn {

void Model::Impl::route(int layer, int tokens) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const size_t rows = static_cast<size_t>(tokens) * static_cast<size_t>(L.top_k);
  perm.resize(rows);
  inv.resize(rows);
  offsets.resize(static_cast<size_t>(L.experts) + 1);
  moe_route(I(layer, kIdx), tokens, L.top_k, L.experts, perm.data(), offsets.data());
  for (size_t r = 0; r < rows; ++r) inv[static_cast<size_t>(perm[r])] = static_cast<int32_t>(r);
}

void Model::Impl::expert_linear(const LayerParams& L, size_t wofs, const float* x, float* y, int in,
                                int out) {
  for (int e = 0; e < L.experts; ++e) {
    const int r0 = offsets[static_cast<size_t>(e)];
    const int n = offsets[static_cast<size_t>(e) + 1] - r0;
    if (n == 0) continue;
    linear_fwd(
        x + static_cast<size_t>(r0) * static_cast<size_t>(in),
        lw(wofs + static_cast<size_t>(e) * static_cast<size_t>(out) * static_cast<size_t>(in)),
        y + static_cast<size_t>(r0) * static_cast<size_t>(out), n, in, out);
  }
}

void Model::Impl::expert_linear_bwd(const LayerParams& L, size_t wofs, const float* x,
                                    const float* dy, float* dx, int in, int out, bool accumulate) {
  for (int e = 0; e < L.experts; ++e) {
    const int r0 = offsets[static_cast<size_t>(e)];
    const int n = offsets[static_cast<size_t>(e) + 1] - r0;
    if (n == 0) continue;
    const size_t wo =
        wofs + static_cast<size_t>(e) * static_cast<size_t>(out) * static_cast<size_t>(in);
    linear_bwd(x + static_cast<size_t>(r0) * static_cast<size_t>(in), lw(wo),
               dy + static_cast<size_t>(r0) * static_cast<size_t>(out),
               dx + static_cast<size_t>(r0) * static_cast<size_t>(in), g + wo, n, in, out,
               accumulate);
  }
}

void Model::Impl::produce_mlp(int layer, int s, int batch, int seq) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const int T = batch * seq;
  auto out = [&](int o) { return out_slot(layer, o, batch, seq); };
  if (s == kNorm2) {
    rmsnorm_fwd(F(layer, kMid), lw(L.mlp_norm), out(kNorm2), T, d, c.rms_eps);
    return;
  }
  if (!L.moe) {
    const size_t n = static_cast<size_t>(T) * static_cast<size_t>(L.ffn);
    switch (s) {
      case kDenseGate:
        linear_fwd(F(layer, kNorm2), lw(L.w1), out(kDenseGate), T, d, L.ffn);
        return;
      case kDenseUp:
        linear_fwd(F(layer, kNorm2), lw(L.w3), out(kDenseUp), T, d, L.ffn);
        return;
      case kDenseAct:
        swiglu_fwd(F(layer, kDenseGate), F(layer, kDenseUp), out(kDenseAct), n);
        return;
      default:
        SPILLWAY_CHECK(false, "no producer for slot {}", s);
    }
  }
  const int rows = T * L.top_k;
  switch (s) {
    case kProbs:
    case kIdx:
    case kWeights: {
      float* logits = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(L.experts));
      linear_fwd(F(layer, kNorm2), lw(L.router), logits, T, d, L.experts);
      float* probs = out(kProbs);
      softmax_fwd(logits, probs, T, L.experts);
      release(logits);
      int32_t* idx = reinterpret_cast<int32_t*>(out(kIdx));
      topk_fwd(probs, idx, out(kWeights), T, L.experts, L.top_k, c.norm_topk);
      return;
    }
    case kDispatch:
      route(layer, T);
      moe_dispatch_fwd(F(layer, kNorm2), perm.data(), out(kDispatch), rows, L.top_k, d);
      return;
    case kGate:
      route(layer, T);
      expert_linear(L, L.w1, F(layer, kDispatch), out(kGate), d, L.ffn);
      return;
    case kUp:
      route(layer, T);
      expert_linear(L, L.w3, F(layer, kDispatch), out(kUp), d, L.ffn);
      return;
    case kAct:
      swiglu_fwd(F(layer, kGate), F(layer, kUp), out(kAct),
                 static_cast<size_t>(rows) * static_cast<size_t>(L.ffn));
      return;
    case kExpertOut:
      route(layer, T);
      expert_linear(L, L.w2, F(layer, kAct), out(kExpertOut), L.ffn, d);
      return;
    default:
      SPILLWAY_CHECK(false, "no producer for slot {}", s);
  }
}

void Model::Impl::mlp_output(int layer, float* y, int T) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  if (L.moe) {
    route(layer, T);
    moe_combine_fwd(F(layer, kMid), F(layer, kExpertOut), F(layer, kWeights), inv.data(), y, T,
                    L.top_k, d);
  } else {
    linear_fwd(F(layer, kDenseAct), lw(L.w2), y, T, L.ffn, d);
    add(F(layer, kMid), y, y, static_cast<size_t>(T) * static_cast<size_t>(d));
  }
}

void Model::Impl::mlp_backward(int layer, const float* dy, float* dnorm, int batch, int seq) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const int T = batch * seq;
  const size_t Td = static_cast<size_t>(T) * static_cast<size_t>(d);
  if (L.moe) {
    const int rows = T * L.top_k;
    const size_t rf = static_cast<size_t>(rows) * static_cast<size_t>(L.ffn);
    const size_t rd = static_cast<size_t>(rows) * static_cast<size_t>(d);
    route(layer, T);
    float* deo = alloc_n<float>(rd);
    float* dweights = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(L.top_k));
    moe_combine_bwd(F(layer, kExpertOut), F(layer, kWeights), inv.data(), dy, deo, dweights, T,
                    L.top_k, d);
    float* dact = alloc_n<float>(rf);
    expert_linear_bwd(L, L.w2, F(layer, kAct), deo, dact, L.ffn, d, false);
    release(deo);
    float* dg = alloc_n<float>(rf);
    float* du = alloc_n<float>(rf);
    swiglu_bwd(F(layer, kGate), F(layer, kUp), dact, dg, du, rf);
    release(dact);
    float* ddisp = alloc_n<float>(rd);
    expert_linear_bwd(L, L.w1, F(layer, kDispatch), dg, ddisp, d, L.ffn, false);
    expert_linear_bwd(L, L.w3, F(layer, kDispatch), du, ddisp, d, L.ffn, true);
    release(dg);
    release(du);
    std::fill(dnorm, dnorm + Td, 0.0f);
    moe_dispatch_bwd(ddisp, perm.data(), dnorm, rows, L.top_k, d);
    release(ddisp);
    const size_t te = static_cast<size_t>(T) * static_cast<size_t>(L.experts);
    float* dprobs = alloc_n<float>(te);
    topk_bwd(F(layer, kProbs), I(layer, kIdx), dweights, dprobs, T, L.experts, L.top_k,
             c.norm_topk);
    release(dweights);
    float* dlogits = alloc_n<float>(te);
    softmax_bwd(F(layer, kProbs), dprobs, dlogits, T, L.experts);
    release(dprobs);
    linear_bwd(F(layer, kNorm2), lw(L.router), dlogits, dnorm, g + L.router, T, d, L.experts, true);
    release(dlogits);
  } else {
    const size_t tf = static_cast<size_t>(T) * static_cast<size_t>(L.ffn);
    float* dact = alloc_n<float>(tf);
    linear_bwd(F(layer, kDenseAct), lw(L.w2), dy, dact, g + L.w2, T, L.ffn, d, false);
    float* dg = alloc_n<float>(tf);
    float* du = alloc_n<float>(tf);
    swiglu_bwd(F(layer, kDenseGate), F(layer, kDenseUp), dact, dg, du, tf);
    release(dact);
    linear_bwd(F(layer, kNorm2), lw(L.w1), dg, dnorm, g + L.w1, T, d, L.ffn, false);
    linear_bwd(F(layer, kNorm2), lw(L.w3), du, dnorm, g + L.w3, T, d, L.ffn, true);
    release(dg);
    release(du);
  }
}

}  // namespace spillway::nn

// The reference model's Mamba-2 mixer (Note [Mamba slots] in slots.hpp): input RMSNorm,
// in_proj to z, x B C and dt, the causal depthwise conv with SiLU, the selective scan
// (ssd_scan_*, ssm_ops.cpp), the gated RMSNorm, out_proj and the residual; forward op by op
// into its saved tensors (ssm.*, mlp.input), and backward to the gradient at its norm.
#include <cstring>

#include "nn/model_impl.hpp"
#include "nn/ops.hpp"
#include "nn/slots.hpp"

namespace spillway::nn {

float* Model::Impl::columns(const float* m, int rows, int stride, int col, int width) {
  float* out = alloc_n<float>(static_cast<size_t>(rows) * static_cast<size_t>(width));
  for (int r = 0; r < rows; ++r)
    std::memcpy(out + static_cast<size_t>(r) * static_cast<size_t>(width),
                m + static_cast<size_t>(r) * static_cast<size_t>(stride) + col,
                static_cast<size_t>(width) * sizeof(float));
  return out;
}

void Model::Impl::put_columns(const float* src, float* m, int rows, int stride, int col,
                              int width) {
  for (int r = 0; r < rows; ++r)
    std::memcpy(m + static_cast<size_t>(r) * static_cast<size_t>(stride) + col,
                src + static_cast<size_t>(r) * static_cast<size_t>(width),
                static_cast<size_t>(width) * sizeof(float));
}

bool Model::Impl::produce_mamba(int layer, int s, int batch, int seq) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const int T = batch * seq;
  const int gn = L.groups * L.state;
  auto out = [&](int o) { return out_slot(layer, o, batch, seq); };
  if (s == kNorm1) {
    rmsnorm_fwd(F(layer, kInput), lw(L.attn_norm), out(kNorm1), T, d, c.rms_eps);
  } else if (s == kSsmInProj) {
    linear_fwd(F(layer, kNorm1), lw(L.w_in), out(kSsmInProj), T, d, L.in_width);
  } else if (s == kSsmConv) {
    float* xbc = columns(F(layer, kSsmInProj), T, L.in_width, L.inner, L.conv_dim);
    causal_conv1d_silu_fwd(xbc, lw(L.conv_w), lw(L.conv_b), out(kSsmConv), batch, seq, L.conv_dim,
                           L.conv);
    release(xbc);
  } else if (s == kSsmScan || s == L.states_slot()) {
    const float* conv = F(layer, kSsmConv);
    float* x = columns(conv, T, L.conv_dim, 0, L.inner);
    float* bm = columns(conv, T, L.conv_dim, L.inner, gn);
    float* cm = columns(conv, T, L.conv_dim, L.inner + gn, gn);
    float* dt = columns(F(layer, kSsmInProj), T, L.in_width, L.inner + L.conv_dim, L.heads);
    float* y = out(kSsmScan);
    float* states = out(L.states_slot());
    ssd_scan_fwd(L.ssd(batch, seq), x, dt, lw(L.dt_bias), lw(L.a_log), bm, cm, lw(L.dskip), y,
                 states);
    for (float* p : {x, bm, cm, dt}) release(p);
  } else if (s == L.gated_slot()) {
    float* z = columns(F(layer, kSsmInProj), T, L.in_width, 0, L.inner);
    gated_rmsnorm_fwd(F(layer, kSsmScan), z, lw(L.gnorm), out(L.gated_slot()), T, L.inner,
                      c.rms_eps);
    release(z);
  } else if (s == kMid) {
    float* mid = out(kMid);
    linear_fwd(F(layer, L.gated_slot()), lw(L.w_out), mid, T, L.inner, d);
    add(F(layer, kInput), mid, mid, static_cast<size_t>(T) * static_cast<size_t>(d));
  } else {
    return false;
  }
  return true;
}

void Model::Impl::mamba_backward(int layer, const float* dmid, float* dnorm, int batch, int seq) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const int T = batch * seq;
  const int gn = L.groups * L.state;
  const size_t te = static_cast<size_t>(T) * static_cast<size_t>(L.inner);
  float* dgated = alloc_n<float>(te);
  linear_bwd(F(layer, L.gated_slot()), lw(L.w_out), dmid, dgated, g + L.w_out, T, L.inner, d,
             false);
  const float* in = F(layer, kSsmInProj);
  float* din = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(L.in_width));
  float* z = columns(in, T, L.in_width, 0, L.inner);
  float* dscan = alloc_n<float>(te);
  float* dz = alloc_n<float>(te);
  gated_rmsnorm_bwd(F(layer, kSsmScan), z, lw(L.gnorm), dgated, dscan, dz, g + L.gnorm, T, L.inner,
                    c.rms_eps);
  put_columns(dz, din, T, L.in_width, 0, L.inner);
  for (float* p : {dgated, z, dz}) release(p);
  const float* conv = F(layer, kSsmConv);
  float* x = columns(conv, T, L.conv_dim, 0, L.inner);
  float* bm = columns(conv, T, L.conv_dim, L.inner, gn);
  float* cm = columns(conv, T, L.conv_dim, L.inner + gn, gn);
  float* dt = columns(in, T, L.in_width, L.inner + L.conv_dim, L.heads);
  float* dx = alloc_n<float>(te);
  float* ddt = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(L.heads));
  float* db = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(gn));
  float* dc = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(gn));
  ssd_scan_bwd(L.ssd(batch, seq), x, dt, lw(L.dt_bias), lw(L.a_log), bm, cm, lw(L.dskip),
               F(layer, L.states_slot()), dscan, dx, ddt, g + L.dt_bias, g + L.a_log, db, dc,
               g + L.dskip);
  put_columns(ddt, din, T, L.in_width, L.inner + L.conv_dim, L.heads);
  const size_t tc = static_cast<size_t>(T) * static_cast<size_t>(L.conv_dim);
  float* dconv = alloc_n<float>(tc);
  put_columns(dx, dconv, T, L.conv_dim, 0, L.inner);
  put_columns(db, dconv, T, L.conv_dim, L.inner, gn);
  put_columns(dc, dconv, T, L.conv_dim, L.inner + gn, gn);
  for (float* p : {x, bm, cm, dt, dx, ddt, db, dc, dscan}) release(p);
  float* xbc = columns(in, T, L.in_width, L.inner, L.conv_dim);
  float* dxbc = alloc_n<float>(tc);
  causal_conv1d_silu_bwd(xbc, lw(L.conv_w), lw(L.conv_b), dconv, dxbc, g + L.conv_w, g + L.conv_b,
                         batch, seq, L.conv_dim, L.conv);
  put_columns(dxbc, din, T, L.in_width, L.inner, L.conv_dim);
  for (float* p : {xbc, dxbc, dconv}) release(p);
  linear_bwd(F(layer, kNorm1), lw(L.w_in), din, dnorm, g + L.w_in, T, d, L.in_width, false);
  release(din);
}

}  // namespace spillway::nn

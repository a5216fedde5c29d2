// The reference model's operations: explicit forward and backward for every op, on host
// memory (the host backend's device memory is host-addressable), in the style of llm.c's
// train_gpt2.c.
//
// Invariants every op keeps:
// - Row-major buffers; shapes beside each parameter: (rows, cols).
// - Templates over T = float (training) and T = double (the finite-difference reference
//   of the same code). GEMMs go through cblas (sgemm / dgemm).
// - Deterministic: the same inputs give the same bits (fixed loop orders, no atomics,
//   reductions in one fixed order). Bitwise identity of the gradients across memory
//   policies (keep, recompute, offload) relies on it: a recomputed tensor equals the
//   saved one to the bit.
// - "Overwritten" outputs are fully written (tests poison them first); "accumulated" ones
//   (+=) are added to, so that parameter gradients sum over layers, experts and tokens.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spillway::nn {

// C (m, n) = alpha * op(A) * op(B) + beta * C, op(X) = X or X^T; lda/ldb/ldc row strides.
template <class T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda, const T* b,
          int ldb, T beta, T* c, int ldc);

// y (n, out) = x (n, in) * W^T, W (out, in) as nn.Linear (no bias).
template <class T>
void linear_fwd(const T* x, const T* w, T* y, int n, int in, int out);
// dx (n, in) = dy * W (overwritten, or accumulated when accumulate_dx);
// dW (out, in) += dy^T * x. dx may be null (no input gradient wanted).
template <class T>
void linear_bwd(const T* x, const T* w, const T* dy, T* dx, T* dw, int n, int in, int out,
                bool accumulate_dx);

// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w; x, y (n, d), w (d).
template <class T>
void rmsnorm_fwd(const T* x, const T* w, T* y, int n, int d, double eps, double offset = 0.0);
// dx (n, d) overwritten (it may be dy: in place); dw (d) accumulated. Recomputes the rms
// from x.
template <class T>
void rmsnorm_bwd(const T* x, const T* w, const T* dy, T* dx, T* dw, int n, int d, double eps);

// out (n, d) = table[tokens[i]]; table (vocab, d).
template <class T>
void embedding_fwd(const int32_t* tokens, const T* table, T* out, int n, int d);
// dtable (vocab, d) accumulated, rows in token order.
template <class T>
void embedding_bwd(const int32_t* tokens, const T* dout, T* dtable, int n, int d);

// Causal grouped-query attention with rotary position embedding.
// qkv (batch * seq, (heads + 2 * kv_heads) * head_dim): per token the q heads, then the
// k heads, then the v heads; RoPE (theta, rotate-half convention, position = index within
// the sequence) is applied to q and k inside the op; q head h reads kv head
// h / (heads / kv_heads); scale 1 / sqrt(head_dim).
// out (batch * seq, heads * head_dim) overwritten; lse (batch * seq, heads) overwritten:
// the log-sum-exp of each query's scaled scores (what a flash-attention backward keeps).
template <class T>
void attention_fwd(const T* qkv, T* out, T* lse, int batch, int seq, int heads, int kv_heads,
                   int head_dim, double rope_theta);
// dqkv (same shape as qkv) overwritten, from qkv, out, lse and dout (softmax probabilities
// recomputed from the scores and lse).
template <class T>
void attention_bwd(const T* qkv, const T* out, const T* lse, const T* dout, T* dqkv, int batch,
                   int seq, int heads, int kv_heads, int head_dim, double rope_theta);

// Attention takes its queries in row blocks of this many (Note [Attention blocks]).
inline constexpr int kAttnBlock = 64;

// Attention of n new tokens of one sequence at positions pos .. pos + n - 1 against its KV
// cache (Note [Cached attention] in ops.cpp): qkv (n, width) their rows, as attention_fwd's;
// their rotated k and their v are written into k_cache and v_cache (kv_heads, capacity,
// head_dim) at pos .. pos + n - 1, then query i attends keys 0 .. pos + i (with a sliding
// `window` > 0, the last `window` of them: pos + i - window + 1 .. pos + i, as transformers'
// sliding-window mask). out (n, heads * head_dim) overwritten. pos + n <= capacity
// (checked). cos_t, sin_t: rope_angles of at least pos + n positions; scratch:
// attention_cached_scratch(n, pos + n, ...) elements. Allocates nothing.
// What a served model's cached attention computes beyond the default (Note [Served Gemma]
// in spillway/nn/nn.hpp): a sliding `window` > 0 of keys; the softmax `scale` (0:
// 1 / sqrt(head_dim)); a `softcap` > 0 of the scores (cap * tanh(score / cap), before the
// mask); `rope_first`, the position of cos_t's and sin_t's first row (a table of the step's
// positions only, dynamic RoPE's).
struct CachedAttention {
  int window = 0;
  double scale = 0.0;
  double softcap = 0.0;
  int rope_first = 0;
};
template <class T>
void attention_cached_fwd(const T* qkv, T* out, T* k_cache, T* v_cache, int capacity, int pos,
                          int n, int heads, int kv_heads, int head_dim, const double* cos_t,
                          const double* sin_t, T* scratch, const CachedAttention& how = {});
// The scratch attention_cached_fwd needs for n new tokens ending at position `end`.
inline size_t attention_cached_scratch(int n, int end, int heads, int head_dim) {
  const int block = n < kAttnBlock ? n : kAttnBlock;
  return static_cast<size_t>(n) * heads * head_dim + static_cast<size_t>(block) * end;
}
// RoPE's angles, as the attention ops use them: cos_t and sin_t (positions, head_dim / 2),
// entry (t, i) the cosine and sine of t * theta^(-2i / head_dim).
void rope_angles(int positions, int head_dim, double theta, double* cos_t, double* sin_t);

// act = silu(g) * u elementwise, n elements.
template <class T>
void swiglu_fwd(const T* g, const T* u, T* act, size_t n);
// act = gelu_tanh(g) * u elementwise (GeGLU with torch's tanh-approximated GELU, Gemma's
// gelu_pytorch_tanh), n elements. Forward only (served).
template <class T>
void geglu_tanh_fwd(const T* g, const T* u, T* act, size_t n);
// dg, du overwritten.
template <class T>
void swiglu_bwd(const T* g, const T* u, const T* dact, T* dg, T* du, size_t n);

// Row softmax: probs (n, e) = softmax(logits (n, e)), max-subtracted.
template <class T>
void softmax_fwd(const T* logits, T* probs, int n, int e);
// dlogits (n, e) overwritten.
template <class T>
void softmax_bwd(const T* probs, const T* dprobs, T* dlogits, int n, int e);

// Top-k of each row of probs (n, e): idx (n, k) in descending probability (ties: lower
// expert index first), weights (n, k) = the probs at idx, divided by their sum when
// norm_topk (Qwen3-MoE's norm_topk_prob).
template <class T>
void topk_fwd(const T* probs, int32_t* idx, T* weights, int n, int e, int k, bool norm_topk);
// dprobs (n, e) overwritten: zero except at idx, where the chain rule through the
// selection (and the normalization when norm_topk) puts dweights (n, k).
template <class T>
void topk_bwd(const T* probs, const int32_t* idx, const T* dweights, T* dprobs, int n, int e, int k,
              bool norm_topk);

// MoE routing as a counting sort: the n * k assignments (token t, slot s) ordered by
// expert, then token, then slot. perm (n * k): perm[r] = t * k + s of dispatched row r;
// offsets (experts + 1): expert x owns rows [offsets[x], offsets[x + 1]). No allocation.
void moe_route(const int32_t* idx, int n, int k, int experts, int32_t* perm, int32_t* offsets);

// Dispatch: xd (n * k, d) row r = x (n, d) row perm[r] / k.
template <class T>
void moe_dispatch_fwd(const T* x, const int32_t* perm, T* xd, int rows, int k, int d);
// dx (n, d) accumulated: row perm[r] / k += dxd row r, r ascending (deterministic).
template <class T>
void moe_dispatch_bwd(const T* dxd, const int32_t* perm, T* dx, int rows, int k, int d);

// Combine: y (n, d) = residual (n, d) + sum over slots s of weights[t, s] * eo row
// inv[t * k + s], eo (n * k, d) the experts' outputs in dispatched order, inv the inverse
// of perm (inv[perm[r]] = r). y overwritten; summed over s ascending.
template <class T>
void moe_combine_fwd(const T* residual, const T* eo, const T* weights, const int32_t* inv, T* y,
                     int n, int k, int d);
// deo (n * k, d) overwritten; dweights (n, k) overwritten; the residual's gradient is dy
// itself (the caller adds it).
template <class T>
void moe_combine_bwd(const T* eo, const T* weights, const int32_t* inv, const T* dy, T* deo,
                     T* dweights, int n, int k, int d);

// Mean cross-entropy of logits (n, v) against targets (n); dlogits (n, v) overwritten
// with its gradient ((softmax - onehot) / n). Returns the loss (summed in double).
template <class T>
double cross_entropy(const T* logits, const int32_t* targets, T* dlogits, int n, int v);

// Residual add: y (n) = a + b, overwritten (y may alias a).
template <class T>
void add(const T* a, const T* b, T* y, size_t n);

// Threads OpenBLAS may use: 1 by default (see Note [Deterministic GEMM] in ops.cpp).
void set_blas_threads(int threads);

// --- Mamba-2 (ssm_ops.cpp) ---------------------------------------------------------------

// Causal depthwise convolution then SiLU, per sequence (zero before its start):
// y[t, c] = silu(bias[c] + sum_j w[c, j] x[t - (width - 1) + j, c]); x, y (batch * seq,
// channels), w (channels, width), bias (channels) or null. y overwritten.
template <class T>
void causal_conv1d_silu_fwd(const T* x, const T* w, const T* bias, T* y, int batch, int seq,
                            int channels, int width);
// dx overwritten; dw, dbias (null when bias is) accumulated.
template <class T>
void causal_conv1d_silu_bwd(const T* x, const T* w, const T* bias, const T* dy, T* dx, T* dw,
                            T* dbias, int batch, int seq, int channels, int width);

struct SsdShape {
  int batch = 1, seq = 1, heads = 1, head_dim = 1, groups = 1, state = 1, chunk = 1;
  int chunks() const { return (seq + chunk - 1) / chunk; }
};

// Mamba-2's selective scan in its sequential form, per sequence and head h (group
// g = h / (heads / groups)): dt = softplus(dt_raw + dt_bias[h]), A = -exp(a_log[h]),
// S_t = exp(dt A) S_{t-1} + dt x_t B_t^T (S: head_dim x state, zero at the start),
// y_t = S_t C_t + dskip[h] x_t. x, y (batch * seq, heads * head_dim); dt_raw (batch * seq,
// heads); B, C (batch * seq, groups * state). states (batch * chunks, heads * head_dim *
// state): S just before each chunk's first token, what backward restarts from (the scan
// is never rerun whole). y and states overwritten.
template <class T>
void ssd_scan_fwd(const SsdShape& s, const T* x, const T* dt_raw, const T* dt_bias, const T* a_log,
                  const T* bmat, const T* cmat, const T* dskip, T* y, T* states);
// The same recurrence for one sequence (s.batch 1) continuing from `state` (heads * head_dim
// * state, S before its first token; left holding S after its last): what a decoder runs
// chunk by chunk. The same per-token arithmetic as ssd_scan_fwd: from a zero state, the
// same bits.
template <class T>
void ssd_scan_carry_fwd(const SsdShape& s, const T* x, const T* dt_raw, const T* dt_bias,
                        const T* a_log, const T* bmat, const T* cmat, const T* dskip, T* y,
                        T* state);
// From the forward's inputs, its states and dy: dx, ddt_raw, db, dc overwritten; ddt_bias,
// da_log, ddskip accumulated. Each chunk's states are recomputed from its saved start
// (the forward's own arithmetic: the same bits).
template <class T>
void ssd_scan_bwd(const SsdShape& s, const T* x, const T* dt_raw, const T* dt_bias, const T* a_log,
                  const T* bmat, const T* cmat, const T* dskip, const T* states, const T* dy, T* dx,
                  T* ddt_raw, T* ddt_bias, T* da_log, T* db, T* dc, T* ddskip);

// Mamba-2's gated RMSNorm (gate before the norm): h = x * silu(z), y = h / rms(h) * w;
// x, z, y (n, d), w (d). y overwritten.
template <class T>
void gated_rmsnorm_fwd(const T* x, const T* z, const T* w, T* y, int n, int d, double eps);
// dx, dz overwritten; dw accumulated.
template <class T>
void gated_rmsnorm_bwd(const T* x, const T* z, const T* w, const T* dy, T* dx, T* dz, T* dw, int n,
                       int d, double eps);

}  // namespace spillway::nn

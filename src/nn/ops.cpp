// The reference model's operations (see ops.hpp for each op's contract).
//
// Invariants kept here:
// - Every loop runs in one fixed order and every reduction is sequential, so the same
//   inputs give the same bits; GEMMs run OpenBLAS on 1 thread (Note [Deterministic GEMM]).
// - Reductions (norms, softmax sums) accumulate in double for both T; T = float then
//   differs from T = double only by the rounding of the stored values, which is what the
//   float-vs-double tests bound. GEMMs, and so attention's scores, probabilities and
//   their gradients (Note [Attention blocks]), sum in T.
// - Softmax, log-sum-exp and cross-entropy subtract the row maximum before exp.
// - Scratch lives in thread_local vectors that only grow: no allocation per call once
//   the largest shape has been seen.
#include "nn/ops.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <numbers>
#include <type_traits>
#include <vector>

#include "spillway/core/error.hpp"

extern "C" void openblas_set_num_threads(int);

namespace spillway::nn {

void rope_angles(int positions, int head_dim, double theta, double* cos_t, double* sin_t) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double freq = std::pow(theta, -2.0 * i / head_dim);
    for (int t = 0; t < positions; ++t) {
      const double angle = t * freq;
      cos_t[static_cast<size_t>(t) * half + i] = std::cos(angle);
      sin_t[static_cast<size_t>(t) * half + i] = std::sin(angle);
    }
  }
}

namespace {

// Note [Deterministic GEMM]
// OpenBLAS picks its code path from the shape and the thread count: small-matrix
// kernels, the single-threaded driver, or the threaded driver that splits the work
// among threads (and its level-1/2 routines split the summed dimension itself). It
// promises no bitwise equality across thread counts, and its default thread count is
// the machine's core count or OPENBLAS_NUM_THREADS. The memory policies (keep,
// recompute, offload) must give bitwise-equal gradients, and two runs of the same plan
// must too, so every GEMM runs on 1 thread, set on the first call, unless the caller
// asks otherwise with set_blas_threads (and then owns the consequence). The reference
// model is small; one thread costs little. The promise holds for one machine and one
// OpenBLAS build: another CPU may select another kernel.
std::once_flag blas_threads_once;

void ensure_blas_threads() {
  std::call_once(blas_threads_once, [] { openblas_set_num_threads(1); });
}

// Grows `v` to at least n elements (never shrinks) and returns its data.
template <class U>
U* scratch(std::vector<U>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// RoPE angles: cos and sin (seq, head_dim / 2), rotate-half pairs (i, i + head_dim / 2),
// freq_i = theta^(-2i / head_dim), angle = position * freq_i, in double.
struct RopeTable {
  int seq = 0;
  int head_dim = 0;
  double theta = 0;
  std::vector<double> cos_t, sin_t;  // (seq, head_dim / 2)
};

// This thread's table for at least `seq` positions. Entry (t, i) depends on t, i,
// head_dim and theta alone, so a kept table gives the same bits as a fresh one; it is
// rebuilt when head_dim or theta change or seq grows.
const RopeTable& rope_table(int seq, int head_dim, double theta) {
  thread_local RopeTable table;
  if (table.seq >= seq && table.head_dim == head_dim && table.theta == theta) return table;
  const size_t size = static_cast<size_t>(seq) * (head_dim / 2);
  table.cos_t.resize(size);
  table.sin_t.resize(size);
  rope_angles(seq, head_dim, theta, table.cos_t.data(), table.sin_t.data());
  table.seq = seq;
  table.head_dim = head_dim;
  table.theta = theta;
  return table;
}

// y (head_dim) = RoPE(x) * scale at the angles cs, sn (head_dim / 2), rounded once.
template <class S, class D>
void rope_rotate(const S* x, D* y, const double* cs, const double* sn, int half, double scale) {
  for (int i = 0; i < half; ++i) {
    const double x1 = x[i];
    const double x2 = x[i + half];
    y[i] = static_cast<D>((x1 * cs[i] - x2 * sn[i]) * scale);
    y[i + half] = static_cast<D>((x1 * sn[i] + x2 * cs[i]) * scale);
  }
}

// dx (head_dim) = RoPE^T(dy) * scale: the rotation is orthogonal, its transpose is the
// inverse.
template <class S, class D>
void rope_unrotate(const S* dy, D* dx, const double* cs, const double* sn, int half, double scale) {
  for (int i = 0; i < half; ++i) {
    const double y1 = dy[i];
    const double y2 = dy[i + half];
    dx[i] = static_cast<D>((y1 * cs[i] + y2 * sn[i]) * scale);
    dx[i + half] = static_cast<D>((-y1 * sn[i] + y2 * cs[i]) * scale);
  }
}

void check_attention_shape(int heads, int kv_heads, int head_dim) {
  SPILLWAY_CHECK(kv_heads >= 1 && heads % kv_heads == 0,
                 "attention: heads ({}) must be a multiple of kv_heads ({})", heads, kv_heads);
  SPILLWAY_CHECK(head_dim >= 2 && head_dim % 2 == 0,
                 "attention: head_dim is {}; must be even (rotate-half RoPE)", head_dim);
}

}  // namespace

void set_blas_threads(int threads) {
  ensure_blas_threads();
  openblas_set_num_threads(threads);
}

// --- GEMM ---------------------------------------------------------------------------

template <class T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda, const T* b,
          int ldb, T beta, T* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    // op(A) * op(B) is zero; cblas would reject lda = 0, so scale C here.
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < n; ++j) {
        T& cij = c[static_cast<size_t>(i) * ldc + j];
        cij = beta == T(0) ? T(0) : beta * cij;
      }
    }
    return;
  }
  ensure_blas_threads();
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// --- linear -------------------------------------------------------------------------

template <class T>
void linear_fwd(const T* x, const T* w, T* y, int n, int in, int out) {
  gemm<T>(false, true, n, out, in, T(1), x, in, w, in, T(0), y, out);
}

template <class T>
void linear_bwd(const T* x, const T* w, const T* dy, T* dx, T* dw, int n, int in, int out,
                bool accumulate_dx) {
  if (dx != nullptr) {
    gemm<T>(false, false, n, in, out, T(1), dy, out, w, in, accumulate_dx ? T(1) : T(0), dx, in);
  }
  gemm<T>(true, false, out, in, n, T(1), dy, out, x, in, T(1), dw, in);
}

// --- RMSNorm ------------------------------------------------------------------------

template <class T>
void rmsnorm_fwd(const T* x, const T* w, T* y, int n, int d, double eps, double offset) {
  for (int r = 0; r < n; ++r) {
    const T* xr = x + static_cast<size_t>(r) * d;
    T* yr = y + static_cast<size_t>(r) * d;
    double ss = 0;
    for (int i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const double inv_rms = 1.0 / std::sqrt(ss / d + eps);
    // (offset + w_i: Gemma's (1 + w); 0 + w_i is w_i exactly)
    for (int i = 0; i < d; ++i) yr[i] = static_cast<T>(xr[i] * inv_rms * (offset + w[i]));
  }
}

// With s = 1 / rms: y_i = x_i s w_i, ds/dx_j = -s^3 x_j / d, so
// dx_j = s w_j dy_j - s^3 x_j / d * sum_i (dy_i w_i x_i).
template <class T>
void rmsnorm_bwd(const T* x, const T* w, const T* dy, T* dx, T* dw, int n, int d, double eps) {
  for (int r = 0; r < n; ++r) {
    const T* xr = x + static_cast<size_t>(r) * d;
    const T* dyr = dy + static_cast<size_t>(r) * d;
    T* dxr = dx + static_cast<size_t>(r) * d;
    double ss = 0;
    double dot = 0;
    for (int i = 0; i < d; ++i) {
      ss += static_cast<double>(xr[i]) * xr[i];
      dot += static_cast<double>(dyr[i]) * w[i] * xr[i];
    }
    const double s = 1.0 / std::sqrt(ss / d + eps);
    const double c = s * s * s * dot / d;
    for (int i = 0; i < d; ++i) {  // dy_i read once, before dx_i is written: dx may be dy
      const double dyi = dyr[i];
      dw[i] += static_cast<T>(dyi * xr[i] * s);
      dxr[i] = static_cast<T>(s * w[i] * dyi - c * xr[i]);
    }
  }
}

// --- embedding ----------------------------------------------------------------------

template <class T>
void embedding_fwd(const int32_t* tokens, const T* table, T* out, int n, int d) {
  for (int t = 0; t < n; ++t) {
    std::copy_n(table + static_cast<size_t>(tokens[t]) * d, d, out + static_cast<size_t>(t) * d);
  }
}

template <class T>
void embedding_bwd(const int32_t* tokens, const T* dout, T* dtable, int n, int d) {
  for (int t = 0; t < n; ++t) {
    T* row = dtable + static_cast<size_t>(tokens[t]) * d;
    const T* g = dout + static_cast<size_t>(t) * d;
    for (int i = 0; i < d; ++i) row[i] += g[i];
  }
}

// --- attention ----------------------------------------------------------------------

namespace {

// Note [Attention blocks]
// Per (batch, head), the queries are taken in row blocks of kAttnBlock: block [i0, i1)
// needs the keys [0, i1) only (causal), so S = Q K^T, O = P V and the backward's products
// are GEMMs of (i1 - i0) x i1 x head_dim that skip the masked blocks above the diagonal.
// Inside a diagonal block the masked entries of P and dS are written as exact zeros and
// take part in the GEMMs. Block bounds depend on seq alone, and the key and value
// gradients are summed head by head of the kv group, block by block within a head, both
// ascending: one fixed reduction order. T = float keeps S, P, dP and dS in float (each
// GEMM sums head_dim or i1 float products in single precision; the softmax sums and
// D = rowsum(dO * O) are double); the float-vs-double test bound (2e-5) holds.

// The attention scratch of one T: rotated q and k, gradients, one row block of scores.
template <class T>
std::vector<T>& attention_scratch() {
  thread_local std::vector<T> v;
  return v;
}

// qs (heads, seq, head_dim) = RoPE(q) * scale, kr (kv_heads, seq, head_dim) = RoPE(k) of
// the sequence qkv_b (seq, width). Folding the scale into q (in double, before the one
// rounding to T) makes Qs K^T the scaled scores.
template <class T>
void rotate_qk(const T* qkv_b, T* qs, T* kr, int seq, int heads, int kv_heads, int head_dim,
               const RopeTable& rope, double scale) {
  const int half = head_dim / 2;
  const size_t width = static_cast<size_t>(heads + 2 * kv_heads) * head_dim;
  for (int t = 0; t < seq; ++t) {
    const T* row = qkv_b + t * width;
    const double* cs = rope.cos_t.data() + static_cast<size_t>(t) * half;
    const double* sn = rope.sin_t.data() + static_cast<size_t>(t) * half;
    for (int h = 0; h < heads; ++h) {
      rope_rotate(row + h * head_dim, qs + (static_cast<size_t>(h) * seq + t) * head_dim, cs, sn,
                  half, scale);
    }
    for (int j = 0; j < kv_heads; ++j) {
      rope_rotate(row + (heads + j) * head_dim, kr + (static_cast<size_t>(j) * seq + t) * head_dim,
                  cs, sn, half, 1.0);
    }
  }
}

// x[j] = exp(x[j] - shift) for j < n.
template <class T>
void exp_shifted(T* x, int n, T shift) {
  for (int j = 0; j < n; ++j) x[j] = std::exp(x[j] - shift);
}

// One row of scores p (cols) into the probabilities of its first n keys, the rest zeroed;
// returns the log-sum-exp of the n scores (max-shifted, summed in double).
template <class T>
double causal_softmax_row(T* p, int n, int cols) {
  const T mx = *std::max_element(p, p + n);
  exp_shifted(p, n, mx);
  double sum = 0;
  for (int j = 0; j < n; ++j) sum += p[j];
  const double inv = 1.0 / sum;
  for (int j = 0; j < n; ++j) p[j] = static_cast<T>(p[j] * inv);
  std::fill(p + n, p + cols, T(0));
  return mx + std::log(sum);
}

// What both attention passes derive from the shape (checked here).
struct AttentionGeometry {
  int group;      // query heads per kv head
  int width;      // a token's qkv row: (heads + 2 kv_heads) head_dim
  int out_width;  // a token's output row: heads head_dim
  size_t hd;      // head_dim
  double scale;   // 1 / sqrt(head_dim)
  size_t q_size;  // (heads, seq, head_dim): the rotated, scaled q
  size_t k_size;  // (kv_heads, seq, head_dim): the rotated k
  int block;      // query rows per block (Note [Attention blocks])
};

AttentionGeometry attention_geometry(int seq, int heads, int kv_heads, int head_dim) {
  check_attention_shape(heads, kv_heads, head_dim);
  const size_t hd = static_cast<size_t>(head_dim);
  return {heads / kv_heads,
          (heads + 2 * kv_heads) * head_dim,
          heads * head_dim,
          hd,
          1.0 / std::sqrt(static_cast<double>(head_dim)),
          static_cast<size_t>(seq) * heads * hd,
          static_cast<size_t>(seq) * kv_heads * hd,
          std::min(kAttnBlock, seq)};
}

}  // namespace

template <class T>
void attention_fwd(const T* qkv, T* out, T* lse, int batch, int seq, int heads, int kv_heads,
                   int head_dim, double rope_theta) {
  const auto [group, width, out_width, hd, scale, q_size, k_size, block] =
      attention_geometry(seq, heads, kv_heads, head_dim);
  if (batch <= 0 || seq <= 0) return;
  const RopeTable& rope = rope_table(seq, head_dim, rope_theta);

  T* buf = scratch(attention_scratch<T>(), q_size + k_size + static_cast<size_t>(block) * seq);
  T* qs = buf;             // (heads, seq, head_dim) rotated, scaled q
  T* kr = qs + q_size;     // (kv_heads, seq, head_dim) rotated k
  T* probs = kr + k_size;  // (rows, cols) one row block's scores, then probabilities

  // Note [Attention blocks]
  for (int b = 0; b < batch; ++b) {
    const size_t token0 = static_cast<size_t>(b) * seq;
    const T* qkv_b = qkv + token0 * width;
    rotate_qk(qkv_b, qs, kr, seq, heads, kv_heads, head_dim, rope, scale);
    for (int h = 0; h < heads; ++h) {
      const int kvh = h / group;
      const T* qh = qs + static_cast<size_t>(h) * seq * hd;
      const T* kh = kr + static_cast<size_t>(kvh) * seq * hd;
      const T* vh = qkv_b + static_cast<size_t>(heads + kv_heads + kvh) * hd;  // ld width
      for (int i0 = 0; i0 < seq; i0 += block) {
        const int rows = std::min(block, seq - i0);
        const int cols = i0 + rows;
        gemm<T>(false, true, rows, cols, head_dim, T(1), qh + i0 * hd, head_dim, kh, head_dim, T(0),
                probs, cols);
        for (int r = 0; r < rows; ++r)  // keys 0 .. i
          lse[(token0 + i0 + r) * heads + h] = static_cast<T>(
              causal_softmax_row(probs + static_cast<size_t>(r) * cols, i0 + r + 1, cols));
        gemm<T>(false, false, rows, head_dim, cols, T(1), probs, cols, vh, width, T(0),
                out + (token0 + i0) * out_width + h * hd, out_width);
      }
    }
  }
}

// Note [Cached attention]: the same row blocks, GEMMs and softmax as attention_fwd, with
// the keys and values read from the cache (kv head j's rows j * capacity + t): a prefill
// from position 0 makes attention_fwd's calls on the same operands (V's row stride aside).
template <class T>
void attention_cached_fwd(const T* qkv, T* out, T* k_cache, T* v_cache, int capacity, int pos,
                          int n, int heads, int kv_heads, int head_dim, const double* cos_t,
                          const double* sin_t, T* scratch_buf, const CachedAttention& how) {
  const auto [group, width, out_width, hd, default_scale, q_size, k_size, block] =
      attention_geometry(n, heads, kv_heads, head_dim);
  const double scale = how.scale > 0 ? how.scale : default_scale;
  const int window = how.window;
  (void)k_size;
  if (n <= 0) return;
  SPILLWAY_CHECK(pos >= 0 && pos + n <= capacity,
                 "attention_cached_fwd: positions {}..{} outside the cache's {}", pos, pos + n - 1,
                 capacity);
  SPILLWAY_CHECK(pos >= how.rope_first, "attention_cached_fwd: position {} before the table's {}",
                 pos, how.rope_first);
  const int half = head_dim / 2;
  T* qs = scratch_buf;     // (heads, n, head_dim) rotated, scaled q
  T* probs = qs + q_size;  // (rows, cols) one row block's scores, then probabilities
  const size_t cap = static_cast<size_t>(capacity);
  for (int t = 0; t < n; ++t) {
    const T* row = qkv + static_cast<size_t>(t) * width;
    const size_t at = static_cast<size_t>(pos) + static_cast<size_t>(t);
    const size_t rope_row = at - static_cast<size_t>(how.rope_first);
    const double* cs = cos_t + rope_row * half;
    const double* sn = sin_t + rope_row * half;
    for (int h = 0; h < heads; ++h)
      rope_rotate(row + h * head_dim, qs + (static_cast<size_t>(h) * n + t) * hd, cs, sn, half,
                  scale);
    for (int j = 0; j < kv_heads; ++j) {
      rope_rotate(row + (heads + j) * head_dim, k_cache + (j * cap + at) * hd, cs, sn, half, 1.0);
      const T* v = row + static_cast<size_t>(heads + kv_heads + j) * hd;
      std::copy(v, v + hd, v_cache + (j * cap + at) * hd);
    }
  }
  for (int h = 0; h < heads; ++h) {
    const size_t kvh = static_cast<size_t>(h / group);
    const T* qh = qs + static_cast<size_t>(h) * n * hd;
    const T* kh = k_cache + kvh * cap * hd;
    const T* vh = v_cache + kvh * cap * hd;
    for (int i0 = 0; i0 < n; i0 += block) {
      const int rows = std::min(block, n - i0);
      const int cols = pos + i0 + rows;
      gemm<T>(false, true, rows, cols, head_dim, T(1), qh + i0 * hd, head_dim, kh, head_dim, T(0),
              probs, cols);
      for (int r = 0; r < rows; ++r) {  // keys 0 (or the window's first) .. pos + i
        const int q = pos + i0 + r;
        const int lo = window > 0 ? std::max(0, q - window + 1) : 0;
        T* p = probs + static_cast<size_t>(r) * cols;
        if (how.softcap > 0)
          for (int j = lo; j <= q; ++j)
            p[j] = static_cast<T>(how.softcap * std::tanh(p[j] / how.softcap));
        std::fill(p, p + lo, T(0));
        (void)causal_softmax_row(p + lo, q + 1 - lo, cols - lo);
      }
      gemm<T>(false, false, rows, head_dim, cols, T(1), probs, cols, vh, head_dim, T(0),
              out + static_cast<size_t>(i0) * out_width + h * hd, out_width);
    }
  }
}

// With P = exp(S - lse), dP = dout V^T, D_i = dout_i . out_i = sum_j P_ij dP_ij:
// dS = P (dP - D), dq_rot = scale dS K_rot, dk_rot = scale dS^T Q_rot, dv = P^T dout;
// then q and k gradients go back through the inverse rotation. S = Qs K^T with the
// scale folded into Qs, so dk_rot = dS^T Qs and dq_rot takes the scale when unrotated.
template <class T>
void attention_bwd(const T* qkv, const T* out, const T* lse, const T* dout, T* dqkv, int batch,
                   int seq, int heads, int kv_heads, int head_dim, double rope_theta) {
  const auto [group, width, out_width, hd, scale, q_size, k_size, block] =
      attention_geometry(seq, heads, kv_heads, head_dim);
  if (batch <= 0 || seq <= 0) return;
  const int half = head_dim / 2;
  const RopeTable& rope = rope_table(seq, head_dim, rope_theta);

  const size_t block_size = static_cast<size_t>(block) * seq;
  T* buf = scratch(attention_scratch<T>(),
                   q_size + 3 * k_size + static_cast<size_t>(seq) * hd + 2 * block_size);
  T* qs = buf;                  // (heads, seq, head_dim) rotated, scaled q
  T* kr = qs + q_size;          // (kv_heads, seq, head_dim) rotated k
  T* dk = kr + k_size;          // (kv_heads, seq, head_dim) gradient of rotated k
  T* dv = dk + k_size;          // (kv_heads, seq, head_dim)
  T* dq = dv + k_size;          // (seq, head_dim) one head's gradient of rotated q
  T* probs = dq + seq * hd;     // (rows, cols) one row block's scores, then P
  T* dsc = probs + block_size;  // (rows, cols) one row block's dP, then dS

  // Note [Attention blocks]
  for (int b = 0; b < batch; ++b) {
    const size_t token0 = static_cast<size_t>(b) * seq;
    const T* qkv_b = qkv + token0 * width;
    T* dqkv_b = dqkv + token0 * width;
    rotate_qk(qkv_b, qs, kr, seq, heads, kv_heads, head_dim, rope, scale);
    std::fill_n(dk, 2 * k_size, T(0));  // dk and dv
    for (int h = 0; h < heads; ++h) {
      const int kvh = h / group;
      const T* qh = qs + static_cast<size_t>(h) * seq * hd;
      const T* kh = kr + static_cast<size_t>(kvh) * seq * hd;
      const T* vh = qkv_b + static_cast<size_t>(heads + kv_heads + kvh) * hd;  // ld width
      const T* oh = out + token0 * out_width + h * hd;                         // ld out_width
      const T* gh = dout + token0 * out_width + h * hd;                        // ld out_width
      T* dkh = dk + static_cast<size_t>(kvh) * seq * hd;
      T* dvh = dv + static_cast<size_t>(kvh) * seq * hd;
      for (int i0 = 0; i0 < seq; i0 += block) {
        const int rows = std::min(block, seq - i0);
        const int cols = i0 + rows;
        gemm<T>(false, true, rows, cols, head_dim, T(1), qh + i0 * hd, head_dim, kh, head_dim, T(0),
                probs, cols);
        gemm<T>(false, true, rows, cols, head_dim, T(1), gh + i0 * out_width, out_width, vh, width,
                T(0), dsc, cols);
        for (int r = 0; r < rows; ++r) {
          const int n = i0 + r + 1;  // keys 0 .. i
          const size_t token = token0 + i0 + r;
          const T* o = oh + (i0 + r) * out_width;
          const T* g = gh + (i0 + r) * out_width;
          double big_d = 0;
          for (int c = 0; c < head_dim; ++c) big_d += static_cast<double>(g[c]) * o[c];
          T* p = probs + static_cast<size_t>(r) * cols;
          T* ds = dsc + static_cast<size_t>(r) * cols;
          exp_shifted(p, n, lse[token * heads + h]);
          for (int j = 0; j < n; ++j) {
            ds[j] = static_cast<T>(static_cast<double>(p[j]) * (ds[j] - big_d));
          }
          std::fill(p + n, p + cols, T(0));
          std::fill(ds + n, ds + cols, T(0));
        }
        gemm<T>(false, false, rows, head_dim, cols, T(1), dsc, cols, kh, head_dim, T(0),
                dq + i0 * hd, head_dim);
        gemm<T>(true, false, cols, head_dim, rows, T(1), dsc, cols, qh + i0 * hd, head_dim, T(1),
                dkh, head_dim);
        gemm<T>(true, false, cols, head_dim, rows, T(1), probs, cols, gh + i0 * out_width,
                out_width, T(1), dvh, head_dim);
      }
      for (int t = 0; t < seq; ++t) {
        rope_unrotate(dq + t * hd, dqkv_b + t * width + h * hd,
                      rope.cos_t.data() + static_cast<size_t>(t) * half,
                      rope.sin_t.data() + static_cast<size_t>(t) * half, half, scale);
      }
    }
    for (int t = 0; t < seq; ++t) {
      T* row = dqkv_b + t * width;
      const double* cs = rope.cos_t.data() + static_cast<size_t>(t) * half;
      const double* sn = rope.sin_t.data() + static_cast<size_t>(t) * half;
      for (int j = 0; j < kv_heads; ++j) {
        const size_t kv_off = (static_cast<size_t>(j) * seq + t) * hd;
        rope_unrotate(dk + kv_off, row + (heads + j) * head_dim, cs, sn, half, 1.0);
        std::copy_n(dv + kv_off, head_dim, row + (heads + kv_heads + j) * head_dim);
      }
    }
  }
}

// --- SwiGLU -------------------------------------------------------------------------

template <class T>
void geglu_tanh_fwd(const T* g, const T* u, T* act, size_t n) {
  const double c = std::sqrt(2.0 / std::numbers::pi);
  for (size_t i = 0; i < n; ++i) {
    const double x = g[i];
    act[i] = static_cast<T>(0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x))) * u[i]);
  }
}

template <class T>
void swiglu_fwd(const T* g, const T* u, T* act, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const double x = g[i];
    act[i] = static_cast<T>(x / (1.0 + std::exp(-x)) * u[i]);
  }
}

// silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x))).
template <class T>
void swiglu_bwd(const T* g, const T* u, const T* dact, T* dg, T* du, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const double x = g[i];
    const double sig = 1.0 / (1.0 + std::exp(-x));
    dg[i] = static_cast<T>(static_cast<double>(dact[i]) * u[i] * sig * (1.0 + x * (1.0 - sig)));
    du[i] = static_cast<T>(static_cast<double>(dact[i]) * x * sig);
  }
}

// --- softmax ------------------------------------------------------------------------

namespace {
thread_local std::vector<double> tl_softmax;  // (e) one row's exponentials
}  // namespace

template <class T>
void softmax_fwd(const T* logits, T* probs, int n, int e) {
  double* ex = scratch(tl_softmax, static_cast<size_t>(std::max(e, 0)));
  for (int r = 0; r < n; ++r) {
    const T* l = logits + static_cast<size_t>(r) * e;
    T* p = probs + static_cast<size_t>(r) * e;
    double mx = -std::numeric_limits<double>::infinity();
    for (int i = 0; i < e; ++i) mx = std::max(mx, static_cast<double>(l[i]));
    double sum = 0;
    for (int i = 0; i < e; ++i) {
      ex[i] = std::exp(l[i] - mx);
      sum += ex[i];
    }
    for (int i = 0; i < e; ++i) p[i] = static_cast<T>(ex[i] / sum);
  }
}

template <class T>
void softmax_bwd(const T* probs, const T* dprobs, T* dlogits, int n, int e) {
  for (int r = 0; r < n; ++r) {
    const T* p = probs + static_cast<size_t>(r) * e;
    const T* dp = dprobs + static_cast<size_t>(r) * e;
    T* dl = dlogits + static_cast<size_t>(r) * e;
    double dot = 0;
    for (int i = 0; i < e; ++i) dot += static_cast<double>(p[i]) * dp[i];
    for (int i = 0; i < e; ++i) dl[i] = static_cast<T>(p[i] * (dp[i] - dot));
  }
}

// --- top-k --------------------------------------------------------------------------

template <class T>
void topk_fwd(const T* probs, int32_t* idx, T* weights, int n, int e, int k, bool norm_topk) {
  SPILLWAY_CHECK(k >= 1 && k <= e, "topk: k is {}; must be in [1, {}]", k, e);
  for (int r = 0; r < n; ++r) {
    const T* p = probs + static_cast<size_t>(r) * e;
    int32_t* ix = idx + static_cast<size_t>(r) * k;
    T* wt = weights + static_cast<size_t>(r) * k;
    for (int s = 0; s < k; ++s) {
      // The largest not yet chosen; strict > keeps the lower index on ties.
      int best = -1;
      for (int x = 0; x < e; ++x) {
        if (std::find(ix, ix + s, x) != ix + s) continue;
        if (best < 0 || p[x] > p[best]) best = x;
      }
      ix[s] = best;
    }
    double sum = 0;
    for (int s = 0; s < k; ++s) sum += p[ix[s]];
    for (int s = 0; s < k; ++s) wt[s] = norm_topk ? static_cast<T>(p[ix[s]] / sum) : p[ix[s]];
  }
}

// With norm_topk, w_s = p_s / S, S = sum_s p_s: dp_s = (dw_s - sum_j dw_j w_j) / S.
template <class T>
void topk_bwd(const T* probs, const int32_t* idx, const T* dweights, T* dprobs, int n, int e, int k,
              bool norm_topk) {
  for (int r = 0; r < n; ++r) {
    const T* p = probs + static_cast<size_t>(r) * e;
    const int32_t* ix = idx + static_cast<size_t>(r) * k;
    const T* dw = dweights + static_cast<size_t>(r) * k;
    T* dp = dprobs + static_cast<size_t>(r) * e;
    std::fill_n(dp, e, T(0));
    if (!norm_topk) {
      for (int s = 0; s < k; ++s) dp[ix[s]] = dw[s];
      continue;
    }
    double sum = 0;
    for (int s = 0; s < k; ++s) sum += p[ix[s]];
    double dot = 0;
    for (int s = 0; s < k; ++s) dot += static_cast<double>(dw[s]) * (p[ix[s]] / sum);
    for (int s = 0; s < k; ++s) dp[ix[s]] = static_cast<T>((dw[s] - dot) / sum);
  }
}

// --- MoE routing --------------------------------------------------------------------

void moe_route(const int32_t* idx, int n, int k, int experts, int32_t* perm, int32_t* offsets) {
  std::fill_n(offsets, experts + 1, 0);
  const int assignments = n * k;
  for (int a = 0; a < assignments; ++a) {
    SPILLWAY_CHECK(idx[a] >= 0 && idx[a] < experts,
                   "moe_route: expert index {} (token {}, slot {}) not in [0, {})", idx[a], a / k,
                   a % k, experts);
    ++offsets[idx[a] + 1];
  }
  for (int x = 0; x < experts; ++x) offsets[x + 1] += offsets[x];
  // offsets[x] serves as expert x's cursor; afterwards it holds x's end = x + 1's start.
  for (int a = 0; a < assignments; ++a) perm[offsets[idx[a]]++] = a;
  for (int x = experts; x > 0; --x) offsets[x] = offsets[x - 1];
  offsets[0] = 0;
}

template <class T>
void moe_dispatch_fwd(const T* x, const int32_t* perm, T* xd, int rows, int k, int d) {
  for (int r = 0; r < rows; ++r) {
    std::copy_n(x + static_cast<size_t>(perm[r] / k) * d, d, xd + static_cast<size_t>(r) * d);
  }
}

template <class T>
void moe_dispatch_bwd(const T* dxd, const int32_t* perm, T* dx, int rows, int k, int d) {
  for (int r = 0; r < rows; ++r) {
    T* row = dx + static_cast<size_t>(perm[r] / k) * d;
    const T* g = dxd + static_cast<size_t>(r) * d;
    for (int i = 0; i < d; ++i) row[i] += g[i];
  }
}

template <class T>
void moe_combine_fwd(const T* residual, const T* eo, const T* weights, const int32_t* inv, T* y,
                     int n, int k, int d) {
  for (int t = 0; t < n; ++t) {
    const T* res = residual + static_cast<size_t>(t) * d;
    T* yr = y + static_cast<size_t>(t) * d;
    for (int i = 0; i < d; ++i) {
      T acc = res[i];
      for (int s = 0; s < k; ++s) {
        const size_t a = static_cast<size_t>(t) * k + s;
        acc += weights[a] * eo[static_cast<size_t>(inv[a]) * d + i];
      }
      yr[i] = acc;
    }
  }
}

template <class T>
void moe_combine_bwd(const T* eo, const T* weights, const int32_t* inv, const T* dy, T* deo,
                     T* dweights, int n, int k, int d) {
  for (int t = 0; t < n; ++t) {
    const T* g = dy + static_cast<size_t>(t) * d;
    for (int s = 0; s < k; ++s) {
      const size_t a = static_cast<size_t>(t) * k + s;
      const T* e = eo + static_cast<size_t>(inv[a]) * d;
      T* de = deo + static_cast<size_t>(inv[a]) * d;
      double dot = 0;
      for (int i = 0; i < d; ++i) {
        dot += static_cast<double>(g[i]) * e[i];
        de[i] = weights[a] * g[i];
      }
      dweights[a] = static_cast<T>(dot);
    }
  }
}

// --- loss and residual --------------------------------------------------------------

template <class T>
double cross_entropy(const T* logits, const int32_t* targets, T* dlogits, int n, int v) {
  double loss = 0;
  for (int r = 0; r < n; ++r) {
    const T* l = logits + static_cast<size_t>(r) * v;
    T* dl = dlogits + static_cast<size_t>(r) * v;
    double mx = -std::numeric_limits<double>::infinity();
    for (int i = 0; i < v; ++i) mx = std::max(mx, static_cast<double>(l[i]));
    double sum = 0;
    for (int i = 0; i < v; ++i) sum += std::exp(l[i] - mx);
    const double lse = mx + std::log(sum);
    loss += lse - l[targets[r]];
    for (int i = 0; i < v; ++i) {
      const double p = std::exp(l[i] - lse);
      dl[i] = static_cast<T>((p - (i == targets[r] ? 1.0 : 0.0)) / n);
    }
  }
  return loss / n;
}

template <class T>
void add(const T* a, const T* b, T* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

// --- instantiations -----------------------------------------------------------------

// T names a type here: it cannot be parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define SPILLWAY_NN_INSTANTIATE(T)                                                                 \
  template void gemm<T>(bool, bool, int, int, int, T, const T*, int, const T*, int, T, T*, int);   \
  template void linear_fwd<T>(const T*, const T*, T*, int, int, int);                              \
  template void linear_bwd<T>(const T*, const T*, const T*, T*, T*, int, int, int, bool);          \
  template void rmsnorm_fwd<T>(const T*, const T*, T*, int, int, double, double);                  \
  template void rmsnorm_bwd<T>(const T*, const T*, const T*, T*, T*, int, int, double);            \
  template void embedding_fwd<T>(const int32_t*, const T*, T*, int, int);                          \
  template void embedding_bwd<T>(const int32_t*, const T*, T*, int, int);                          \
  template void attention_fwd<T>(const T*, T*, T*, int, int, int, int, int, double);               \
  template void attention_bwd<T>(const T*, const T*, const T*, const T*, T*, int, int, int, int,   \
                                 int, double);                                                     \
  template void attention_cached_fwd<T>(const T*, T*, T*, T*, int, int, int, int, int, int,        \
                                        const double*, const double*, T*, const CachedAttention&); \
  template void swiglu_fwd<T>(const T*, const T*, T*, size_t);                                     \
  template void geglu_tanh_fwd<T>(const T*, const T*, T*, size_t);                                 \
  template void swiglu_bwd<T>(const T*, const T*, const T*, T*, T*, size_t);                       \
  template void softmax_fwd<T>(const T*, T*, int, int);                                            \
  template void softmax_bwd<T>(const T*, const T*, T*, int, int);                                  \
  template void topk_fwd<T>(const T*, int32_t*, T*, int, int, int, bool);                          \
  template void topk_bwd<T>(const T*, const int32_t*, const T*, T*, int, int, int, bool);          \
  template void moe_dispatch_fwd<T>(const T*, const int32_t*, T*, int, int, int);                  \
  template void moe_dispatch_bwd<T>(const T*, const int32_t*, T*, int, int, int);                  \
  template void moe_combine_fwd<T>(const T*, const T*, const T*, const int32_t*, T*, int, int,     \
                                   int);                                                           \
  template void moe_combine_bwd<T>(const T*, const T*, const int32_t*, const T*, T*, T*, int, int, \
                                   int);                                                           \
  template double cross_entropy<T>(const T*, const int32_t*, T*, int, int);                        \
  template void add<T>(const T*, const T*, T*, size_t);

SPILLWAY_NN_INSTANTIATE(float)
SPILLWAY_NN_INSTANTIATE(double)
#undef SPILLWAY_NN_INSTANTIATE
// NOLINTEND(bugprone-macro-parentheses)

}  // namespace spillway::nn

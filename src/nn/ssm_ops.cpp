// The reference model's state-space operations (Mamba-2): the causal depthwise convolution
// with SiLU, the selective scan (SSD in its sequential form) with chunk states, and the
// gated RMSNorm. Same invariants as ops.cpp: templates over float and double, reductions in
// double rounded once, fixed loop orders (deterministic), overwritten outputs fully written.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "nn/ops.hpp"
#include "spillway/core/error.hpp"

namespace spillway::nn {

namespace {

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
double softplus(double x) {
  return x > 20.0 ? x : std::log1p(std::exp(x));
}
size_t at(int a, int b) {
  return static_cast<size_t>(a) * static_cast<size_t>(b);
}

}  // namespace

// --- causal depthwise convolution + SiLU ----------------------------------------------

template <class T>
void causal_conv1d_silu_fwd(const T* x, const T* w, const T* bias, T* y, int batch, int seq,
                            int channels, int width) {
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < seq; ++t) {
      const size_t row = at(b * seq + t, channels);
      for (int c = 0; c < channels; ++c) {
        double a = bias != nullptr ? static_cast<double>(bias[c]) : 0.0;
        for (int j = 0; j < width; ++j) {
          const int src = t - (width - 1) + j;
          if (src < 0) continue;
          a += static_cast<double>(w[at(c, width) + static_cast<size_t>(j)]) *
               x[at(b * seq + src, channels) + static_cast<size_t>(c)];
        }
        y[row + static_cast<size_t>(c)] = static_cast<T>(a * sigmoid(a));
      }
    }
  }
}

template <class T>
void causal_conv1d_silu_bwd(const T* x, const T* w, const T* bias, const T* dy, T* dx, T* dw,
                            T* dbias, int batch, int seq, int channels, int width) {
  const size_t n = at(batch * seq, channels);
  std::vector<double> dxa(n, 0.0);
  std::vector<double> dwa(at(channels, width), 0.0);
  std::vector<double> dba(static_cast<size_t>(channels), 0.0);
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < seq; ++t) {
      const size_t row = at(b * seq + t, channels);
      for (int c = 0; c < channels; ++c) {
        double a = bias != nullptr ? static_cast<double>(bias[c]) : 0.0;
        for (int j = 0; j < width; ++j) {
          const int src = t - (width - 1) + j;
          if (src < 0) continue;
          a += static_cast<double>(w[at(c, width) + static_cast<size_t>(j)]) *
               x[at(b * seq + src, channels) + static_cast<size_t>(c)];
        }
        const double s = sigmoid(a);
        const double da =
            static_cast<double>(dy[row + static_cast<size_t>(c)]) * s * (1.0 + a * (1.0 - s));
        dba[static_cast<size_t>(c)] += da;
        for (int j = 0; j < width; ++j) {
          const int src = t - (width - 1) + j;
          if (src < 0) continue;
          const size_t xi = at(b * seq + src, channels) + static_cast<size_t>(c);
          dxa[xi] += static_cast<double>(w[at(c, width) + static_cast<size_t>(j)]) * da;
          dwa[at(c, width) + static_cast<size_t>(j)] += da * x[xi];
        }
      }
    }
  }
  for (size_t i = 0; i < n; ++i) dx[i] = static_cast<T>(dxa[i]);
  for (size_t i = 0; i < dwa.size(); ++i) dw[i] += static_cast<T>(dwa[i]);
  if (dbias != nullptr) {
    for (size_t i = 0; i < dba.size(); ++i) dbias[i] += static_cast<T>(dba[i]);
  }
}

// --- the selective scan ----------------------------------------------------------------

namespace {

// One token of one head's recurrence: S = exp(dt A) S + dt x B^T, y = S C + dskip x (S:
// head_dim x state, updated in place). Both scans run it: the same bits.
template <class T>
void ssd_token(int head_dim, int state, double dt, double decay, double dskip, const T* xt,
               const T* bt, const T* ct, T* st, T* yt) {
  for (int p = 0; p < head_dim; ++p) {
    double out = dskip * xt[p];
    for (int n = 0; n < state; ++n) {
      T& v = st[at(p, state) + static_cast<size_t>(n)];
      v = static_cast<T>(decay * v + dt * static_cast<double>(xt[p]) * bt[n]);
      out += static_cast<double>(v) * ct[n];
    }
    yt[p] = static_cast<T>(out);
  }
}

}  // namespace

template <class T>
void ssd_scan_carry_fwd(const SsdShape& s, const T* x, const T* dt_raw, const T* dt_bias,
                        const T* a_log, const T* bmat, const T* cmat, const T* dskip, T* y,
                        T* state) {
  SPILLWAY_CHECK(s.batch == 1, "ssd_scan_carry_fwd: one sequence at a time, not {}", s.batch);
  const int hp = s.heads * s.head_dim;
  const int gn = s.groups * s.state;
  const int per_group = s.heads / s.groups;
  for (int h = 0; h < s.heads; ++h) {
    const int g = h / per_group;
    const double a_h = -std::exp(static_cast<double>(a_log[h]));
    T* st = state + at(h, s.head_dim * s.state);
    for (int t = 0; t < s.seq; ++t) {
      const auto tok = static_cast<size_t>(t);
      const double dt = softplus(
          static_cast<double>(dt_raw[tok * static_cast<size_t>(s.heads) + static_cast<size_t>(h)]) +
          dt_bias[h]);
      ssd_token(s.head_dim, s.state, dt, std::exp(dt * a_h), static_cast<double>(dskip[h]),
                x + tok * static_cast<size_t>(hp) + at(h, s.head_dim),
                bmat + tok * static_cast<size_t>(gn) + at(g, s.state),
                cmat + tok * static_cast<size_t>(gn) + at(g, s.state), st,
                y + tok * static_cast<size_t>(hp) + at(h, s.head_dim));
    }
  }
}

template <class T>
void ssd_scan_fwd(const SsdShape& s, const T* x, const T* dt_raw, const T* dt_bias, const T* a_log,
                  const T* bmat, const T* cmat, const T* dskip, T* y, T* states) {
  const int hp = s.heads * s.head_dim;
  const int gn = s.groups * s.state;
  const int per_group = s.heads / s.groups;
  const int chunks = s.chunks();
  std::vector<T> st(at(s.head_dim, s.state));
  for (int b = 0; b < s.batch; ++b) {
    for (int h = 0; h < s.heads; ++h) {
      const int g = h / per_group;
      const double a_h = -std::exp(static_cast<double>(a_log[h]));
      std::fill(st.begin(), st.end(), T(0));
      for (int t = 0; t < s.seq; ++t) {
        if (t % s.chunk == 0) {
          T* saved =
              states + at(b * chunks + t / s.chunk, hp * s.state) + at(h, s.head_dim * s.state);
          std::copy(st.begin(), st.end(), saved);
        }
        const size_t tok = (at(b, s.seq) + static_cast<size_t>(t));
        const double dt =
            softplus(static_cast<double>(
                         dt_raw[tok * static_cast<size_t>(s.heads) + static_cast<size_t>(h)]) +
                     dt_bias[h]);
        ssd_token(s.head_dim, s.state, dt, std::exp(dt * a_h), static_cast<double>(dskip[h]),
                  x + tok * static_cast<size_t>(hp) + at(h, s.head_dim),
                  bmat + tok * static_cast<size_t>(gn) + at(g, s.state),
                  cmat + tok * static_cast<size_t>(gn) + at(g, s.state), st.data(),
                  y + tok * static_cast<size_t>(hp) + at(h, s.head_dim));
      }
    }
  }
}

template <class T>
void ssd_scan_bwd(const SsdShape& s, const T* x, const T* dt_raw, const T* dt_bias, const T* a_log,
                  const T* bmat, const T* cmat, const T* dskip, const T* states, const T* dy, T* dx,
                  T* ddt_raw, T* ddt_bias, T* da_log, T* db, T* dc, T* ddskip) {
  const int hp = s.heads * s.head_dim;
  const int gn = s.groups * s.state;
  const int per_group = s.heads / s.groups;
  const int chunks = s.chunks();
  const size_t pn = at(s.head_dim, s.state);
  const size_t tokens = at(s.batch, s.seq);
  std::vector<double> dba(tokens * static_cast<size_t>(gn), 0.0);
  std::vector<double> dca(tokens * static_cast<size_t>(gn), 0.0);
  std::vector<double> ds(pn);
  // The states of one chunk, recomputed from its saved start: (chunk + 1) x P x N, entry 0
  // the state before the chunk's first token.
  std::vector<T> run(static_cast<size_t>(s.chunk + 1) * pn);
  for (int b = 0; b < s.batch; ++b) {
    for (int h = 0; h < s.heads; ++h) {
      const int g = h / per_group;
      const double a_h = -std::exp(static_cast<double>(a_log[h]));
      double d_a = 0.0;  // dL / dA for this head
      double d_bias = 0.0;
      double d_skip = 0.0;
      std::fill(ds.begin(), ds.end(), 0.0);
      for (int c = chunks - 1; c >= 0; --c) {
        const int t0 = c * s.chunk;
        const int t1 = std::min(s.seq, t0 + s.chunk);
        const T* saved = states + at(b * chunks + c, hp * s.state) + at(h, s.head_dim * s.state);
        std::copy(saved, saved + pn, run.begin());
        for (int t = t0; t < t1; ++t) {  // the forward's recurrence, the same bits
          const size_t tok = (at(b, s.seq) + static_cast<size_t>(t));
          const double dt =
              softplus(static_cast<double>(
                           dt_raw[tok * static_cast<size_t>(s.heads) + static_cast<size_t>(h)]) +
                       dt_bias[h]);
          const double decay = std::exp(dt * a_h);
          const T* xt = x + tok * static_cast<size_t>(hp) + at(h, s.head_dim);
          const T* bt = bmat + tok * static_cast<size_t>(gn) + at(g, s.state);
          const T* prev = run.data() + static_cast<size_t>(t - t0) * pn;
          T* cur = run.data() + static_cast<size_t>(t - t0 + 1) * pn;
          for (int p = 0; p < s.head_dim; ++p) {
            for (int n = 0; n < s.state; ++n) {
              const size_t i = at(p, s.state) + static_cast<size_t>(n);
              cur[i] = static_cast<T>(decay * prev[i] + dt * static_cast<double>(xt[p]) * bt[n]);
            }
          }
        }
        for (int t = t1 - 1; t >= t0; --t) {
          const size_t tok = (at(b, s.seq) + static_cast<size_t>(t));
          const size_t hi = tok * static_cast<size_t>(s.heads) + static_cast<size_t>(h);
          const double u = static_cast<double>(dt_raw[hi]) + dt_bias[h];
          const double dt = softplus(u);
          const double decay = std::exp(dt * a_h);
          const T* xt = x + tok * static_cast<size_t>(hp) + at(h, s.head_dim);
          const T* bt = bmat + tok * static_cast<size_t>(gn) + at(g, s.state);
          const T* ct = cmat + tok * static_cast<size_t>(gn) + at(g, s.state);
          const T* gy = dy + tok * static_cast<size_t>(hp) + at(h, s.head_dim);
          const T* st = run.data() + static_cast<size_t>(t - t0 + 1) * pn;
          const T* prev = run.data() + static_cast<size_t>(t - t0) * pn;
          T* gx = dx + tok * static_cast<size_t>(hp) + at(h, s.head_dim);
          double* gb = dba.data() + tok * static_cast<size_t>(gn) + at(g, s.state);
          double* gc = dca.data() + tok * static_cast<size_t>(gn) + at(g, s.state);
          double d_dt = 0.0;
          double d_decay = 0.0;
          for (int p = 0; p < s.head_dim; ++p) {
            const double gyp = gy[p];
            const double xp = xt[p];
            d_skip += gyp * xp;
            double gxp = static_cast<double>(dskip[h]) * gyp;
            for (int n = 0; n < s.state; ++n) {
              const size_t i = at(p, s.state) + static_cast<size_t>(n);
              ds[i] += gyp * ct[n];  // y_t = S_t C_t: now ds is dL / dS_t
              gc[n] += static_cast<double>(st[i]) * gyp;
              gxp += dt * ds[i] * bt[n];
              gb[n] += dt * ds[i] * xp;
              d_dt += ds[i] * xp * bt[n];
              d_decay += ds[i] * prev[i];
              ds[i] *= decay;  // to dL / dS_{t-1}
            }
            gx[p] = static_cast<T>(gxp);
          }
          d_dt += d_decay * decay * a_h;
          d_a += d_decay * decay * dt;
          const double du = d_dt * sigmoid(u);
          ddt_raw[hi] = static_cast<T>(du);
          d_bias += du;
        }
      }
      ddt_bias[h] += static_cast<T>(d_bias);
      da_log[h] += static_cast<T>(d_a * a_h);  // A = -exp(A_log): dA / dA_log = A
      ddskip[h] += static_cast<T>(d_skip);
    }
  }
  for (size_t i = 0; i < dba.size(); ++i) db[i] = static_cast<T>(dba[i]);
  for (size_t i = 0; i < dca.size(); ++i) dc[i] = static_cast<T>(dca[i]);
}

// --- gated RMSNorm ---------------------------------------------------------------------

template <class T>
void gated_rmsnorm_fwd(const T* x, const T* z, const T* w, T* y, int n, int d, double eps) {
  for (int r = 0; r < n; ++r) {
    const size_t row = at(r, d);
    double ss = 0.0;
    for (int i = 0; i < d; ++i) {
      const double zi = z[row + static_cast<size_t>(i)];
      const double h = static_cast<double>(x[row + static_cast<size_t>(i)]) * zi * sigmoid(zi);
      ss += h * h;
    }
    const double inv = 1.0 / std::sqrt(ss / d + eps);
    for (int i = 0; i < d; ++i) {
      const double zi = z[row + static_cast<size_t>(i)];
      const double h = static_cast<double>(x[row + static_cast<size_t>(i)]) * zi * sigmoid(zi);
      y[row + static_cast<size_t>(i)] = static_cast<T>(h * inv * w[i]);
    }
  }
}

template <class T>
void gated_rmsnorm_bwd(const T* x, const T* z, const T* w, const T* dy, T* dx, T* dz, T* dw, int n,
                       int d, double eps) {
  std::vector<double> dwa(static_cast<size_t>(d), 0.0);
  std::vector<double> hrow(static_cast<size_t>(d));
  for (int r = 0; r < n; ++r) {
    const size_t row = at(r, d);
    double ss = 0.0;
    for (int i = 0; i < d; ++i) {
      const double zi = z[row + static_cast<size_t>(i)];
      hrow[static_cast<size_t>(i)] =
          static_cast<double>(x[row + static_cast<size_t>(i)]) * zi * sigmoid(zi);
      ss += hrow[static_cast<size_t>(i)] * hrow[static_cast<size_t>(i)];
    }
    const double inv = 1.0 / std::sqrt(ss / d + eps);
    // y = h inv w: dh = inv (w dy - h inv^2 mean(h w dy)).
    double dot = 0.0;
    for (int i = 0; i < d; ++i) {
      const double g = static_cast<double>(dy[row + static_cast<size_t>(i)]);
      dot += hrow[static_cast<size_t>(i)] * w[i] * g;
      dwa[static_cast<size_t>(i)] += g * hrow[static_cast<size_t>(i)] * inv;
    }
    for (int i = 0; i < d; ++i) {
      const double g = static_cast<double>(dy[row + static_cast<size_t>(i)]);
      const double h = hrow[static_cast<size_t>(i)];
      const double dh = inv * (w[i] * g - h * inv * inv * dot / d);
      const double zi = z[row + static_cast<size_t>(i)];
      const double sg = sigmoid(zi);
      const double xi = x[row + static_cast<size_t>(i)];
      dx[row + static_cast<size_t>(i)] = static_cast<T>(dh * zi * sg);
      dz[row + static_cast<size_t>(i)] = static_cast<T>(dh * xi * sg * (1.0 + zi * (1.0 - sg)));
    }
  }
  for (int i = 0; i < d; ++i) dw[i] += static_cast<T>(dwa[static_cast<size_t>(i)]);
}

// NOLINTBEGIN(bugprone-macro-parentheses)
#define SPILLWAY_SSM_INSTANTIATE(T)                                                                \
  template void causal_conv1d_silu_fwd<T>(const T*, const T*, const T*, T*, int, int, int, int);   \
  template void causal_conv1d_silu_bwd<T>(const T*, const T*, const T*, const T*, T*, T*, T*, int, \
                                          int, int, int);                                          \
  template void ssd_scan_fwd<T>(const SsdShape&, const T*, const T*, const T*, const T*, const T*, \
                                const T*, const T*, T*, T*);                                       \
  template void ssd_scan_carry_fwd<T>(const SsdShape&, const T*, const T*, const T*, const T*,     \
                                      const T*, const T*, const T*, T*, T*);                       \
  template void ssd_scan_bwd<T>(const SsdShape&, const T*, const T*, const T*, const T*, const T*, \
                                const T*, const T*, const T*, const T*, T*, T*, T*, T*, T*, T*,    \
                                T*);                                                               \
  template void gated_rmsnorm_fwd<T>(const T*, const T*, const T*, T*, int, int, double);          \
  template void gated_rmsnorm_bwd<T>(const T*, const T*, const T*, const T*, T*, T*, T*, int, int, \
                                     double);

SPILLWAY_SSM_INSTANTIATE(float)
SPILLWAY_SSM_INSTANTIATE(double)
#undef SPILLWAY_SSM_INSTANTIATE
// NOLINTEND(bugprone-macro-parentheses)

}  // namespace spillway::nn

// HybridGEMM on the host backend (spillway/serve/hybrid_gemm.hpp, Note [HybridGEMM dataflows],
// Note [HybridGEMM arithmetic]): the two dataflows run tile by tile as a GPU kernel would,
// with the tiles packed into scratch buffers (a kernel's registers and shared memory),
// and every byte a tile load or store moves between HBM, the link and the chip counted.
#include "spillway/serve/hybrid_gemm.hpp"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "spillway/core/error.hpp"
#include "spillway/device/device_math.hpp"

namespace spillway {
namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

void check(const HybridGemmProblem& p) {
  if (p.m < 1) SPILLWAY_FIELD_ERROR("m", p.m, "must be >= 1");
  if (p.n < 1) SPILLWAY_FIELD_ERROR("n", p.n, "must be >= 1");
  if (p.k < 1) SPILLWAY_FIELD_ERROR("k", p.k, "must be >= 1");
  if (p.w_dtype != DType::kBf16 && p.w_dtype != DType::kFp32)
    SPILLWAY_FIELD_ERROR("w_dtype", to_string(p.w_dtype), "must be bf16 or fp32");
  if (!(p.alpha >= 0.0 && p.alpha <= 1.0))
    SPILLWAY_FIELD_ERROR("alpha", p.alpha, "must be in [0, 1]");
  for (const GemmTiles* t : {&p.symmetric, &p.asymmetric}) {
    const char* which = t == &p.symmetric ? "symmetric" : "asymmetric";
    if (t->m < 1 || t->n < 1 || t->k < 1)
      SPILLWAY_FIELD_ERROR("tiles", fmt::format("{}x{}x{}", t->m, t->n, t->k),
                           "every {} tile size must be >= 1", which);
  }
  if (p.invariant && (p.symmetric.m != p.asymmetric.m || p.symmetric.n != p.asymmetric.n ||
                      p.symmetric.k != p.asymmetric.k))
    SPILLWAY_FIELD_ERROR("tiles",
                         fmt::format("{}x{}x{} and {}x{}x{}", p.symmetric.m, p.symmetric.n,
                                     p.symmetric.k, p.asymmetric.m, p.asymmetric.n, p.asymmetric.k),
                         "an invariant HybridGEMM needs the same tiles on both paths");
}

int64_t symmetric_columns(const HybridGemmProblem& p) {
  const auto ns = static_cast<int64_t>(std::floor(p.alpha * static_cast<double>(p.n)));
  if (!p.invariant) return ns;
  return ns / p.symmetric.n * p.symmetric.n;  // Note [Invariant HybridGEMM]
}

// The W tile of rows [j0, j0 + tn) and depth [k0, k0 + tk), widened to fp32, packed
// (tn, tk): what crosses the link.
void load_w(const HybridGemmProblem& p, const void* w, int64_t j0, int64_t tn, int64_t k0,
            int64_t tk, float* out) {
  for (int64_t j = 0; j < tn; ++j) {
    const int64_t row = (j0 + j) * p.k + k0;
    if (p.w_dtype == DType::kFp32) {
      std::memcpy(out + j * tk, static_cast<const float*>(w) + row,
                  static_cast<size_t>(tk) * sizeof(float));
    } else {
      const auto* b = static_cast<const uint16_t*>(w) + row;
      for (int64_t k = 0; k < tk; ++k) out[j * tk + k] = bf16_to_float(b[k]);
    }
  }
}

// The X tile of rows [i0, i0 + tm) and depth [k0, k0 + tk), packed (tm, tk): read from HBM.
void load_x(const HybridGemmProblem& p, const float* x, int64_t i0, int64_t tm, int64_t k0,
            int64_t tk, float* out) {
  for (int64_t i = 0; i < tm; ++i)
    std::memcpy(out + i * tk, x + (i0 + i) * p.k + k0, static_cast<size_t>(tk) * sizeof(float));
}

// prod (tm, tn) = xt (tm, tk) * wt (tn, tk)^T: one BLAS call (Note [HybridGEMM arithmetic]).
// Invariant (Note [Invariant HybridGEMM]): one call per row of the tile.
void tile_product(const float* xt, const float* wt, int64_t tm, int64_t tn, int64_t tk, float* prod,
                  bool invariant) {
  if (invariant) {
    for (int64_t i = 0; i < tm; ++i)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, 1, static_cast<int>(tn),
                  static_cast<int>(tk), 1.0f, xt + i * tk, static_cast<int>(tk), wt,
                  static_cast<int>(tk), 0.0f, prod + i * tn, static_cast<int>(tn));
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(tm), static_cast<int>(tn),
              static_cast<int>(tk), 1.0f, xt, static_cast<int>(tk), wt, static_cast<int>(tk), 0.0f,
              prod, static_cast<int>(tn));
}

// The tiles' on-chip buffers, one set per thread, grown to the largest tiles it has seen and
// reused: a GEMM allocates nothing once its thread has run tiles of that size.
struct Scratch {
  std::vector<float> x, w, prod, acc;
  static Scratch& for_tiles(const GemmTiles& t) {
    thread_local Scratch s;
    auto fit = [](std::vector<float>& v, int64_t n) {
      if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
    };
    fit(s.x, t.m * t.k);
    fit(s.w, t.n * t.k);
    fit(s.prod, t.m * t.n);
    fit(s.acc, t.m * t.n);
    return s;
  }
};

// Output-stationary over columns [0, ns).
void run_symmetric(const HybridGemmProblem& p, const float* x, const void* w, float* o, int64_t ns,
                   GemmTraffic& t) {
  const GemmTiles& tl = p.symmetric;
  const int64_t wb = dtype_bytes(p.w_dtype);
  Scratch& s = Scratch::for_tiles(tl);
  for (int64_t i0 = 0; i0 < p.m; i0 += tl.m) {
    const int64_t tm = std::min(tl.m, p.m - i0);
    for (int64_t j0 = 0; j0 < ns; j0 += tl.n) {
      const int64_t tn = std::min(tl.n, ns - j0);
      std::fill_n(s.acc.begin(), tm * tn, 0.0f);
      for (int64_t k0 = 0; k0 < p.k; k0 += tl.k) {
        const int64_t tk = std::min(tl.k, p.k - k0);
        load_x(p, x, i0, tm, k0, tk, s.x.data());
        t.hbm_read_bytes += tm * tk * 4;
        load_w(p, w, j0, tn, k0, tk, s.w.data());
        t.link_bytes += tn * tk * wb;
        tile_product(s.x.data(), s.w.data(), tm, tn, tk, s.prod.data(), p.invariant);
        for (int64_t e = 0; e < tm * tn; ++e)
          s.acc[static_cast<size_t>(e)] += s.prod[static_cast<size_t>(e)];
      }
      for (int64_t i = 0; i < tm; ++i)
        std::memcpy(o + (i0 + i) * p.n + j0, s.acc.data() + i * tn,
                    static_cast<size_t>(tn) * sizeof(float));
      t.hbm_write_bytes += tm * tn * 4;
    }
  }
}

// Weight-stationary over columns [ns, n): O zeroed, then every W tile, once over the link,
// meets all of M and reduce-adds into O.
void run_asymmetric(const HybridGemmProblem& p, const float* x, const void* w, float* o, int64_t ns,
                    GemmTraffic& t) {
  const GemmTiles& tl = p.asymmetric;
  const int64_t wb = dtype_bytes(p.w_dtype);
  const int64_t na = p.n - ns;
  for (int64_t i = 0; i < p.m; ++i) std::fill(o + i * p.n + ns, o + i * p.n + p.n, 0.0f);
  t.hbm_write_bytes += p.m * na * 4;
  Scratch& s = Scratch::for_tiles(tl);
  for (int64_t k0 = 0; k0 < p.k; k0 += tl.k) {
    const int64_t tk = std::min(tl.k, p.k - k0);
    for (int64_t j0 = ns; j0 < p.n; j0 += tl.n) {
      const int64_t tn = std::min(tl.n, p.n - j0);
      load_w(p, w, j0, tn, k0, tk, s.w.data());
      t.link_bytes += tn * tk * wb;
      for (int64_t i0 = 0; i0 < p.m; i0 += tl.m) {
        const int64_t tm = std::min(tl.m, p.m - i0);
        load_x(p, x, i0, tm, k0, tk, s.x.data());
        t.hbm_read_bytes += tm * tk * 4;
        tile_product(s.x.data(), s.w.data(), tm, tn, tk, s.prod.data(), p.invariant);
        for (int64_t i = 0; i < tm; ++i) {  // the reduce-add: read, add, write
          float* row = o + (i0 + i) * p.n + j0;
          for (int64_t j = 0; j < tn; ++j) row[j] += s.prod[static_cast<size_t>(i * tn + j)];
        }
        t.hbm_read_bytes += tm * tn * 4;
        t.hbm_write_bytes += tm * tn * 4;
      }
    }
  }
}

}  // namespace

HybridGemmTraffic hybrid_gemm_traffic(const HybridGemmProblem& p) {
  check(p);
  HybridGemmTraffic r;
  const int64_t ns = symmetric_columns(p);
  const int64_t na = p.n - ns;
  const int64_t wb = dtype_bytes(p.w_dtype);
  r.n_symmetric = ns;
  if (ns > 0) {
    r.symmetric.link_bytes = ceil_div(p.m, p.symmetric.m) * ns * p.k * wb;
    r.symmetric.hbm_read_bytes = ceil_div(ns, p.symmetric.n) * p.m * p.k * 4;
    r.symmetric.hbm_write_bytes = p.m * ns * 4;
  }
  if (na > 0) {
    const int64_t kt = ceil_div(p.k, p.asymmetric.k);
    r.asymmetric.link_bytes = na * p.k * wb;
    r.asymmetric.hbm_read_bytes = ceil_div(na, p.asymmetric.n) * p.m * p.k * 4 + kt * p.m * na * 4;
    r.asymmetric.hbm_write_bytes = (kt + 1) * p.m * na * 4;
  }
  return r;
}

HybridGemmTraffic hybrid_gemm_host(const HybridGemmProblem& p, const float* x, const void* w,
                                   float* o) {
  check(p);
  SPILLWAY_CHECK(x != nullptr && w != nullptr && o != nullptr, "hybrid_gemm_host: null operand");
  HybridGemmTraffic r;
  r.n_symmetric = symmetric_columns(p);
  if (r.n_symmetric > 0) run_symmetric(p, x, w, o, r.n_symmetric, r.symmetric);
  if (r.n_symmetric < p.n) run_asymmetric(p, x, w, o, r.n_symmetric, r.asymmetric);
  return r;
}

}  // namespace spillway

// hybrid_gemm_cuda (spillway/hybrid_gemm.hpp): the problem checked as on the host, the tiles
// checked against the kernels' limits, then the kernels of src/serve/cuda/ (a CUDA build)
// or a clear no (a build without the CUDA backend).
#include <fmt/format.h>

#include <string>

#include "spillway/hybrid_gemm.hpp"

#if SPILLWAY_HAVE_CUDA
#include "serve/cuda/hybrid_gemm_kernels.hpp"
#endif

namespace spillway {

bool hybrid_gemm_cuda(const HybridGemmProblem& p, const float* x, const void* w, float* o,
                      void* stream, std::string* why) {
  const HybridGemmTraffic t = hybrid_gemm_traffic(p);  // checks the problem
#if SPILLWAY_HAVE_CUDA
  for (const GemmTiles* g : {&p.symmetric, &p.asymmetric}) {
    const int64_t shared = (g->m + g->n) * g->k * static_cast<int64_t>(sizeof(float));
    const int64_t outputs = cuda::kHybridGemmOutputsPerThread * cuda::kHybridGemmThreads;
    if (shared > cuda::kHybridGemmSharedBytes || g->m * g->n > outputs) {
      if (why != nullptr)
        *why = fmt::format(
            "tiles {}x{}x{} need {} bytes of shared memory (at most {}) and {} outputs per "
            "block (at most {})",
            g->m, g->n, g->k, shared, cuda::kHybridGemmSharedBytes, g->m * g->n, outputs);
      return false;
    }
  }
  cuda::HybridGemmArgs a;
  a.m = p.m;
  a.n = p.n;
  a.k = p.k;
  a.ns = t.n_symmetric;
  a.w_bf16 = p.w_dtype == DType::kBf16;
  a.sym_m = p.symmetric.m;
  a.sym_n = p.symmetric.n;
  a.sym_k = p.symmetric.k;
  a.asym_m = p.asymmetric.m;
  a.asym_n = p.asymmetric.n;
  a.asym_k = p.asymmetric.k;
  cuda::launch_hybrid_gemm(a, x, w, o, stream);
  return true;
#else
  (void)t;
  (void)x;
  (void)w;
  (void)o;
  (void)stream;
  if (why != nullptr) *why = "this build of spillway has no CUDA backend";
  return false;
#endif
}

}  // namespace spillway

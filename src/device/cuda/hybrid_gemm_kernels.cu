// HybridGEMM's CUDA kernels (spillway/serve/hybrid_gemm.hpp, Note [HybridGEMM dataflows]): X and
// O in device memory, W in mapped host memory that the kernels read in place over the
// link. The arithmetic of a tile is plain fp32 multiply-adds in K order; the host
// implementation's tile products go through BLAS, so the two agree within Note [HybridGEMM
// arithmetic]'s bound, not bitwise (the parity test holds that bound where a GPU exists).
//
//   symmetric   one block per (row tile, column tile) of O in [0, Ns): the K tiles of X
//               (HBM) and W (host, widened to fp32) pass through shared memory; each thread
//               keeps its outputs in registers and writes them once.
//   asymmetric  one block per (column tile in [Ns, N), K tile): the W tile is read once
//               into shared memory and every row tile of X sweeps past it; partial sums are
//               added into O with atomicAdd over the columns zeroed first.
// Both launch on the caller's stream, the asymmetric after the symmetric (running them
// concurrently on disjoint SMs is not done yet).
//
// Note [Counted HybridGEMM kernels]: every kernel is a template on kCount. With it (a
// DeviceHybridGemm with traffic set), each thread counts in registers the bytes of every
// element it loads or stores (X: 4 bytes of HBM read; W: w_bytes over the link; O: 4 bytes
// of HBM write; the asymmetric reduce-add: 4 read and 4 written; the zeroing: 4 written)
// and at its end adds what is non-zero to the path's counters with one atomicAdd each.
// Without it the counting is compiled out (if constexpr): the kernels the server runs do
// no extra work.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "device/cuda/hybrid_gemm_kernels.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device_math.hpp"

namespace spillway::cuda {
namespace {

// The kernels' view of a DeviceHybridGemm: the sizes and tiles by value.
struct HybridGemmArgs {
  int64_t m = 0, n = 0, k = 0;
  int64_t ns = 0;  // columns [0, ns) symmetric, [ns, n) asymmetric
  bool w_bf16 = true;
  int64_t sym_m = 0, sym_n = 0, sym_k = 0;     // symmetric tiles
  int64_t asym_m = 0, asym_n = 0, asym_k = 0;  // asymmetric tiles
};

constexpr int kThreads = kHybridGemmThreads;

__device__ int64_t lmin(int64_t a, int64_t b) {
  return a < b ? a : b;
}

__device__ float w_at(const void* w, bool bf16, int64_t i) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(w)[i]) : static_cast<const float*>(w)[i];
}

// The counters of DeviceHybridGemm::traffic, in its order.
enum Counter { kSymLink = 0, kSymRead, kSymWrite, kAsymLink, kAsymRead, kAsymWrite };

// A thread's bytes, added once at its end (Note [Counted HybridGEMM kernels]).
__device__ void add_count(unsigned long long* counters, int which, unsigned long long bytes) {
  if (bytes != 0) atomicAdd(&counters[which], bytes);
}

// Shared: X tile (tm, tk) then W tile (tn, tk). counters: null unless kCount.
template <bool kCount>
__global__ void symmetric_kernel(HybridGemmArgs p, const float* x, const void* w, float* o,
                                 unsigned long long* counters) {
  const int64_t ns = p.ns;
  extern __shared__ float smem[];
  const int64_t tm = p.sym_m, tn = p.sym_n, tk = p.sym_k;
  float* xs = smem;
  float* ws = smem + tm * tk;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * tm;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * tn;
  const int64_t rows = lmin(tm, p.m - i0), cols = lmin(tn, ns - j0);
  const bool bf16 = p.w_bf16;
  const unsigned long long w_bytes = bf16 ? 2 : 4;
  unsigned long long link = 0, read = 0, write = 0;  // bytes this thread moved (kCount)
  // Each thread owns outputs e = threadIdx.x, + kThreads, ... of the rows x cols tile; at
  // most 16 of them (the launcher checks tm * tn <= 16 * kThreads).
  float acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = 0.0f;
  for (int64_t k0 = 0; k0 < p.k; k0 += tk) {
    const int64_t depth = lmin(tk, p.k - k0);
    for (int64_t e = threadIdx.x; e < rows * depth; e += blockDim.x) {
      xs[(e / depth) * tk + e % depth] = x[(i0 + e / depth) * p.k + k0 + e % depth];
      if constexpr (kCount) read += 4;
    }
    for (int64_t e = threadIdx.x; e < cols * depth; e += blockDim.x) {
      ws[(e / depth) * tk + e % depth] = w_at(w, bf16, (j0 + e / depth) * p.k + k0 + e % depth);
      if constexpr (kCount) link += w_bytes;
    }
    __syncthreads();
    int r = 0;
    for (int64_t e = threadIdx.x; e < rows * cols; e += blockDim.x, ++r) {
      const int64_t i = e / cols, j = e % cols;
      float s = 0.0f;
      for (int64_t k = 0; k < depth; ++k) s += xs[i * tk + k] * ws[j * tk + k];
      acc[r] += s;
    }
    __syncthreads();
  }
  int r = 0;
  for (int64_t e = threadIdx.x; e < rows * cols; e += blockDim.x, ++r) {
    o[(i0 + e / cols) * p.n + j0 + e % cols] = acc[r];
    if constexpr (kCount) write += 4;
  }
  if constexpr (kCount) {
    add_count(counters, kSymLink, link);
    add_count(counters, kSymRead, read);
    add_count(counters, kSymWrite, write);
  }
}

// The asymmetric path's columns of O zeroed; counted as its HBM writes.
template <bool kCount>
__global__ void zero_columns_kernel(float* o, int64_t m, int64_t n, int64_t ns,
                                    unsigned long long* counters) {
  const int64_t na = n - ns;
  unsigned long long write = 0;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < m * na;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    o[(e / na) * n + ns + e % na] = 0.0f;
    if constexpr (kCount) write += 4;
  }
  if constexpr (kCount) add_count(counters, kAsymWrite, write);
}

// Shared: W tile (tn, tk) then X tile (tm, tk). counters: null unless kCount.
template <bool kCount>
__global__ void asymmetric_kernel(HybridGemmArgs p, const float* x, const void* w, float* o,
                                  unsigned long long* counters) {
  const int64_t ns = p.ns;
  extern __shared__ float smem[];
  const int64_t tm = p.asym_m, tn = p.asym_n, tk = p.asym_k;
  float* ws = smem;
  float* xs = smem + tn * tk;
  const int64_t j0 = ns + static_cast<int64_t>(blockIdx.x) * tn;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * tk;
  const int64_t cols = lmin(tn, p.n - j0), depth = lmin(tk, p.k - k0);
  const bool bf16 = p.w_bf16;
  const unsigned long long w_bytes = bf16 ? 2 : 4;
  unsigned long long link = 0, read = 0, write = 0;  // bytes this thread moved (kCount)
  for (int64_t e = threadIdx.x; e < cols * depth; e += blockDim.x) {
    ws[(e / depth) * tk + e % depth] = w_at(w, bf16, (j0 + e / depth) * p.k + k0 + e % depth);
    if constexpr (kCount) link += w_bytes;
  }
  __syncthreads();
  for (int64_t i0 = 0; i0 < p.m; i0 += tm) {
    const int64_t rows = lmin(tm, p.m - i0);
    for (int64_t e = threadIdx.x; e < rows * depth; e += blockDim.x) {
      xs[(e / depth) * tk + e % depth] = x[(i0 + e / depth) * p.k + k0 + e % depth];
      if constexpr (kCount) read += 4;
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < rows * cols; e += blockDim.x) {
      const int64_t i = e / cols, j = e % cols;
      float s = 0.0f;
      for (int64_t k = 0; k < depth; ++k) s += xs[i * tk + k] * ws[j * tk + k];
      atomicAdd(&o[(i0 + i) * p.n + j0 + j], s);
      if constexpr (kCount) {  // the reduce-add reads and writes its element
        read += 4;
        write += 4;
      }
    }
    __syncthreads();
  }
  if constexpr (kCount) {
    add_count(counters, kAsymLink, link);
    add_count(counters, kAsymRead, read);
    add_count(counters, kAsymWrite, write);
  }
}

void launch_check(const char* what) {
  const cudaError_t err = cudaGetLastError();
  SPILLWAY_CHECK(err == cudaSuccess, "hybrid_gemm: the {} launch failed: {} ({})", what,
                 cudaGetErrorName(err), cudaGetErrorString(err));
}

// Both paths on stream s; counters null unless kCount (Note [Counted HybridGEMM kernels]).
template <bool kCount>
void launch_paths(const HybridGemmArgs& a, const float* x, const void* w, float* o,
                  unsigned long long* counters, cudaStream_t s) {
  if (a.ns > 0) {
    const dim3 grid(static_cast<unsigned>((a.ns + a.sym_n - 1) / a.sym_n),
                    static_cast<unsigned>((a.m + a.sym_m - 1) / a.sym_m));
    const size_t shared = static_cast<size_t>((a.sym_m + a.sym_n) * a.sym_k) * sizeof(float);
    symmetric_kernel<kCount><<<grid, kThreads, shared, s>>>(a, x, w, o, counters);
    launch_check("symmetric");
  }
  if (a.ns < a.n) {
    zero_columns_kernel<kCount><<<128, kThreads, 0, s>>>(o, a.m, a.n, a.ns, counters);
    launch_check("zeroing");
    const dim3 grid(static_cast<unsigned>((a.n - a.ns + a.asym_n - 1) / a.asym_n),
                    static_cast<unsigned>((a.k + a.asym_k - 1) / a.asym_k));
    const size_t shared = static_cast<size_t>((a.asym_m + a.asym_n) * a.asym_k) * sizeof(float);
    asymmetric_kernel<kCount><<<grid, kThreads, shared, s>>>(a, x, w, o, counters);
    launch_check("asymmetric");
  }
}

}  // namespace

void launch_hybrid_gemm(const DeviceHybridGemm& d, void* stream) {
  HybridGemmArgs a;
  a.m = d.m;
  a.n = d.n;
  a.k = d.k;
  a.ns = d.n_symmetric;
  a.w_bf16 = d.w_bf16;
  a.sym_m = d.symmetric.m;
  a.sym_n = d.symmetric.n;
  a.sym_k = d.symmetric.k;
  a.asym_m = d.asymmetric.m;
  a.asym_n = d.asymmetric.n;
  a.asym_k = d.asymmetric.k;
  const float* x = d.x;
  const void* w = d.w;
  float* o = d.o;
  auto* s = static_cast<cudaStream_t>(stream);
  // int64 counters added to as unsigned 64-bit: the same bits for counts below 2^63.
  static_assert(sizeof(unsigned long long) == sizeof(int64_t));
  auto* counters = reinterpret_cast<unsigned long long*>(d.traffic);
  if (counters != nullptr) {
    launch_paths<true>(a, x, w, o, counters, s);
  } else {
    launch_paths<false>(a, x, w, o, nullptr, s);
  }
}

}  // namespace spillway::cuda

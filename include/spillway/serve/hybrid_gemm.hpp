// HybridGEMM (docs/serve.md): O[M x N] = X[M x K] * W^T, X and O in device memory (HBM),
// W in host memory the device reads over the link. W is stored as a Linear layer's weight,
// [N x K] row-major (row j holds output column j's K weights), bf16 or fp32; X and O are
// fp32 row-major.
//
// Note [HybridGEMM dataflows]: the first Ns = floor(alpha * N) columns go to the symmetric
// path, the rest (Na = N - Ns) to the asymmetric one; each path has its tile sizes
// (tm x tn output tiles, tk deep).
//   - Symmetric (output-stationary): per O tile, an accumulator of tm x tn stays on chip
//     while the K tiles of X (from HBM) and of W (over the link) stream through; the tile
//     is written once. W crosses the link once per row tile of O.
//       link  = ceil(M / tm) * Ns * K * w_bytes
//       HBM   = ceil(Ns / tn) * M * K * 4   (X read)  +  M * Ns * 4   (O written)
//   - Asymmetric (weight-stationary): each W tile (tn x tk) crosses the link once and
//     stays on chip while all of M sweeps past it, reading the X tile from HBM and
//     reduce-adding its partial product into O in HBM (read, add, write: an atomic add on
//     a GPU) over an O zeroed first.
//       link  = Na * K * w_bytes
//       HBM   = ceil(Na / tn) * M * K * 4   (X read)
//             + ceil(K / tk) * M * Na * 4   (O read)
//             + (ceil(K / tk) + 1) * M * Na * 4   (O written: the zeroing, then every K tile)
// Edge tiles count their real sizes; the formulas above are exact for every shape
// (hybrid_gemm_traffic computes them; the host implementation counts what it moves, the
// device's kernels count it too when asked (hybrid_gemm_counted_on_device), and the tests
// hold the counts equal to the formulas).
//
// Note [HybridGEMM arithmetic]: every tile product X_tile * W_tile^T is one BLAS call on
// the tile (packed contiguous, W widened to fp32) into a scratch tile, added to the
// output in K-tile order. The two paths make the same calls when their tiles are the same
// and alpha splits on a tile boundary: then they compute the same bits (tested). Otherwise
// a column's tile products come from calls of other widths, whose summation order is
// BLAS's: every alpha is within |error| <= 2 * K * 2^-24 * sum_k |x_k w_k| of the exact
// product (tested), not bitwise across alphas.
#pragma once

#include <cstdint>
#include <string>

#include "spillway/catalog/inventory.hpp"
#include "spillway/device/device.hpp"

namespace spillway {

struct GemmTiles {
  int64_t m = 64;  // output rows per tile
  int64_t n = 64;  // output columns per tile
  int64_t k = 64;  // depth per tile
};

struct GemmTraffic {
  int64_t link_bytes = 0;       // host -> device over the link (W)
  int64_t hbm_read_bytes = 0;   // X, and O for the asymmetric path's reduce-adds
  int64_t hbm_write_bytes = 0;  // O
  int64_t hbm_bytes() const { return hbm_read_bytes + hbm_write_bytes; }
};

struct HybridGemmTraffic {
  int64_t n_symmetric = 0;  // floor(alpha * N) columns on the symmetric path
  GemmTraffic symmetric, asymmetric;
  GemmTraffic total() const {
    return {symmetric.link_bytes + asymmetric.link_bytes,
            symmetric.hbm_read_bytes + asymmetric.hbm_read_bytes,
            symmetric.hbm_write_bytes + asymmetric.hbm_write_bytes};
  }
};

struct HybridGemmProblem {
  int64_t m = 0, n = 0, k = 0;
  DType w_dtype = DType::kBf16;  // kBf16 or kFp32
  double alpha = 0.0;            // [0, 1]
  GemmTiles symmetric, asymmetric;
  // Note [Invariant HybridGEMM]: outputs that depend on neither the other rows of X nor
  // alpha (what a server needs for a request's tokens not to depend on what it is batched
  // with, or on the controller). Both paths must have the same tiles (checked); the split
  // is rounded down to a tile boundary, Ns = floor(floor(alpha N) / tn) * tn, so that the
  // two paths make the same calls on every column; and on the host every tile product is
  // made one row of X at a time, so that a row's bits do not depend on how many rows share
  // its tile. Traffic is counted as for any split (the formulas with that Ns). On CUDA the
  // symmetric kernel is row-invariant by construction (a thread's dot products run in a
  // fixed order); the asymmetric one reduce-adds its K tiles with atomics in an order the
  // hardware picks, so there only alpha = 1 is invariant.
  bool invariant = false;
};

// The closed-form traffic of Note [HybridGEMM dataflows] (checked problem).
HybridGemmTraffic hybrid_gemm_traffic(const HybridGemmProblem& p);

// The host backend's HybridGEMM: runs the real tiles of both paths (tile products through
// BLAS) and counts the traffic as the dataflows move it. x: (M, K) fp32, w: (N, K) of
// p.w_dtype, o: (M, N) fp32, all row-major and dense.
HybridGemmTraffic hybrid_gemm_host(const HybridGemmProblem& p, const float* x, const void* w,
                                   float* o);

// Note [HybridGEMM as a device operation]: the GPU kernels of both paths are the device's
// (Device::hybrid_gemm; the CUDA backend's in src/device/cuda/), as AdamW is; this checks
// the problem, then enqueues them on s: x and o in device memory, w in mapped host memory
// the kernels read in place. The traffic is hybrid_gemm_traffic(p)'s, not counted here:
// the kernels the server runs do no work beyond the product. Returns false and says why,
// launching nothing, when the device has no such operation (the host backend:
// hybrid_gemm_host computes the same product); tiles beyond the kernels' limits throw
// InputError naming them, before any launch.
bool hybrid_gemm_on_device(Device& device, const HybridGemmProblem& p, const float* x,
                           const void* w, float* o, Stream s, std::string* why);

// The same product with the device counting its traffic (DeviceHybridGemm::traffic): six
// counters in device memory, zeroed on s, added to by every load and store of the kernels,
// copied back; returns once s has run all of it (it synchronizes s), with *counted the
// bytes the kernels moved (n_symmetric: the closed form's). The counters are freed on
// every path, an exception's included, after the work that uses them. Returns false with
// *why, and *counted untouched, when the device has no such operation or cannot allocate
// 48 bytes of device memory.
bool hybrid_gemm_counted_on_device(Device& device, const HybridGemmProblem& p, const float* x,
                                   const void* w, float* o, Stream s, HybridGemmTraffic* counted,
                                   std::string* why);

}  // namespace spillway

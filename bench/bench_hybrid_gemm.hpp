// HybridGEMM's benchmark (`spillway bench hybrid-gemm`): per alpha, the bytes the device's
// HybridGEMM moves, counted as it runs, against the closed form (Note [HybridGEMM
// dataflows]), and the link bandwidth it achieves against a plain copy of the same weights
// over the same link measured in the same run.
//
// Method:
//   problem      O (m x n) = X (m x k) * W^T, W (n x k) bf16 or fp32; the tiles and the
//                invariant split of the serving engine (inference::PooledWeights: 64x64x64
//                on both paths) unless given; inputs uniform in [-1, 1], a fixed seed.
//   counted      per alpha, one run that counts its traffic: the host backend's
//                hybrid_gemm_host (what it returns), CUDA's counting kernels
//                (hybrid_gemm_counted_on_device). Every field must equal
//                hybrid_gemm_traffic's: a difference is an error naming the alpha, the field
//                and both values (after the report is written).
//   correctness  that run's O, poisoned with NaN first, must be finite everywhere and within
//                Note [HybridGEMM arithmetic]'s bound (CUDA: twice it, as its parity test) of
//                a double dot product at `check_points` random elements; a mismatch throws
//                naming the alpha, the element and both values. Nothing is timed before.
//   limit        one sample per repeat: the W bytes copied host -> device from pinned
//                memory on a copy stream of the device's own (CUDA), or memcpy'd between
//                two pre-touched host buffers (the host backend: its device memory is host
//                memory and its "link" is this machine's memory).
//   timing       uncounted runs (what the server runs): on CUDA, steady_clock around the
//                enqueue and a stream synchronize (launch overhead included: tens of
//                microseconds); on the host, around the call. Each repeat takes one limit
//                sample, then one run of every alpha (interleaved: bandwidth drifts);
//                figures are medians.
//   figures      link GB/s = the run's link bytes (1e9 bytes/s) / its median time;
//                fraction_of_copy = that / the copy's median GB/s.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/serve/hybrid_gemm.hpp"

namespace spillway {

struct HybridGemmBenchOptions {
  std::string backend = "host";  // "host" (hybrid_gemm_host) or "cuda" (device 0's kernels)
  int64_t m = 16;                // a decode-sized batch
  int64_t n = 4096;
  int64_t k = 4096;
  DType w_dtype = DType::kBf16;
  std::vector<double> alphas = {0.0, 0.25, 0.5, 0.75, 1.0};
  GemmTiles tiles{64, 64, 64};  // both paths (the serving engine's)
  bool invariant = true;        // Note [Invariant HybridGEMM], as the serving engine runs it
  int repeats = 5;
  int check_points = 64;  // per alpha
  uint64_t seed = 7;
};

struct HybridGemmBenchRow {
  double alpha = 0.0;
  HybridGemmTraffic counted;      // by the run
  HybridGemmTraffic closed_form;  // hybrid_gemm_traffic
  bool equal = false;             // every field
  double ms = 0.0;                // median of the uncounted runs
  std::vector<double> samples_ms;
  double link_gbps = 0.0;             // closed_form.total().link_bytes / ms
  double fraction_of_copy = 0.0;      // link_gbps / the copy's median
  double max_error_over_bound = 0.0;  // of the checked elements: |error| / bound, <= 1
};

struct HybridGemmBenchResult {
  HybridGemmBenchOptions options;
  std::string device;  // what ran the GEMMs
  std::string limit;   // what the copy is, in words
  int64_t w_bytes = 0;
  double copy_gbps = 0.0;  // median
  std::vector<double> copy_samples_gbps;
  int64_t elements_checked = 0;
  std::vector<HybridGemmBenchRow> rows;  // one per alpha, in the options' order
  bool all_equal() const;
};

// Throws spillway::Error on bad options (naming the field and the value), when the inputs
// would not fit in this machine's memory, when an output is wrong, or (CUDA) when there is
// no CUDA device; a count that differs from the closed form is a row with equal false.
HybridGemmBenchResult run_hybrid_gemm_bench(const HybridGemmBenchOptions& options);
// Throws spillway::Error naming the first alpha whose count differs, the field and both
// values; nothing when every row is equal.
void check_hybrid_gemm_bench(const HybridGemmBenchResult& result);
// spillway.bench.hybrid-gemm/1: the problem, the limit, and per alpha the counted and
// closed-form traffic, equal, ms, link_gbps and fraction_of_copy.
std::string hybrid_gemm_bench_json(const HybridGemmBenchResult& result);
// The table: per alpha link MB counted and closed form, equal, ms, link GB/s and the
// fraction of the copy.
std::string format_hybrid_gemm_bench(const HybridGemmBenchResult& result);

}  // namespace spillway

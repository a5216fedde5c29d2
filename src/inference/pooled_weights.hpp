// A slice's view of a pooled model (Note [Serving engine]): the decoder's weights read in
// place from the pool's mapped host memory, every Linear through HybridGEMM on the slice in
// its invariant form (Note [Served determinism]); the traffic and times of an iteration
// summed for the metrics and the alpha controller.
#pragma once

#include <cstdint>
#include <vector>

#include "spillway/inference/inference.hpp"
#include "spillway/nn/decoder.hpp"
#include "spillway/serve/hybrid_gemm.hpp"
#include "spillway/serve/serve.hpp"
#include "spillway/serve/slices.hpp"

namespace spillway::inference {

struct IterationTraffic {
  int64_t link_bytes = 0;
  int64_t hbm_bytes = 0;
  double link_ms = 0.0;  // summed over the iteration's GEMMs
  double hbm_ms = 0.0;
};

class PooledWeights final : public nn::WeightSource {
 public:
  // Every weight of weight_specs(c) from its parts in the handle (resolve_checkpoint's, Note
  // [Checkpoint resolution]); a BF16 vector (norms, the embedding) is widened once here. A
  // weight of several parts (q, k, v) is multiplied part by part into a buffer of max_rows
  // rows sized here, then laid out as the fused weight's output.
  PooledWeights(const ModelHandle& handle, const nn::RefConfig& c, EmulatedSlice& slice,
                const ResolvedWeights& parts, int max_rows);
  const float* values(int weight) override;
  void linear(int weight, const float* x, float* y, int n, int in, int out) override;

  void begin_iteration(double alpha);
  const IterationTraffic& iteration() const { return it_; }

  // The tiles of every serving GEMM (both paths alike: Note [Invariant HybridGEMM]).
  static constexpr GemmTiles kTiles{64, 64, 64};

 private:
  struct Part {
    const void* host = nullptr;
    int rows = 0;  // of the weight's output columns
  };
  void gemm(const Part& part, DType dtype, const float* x, float* y, int n, int in);
  EmulatedSlice& slice_;
  std::vector<std::vector<Part>> parts_;
  std::vector<const void*> host_;  // the first part's
  std::vector<DType> dtype_;
  std::vector<float> split_;                 // a split weight's outputs, part by part
  std::vector<std::vector<float>> widened_;  // per weight read as values: bf16 or in parts
  double alpha_ = 0.0;
  IterationTraffic it_;
};

}  // namespace spillway::inference

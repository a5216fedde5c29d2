#include "server/pooled_weights.hpp"

#include "spillway/device_math.hpp"
#include "spillway/error.hpp"

namespace spillway::server {

PooledWeights::PooledWeights(const ModelHandle& handle, const nn::RefConfig& c,
                             EmulatedSlice& slice)
    : slice_(slice) {
  const std::vector<nn::WeightSpec> specs = nn::weight_specs(c);
  host_.resize(specs.size());
  dtype_.resize(specs.size());
  widened_.resize(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const PooledTensor& t = handle.tensor(specs[i].name);
    host_[i] = t.host;
    dtype_[i] = t.dtype;
    if (!specs[i].linear && t.dtype == DType::kBf16) {
      const auto* b = reinterpret_cast<const uint16_t*>(t.host);
      std::vector<float>& w = widened_[i];
      w.resize(static_cast<size_t>(specs[i].elements()));
      for (size_t k = 0; k < w.size(); ++k) w[k] = bf16_to_float(b[k]);
    }
  }
}

const float* PooledWeights::values(int weight) {
  const auto i = static_cast<size_t>(weight);
  SPILLWAY_CHECK(i < host_.size(), "PooledWeights: weight {} of {}", weight, host_.size());
  if (!widened_[i].empty()) return widened_[i].data();
  SPILLWAY_CHECK(dtype_[i] == DType::kFp32, "PooledWeights: weight {} is not fp32", weight);
  return static_cast<const float*>(host_[i]);
}

void PooledWeights::linear(int weight, const float* x, float* y, int n, int in, int out) {
  const auto i = static_cast<size_t>(weight);
  SPILLWAY_CHECK(i < host_.size(), "PooledWeights: weight {} of {}", weight, host_.size());
  HybridGemmProblem p{n, out, in, dtype_[i], alpha_, kTiles, kTiles};
  p.invariant = true;
  const SliceGemmTiming t = slice_.gemm(p, x, host_[i], y);
  const GemmTraffic tr = t.traffic.total();
  it_.link_bytes += tr.link_bytes;
  it_.hbm_bytes += tr.hbm_bytes();
  it_.link_ms += t.link_ms;
  it_.hbm_ms += t.hbm_ms;
  it_.gemm_ms += t.elapsed_ms;
  ++it_.gemms;
}

void PooledWeights::begin_iteration(double alpha) {
  alpha_ = alpha;
  it_ = IterationTraffic{};
}

}  // namespace spillway::server

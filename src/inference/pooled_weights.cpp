#include "inference/pooled_weights.hpp"

#include <algorithm>
#include <cstring>

#include "spillway/core/error.hpp"
#include "spillway/device/device_math.hpp"

namespace spillway::inference {

namespace {

// A part's place in the pooled tensor (Note [Checkpoint resolution]): its first byte, its
// rows and their width (the tensor viewed as a matrix of its last dimension's width).
struct PartView {
  const std::byte* host = nullptr;
  int64_t rows = 0, width = 0;
};
PartView view(const ModelHandle& handle, const WeightPart& part) {
  const PooledTensor& pt = handle.tensor(part.tensor);
  const int64_t width = pt.shape.empty() ? 1 : pt.shape.back();
  int64_t all = 1;
  for (size_t d = 0; d + 1 < pt.shape.size(); ++d) all *= pt.shape[d];
  const int64_t rows = part.rows > 0 ? part.rows : all;
  SPILLWAY_CHECK(part.row >= 0 && part.row + rows <= all,
                 "PooledWeights: rows {}..{} of {}, which has {}", part.row, part.row + rows - 1,
                 part.tensor, all);
  const int64_t elem = pt.dtype == DType::kBf16 ? 2 : 4;
  return {pt.host + part.row * width * elem, rows, width};
}

}  // namespace

PooledWeights::PooledWeights(const ModelHandle& handle, const nn::RefConfig& c,
                             EmulatedSlice& slice, const ResolvedWeights& parts, int max_rows)
    : slice_(slice) {
  const std::vector<nn::WeightSpec> specs = nn::weight_specs(c);
  SPILLWAY_CHECK(parts.size() == specs.size(), "PooledWeights: {} resolved weights for {}",
                 parts.size(), specs.size());
  host_.resize(specs.size());
  dtype_.resize(specs.size());
  widened_.resize(specs.size());
  parts_.resize(specs.size());
  size_t split = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    for (const WeightPart& part : parts[i])
      parts_[i].push_back({view(handle, part).host, static_cast<int>(view(handle, part).rows)});
    if (parts_[i].size() > 1)
      split = std::max(split,
                       static_cast<size_t>(max_rows) * static_cast<size_t>(specs[i].shape.front()));
    const PooledTensor& t = handle.tensor(parts[i].front().tensor);
    host_[i] = parts_[i].front().host;
    dtype_[i] = t.dtype;
    // A weight read as values (a norm, a bias): fp32 in one piece, its parts (q, k and v
    // biases) one after the other.
    if (!specs[i].linear && (t.dtype == DType::kBf16 || parts[i].size() > 1)) {
      std::vector<float>& w = widened_[i];
      w.reserve(static_cast<size_t>(specs[i].elements()));
      for (const WeightPart& part : parts[i]) {
        const PooledTensor& pt = handle.tensor(part.tensor);
        const PartView v = view(handle, part);
        const auto n = static_cast<size_t>(v.rows * v.width);
        if (pt.dtype == DType::kBf16) {
          const auto* b = reinterpret_cast<const uint16_t*>(v.host);
          for (size_t k = 0; k < n; ++k) w.push_back(bf16_to_float(b[k]));
        } else {
          const auto* f = reinterpret_cast<const float*>(v.host);
          w.insert(w.end(), f, f + n);
        }
      }
      SPILLWAY_CHECK(w.size() == static_cast<size_t>(specs[i].elements()),
                     "PooledWeights: weight {} has {} values, not {}", specs[i].name, w.size(),
                     specs[i].elements());
    }
  }
  split_.resize(split);
}

void PooledWeights::gemm(const Part& part, DType dtype, const float* x, float* y, int n, int in) {
  HybridGemmProblem p{n, part.rows, in, dtype, alpha_, kTiles, kTiles};
  p.invariant = true;
  const SliceGemmTiming t = slice_.gemm(p, x, part.host, y);
  const GemmTraffic tr = t.traffic.total();
  it_.link_bytes += tr.link_bytes;
  it_.hbm_bytes += tr.hbm_bytes();
  it_.link_ms += t.link_ms;
  it_.hbm_ms += t.hbm_ms;
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
  const std::vector<Part>& ps = parts_[i];
  if (ps.size() == 1) {
    gemm(ps.front(), dtype_[i], x, y, n, in);
    return;
  }
  // Part by part (Note [Checkpoint resolution]), each into its own block of the buffer,
  // then row by row into the fused layout: a row's parts side by side.
  SPILLWAY_CHECK(static_cast<size_t>(n) * static_cast<size_t>(out) <= split_.size(),
                 "PooledWeights: {} rows of a split weight; sized for {}", n,
                 split_.size() / static_cast<size_t>(out));
  size_t at = 0;
  int col = 0;
  for (const Part& part : ps) {
    float* block = split_.data() + at;
    gemm(part, dtype_[i], x, block, n, in);
    for (int r = 0; r < n; ++r)
      std::memcpy(y + static_cast<size_t>(r) * static_cast<size_t>(out) + col,
                  block + static_cast<size_t>(r) * static_cast<size_t>(part.rows),
                  static_cast<size_t>(part.rows) * sizeof(float));
    at += static_cast<size_t>(n) * static_cast<size_t>(part.rows);
    col += part.rows;
  }
  SPILLWAY_CHECK(col == out, "PooledWeights: split weight {} gives {} columns, not {}", weight, col,
                 out);
}

void PooledWeights::begin_iteration(double alpha) {
  alpha_ = alpha;
  it_ = IterationTraffic{};
}

}  // namespace spillway::inference

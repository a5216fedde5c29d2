// JSON helpers of the benchmarks: a figure that came out NaN or infinite (a zero-length
// sample, a division by a zero baseline) is written as 0, so scripts always read numbers.
#pragma once

#include <cmath>
#include <nlohmann/json.hpp>
#include <vector>

namespace spillway::bench_json {

using Json = nlohmann::ordered_json;

inline double finite(double v) {
  return std::isfinite(v) ? v : 0.0;
}

inline Json finite_all(const std::vector<double>& v) {
  Json a = Json::array();
  for (double x : v) a.push_back(finite(x));
  return a;
}

}  // namespace spillway::bench_json

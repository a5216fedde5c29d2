// Small measurement helpers shared by every part, the benchmarks and `spillway train`: a
// steady clock timer, timestamps, and the median of samples.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace spillway {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Milliseconds on the steady clock (an arbitrary epoch): timestamps that host callbacks
// take on several threads and that are only ever subtracted.
inline double now_ms() {
  return std::chrono::duration<double, std::milli>(Clock::now().time_since_epoch()).count();
}

// The median (the mean of the middle two for an even count); 0 for no samples.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace spillway

// Checked byte arithmetic and the human-readable unit formats of reports.
#include "spillway/core/units.hpp"

#include <fmt/format.h>

#include "spillway/core/error.hpp"

namespace spillway {

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    SPILLWAY_INPUT_ERROR("{} overflows 64 bits: {} * {}", what, a, b);
  }
  return out;
}

int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) {
    SPILLWAY_INPUT_ERROR("{} overflows 64 bits: {} + {}", what, a, b);
  }
  return out;
}

std::string to_string(Bytes b) {
  const double gb = b.gb();
  if (gb >= 1.0 || gb <= -1.0) return fmt::format("{:.2f} GB", gb);
  return fmt::format("{:.1f} MB", static_cast<double>(b.count) / 1e6);
}

std::string to_string(Seconds s) {
  if (s.value >= 1.0) return fmt::format("{:.2f} s", s.value);
  return fmt::format("{:.1f} ms", s.ms());
}

std::string to_string(GBps bw) {
  return fmt::format("{:.0f} GB/s", bw.value);
}

}  // namespace spillway

// The range of every numeric flag: stated in --help and enforced when the command line is
// parsed. See Note [Every numeric flag has a range] in ranges.cpp.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

namespace spillway::tool {

// Common bounds: a host memory amount in MiB up to 1 TiB, repeats of a measurement.
inline constexpr double kMaxHostMiB = 1048576.0;
inline constexpr int kMaxRepeats = 1000;
// The emulations' rate factors and links (Note [Checked rate durations] in
// spillway/device/device.hpp): below these a run takes days, and far below, its times overflow.
inline constexpr double kMinRateScale = 1e-6;    // serve, bench serve: every rate times this
inline constexpr double kMinRunLinkGbps = 1e-3;  // an emulated link a run streams through
// A run whose emulated transfers alone would take longer is refused before it starts,
// with the numbers and the flag to change.
inline constexpr double kMaxRunSeconds = 3600.0;

struct FlagRange {
  double lo = 0.0;
  double hi = 0.0;
  bool lo_open = false;        // (lo, hi]: lo itself is refused
  std::optional<double> also;  // one value outside [lo, hi] with a meaning of its own
  std::string hi_text;         // an upper bound that depends on the input, checked later
};

// Closed range [lo, hi].
inline FlagRange closed(double lo, double hi) {
  return FlagRange{lo, hi, false, {}, {}};
}
// [lo, hi] or the sentinel `also` (0: no throttle; -1: chosen by the run).
inline FlagRange closed_or(double lo, double hi, double also) {
  return FlagRange{lo, hi, false, also, {}};
}
// (lo, hi]
inline FlagRange open_closed(double lo, double hi) {
  return FlagRange{lo, hi, true, {}, {}};
}
// [lo, <hi_text>]: the upper bound depends on the model or the run; the library checks it.
inline FlagRange up_to(double lo, std::string hi_text) {
  return FlagRange{lo, 0.0, false, {}, std::move(hi_text)};
}

// " [lo, hi]", " (lo, hi]", " [lo, hi] or S", " [lo, the model's layers]".
std::string range_text(const FlagRange& r);

// Appends range_text(r) to the option's description and refuses a value outside it while
// parsing: spillway::InputError "--flag is V; must be in [lo, hi]" (exit 1). Returns opt.
CLI::Option* in_range(CLI::Option* opt, const FlagRange& r);

}  // namespace spillway::tool

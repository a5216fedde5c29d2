// What the pieces of the trace replay share (replay.cpp: the replay on the engine;
// replay_report.cpp: its report): the percentile of a set of latencies.
#pragma once

#include <vector>

namespace spillway::serve::detail {

// The q-quantile (0..1) of `v`, interpolated between its nearest ranks; 0 when empty.
double percentile(std::vector<double> v, double q);

}  // namespace spillway::serve::detail

// The weight streamer's benchmark (`spillway bench stream`), on the host backend with a
// throttled link (an emulated device: its copy engine is a thread doing memmove then
// waiting out the link's schedule, and a layer's compute is a timed wait on the compute
// stream, as a GPU's kernel takes device time, plus a read of the layer's first and last
// words so that a wrong slot fails).
//
//   overhead    L layers of B bytes streamed with depth d against the same steps with every
//               layer resident in device memory, same run, interleaved; the link time per
//               layer (B / link) below the compute time per layer. Target: <= 3% step time.
//               Also the copy stream's achieved bandwidth against the link's figure (the
//               probe's, for this emulated link: its throttle). Target: >= 0.9. Both
//               beside this machine's memcpy, measured in the same run: a link faster than
//               it cannot be reached, and the report says the machine is the limit.
//   sharded     N = 2 and 4 emulated GPUs behind one link (Note [Shared host links]), each
//               rank on its own thread: full copy (every rank pulls every layer) against
//               sharded (each pulls 1/N, the host group's all-gather assembles it): step
//               time and bytes per rank over the link (expected: N times fewer).
// Figures are medians over steps after a warm-up step.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace spillway {

struct StreamBenchOptions {
  int layers = 16;
  size_t layer_bytes = size_t{16} << 20;
  double compute_ms = 4.0;  // per layer
  double link_gbps = 5.0;   // B / link = 3.4 ms per 16 MiB layer: below compute
  int depth = 2;
  int steps = 6;  // the first is the warm-up
  std::vector<int> ranks = {2, 4};
};

struct StreamBenchResult {
  StreamBenchOptions options;
  double resident_ms = 0.0;  // median step, all layers resident
  double streamed_ms = 0.0;  // median step, streamed
  double overhead = 0.0;     // streamed / resident - 1
  double achieved_gbps = 0.0;
  double stall_ms = 0.0;  // per step
  // This machine's memcpy through the host backend's copy engine, measured in the same run
  // (the probe on an unthrottled device, one layer per copy): the ceiling of any emulated
  // link (Note [The machine is the limit] in spillway/probe/probe.hpp). 0: not measured.
  double memcpy_gbps = 0.0;
  struct Sharded {
    int ranks = 0;
    double full_ms = 0.0, sharded_ms = 0.0;            // median step, slowest rank
    double full_rank_gb = 0.0, sharded_rank_gb = 0.0;  // per step per rank over the link
  };
  std::vector<Sharded> sharded;
};

void check_stream_bench_options(const StreamBenchOptions& o);
StreamBenchResult run_stream_bench(const StreamBenchOptions& o);
std::string format_stream_bench(const StreamBenchResult& r);
std::string stream_bench_json(const StreamBenchResult& r);

}  // namespace spillway

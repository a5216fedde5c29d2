// Host-resident serving's benchmark (`spillway bench serve`), on emulated MIG slices of a
// catalog GPU (Note [Emulated MIG slices]: every rate of the hardware times one scale
// factor, so ratios are the hardware's and times are its times divided by the factor).
//
//   switch    a model of L layers (each an N x K bf16 Linear) in the pool, another model
//             active: re-pointing a slice at it (the pool's acquire: no byte copied) and
//             its first token (one decode step, M = 1, every layer through HybridGEMM from
//             host memory), against reloading the same weights into the slice's device
//             memory over the link and the first token from HBM, same run; and the cold
//             start: the model from disk into the pool, then its first token.
//   alpha     one GEMM (M x N x K, bf16 weights) on every slice of a MIG profile at once
//             (the GPU's 1-, 3- and 7-way profiles: their slices share its link), at each
//             alpha: the slowest
//             slice's time, link bytes (all slices), HBM bytes per slice, and which alpha
//             wins for that slice count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spillway {

struct ServeBenchOptions {
  std::string hardware = "gh200";
  double rate_scale = 1e-4;  // every rate of the hardware times this
  int64_t m = 128, n = 1024, k = 1024;
  std::vector<double> alphas = {0.0, 0.25, 0.5, 0.75, 1.0};
  // Empty: the hardware's own 1-, 3- and 7-way profiles (on a GH200: 7g.96gb, 2g.24gb,
  // 1g.12gb); the first one also runs the switch.
  std::vector<std::string> profiles;
  int switch_layers = 8;  // the switched model: this many N x K layers
  // A run whose link time alone would pass this is refused before it starts, naming the
  // numbers and --rate-scale (Note [Checked rate durations]).
  double max_seconds = 3600.0;
};

struct ServeBenchResult {
  ServeBenchOptions options;
  double link_gbps = 0.0;  // the scaled link
  struct Switch {
    int64_t weight_bytes = 0;
    double switch_ms = 0.0;                 // acquire + first token, emulated
    double reload_ms = 0.0;                 // copy into device memory + first token, emulated
    int64_t switch_device_allocations = 0;  // device allocations during the switch: 0
    int64_t switch_device_bytes = 0;        // device memory it took (peak growth): 0
    double hardware_switch_ms = 0;          // the same at the hardware's rates (times rate_scale)
    double hardware_reload_ms = 0;
    double cold_ms = 0.0;  // from disk into the pool, then the first token
    double hardware_cold_ms = 0.0;
    double disk_gbps = 0.0;  // the cold load's read rate (this machine's disk)
  } sw;
  struct Point {
    double alpha = 0.0;
    double slowest_ms = 0.0;
    int64_t link_bytes = 0;                                // all slices
    int64_t hbm_bytes = 0;                                 // per slice
    double link_ms = 0.0, hbm_ms = 0.0, compute_ms = 0.0;  // the slowest slice's parts
    bool overrun = false;
  };
  struct Sweep {
    std::string profile;
    int slices = 0;
    std::vector<Point> points;
    double best_alpha = 0.0;
  };
  std::vector<Sweep> sweeps;
};

// The profiles a run sweeps: o.profiles, or those the hardware has (see above); an error
// naming the hardware when it has no MIG profiles.
std::vector<std::string> serve_bench_profiles(const ServeBenchOptions& o);
ServeBenchResult run_serve_bench(const ServeBenchOptions& o);
std::string format_serve_bench(const ServeBenchResult& r);
std::string serve_bench_json(const ServeBenchResult& r);

}  // namespace spillway

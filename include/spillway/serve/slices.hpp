// MIG slices on the host backend (docs/serve.md): each slice an emulated device with its
// own device memory, HBM bandwidth and compute rate; all of them behind one throttled host
// link whose bandwidth they share, as the slices of a GH200 share its NVLink-C2C.
//
// Note [Emulated MIG slices]: a slice runs HybridGEMM's real tiles (hybrid_gemm_host: the
// results are real) and is then held until the time the slice would have taken: its link
// bytes are booked on the shared link (HostLink, Note [Shared host links]) in chunks as
// they would stream, so co-running slices' transfers interleave and slow each other; its
// HBM bytes take hbm_bytes / hbm_gbps and its FLOPs flops / gflops, overlapped with the
// transfer (a kernel streams, reads HBM and computes at once); the GEMM ends at the latest
// of the three. The emulation runs on a machine far slower than a GPU, so every rate of a
// setup is scaled by one factor (rate_scale): the ratios between link, HBM and compute,
// which decide which dataflow wins, are the hardware's, and every time is the hardware's
// divided by the factor. The real tile work must stay well below the emulated time (it
// overlaps it; a run whose real work exceeds it reports the overrun).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "spillway/catalog/hardware.hpp"
#include "spillway/device/device.hpp"
#include "spillway/serve/hybrid_gemm.hpp"

namespace spillway {

struct SliceSpec {
  std::string profile;    // "1g.12gb", ...
  int64_t hbm_bytes = 0;  // the slice's device memory
  double hbm_gbps = 0.0;  // its HBM bandwidth, GB/s
  double gflops = 0.0;    // its dense bf16 compute rate, GFLOP/s
};

struct SliceSetup {
  std::vector<SliceSpec> slices;
  double link_gbps = 0.0;  // the shared host->device link, GB/s
  double rate_scale = 1.0;
};

// The slices of one GPU of `hw` cut by its MIG profile `profile` ("1g.12gb": 7 slices),
// each slice's HBM bandwidth, compute rate (the GPU's, times the slice's share of its SMs)
// and the link (the profile's typical host->device figure) times rate_scale; memory times
// memory_scale. Names the profiles a GPU has when `profile` is not one of them.
SliceSetup mig_slices(const HardwareProfile& hw, const std::string& profile, double rate_scale,
                      double memory_scale);

struct SliceGemmTiming {
  HybridGemmTraffic traffic;
  double link_ms = 0.0;     // when its last link chunk ended, from the start
  double hbm_ms = 0.0;      // its HBM bytes at the slice's bandwidth
  double compute_ms = 0.0;  // its FLOPs at the slice's rate
  double elapsed_ms = 0.0;  // the GEMM, start to end (the latest of the three, or the real
                            // work if longer: overrun)
  bool overrun = false;     // the real tile work took longer than the emulated time
};

class EmulatedSlice {
 public:
  // `link` is the slices' shared link; the slice's device memory is an arena of
  // spec.hbm_bytes behind it.
  EmulatedSlice(const SliceSpec& spec, std::shared_ptr<HostLink> link);
  ~EmulatedSlice();
  EmulatedSlice(const EmulatedSlice&) = delete;
  EmulatedSlice& operator=(const EmulatedSlice&) = delete;

  const SliceSpec& spec() const { return spec_; }
  Device& device() { return *dev_; }

  // HybridGEMM on this slice (Note [Emulated MIG slices]); one caller per slice at a time,
  // slices on their own threads.
  SliceGemmTiming gemm(const HybridGemmProblem& p, const float* x, const void* w, float* o);

 private:
  SliceSpec spec_;
  std::shared_ptr<HostLink> link_;
  std::unique_ptr<Device> dev_;
};

}  // namespace spillway

// Hardware profiles: one GPU's HBM and compute, its host link per direction (nominal and
// typical measured, device->host and host->device apart), how many GPUs share that
// link, the GPU-to-GPU fabric collectives cross (NVLink domain, scale-out network), host
// memory and MIG slices. Catalog profiles live in data/hardware/ (embedded in
// the binary); users pass their own file with the same schema (spillway.hardware/1).
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "spillway/core/units.hpp"

namespace spillway {

struct MigProfile {
  std::string profile;  // e.g. "1g.12gb"
  int count = 0;        // how many such slices fit one GPU
  double hbm_gb = 0.0;
  int sms = 0;
  double hbm_tbps = 0.0;
};

// The fabric between GPUs (the "interconnect" object of a profile; absent = the defaults:
// no NVLink, a 25 GB/s network per GPU, 10 us per ring step). Per GPU, per direction.
struct Interconnect {
  double nvlink_gbps = 0.0;             // NVLink to the other GPUs of its domain; 0 = none
  int gpus_per_nvlink_domain = 1;       // GPUs one NVLink fabric joins (8 HGX, 72 NVL72); 1 = none
  double network_gbps = 25.0;           // scale-out NIC(s) per GPU (400 Gb/s = 50 GB/s)
  double collective_latency_us = 10.0;  // per step of a ring (see spillway/plan/collectives.hpp)
};

// Note [Efficiency curves]: the roofline divides FLOPs by peak x efficiency, and the
// efficiency depends on the kernel's shape. Each curve is a list of (abscissa, efficiency)
// points, abscissae strictly increasing, efficiencies in (0, 1]; between points the
// efficiency is linear in log(abscissa), outside them it is clamped to the end points.
//   gemm          a dense GEMM (M x K) by (K x N): x = min(M, N, K). For training GEMMs
//                 (M = tokens, thousands) that is the narrower weight dimension.
//   grouped_gemm  the expert GEMMs of an MoE layer, run as one grouped GEMM over the
//                 experts on the GPU: x = min(tokens per expert, N, K) of one expert's GEMM
//                 (few tokens per expert, or narrow fine-grained experts, run far below a
//                 dense GEMM of the same FLOPs).
//   attention     fused (flash) attention: x = the average number of keys a query attends
//                 to ((seq_len + 1) / 2 for causal attention, about the window with a
//                 sliding window).
//   hbm           memory-bound kernels: one fraction of HBM bandwidth.
// A profile without curves gets flat ones equal to the former constants (0.70 for both
// GEMM curves, 0.50 attention, 0.80 HBM). Calibration points (a profile's "ops") replace
// the curve's points inside their range (plan.hpp, MeasuredOp).
struct EfficiencyCurve {
  std::vector<std::pair<double, double>> points;  // (abscissa, efficiency)
  double at(double x) const;                      // interpolated in log(x), clamped
};

struct EfficiencyCurves {
  EfficiencyCurve gemm{{{1.0, 0.70}}};
  EfficiencyCurve grouped_gemm{{{1.0, 0.70}}};
  EfficiencyCurve attention{{{1.0, 0.50}}};
  double hbm = 0.80;
};

// Checks a curve: at least one point, abscissae > 0 and strictly increasing, efficiencies
// in (0, 1]. `field` names it in the message ("efficiency.gemm").
void check_efficiency_curve(const EfficiencyCurve& curve, const std::string& field);

struct HardwareProfile {
  std::string name;
  std::string description;
  std::string source;      // file path or data/hardware/<name>.json
  bool projected = false;  // figures of an unreleased part
  double hbm_gb = 0.0;
  double hbm_tbps = 0.0;
  int sms = 0;
  TFlops bf16_dense;
  TFlops fp8_dense;
  std::string link_kind;  // "pcie-gen5-x16", "nvlink-c2c", ...
  // What one GPU achieves alone on its host link, per direction.
  GBps d2h_nominal, h2d_nominal, d2h_typical, h2d_typical;
  int gpus_per_link = 1;  // GPUs sharing one host link (switch uplink / root port)
  Interconnect interconnect;
  double host_memory_gb = 0.0;
  int gpus_per_host_memory = 1;
  std::vector<MigProfile> mig;
  EfficiencyCurves efficiency;  // Note [Efficiency curves]
  std::string notes;
};

HardwareProfile parse_hardware_profile(const nlohmann::json& doc, const std::string& file);
// A catalog name ("gh200") or a path to a profile JSON file.
HardwareProfile load_hardware(const std::string& name_or_path);
// The names of the embedded profiles, sorted.
std::vector<std::string> hardware_names();
// The fabric in one line: "NVLink 450 GB/s x 8 GPUs, network 50 GB/s, 5 us/step" or
// "no NVLink, network 25 GB/s, 10 us/step" (per GPU, per direction).
std::string describe_interconnect(const Interconnect& ic);

}  // namespace spillway

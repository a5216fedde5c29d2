// Hardware profiles: one GPU's HBM and compute, its host link per direction (nominal and
// typical measured, device->host and host->device apart), how many GPUs share that
// link, the GPU-to-GPU fabric collectives cross (NVLink domain, scale-out network), host
// memory and MIG slices. Catalog profiles live in data/hardware/ (embedded in
// the binary); users pass their own file with the same schema (spillway.hardware/1).
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "spillway/units.hpp"

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
  double collective_latency_us = 10.0;  // per step of a ring (see spillway/collectives.hpp)
};

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

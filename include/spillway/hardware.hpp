// Hardware profiles: one GPU's HBM and compute, its host link per direction (nominal and
// typical measured, device->host and host->device apart), how many GPUs share that
// link, host memory and MIG slices. Catalog profiles live in data/hardware/ (embedded in
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

}  // namespace spillway

// Request builders and small queries shared by the planner tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>

#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway::testing {

// Models and profiles are parsed once per test binary.
inline const ModelConfig& model(const std::string& name) {
  static std::map<std::string, ModelConfig> cache;
  auto it = cache.find(name);
  if (it == cache.end()) it = cache.emplace(name, load_model(name)).first;
  return it->second;
}

inline const HardwareProfile& hardware(const std::string& name) {
  static std::map<std::string, HardwareProfile> cache;
  auto it = cache.find(name);
  if (it == cache.end()) it = cache.emplace(name, load_hardware(name)).first;
  return it->second;
}

inline PlanRequest request(const std::string& model_name, const std::string& hw, int64_t mb,
                           int64_t seq, Policy s) {
  PlanRequest r;
  r.model = model(model_name);
  r.hardware = hardware(hw);
  r.work.shape.micro_batch = mb;
  r.work.shape.seq_len = seq;
  r.strategy = s;
  return r;
}

// An HBM budget and host memory so large that only the forward windows decide feasibility.
inline PlanRequest generous(PlanRequest r) {
  r.hbm_budget_gb = 1e6;
  r.hardware.host_memory_gb = 1e9;
  return r;
}

inline int64_t max_offload_bytes(const Plan& p) {
  int64_t m = 0;
  for (const LayerPlan& l : p.layers) m = std::max(m, l.offload_bytes);
  return m;
}

inline bool any_snowball(const Plan& p) {
  return std::any_of(p.layers.begin(), p.layers.end(),
                     [](const LayerPlan& l) { return l.snowball; });
}

inline std::string describe(const PlanRequest& r) {
  return r.model.name + " on " + r.hardware.name + " mb " +
         std::to_string(r.work.shape.micro_batch) + " seq " + std::to_string(r.work.shape.seq_len) +
         " tp " + std::to_string(r.work.shape.tp) + " strategy " + to_string(r.strategy) +
         " margin " + std::to_string(r.margin) +
         (r.d2h_gbps ? " d2h " + std::to_string(*r.d2h_gbps) : "");
}

}  // namespace spillway::testing

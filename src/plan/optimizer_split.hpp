// The GPU/CPU split of optimizer offload, planned (DESIGN section 4, docs/optim.md): one
// gradient bucket per layer, arriving as backward passes it (last layer first); on the CPU
// a bucket costs its gradient copy down, its AdamW step at the measured CPU rate
// (`spillway bench adam`) and its weight copy up; on the device its AdamW step at HBM
// speed after backward; its fp32 state (12 bytes per parameter) needs free HBM. The split
// is optim::choose_device_buckets over those timings.
#pragma once

#include <cstdint>

#include "spillway/plan.hpp"

namespace spillway {

struct OptimizerSplit {
  int layers = 0;            // buckets (one per layer of this stage)
  int layers_on_device = 0;  // the last to arrive (the first layers), stepped on the GPU
  double backward_ms = 0.0;  // of one micro-batch, from the plan
  double end_ms = 0.0;       // the optimizer step's end with that split, from backward's start
  double cpu_only_ms = 0.0;  // with every layer on the CPU
  int64_t device_state_bytes = 0;
  int64_t free_hbm_bytes = 0;  // budget - peak + the optimizer states offload removes
  double cpu_adam_gbps = 0.0;  // state traffic rate of the CPU AdamW (28 bytes per element)
};

// `cpu_adam_gbps` > 0 (the figure of `spillway bench adam`); throws spillway::Error
// naming it otherwise.
OptimizerSplit plan_optimizer_split(const Plan& plan, const PlanRequest& request,
                                    double cpu_adam_gbps);

}  // namespace spillway

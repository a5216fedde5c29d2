// The planned GPU/CPU split of optimizer offload: see optimizer_split.hpp.
#include "plan/optimizer_split.hpp"

#include <algorithm>
#include <vector>

#include "optim/offload_pipeline.hpp"
#include "spillway/error.hpp"

namespace spillway {

OptimizerSplit plan_optimizer_split(const Plan& plan, const PlanRequest& request,
                                    double cpu_adam_gbps) {
  if (!(cpu_adam_gbps > 0.0))
    SPILLWAY_INPUT_ERROR(
        "--cpu-adam-gbps is {}; must be > 0 (the state GB/s `spillway bench adam` reports)",
        cpu_adam_gbps);
  OptimizerSplit s;
  s.cpu_adam_gbps = cpu_adam_gbps;
  s.layers = static_cast<int>(plan.layers.size());
  const double d2h = plan.summary.d2h_gbps > 0 ? plan.summary.d2h_gbps : 1.0;
  const double h2d = plan.summary.h2d_gbps > 0 ? plan.summary.h2d_gbps : 1.0;
  const double hbm_gbps = request.hardware.hbm_tbps * 1e3 * request.efficiency.hbm;
  std::vector<optim::BucketTiming> arrival;  // last layer first
  double t = 0.0;
  for (int l = s.layers - 1; l >= 0; --l) {
    const LayerPlan& lp = plan.layers[static_cast<size_t>(l)];
    t += lp.bwd_ms + lp.recompute_ms;
    const double params = static_cast<double>(lp.params);
    optim::BucketTiming b;
    b.arrive_ms = t;
    // bf16 gradients down, 28 bytes of state per element on the CPU, bf16 weights up.
    b.cpu_ms =
        params * 2 / (d2h * 1e6) + params * 28 / (cpu_adam_gbps * 1e6) + params * 2 / (h2d * 1e6);
    b.device_ms = hbm_gbps > 0 ? params * 28 / (hbm_gbps * 1e6) : 0.0;
    b.state_bytes = 12 * lp.params;
    arrival.push_back(b);
  }
  s.backward_ms = t;
  // Offloaded, the optimizer states leave HBM: what they took is free for the split.
  s.free_hbm_bytes =
      std::max<int64_t>(0, plan.summary.hbm_budget_bytes - plan.summary.peak.total() +
                               plan.summary.peak.optimizer_states);
  const optim::SplitChoice c = optim::choose_device_buckets(arrival, t, s.free_hbm_bytes);
  s.layers_on_device = c.device_buckets;
  s.end_ms = c.end_ms;
  s.cpu_only_ms = c.cpu_only_ms;
  for (int i = 0; i < c.device_buckets; ++i)
    s.device_state_bytes += arrival[arrival.size() - 1 - static_cast<size_t>(i)].state_bytes;
  return s;
}

}  // namespace spillway

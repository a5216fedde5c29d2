// The planned GPU/CPU split of optimizer offload (include/spillway/plan/plan.hpp): the bucket
// timings of a plan and the pure arithmetic that chooses the split from them.
#include <algorithm>
#include <vector>

#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {

OptimizerSplit plan_optimizer_split(const Plan& plan, const PlanRequest& request,
                                    double cpu_adam_gbps) {
  if (!(cpu_adam_gbps >= PlanLimits::kMinGbps && cpu_adam_gbps <= PlanLimits::kMaxGbps))
    SPILLWAY_FIELD_ERROR("cpu_adam_gbps", cpu_adam_gbps,
                         "must be in [{}, {}] (the state GB/s `spillway bench adam` reports)",
                         PlanLimits::kMinGbps, PlanLimits::kMaxGbps);
  OptimizerSplit s;
  s.cpu_adam_gbps = cpu_adam_gbps;
  s.layers = static_cast<int>(plan.layers.size());
  const double d2h = (plan.summary.d2h_gbps > 0 ? plan.summary.d2h_gbps : 1.0) * 1e6;  // B/ms
  const double h2d = (plan.summary.h2d_gbps > 0 ? plan.summary.h2d_gbps : 1.0) * 1e6;
  const double cpu = cpu_adam_gbps * 1e6;
  const double hbm =
      request.hardware.hbm_tbps * 1e9 * hbm_efficiency(request.hardware, request.efficiency);
  // Where to cast (docs/optim.md): bf16 over the link with both casts on the CPU (2 + 2
  // bytes of CPU work at its state rate), or fp32 over the link (4 bytes each way) with the
  // casts on the GPU; whichever moves a parameter sooner.
  const double host_cast = 2.0 / d2h + 2.0 / h2d + 4.0 / cpu;
  const double device_cast = 4.0 / d2h + 4.0 / h2d;
  s.cast_on_host = host_cast <= device_cast;
  const double per_param_ms = 28.0 / cpu + std::min(host_cast, device_cast);
  // The optimizer state this GPU holds: its ZeRO shard (stage >= 1) of each layer.
  const int64_t dp = request.zero >= 1 ? request.work.dp : 1;
  std::vector<BucketTiming> arrival;  // last layer first
  double t = 0.0;
  for (int l = s.layers - 1; l >= 0; --l) {
    const LayerPlan& lp = plan.layers[static_cast<size_t>(l)];
    t += lp.stall_ms + lp.recompute_ms + lp.bwd_ms;
    const int64_t shard = (lp.params + dp - 1) / dp;
    const double params = static_cast<double>(shard);
    BucketTiming b;
    b.arrive_ms = t;
    b.cpu_ms = params * per_param_ms;
    b.device_ms = params * 28.0 / hbm;
    b.state_bytes = 12 * shard;
    s.cpu_total_ms += b.cpu_ms;
    arrival.push_back(b);
  }
  s.backward_ms = t;
  // Offloaded, the optimizer states leave HBM: what they took is free for the split.
  s.free_hbm_bytes =
      std::max<int64_t>(0, plan.summary.hbm_budget_bytes - plan.summary.peak.total() +
                               plan.summary.peak.optimizer_states);
  const SplitChoice c = choose_device_buckets(arrival, t, s.free_hbm_bytes);
  s.layers_on_device = c.device_buckets;
  s.end_ms = c.end_ms;
  s.cpu_only_ms = c.cpu_only_ms;
  for (int i = 0; i < c.device_buckets; ++i)
    s.device_state_bytes += arrival[arrival.size() - 1 - static_cast<size_t>(i)].state_bytes;
  return s;
}

SplitChoice choose_device_buckets(const std::vector<BucketTiming>& arrival_order,
                                  double backward_ms, int64_t free_hbm_bytes) {
  const int nb = static_cast<int>(arrival_order.size());
  auto end_with = [&](int device) {
    // The first nb - device to arrive go through the CPU, one at a time.
    double cpu_end = 0.0;
    for (int i = 0; i < nb - device; ++i) {
      const BucketTiming& b = arrival_order[static_cast<size_t>(i)];
      cpu_end = std::max(cpu_end, b.arrive_ms) + b.cpu_ms;
    }
    double device_end = backward_ms;
    for (int i = nb - device; i < nb; ++i)
      device_end += arrival_order[static_cast<size_t>(i)].device_ms;
    return std::max({backward_ms, cpu_end, device_end});
  };
  SplitChoice c;
  c.cpu_only_ms = end_with(0);
  c.end_ms = c.cpu_only_ms;
  int64_t hbm = 0;
  for (int device = 1; device <= nb; ++device) {
    hbm += arrival_order[static_cast<size_t>(nb - device)].state_bytes;
    if (hbm > free_hbm_bytes) break;
    const double e = end_with(device);
    if (e < c.end_ms) {
      c.end_ms = e;
      c.device_buckets = device;
    }
  }
  return c;
}

}  // namespace spillway

// Collectives in the planner's vocabulary (docs/collectives.md): the
// ring time of an all-reduce, all-gather, reduce-scatter or all-to-all, which link a group
// of GPUs crosses, and the CollectivePlan a layer carries (spillway/plan/plan.hpp).
//
// Ring time of a message of S bytes per GPU over n GPUs at B bytes/s per GPU per direction,
// with a latency L per ring step:
//   all-reduce                           2(n-1)/n x S / B + 2(n-1) x L
//   all-gather, reduce-scatter, all-to-all (n-1)/n x S / B +  (n-1) x L
// n = 1 costs nothing. The factor x S is the ring's byte volume: what each GPU sends (and
// receives) on its link, the work the simulator gives the transfer.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "spillway/catalog/hardware.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {

// The factor of S a ring moves per GPU: 2(n-1)/n for an all-reduce, (n-1)/n otherwise;
// 0 for n = 1. `group` >= 1 (InputError naming "group" otherwise).
double ring_volume_factor(CollectiveKind kind, int64_t group);

// The ring latency steps: 2(n-1) for an all-reduce, n-1 otherwise.
int64_t ring_steps(CollectiveKind kind, int64_t group);

// Milliseconds of one ring collective (formulas above). `bytes_per_gpu` >= 0, `group` in
// [1, PlanLimits::kMaxGroup], `gbps` (GB/s, 1e9 bytes/s) in [PlanLimits::kMinGbps,
// kMaxGbps], `latency_us` in [0, 1e6]; a bad value throws InputError naming its argument
// (bytes, group, gbps, latency_us). A group of 1 is 0 ms whatever the link.
double ring_ms(CollectiveKind kind, int64_t bytes_per_gpu, int64_t group, double gbps,
               double latency_us);

// The link a collective crosses and its per-GPU bandwidth (GB/s, per direction).
struct CollectiveLink {
  std::string link;  // "nvlink", "network" or "host"
  double gbps = 0.0;
};

// Note [Which link a collective crosses]: ranks are laid out in order, so a group of n
// members spaced `gpus_between_members` (s) apart lies in an aligned block of n x s GPUs.
//   - the block fits one NVLink domain (n x s <= gpus_per_nvlink_domain) and the profile has
//     NVLink: "nvlink" at nvlink_gbps;
//   - else the block fits one node (n x s <= host.gpus_per_host_memory, the GPUs of one
//     host): "host", through the host link: min(typical D2H, typical H2D) / gpus_per_link,
//     since the GPUs behind one link share its root complex (with the offload copies);
//   - else it spans nodes: "network" at network_gbps (the slowest link a ring crosses).
// A group of 1 crosses nothing; it gets the link its block of s GPUs would use.
// `group` and `gpus_between_members` in [1, PlanLimits::kMaxGroup] (InputError otherwise).
CollectiveLink collective_link(const HardwareProfile& hw, int64_t group,
                               int64_t gpus_between_members);

// A layer's collective, timed: `ms` = ring_ms over `link`, `exposed` = true for an
// all-to-all (it blocks the MoE layer's compute), false for the others (overlapped with
// compute). `bytes` is S per GPU. Arguments are checked as in ring_ms; `what` must not be
// empty and `link.link` must be "nvlink", "network" or "host".
CollectivePlan make_collective(CollectiveKind kind, std::string what, bool backward, int64_t bytes,
                               int64_t group, const CollectiveLink& link, double latency_us);

// The ring's byte volume of a collective: ring_volume_factor x bytes, rounded to bytes.
int64_t ring_bytes(const CollectivePlan& c);

// The ring-step latency inside a collective's `ms` (ring_steps x L): ms minus the bytes'
// time at its gbps; 0 when ms has none (or gbps is 0).
double ring_latency_ms(const CollectivePlan& c);

// Where an exposed forward collective runs inside its layer, the one rule the planner's
// timeline and the simulator share: after the forward op of the returned index, given the
// layer's `op_count` op names in forward order: a dispatch after moe.dispatch, a combine
// before moe.combine, anything else (or without those ops) after the last op.
int exposed_forward_position(const CollectivePlan& c, size_t op_count,
                             const std::function<std::string_view(size_t)>& op_name);

}  // namespace spillway

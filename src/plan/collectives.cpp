// Collectives: the names of CollectiveKind, ring times, the link rule (Note [Which link a
// collective crosses] in spillway/plan/collectives.hpp) and CollectivePlan construction.
#include "spillway/plan/collectives.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <string_view>
#include <utility>

#include "core/enum_names.hpp"
#include "spillway/core/error.hpp"

namespace spillway {

namespace {

constexpr std::array<std::pair<CollectiveKind, std::string_view>, 4> kKindNames = {{
    {CollectiveKind::kAllReduce, "all-reduce"},
    {CollectiveKind::kAllGather, "all-gather"},
    {CollectiveKind::kReduceScatter, "reduce-scatter"},
    {CollectiveKind::kAllToAll, "all-to-all"},
}};

void check_group(int64_t group, const char* field) {
  if (group < 1 || group > PlanLimits::kMaxGroup)
    SPILLWAY_FIELD_ERROR(field, group, "must be in [1, {}]", PlanLimits::kMaxGroup);
}

}  // namespace

std::string to_string(CollectiveKind k) {
  return std::string(name_of(kKindNames, k));
}

CollectiveKind parse_collective_kind(const std::string& s) {
  if (const std::optional<CollectiveKind> k = value_of(kKindNames, s)) return *k;
  SPILLWAY_FIELD_ERROR("kind", fmt::format("'{}'", s),
                       "must be one of all-reduce, all-gather, reduce-scatter, all-to-all");
}

double ring_volume_factor(CollectiveKind kind, int64_t group) {
  check_group(group, "group");
  const double n = static_cast<double>(group);
  const double once = (n - 1.0) / n;
  return kind == CollectiveKind::kAllReduce ? 2.0 * once : once;
}

int64_t ring_steps(CollectiveKind kind, int64_t group) {
  check_group(group, "group");
  return kind == CollectiveKind::kAllReduce ? 2 * (group - 1) : group - 1;
}

double ring_ms(CollectiveKind kind, int64_t bytes_per_gpu, int64_t group, double gbps,
               double latency_us) {
  if (bytes_per_gpu < 0) SPILLWAY_FIELD_ERROR("bytes", bytes_per_gpu, "must be >= 0");
  check_group(group, "group");
  if (!(gbps >= PlanLimits::kMinGbps && gbps <= PlanLimits::kMaxGbps)) {
    SPILLWAY_FIELD_ERROR("gbps", gbps, "must be in [{:g}, {:g}] GB/s", PlanLimits::kMinGbps,
                         PlanLimits::kMaxGbps);
  }
  if (!(latency_us >= 0.0 && latency_us <= 1e6))
    SPILLWAY_FIELD_ERROR("latency_us", latency_us, "must be in [0, 1e6]");
  if (group == 1) return 0.0;
  const double transfer_ms =
      ring_volume_factor(kind, group) * static_cast<double>(bytes_per_gpu) / (gbps * 1e6);
  return transfer_ms + static_cast<double>(ring_steps(kind, group)) * latency_us * 1e-3;
}

// Note [Which link a collective crosses] (spillway/plan/collectives.hpp).
CollectiveLink collective_link(const HardwareProfile& hw, int64_t group,
                               int64_t gpus_between_members) {
  check_group(group, "group");
  check_group(gpus_between_members, "gpus_between_members");
  const int64_t block = group * gpus_between_members;  // <= 2^40: no overflow
  const Interconnect& ic = hw.interconnect;
  if (ic.nvlink_gbps > 0.0 && block <= ic.gpus_per_nvlink_domain) return {"nvlink", ic.nvlink_gbps};
  if (block <= std::max(hw.gpus_per_host_memory, 1)) {
    const double typical = std::min(hw.d2h_typical.value, hw.h2d_typical.value);
    return {"host", typical / std::max(hw.gpus_per_link, 1)};
  }
  return {"network", ic.network_gbps};
}

CollectivePlan make_collective(CollectiveKind kind, std::string what, bool backward, int64_t bytes,
                               int64_t group, const CollectiveLink& link, double latency_us) {
  if (what.empty()) SPILLWAY_FIELD_ERROR("what", "\"\"", "must name the collective");
  if (link.link != "nvlink" && link.link != "network" && link.link != "host") {
    SPILLWAY_FIELD_ERROR("link", fmt::format("\"{}\"", link.link),
                         "must be nvlink, network or host");
  }
  CollectivePlan c;
  c.kind = kind;
  c.what = std::move(what);
  c.backward = backward;
  c.bytes = bytes;
  c.group = group;
  c.link = link.link;
  c.gbps = link.gbps;
  c.ms = ring_ms(kind, bytes, group, link.gbps, latency_us);
  c.exposed = kind == CollectiveKind::kAllToAll;
  return c;
}

int64_t ring_bytes(const CollectivePlan& c) {
  if (c.bytes < 0) SPILLWAY_FIELD_ERROR("bytes", c.bytes, "must be >= 0");
  return static_cast<int64_t>(
      std::llround(ring_volume_factor(c.kind, c.group) * static_cast<double>(c.bytes)));
}

double ring_latency_ms(const CollectivePlan& c) {
  if (c.gbps <= 0.0) return 0.0;
  const double transfer =
      ring_volume_factor(c.kind, c.group) * static_cast<double>(c.bytes) / (c.gbps * 1e6);
  // What ring_ms added beyond the bytes; rounding may leave a hair below zero.
  const double latency = c.ms - transfer;
  return latency > 1e-12 * std::max(1.0, c.ms) ? latency : 0.0;
}

int exposed_forward_position(const CollectivePlan& c, size_t op_count,
                             const std::function<std::string_view(size_t)>& op_name) {
  const int last = static_cast<int>(op_count) - 1;
  auto op_index = [&](std::string_view name) {
    for (size_t k = 0; k < op_count; ++k)
      if (op_name(k) == name) return static_cast<int>(k);
    return -1;
  };
  if (c.what.ends_with("dispatch")) {
    const int k = op_index("moe.dispatch");
    return k >= 0 ? k : last;
  }
  if (c.what.ends_with("combine")) {
    const int k = op_index("moe.combine");
    return k >= 1 ? k - 1 : last;
  }
  return last;
}

}  // namespace spillway

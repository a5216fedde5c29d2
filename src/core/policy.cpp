// The memory-policy vocabulary (include/spillway/core/policy.hpp): the names of its enums, from
// one table each, and the lookups.
#include "spillway/core/policy.hpp"

#include <algorithm>
#include <array>
#include <utility>

#include "core/enum_names.hpp"
#include "spillway/core/error.hpp"

namespace spillway {

namespace {

constexpr EnumNames<Action, 3> kActionNames = {{
    {Action::kKeep, "keep"},
    {Action::kOffload, "offload"},
    {Action::kRecompute, "recompute"},
}};

constexpr EnumNames<Policy, 7> kPolicyNames = {{
    {Policy::kAuto, "auto"},
    {Policy::kKeep, "keep"},
    {Policy::kRecompute, "recompute"},
    {Policy::kOffload, "offload"},
    {Policy::kSelective, "selective"},
    {Policy::kHybrid, "hybrid"},
    {Policy::kCheckpoint, "checkpoint"},
}};

}  // namespace

std::string to_string(Action a) {
  return std::string(name_of(kActionNames, a));
}
std::string to_string(Policy p) {
  return std::string(name_of(kPolicyNames, p));
}

Policy parse_policy(std::string_view name, std::string_view field) {
  if (const std::optional<Policy> p = value_of(kPolicyNames, name)) return *p;
  SPILLWAY_FIELD_ERROR(
      std::string(field), fmt::format("'{}'", name),
      "must be one of auto, keep, recompute, offload, selective, hybrid, checkpoint");
}

Action LayerActions::action(std::string_view tensor) const {
  const auto it = std::find(tensors.begin(), tensors.end(), tensor);
  if (it == tensors.end()) return Action::kKeep;
  const auto i = static_cast<size_t>(it - tensors.begin());
  return i < actions.size() ? actions[i] : Action::kKeep;
}

Action MemoryPolicy::action(int layer, std::string_view tensor) const {
  if (layer < 0 || static_cast<size_t>(layer) >= layers.size()) return Action::kKeep;
  return layers[static_cast<size_t>(layer)].action(tensor);
}

bool MemoryPolicy::any_offload() const {
  return count(Action::kOffload) > 0;
}

int MemoryPolicy::count(Action a) const {
  int n = 0;
  for (const LayerActions& l : layers)
    n += static_cast<int>(std::count(l.actions.begin(), l.actions.end(), a));
  return n;
}

MemoryPolicy MemoryPolicy::uniform(int layers, const std::vector<std::string>& names,
                                   int keep_last) {
  MemoryPolicy p;
  p.name = "uniform";
  p.layers.resize(static_cast<size_t>(std::max(layers, 0)));
  for (int l = 0; l + keep_last < layers; ++l) {
    LayerActions& la = p.layers[static_cast<size_t>(l)];
    la.tensors = names;
    la.actions.assign(names.size(), Action::kOffload);
  }
  return p;
}

}  // namespace spillway

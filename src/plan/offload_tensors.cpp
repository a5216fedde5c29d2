// Note [Named offload tensors]: a user states an experiment by naming the tensors it
// offloads (`--offload-tensors mlp.gate_out,mlp.up_out,mlp.act`, or the group `mlp`):
// exactly those are offloaded in every layer that offloads (not the last keep_last_layers),
// and the planner decides nothing about them. What is not named follows the strategy: kept
// under keep, the block policy's recompute under recompute and offload; auto chooses per
// layer among keep, recompute, and the named set offloaded with the rest kept or
// recomputed. The strategies that choose their own tensors (selective, hybrid) and full-layer
// checkpointing (nothing saved to offload) refuse a named set. A layer whose block saves none
// of the names offloads nothing. Feasibility is judged as for any plan: a named set that
// misses its window is a snowball, named in the reasons.
//
// A group is one sub-block's activations: the saved tensors "g.*" but the sub-block's input
// (the checkpoint the block policy keeps) and its norm output. So `mlp` is mlp.gate_out,
// mlp.up_out and mlp.act (the three MLP activations seed 000 offloads; the experts' in an
// MoE layer), `attn` the attention's projections, core output and statistics, `moe` the
// router's results and the experts' dispatched input and output.
#include <fmt/ranges.h>

#include <algorithm>

#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway {

const std::vector<std::string>& offload_tensor_groups() {
  static const std::vector<std::string> groups = {"attn", "mlp", "moe", "ssm", "lin", "rec"};
  return groups;
}

bool in_offload_group(std::string_view group, std::string_view tensor) {
  if (tensor.size() <= group.size() + 1 || tensor.substr(0, group.size()) != group ||
      tensor[group.size()] != '.') {
    return false;
  }
  const std::string_view member = tensor.substr(group.size() + 1);
  return member != "input" && member != "norm_out";
}

std::vector<std::string> resolve_offload_tensors(const ModelConfig& model, const ShardShape& shape,
                                                 const std::vector<std::string>& names) {
  // The saved names of the model's distinct blocks, in block order.
  std::vector<std::string> saved;
  std::vector<const LayerSpec*> seen;
  for (const LayerSpec& spec : model.layers) {
    if (std::any_of(seen.begin(), seen.end(), [&](const LayerSpec* s) { return *s == spec; }))
      continue;
    seen.push_back(&spec);
    for (const TensorInfo& t : build_inventory(spec, model.hidden, shape).tensors) {
      if (t.saved && std::find(saved.begin(), saved.end(), t.name) == saved.end())
        saved.push_back(t.name);
    }
  }
  const std::vector<std::string>& groups = offload_tensor_groups();
  auto refuse = [&](const std::string& name, std::string_view why) {
    SPILLWAY_FIELD_ERROR("offload_tensors", name, "{}; the blocks of {} save {} (groups: {}){}",
                         why, model.name, fmt::join(saved, ", "), fmt::join(groups, ", "),
                         name == "mlp.act" && shape.fused_swiglu
                             ? "; with fused_swiglu the SwiGLU backward recomputes mlp.act"
                             : "");
  };
  std::vector<bool> chosen(saved.size(), false);
  for (const std::string& name : names) {
    if (name.empty()) refuse(name, "an empty name (a comma too many?)");
    const bool group = std::find(groups.begin(), groups.end(), name) != groups.end();
    bool any = false;
    for (size_t i = 0; i < saved.size(); ++i) {
      if (group ? in_offload_group(name, saved[i]) : saved[i] == name) {
        chosen[i] = true;
        any = true;
      }
    }
    if (!any) {
      refuse(name,
             group ? "a group with no member in this model" : "no tensor of that name is saved");
    }
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < saved.size(); ++i) {
    if (chosen[i]) out.push_back(saved[i]);
  }
  return out;
}

}  // namespace spillway

// The reference model's memory policies (include/spillway/nn/nn.hpp): keep, and any policy
// (a plan's) put in this model's terms, slot by slot.
#include <algorithm>

#include "nn/slots.hpp"
#include "spillway/core/error.hpp"
#include "spillway/nn/nn.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway::nn {

MemoryPolicy keep_policy(const RefConfig& c) {
  MemoryPolicy p;
  p.name = "keep";
  p.layers.resize(static_cast<size_t>(c.layers()));
  for (int l = 0; l < c.layers(); ++l) {
    LayerActions& la = p.layers[static_cast<size_t>(l)];
    la.tensors = saved_tensor_names(c, l);
    la.actions.assign(la.tensors.size(), Action::kKeep);
  }
  return p;
}

MemoryPolicy reference_policy(const RefConfig& c, const MemoryPolicy& from) {
  if (from.layer_count() != c.layers())
    SPILLWAY_INPUT_ERROR("plan '{}': {} layers; the model has {}", from.name, from.layer_count(),
                         c.layers());
  MemoryPolicy p = keep_policy(c);
  p.name = from.name;
  p.note = from.note;
  p.prefetch_depth = from.prefetch_depth;
  for (int l = 0; l < c.layers(); ++l) {
    LayerActions& la = p.layers[static_cast<size_t>(l)];
    const LayerActions& src = from.layers[static_cast<size_t>(l)];
    // A tensor the source does not save (mlp.act under a fused SwiGLU backward) is
    // recomputed from its inputs in backward; the layer input always exists.
    for (size_t i = 1; i < la.tensors.size(); ++i) la.actions[i] = Action::kRecompute;
    for (size_t k = 0; k < src.tensors.size() && k < src.actions.size(); ++k) {
      const auto it = std::find(la.tensors.begin(), la.tensors.end(), src.tensors[k]);
      if (it == la.tensors.end()) continue;  // a tensor this model does not save
      const size_t i = static_cast<size_t>(it - la.tensors.begin());
      if (i == kInput && src.actions[k] == Action::kRecompute)
        SPILLWAY_INPUT_ERROR(
            "plan '{}': layer {} recomputes attn.input, the layer input; it "
            "can only be kept or offloaded",
            from.name, l);
      la.actions[i] = src.actions[k];
    }
  }
  return p;
}

MemoryPolicy policy_from_plan(const RefConfig& c, const Plan& plan, const std::string& name) {
  return reference_policy(c, memory_policy(plan, name));
}

}  // namespace spillway::nn

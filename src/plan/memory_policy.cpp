// A plan's memory policy (include/spillway/plan/plan.hpp): the one converter from the
// planner's per-tensor actions to the vocabulary the engines read (spillway/core/policy.hpp).
#include "spillway/plan/plan.hpp"

namespace spillway {

MemoryPolicy memory_policy(const Plan& plan, const std::string& name, int prefetch_depth) {
  MemoryPolicy p;
  p.name = name;
  p.prefetch_depth = prefetch_depth;
  p.layers.reserve(plan.layers.size());
  for (const LayerPlan& l : plan.layers) {
    LayerActions la;
    la.tensors.reserve(l.tensors.size());
    la.actions.reserve(l.tensors.size());
    for (const TensorPlan& t : l.tensors) {
      la.tensors.push_back(t.name);
      la.actions.push_back(t.action);
    }
    p.layers.push_back(std::move(la));
  }
  return p;
}

}  // namespace spillway

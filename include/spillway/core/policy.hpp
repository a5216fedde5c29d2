// The one memory-policy vocabulary, from the planner to the engines (docs/architecture.md):
// per layer, per saved tensor (by the planner's names, docs/plan-schema.md), what happens
// to it between its forward and its backward. The planner writes it (memory_policy() in
// plan.hpp), the activation offload engine reads which tensors go to the host, and a
// model (the reference model, the PyTorch adapter) reads what to keep and recompute.
// Core vocabulary: it depends on nothing but the standard library.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace spillway {

// What happens to one saved tensor of one layer.
enum class Action { kKeep, kOffload, kRecompute };

// The per-layer policy names the planner chooses among (docs/offload.md, docs/planner.md); a
// strategy asks for one of them in every layer, or for the best per layer (kAuto, never a
// layer's policy).
enum class Policy { kAuto, kKeep, kRecompute, kOffload, kSelective, kHybrid, kCheckpoint };

// Names from one table each ("keep", "offload", ...); parse_* throws spillway::Error naming
// the field and the value when the name is unknown.
std::string to_string(Action a);
std::string to_string(Policy p);
Policy parse_policy(std::string_view name, std::string_view field = "strategy");

// One layer: its saved tensors in order and each one's action (same length).
struct LayerActions {
  std::vector<std::string> tensors;
  std::vector<Action> actions;
  // The action of `tensor`; kKeep when the layer does not list it.
  Action action(std::string_view tensor) const;
};

struct MemoryPolicy {
  std::string name;  // "keep", "recompute", "plan.json", ...
  std::string note;  // how it was chosen, for reports
  std::vector<LayerActions> layers;
  int prefetch_depth = 1;  // backward reloads issued this many layers ahead

  int64_t layer_count() const { return static_cast<int64_t>(layers.size()); }
  // The action of a tensor of a layer; kKeep for a layer or a tensor not listed.
  Action action(int layer, std::string_view tensor) const;
  // Whether the tensor goes to the host (the offload engine's question).
  bool wants(int layer, std::string_view tensor) const {
    return action(layer, tensor) == Action::kOffload;
  }
  bool any_offload() const;
  // Kept, offloaded and recomputed tensors over all layers.
  int count(Action a) const;
  // Every layer but the last `keep_last` offloads the named tensors (the rest unlisted:
  // kept).
  static MemoryPolicy uniform(int layers, const std::vector<std::string>& names, int keep_last = 1);
};

}  // namespace spillway

// The saved tensors of a layer as the framework that runs the model saves them.
//
// Note [A model as PyTorch runs it]: the inventory (src/model/inventory.cpp) is what a layer
// saves under fused kernels: one normalized output per RMSNorm, SwiGLU's product and not its
// SiLU, int32 router indices. An eager Hugging Face model saves more: the fp32 copy and the
// pre-weight product of each RMSNorm, SiLU's output beside the product, int64 indices; 1.3-1.5x
// per attention or MLP layer, 6-8x per Mamba layer on its slow path. A plan from the inventory
// then under-counts the peak of the model that really runs. spillway.torch.measure_saved counts
// what autograd saves in each block of the user's own model (saved_tensors_hooks, each storage
// once, the parameters left out), by the names the offload adapter gives its tensors (Note
// [Names of Hugging Face tensors]), scaled to the job's tokens; given here, it replaces the
// inventory's sizes layer by layer:
//   - a name the layer's inventory has: that tensor's bytes become the measured ones (its
//     producer and the op graph stay, so recompute closures and windows are the inventory's);
//   - a name it lacks (an eager tensor no planner name stands for, "block" for what no rule
//     names, a Mamba projection named by an attention rule): a saved tensor of that name,
//     produced by the last op of its sub-block (the name's prefix), else the layer's last op;
//   - a saved tensor of the inventory that was not measured: 0 bytes (the model does not save
//     it as such), except the layer's input, which a checkpoint keeps whatever autograd saved.
// The names are the adapter's, so what a plan offloads is exactly what the adapter can find.
// A measured tensor's shape in the plan is its bytes, its dtype "uint8": sizes are measured,
// shapes are not.
#include <algorithm>

#include "plan/cost_model.hpp"
#include "spillway/core/error.hpp"

namespace spillway {

namespace {

// The op that produces a saved tensor of `name` that the layer's inventory lacks.
int producer_of(const LayerInventory& inv, const std::string& name) {
  const size_t dot = name.find('.');
  if (dot != std::string::npos) {
    const std::string prefix = name.substr(0, dot + 1);
    for (size_t k = inv.ops.size(); k-- > 0;) {
      if (inv.ops[k].name.rfind(prefix, 0) == 0) return static_cast<int>(k);
    }
  }
  return inv.ops.empty() ? -1 : static_cast<int>(inv.ops.size()) - 1;
}

}  // namespace

void apply_saved_as_run(CostedLayer& c, const std::vector<SavedTensorBytes>& measured) {
  LayerInventory& inv = c.inv;
  std::vector<char> given(inv.tensors.size(), 0);
  for (const SavedTensorBytes& m : measured) {
    int k = inv.find(m.name);
    if (k < 0) {  // unknown to the inventory: a saved tensor of its own
      TensorInfo t;
      t.name = m.name;
      t.producer = producer_of(inv, m.name);
      k = static_cast<int>(inv.tensors.size());
      if (t.producer >= 0) inv.ops[static_cast<size_t>(t.producer)].outputs.push_back(k);
      inv.tensors.push_back(std::move(t));
      given.push_back(0);
    }
    TensorInfo& t = inv.tensors[static_cast<size_t>(k)];
    given[static_cast<size_t>(k)] = 1;
    // The layer's input is kept by a checkpoint even where autograd saved only a copy.
    if (t.saved && t.producer < 0 && m.bytes < t.bytes) continue;
    t.saved = true;  // a transient of the inventory that the model saves is saved
    t.bytes = m.bytes;
    t.shape = {m.bytes};
    t.dtype = "uint8";
  }
  for (size_t i = 0; i < given.size(); ++i) {
    TensorInfo& t = inv.tensors[i];
    if (given[i] || !t.saved || t.producer < 0) continue;
    t.bytes = 0;
  }
  // The times at which each tensor exists, the appended ones included.
  c.produced_at_ms.assign(inv.tensors.size(), 0.0);
  double at = 0.0;
  for (size_t k = 0; k < inv.ops.size(); ++k) {
    at += c.op_fwd_ms[k];
    for (int out : inv.ops[k].outputs) c.produced_at_ms[static_cast<size_t>(out)] = at;
  }
}

}  // namespace spillway

// A layer of the reference model over its saved tensors (Note [Saved tensors] in
// include/spillway/nn/nn.hpp): their sizes, which op produces each from which, the layer's
// forward (each tensor kept, handed to the hooks, or dropped as the policy says) and its
// backward (each materialized again, then the blocks' gradients). The blocks' own math is in
// attention_block.cpp, mlp_block.cpp and mamba_block.cpp.
#include <cstring>
#include <functional>

#include "nn/model_impl.hpp"
#include "nn/ops.hpp"
#include "nn/slots.hpp"
#include "spillway/core/error.hpp"

namespace spillway::nn {

size_t Model::Impl::slot_bytes(int layer, int s, int batch, int seq) const {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const size_t T = static_cast<size_t>(batch) * static_cast<size_t>(seq);
  const size_t rows = L.moe ? T * static_cast<size_t>(L.top_k) : T;
  const size_t f = static_cast<size_t>(L.ffn);
  if (L.mamba) {  // Note [Mamba slots]
    if (s == kSsmInProj) return T * static_cast<size_t>(L.in_width) * 4;
    if (s == kSsmConv) return T * static_cast<size_t>(L.conv_dim) * 4;
    if (s == kSsmScan || s == L.gated_slot()) return T * static_cast<size_t>(L.inner) * 4;
    if (s == L.states_slot())
      return static_cast<size_t>(L.ssd(batch, seq).chunks()) * static_cast<size_t>(batch) *
             static_cast<size_t>(L.inner) * static_cast<size_t>(L.state) * 4;
  }
  switch (s) {
    case kInput:
    case kNorm1:
    case kMid:
    case kNorm2:
      return T * static_cast<size_t>(d) * 4;
    case kQkv:
      return T * static_cast<size_t>(qkv_dim) * 4;
    case kCoreOut:
      return T * static_cast<size_t>(q_dim) * 4;
    case kLse:
      return T * static_cast<size_t>(c.heads) * 4;
    default:
      break;
  }
  if (!L.moe) return rows * f * 4;  // gate, up, act
  switch (s) {
    case kProbs:
      return T * static_cast<size_t>(L.experts) * 4;
    case kIdx:
    case kWeights:
      return T * static_cast<size_t>(L.top_k) * 4;
    case kDispatch:
    case kExpertOut:
      return rows * static_cast<size_t>(d) * 4;
    default:
      return rows * f * 4;  // gate, up, act
  }
}

float* Model::Impl::out_slot(int layer, int o, int batch, int seq) {
  Saved& sv = saved[layer][o];
  if (sv.p == nullptr) {
    where_layer = layer;
    where_what = names[static_cast<size_t>(layer)][static_cast<size_t>(o)].c_str();
    sv.bytes = slot_bytes(layer, o, batch, seq);
    sv.p = alloc(sv.bytes);
  }
  return static_cast<float*>(sv.p);
}

void Model::Impl::produce(int layer, int s, int batch, int seq) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  if (L.mamba && produce_mamba(layer, s, batch, seq)) return;
  if (produce_attention(layer, s, batch, seq)) return;
  produce_mlp(layer, s, batch, seq);
}

std::vector<int> Model::Impl::inputs_of(int layer, int s) const {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const bool moe = L.moe;
  if (L.mamba) {  // Note [Mamba slots]
    if (s == kNorm1) return {kInput};
    if (s == kSsmInProj) return {kNorm1};
    if (s == kSsmConv) return {kSsmInProj};
    if (s == kSsmScan || s == L.states_slot()) return {kSsmConv, kSsmInProj};
    if (s == L.gated_slot()) return {kSsmScan, kSsmInProj};
    if (s == kMid) return {kInput, L.gated_slot()};
  }
  switch (s) {
    case kNorm1:
      return {kInput};
    case kQkv:
      return {kNorm1};
    case kCoreOut:
    case kLse:
      return {kQkv};
    case kMid:
      return {kInput, kCoreOut};
    case kNorm2:
      return {kMid};
    default:
      break;
  }
  if (!moe) {
    if (s == kDenseGate || s == kDenseUp) return {kNorm2};
    return {kDenseGate, kDenseUp};
  }
  switch (s) {
    case kProbs:
    case kIdx:
    case kWeights:
      return {kNorm2};
    case kDispatch:
      return {kNorm2, kIdx};
    case kGate:
    case kUp:
      return {kDispatch, kIdx};
    case kAct:
      return {kGate, kUp};
    default:  // kExpertOut
      return {kAct, kIdx};
  }
}

void Model::Impl::materialize(int layer, int s, int batch, int seq) {
  if (saved[layer][s].p != nullptr) return;
  SPILLWAY_CHECK(saved[layer][s].action == Action::kRecompute,
                 "layer {} slot {} is missing in backward", layer, s);
  for (int i : inputs_of(layer, s)) materialize(layer, i, batch, seq);
  if (saved[layer][s].p != nullptr) return;  // an op with two outputs made it
  ++recomputed_ops;
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  if (L.mamba && (s == kSsmScan || s == L.states_slot())) ++recomputed_scans;
  produce(layer, s, batch, seq);
}

void Model::Impl::forward_layer(int layer, float* x, float** y_out, int batch, int seq,
                                const MemoryPolicy& policy, TrainingHooks& hooks) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const int T = batch * seq;
  const int n_slots = L.slots();
  saved[layer].assign(static_cast<size_t>(n_slots), Saved{});
  for (int s = 0; s < n_slots; ++s)
    saved[layer][s].action =
        policy.layers[static_cast<size_t>(layer)].actions[static_cast<size_t>(s)];
  saved[layer][kInput].p = x;
  saved[layer][kInput].bytes = slot_bytes(layer, kInput, batch, seq);
  // Note [Saved tensors]: an offloaded tensor goes to the hooks as soon as its producer
  // has run (its copy overlaps the rest of this layer's forward and the next one, the
  // window the planner assumes); it is given (Note [Saved tensor ownership] in
  // spillway/device/hooks.hpp), held until this layer's forward ends, since the forward still
  // reads it.
  auto hand_over = [&] {
    for (int s = 0; s < n_slots; ++s) {
      Saved& sv = saved[layer][s];
      if (sv.action != Action::kOffload || sv.p == nullptr || sv.ticket) continue;
      const char* name = names[static_cast<size_t>(layer)][static_cast<size_t>(s)].c_str();
      SavedTensor t;
      t.data = sv.p;
      t.bytes = sv.bytes;
      t.give = true;
      t.hold_until_forward_end = true;
      sv.ticket = hooks.saved(layer, name, t);
      SPILLWAY_CHECK(sv.ticket, "policy {} offloads {} of layer {} but no hook took it",
                     policy.name, name, layer);
    }
  };
  hooks.forward_begin(layer);
  at(layer, "", "forward");
  hand_over();
  // Each slot after its inputs (Note [Mamba slots]: the numbering is not the order).
  std::function<void(int)> ensure = [&](int s) {
    if (saved[layer][s].p != nullptr) return;
    for (int i : inputs_of(layer, s)) ensure(i);
    if (saved[layer][s].p != nullptr) return;  // an op with two outputs made it
    produce(layer, s, batch, seq);
    hand_over();
  };
  for (int s = 1; s < n_slots; ++s) ensure(s);
  at(layer, "output", "forward");
  float* y = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(d));
  mlp_output(layer, y, T);
  for (int s = 0; s < n_slots; ++s) {
    Saved& sv = saved[layer][s];
    if (sv.action == Action::kOffload) {
      sv.p = nullptr;  // the hook owns it now
    } else if (sv.action == Action::kRecompute) {
      release(sv.p);
      sv.p = nullptr;
    }
  }
  hooks.forward_end(layer);
  *y_out = y;
}

void Model::Impl::backward_layer(int layer, const float* dy, float* dx, int batch, int seq,
                                 TrainingHooks& hooks) {
  const LayerParams& L = lp[static_cast<size_t>(layer)];
  const int T = batch * seq;
  const size_t Td = static_cast<size_t>(T) * static_cast<size_t>(d);
  const int n_slots = L.slots();
  hooks.backward_begin(layer);
  bool reloaded = false;
  for (int s = 0; s < n_slots; ++s) {
    Saved& sv = saved[layer][s];
    if (sv.action != Action::kOffload) continue;
    sv.p = hooks.needed(sv.ticket, nullptr);
    SPILLWAY_CHECK(sv.p != nullptr, "no hook gave back {} of layer {}",
                   names[static_cast<size_t>(layer)][static_cast<size_t>(s)], layer);
    sv.reloaded = true;
    reloaded = true;
  }
  if (reloaded) dev.synchronize(compute);  // the host computes: wait for the reloads
  at(layer, "", "recompute in backward");
  for (int s = 0; s < n_slots; ++s) materialize(layer, s, batch, seq);
  at(layer, "gradient temporaries", "backward");

  float* dmid = alloc_n<float>(Td);  // gradient at mlp.input
  std::memcpy(dmid, dy, Td * sizeof(float));
  float* dnorm = alloc_n<float>(Td);
  mlp_backward(layer, dy, dnorm, batch, seq);
  float* tmp = alloc_n<float>(Td);
  rmsnorm_bwd(F(layer, kMid), lw(L.mlp_norm), dnorm, tmp, g + L.mlp_norm, T, d, c.rms_eps);
  add(dmid, tmp, dmid, Td);
  if (L.mamba) {
    mamba_backward(layer, dmid, dnorm, batch, seq);
  } else {
    attention_backward(layer, dmid, dnorm, batch, seq);
  }
  rmsnorm_bwd(F(layer, kInput), lw(L.attn_norm), dnorm, tmp, g + L.attn_norm, T, d, c.rms_eps);
  add(dmid, tmp, dx, Td);
  release(tmp);
  release(dnorm);
  release(dmid);
  for (int s = 0; s < n_slots; ++s) {
    Saved& sv = saved[layer][s];
    if (sv.reloaded) {
      hooks.done(sv.ticket);
    } else if (sv.p != nullptr) {
      release(sv.p);
    }
    sv = Saved{};
  }
}

}  // namespace spillway::nn

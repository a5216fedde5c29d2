// The reference model's saved-tensor slots and their planner names (Note [Saved tensors]
// in include/spillway/nn/nn.hpp), shared by its config, policy and network files.
#pragma once

#include <cstdint>

#include "spillway/core/error.hpp"
#include "spillway/nn/nn.hpp"

namespace spillway::nn {

inline int to_int(int64_t v, const char* field) {
  if (v <= 0 || v > (int64_t{1} << 24))
    SPILLWAY_INPUT_ERROR("reference model: {} is {}; must be in [1, 2^24]", field, v);
  return static_cast<int>(v);
}

// Saved tensor slots (Note [Saved tensors]); the MoE and dense MLPs number theirs from 7.
enum Slot : int {
  kInput = 0,  // attn.input (T, d)
  kNorm1,      // attn.norm_out (T, d)
  kQkv,        // attn.qkv_out (T, (H + 2 KV) hd)
  kCoreOut,    // attn.out_proj_in (T, H hd)
  kLse,        // attn.core_lse (T, H)
  kMid,        // mlp.input (T, d)
  kNorm2,      // mlp.norm_out (T, d)
  kProbs,      // moe.router_probs (T, E)
  kIdx,        // moe.topk_idx (T, k) int32
  kWeights,    // moe.topk_weights (T, k)
  kDispatch,   // moe.dispatch_in (T k, d)
  kGate,       // mlp.gate_out (T k, fe)
  kUp,         // mlp.up_out (T k, fe)
  kAct,        // mlp.act (T k, fe)
  kExpertOut,  // moe.expert_out (T k, d)
  kMoeSlots,
  kDenseGate = 7,  // mlp.gate_out (T, f)
  kDenseUp,        // mlp.up_out (T, f)
  kDenseAct,       // mlp.act (T, f)
  kDenseSlots,
};

inline const char* const kMoeNames[kMoeSlots] = {
    "attn.input",      "attn.norm_out", "attn.qkv_out",     "attn.out_proj_in", "attn.core_lse",
    "mlp.input",       "mlp.norm_out",  "moe.router_probs", "moe.topk_idx",     "moe.topk_weights",
    "moe.dispatch_in", "mlp.gate_out",  "mlp.up_out",       "mlp.act",          "moe.expert_out"};
inline const char* const kDenseNames[kDenseSlots] = {
    "attn.input", "attn.norm_out", "attn.qkv_out", "attn.out_proj_in", "attn.core_lse",
    "mlp.input",  "mlp.norm_out",  "mlp.gate_out", "mlp.up_out",       "mlp.act"};

inline bool is_moe(const RefConfig& c, int layer) {
  return c.model.layers[static_cast<size_t>(layer)].mlp.kind == MlpKind::kMoe;
}
inline bool is_mamba(const RefConfig& c, int layer) {
  return c.model.layers[static_cast<size_t>(layer)].mixer == MixerKind::kMamba;
}

// Note [Mamba slots]: a Mamba-2 layer (mixer + MLP) reuses the attention slots' numbers
// for its mixer's first five tensors, so that the MLP's slots keep theirs, and puts the
// last two after the MLP's: ssm.input (kInput), ssm.norm_out (kNorm1), ssm.in_proj_out
// (kSsmInProj), ssm.conv_out (kSsmConv), ssm.scan_out (kSsmScan), then mlp.input... and
// ssm.chunk_states, ssm.out_proj_in at mlp_slots and mlp_slots + 1. Production follows the
// inputs (the forward ensures a slot's inputs first), not the numbering.
enum MambaSlot : int { kSsmInProj = kQkv, kSsmConv = kCoreOut, kSsmScan = kLse };
inline const char* const kMambaMixerNames[5] = {"ssm.input", "ssm.norm_out", "ssm.in_proj_out",
                                                "ssm.conv_out", "ssm.scan_out"};
inline const char* const kMambaTailNames[2] = {"ssm.chunk_states", "ssm.out_proj_in"};

}  // namespace spillway::nn

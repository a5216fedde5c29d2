// The reference model's parameter layout: where each weight lives in its one flat block of
// parameters (the order of Note [Checkpoint names]: weight_specs() walks the same), the
// optimizer buckets that tile it, and the initial values. Offsets are in floats from the
// start of the block; the gradients and the AdamW moments share the layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "nn/ops.hpp"
#include "nn/slots.hpp"
#include "spillway/device/hooks.hpp"
#include "spillway/nn/nn.hpp"

namespace spillway::nn {

// One layer's parameters (offsets) and shapes.
struct LayerParams {
  size_t attn_norm = 0, wqkv = 0, wo = 0, mlp_norm = 0;  // attn_norm: the mixer's input norm
  // Qwen3's per-head RMSNorm of q and k before RoPE (Note [Q/K norms] in attention_block.cpp):
  // (head_dim) each, when qk_norm.
  bool qk_norm = false;
  size_t q_norm = 0, k_norm = 0;
  size_t router = 0, w1 = 0, w3 = 0, w2 = 0;  // MoE: experts contiguous; dense: one
  int experts = 0, top_k = 0, ffn = 0;        // dense: experts = 1, top_k = 1
  bool moe = false;
  // A Mamba-2 mixer (Note [Mamba slots]): in_proj (in_width, d) to z, x B C, dt; the
  // conv's weight (conv_dim, conv) and bias; dt_bias, a_log, dskip (heads); the gated
  // norm's weight (inner); out_proj (d, inner).
  bool mamba = false;
  size_t w_in = 0, conv_w = 0, conv_b = 0, dt_bias = 0, a_log = 0, dskip = 0, gnorm = 0, w_out = 0;
  int heads = 0, head_dim = 0, groups = 0, state = 0, conv = 0, chunk = 0;
  int inner = 0, conv_dim = 0, in_width = 0;
  int mlp_slots() const { return moe ? kMoeSlots : kDenseSlots; }
  int slots() const { return mlp_slots() + (mamba ? 2 : 0); }
  int states_slot() const { return mlp_slots(); }
  int gated_slot() const { return mlp_slots() + 1; }
  SsdShape ssd(int batch, int seq) const {
    SsdShape s;
    s.batch = batch;
    s.seq = seq;
    s.heads = heads;
    s.head_dim = head_dim;
    s.groups = groups;
    s.state = state;
    s.chunk = chunk;
    return s;
  }
};

struct ParameterLayout {
  int d = 0, qkv_dim = 0, q_dim = 0;  // hidden, the fused q k v width, the q heads' width
  std::vector<LayerParams> lp;
  // Note [Tied embeddings]: with the config's tie_word_embeddings the LM head reads the
  // embedding's matrix (lm_head == embed, one parameter, counted once) and its gradient is
  // the sum of both uses: the head's backward writes it first (the step zeroes the
  // gradients), the embedding's backward adds its rows after, in this one order, so the sum
  // is bitwise deterministic. The embedding's optimizer bucket holds it; the last bucket is
  // the final norm alone.
  size_t embed = 0, final_norm = 0, lm_head = 0;
  bool tied = false;
  size_t n_params = 0;
  std::vector<Bucket> buckets;  // Model::parameter_buckets
};

// The layout of config `c`. Throws spillway::Error naming a size out of range.
ParameterLayout layout_parameters(const RefConfig& c);

// The initial weights w (n_params floats): normal(0, 0.02) from `seed`, the norms' weights
// 1, and Mamba-2's usual start for its mixers' A, dt and D.
void init_parameters(const ParameterLayout& p, uint64_t seed, float* w);

}  // namespace spillway::nn

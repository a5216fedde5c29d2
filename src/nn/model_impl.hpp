// The reference model's state (Model::Impl, include/spillway/nn/nn.hpp), shared by the files
// that make up its network: model.cpp (the public face, the step, streamed weights,
// allocation), saved_tensors.cpp (a layer's forward and backward over its saved tensors,
// Note [Saved tensors]), the blocks' math (attention_block.cpp, mlp_block.cpp,
// mamba_block.cpp) and inference.cpp (forward only).
//
// All memory a step uses is the device's (alloc/release): parameters, gradients, moments,
// saved tensors and temporaries, so that the arena's peak is the step's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "nn/parameter_layout.hpp"
#include "spillway/core/policy.hpp"
#include "spillway/device/device.hpp"
#include "spillway/device/hooks.hpp"
#include "spillway/nn/nn.hpp"

namespace spillway::nn {

// Tokens (batch, seq + 1) into the inputs and the shifted targets (batch * seq each),
// every token checked against the vocabulary.
void split_tokens(const std::vector<int32_t>& tokens, int batch, int seq, int vocab,
                  std::vector<int32_t>* in, std::vector<int32_t>* target);

struct Model::Impl : ParameterLayout {
  RefConfig c;
  Device& dev;

  std::vector<std::vector<std::string>> names;  // per layer, per slot (saved_tensor_names)
  int64_t recomputed_ops = 0;                   // this step's (StepStats)
  int64_t recomputed_scans = 0;
  // Parameters: one device block each for weights, gradients, and the two moments
  // (ParameterLayout's offsets).
  float* w = nullptr;
  // Note [Streamed weights]: while a layer computes from a weight streamer's slot, its
  // parameters are read there (the slot holds the layer's bucket, from its offset).
  const float* layer_slot = nullptr;
  size_t layer_offset = 0;
  const float* lw(size_t at) const {
    return layer_slot != nullptr ? layer_slot + (at - layer_offset) : w + at;
  }
  LayerWeights* streamer = nullptr;
  float* g = nullptr;
  float* m1 = nullptr;
  float* m2 = nullptr;
  // With an offloaded optimizer: the bf16 weights it writes and this model computes with,
  // and the bf16 gradients this model writes for it (n_params each, device memory).
  uint16_t* w16 = nullptr;
  uint16_t* g16 = nullptr;

  UniqueStream compute;  // the stream the hooks' engines order their copies against

  // Allocation context for messages (formatted only when an allocation fails).
  std::string policy_name;
  int where_layer = -1;
  const char* where_what = "";
  const char* where_phase = "";
  void at(int layer, const char* what, const char* phase) {
    where_layer = layer;
    where_what = what;
    where_phase = phase;
  }

  // One layer's saved tensors during a step.
  struct Saved {
    void* p = nullptr;
    size_t bytes = 0;
    Action action = Action::kKeep;
    SavedTicket ticket;     // taken by a hook (offloaded)
    bool reloaded = false;  // p is the hook's memory (needed()), given back with done()
  };
  std::vector<std::vector<Saved>> saved;
  // MoE routing of the layer in flight (host metadata, sized once per shape).
  std::vector<int32_t> perm, inv, offsets;

  Impl(const RefConfig& config, Device& device)
      : ParameterLayout(layout_parameters(config)), c(config), dev(device) {}

  // --- model.cpp: device memory, streamed weights, the head -----------------------------

  std::string where() const;
  // Device memory, or spillway::Error naming the policy, where() and the bytes.
  void* alloc(size_t bytes);
  void release(void* p) { dev.free(p, MemoryKind::kDevice); }
  template <class X>
  X* alloc_n(size_t n) {
    return static_cast<X*>(alloc(n * sizeof(X)));
  }
  // A layer's visit to the streamer: its slot, ready for the host ops that read it (the
  // reference model computes on the calling thread, so the compute stream's wait for the
  // slot is waited out here), and its release once the layer's ops have run.
  void visit_begin(int layer);
  void visit_end(int layer);
  // The current weights of every layer into the streamer's host slabs, once the copies
  // that read them are done. A sharded streamer's slab holds this rank's shard of the
  // layer's bytes (Note [Sharded streaming]), zero past the layer's end.
  void pack_weights();
  // The head's forward on x (T, d): the final norm into *fn and the logits (T, vocab),
  // returned; device memory the caller releases.
  float* head_forward(const float* x, int T, float** fn);

  // --- saved_tensors.cpp: a layer over its saved tensors (Note [Saved tensors]) ---------

  size_t slot_bytes(int layer, int s, int batch, int seq) const;
  float* F(int layer, int s) { return static_cast<float*>(saved[layer][s].p); }
  int32_t* I(int layer, int s) { return static_cast<int32_t*>(saved[layer][s].p); }
  // Slot o of `layer` as an output: its buffer, allocated when absent.
  float* out_slot(int layer, int o, int batch, int seq);
  // Runs the forward op producing slot s of `layer` (its inputs present), writing every
  // output of that op into the slots' buffers (allocated here when absent).
  void produce(int layer, int s, int batch, int seq);
  // The slots an op reads (to recompute s, these must be present first).
  std::vector<int> inputs_of(int layer, int s) const;
  // Backward: slot s present, by recomputation from its inputs when dropped (reloads have
  // been issued and waited for before).
  void materialize(int layer, int s, int batch, int seq);
  void forward_layer(int layer, float* x, float** y_out, int batch, int seq,
                     const MemoryPolicy& policy, TrainingHooks& hooks);
  // dy (T, d): gradient of the layer's output; writes dx (T, d), the input's gradient.
  void backward_layer(int layer, const float* dy, float* dx, int batch, int seq,
                      TrainingHooks& hooks);

  // --- attention_block.cpp --------------------------------------------------------------

  // The attention mixer's forward ops, as produce(); false for a slot that is not theirs.
  bool produce_attention(int layer, int s, int batch, int seq);
  // Attention block backward: mlp.input = attn.input + out_proj(attention(qkv(norm(
  // attn.input)))); from dmid (the gradient at mlp.input), dnorm = the gradient at
  // attn.norm_out (overwritten).
  void attention_backward(int layer, const float* dmid, float* dnorm, int batch, int seq);
  // Note [Q/K norms]: the per-head norms of q and k, in place on T rows of the projection.
  void qk_norm_fwd(const LayerParams& L, float* qkv, int T) const;

  // --- mlp_block.cpp: the dense and the MoE MLPs ----------------------------------------

  // The MLP's forward ops (its norm, then the dense or the MoE MLP), as produce().
  void produce_mlp(int layer, int s, int batch, int seq);
  // The layer's output y (T, d): mlp.input plus the MLP's output.
  void mlp_output(int layer, float* y, int T);
  // MLP backward from dy (the gradient at the layer's output): the gradient at
  // mlp.norm_out into dnorm (T, d, overwritten).
  void mlp_backward(int layer, const float* dy, float* dnorm, int batch, int seq);
  void route(int layer, int tokens);
  // Per-expert GEMM over the dispatched rows: y rows of expert x = x rows * W_x^T.
  void expert_linear(const LayerParams& L, size_t wofs, const float* x, float* y, int in, int out);
  void expert_linear_bwd(const LayerParams& L, size_t wofs, const float* x, const float* dy,
                         float* dx, int in, int out, bool accumulate);

  // --- mamba_block.cpp ------------------------------------------------------------------

  // The Mamba-2 mixer's forward ops (Note [Mamba slots]); false for a slot that is not its.
  bool produce_mamba(int layer, int s, int batch, int seq);
  // The Mamba-2 mixer's backward, as attention_backward: from dmid, dnorm overwritten.
  void mamba_backward(int layer, const float* dmid, float* dnorm, int batch, int seq);
  // Columns [col, col + width) of a (rows, stride) matrix into a new (rows, width) one.
  float* columns(const float* m, int rows, int stride, int col, int width);
  // And back: a (rows, width) matrix into columns [col, col + width) of (rows, stride).
  static void put_columns(const float* src, float* m, int rows, int stride, int col, int width);

  // --- inference.cpp --------------------------------------------------------------------

  // Forward only: the last layer's output (T, d) for input tokens (batch * seq), device
  // memory the caller releases; every saved tensor recomputed (nothing is kept for a
  // backward): a layer's forward frees what it made, and its input is freed once its output
  // exists.
  float* forward_inference(const std::vector<int32_t>& in, int batch, int seq);
};

}  // namespace spillway::nn

// The reference model: a small decoder in the shape of Qwen3-MoE (token embedding,
// RMSNorm, causal GQA attention with RoPE, SwiGLU MLPs dense in some layers and top-k
// routed MoE in others, residuals, final norm, LM head, cross-entropy), fp32, trained on
// the host backend, with every tensor saved for backward explicit and named with the
// planner's names (docs/plan-schema.md).
//
// Note [Saved tensors]: a layer is a fixed list of forward ops over named tensors. Each
// saved tensor is kept in device memory, handed to the offload engine as soon as its
// producer has run (its device memory held until the layer's forward ends), or dropped at
// the end of the layer's forward to be recomputed, as the layer's actions say. In backward a
// tensor is materialized from where it went: kept, reloaded, or recomputed by running
// its producing op again from its own (materialized) inputs. The ops are deterministic, so
// a recomputed or reloaded tensor is bitwise the saved one, and loss and gradients are
// bitwise identical under every policy; tests/nn/model_test.cpp proves it.
//
// Memory: parameters, gradients, the AdamW moments, activations and backward temporaries
// all live in the device's memory (the host backend's arena, whose capacity is the
// budget), so the arena's peak is the run's peak device memory.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "spillway/catalog/model.hpp"
#include "spillway/core/policy.hpp"
#include "spillway/device/device.hpp"
#include "spillway/device/hooks.hpp"
#include "spillway/plan/plan.hpp"

namespace spillway::nn {

struct RefConfig {
  ModelConfig model;  // as parsed by the planner (same config.json fields)
  int vocab = 256;    // byte-level tokens
  int hidden = 0;
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  double rope_theta = 10000.0;
  double rms_eps = 1e-6;
  bool norm_topk = true;
  // Note [Served attention extras]: what a served checkpoint's attention computes beyond the
  // reference model's, which the decoder runs and the training model refuses: biases on the
  // q, k and v projections (Qwen2; attention_bias), on o (attention_bias), sliding windows
  // (per layer, in the layers' AttentionSpec). The biases follow the config. A per-head
  // RMSNorm of q and k before RoPE (Qwen3, Qwen3-MoE) follows the config's family and is
  // trained too (Note [Q/K norms] in attention_block.cpp); the server keeps it only for a
  // checkpoint that holds the norms (the reference model's qwen3_moe checkpoints written
  // before it trained them have none).
  bool qkv_bias = false;
  bool o_bias = false;
  bool qk_norm = false;
  bool sliding_window = false;  // some layer attends a sliding window (Mistral, Qwen2)
  // Note [RoPE scaling] (rope_scaling.cpp): the type, head_dim / 2 inverse frequencies and
  // the factor on cos and sin (yarn's attention factor) as transformers computes them. The
  // decoder serves every type read; the training model only the default one.
  std::string rope_type = "default";
  std::vector<double> rope_inv_freq;
  double rope_attention_factor = 1.0;
  // Sliding-window layers with their own RoPE (Gemma 3: rope_parameters per layer type, the
  // local base 10,000): their frequencies and factor; empty: the ones above.
  std::vector<double> rope_local_inv_freq;
  double rope_local_attention_factor = 1.0;
  // Dynamic NTK RoPE ("dynamic"): past rope_dynamic_length positions (max_position_embeddings)
  // a step's frequencies are those of base theta x (factor x L / length - (factor - 1))^(dim
  // / (dim - 2)), L the sequence's length after the step; 0: not dynamic.
  double rope_dynamic_factor = 0.0;
  int rope_dynamic_length = 0;
  // Note [Served Gemma] (config.cpp): what Gemma 2 and 3 compute beyond the reference
  // model, all served and refused by the training model: norms that multiply by
  // (norm_offset + w) (Gemma: 1); the embedding times embed_scale (sqrt(hidden), rounded to
  // fp32); sandwich norms (after attention, post_attention_layernorm, and after the MLP,
  // post_feedforward_layernorm; the MLP's own is pre_feedforward_layernorm); a GeGLU MLP with
  // tanh-approximated GELU (hidden_activation gelu_pytorch_tanh); the softmax scale
  // query_pre_attn_scalar^-1/2 (attn_scale; 0: 1 / sqrt(head_dim)); soft caps of the
  // attention scores and of the logits (cap x tanh(x / cap); 0: none).
  double norm_offset = 0.0;
  float embed_scale = 1.0f;
  bool sandwich_norms = false;
  bool gelu_mlp = false;
  double attn_scale = 0.0;
  double attn_softcap = 0.0;
  double final_softcap = 0.0;
  // Qwen2-MoE's shared expert: in each MoE layer a SwiGLU MLP of shared_expert_ffn beside the
  // routed experts, its output times sigmoid(shared_expert_gate . x). 0: none.
  int shared_expert_ffn = 0;
  int layers() const { return static_cast<int>(model.layers.size()); }
};

// An embedded reference config (data/nn/: "tiny-moe" for tests and the default run,
// "small-moe" for the benchmark) or a path to a config.json of a qwen3_moe / qwen3 /
// llama-like GQA model. Errors name the field and the value.
RefConfig load_reference_config(const std::string& name_or_path);

// The saved tensors of layer `layer` in forward order (the planner's names).
std::vector<std::string> saved_tensor_names(const RefConfig& c, int layer);

// A policy in this model's terms: per layer, its saved tensors in saved_tensor_names order
// (what Model::step takes). From another policy (a plan's, by memory_policy()), by name: a
// tensor the source does not list (mlp.act under a fused SwiGLU backward) is recomputed; a
// recompute of the layer input, which has no producer in the layer, is refused; a
// different layer count is refused.
MemoryPolicy reference_policy(const RefConfig& c, const MemoryPolicy& from);
// The same from a plan (its memory_policy), named `name`.
MemoryPolicy policy_from_plan(const RefConfig& c, const Plan& plan, const std::string& name);
// Every tensor kept.
MemoryPolicy keep_policy(const RefConfig& c);

// Note [Checkpoint names]: the model's weights by name, in the names of Hugging Face's
// Llama / Qwen3-MoE / Mamba-2 checkpoints where one exists (the attention's q, k and v
// projections are one fused tensor, self_attn.qkv_proj, as in Phi-3; a written checkpoint
// splits it into transformers' q_proj, k_proj and v_proj: Note [Written checkpoints] in
// src/inference/checkpoints.cpp), every weight fp32 and shaped as torch's (a Linear's weight
// is (out, in)). The order is the parameters' order in memory (Model::parameters()): the
// embedding; per layer its input norm, its mixer's weights (q/k norms after the projection),
// its MLP's norm, router, and the experts' gate, up and down projections (each expert its
// own tensor, all gates first); the final norm; the LM head, which with tied embeddings is
// the embedding's matrix (Note [Tied embeddings]: Model::named_weights points it there and
// counts it once).
struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool linear = false;  // a Linear's weight (out, in): a runtime multiplies by it (HybridGEMM)
  int64_t elements() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
};
std::vector<WeightSpec> weight_specs(const RefConfig& c);

struct NamedWeight {
  WeightSpec spec;
  const float* data = nullptr;  // the model's parameter memory (spec.elements() floats)
};

struct StepStats {
  double loss = 0.0;
  double step_ms = 0.0;              // forward and backward (the optimizer step is apart)
  double optimizer_ms = 0.0;         // after backward: the AdamW, or the offloaded end_step
  std::vector<double> layer_fwd_ms;  // host time of each layer's forward
  std::vector<double> layer_bwd_ms;
  int64_t peak_device_bytes = 0;  // arena peak during the step
  int64_t recomputed_ops = 0;     // forward ops run again in backward (recompute)
  int64_t recomputed_scans = 0;   // of them, Mamba selective scans
};

// Note [The model's own update]: with its optimizer on the device (device_optimizer), a
// step ends with the caller's update of the fp32 parameters from their gradients (the
// textbook AdamW of spillway::train), between backward and the weights the next step
// streams. The model keeps the moments in its device memory (counted in its peak); the
// update keeps everything else (hyperparameters, the step counter).
struct DeviceParameters {
  float* weights = nullptr;
  const float* grads = nullptr;
  float* moment1 = nullptr;
  float* moment2 = nullptr;
  size_t n = 0;
};
using ParameterUpdate = std::function<void(const DeviceParameters&)>;

class Model {
 public:
  // Allocates parameters, gradients and optimizer moments in device memory and
  // initializes them from `seed` (normal, std 0.02; norms 1). Throws spillway::Error
  // naming the bytes when the device memory cannot hold them.
  // `device_optimizer` false: no AdamW moments on the device (the optimizer is offloaded).
  Model(const RefConfig& config, Device& device, uint64_t seed, bool device_optimizer = true);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // One training step on tokens (batch, seq + 1) (inputs and shifted targets): forward,
  // backward under `policy` (in this model's terms: reference_policy), then, with a
  // device optimizer, `update` (Note [The model's own update]; empty: none, gradient
  // tests). The engines
  // are reached through `hooks` only (spillway/device/hooks.hpp, Note [Hook sequence]): a tensor
  // the policy offloads is given to them (running without a hook that takes it is an
  // error), needed() brings it back, grad_ready(b) follows each bucket's gradients, and
  // step_end() ends the step. Running out of device memory throws spillway::Error naming
  // the policy, the layer, the tensor and the bytes.
  //
  // With an offloaded optimizer (built with device_optimizer = false, docs/optim.md):
  // the forward computes with the fp32 widening of device_weights_bf16() (which the
  // optimizer writes); as backward completes each bucket of parameter_buckets() its
  // gradients go to device_grads_bf16() in bf16 before grad_ready(b); no update.
  StepStats step(const std::vector<int32_t>& tokens, int batch, int seq, const MemoryPolicy& policy,
                 TrainingHooks& hooks, const ParameterUpdate& update = {});

  // The parameters in optimizer buckets, tiling parameters(): bucket 0 the embedding,
  // bucket 1 + l layer l, the last the final norm and the LM head. Backward completes them
  // last first.
  std::vector<Bucket> parameter_buckets() const;

  // Parameters and their gradients, flattened in a fixed order (for tests).
  int64_t parameter_count() const;
  std::vector<float> parameters() const;
  std::vector<float> gradients() const;
  const RefConfig& config() const;
  // The compute stream the hooks' engines must order their work against.
  Stream compute_stream() const;
  // With an offloaded optimizer (device_optimizer = false; else null): the bf16 weights the
  // forward reads and the bf16 gradients backward writes, parameter_count() each, device
  // memory this model owns (the optimizer pipeline's device weights and gradients).
  uint16_t* device_weights_bf16() const;
  uint16_t* device_grads_bf16() const;

  // Note [Streamed weights] (docs/stream.md): each layer's weights are the parameters of
  // its bucket (parameter_buckets()[1 + l]), fp32. layer_weight_bytes() sizes a source of
  // layer weights over them (Note [Layer weight sources], a WeightStreamer);
  // stream_weights(ws) packs the current weights into its host slabs, and from then on
  // every layer computes from the slot the source hands out
  // (acquire before the layer's forward, and before its backward in a training step,
  // release after): the streamer's schedule must be the step's (training mode for step(),
  // inference for forward_loss()). After a step's update the new weights are packed into
  // the slabs before the streamer's step_end(). The model's own device copy stays the
  // master the updates write (this is a demonstration of the engine on the reference
  // model, not of its memory saving, which the planner and simulator show). Null: every
  // layer reads its device copy again. Not with an offloaded optimizer.
  std::vector<size_t> layer_weight_bytes() const;
  void stream_weights(LayerWeights* weights);
  // Forward only (inference): the mean cross-entropy of tokens (batch, seq + 1), each
  // layer's tensors freed as soon as the next layer has its input.
  double forward_loss(const std::vector<int32_t>& tokens, int batch, int seq);
  // Forward only: the logits (batch * seq, vocab) of tokens (batch, seq), every position's
  // (the reference a served model's outputs are checked against).
  std::vector<float> forward_logits(const std::vector<int32_t>& tokens, int batch, int seq);
  // The weights by name (Note [Checkpoint names]), pointing into the model's parameters.
  std::vector<NamedWeight> named_weights() const;
  // Bytes of the saved tensors of one layer for (batch, seq) (what keep holds per layer).
  int64_t saved_bytes(int layer, int batch, int seq) const;
  // Bytes of each saved tensor of one layer, in saved_tensor_names order.
  std::vector<int64_t> saved_tensor_bytes(int layer, int batch, int seq) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway::nn

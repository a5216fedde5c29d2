// The reference model's public face (include/spillway/nn/nn.hpp): its construction, the
// training step under a memory policy with the engines reached through the socket
// (hooks.hpp, Note [Hook sequence]) and the caller's update (Note [The model's own update]),
// streamed weights (Note [Streamed weights]), and the device memory every part of it
// allocates. A layer over its saved tensors is in saved_tensors.cpp (Note [Saved tensors]),
// the blocks' math in attention_block.cpp, mlp_block.cpp and mamba_block.cpp, the forward
// only in inference.cpp, the parameter layout in parameter_layout.cpp; its config is in
// config.cpp, its policies in policy.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>

#include "core/stats.hpp"
#include "nn/model_impl.hpp"
#include "nn/ops.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"
#include "spillway/nn/nn.hpp"

namespace spillway::nn {

namespace {

// "524288 bytes (0.50 MiB)": exact, and in the unit of --device-memory-mb.
std::string size_text(size_t bytes) {
  return fmt::format("{} bytes ({:.2f} MiB)", bytes, static_cast<double>(bytes) / 1048576.0);
}

}  // namespace

std::string Model::Impl::where() const {
  if (where_layer < 0)
    return fmt::format("{} {}", where_phase, where_what).substr(where_phase[0] == '\0' ? 1 : 0);
  return fmt::format("at layer {} {} ({})", where_layer, where_what, where_phase);
}

void* Model::Impl::alloc(size_t bytes) {
  AllocResult r = dev.allocate(std::max<size_t>(bytes, 1), MemoryKind::kDevice);
  if (!r) {
    const MemoryStats ms = dev.memory_stats();
    throw Error(fmt::format(
        "{}device memory exhausted {}: {} needed, {} in use ({}); raise --device-memory-mb or "
        "use a policy that keeps less (--policy auto finds one that fits)",
        policy_name.empty() ? "" : "policy " + policy_name + ": ", where(), size_text(bytes),
        size_text(static_cast<size_t>(ms.current[0])), r.reason));
  }
  return r.ptr;
}

void Model::Impl::visit_begin(int layer) {
  if (streamer == nullptr) return;
  layer_slot = static_cast<const float*>(streamer->acquire(layer));
  dev.synchronize(compute);
  layer_offset = buckets[static_cast<size_t>(layer) + 1].offset;
}

void Model::Impl::visit_end(int layer) {
  if (streamer == nullptr) return;
  streamer->release(layer);
  layer_slot = nullptr;
}

void Model::Impl::pack_weights() {
  for (int l = 0; l < c.layers(); ++l) {
    const Bucket& k = buckets[static_cast<size_t>(l) + 1];
    dev.synchronize(streamer->host_slab_read(l));
    const size_t layer_bytes = k.n * sizeof(float);
    const size_t at = std::min(streamer->host_slab_offset(l), layer_bytes);
    const size_t slab = streamer->host_slab_bytes(l);
    const size_t n = std::min(slab, layer_bytes - at);
    auto* dst = static_cast<std::byte*>(streamer->host_slab(l));
    std::memcpy(dst, reinterpret_cast<const std::byte*>(w + k.offset) + at, n);
    std::memset(dst + n, 0, slab - n);
  }
}

float* Model::Impl::head_forward(const float* x, int T, float** fn) {
  at(-1, "LM head", "at the");
  *fn = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(d));
  rmsnorm_fwd(x, w + final_norm, *fn, T, d, c.rms_eps);
  float* logits = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(c.vocab));
  linear_fwd(*fn, w + lm_head, logits, T, d, c.vocab);
  return logits;
}

Model::Model(const RefConfig& config, Device& device, uint64_t seed, bool device_optimizer) {
  if (!device.emulated())
    SPILLWAY_INPUT_ERROR(
        "the reference model computes on the host: it needs the host backend (--device host), "
        "not {}",
        device.name());
  // Note [Served attention extras] and [RoPE scaling]: served, not trained.
  if (config.rope_type != "default")
    SPILLWAY_INPUT_ERROR(
        "model config: {} has rope type \"{}\"; the reference model trains with unscaled RoPE "
        "(spillway serve runs it)",
        config.model.name, config.rope_type);
  if (config.sliding_window)
    SPILLWAY_INPUT_ERROR(
        "model config: {} has sliding-window attention; the reference model trains full "
        "causal attention (spillway serve runs the windows)",
        config.model.name);
  if (config.qkv_bias || config.o_bias)
    SPILLWAY_INPUT_ERROR(
        "model config: {} has {}; the reference model trains attention without biases "
        "(spillway serve runs them)",
        config.model.name,
        config.qkv_bias ? "biases on q, k and v (attention_bias, or Qwen2's)"
                        : "a bias on o (attention_bias)");
  // Note [Served Gemma] and Qwen2-MoE's shared expert: served, not trained.
  const char* served_only = config.norm_offset != 0.0     ? "(1 + w) norms (Gemma)"
                            : config.sandwich_norms       ? "sandwich norms (Gemma)"
                            : config.gelu_mlp             ? "a GeGLU MLP (gelu_pytorch_tanh)"
                            : config.embed_scale != 1.0f  ? "a scaled embedding (Gemma)"
                            : config.attn_scale != 0.0    ? "query_pre_attn_scalar (Gemma)"
                            : config.attn_softcap != 0.0  ? "soft-capped attention scores"
                            : config.final_softcap != 0.0 ? "soft-capped logits"
                            : !config.rope_local_inv_freq.empty() ? "a local RoPE (Gemma 3)"
                            : config.shared_expert_ffn != 0       ? "a shared expert (Qwen2-MoE)"
                                                                  : nullptr;
  if (served_only != nullptr)
    SPILLWAY_INPUT_ERROR(
        "model config: {} has {}; the reference model does not train it (spillway serve runs "
        "it)",
        config.model.name, served_only);
  impl_ = std::make_unique<Impl>(config, device);
  Impl& m = *impl_;
  const RefConfig& c = m.c;
  const size_t at = m.n_params;
  const std::string what = fmt::format(
      "for {} parameters, their gradients{}", at,
      device_optimizer ? " and AdamW moments" : ", their bf16 copies (the optimizer is offloaded)");
  m.at(-1, what.c_str(), "");
  m.w = m.alloc_n<float>(at);
  m.g = m.alloc_n<float>(at);
  if (device_optimizer) {
    m.m1 = m.alloc_n<float>(at);
    m.m2 = m.alloc_n<float>(at);
  } else {
    m.w16 = m.alloc_n<uint16_t>(at);
    m.g16 = m.alloc_n<uint16_t>(at);
  }
  init_parameters(m, seed, m.w);
  std::fill(m.g, m.g + at, 0.0f);
  if (device_optimizer) {
    std::fill(m.m1, m.m1 + at, 0.0f);
    std::fill(m.m2, m.m2 + at, 0.0f);
  } else {
    for (size_t i = 0; i < at; ++i) m.w16[i] = float_to_bf16(m.w[i]);
    std::fill(m.g16, m.g16 + at, uint16_t{0});
  }
  m.at(-1, "", "");
  m.saved.resize(static_cast<size_t>(c.layers()));
  for (int l = 0; l < c.layers(); ++l) m.names.push_back(saved_tensor_names(c, l));
  m.compute = UniqueStream(device, StreamRole::kCompute);
  set_blas_threads(1);
}

Model::~Model() {
  Impl& m = *impl_;
  for (float* p : {m.w, m.g, m.m1, m.m2})
    if (p != nullptr) m.release(p);
  for (uint16_t* p : {m.w16, m.g16})
    if (p != nullptr) m.release(p);
}

uint16_t* Model::device_weights_bf16() const {
  return impl_->w16;
}
uint16_t* Model::device_grads_bf16() const {
  return impl_->g16;
}

Stream Model::compute_stream() const {
  return impl_->compute;
}

const RefConfig& Model::config() const {
  return impl_->c;
}
int64_t Model::parameter_count() const {
  return static_cast<int64_t>(impl_->n_params);
}
std::vector<float> Model::parameters() const {
  return {impl_->w, impl_->w + impl_->n_params};
}
std::vector<float> Model::gradients() const {
  return {impl_->g, impl_->g + impl_->n_params};
}
int64_t Model::saved_bytes(int layer, int batch, int seq) const {
  const int n = impl_->lp[static_cast<size_t>(layer)].slots();
  int64_t total = 0;
  for (int s = 0; s < n; ++s)
    total += static_cast<int64_t>(impl_->slot_bytes(layer, s, batch, seq));
  return total;
}

std::vector<int64_t> Model::saved_tensor_bytes(int layer, int batch, int seq) const {
  const int n = impl_->lp[static_cast<size_t>(layer)].slots();
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int s = 0; s < n; ++s)
    out[static_cast<size_t>(s)] = static_cast<int64_t>(impl_->slot_bytes(layer, s, batch, seq));
  return out;
}

std::vector<Bucket> Model::parameter_buckets() const {
  return impl_->buckets;
}

void split_tokens(const std::vector<int32_t>& tokens, int batch, int seq, int vocab,
                  std::vector<int32_t>* in, std::vector<int32_t>* target) {
  const size_t T = static_cast<size_t>(batch) * static_cast<size_t>(seq);
  in->assign(T, 0);
  target->assign(T, 0);
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < seq; ++t) {
      const size_t src =
          static_cast<size_t>(b) * static_cast<size_t>(seq + 1) + static_cast<size_t>(t);
      const int32_t tok = tokens[src];
      const int32_t next = tokens[src + 1];
      if (tok < 0 || tok >= vocab || next < 0 || next >= vocab)
        SPILLWAY_INPUT_ERROR("token {} at position {} is outside the vocabulary [0, {})",
                             tok < 0 || tok >= vocab ? tok : next, src, vocab);
      const size_t at = static_cast<size_t>(b) * static_cast<size_t>(seq) + static_cast<size_t>(t);
      (*in)[at] = tok;
      (*target)[at] = next;
    }
  }
}

StepStats Model::step(const std::vector<int32_t>& tokens, int batch, int seq,
                      const MemoryPolicy& policy, TrainingHooks& hooks,
                      const ParameterUpdate& update) {
  Impl& m = *impl_;
  const RefConfig& c = m.c;
  SPILLWAY_CHECK(batch > 0 && seq > 0, "step: batch {} and seq {} must be > 0", batch, seq);
  SPILLWAY_CHECK(tokens.size() == static_cast<size_t>(batch) * static_cast<size_t>(seq + 1),
                 "step: {} tokens for batch {} x (seq {} + 1)", tokens.size(), batch, seq);
  SPILLWAY_CHECK(policy.layer_count() == c.layers(), "policy {} has {} layers; the model has {}",
                 policy.name, policy.layer_count(), c.layers());
  for (int l = 0; l < c.layers(); ++l) {
    const LayerActions& la = policy.layers[static_cast<size_t>(l)];
    const size_t slots = static_cast<size_t>(m.lp[static_cast<size_t>(l)].slots());
    SPILLWAY_CHECK(la.actions.size() == slots && la.tensors.size() == slots,
                   "policy {}: layer {} lists {} tensors; the model saves {} (reference_policy() "
                   "puts a policy in this model's terms)",
                   policy.name, l, la.actions.size(), slots);
  }
  m.policy_name = policy.name;
  StepStats st;
  st.layer_fwd_ms.assign(static_cast<size_t>(c.layers()), 0.0);
  st.layer_bwd_ms.assign(static_cast<size_t>(c.layers()), 0.0);
  const int T = batch * seq;
  const size_t Td = static_cast<size_t>(T) * static_cast<size_t>(m.d);
  std::vector<int32_t> in, target;
  split_tokens(tokens, batch, seq, c.vocab, &in, &target);
  const bool offloaded_optimizer = m.w16 != nullptr;
  SPILLWAY_CHECK(!offloaded_optimizer || !update,
                 "step: an update was given, but this Model's optimizer is offloaded (built with "
                 "device_optimizer = false): its hooks step it");
  hooks.step_begin();
  if (offloaded_optimizer) {
    // The weights of this step: the bf16 ones the optimizer wrote (the last step's uploads
    // are ordered before the compute stream's next work), widened for the fp32 ops.
    m.dev.synchronize(m.compute);
    for (size_t i = 0; i < m.n_params; ++i) m.w[i] = bf16_to_float(m.w16[i]);
  }
  // A bucket's gradients are complete: with an offloaded optimizer, in bf16 to its buffer,
  // then to the hooks.
  auto hand_over = [&](int b) {
    if (!offloaded_optimizer) return;
    const Bucket& k = m.buckets[static_cast<size_t>(b)];
    uint16_t* g16 = m.g16 + k.offset;
    for (size_t i = 0; i < k.n; ++i) g16[i] = float_to_bf16(m.g[k.offset + i]);
    hooks.grad_ready(b);
  };
  m.dev.reset_peaks();
  m.recomputed_ops = 0;
  m.recomputed_scans = 0;
  const auto t0 = Clock::now();
  std::fill(m.g, m.g + m.n_params, 0.0f);
  m.at(-1, "embedding", "at the");
  float* x = m.alloc_n<float>(Td);
  embedding_fwd(in.data(), m.w + m.embed, x, T, m.d);
  for (int l = 0; l < c.layers(); ++l) {
    const auto tl = Clock::now();
    float* y = nullptr;
    m.visit_begin(l);
    m.forward_layer(l, x, &y, batch, seq, policy, hooks);
    m.visit_end(l);
    x = y;  // the layer's input now belongs to its saved tensors
    st.layer_fwd_ms[static_cast<size_t>(l)] = ms_since(tl);
  }
  // Head: final norm, LM head, cross-entropy (x is the last layer's output).
  float* fn = nullptr;
  float* logits = m.head_forward(x, T, &fn);
  const size_t tv = static_cast<size_t>(T) * static_cast<size_t>(c.vocab);
  float* dlogits = m.alloc_n<float>(tv);
  st.loss = cross_entropy(logits, target.data(), dlogits, T, c.vocab);
  m.release(logits);
  float* dfn = m.alloc_n<float>(Td);
  // Tied (Note [Tied embeddings]): this writes the embedding's gradient first.
  linear_bwd(fn, m.w + m.lm_head, dlogits, dfn, m.g + m.lm_head, T, m.d, c.vocab, false);
  m.release(dlogits);
  float* dy = m.alloc_n<float>(Td);
  rmsnorm_bwd(x, m.w + m.final_norm, dfn, dy, m.g + m.final_norm, T, m.d, c.rms_eps);
  m.release(dfn);
  m.release(fn);
  m.release(x);
  hand_over(c.layers() + 1);  // the final norm and the LM head
  float* dx = m.alloc_n<float>(Td);
  for (int l = c.layers() - 1; l >= 0; --l) {
    const auto tl = Clock::now();
    m.visit_begin(l);
    m.backward_layer(l, dy, dx, batch, seq, hooks);
    m.visit_end(l);
    std::swap(dy, dx);
    hand_over(l + 1);
    st.layer_bwd_ms[static_cast<size_t>(l)] = ms_since(tl);
  }
  embedding_bwd(in.data(), dy, m.g + m.embed, T, m.d);  // tied: adds to the head's
  hand_over(0);
  m.release(dx);
  m.release(dy);
  st.step_ms = ms_since(t0);
  {
    // The engines finish the step (the offload engine's telemetry; an offloaded
    // optimizer validates and uploads the next step's weights).
    const auto to = Clock::now();
    hooks.step_end();
    if (offloaded_optimizer) {
      m.dev.synchronize(m.compute);  // the device weights of the next step are ready
      st.optimizer_ms = ms_since(to);
    }
  }
  st.peak_device_bytes = m.dev.memory_stats().peak[0];
  st.recomputed_ops = m.recomputed_ops;
  st.recomputed_scans = m.recomputed_scans;
  const bool updated = static_cast<bool>(update);
  if (updated) {
    // Note [The model's own update].
    const auto to = Clock::now();
    update(DeviceParameters{m.w, m.g, m.m1, m.m2, m.n_params});
    st.optimizer_ms = ms_since(to);
  }
  if (m.streamer != nullptr) {
    // Note [Streamed weights]: the next step streams the updated weights.
    if (updated) m.pack_weights();
    m.streamer->step_end();
  }
  return st;
}

std::vector<size_t> Model::layer_weight_bytes() const {
  std::vector<size_t> out;
  out.reserve(static_cast<size_t>(impl_->c.layers()));
  for (int l = 0; l < impl_->c.layers(); ++l)
    out.push_back(impl_->buckets[static_cast<size_t>(l) + 1].n * sizeof(float));
  return out;
}

void Model::stream_weights(LayerWeights* weights) {
  Impl& m = *impl_;
  SPILLWAY_CHECK(m.w16 == nullptr,
                 "stream_weights: this Model's optimizer is offloaded; streamed weights need "
                 "the device optimizer");
  if (weights != nullptr) {
    SPILLWAY_CHECK(weights->layers() == m.c.layers(),
                   "stream_weights: the streamer has {} layers; the model {}", weights->layers(),
                   m.c.layers());
    const std::vector<size_t> want = layer_weight_bytes();
    // A full-copy streamer's slab is the layer; a sharded one's (Note [Sharded streaming])
    // is this rank's shard and its slots hold the ranks' shards end to end: the layer
    // from their start.
    for (int l = 0; l < m.c.layers(); ++l) {
      const size_t layer = want[static_cast<size_t>(l)];
      const size_t slab = weights->host_slab_bytes(l);
      const bool whole = slab == layer && weights->host_slab_offset(l) == 0;
      const bool shard = slab < layer && weights->host_slab_offset(l) % slab == 0 &&
                         weights->slot_bytes() >= layer;
      SPILLWAY_CHECK(whole || shard,
                     "stream_weights: layer {} of the streamer holds {} bytes from offset {}; "
                     "the model's layer has {} (a streamer of layer_weight_bytes())",
                     l, slab, weights->host_slab_offset(l), layer);
    }
  }
  m.streamer = weights;
  if (weights != nullptr) m.pack_weights();
}

std::vector<NamedWeight> Model::named_weights() const {
  const Impl& m = *impl_;
  std::vector<NamedWeight> out;
  size_t at = 0;
  for (WeightSpec& s : weight_specs(m.c)) {
    if (m.tied && s.name == "lm_head.weight") {  // Note [Tied embeddings]: the embedding's
      out.push_back({std::move(s), m.w + m.lm_head});
      continue;
    }
    const size_t n = static_cast<size_t>(s.elements());
    out.push_back({std::move(s), m.w + at});
    at += n;
  }
  SPILLWAY_CHECK(at == m.n_params, "named_weights: the specs cover {} of {} parameters", at,
                 m.n_params);
  return out;
}

}  // namespace spillway::nn

// The reference model in inference mode with a KV cache (spillway/nn/decoder.hpp).
#include "spillway/nn/decoder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "nn/ops.hpp"
#include "spillway/core/error.hpp"

namespace spillway::nn {

const float* MemoryWeights::values(int weight) {
  SPILLWAY_CHECK(weight >= 0 && static_cast<size_t>(weight) < w_.size(),
                 "MemoryWeights: weight {} of {}", weight, w_.size());
  return w_[static_cast<size_t>(weight)];
}

void MemoryWeights::linear(int weight, const float* x, float* y, int n, int in, int out) {
  linear_fwd(x, values(weight), y, n, in, out);
}

namespace {

// A layer's weights (indices into weight_specs) and shapes.
struct LayerIds {
  int attn_norm = -1, wqkv = -1, wo = -1, mlp_norm = -1, router = -1;
  // Note [Served attention extras]: -1 when the attention has none.
  int qkv_bias = -1, o_bias = -1, q_norm = -1, k_norm = -1;
  int window = 0;           // a sliding window's keys (Mistral, Qwen2's upper layers); 0: full
  bool local_rope = false;  // RoPE from the local tables (Gemma 3's sliding layers)
  // Note [Served Gemma]: the sandwich's norms of the attention's and the MLP's outputs.
  int attn_post_norm = -1, mlp_post_norm = -1;
  // Qwen2-MoE's shared expert: its projections and gate, and its width (0: none).
  int sh_gate = -1, sh_up = -1, sh_down = -1, sh_weight = -1, shared_ffn = 0;
  std::vector<int> w1, w3, w2;  // per expert (dense: one)
  bool moe = false;
  int experts = 1, top_k = 1, ffn = 0;
  // A Mamba-2 mixer (Note [Decoder state]): its weights and shapes.
  bool mamba = false;
  int w_in = -1, conv_w = -1, conv_b = -1, dt_bias = -1, a_log = -1, dskip = -1, gnorm = -1,
      w_out = -1;
  SsdShape ssd;  // heads, head_dim, groups, state (batch 1, seq set per chunk)
  int conv = 0, inner = 0, conv_dim = 0, in_width = 0;
  int state_index = -1;  // its place among the Mamba layers
};

// The buffers of a step, all sized once for max_step_tokens rows.
struct Sizes {
  size_t rows = 0, seqs = 0, d = 0, qkv = 0, q = 0, ffn_rows = 0, experts = 0, topk_rows = 0;
  size_t cache_floats = 0;  // one layer's K (or V) of one sequence
  size_t attn_layers = 0;
  // Mamba-2 layers: per sequence and layer the conv's last inputs and the SSM state (the
  // largest layer's sizes), and a step's buffers.
  size_t mamba_layers = 0, mamba_state = 0, in_width = 0, conv_rows = 0, conv_dim = 0, inner = 0,
         gn = 0, heads = 0;
  size_t rope = 0;          // max_context x head_dim / 2 angles
  size_t local_rope = 0;    // the same for the sliding layers' own RoPE (Gemma 3), or 0
  size_t dynamic_rope = 0;  // a step's rows x head_dim / 2 angles (dynamic RoPE), or 0
  size_t attn_scratch = 0;  // attention_cached_fwd's, for the largest chunk at the end
};

Sizes sizes_for(const RefConfig& c, const DecoderOptions& o) {
  Sizes s;
  s.rows = static_cast<size_t>(o.max_step_tokens);
  s.seqs = static_cast<size_t>(o.max_sequences);
  s.d = static_cast<size_t>(c.hidden);
  s.qkv = static_cast<size_t>(c.heads + 2 * c.kv_heads) * static_cast<size_t>(c.head_dim);
  s.q = static_cast<size_t>(c.heads) * static_cast<size_t>(c.head_dim);
  for (const LayerSpec& l : c.model.layers) {
    const bool moe = l.mlp.kind == MlpKind::kMoe;
    const size_t k = moe ? static_cast<size_t>(l.mlp.top_k) : 1;
    s.ffn_rows = std::max(s.ffn_rows, s.rows * k * static_cast<size_t>(l.mlp.ffn));
    if (moe) s.ffn_rows = std::max(s.ffn_rows, s.rows * static_cast<size_t>(l.mlp.shared_ffn));
    s.topk_rows = std::max(s.topk_rows, s.rows * k);
    if (moe) s.experts = std::max(s.experts, static_cast<size_t>(l.mlp.experts));
    if (l.mixer != MixerKind::kMamba) {
      ++s.attn_layers;
      continue;
    }
    const SsmSpec& m = l.ssm;
    const size_t inner = static_cast<size_t>(m.heads * m.head_dim);
    const size_t gn = static_cast<size_t>(m.groups * m.state);
    const size_t conv_dim = inner + 2 * gn;
    ++s.mamba_layers;
    s.mamba_state = std::max(s.mamba_state, static_cast<size_t>(m.conv - 1) * conv_dim +
                                                inner * static_cast<size_t>(m.state));
    s.in_width = std::max(s.in_width, inner + conv_dim + static_cast<size_t>(m.heads));
    s.conv_rows = std::max(s.conv_rows, static_cast<size_t>(m.conv - 1));
    s.conv_dim = std::max(s.conv_dim, conv_dim);
    s.inner = std::max(s.inner, inner);
    s.gn = std::max(s.gn, gn);
    s.heads = std::max(s.heads, static_cast<size_t>(m.heads));
  }
  s.cache_floats =
      static_cast<size_t>(c.kv_heads) * static_cast<size_t>(o.max_context) * c.head_dim;
  s.rope = static_cast<size_t>(o.max_context) * static_cast<size_t>(c.head_dim / 2);
  s.local_rope = c.rope_local_inv_freq.empty() ? 0 : s.rope;
  s.dynamic_rope = c.rope_dynamic_factor > 0 ? s.rows * static_cast<size_t>(c.head_dim / 2) : 0;
  s.attn_scratch = attention_cached_scratch(std::min(o.max_step_tokens, o.max_context),
                                            o.max_context, c.heads, c.head_dim);
  return s;
}

// Float counts of each buffer, in allocation order.
std::vector<size_t> buffer_floats(const RefConfig& c, const Sizes& s) {
  return {
      2 * s.attn_layers * s.seqs * s.cache_floats,  // KV cache
      s.rows * s.d,                                 // x
      s.rows * s.d,                                 // norm
      s.rows * s.qkv,                               // qkv
      s.rows * s.q,                                 // attention output
      s.rows * s.d,                                 // mid
      s.rows * s.d,                                 // y
      s.ffn_rows,                                   // gate
      s.ffn_rows,                                   // up
      s.ffn_rows,                                   // act
      s.rows * s.experts,                           // router logits
      s.rows * s.experts,                           // router probs
      s.topk_rows,                                  // top-k weights
      s.topk_rows,                                  // top-k indices (int32)
      s.topk_rows * s.d,                            // dispatched rows
      s.topk_rows * s.d,                            // experts' outputs
      2 * s.topk_rows + s.experts + 1,              // perm, inv, offsets (int32)
      s.rows,                                       // tokens (int32)
      s.seqs * s.d,                                 // last rows
      s.seqs * s.d,                                 // their final norm
      2 * s.rope,                                   // RoPE cosines (doubles)
      2 * s.rope,                                   // RoPE sines (doubles)
      s.attn_scratch,                               // attention's scratch
      s.mamba_layers * s.seqs * s.mamba_state,      // Mamba conv inputs and SSM states
      s.rows * s.in_width,                          // in_proj's output
      (s.rows + s.conv_rows) * s.conv_dim,          // a chunk's conv input, its history first
      (s.rows + s.conv_rows) * s.conv_dim,          // ... and output
      s.rows * s.inner,                             // a chunk's x
      s.rows * s.gn,                                // B
      s.rows * s.gn,                                // C
      s.rows * s.heads,                             // dt
      s.rows * s.inner,                             // the scan's y, all chunks
      s.rows * s.inner,                             // z
      s.rows * s.inner,                             // the gated norm's output
      2 * s.local_rope,                             // local RoPE cosines (doubles)
      2 * s.local_rope,                             // local RoPE sines (doubles)
      2 * s.dynamic_rope,                           // a step's dynamic RoPE cosines (doubles)
      2 * s.dynamic_rope,                           // ... and sines
  };
  (void)c;
}

// RoPE's cos and sin (times `factor`) of positions first .. first + count - 1 at frequencies
// `inv`, row t - first of the tables (head_dim / 2 each).
void fill_rope(const std::vector<double>& inv, double factor, int first, int count, double* cos_t,
               double* sin_t) {
  const size_t half = inv.size();
  for (int t = 0; t < count; ++t) {
    for (size_t i = 0; i < half; ++i) {
      const double angle = (first + t) * inv[i];
      const size_t at = static_cast<size_t>(t) * half + i;
      cos_t[at] = std::cos(angle) * factor;
      sin_t[at] = std::sin(angle) * factor;
    }
  }
}

// Note [Dynamic RoPE]: transformers' dynamic NTK frequencies for a sequence `length` long
// (_compute_dynamic_ntk_parameters): up to max_position_embeddings the default ones; past it
// those of base theta x (factor x length / max - (factor - 1))^(dim / (dim - 2)).
void dynamic_frequencies(const RefConfig& c, int length, std::vector<double>& inv) {
  const double dim = c.head_dim;
  const double max = c.rope_dynamic_length;
  const double f = c.rope_dynamic_factor;
  const double seq = std::max(static_cast<double>(length), max);
  const double base = c.rope_theta * std::pow(f * seq / max - (f - 1), dim / (dim - 2));
  for (size_t i = 0; i < inv.size(); ++i)
    inv[i] = 1.0 / std::pow(base, 2.0 * static_cast<double>(i) / dim);
}

}  // namespace

struct Decoder::Impl {
  RefConfig c;
  Device& dev;
  DecoderOptions o;
  Sizes s;
  std::vector<LayerIds> layers;
  std::vector<int> attn_index;  // layer -> its place among the attention layers
  int embed = -1, final_norm = -1, lm_head = -1;
  std::vector<int> lengths;
  std::vector<void*> blocks;
  float *kv = nullptr, *x = nullptr, *norm = nullptr, *qkv = nullptr, *core = nullptr,
        *mid = nullptr, *y = nullptr, *gate = nullptr, *up = nullptr, *act = nullptr,
        *rlogits = nullptr, *probs = nullptr, *tw = nullptr, *disp = nullptr, *eout = nullptr,
        *last = nullptr, *lastn = nullptr, *attn_scratch = nullptr, *mstate = nullptr,
        *inproj = nullptr, *conv_in = nullptr, *conv_out = nullptr, *sx = nullptr, *sb = nullptr,
        *sc = nullptr, *sdt = nullptr, *sy = nullptr, *sz = nullptr, *sgated = nullptr;
  double *rope_cos = nullptr, *rope_sin = nullptr, *local_cos = nullptr, *local_sin = nullptr,
         *dyn_cos = nullptr, *dyn_sin = nullptr;
  // Note [Dynamic RoPE]: per chunk of a step, its RoPE table and the table's first position.
  std::vector<const double*> chunk_cos, chunk_sin;
  std::vector<int> chunk_first;
  std::vector<double> dyn_inv;  // a step's frequencies (head_dim / 2), sized once
  int32_t *tidx = nullptr, *perm = nullptr, *inv = nullptr, *offsets = nullptr, *tokens = nullptr;
  std::vector<char> seen;  // per sequence, during a step's checks

  Impl(const RefConfig& cfg, Device& d, const DecoderOptions& opt) : c(cfg), dev(d), o(opt) {}

  float* k_cache(int layer, int sequence) {
    const size_t a = static_cast<size_t>(attn_index[static_cast<size_t>(layer)]);
    return kv + ((a * s.seqs + static_cast<size_t>(sequence)) * 2) * s.cache_floats;
  }
  float* v_cache(int layer, int sequence) { return k_cache(layer, sequence) + s.cache_floats; }
  // Note [Decoder state]: a Mamba layer's state of a sequence: the conv's last conv - 1
  // inputs (conv_dim each), then the SSM state (heads x head_dim x state).
  float* mamba_state(const LayerIds& L, int sequence) {
    return mstate + (static_cast<size_t>(L.state_index) * s.seqs + static_cast<size_t>(sequence)) *
                        s.mamba_state;
  }

  // Note [Served attention extras]: the q, k, v biases and the per-head q/k RMSNorm on the
  // step's qkv rows, before attention (whose RoPE follows the norms, as in Qwen3).
  void attention_extras(const LayerIds& L, WeightSource& w, int T) {
    const int width = static_cast<int>(s.qkv);
    if (L.qkv_bias >= 0) add_bias(qkv, w.values(L.qkv_bias), T, width);
    if (L.q_norm < 0) return;
    const float* qn = w.values(L.q_norm);
    const float* kn = w.values(L.k_norm);
    for (int t = 0; t < T; ++t) {
      float* row = qkv + static_cast<size_t>(t) * static_cast<size_t>(width);
      rmsnorm_fwd(row, qn, row, c.heads, c.head_dim, c.rms_eps, c.norm_offset);
      float* k = row + static_cast<size_t>(c.heads) * static_cast<size_t>(c.head_dim);
      rmsnorm_fwd(k, kn, k, c.kv_heads, c.head_dim, c.rms_eps, c.norm_offset);
    }
  }
  static void add_bias(float* y, const float* b, int rows, int width) {
    for (int r = 0; r < rows; ++r) {
      float* yr = y + static_cast<size_t>(r) * static_cast<size_t>(width);
      for (int i = 0; i < width; ++i) yr[i] += b[i];
    }
  }

  // A Mamba-2 mixer over the step's rows (Note [Decoder state]): norm rows in `norm`, the
  // mixer's output added to the residual x into `mid`.
  void mamba_mixer(const LayerIds& L, WeightSource& w, const DecodeChunk* chunks, int count, int T);

  // Expert GEMMs over the dispatched rows (offsets by expert), through the source.
  void experts_linear(WeightSource& w, const std::vector<int>& ids, const float* in, float* out,
                      int width_in, int width_out) {
    for (size_t e = 0; e < ids.size(); ++e) {
      const int r0 = offsets[e];
      const int n = offsets[e + 1] - r0;
      if (n == 0) continue;
      w.linear(ids[e], in + static_cast<size_t>(r0) * static_cast<size_t>(width_in),
               out + static_cast<size_t>(r0) * static_cast<size_t>(width_out), n, width_in,
               width_out);
    }
  }
};

// Note [Decoder state]: a Mamba-2 layer carries, per sequence, the last conv - 1 inputs of
// its causal convolution and its SSM state. A chunk's convolution runs over those inputs
// followed by the chunk's (its first conv - 1 outputs, which see the zero padding, are
// dropped), and the scan continues from the state (ssd_scan_carry_fwd): the same arithmetic
// as the training forward's over the whole sequence. reset() zeroes both.
void Decoder::Impl::mamba_mixer(const LayerIds& L, WeightSource& w, const DecodeChunk* chunks,
                                int count, int T) {
  const int d = c.hidden;
  const int gn = L.ssd.groups * L.ssd.state;
  const int hist = L.conv - 1;
  const auto row = [](int r, int width) {
    return static_cast<size_t>(r) * static_cast<size_t>(width);
  };
  const size_t f = sizeof(float);
  w.linear(L.w_in, norm, inproj, T, d, L.in_width);
  const float* conv_w = w.values(L.conv_w);
  const float* conv_b = w.values(L.conv_b);
  const float* dt_bias = w.values(L.dt_bias);
  const float* a_log = w.values(L.a_log);
  const float* dskip = w.values(L.dskip);
  for (int i = 0, r = 0; i < count; r += chunks[i].n, ++i) {
    const int n = chunks[i].n;
    float* st = mamba_state(L, chunks[i].sequence);
    std::memcpy(conv_in, st, row(hist, L.conv_dim) * f);
    for (int t = 0; t < n; ++t)
      std::memcpy(conv_in + row(hist + t, L.conv_dim), inproj + row(r + t, L.in_width) + L.inner,
                  static_cast<size_t>(L.conv_dim) * f);
    causal_conv1d_silu_fwd(conv_in, conv_w, conv_b, conv_out, 1, n + hist, L.conv_dim, L.conv);
    std::memcpy(st, conv_in + row(n, L.conv_dim), row(hist, L.conv_dim) * f);
    for (int t = 0; t < n; ++t) {
      const float* out = conv_out + row(hist + t, L.conv_dim);
      std::memcpy(sx + row(t, L.inner), out, static_cast<size_t>(L.inner) * f);
      std::memcpy(sb + row(t, gn), out + L.inner, static_cast<size_t>(gn) * f);
      std::memcpy(sc + row(t, gn), out + L.inner + gn, static_cast<size_t>(gn) * f);
      std::memcpy(sdt + row(t, L.ssd.heads), inproj + row(r + t, L.in_width) + L.inner + L.conv_dim,
                  static_cast<size_t>(L.ssd.heads) * f);
    }
    SsdShape sh = L.ssd;
    sh.batch = 1;
    sh.seq = n;
    sh.chunk = n;
    ssd_scan_carry_fwd(sh, sx, sdt, dt_bias, a_log, sb, sc, dskip, sy + row(r, L.inner),
                       st + row(hist, L.conv_dim));
  }
  for (int t = 0; t < T; ++t)
    std::memcpy(sz + row(t, L.inner), inproj + row(t, L.in_width),
                static_cast<size_t>(L.inner) * f);
  gated_rmsnorm_fwd(sy, sz, w.values(L.gnorm), sgated, T, L.inner, c.rms_eps);
  w.linear(L.w_out, sgated, mid, T, L.inner, d);
  add(x, mid, mid, row(T, d));
}

int64_t Decoder::device_bytes_for(const RefConfig& c, const DecoderOptions& o) {
  int64_t bytes = 0;
  for (size_t n : buffer_floats(c, sizes_for(c, o))) bytes += static_cast<int64_t>(n) * 4;
  return bytes;
}

Decoder::Decoder(const RefConfig& c, Device& dev, const DecoderOptions& o)
    : impl_(std::make_unique<Impl>(c, dev, o)) {
  Impl& m = *impl_;
  if (o.max_sequences < 1 || o.max_context < 1 || o.max_step_tokens < 1)
    SPILLWAY_INPUT_ERROR(
        "decoder: max_sequences {}, max_context {} and max_step_tokens {} must be >= 1",
        o.max_sequences, o.max_context, o.max_step_tokens);
  std::unordered_map<std::string, int> index;
  const std::vector<WeightSpec> specs = weight_specs(c);
  for (size_t i = 0; i < specs.size(); ++i) index[specs[i].name] = static_cast<int>(i);
  auto id = [&](const std::string& name) {
    const auto it = index.find(name);
    SPILLWAY_CHECK(it != index.end(), "decoder: no weight {}", name);
    return it->second;
  };
  m.embed = id("model.embed_tokens.weight");
  m.final_norm = id("model.norm.weight");
  m.lm_head = id("lm_head.weight");
  int attn = 0, mamba = 0;
  for (int l = 0; l < c.layers(); ++l) {
    const LayerSpec& spec = c.model.layers[static_cast<size_t>(l)];
    const std::string p = fmt::format("model.layers.{}.", l);
    LayerIds L;
    L.attn_norm = id(p + "input_layernorm.weight");
    if (spec.mixer == MixerKind::kMamba) {
      const SsmSpec& sm = spec.ssm;
      L.mamba = true;
      L.w_in = id(p + "mixer.in_proj.weight");
      L.conv_w = id(p + "mixer.conv1d.weight");
      L.conv_b = id(p + "mixer.conv1d.bias");
      L.dt_bias = id(p + "mixer.dt_bias");
      L.a_log = id(p + "mixer.A_log");
      L.dskip = id(p + "mixer.D");
      L.gnorm = id(p + "mixer.norm.weight");
      L.w_out = id(p + "mixer.out_proj.weight");
      L.ssd.heads = static_cast<int>(sm.heads);
      L.ssd.head_dim = static_cast<int>(sm.head_dim);
      L.ssd.groups = static_cast<int>(sm.groups);
      L.ssd.state = static_cast<int>(sm.state);
      L.conv = static_cast<int>(sm.conv);
      L.inner = L.ssd.heads * L.ssd.head_dim;
      L.conv_dim = L.inner + 2 * L.ssd.groups * L.ssd.state;
      L.in_width = L.inner + L.conv_dim + L.ssd.heads;
      L.state_index = mamba++;
    } else {
      L.wqkv = id(p + "self_attn.qkv_proj.weight");
      L.window = static_cast<int>(spec.attn.sliding_window);
      L.local_rope = L.window > 0 && !c.rope_local_inv_freq.empty();
      L.wo = id(p + "self_attn.o_proj.weight");
      if (c.qkv_bias) L.qkv_bias = id(p + "self_attn.qkv_proj.bias");
      if (c.o_bias) L.o_bias = id(p + "self_attn.o_proj.bias");
      if (c.qk_norm) {
        L.q_norm = id(p + "self_attn.q_norm.weight");
        L.k_norm = id(p + "self_attn.k_norm.weight");
      }
    }
    if (c.sandwich_norms) {  // Note [Served Gemma]
      SPILLWAY_CHECK(!L.mamba && spec.mlp.kind != MlpKind::kMoe,
                     "decoder: sandwich norms in layer {} with a Mamba mixer or experts", l);
      L.attn_post_norm = id(p + "post_attention_layernorm.weight");
      L.mlp_norm = id(p + "pre_feedforward_layernorm.weight");
      L.mlp_post_norm = id(p + "post_feedforward_layernorm.weight");
    } else {
      L.mlp_norm = id(p + "post_attention_layernorm.weight");
    }
    L.moe = spec.mlp.kind == MlpKind::kMoe;
    L.ffn = static_cast<int>(spec.mlp.ffn);
    if (L.moe) {
      L.experts = static_cast<int>(spec.mlp.experts);
      L.top_k = static_cast<int>(spec.mlp.top_k);
      L.router = id(p + "mlp.gate.weight");
      for (int e = 0; e < L.experts; ++e) {
        L.w1.push_back(id(fmt::format("{}mlp.experts.{}.gate_proj.weight", p, e)));
        L.w3.push_back(id(fmt::format("{}mlp.experts.{}.up_proj.weight", p, e)));
        L.w2.push_back(id(fmt::format("{}mlp.experts.{}.down_proj.weight", p, e)));
      }
      L.shared_ffn = static_cast<int>(spec.mlp.shared_ffn);
      if (L.shared_ffn > 0) {
        L.sh_gate = id(p + "mlp.shared_expert.gate_proj.weight");
        L.sh_up = id(p + "mlp.shared_expert.up_proj.weight");
        L.sh_down = id(p + "mlp.shared_expert.down_proj.weight");
        L.sh_weight = id(p + "mlp.shared_expert_gate.weight");
      }
    } else {
      L.w1 = {id(p + "mlp.gate_proj.weight")};
      L.w3 = {id(p + "mlp.up_proj.weight")};
      L.w2 = {id(p + "mlp.down_proj.weight")};
    }
    m.attn_index.push_back(L.mamba ? -1 : attn++);
    m.layers.push_back(std::move(L));
  }
  m.s = sizes_for(c, o);
  const std::vector<size_t> floats = buffer_floats(c, m.s);
  int64_t total = 0;
  for (size_t n : floats) total += static_cast<int64_t>(n) * 4;
  for (size_t n : floats) {
    AllocResult r = dev.allocate(std::max<size_t>(n * 4, 4), MemoryKind::kDevice);
    if (!r) {
      for (void* p : m.blocks) dev.free(p, MemoryKind::kDevice);
      SPILLWAY_INPUT_ERROR(
          "decoder: {} bytes of device memory for the KV cache and the step's buffers ({} "
          "sequences of {} tokens, {} tokens a step) do not fit: {}",
          total, o.max_sequences, o.max_context, o.max_step_tokens, r.reason);
    }
    m.blocks.push_back(r.ptr);
  }
  auto f = [&](size_t i) { return static_cast<float*>(m.blocks[i]); };
  auto i32 = [&](size_t i) { return static_cast<int32_t*>(m.blocks[i]); };
  m.kv = f(0);
  m.x = f(1);
  m.norm = f(2);
  m.qkv = f(3);
  m.core = f(4);
  m.mid = f(5);
  m.y = f(6);
  m.gate = f(7);
  m.up = f(8);
  m.act = f(9);
  m.rlogits = f(10);
  m.probs = f(11);
  m.tw = f(12);
  m.tidx = i32(13);
  m.disp = f(14);
  m.eout = f(15);
  m.perm = i32(16);
  m.inv = m.perm + m.s.topk_rows;
  m.offsets = m.inv + m.s.topk_rows;
  m.tokens = i32(17);
  m.last = f(18);
  m.lastn = f(19);
  m.rope_cos = static_cast<double*>(m.blocks[20]);
  m.rope_sin = static_cast<double*>(m.blocks[21]);
  m.attn_scratch = f(22);
  m.mstate = f(23);
  m.inproj = f(24);
  m.conv_in = f(25);
  m.conv_out = f(26);
  m.sx = f(27);
  m.sb = f(28);
  m.sc = f(29);
  m.sdt = f(30);
  m.sy = f(31);
  m.sz = f(32);
  m.sgated = f(33);
  m.local_cos = static_cast<double*>(m.blocks[34]);
  m.local_sin = static_cast<double*>(m.blocks[35]);
  m.dyn_cos = static_cast<double*>(m.blocks[36]);
  m.dyn_sin = static_cast<double*>(m.blocks[37]);
  m.chunk_cos.assign(static_cast<size_t>(o.max_sequences), nullptr);
  m.chunk_sin.assign(static_cast<size_t>(o.max_sequences), nullptr);
  m.chunk_first.assign(static_cast<size_t>(o.max_sequences), 0);
  m.dyn_inv.assign(static_cast<size_t>(c.head_dim / 2), 0.0);
  // Note [RoPE scaling]: the config's frequencies; yarn scales cos and sin.
  const int half = c.head_dim / 2;
  SPILLWAY_CHECK(c.rope_inv_freq.size() == static_cast<size_t>(half),
                 "decoder: {} RoPE frequencies for head_dim {}", c.rope_inv_freq.size(),
                 c.head_dim);
  fill_rope(c.rope_inv_freq, c.rope_attention_factor, 0, o.max_context, m.rope_cos, m.rope_sin);
  if (!c.rope_local_inv_freq.empty()) {
    SPILLWAY_CHECK(c.rope_local_inv_freq.size() == static_cast<size_t>(half),
                   "decoder: {} local RoPE frequencies for head_dim {}",
                   c.rope_local_inv_freq.size(), c.head_dim);
    fill_rope(c.rope_local_inv_freq, c.rope_local_attention_factor, 0, o.max_context, m.local_cos,
              m.local_sin);
  }
  std::fill_n(m.mstate, m.s.mamba_layers * m.s.seqs * m.s.mamba_state, 0.0f);
  m.lengths.assign(static_cast<size_t>(o.max_sequences), 0);
  m.seen.assign(static_cast<size_t>(o.max_sequences), 0);
}

Decoder::~Decoder() {
  for (void* p : impl_->blocks) impl_->dev.free(p, MemoryKind::kDevice);
}

const RefConfig& Decoder::config() const {
  return impl_->c;
}
const DecoderOptions& Decoder::options() const {
  return impl_->o;
}

int Decoder::length(int sequence) const {
  SPILLWAY_CHECK(sequence >= 0 && sequence < impl_->o.max_sequences, "decoder: sequence {} of {}",
                 sequence, impl_->o.max_sequences);
  return impl_->lengths[static_cast<size_t>(sequence)];
}

void Decoder::reset(int sequence) {
  (void)length(sequence);
  Impl& m = *impl_;
  m.lengths[static_cast<size_t>(sequence)] = 0;
  // Note [Decoder state]: a new sequence starts from zero conv inputs and a zero SSM state.
  for (const LayerIds& L : m.layers)
    if (L.mamba) std::fill_n(m.mamba_state(L, sequence), m.s.mamba_state, 0.0f);
}

void Decoder::step(const DecodeChunk* chunks, int count, WeightSource& weights, float* logits) {
  Impl& m = *impl_;
  const RefConfig& c = m.c;
  if (count < 1 || count > m.o.max_sequences)
    SPILLWAY_INPUT_ERROR("decoder step: {} chunks; 1 to max_sequences {}", count,
                         m.o.max_sequences);
  int T = 0;
  std::fill(m.seen.begin(), m.seen.end(), 0);
  for (int i = 0; i < count; ++i) {
    const DecodeChunk& ch = chunks[i];
    if (ch.sequence < 0 || ch.sequence >= m.o.max_sequences)
      SPILLWAY_INPUT_ERROR("decoder step: chunk {} names sequence {}; 0 to {}", i, ch.sequence,
                           m.o.max_sequences - 1);
    if (m.seen[static_cast<size_t>(ch.sequence)] != 0)
      SPILLWAY_INPUT_ERROR("decoder step: sequence {} has two chunks in one step", ch.sequence);
    m.seen[static_cast<size_t>(ch.sequence)] = 1;
    if (ch.n < 1 || ch.tokens == nullptr)
      SPILLWAY_INPUT_ERROR("decoder step: chunk {} has {} tokens; at least 1", i, ch.n);
    const int len = m.lengths[static_cast<size_t>(ch.sequence)];
    if (len + ch.n > m.o.max_context)
      SPILLWAY_INPUT_ERROR(
          "decoder step: sequence {} would hold {} tokens ({} + {}); max_context is {}",
          ch.sequence, len + ch.n, len, ch.n, m.o.max_context);
    for (int t = 0; t < ch.n; ++t)
      if (ch.tokens[t] < 0 || ch.tokens[t] >= c.vocab)
        SPILLWAY_INPUT_ERROR(
            "decoder step: token {} of sequence {} is outside the vocabulary "
            "[0, {})",
            ch.tokens[t], ch.sequence, c.vocab);
    T += ch.n;
  }
  if (T > m.o.max_step_tokens)
    SPILLWAY_INPUT_ERROR("decoder step: {} tokens; max_step_tokens is {}", T, m.o.max_step_tokens);

  const int d = c.hidden;
  const size_t Td = static_cast<size_t>(T) * static_cast<size_t>(d);
  const int qkv_dim = static_cast<int>(m.s.qkv);
  const int q_dim = static_cast<int>(m.s.q);
  for (int i = 0, r = 0; i < count; r += chunks[i].n, ++i)
    std::copy(chunks[i].tokens, chunks[i].tokens + chunks[i].n, m.tokens + r);
  // Note [Dynamic RoPE]: a chunk that takes its sequence past max_position_embeddings
  // rotates its queries and keys at the frequencies of its sequence's new length, or of its
  // rope_length (a prompt's chunks: the whole prompt, as transformers' prefill), keys cached
  // before keeping theirs (transformers' cache does the same); others read the table.
  for (int i = 0, r = 0; i < count; r += chunks[i].n, ++i) {
    const int pos = m.lengths[static_cast<size_t>(chunks[i].sequence)];
    const auto at = static_cast<size_t>(i);
    m.chunk_cos[at] = m.rope_cos;
    m.chunk_sin[at] = m.rope_sin;
    m.chunk_first[at] = 0;
    const int length = std::max(pos + chunks[i].n, chunks[i].rope_length);
    if (c.rope_dynamic_factor > 0 && length > c.rope_dynamic_length) {
      dynamic_frequencies(c, length, m.dyn_inv);
      const size_t row = static_cast<size_t>(r) * m.dyn_inv.size();
      fill_rope(m.dyn_inv, 1.0, pos, chunks[i].n, m.dyn_cos + row, m.dyn_sin + row);
      m.chunk_cos[at] = m.dyn_cos + row;
      m.chunk_sin[at] = m.dyn_sin + row;
      m.chunk_first[at] = pos;
    }
  }
  embedding_fwd(m.tokens, weights.values(m.embed), m.x, T, d);
  if (c.embed_scale != 1.0f)  // Note [Served Gemma]: in fp32, as torch multiplies
    for (size_t i = 0; i < Td; ++i) m.x[i] *= c.embed_scale;
  const double off = c.norm_offset;
  for (int l = 0; l < c.layers(); ++l) {
    const LayerIds& L = m.layers[static_cast<size_t>(l)];
    rmsnorm_fwd(m.x, weights.values(L.attn_norm), m.norm, T, d, c.rms_eps, off);
    if (L.mamba) {
      m.mamba_mixer(L, weights, chunks, count, T);
    } else {
      weights.linear(L.wqkv, m.norm, m.qkv, T, d, qkv_dim);
      m.attention_extras(L, weights, T);
      for (int i = 0, r = 0; i < count; r += chunks[i].n, ++i) {
        const int sq = chunks[i].sequence;
        const auto at = static_cast<size_t>(i);
        CachedAttention how{L.window, c.attn_scale, c.attn_softcap, m.chunk_first[at]};
        const bool local = L.local_rope;
        attention_cached_fwd(
            m.qkv + static_cast<size_t>(r) * qkv_dim, m.core + static_cast<size_t>(r) * q_dim,
            m.k_cache(l, sq), m.v_cache(l, sq), m.o.max_context, m.lengths[static_cast<size_t>(sq)],
            chunks[i].n, c.heads, c.kv_heads, c.head_dim, local ? m.local_cos : m.chunk_cos[at],
            local ? m.local_sin : m.chunk_sin[at], m.attn_scratch, how);
      }
      weights.linear(L.wo, m.core, m.mid, T, q_dim, d);
      if (L.o_bias >= 0) Impl::add_bias(m.mid, weights.values(L.o_bias), T, d);
      if (L.attn_post_norm >= 0)
        rmsnorm_fwd(m.mid, weights.values(L.attn_post_norm), m.mid, T, d, c.rms_eps, off);
      add(m.x, m.mid, m.mid, Td);
    }
    rmsnorm_fwd(m.mid, weights.values(L.mlp_norm), m.norm, T, d, c.rms_eps, off);
    const auto glu = [&](size_t n) {
      if (c.gelu_mlp)
        geglu_tanh_fwd(m.gate, m.up, m.act, n);
      else
        swiglu_fwd(m.gate, m.up, m.act, n);
    };
    if (!L.moe) {
      weights.linear(L.w1[0], m.norm, m.gate, T, d, L.ffn);
      weights.linear(L.w3[0], m.norm, m.up, T, d, L.ffn);
      glu(static_cast<size_t>(T) * static_cast<size_t>(L.ffn));
      weights.linear(L.w2[0], m.act, m.y, T, L.ffn, d);
      if (L.mlp_post_norm >= 0)
        rmsnorm_fwd(m.y, weights.values(L.mlp_post_norm), m.y, T, d, c.rms_eps, off);
      add(m.mid, m.y, m.y, Td);
    } else {
      const int rows = T * L.top_k;
      weights.linear(L.router, m.norm, m.rlogits, T, d, L.experts);
      softmax_fwd(m.rlogits, m.probs, T, L.experts);
      topk_fwd(m.probs, m.tidx, m.tw, T, L.experts, L.top_k, c.norm_topk);
      moe_route(m.tidx, T, L.top_k, L.experts, m.perm, m.offsets);
      for (int r = 0; r < rows; ++r) m.inv[m.perm[r]] = r;
      moe_dispatch_fwd(m.norm, m.perm, m.disp, rows, L.top_k, d);
      m.experts_linear(weights, L.w1, m.disp, m.gate, d, L.ffn);
      m.experts_linear(weights, L.w3, m.disp, m.up, d, L.ffn);
      glu(static_cast<size_t>(rows) * static_cast<size_t>(L.ffn));
      m.experts_linear(weights, L.w2, m.act, m.eout, L.ffn, d);
      moe_combine_fwd(m.mid, m.eout, m.tw, m.inv, m.y, T, L.top_k, d);
      if (L.shared_ffn > 0) {
        // Qwen2-MoE: y += sigmoid(norm . shared_expert_gate) x shared_expert(norm); its output
        // in eout and its gate in the router's logits, both free once combined.
        weights.linear(L.sh_gate, m.norm, m.gate, T, d, L.shared_ffn);
        weights.linear(L.sh_up, m.norm, m.up, T, d, L.shared_ffn);
        glu(static_cast<size_t>(T) * static_cast<size_t>(L.shared_ffn));
        weights.linear(L.sh_down, m.act, m.eout, T, L.shared_ffn, d);
        weights.linear(L.sh_weight, m.norm, m.rlogits, T, d, 1);
        for (int t = 0; t < T; ++t) {
          const float g = 1.0f / (1.0f + std::exp(-m.rlogits[t]));
          float* yr = m.y + static_cast<size_t>(t) * static_cast<size_t>(d);
          const float* er = m.eout + static_cast<size_t>(t) * static_cast<size_t>(d);
          for (int i = 0; i < d; ++i) yr[i] += g * er[i];
        }
      }
    }
    std::swap(m.x, m.y);
  }
  // The head on each chunk's last row.
  for (int i = 0, r = 0; i < count; r += chunks[i].n, ++i) {
    const size_t row = static_cast<size_t>(r + chunks[i].n - 1);
    std::memcpy(m.last + static_cast<size_t>(i) * d, m.x + row * d, sizeof(float) * d);
  }
  rmsnorm_fwd(m.last, weights.values(m.final_norm), m.lastn, count, d, c.rms_eps, off);
  weights.linear(m.lm_head, m.lastn, logits, count, d, c.vocab);
  if (c.final_softcap > 0) {  // Note [Served Gemma]
    const size_t n = static_cast<size_t>(count) * static_cast<size_t>(c.vocab);
    const auto cap = static_cast<float>(c.final_softcap);
    for (size_t i = 0; i < n; ++i) logits[i] = cap * std::tanh(logits[i] / cap);
  }
  for (int i = 0; i < count; ++i) m.lengths[static_cast<size_t>(chunks[i].sequence)] += chunks[i].n;
}

}  // namespace spillway::nn

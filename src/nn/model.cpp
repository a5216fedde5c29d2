// The reference model's network (include/spillway/nn.hpp): parameters, forward, backward
// under a memory policy with the engines reached through the socket (hooks.hpp), and the
// caller's update (Note [The model's own update]). Note [Saved tensors]. Its config is in config.cpp, its policies in
// policy.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <random>

#include "core/stats.hpp"
#include "nn/ops.hpp"
#include "nn/slots.hpp"
#include "spillway/error.hpp"
#include "spillway/nn.hpp"
#include "spillway/units.hpp"

namespace spillway::nn {

namespace {

// "524288 bytes (0.50 MiB)": exact, and in the unit of --device-memory-mb.
std::string size_text(size_t bytes) {
  return fmt::format("{} bytes ({:.2f} MiB)", bytes, static_cast<double>(bytes) / 1048576.0);
}

}  // namespace

// ---------------------------------------------------------------------------------------

struct Model::Impl {
  RefConfig c;
  Device& dev;
  int d = 0, qkv_dim = 0, q_dim = 0;

  // Parameters: one device block each for weights, gradients, and the two moments.
  struct LayerParams {
    size_t attn_norm = 0, wqkv = 0, wo = 0, mlp_norm = 0;  // attn_norm: the mixer's input norm
    size_t router = 0, w1 = 0, w3 = 0, w2 = 0;             // MoE: experts contiguous; dense: one
    int experts = 0, top_k = 0, ffn = 0;                   // dense: experts = 1, top_k = 1
    bool moe = false;
    // A Mamba-2 mixer (Note [Mamba slots]): in_proj (in_width, d) to z, x B C, dt; the
    // conv's weight (conv_dim, conv) and bias; dt_bias, a_log, dskip (heads); the gated
    // norm's weight (inner); out_proj (d, inner).
    bool mamba = false;
    size_t w_in = 0, conv_w = 0, conv_b = 0, dt_bias = 0, a_log = 0, dskip = 0, gnorm = 0,
           w_out = 0;
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
  std::vector<std::vector<std::string>> names;  // per layer, per slot (saved_tensor_names)
  int64_t recomputed_ops = 0;                   // this step's (StepStats)
  int64_t recomputed_scans = 0;
  std::vector<LayerParams> lp;
  size_t embed = 0, final_norm = 0, lm_head = 0;
  size_t n_params = 0;
  std::vector<Bucket> buckets;  // Model::parameter_buckets
  float* w = nullptr;
  // Note [Streamed weights]: while a layer computes from a weight streamer's slot, its
  // parameters are read there (the slot holds the layer's bucket, from its offset).
  const float* layer_slot = nullptr;
  size_t layer_offset = 0;
  const float* lw(size_t at) const {
    return layer_slot != nullptr ? layer_slot + (at - layer_offset) : w + at;
  }
  LayerWeights* streamer = nullptr;
  // A layer's visit to the streamer: its slot, ready for the host ops that read it (the
  // reference model computes on the calling thread, so the compute stream's wait for the
  // slot is waited out here), and its release once the layer's ops have run.
  void visit_begin(int layer) {
    if (streamer == nullptr) return;
    layer_slot = static_cast<const float*>(streamer->acquire(layer));
    dev.synchronize(compute);
    layer_offset = buckets[static_cast<size_t>(layer) + 1].offset;
  }
  void visit_end(int layer) {
    if (streamer == nullptr) return;
    streamer->release(layer);
    layer_slot = nullptr;
  }
  // The current weights of every layer into the streamer's host slabs, once the copies
  // that read them are done. A sharded streamer's slab holds this rank's shard of the
  // layer's bytes (Note [Sharded streaming]), zero past the layer's end.
  void pack_weights() {
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
  float* g = nullptr;
  float* m1 = nullptr;
  float* m2 = nullptr;
  // With an offloaded optimizer: the bf16 weights it writes and this model computes with,
  // and the bf16 gradients this model writes for it (n_params each, device memory).
  uint16_t* w16 = nullptr;
  uint16_t* g16 = nullptr;

  Stream compute;  // the stream the hooks' engines order their copies against

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
  std::string where() const {
    if (where_layer < 0)
      return fmt::format("{} {}", where_phase, where_what).substr(where_phase[0] == '\0' ? 1 : 0);
    return fmt::format("at layer {} {} ({})", where_layer, where_what, where_phase);
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

  Impl(const RefConfig& config, Device& device) : c(config), dev(device) {}

  void* alloc(size_t bytes) {
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
  void release(void* p) { dev.free(p, MemoryKind::kDevice); }

  template <class X>
  X* alloc_n(size_t n) {
    return static_cast<X*>(alloc(n * sizeof(X)));
  }

  size_t slot_bytes(int layer, int s, int batch, int seq) const {
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

  float* F(int layer, int s) { return static_cast<float*>(saved[layer][s].p); }
  int32_t* I(int layer, int s) { return static_cast<int32_t*>(saved[layer][s].p); }

  void route(int layer, int tokens) {
    const LayerParams& L = lp[static_cast<size_t>(layer)];
    const size_t rows = static_cast<size_t>(tokens) * static_cast<size_t>(L.top_k);
    perm.resize(rows);
    inv.resize(rows);
    offsets.resize(static_cast<size_t>(L.experts) + 1);
    moe_route(I(layer, kIdx), tokens, L.top_k, L.experts, perm.data(), offsets.data());
    for (size_t r = 0; r < rows; ++r) inv[static_cast<size_t>(perm[r])] = static_cast<int32_t>(r);
  }

  // Per-expert GEMM over the dispatched rows: y rows of expert x = x rows * W_x^T.
  void expert_linear(const LayerParams& L, size_t wofs, const float* x, float* y, int in, int out) {
    for (int e = 0; e < L.experts; ++e) {
      const int r0 = offsets[static_cast<size_t>(e)];
      const int n = offsets[static_cast<size_t>(e) + 1] - r0;
      if (n == 0) continue;
      linear_fwd(
          x + static_cast<size_t>(r0) * static_cast<size_t>(in),
          w + wofs + static_cast<size_t>(e) * static_cast<size_t>(out) * static_cast<size_t>(in),
          y + static_cast<size_t>(r0) * static_cast<size_t>(out), n, in, out);
    }
  }
  void expert_linear_bwd(const LayerParams& L, size_t wofs, const float* x, const float* dy,
                         float* dx, int in, int out, bool accumulate) {
    for (int e = 0; e < L.experts; ++e) {
      const int r0 = offsets[static_cast<size_t>(e)];
      const int n = offsets[static_cast<size_t>(e) + 1] - r0;
      if (n == 0) continue;
      const size_t wo =
          wofs + static_cast<size_t>(e) * static_cast<size_t>(out) * static_cast<size_t>(in);
      linear_bwd(x + static_cast<size_t>(r0) * static_cast<size_t>(in), w + wo,
                 dy + static_cast<size_t>(r0) * static_cast<size_t>(out),
                 dx + static_cast<size_t>(r0) * static_cast<size_t>(in), g + wo, n, in, out,
                 accumulate);
    }
  }

  // Runs the forward op producing slot s of `layer` (its inputs present), writing every
  // output of that op into the slots' buffers (allocated here when absent).
  void produce(int layer, int s, int batch, int seq) {
    const LayerParams& L = lp[static_cast<size_t>(layer)];
    const int T = batch * seq;
    auto out = [&](int o) -> float* {
      Saved& sv = saved[layer][o];
      if (sv.p == nullptr) {
        where_layer = layer;
        where_what = names[static_cast<size_t>(layer)][static_cast<size_t>(o)].c_str();
        sv.bytes = slot_bytes(layer, o, batch, seq);
        sv.p = alloc(sv.bytes);
      }
      return static_cast<float*>(sv.p);
    };
    const auto eps = c.rms_eps;
    if (L.mamba && produce_mamba(layer, s, batch, seq, out)) return;
    switch (s) {
      case kNorm1:
        rmsnorm_fwd(F(layer, kInput), lw(L.attn_norm), out(kNorm1), T, d, eps);
        return;
      case kQkv:
        linear_fwd(F(layer, kNorm1), lw(L.wqkv), out(kQkv), T, d, qkv_dim);
        return;
      case kCoreOut:
      case kLse: {
        float* o = out(kCoreOut);
        float* lse = out(kLse);
        attention_fwd(F(layer, kQkv), o, lse, batch, seq, c.heads, c.kv_heads, c.head_dim,
                      c.rope_theta);
        return;
      }
      case kMid: {
        float* mid = out(kMid);
        linear_fwd(F(layer, kCoreOut), lw(L.wo), mid, T, q_dim, d);
        add(F(layer, kInput), mid, mid, static_cast<size_t>(T) * static_cast<size_t>(d));
        return;
      }
      case kNorm2:
        rmsnorm_fwd(F(layer, kMid), lw(L.mlp_norm), out(kNorm2), T, d, eps);
        return;
      default:
        break;
    }
    if (!L.moe) {
      const size_t n = static_cast<size_t>(T) * static_cast<size_t>(L.ffn);
      switch (s) {
        case kDenseGate:
          linear_fwd(F(layer, kNorm2), lw(L.w1), out(kDenseGate), T, d, L.ffn);
          return;
        case kDenseUp:
          linear_fwd(F(layer, kNorm2), lw(L.w3), out(kDenseUp), T, d, L.ffn);
          return;
        case kDenseAct:
          swiglu_fwd(F(layer, kDenseGate), F(layer, kDenseUp), out(kDenseAct), n);
          return;
        default:
          SPILLWAY_CHECK(false, "no producer for slot {}", s);
      }
    }
    const int rows = T * L.top_k;
    switch (s) {
      case kProbs:
      case kIdx:
      case kWeights: {
        float* logits = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(L.experts));
        linear_fwd(F(layer, kNorm2), lw(L.router), logits, T, d, L.experts);
        float* probs = out(kProbs);
        softmax_fwd(logits, probs, T, L.experts);
        release(logits);
        int32_t* idx = reinterpret_cast<int32_t*>(out(kIdx));
        topk_fwd(probs, idx, out(kWeights), T, L.experts, L.top_k, c.norm_topk);
        return;
      }
      case kDispatch:
        route(layer, T);
        moe_dispatch_fwd(F(layer, kNorm2), perm.data(), out(kDispatch), rows, L.top_k, d);
        return;
      case kGate:
        route(layer, T);
        expert_linear(L, L.w1, F(layer, kDispatch), out(kGate), d, L.ffn);
        return;
      case kUp:
        route(layer, T);
        expert_linear(L, L.w3, F(layer, kDispatch), out(kUp), d, L.ffn);
        return;
      case kAct:
        swiglu_fwd(F(layer, kGate), F(layer, kUp), out(kAct),
                   static_cast<size_t>(rows) * static_cast<size_t>(L.ffn));
        return;
      case kExpertOut:
        route(layer, T);
        expert_linear(L, L.w2, F(layer, kAct), out(kExpertOut), L.ffn, d);
        return;
      default:
        SPILLWAY_CHECK(false, "no producer for slot {}", s);
    }
  }

  // The slots an op reads (to recompute s, these must be present first).
  std::vector<int> inputs_of(int layer, int s) const {
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

  // Backward: slot s present, by recomputation from its inputs when dropped (reloads have
  // been issued and waited for before).
  void materialize(int layer, int s, int batch, int seq) {
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

  void forward_layer(int layer, float* x, float** y_out, int batch, int seq,
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
    // spillway/hooks.hpp), held until this layer's forward ends, since the forward still
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
    if (L.moe) {
      route(layer, T);
      moe_combine_fwd(F(layer, kMid), F(layer, kExpertOut), F(layer, kWeights), inv.data(), y, T,
                      L.top_k, d);
    } else {
      linear_fwd(F(layer, kDenseAct), lw(L.w2), y, T, L.ffn, d);
      add(F(layer, kMid), y, y, static_cast<size_t>(T) * static_cast<size_t>(d));
    }
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

  // Forward only: the last layer's output (T, d) for input tokens (batch * seq), device
  // memory the caller releases; every saved tensor recomputed (nothing is kept for a
  // backward): a layer's forward frees what it made, and its input is freed once its output
  // exists.
  float* forward_inference(const std::vector<int32_t>& in, int batch, int seq) {
    const int T = batch * seq;
    MemoryPolicy none = keep_policy(c);
    none.name = "forward";
    for (LayerActions& la : none.layers)
      for (size_t s = 1; s < la.actions.size(); ++s) la.actions[s] = Action::kRecompute;
    TrainingHooks no_hooks;
    policy_name = none.name;
    at(-1, "embedding", "at the");
    float* x = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(d));
    embedding_fwd(in.data(), w + embed, x, T, d);
    for (int l = 0; l < c.layers(); ++l) {
      float* y = nullptr;
      visit_begin(l);
      forward_layer(l, x, &y, batch, seq, none, no_hooks);
      visit_end(l);
      release(x);
      saved[static_cast<size_t>(l)][kInput].p = nullptr;
      x = y;
    }
    return x;
  }

  // The head's forward on x (T, d): the final norm into *fn and the logits (T, vocab),
  // returned; device memory the caller releases.
  float* head_forward(const float* x, int T, float** fn) {
    at(-1, "LM head", "at the");
    *fn = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(d));
    rmsnorm_fwd(x, w + final_norm, *fn, T, d, c.rms_eps);
    float* logits = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(c.vocab));
    linear_fwd(*fn, w + lm_head, logits, T, d, c.vocab);
    return logits;
  }

  // dy (T, d): gradient of the layer's output; writes dx (T, d), the input's gradient.
  void backward_layer(int layer, const float* dy, float* dx, int batch, int seq,
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
    if (L.moe) {
      const int rows = T * L.top_k;
      const size_t rf = static_cast<size_t>(rows) * static_cast<size_t>(L.ffn);
      const size_t rd = static_cast<size_t>(rows) * static_cast<size_t>(d);
      route(layer, T);
      float* deo = alloc_n<float>(rd);
      float* dweights = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(L.top_k));
      moe_combine_bwd(F(layer, kExpertOut), F(layer, kWeights), inv.data(), dy, deo, dweights, T,
                      L.top_k, d);
      float* dact = alloc_n<float>(rf);
      expert_linear_bwd(L, L.w2, F(layer, kAct), deo, dact, L.ffn, d, false);
      release(deo);
      float* dg = alloc_n<float>(rf);
      float* du = alloc_n<float>(rf);
      swiglu_bwd(F(layer, kGate), F(layer, kUp), dact, dg, du, rf);
      release(dact);
      float* ddisp = alloc_n<float>(rd);
      expert_linear_bwd(L, L.w1, F(layer, kDispatch), dg, ddisp, d, L.ffn, false);
      expert_linear_bwd(L, L.w3, F(layer, kDispatch), du, ddisp, d, L.ffn, true);
      release(dg);
      release(du);
      std::fill(dnorm, dnorm + Td, 0.0f);
      moe_dispatch_bwd(ddisp, perm.data(), dnorm, rows, L.top_k, d);
      release(ddisp);
      const size_t te = static_cast<size_t>(T) * static_cast<size_t>(L.experts);
      float* dprobs = alloc_n<float>(te);
      topk_bwd(F(layer, kProbs), I(layer, kIdx), dweights, dprobs, T, L.experts, L.top_k,
               c.norm_topk);
      release(dweights);
      float* dlogits = alloc_n<float>(te);
      softmax_bwd(F(layer, kProbs), dprobs, dlogits, T, L.experts);
      release(dprobs);
      linear_bwd(F(layer, kNorm2), lw(L.router), dlogits, dnorm, g + L.router, T, d, L.experts,
                 true);
      release(dlogits);
    } else {
      const size_t tf = static_cast<size_t>(T) * static_cast<size_t>(L.ffn);
      float* dact = alloc_n<float>(tf);
      linear_bwd(F(layer, kDenseAct), lw(L.w2), dy, dact, g + L.w2, T, L.ffn, d, false);
      float* dg = alloc_n<float>(tf);
      float* du = alloc_n<float>(tf);
      swiglu_bwd(F(layer, kDenseGate), F(layer, kDenseUp), dact, dg, du, tf);
      release(dact);
      linear_bwd(F(layer, kNorm2), lw(L.w1), dg, dnorm, g + L.w1, T, d, L.ffn, false);
      linear_bwd(F(layer, kNorm2), lw(L.w3), du, dnorm, g + L.w3, T, d, L.ffn, true);
      release(dg);
      release(du);
    }
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

  // Attention block backward: mlp.input = attn.input + out_proj(attention(qkv(norm(
  // attn.input)))); from dmid (the gradient at mlp.input), dnorm = the gradient at
  // attn.norm_out (overwritten).
  void attention_backward(int layer, const float* dmid, float* dnorm, int batch, int seq) {
    const LayerParams& L = lp[static_cast<size_t>(layer)];
    const int T = batch * seq;
    float* dcore = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(q_dim));
    linear_bwd(F(layer, kCoreOut), lw(L.wo), dmid, dcore, g + L.wo, T, q_dim, d, false);
    float* dqkv = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(qkv_dim));
    attention_bwd(F(layer, kQkv), F(layer, kCoreOut), F(layer, kLse), dcore, dqkv, batch, seq,
                  c.heads, c.kv_heads, c.head_dim, c.rope_theta);
    release(dcore);
    linear_bwd(F(layer, kNorm1), lw(L.wqkv), dqkv, dnorm, g + L.wqkv, T, d, qkv_dim, false);
    release(dqkv);
  }

  // Columns [col, col + width) of a (rows, stride) matrix into a new (rows, width) one.
  float* columns(const float* m, int rows, int stride, int col, int width) {
    float* out = alloc_n<float>(static_cast<size_t>(rows) * static_cast<size_t>(width));
    for (int r = 0; r < rows; ++r)
      std::memcpy(out + static_cast<size_t>(r) * static_cast<size_t>(width),
                  m + static_cast<size_t>(r) * static_cast<size_t>(stride) + col,
                  static_cast<size_t>(width) * sizeof(float));
    return out;
  }
  // And back: a (rows, width) matrix into columns [col, col + width) of (rows, stride).
  static void put_columns(const float* src, float* m, int rows, int stride, int col, int width) {
    for (int r = 0; r < rows; ++r)
      std::memcpy(m + static_cast<size_t>(r) * static_cast<size_t>(stride) + col,
                  src + static_cast<size_t>(r) * static_cast<size_t>(width),
                  static_cast<size_t>(width) * sizeof(float));
  }

  // The Mamba-2 mixer's forward ops (Note [Mamba slots]); false for a slot that is not its.
  template <class Out>
  bool produce_mamba(int layer, int s, int batch, int seq, Out& out) {
    const LayerParams& L = lp[static_cast<size_t>(layer)];
    const int T = batch * seq;
    const int gn = L.groups * L.state;
    if (s == kNorm1) {
      rmsnorm_fwd(F(layer, kInput), lw(L.attn_norm), out(kNorm1), T, d, c.rms_eps);
    } else if (s == kSsmInProj) {
      linear_fwd(F(layer, kNorm1), lw(L.w_in), out(kSsmInProj), T, d, L.in_width);
    } else if (s == kSsmConv) {
      float* xbc = columns(F(layer, kSsmInProj), T, L.in_width, L.inner, L.conv_dim);
      causal_conv1d_silu_fwd(xbc, lw(L.conv_w), lw(L.conv_b), out(kSsmConv), batch, seq, L.conv_dim,
                             L.conv);
      release(xbc);
    } else if (s == kSsmScan || s == L.states_slot()) {
      const float* conv = F(layer, kSsmConv);
      float* x = columns(conv, T, L.conv_dim, 0, L.inner);
      float* bm = columns(conv, T, L.conv_dim, L.inner, gn);
      float* cm = columns(conv, T, L.conv_dim, L.inner + gn, gn);
      float* dt = columns(F(layer, kSsmInProj), T, L.in_width, L.inner + L.conv_dim, L.heads);
      float* y = out(kSsmScan);
      float* states = out(L.states_slot());
      ssd_scan_fwd(L.ssd(batch, seq), x, dt, lw(L.dt_bias), lw(L.a_log), bm, cm, lw(L.dskip), y,
                   states);
      for (float* p : {x, bm, cm, dt}) release(p);
    } else if (s == L.gated_slot()) {
      float* z = columns(F(layer, kSsmInProj), T, L.in_width, 0, L.inner);
      gated_rmsnorm_fwd(F(layer, kSsmScan), z, lw(L.gnorm), out(L.gated_slot()), T, L.inner,
                        c.rms_eps);
      release(z);
    } else if (s == kMid) {
      float* mid = out(kMid);
      linear_fwd(F(layer, L.gated_slot()), lw(L.w_out), mid, T, L.inner, d);
      add(F(layer, kInput), mid, mid, static_cast<size_t>(T) * static_cast<size_t>(d));
    } else {
      return false;
    }
    return true;
  }

  // The Mamba-2 mixer's backward, as attention_backward: from dmid, dnorm overwritten.
  void mamba_backward(int layer, const float* dmid, float* dnorm, int batch, int seq) {
    const LayerParams& L = lp[static_cast<size_t>(layer)];
    const int T = batch * seq;
    const int gn = L.groups * L.state;
    const size_t te = static_cast<size_t>(T) * static_cast<size_t>(L.inner);
    float* dgated = alloc_n<float>(te);
    linear_bwd(F(layer, L.gated_slot()), lw(L.w_out), dmid, dgated, g + L.w_out, T, L.inner, d,
               false);
    const float* in = F(layer, kSsmInProj);
    float* din = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(L.in_width));
    float* z = columns(in, T, L.in_width, 0, L.inner);
    float* dscan = alloc_n<float>(te);
    float* dz = alloc_n<float>(te);
    gated_rmsnorm_bwd(F(layer, kSsmScan), z, lw(L.gnorm), dgated, dscan, dz, g + L.gnorm, T,
                      L.inner, c.rms_eps);
    put_columns(dz, din, T, L.in_width, 0, L.inner);
    for (float* p : {dgated, z, dz}) release(p);
    const float* conv = F(layer, kSsmConv);
    float* x = columns(conv, T, L.conv_dim, 0, L.inner);
    float* bm = columns(conv, T, L.conv_dim, L.inner, gn);
    float* cm = columns(conv, T, L.conv_dim, L.inner + gn, gn);
    float* dt = columns(in, T, L.in_width, L.inner + L.conv_dim, L.heads);
    float* dx = alloc_n<float>(te);
    float* ddt = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(L.heads));
    float* db = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(gn));
    float* dc = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(gn));
    ssd_scan_bwd(L.ssd(batch, seq), x, dt, lw(L.dt_bias), lw(L.a_log), bm, cm, lw(L.dskip),
                 F(layer, L.states_slot()), dscan, dx, ddt, g + L.dt_bias, g + L.a_log, db, dc,
                 g + L.dskip);
    put_columns(ddt, din, T, L.in_width, L.inner + L.conv_dim, L.heads);
    const size_t tc = static_cast<size_t>(T) * static_cast<size_t>(L.conv_dim);
    float* dconv = alloc_n<float>(tc);
    put_columns(dx, dconv, T, L.conv_dim, 0, L.inner);
    put_columns(db, dconv, T, L.conv_dim, L.inner, gn);
    put_columns(dc, dconv, T, L.conv_dim, L.inner + gn, gn);
    for (float* p : {x, bm, cm, dt, dx, ddt, db, dc, dscan}) release(p);
    float* xbc = columns(in, T, L.in_width, L.inner, L.conv_dim);
    float* dxbc = alloc_n<float>(tc);
    causal_conv1d_silu_bwd(xbc, lw(L.conv_w), lw(L.conv_b), dconv, dxbc, g + L.conv_w, g + L.conv_b,
                           batch, seq, L.conv_dim, L.conv);
    put_columns(dxbc, din, T, L.in_width, L.inner, L.conv_dim);
    for (float* p : {xbc, dxbc, dconv}) release(p);
    linear_bwd(F(layer, kNorm1), lw(L.w_in), din, dnorm, g + L.w_in, T, d, L.in_width, false);
    release(din);
  }
};

Model::Model(const RefConfig& config, Device& device, uint64_t seed, bool device_optimizer)
    : impl_(std::make_unique<Impl>(config, device)) {
  Impl& m = *impl_;
  if (!device.emulated())
    SPILLWAY_INPUT_ERROR(
        "the reference model computes on the host: it needs the host backend (--device host), "
        "not {}",
        device.name());
  const RefConfig& c = m.c;
  m.d = c.hidden;
  m.q_dim = c.heads * c.head_dim;
  m.qkv_dim = (c.heads + 2 * c.kv_heads) * c.head_dim;
  size_t at = 0;
  auto take = [&](size_t n) {
    const size_t o = at;
    at += n;
    return o;
  };
  const size_t d = static_cast<size_t>(m.d);
  m.embed = take(static_cast<size_t>(c.vocab) * d);
  for (int l = 0; l < c.layers(); ++l) {
    const MlpSpec& mlp = c.model.layers[static_cast<size_t>(l)].mlp;
    Impl::LayerParams L;
    L.moe = mlp.kind == MlpKind::kMoe;
    L.experts = L.moe ? to_int(mlp.experts, "num_experts") : 1;
    L.top_k = L.moe ? to_int(mlp.top_k, "num_experts_per_tok") : 1;
    L.ffn = to_int(mlp.ffn, L.moe ? "moe_intermediate_size" : "intermediate_size");
    L.attn_norm = take(d);
    const LayerSpec& spec = c.model.layers[static_cast<size_t>(l)];
    if (spec.mixer == MixerKind::kMamba) {  // Note [Mamba slots]
      const SsmSpec& s = spec.ssm;
      L.mamba = true;
      L.heads = to_int(s.heads, "mamba heads");
      L.head_dim = to_int(s.head_dim, "mamba head_dim");
      L.groups = to_int(s.groups, "mamba groups");
      L.state = to_int(s.state, "mamba state size");
      L.conv = to_int(s.conv, "mamba conv kernel");
      L.chunk = to_int(s.chunk, "mamba chunk size");
      L.inner = L.heads * L.head_dim;
      L.conv_dim = L.inner + 2 * L.groups * L.state;
      L.in_width = L.inner + L.conv_dim + L.heads;
      L.w_in = take(static_cast<size_t>(L.in_width) * d);
      L.conv_w = take(static_cast<size_t>(L.conv_dim) * static_cast<size_t>(L.conv));
      L.conv_b = take(static_cast<size_t>(L.conv_dim));
      L.dt_bias = take(static_cast<size_t>(L.heads));
      L.a_log = take(static_cast<size_t>(L.heads));
      L.dskip = take(static_cast<size_t>(L.heads));
      L.gnorm = take(static_cast<size_t>(L.inner));
      L.w_out = take(d * static_cast<size_t>(L.inner));
    } else {
      L.wqkv = take(static_cast<size_t>(m.qkv_dim) * d);
      L.wo = take(d * static_cast<size_t>(m.q_dim));
    }
    L.mlp_norm = take(d);
    if (L.moe) L.router = take(static_cast<size_t>(L.experts) * d);
    const size_t ew = static_cast<size_t>(L.experts) * static_cast<size_t>(L.ffn) * d;
    L.w1 = take(ew);
    L.w3 = take(ew);
    L.w2 = take(ew);
    m.lp.push_back(L);
  }
  m.final_norm = take(d);
  m.lm_head = take(static_cast<size_t>(c.vocab) * d);
  m.n_params = at;
  // Optimizer buckets: the embedding, each layer, the final norm with the head.
  m.buckets.push_back({m.embed, (m.lp.empty() ? m.final_norm : m.lp[0].attn_norm) - m.embed});
  for (size_t l = 0; l < m.lp.size(); ++l) {
    const size_t end = l + 1 < m.lp.size() ? m.lp[l + 1].attn_norm : m.final_norm;
    m.buckets.push_back({m.lp[l].attn_norm, end - m.lp[l].attn_norm});
  }
  m.buckets.push_back({m.final_norm, m.n_params - m.final_norm});
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
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (size_t i = 0; i < at; ++i) m.w[i] = normal(rng);
  auto ones = [&](size_t ofs) { std::fill(m.w + ofs, m.w + ofs + d, 1.0f); };
  for (const Impl::LayerParams& L : m.lp) {
    ones(L.attn_norm);
    ones(L.mlp_norm);
    if (!L.mamba) continue;
    // Mamba-2's usual start: A = -(1 .. 16) over the heads, dt from 0.001 to 0.1
    // (log-spaced; dt_bias its inverse softplus), D = 1, the gated norm's weight 1.
    for (int h = 0; h < L.heads; ++h) {
      const double f = L.heads > 1 ? static_cast<double>(h) / (L.heads - 1) : 0.0;
      const double dt = 0.001 * std::pow(100.0, f);
      m.w[L.a_log + static_cast<size_t>(h)] = static_cast<float>(std::log(1.0 + 15.0 * f));
      m.w[L.dt_bias + static_cast<size_t>(h)] = static_cast<float>(dt + std::log(-std::expm1(-dt)));
      m.w[L.dskip + static_cast<size_t>(h)] = 1.0f;
    }
    std::fill(m.w + L.gnorm, m.w + L.gnorm + L.inner, 1.0f);
  }
  ones(m.final_norm);
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
  m.compute = device.create_stream(StreamRole::kCompute);
  set_blas_threads(1);
}

Model::~Model() {
  Impl& m = *impl_;
  for (float* p : {m.w, m.g, m.m1, m.m2})
    if (p != nullptr) m.release(p);
  for (uint16_t* p : {m.w16, m.g16})
    if (p != nullptr) m.release(p);
  m.dev.destroy_stream(m.compute);
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

namespace {

// Tokens (batch, seq + 1) into the inputs and the shifted targets (batch * seq each),
// every token checked against the vocabulary.
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

}  // namespace

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
  embedding_bwd(in.data(), dy, m.g + m.embed, T, m.d);
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

double Model::forward_loss(const std::vector<int32_t>& tokens, int batch, int seq) {
  Impl& m = *impl_;
  SPILLWAY_CHECK(batch > 0 && seq > 0, "forward_loss: batch {} and seq {} must be > 0", batch, seq);
  SPILLWAY_CHECK(tokens.size() == static_cast<size_t>(batch) * static_cast<size_t>(seq + 1),
                 "forward_loss: {} tokens for batch {} x (seq {} + 1)", tokens.size(), batch, seq);
  const int T = batch * seq;
  std::vector<int32_t> in, target;
  split_tokens(tokens, batch, seq, m.c.vocab, &in, &target);
  float* x = m.forward_inference(in, batch, seq);
  float* fn = nullptr;
  float* logits = m.head_forward(x, T, &fn);
  const size_t tv = static_cast<size_t>(T) * static_cast<size_t>(m.c.vocab);
  float* dlogits = m.alloc_n<float>(tv);
  const double loss = cross_entropy(logits, target.data(), dlogits, T, m.c.vocab);
  for (float* p : {dlogits, logits, fn, x}) m.release(p);
  if (m.streamer != nullptr) m.streamer->step_end();
  return loss;
}

std::vector<float> Model::forward_logits(const std::vector<int32_t>& tokens, int batch, int seq) {
  Impl& m = *impl_;
  SPILLWAY_CHECK(batch > 0 && seq > 0, "forward_logits: batch {} and seq {} must be > 0", batch,
                 seq);
  SPILLWAY_CHECK(tokens.size() == static_cast<size_t>(batch) * static_cast<size_t>(seq),
                 "forward_logits: {} tokens for batch {} x seq {}", tokens.size(), batch, seq);
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= m.c.vocab)
      SPILLWAY_INPUT_ERROR("token {} at position {} is outside the vocabulary [0, {})", tokens[i],
                           i, m.c.vocab);
  const int T = batch * seq;
  float* x = m.forward_inference(tokens, batch, seq);
  float* fn = nullptr;
  float* logits = m.head_forward(x, T, &fn);
  std::vector<float> out(logits, logits + static_cast<size_t>(T) * static_cast<size_t>(m.c.vocab));
  for (float* p : {logits, fn, x}) m.release(p);
  if (m.streamer != nullptr) m.streamer->step_end();
  return out;
}

std::vector<NamedWeight> Model::named_weights() const {
  const Impl& m = *impl_;
  std::vector<NamedWeight> out;
  size_t at = 0;
  for (WeightSpec& s : weight_specs(m.c)) {
    const size_t n = static_cast<size_t>(s.elements());
    out.push_back({std::move(s), m.w + at});
    at += n;
  }
  SPILLWAY_CHECK(at == m.n_params, "named_weights: the specs cover {} of {} parameters", at,
                 m.n_params);
  return out;
}

}  // namespace spillway::nn

// The reference model's network (include/spillway/nn.hpp): parameters, forward, backward
// under a memory policy with the engines reached through hooks, and its AdamW (optim's
// textbook form). Note [Saved tensors]. Its config is in config.cpp, its policies in
// policy.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
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
    size_t attn_norm = 0, wqkv = 0, wo = 0, mlp_norm = 0;
    size_t router = 0, w1 = 0, w3 = 0, w2 = 0;  // MoE: experts contiguous; dense: one
    int experts = 0, top_k = 0, ffn = 0;        // dense: experts = 1, top_k = 1
    bool moe = false;
  };
  std::vector<LayerParams> lp;
  size_t embed = 0, final_norm = 0, lm_head = 0;
  size_t n_params = 0;
  std::vector<optim::Bucket> buckets;  // Model::parameter_buckets
  float* w = nullptr;
  float* g = nullptr;
  float* m1 = nullptr;
  float* m2 = nullptr;
  int64_t adam_step = 0;
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

  size_t slot_bytes(int layer, int s, int tokens) const {
    const LayerParams& L = lp[static_cast<size_t>(layer)];
    const size_t T = static_cast<size_t>(tokens);
    const size_t rows = L.moe ? T * static_cast<size_t>(L.top_k) : T;
    const size_t f = static_cast<size_t>(L.ffn);
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
        where_what = L.moe ? kMoeNames[o] : kDenseNames[o];
        sv.bytes = slot_bytes(layer, o, T);
        sv.p = alloc(sv.bytes);
      }
      return static_cast<float*>(sv.p);
    };
    const auto eps = c.rms_eps;
    switch (s) {
      case kNorm1:
        rmsnorm_fwd(F(layer, kInput), w + L.attn_norm, out(kNorm1), T, d, eps);
        return;
      case kQkv:
        linear_fwd(F(layer, kNorm1), w + L.wqkv, out(kQkv), T, d, qkv_dim);
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
        linear_fwd(F(layer, kCoreOut), w + L.wo, mid, T, q_dim, d);
        add(F(layer, kInput), mid, mid, static_cast<size_t>(T) * static_cast<size_t>(d));
        return;
      }
      case kNorm2:
        rmsnorm_fwd(F(layer, kMid), w + L.mlp_norm, out(kNorm2), T, d, eps);
        return;
      default:
        break;
    }
    if (!L.moe) {
      const size_t n = static_cast<size_t>(T) * static_cast<size_t>(L.ffn);
      switch (s) {
        case kDenseGate:
          linear_fwd(F(layer, kNorm2), w + L.w1, out(kDenseGate), T, d, L.ffn);
          return;
        case kDenseUp:
          linear_fwd(F(layer, kNorm2), w + L.w3, out(kDenseUp), T, d, L.ffn);
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
        linear_fwd(F(layer, kNorm2), w + L.router, logits, T, d, L.experts);
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
    const bool moe = lp[static_cast<size_t>(layer)].moe;
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
    produce(layer, s, batch, seq);
  }

  void forward_layer(int layer, float* x, float** y_out, int batch, int seq,
                     const MemoryPolicy& policy, TrainingHooks& hooks) {
    const LayerParams& L = lp[static_cast<size_t>(layer)];
    const int T = batch * seq;
    const int n_slots = L.moe ? kMoeSlots : kDenseSlots;
    saved[layer].assign(static_cast<size_t>(n_slots), Saved{});
    for (int s = 0; s < n_slots; ++s)
      saved[layer][s].action =
          policy.layers[static_cast<size_t>(layer)].actions[static_cast<size_t>(s)];
    saved[layer][kInput].p = x;
    saved[layer][kInput].bytes = slot_bytes(layer, kInput, T);
    // Note [Saved tensors]: an offloaded tensor goes to the hooks as soon as its producer
    // has run (its copy overlaps the rest of this layer's forward and the next one, the
    // window the planner assumes); it is given (Note [Saved tensor ownership] in
    // spillway/hooks.hpp), held until this layer's forward ends, since the forward still
    // reads it.
    auto hand_over = [&] {
      for (int s = 0; s < n_slots; ++s) {
        Saved& sv = saved[layer][s];
        if (sv.action != Action::kOffload || sv.p == nullptr || sv.ticket) continue;
        const char* name = L.moe ? kMoeNames[s] : kDenseNames[s];
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
    for (int s = 1; s < n_slots; ++s) {
      if (saved[layer][s].p != nullptr) continue;
      produce(layer, s, batch, seq);
      hand_over();
    }
    at(layer, "output", "forward");
    float* y = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(d));
    if (L.moe) {
      route(layer, T);
      moe_combine_fwd(F(layer, kMid), F(layer, kExpertOut), F(layer, kWeights), inv.data(), y, T,
                      L.top_k, d);
    } else {
      linear_fwd(F(layer, kDenseAct), w + L.w2, y, T, L.ffn, d);
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

  // dy (T, d): gradient of the layer's output; writes dx (T, d), the input's gradient.
  void backward_layer(int layer, const float* dy, float* dx, int batch, int seq,
                      TrainingHooks& hooks) {
    const LayerParams& L = lp[static_cast<size_t>(layer)];
    const int T = batch * seq;
    const size_t Td = static_cast<size_t>(T) * static_cast<size_t>(d);
    const int n_slots = L.moe ? kMoeSlots : kDenseSlots;
    hooks.backward_begin(layer);
    bool reloaded = false;
    for (int s = 0; s < n_slots; ++s) {
      Saved& sv = saved[layer][s];
      if (sv.action != Action::kOffload) continue;
      sv.p = hooks.needed(sv.ticket, nullptr);
      SPILLWAY_CHECK(sv.p != nullptr, "no hook gave back {} of layer {}",
                     L.moe ? kMoeNames[s] : kDenseNames[s], layer);
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
      linear_bwd(F(layer, kNorm2), w + L.router, dlogits, dnorm, g + L.router, T, d, L.experts,
                 true);
      release(dlogits);
    } else {
      const size_t tf = static_cast<size_t>(T) * static_cast<size_t>(L.ffn);
      float* dact = alloc_n<float>(tf);
      linear_bwd(F(layer, kDenseAct), w + L.w2, dy, dact, g + L.w2, T, L.ffn, d, false);
      float* dg = alloc_n<float>(tf);
      float* du = alloc_n<float>(tf);
      swiglu_bwd(F(layer, kDenseGate), F(layer, kDenseUp), dact, dg, du, tf);
      release(dact);
      linear_bwd(F(layer, kNorm2), w + L.w1, dg, dnorm, g + L.w1, T, d, L.ffn, false);
      linear_bwd(F(layer, kNorm2), w + L.w3, du, dnorm, g + L.w3, T, d, L.ffn, true);
      release(dg);
      release(du);
    }
    float* tmp = alloc_n<float>(Td);
    rmsnorm_bwd(F(layer, kMid), w + L.mlp_norm, dnorm, tmp, g + L.mlp_norm, T, d, c.rms_eps);
    add(dmid, tmp, dmid, Td);
    // Attention block: mlp.input = attn.input + out_proj(attention(qkv(norm(attn.input)))).
    float* dcore = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(q_dim));
    linear_bwd(F(layer, kCoreOut), w + L.wo, dmid, dcore, g + L.wo, T, q_dim, d, false);
    float* dqkv = alloc_n<float>(static_cast<size_t>(T) * static_cast<size_t>(qkv_dim));
    attention_bwd(F(layer, kQkv), F(layer, kCoreOut), F(layer, kLse), dcore, dqkv, batch, seq,
                  c.heads, c.kv_heads, c.head_dim, c.rope_theta);
    release(dcore);
    linear_bwd(F(layer, kNorm1), w + L.wqkv, dqkv, dnorm, g + L.wqkv, T, d, qkv_dim, false);
    release(dqkv);
    rmsnorm_bwd(F(layer, kInput), w + L.attn_norm, dnorm, tmp, g + L.attn_norm, T, d, c.rms_eps);
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
    L.wqkv = take(static_cast<size_t>(m.qkv_dim) * d);
    L.wo = take(d * static_cast<size_t>(m.q_dim));
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
  }
  ones(m.final_norm);
  std::fill(m.g, m.g + at, 0.0f);
  if (device_optimizer) {
    std::fill(m.m1, m.m1 + at, 0.0f);
    std::fill(m.m2, m.m2 + at, 0.0f);
  } else {
    for (size_t i = 0; i < at; ++i) m.w16[i] = optim::float_to_bf16(m.w[i]);
    std::fill(m.g16, m.g16 + at, uint16_t{0});
  }
  m.at(-1, "", "");
  m.saved.resize(static_cast<size_t>(c.layers()));
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
  const int n = impl_->lp[static_cast<size_t>(layer)].moe ? kMoeSlots : kDenseSlots;
  int64_t total = 0;
  for (int s = 0; s < n; ++s)
    total += static_cast<int64_t>(impl_->slot_bytes(layer, s, batch * seq));
  return total;
}

std::vector<int64_t> Model::saved_tensor_bytes(int layer, int batch, int seq) const {
  const int n = impl_->lp[static_cast<size_t>(layer)].moe ? kMoeSlots : kDenseSlots;
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int s = 0; s < n; ++s)
    out[static_cast<size_t>(s)] = static_cast<int64_t>(impl_->slot_bytes(layer, s, batch * seq));
  return out;
}

std::vector<optim::Bucket> Model::parameter_buckets() const {
  return impl_->buckets;
}

StepStats Model::step(const std::vector<int32_t>& tokens, int batch, int seq,
                      const MemoryPolicy& policy, TrainingHooks& hooks, double lr) {
  Impl& m = *impl_;
  const RefConfig& c = m.c;
  SPILLWAY_CHECK(batch > 0 && seq > 0, "step: batch {} and seq {} must be > 0", batch, seq);
  SPILLWAY_CHECK(tokens.size() == static_cast<size_t>(batch) * static_cast<size_t>(seq + 1),
                 "step: {} tokens for batch {} x (seq {} + 1)", tokens.size(), batch, seq);
  SPILLWAY_CHECK(policy.layer_count() == c.layers(), "policy {} has {} layers; the model has {}",
                 policy.name, policy.layer_count(), c.layers());
  for (int l = 0; l < c.layers(); ++l) {
    const LayerActions& la = policy.layers[static_cast<size_t>(l)];
    const size_t slots =
        static_cast<size_t>(m.lp[static_cast<size_t>(l)].moe ? kMoeSlots : kDenseSlots);
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
  std::vector<int32_t> in(static_cast<size_t>(T)), target(static_cast<size_t>(T));
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < seq; ++t) {
      const size_t src =
          static_cast<size_t>(b) * static_cast<size_t>(seq + 1) + static_cast<size_t>(t);
      const int32_t tok = tokens[src];
      const int32_t next = tokens[src + 1];
      if (tok < 0 || tok >= c.vocab || next < 0 || next >= c.vocab)
        SPILLWAY_INPUT_ERROR("token {} at position {} is outside the vocabulary [0, {})",
                             tok < 0 || tok >= c.vocab ? tok : next, src, c.vocab);
      const size_t at = static_cast<size_t>(b) * static_cast<size_t>(seq) + static_cast<size_t>(t);
      in[at] = tok;
      target[at] = next;
    }
  }
  const bool offloaded_optimizer = m.w16 != nullptr;
  SPILLWAY_CHECK(!offloaded_optimizer || lr <= 0,
                 "step: lr is {}; this Model's optimizer is offloaded (built with "
                 "device_optimizer = false): its hooks step it, lr must be 0",
                 lr);
  hooks.step_begin();
  if (offloaded_optimizer) {
    // The weights of this step: the bf16 ones the optimizer wrote (the last step's uploads
    // are ordered before the compute stream's next work), widened for the fp32 ops.
    m.dev.synchronize(m.compute);
    for (size_t i = 0; i < m.n_params; ++i) m.w[i] = optim::bf16_to_float(m.w16[i]);
  }
  // A bucket's gradients are complete: with an offloaded optimizer, in bf16 to its buffer,
  // then to the hooks.
  auto hand_over = [&](int b) {
    if (!offloaded_optimizer) return;
    const optim::Bucket& k = m.buckets[static_cast<size_t>(b)];
    uint16_t* g16 = m.g16 + k.offset;
    for (size_t i = 0; i < k.n; ++i) g16[i] = optim::float_to_bf16(m.g[k.offset + i]);
    hooks.grad_ready(b);
  };
  m.dev.reset_peaks();
  const auto t0 = Clock::now();
  std::fill(m.g, m.g + m.n_params, 0.0f);
  m.at(-1, "embedding", "at the");
  float* x = m.alloc_n<float>(Td);
  embedding_fwd(in.data(), m.w + m.embed, x, T, m.d);
  for (int l = 0; l < c.layers(); ++l) {
    const auto tl = Clock::now();
    float* y = nullptr;
    m.forward_layer(l, x, &y, batch, seq, policy, hooks);
    x = y;  // the layer's input now belongs to its saved tensors
    st.layer_fwd_ms[static_cast<size_t>(l)] = ms_since(tl);
  }
  // Head: final norm, LM head, cross-entropy (x is the last layer's output).
  m.at(-1, "LM head", "at the");
  float* fn = m.alloc_n<float>(Td);
  rmsnorm_fwd(x, m.w + m.final_norm, fn, T, m.d, c.rms_eps);
  const size_t tv = static_cast<size_t>(T) * static_cast<size_t>(c.vocab);
  float* logits = m.alloc_n<float>(tv);
  linear_fwd(fn, m.w + m.lm_head, logits, T, m.d, c.vocab);
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
    m.backward_layer(l, dy, dx, batch, seq, hooks);
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
  if (lr > 0 && !offloaded_optimizer) {
    // AdamW in its textbook form (decoupled weight decay 0.1 on matrices and embeddings
    // alike; the reference model keeps it simple), bias-corrected.
    optim::AdamWParams hp;
    hp.lr = lr;
    hp.beta1 = 0.9;
    hp.beta2 = 0.95;
    hp.eps = 1e-8;
    hp.weight_decay = 0.1;
    ++m.adam_step;
    const auto to = Clock::now();
    optim::adamw_step_textbook(hp, m.adam_step, m.w, m.m1, m.m2, m.g, m.n_params);
    st.optimizer_ms = ms_since(to);
  }
  return st;
}

}  // namespace spillway::nn

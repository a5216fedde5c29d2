// Builds the per-layer inventory of ops and saved tensors (see inventory.hpp).
//
// FLOP conventions: a GEMM of (M x K) by (K x N) is 2MKN forward and 4MKN backward (data
// and weight gradients). Core attention (flash style) is 2 * T * keys * heads * (d_qk +
// d_v) forward and 2.5x that backward (it recomputes the scores). Memory-bound ops are
// counted by the bytes they read and write; backward moves twice the forward bytes.
#include "spillway/catalog/inventory.hpp"

#include <algorithm>
#include <utility>

#include "core/enum_names.hpp"
#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"

namespace spillway {

int64_t dtype_bytes(DType t) {
  switch (t) {
    case DType::kBf16:
    case DType::kFp16:
      return 2;
    case DType::kFp8:
      return 1;
    case DType::kFp32:
      return 4;
  }
  return 2;
}

constexpr EnumNames<DType, 4> kDTypeNames = {
    {{DType::kBf16, "bf16"}, {DType::kFp16, "fp16"}, {DType::kFp8, "fp8"}, {DType::kFp32, "fp32"}}};
constexpr EnumNames<OpKind, 3> kOpKindNames = {
    {{OpKind::kGemm, "gemm"}, {OpKind::kAttention, "attention"}, {OpKind::kMemory, "memory"}}};

std::string to_string(DType t) {
  return std::string(name_of(kDTypeNames, t));
}

DType parse_dtype(const std::string& s) {
  if (const std::optional<DType> t = value_of(kDTypeNames, s)) return *t;
  SPILLWAY_FIELD_ERROR("dtype", fmt::format("'{}'", s), "must be one of bf16, fp16, fp8, fp32");
}

std::string to_string(OpKind k) {
  return std::string(name_of(kOpKindNames, k));
}

OpKind parse_op_kind(const std::string& s) {
  if (const std::optional<OpKind> k = value_of(kOpKindNames, s)) return *k;
  SPILLWAY_INPUT_ERROR("op kind is '{}'; must be gemm, attention or memory", s);
}

double causal_average_keys(int64_t seq_len, int64_t window) {
  const double s = static_cast<double>(seq_len);
  if (window <= 0 || window >= seq_len) return (s + 1.0) / 2.0;
  const double w = static_cast<double>(window);
  return (w * (w + 1.0) / 2.0 + (s - w) * w) / s;
}

int64_t OpShape::min_dim() const {
  return std::min({m, n, k});
}

int LayerInventory::find(const std::string& tensor_name) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == tensor_name) return static_cast<int>(i);
  }
  return -1;
}

int64_t LayerInventory::saved_bytes() const {
  int64_t total = 0;
  for (const TensorInfo& t : tensors) {
    if (t.saved) total = checked_add(total, t.bytes, "a layer's saved bytes");
  }
  return total;
}

namespace {

const char* kOverflow = "activation size (micro_batch * seq_len * width * bytes)";

int64_t mul(int64_t a, int64_t b) {
  return checked_mul(a, b, kOverflow);
}
int64_t ceil_div(int64_t a, int64_t b) {
  return a / b + (a % b != 0 ? 1 : 0);  // no a + b - 1: it overflows near INT64_MAX
}

class Builder {
 public:
  explicit Builder(LayerInventory& inv) : inv_(inv) {}

  int tensor(std::string name, int64_t rows, int64_t cols, const char* dtype, int64_t elem,
             bool saved = true) {
    TensorInfo t;
    t.name = std::move(name);
    t.shape = {rows, cols};
    t.dtype = dtype;
    t.bytes = mul(mul(rows, cols), elem);
    t.saved = saved;
    inv_.tensors.push_back(std::move(t));
    return static_cast<int>(inv_.tensors.size() - 1);
  }

  void op(std::string name, OpKind kind, double flops, int64_t bytes, std::vector<int> in,
          std::vector<int> out, OpShape shape = {}, double bwd_flop_factor = 2.0) {
    OpCost o;
    o.name = std::move(name);
    o.kind = kind;
    o.shape = shape;
    o.fwd_flops = flops;
    o.fwd_bytes = bytes;
    o.bwd_flops = flops * bwd_flop_factor;
    o.bwd_bytes = checked_mul(bytes, 2, kOverflow);
    o.inputs = std::move(in);
    o.outputs = std::move(out);
    const int index = static_cast<int>(inv_.ops.size());
    for (int t : o.outputs) inv_.tensors[static_cast<size_t>(t)].producer = index;
    inv_.ops.push_back(std::move(o));
  }

 private:
  LayerInventory& inv_;
};

void mlp_inventory(Builder& b, const MlpSpec& m, int64_t d, const ShardShape& sh, int h,
                   const char* out_name = "layer.output");

// What every block part needs: tokens, widths and byte helpers of one shard shape.
struct Dims {
  int64_t e, tp, T, Tsp;
  double Tf, df, tpf;
  std::string dt;
  Dims(int64_t d, const ShardShape& sh)
      : e(dtype_bytes(sh.dtype)),
        tp(sh.tp),
        T(ceil_div(mul(sh.micro_batch, sh.seq_len), sh.cp)),
        Tsp(ceil_div(T, sh.tp)),
        Tf(static_cast<double>(T)),
        df(static_cast<double>(d)),
        tpf(static_cast<double>(sh.tp)),
        dt(to_string(sh.dtype)) {}
  // inputs + weights + outputs of a GEMM, per GPU (widths split by tp)
  int64_t gemm_bytes(int64_t M, int64_t K, int64_t N) const {
    return mul(checked_add(checked_add(mul(M, K), mul(K, N), kOverflow), mul(M, N), kOverflow) / tp,
               e);
  }
  static OpShape gemm(int64_t M, int64_t K, int64_t N) {
    OpShape g;
    g.m = M;
    g.n = N;
    g.k = K;
    return g;
  }
};

// Note [Block inventories]: a layer is a token mixer (attention, a state-space model,
// linear attention, or none) and an MLP (dense, MoE, or none), each with its pre-norm and
// residual; the mixer's output is "mlp.input" when an MLP follows, else the unsaved
// "layer.output". Widths split by tp as heads do. Two hybrids: Falcon-H1's attention has a
// Mamba mixer beside it on the same norm output, summed by the attention's out_proj (the
// mixer's own out_proj writes the unsaved "ssm.out"); Zamba2's hybrid layer runs a shared
// attention (over [hidden, input embedding], no residual, "mlp.input" its output) and MLP
// ("shared.out", unsaved), then "shared.proj" (a hidden x hidden GEMM plus the hidden state)
// makes "ssm.input" of the layer's Mamba mixer.
//
// Mamba (docs/plan-schema.md, "ssm.*"): norm; in_proj (GEMM) to z, x, B, C, dt; a causal
// depthwise conv over x, B, C; the scan; the gate (Mamba-2: gated RMSNorm; Mamba-1:
// y * silu(z)); out_proj (GEMM). The scan saves its output and its chunk states (fp32):
// the block policy recomputes in_proj, conv and gate from the kept input and never reruns
// the scan (docs/planner.md). Mamba-2's scan is the chunked SSD: per token and head,
// Q (N + P) FLOPs inside its chunk of Q (a causal matmul pair, attention-like: costed at
// the attention efficiency with Q / 2 keys) and 4 N P across chunks. Mamba-1's is a
// per-channel recurrence, 9 N FLOPs per token and channel, memory-bound; its states are
// kept every 2048 tokens (the kernel's chunk).
//
// A parallel mixer (Falcon-H1) is given the attention's norm output as `parallel_in`: it has
// no input or norm of its own, and its out_proj writes the unsaved "ssm.out" that the
// attention's out_proj adds with the residual. A mixer after a shared block (Zamba2) is
// given its input, made by the block's projection, as `input`.
void mamba_inventory(Builder& b, const SsmSpec& s, int64_t d, const ShardShape& sh,
                     const char* out_name, bool out_saved, int parallel_in = -1, int input = -1) {
  const Dims k(d, sh);
  const char* dt = k.dt.c_str();
  int x = -1;
  int xn = parallel_in;
  if (parallel_in < 0) {
    x = input >= 0 ? input : b.tensor("ssm.input", k.Tsp, d, dt, k.e);
    xn = b.tensor("ssm.norm_out", k.Tsp, d, dt, k.e);
    b.op("ssm.norm", OpKind::kMemory, 4.0 * k.Tf * k.df / k.tpf, mul(mul(2, k.Tsp), mul(d, k.e)),
         {x}, {xn});
  }
  const bool v1 = s.version == 1;
  // in_proj: Mamba-1 x and z; Mamba-2 z, x, B, C (groups) and dt (heads).
  const int64_t conv_dim = v1 ? s.inner : s.inner + mul(2, mul(s.groups, s.state));
  const int64_t in_width = v1 ? mul(2, s.inner) : s.inner + conv_dim + s.heads;
  const int in = b.tensor("ssm.in_proj_out", k.T, ceil_div(in_width, k.tp), dt, k.e);
  b.op("ssm.in_proj", OpKind::kGemm, 2.0 * k.Tf * k.df * static_cast<double>(in_width) / k.tpf,
       k.gemm_bytes(k.T, d, in_width), {xn}, {in}, Dims::gemm(k.T, d, ceil_div(in_width, k.tp)));
  const int conv = b.tensor("ssm.conv_out", k.T, ceil_div(conv_dim, k.tp), dt, k.e);
  b.op("ssm.conv", OpKind::kMemory,
       2.0 * k.Tf * static_cast<double>(conv_dim) * static_cast<double>(s.conv) / k.tpf,
       mul(mul(2, k.T), mul(ceil_div(conv_dim, k.tp), k.e)), {in}, {conv});
  std::vector<int> scan_in = {conv, in};
  if (v1) {
    // x_proj (to dt, B, C) and dt_proj (back to the inner width), on every channel.
    const int64_t xw = s.dt_rank + mul(2, s.state);
    const int xp = b.tensor("ssm.x_proj_out", k.T, xw, dt, k.e);
    b.op("ssm.x_proj", OpKind::kGemm,
         2.0 * k.Tf * static_cast<double>(s.inner) * static_cast<double>(xw) / k.tpf,
         k.gemm_bytes(k.T, s.inner, xw), {conv}, {xp},
         Dims::gemm(k.T, ceil_div(s.inner, k.tp), xw));
    const int dtp = b.tensor("ssm.dt", k.T, ceil_div(s.inner, k.tp), dt, k.e);
    b.op("ssm.dt_proj", OpKind::kGemm,
         2.0 * k.Tf * static_cast<double>(s.dt_rank) * static_cast<double>(s.inner) / k.tpf,
         k.gemm_bytes(k.T, s.dt_rank, s.inner), {xp}, {dtp},
         Dims::gemm(k.T, s.dt_rank, ceil_div(s.inner, k.tp)));
    scan_in = {conv, xp, dtp, in};
  }
  const int y = b.tensor("ssm.scan_out", k.T, ceil_div(s.inner, k.tp), dt, k.e);
  const int64_t chunk = v1 ? 2048 : s.chunk;
  const int64_t state_width = v1 ? mul(s.inner, s.state) : mul(mul(s.heads, s.head_dim), s.state);
  const int states =
      b.tensor("ssm.chunk_states", ceil_div(k.T, chunk), ceil_div(state_width, k.tp), "fp32", 4);
  if (v1) {
    b.op("ssm.scan", OpKind::kMemory,
         9.0 * k.Tf * static_cast<double>(s.inner) * static_cast<double>(s.state) / k.tpf,
         mul(mul(k.T, ceil_div(mul(4, s.inner) + mul(2, s.state), k.tp)), k.e), scan_in,
         {y, states});
  } else {
    const double Q = static_cast<double>(s.chunk);
    const double N = static_cast<double>(s.state);
    const double P = static_cast<double>(s.head_dim);
    OpShape scan_shape;
    scan_shape.keys = Q / 2.0;
    b.op("ssm.scan", OpKind::kAttention,
         k.Tf * static_cast<double>(s.heads) * (Q * (N + P) + 4.0 * N * P) / k.tpf,
         mul(mul(k.T, ceil_div(conv_dim + s.inner + s.heads, k.tp)), k.e), scan_in, {y, states},
         scan_shape, 2.5);
  }
  const int gated = b.tensor("ssm.out_proj_in", k.T, ceil_div(s.inner, k.tp), dt, k.e);
  b.op("ssm.gate", OpKind::kMemory, 6.0 * k.Tf * static_cast<double>(s.inner) / k.tpf,
       mul(mul(3, k.T), mul(ceil_div(s.inner, k.tp), k.e)), {y, in}, {gated});
  const int out = b.tensor(out_name, k.Tsp, d, dt, k.e, out_saved);
  std::vector<int> out_in = {gated};
  if (x >= 0) out_in.push_back(x);  // the residual
  b.op("ssm.out_proj", OpKind::kGemm, 2.0 * k.Tf * static_cast<double>(s.inner) * k.df / k.tpf,
       k.gemm_bytes(k.T, s.inner, d), out_in, {out}, Dims::gemm(k.T, ceil_div(s.inner, k.tp), d));
}

// Linear attention (docs/plan-schema.md, "lin.*"), as Mamba-2 with the chunked linear
// recurrence as its scan: per token and value head, C (dk + dv) FLOPs inside its chunk of C
// and 4 dk dv across chunks (the recurrent state is dk x dv per value head); the block
// policy recomputes the projections, conv and gate and keeps the core output and chunk
// states. The input projection makes, per kind: Gated DeltaNet q, k, v, z (the output gate)
// and b, a (beta and decay) per value head; Kimi Delta Attention q, k, v, the per-channel
// decay and the output gate (each through a rank-r pair) and beta per head; lightning
// attention q, k, v and the output gate, and has no convolution.
void linear_attention_inventory(Builder& b, const LinearAttentionSpec& g, int64_t d,
                                const ShardShape& sh, const char* out_name, bool out_saved) {
  const Dims k(d, sh);
  const char* dt = k.dt.c_str();
  const int64_t key = mul(g.k_heads, g.k_head_dim);
  const int64_t value = mul(g.v_heads, g.v_head_dim);
  const int x = b.tensor("lin.input", k.Tsp, d, dt, k.e);
  const int xn = b.tensor("lin.norm_out", k.Tsp, d, dt, k.e);
  b.op("lin.norm", OpKind::kMemory, 4.0 * k.Tf * k.df / k.tpf, mul(mul(2, k.Tsp), mul(d, k.e)), {x},
       {xn});
  const int64_t conv_dim = mul(2, key) + value;
  int64_t in_width = 0;  // what the projections write
  double in_flops = 0;
  switch (g.kind) {
    case LinearKind::kGatedDeltaNet:
      in_width = mul(2, key) + mul(2, value) + mul(2, g.v_heads);
      in_flops = 2.0 * k.Tf * k.df * static_cast<double>(in_width) / k.tpf;
      break;
    case LinearKind::kKimiDelta: {
      in_width = conv_dim + key + g.v_heads + value;
      const double r = static_cast<double>(g.gate_rank);
      in_flops = 2.0 * k.Tf *
                 (k.df * (static_cast<double>(conv_dim + g.v_heads) + 2.0 * r) +
                  r * static_cast<double>(key + value)) /
                 k.tpf;
      break;
    }
    case LinearKind::kLightning:
      in_width = conv_dim + value;
      in_flops = 2.0 * k.Tf * k.df * static_cast<double>(in_width) / k.tpf;
      break;
  }
  const int in = b.tensor("lin.in_proj_out", k.T, ceil_div(in_width, k.tp), dt, k.e);
  b.op("lin.in_proj", OpKind::kGemm, in_flops, k.gemm_bytes(k.T, d, in_width), {xn}, {in},
       Dims::gemm(k.T, d, ceil_div(in_width, k.tp)));
  int conv = in;
  if (g.conv > 0) {
    conv = b.tensor("lin.conv_out", k.T, ceil_div(conv_dim, k.tp), dt, k.e);
    b.op("lin.conv", OpKind::kMemory,
         2.0 * k.Tf * static_cast<double>(conv_dim) * static_cast<double>(g.conv) / k.tpf,
         mul(mul(2, k.T), mul(ceil_div(conv_dim, k.tp), k.e)), {in}, {conv});
  }
  const int y = b.tensor("lin.core_out", k.T, ceil_div(value, k.tp), dt, k.e);
  const int states =
      b.tensor("lin.chunk_states", ceil_div(k.T, g.chunk),
               ceil_div(mul(g.v_heads, mul(g.k_head_dim, g.v_head_dim)), k.tp), "fp32", 4);
  const double C = static_cast<double>(g.chunk);
  const double dk = static_cast<double>(g.k_head_dim);
  const double dv = static_cast<double>(g.v_head_dim);
  OpShape core_shape;
  core_shape.keys = C / 2.0;
  // The core reads q, k, v (the conv's output) and its gates (the rest of the projection).
  std::vector<int> core_in = {conv};
  if (conv != in) core_in.push_back(in);
  b.op("lin.core", OpKind::kAttention,
       k.Tf * static_cast<double>(g.v_heads) * (C * (dk + dv) + 4.0 * dk * dv) / k.tpf,
       mul(mul(k.T, ceil_div(in_width, k.tp)), k.e), core_in, {y, states}, core_shape, 2.5);
  const int gated = b.tensor("lin.out_proj_in", k.T, ceil_div(value, k.tp), dt, k.e);
  b.op("lin.gate", OpKind::kMemory, 6.0 * k.Tf * static_cast<double>(value) / k.tpf,
       mul(mul(3, k.T), mul(ceil_div(value, k.tp), k.e)), {y, in}, {gated});
  const int out = b.tensor(out_name, k.Tsp, d, dt, k.e, out_saved);
  b.op("lin.out_proj", OpKind::kGemm, 2.0 * k.Tf * static_cast<double>(value) * k.df / k.tpf,
       k.gemm_bytes(k.T, value, d), {gated, x}, {out}, Dims::gemm(k.T, ceil_div(value, k.tp), d));
}

// Griffin's recurrent block (docs/plan-schema.md, "rec.*"): norm; y = W_y x (GEMM, its GeLU
// applied in the gate); x' = W_x x (GEMM); a causal depthwise conv over x'; the RG-LRU (its
// two block-diagonal gates, 2 x 2 w (w / heads) FLOPs a token, and the recurrence, ~10 w);
// the gate h * gelu(y); out_proj (GEMM). The RG-LRU saves its output and its state every
// chunk tokens; the block policy recomputes the whole block from its input but keeps those
// chunk states (docs/planner.md: full-block plus a narrow recompute of the recurrence).
void recurrent_inventory(Builder& b, const RecurrentSpec& r, int64_t d, const ShardShape& sh,
                         const char* out_name, bool out_saved) {
  const Dims k(d, sh);
  const char* dt = k.dt.c_str();
  const int64_t w = r.width;
  const int64_t wt = ceil_div(w, k.tp);
  const int x = b.tensor("rec.input", k.Tsp, d, dt, k.e);
  const int xn = b.tensor("rec.norm_out", k.Tsp, d, dt, k.e);
  b.op("rec.norm", OpKind::kMemory, 4.0 * k.Tf * k.df / k.tpf, mul(mul(2, k.Tsp), mul(d, k.e)), {x},
       {xn});
  const double proj = 2.0 * k.Tf * k.df * static_cast<double>(w) / k.tpf;
  const int y = b.tensor("rec.y_out", k.T, wt, dt, k.e);
  b.op("rec.y_proj", OpKind::kGemm, proj, k.gemm_bytes(k.T, d, w), {xn}, {y},
       Dims::gemm(k.T, d, wt));
  const int xp = b.tensor("rec.x_out", k.T, wt, dt, k.e);
  b.op("rec.x_proj", OpKind::kGemm, proj, k.gemm_bytes(k.T, d, w), {xn}, {xp},
       Dims::gemm(k.T, d, wt));
  const int conv = b.tensor("rec.conv_out", k.T, wt, dt, k.e);
  b.op("rec.conv", OpKind::kMemory,
       2.0 * k.Tf * static_cast<double>(w) * static_cast<double>(r.conv) / k.tpf,
       mul(mul(2, k.T), mul(wt, k.e)), {xp}, {conv});
  const int h = b.tensor("rec.lru_out", k.T, wt, dt, k.e);
  const int states = b.tensor("rec.chunk_states", ceil_div(k.T, r.chunk), wt, "fp32", 4);
  const int64_t block_width = w / r.heads;  // the gates' diagonal blocks
  const double block = static_cast<double>(block_width);
  b.op("rec.lru", OpKind::kMemory, k.Tf * static_cast<double>(w) * (4.0 * block + 10.0) / k.tpf,
       mul(mul(3, k.T), mul(wt, k.e)), {conv}, {h, states});
  const int gated = b.tensor("rec.out_proj_in", k.T, wt, dt, k.e);
  b.op("rec.gate", OpKind::kMemory, 10.0 * k.Tf * static_cast<double>(w) / k.tpf,
       mul(mul(3, k.T), mul(wt, k.e)), {h, y}, {gated});
  const int out = b.tensor(out_name, k.Tsp, d, dt, k.e, out_saved);
  b.op("rec.out_proj", OpKind::kGemm, 2.0 * k.Tf * static_cast<double>(w) * k.df / k.tpf,
       k.gemm_bytes(k.T, w, d), {gated, x}, {out}, Dims::gemm(k.T, wt, d));
}

}  // namespace

LayerInventory build_inventory(const LayerSpec& layer, int64_t d, const ShardShape& sh) {
  SPILLWAY_CHECK(sh.tp >= 1 && sh.cp >= 1 && sh.ep >= 1 && sh.micro_batch >= 1 && sh.seq_len >= 1,
                 "shard shape must be positive");
  LayerInventory inv;
  Builder b(inv);
  const int64_t e = dtype_bytes(sh.dtype);
  const std::string dtype_name = to_string(sh.dtype);
  const char* dt = dtype_name.c_str();
  const int64_t tp = sh.tp;
  const int64_t T = ceil_div(mul(sh.micro_batch, sh.seq_len), sh.cp);  // tokens per GPU
  const int64_t Tsp = ceil_div(T, tp);                                 // sequence-parallel rows
  const double Tf = static_cast<double>(T);
  const double df = static_cast<double>(d);
  const double tpf = static_cast<double>(tp);
  const AttentionSpec& a = layer.attn;
  const MlpSpec& m = layer.mlp;

  auto gemm_shape = [](int64_t M, int64_t K, int64_t N) {
    OpShape g;
    g.m = M;
    g.n = N;
    g.k = K;
    return g;
  };

  auto gemm_bytes = [&](int64_t M, int64_t K, int64_t N, int64_t weight_copies = 1) {
    // inputs + weights + outputs, per GPU (weights and widths split by tp)
    return mul(checked_add(checked_add(mul(M, K), mul(mul(K, N), weight_copies), kOverflow),
                           mul(M, N), kOverflow) /
                   tp,
               e);
  };

  // The mixer's output plus the residual: the MLP's input, or the layer's output in a
  // mixer-only layer (Note [Block inventories]).
  const bool has_mlp = m.kind != MlpKind::kNone;
  const char* mixer_out = has_mlp ? "mlp.input" : "layer.output";
  if (layer.shared_block >= 0) {
    // Zamba2: the shared block (attention, MLP) first, the Mamba mixer after (below).
  } else if (layer.mixer == MixerKind::kMamba) {
    mamba_inventory(b, layer.ssm, d, sh, mixer_out, has_mlp);
  } else if (layer.mixer == MixerKind::kLinearAttention) {
    linear_attention_inventory(b, layer.linear, d, sh, mixer_out, has_mlp);
  } else if (layer.mixer == MixerKind::kRecurrent) {
    recurrent_inventory(b, layer.recurrent, d, sh, mixer_out, has_mlp);
  }
  if (layer.mixer != MixerKind::kAttention && layer.shared_block < 0) {
    if (!has_mlp) return inv;
    if (layer.mixer == MixerKind::kNone) b.tensor("mlp.input", Tsp, d, dt, e);  // layer input
    mlp_inventory(b, m, d, sh, inv.find("mlp.input"));
    return inv;
  }

  // ---- attention -----------------------------------------------------------------
  // A shared block (Zamba2) reads [hidden, input embedding] (in_w wide) and adds no
  // residual: the layer's mixer does, after the block's projection (Note [Block
  // inventories]).
  const bool shared = layer.shared_block >= 0;
  const int64_t in_w = a.input_width > 0 ? a.input_width : d;
  const double inf = static_cast<double>(in_w);
  const int x = b.tensor("attn.input", Tsp, in_w, dt, e);
  const int xn = b.tensor("attn.norm_out", Tsp, in_w, dt, e);
  b.op("attn.norm", OpKind::kMemory, 4.0 * Tf * inf / tpf, mul(mul(2, Tsp), mul(in_w, e)), {x},
       {xn});

  // Gated attention (Qwen3-Next): the Q projection also makes the output gate.
  const int64_t q_width = mul(mul(a.heads, a.qk_head_dim), a.output_gate ? 2 : 1);
  const int64_t kv_width = a.kind == AttentionKind::kMla
                               ? mul(a.heads, a.qk_head_dim + a.v_head_dim)
                               : mul(a.kv_heads, a.qk_head_dim + a.v_head_dim);
  const int64_t qkv_width = checked_add(q_width, kv_width, kOverflow);
  const int qkv = b.tensor("attn.qkv_out", T, ceil_div(qkv_width, tp), dt, e);
  if (a.kind == AttentionKind::kMla) {
    // Down-projections to the latents, then up-projections to per-head Q, K, V.
    const int64_t q_rank = a.q_lora_rank;
    const int64_t kv_in = a.kv_lora_rank + a.qk_rope_head_dim;
    const int64_t down_n = q_rank + kv_in;
    const int ql = q_rank > 0 ? b.tensor("attn.q_latent", T, q_rank, dt, e) : -1;
    const int kvl = b.tensor("attn.kv_latent", T, kv_in, dt, e);
    std::vector<int> latents = {kvl};
    if (ql >= 0) latents.push_back(ql);
    // The latents are computed redundantly on every TP rank (small), hence no /tp on flops.
    b.op("attn.qkv_down", OpKind::kGemm, 2.0 * Tf * df * static_cast<double>(down_n),
         mul(gemm_bytes(T, d, down_n), tp), {xn}, latents, gemm_shape(T, d, down_n));
    const int64_t up_k = q_rank > 0 ? q_rank : d;
    const double up_flops =
        2.0 * Tf *
        (static_cast<double>(up_k) * static_cast<double>(q_width) +
         static_cast<double>(a.kv_lora_rank) *
             static_cast<double>(mul(a.heads, a.qk_head_dim - a.qk_rope_head_dim + a.v_head_dim))) /
        tpf;
    std::vector<int> up_in = latents;
    if (ql < 0) up_in.push_back(xn);
    b.op("attn.qkv_up", OpKind::kGemm, up_flops, gemm_bytes(T, up_k + a.kv_lora_rank, qkv_width),
         up_in, {qkv}, gemm_shape(T, up_k, ceil_div(qkv_width, tp)));
  } else {
    b.op("attn.qkv", OpKind::kGemm, 2.0 * Tf * inf * static_cast<double>(qkv_width) / tpf,
         gemm_bytes(T, in_w, qkv_width), {xn}, {qkv}, gemm_shape(T, in_w, ceil_div(qkv_width, tp)));
  }

  const int64_t o_width = mul(a.heads, a.v_head_dim);
  const int core = b.tensor("attn.out_proj_in", T, ceil_div(o_width, tp), dt, e);
  const int lse = b.tensor("attn.core_lse", T, ceil_div(a.heads, tp), "fp32", 4);
  const double keys = causal_average_keys(sh.seq_len, a.sliding_window);
  const double core_flops = 2.0 * Tf * keys * static_cast<double>(a.heads) *
                            static_cast<double>(a.qk_head_dim + a.v_head_dim) / tpf;
  OpShape core_shape;
  core_shape.keys = keys;
  b.op("attn.core", OpKind::kAttention, core_flops,
       mul(checked_add(qkv_width, o_width, kOverflow), mul(T, e)) / tp, {qkv}, {core, lse},
       core_shape, 2.5);

  std::vector<int> out_in = {core};
  if (!shared) out_in.push_back(x);  // the residual
  if (layer.parallel_ssm) {          // Falcon-H1: the Mamba mixer beside, summed by the out_proj
    mamba_inventory(b, layer.ssm, d, sh, "ssm.out", false, xn);
    out_in.push_back(inv.find("ssm.out"));
  }
  const int h = b.tensor(mixer_out, Tsp, d, dt, e, has_mlp);
  b.op("attn.out_proj", OpKind::kGemm, 2.0 * Tf * static_cast<double>(o_width) * df / tpf,
       gemm_bytes(T, o_width, d), out_in, {h}, gemm_shape(T, ceil_div(o_width, tp), d));
  if (!shared) {
    if (has_mlp) mlp_inventory(b, m, d, sh, h);
    return inv;
  }
  // The shared block's output, through the layer's projection, plus the hidden state (the
  // first half of the block's input) is the mixer's input.
  mlp_inventory(b, m, d, sh, h, "shared.out");
  const int ssm_in = b.tensor("ssm.input", Tsp, d, dt, e);
  b.op("shared.proj", OpKind::kGemm, 2.0 * Tf * df * df / tpf, gemm_bytes(T, d, d),
       {inv.find("shared.out"), x}, {ssm_in}, gemm_shape(T, d, ceil_div(d, tp)));
  mamba_inventory(b, layer.ssm, d, sh, "layer.output", false, -1, ssm_in);
  return inv;
}

namespace {

// ---- MLP (dense or MoE), from its input tensor `h` -------------------------------------
void mlp_inventory(Builder& b, const MlpSpec& m, int64_t d, const ShardShape& sh, int h,
                   const char* out_name) {
  const int64_t e = dtype_bytes(sh.dtype);
  const std::string dtype_name = to_string(sh.dtype);
  const char* dt = dtype_name.c_str();
  const int64_t tp = sh.tp;
  const int64_t T = ceil_div(mul(sh.micro_batch, sh.seq_len), sh.cp);
  const int64_t Tsp = ceil_div(T, tp);
  const double Tf = static_cast<double>(T);
  const double df = static_cast<double>(d);
  const double tpf = static_cast<double>(tp);
  auto gemm_shape = [](int64_t M, int64_t K, int64_t N) {
    OpShape g;
    g.m = M;
    g.n = N;
    g.k = K;
    return g;
  };
  auto gemm_bytes = [&](int64_t M, int64_t K, int64_t N, int64_t weight_copies = 1) {
    return mul(checked_add(checked_add(mul(M, K), mul(mul(K, N), weight_copies), kOverflow),
                           mul(M, N), kOverflow) /
                   tp,
               e);
  };
  const int hn = b.tensor("mlp.norm_out", Tsp, d, dt, e);
  b.op("mlp.norm", OpKind::kMemory, 4.0 * Tf * df / tpf, mul(mul(2, Tsp), mul(d, e)), {h}, {hn});

  const int64_t f_act = m.active_ffn();
  const int64_t f_cols = ceil_div(f_act, tp);
  std::vector<int> gate_in = {hn};
  int topk_w = -1;
  double proj_flops = 0.0;  // one of gate/up, all parts
  int64_t proj_bytes = 0;
  int64_t down_bytes = 0;
  OpShape proj_shape = gemm_shape(T, d, f_cols);  // gate and up; down swaps n and k
  if (m.kind == MlpKind::kMoe) {
    const int64_t E = m.experts;
    const int64_t k = m.top_k;
    const int probs = b.tensor("moe.router_probs", Tsp, E, "fp32", 4);
    const int idx = b.tensor("moe.topk_idx", Tsp, k, "int32", 4);
    topk_w = b.tensor("moe.topk_weights", Tsp, k, "fp32", 4);
    b.op("moe.router", OpKind::kGemm, 2.0 * Tf * df * static_cast<double>(E) / tpf,
         gemm_bytes(T, d, E), {hn}, {probs, idx, topk_w}, gemm_shape(T, d, E));
    const int64_t rows = mul(T, k);  // routed token rows, over all experts
    const int disp = b.tensor("moe.dispatch_in", ceil_div(rows, tp), d, dt, e);
    b.op("moe.dispatch", OpKind::kMemory, 0.0, mul(mul(2, ceil_div(rows, tp)), mul(d, e)),
         {hn, idx}, {disp});
    gate_in = {disp};
    if (m.shared_ffn > 0 || m.residual_ffn > 0) gate_in.push_back(hn);
    const int64_t local_experts = ceil_div(E, sh.ep);
    const double dense_width = static_cast<double>(m.shared_ffn + m.residual_ffn);
    proj_flops = 2.0 * df *
                 (static_cast<double>(rows) * static_cast<double>(m.ffn) + Tf * dense_width) / tpf;
    // Each local expert's weights are read once per projection.
    proj_bytes = checked_add(gemm_bytes(rows, d, m.ffn, local_experts),
                             gemm_bytes(T, d, m.shared_ffn + m.residual_ffn), kOverflow);
    down_bytes = proj_bytes;
    // The routed rows spread evenly over the local experts (shared/residual experts, if
    // any, run in the same op and are costed at the grouped efficiency too).
    proj_shape.experts = local_experts;
    proj_shape.tokens_per_expert = static_cast<double>(rows) / static_cast<double>(local_experts);
    proj_shape.m = ceil_div(rows, local_experts);
    proj_shape.n = ceil_div(m.ffn, tp);
  } else {
    proj_flops = 2.0 * Tf * df * static_cast<double>(m.ffn) / tpf;
    proj_bytes = gemm_bytes(T, d, m.ffn);
    down_bytes = proj_bytes;
  }
  std::vector<int> act_in;
  if (m.gated) {
    const int g = b.tensor("mlp.gate_out", T, f_cols, dt, e);
    b.op("mlp.gate", OpKind::kGemm, proj_flops, proj_bytes, gate_in, {g}, proj_shape);
    act_in.push_back(g);
  }
  const int u = b.tensor("mlp.up_out", T, f_cols, dt, e);
  b.op("mlp.up", OpKind::kGemm, proj_flops, proj_bytes, gate_in, {u}, proj_shape);
  act_in.push_back(u);
  OpShape down_shape = proj_shape;
  std::swap(down_shape.n, down_shape.k);
  // Gated: silu(gate) * up (fused SwiGLU recomputes it in the down projection's backward);
  // ungated: an element-wise activation of up (squared ReLU), always saved.
  const int act = b.tensor("mlp.act", T, f_cols, dt, e, !(sh.fused_swiglu && m.gated));
  b.op("mlp.act", OpKind::kMemory, 4.0 * Tf * static_cast<double>(f_cols),
       mul(mul(m.gated ? 3 : 2, T), mul(f_cols, e)), act_in, {act});
  if (m.kind == MlpKind::kMoe) {
    const int64_t rows = mul(T, m.top_k);
    const int eo = b.tensor("moe.expert_out", ceil_div(rows, tp), d, dt, e);
    const int out = b.tensor(out_name, Tsp, d, dt, e, false);
    b.op("mlp.down", OpKind::kGemm, proj_flops, down_bytes, {act}, {eo}, down_shape);
    b.op("moe.combine", OpKind::kMemory, 2.0 * static_cast<double>(rows) * df / tpf,
         mul(mul(2, ceil_div(rows, tp)), mul(d, e)), {eo, topk_w}, {out});
  } else {
    const int out = b.tensor(out_name, Tsp, d, dt, e, false);
    b.op("mlp.down", OpKind::kGemm, proj_flops, down_bytes, {act}, {out}, down_shape);
  }
}

}  // namespace

}  // namespace spillway

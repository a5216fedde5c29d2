// The per-layer inventory: the forward ops of a decoder layer, in order, and every tensor
// a layer saves for backward, with its name, shape, bytes and producing op.
//
// Names are stable and shared by the planner, the simulator and the runtime engines (see
// docs/plan-schema.md for the list). Sizes are per GPU for one micro-batch: T tokens =
// micro_batch * seq_len / cp; every width is divided by tp (Megatron-style tensor
// parallelism with sequence parallelism, so token-major tensors are split too); MoE
// experts see T * top_k token rows in total (balanced routing; ep spreads the experts,
// not the rows). Byte products are checked for 64-bit overflow.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/catalog/model.hpp"

namespace spillway {

enum class DType { kBf16, kFp16, kFp8, kFp32 };
int64_t dtype_bytes(DType t);
std::string to_string(DType t);
DType parse_dtype(const std::string& s);  // "bf16", "fp16", "fp8", "fp32"

struct ShardShape {
  int64_t micro_batch = 1;
  int64_t seq_len = 4096;
  int64_t tp = 1;
  int64_t cp = 1;
  int64_t ep = 1;
  DType dtype = DType::kBf16;
  bool fused_swiglu = false;  // SwiGLU backward recomputes silu(g)*u in-kernel: act not saved
  int64_t tokens() const { return micro_batch * seq_len / cp; }
};

enum class OpKind { kGemm, kAttention, kMemory };
std::string to_string(OpKind k);  // "gemm", "attention", "memory"
OpKind parse_op_kind(const std::string& s);

// The shape of an op's kernel, what the efficiency curves read (Note [Efficiency curves],
// hardware.hpp). A GEMM multiplies (m x k) by (k x n) per GPU in its forward; a grouped
// expert GEMM is `experts` such GEMMs, one per expert on this GPU, of m = the tokens each
// expert sees (rounded up; tokens_per_expert is exact). Attention reads `keys`, the
// average number of keys per query. Zero where it does not apply.
struct OpShape {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t experts = 0;  // > 0: a grouped expert GEMM over this many experts
  double tokens_per_expert = 0.0;
  double keys = 0.0;  // attention: average keys per query
  bool grouped() const { return experts > 0; }
  int64_t min_dim() const;  // min(m, n, k)
};

struct OpCost {
  std::string name;  // "attn.qkv", "mlp.gate", ...
  OpKind kind = OpKind::kMemory;
  OpShape shape;  // geometry of the forward kernel (backward GEMMs permute m, n, k)
  double fwd_flops = 0.0;
  int64_t fwd_bytes = 0;  // HBM traffic of the forward kernel(s)
  double bwd_flops = 0.0;
  int64_t bwd_bytes = 0;
  std::vector<int> inputs;   // tensor indices read by the forward op
  std::vector<int> outputs;  // tensor indices written by the forward op
};

struct TensorInfo {
  std::string name;            // "mlp.gate_out"
  std::vector<int64_t> shape;  // per GPU, e.g. {T, f_act / tp}
  std::string dtype;           // "bf16", "fp32", "int32"
  int64_t bytes = 0;
  bool saved = true;  // false: a transient intermediate (named for dependencies)
  int producer = -1;  // op index; -1 = the layer input (produced by the layer before)
};

struct LayerInventory {
  std::vector<OpCost> ops;  // forward order
  std::vector<TensorInfo> tensors;
  int find(const std::string& tensor_name) const;  // -1 when absent
  int64_t saved_bytes() const;
};

LayerInventory build_inventory(const LayerSpec& layer, int64_t hidden, const ShardShape& shape);

// Average number of keys a query attends to in causal attention over seq_len positions
// with a sliding window (0 = none): sum_i min(i, window) / seq_len.
double causal_average_keys(int64_t seq_len, int64_t window);

}  // namespace spillway

// CPU AdamW over fp32 master weights and moments (DESIGN section 4): a scalar reference
// and a SIMD version (Highway, run-time dispatch: AVX-512/AVX2 on x86, SVE/NEON on Arm)
// with the same arithmetic, tiled over a thread pool.
//
// The update, per element i (decoupled weight decay, bias correction; PyTorch's AdamW):
//   p  = p * (1 - lr * wd)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p  = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),   bc1 = 1 - beta1^t, bc2 = 1 - beta2^t
// with the per-step scalars (lr / bc1, 1 / sqrt(bc2), 1 - lr * wd) computed once in double
// and rounded to float. Note [AdamW operation order] (adamw.cpp): scalar and SIMD evaluate
// each line in the same order, every multiply and add rounded on its own (no fused
// multiply-add, -ffp-contract=off), so they agree to the bit on every target.
//
// Invariants: no allocation per step (the pool and tiles are sized at construction);
// outputs are fully written; the low-precision copy of p (bf16 round-to-nearest-even, or
// fp16) is written in the same pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace spillway::optim {

struct AdamWParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

enum class GradType { kFp32, kBf16 };
enum class CopyType { kNone, kBf16, kFp16 };

// One call's inputs: n elements of state, the gradient (fp32 or bf16 bits), the step
// counter t (>= 1, of this parameter group) and the optional low-precision copy out.
struct AdamWArgs {
  float* p = nullptr;       // (n) fp32 master weights, updated in place
  float* m = nullptr;       // (n) first moment
  float* v = nullptr;       // (n) second moment
  const void* g = nullptr;  // (n) gradient, fp32 or bf16 bits (uint16_t)
  GradType grad_type = GradType::kFp32;
  float grad_scale = 1.0f;   // the gradient is multiplied by this first (clipping); 1: exact
  void* copy_out = nullptr;  // (n) bf16 or fp16 bits of the updated p, or null
  CopyType copy_type = CopyType::kNone;
  size_t n = 0;
  int64_t step = 1;
  // Out of place (all three or none): the updated p, m, v go here and p, m, v are only
  // read (STV's double buffer). The arrays must not overlap the inputs partially.
  float* p_out = nullptr;
  float* m_out = nullptr;
  float* v_out = nullptr;
};

// The per-step scalars of Note [AdamW operation order]: computed in double once per call
// and rounded to float, so the scalar and SIMD paths see the same bits. Checks hp and step.
struct AdamWStepScalars {
  float step_size;        // lr / bc1
  float inv_sqrt_bc2;     // 1 / sqrt(bc2)
  float decay;            // 1 - lr * weight_decay
  float beta1;            // beta1
  float one_minus_beta1;  // 1 - beta1
  float beta2;            // beta2
  float one_minus_beta2;  // 1 - beta2
  float eps;              // eps
};
AdamWStepScalars adamw_step_scalars(const AdamWParams& hp, int64_t step);
// Throws spillway::Error when the pointers of `a` do not fit its n and options (every
// step checks its arguments with it).
void check_adamw_args(const AdamWArgs& a);

// The scalar reference: one thread, plain loops, same arithmetic as the SIMD path.
void adamw_step_scalar(const AdamWParams& hp, const AdamWArgs& a);

// The SIMD step on the calling thread (the best target the CPU supports).
void adamw_step_simd(const AdamWParams& hp, const AdamWArgs& a);
// The name of the target the dispatch picked, e.g. "AVX3" or "AVX2", "SVE", "NEON".
const char* adamw_simd_target();
// For tests: the names of the targets compiled in that this CPU supports, best first
// (e.g. "AVX3", "AVX2", "SSE4", "EMU128"), and making adamw_step_simd use one of them
// (nullptr: the best again). Returns false for a name not in the list. Not thread-safe:
// no step may run concurrently.
std::vector<std::string> adamw_simd_targets();
bool adamw_simd_force_target(const char* name);

// All cores: the SIMD step tiled across a thread pool created once (threads bound to the
// NUMA node `numa_node` when the machine has several; -1: no binding).
class AdamW {
 public:
  explicit AdamW(int threads = 0, int numa_node = -1);  // threads 0: hardware concurrency
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  void step(const AdamWParams& hp, const AdamWArgs& a);
  int threads() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// bf16 (round to nearest even, NaN kept NaN) and fp16 conversions used by the copies. The
// bf16 ones are inline: loops over them vectorize.
inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
uint16_t float_to_fp16(float x);
float fp16_to_float(uint16_t h);

}  // namespace spillway::optim

// hybrid_gemm_on_device (spillway/hybrid_gemm.hpp): the problem checked as on the host, then
// the device's HybridGEMM operation (Note [HybridGEMM as a device operation]).
#include <fmt/format.h>

#include <string>

#include "spillway/hybrid_gemm.hpp"

namespace spillway {

bool hybrid_gemm_on_device(Device& device, const HybridGemmProblem& p, const float* x,
                           const void* w, float* o, Stream s, std::string* why) {
  const HybridGemmTraffic t = hybrid_gemm_traffic(p);  // checks the problem
  DeviceHybridGemm a;
  a.m = p.m;
  a.n = p.n;
  a.k = p.k;
  a.n_symmetric = t.n_symmetric;
  a.w_bf16 = p.w_dtype == DType::kBf16;
  a.symmetric = {p.symmetric.m, p.symmetric.n, p.symmetric.k};
  a.asymmetric = {p.asymmetric.m, p.asymmetric.n, p.asymmetric.k};
  a.x = x;
  a.w = w;
  a.o = o;
  if (device.hybrid_gemm(a, s)) return true;
  if (why != nullptr)
    *why = fmt::format(
        "{} has no HybridGEMM operation (the host backend computes it with "
        "hybrid_gemm_host)",
        device.name());
  return false;
}

}  // namespace spillway

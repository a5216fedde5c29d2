// The optimizer-offload pipeline on the CUDA backend: both cast sites (the device one
// through the widening kernel) and the GPU/CPU split (the norm-lane and AdamW kernels)
// bitwise the non-speculative optimizer. GPU only: without a
// CUDA device it skips and says why.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "spillway/optim/optim.hpp"

namespace spillway::optim {
namespace {

TEST(OptimizerOffloadCuda, CastSitesAndSplitsMatchTheNonSpeculativeOptimizer) {
  std::string why;
  std::unique_ptr<Device> dev = make_cuda_device(0, &why);
  if (!dev) GTEST_SKIP() << why;
  const std::vector<Bucket> buckets = {{0, 4000}, {4000, 6001}, {10001, 1999}};
  const size_t n = 12000;
  std::mt19937 g(11);
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<float> w0(n);
  for (float& x : w0) x = d(g);
  AdamWParams hp;
  for (int variant = 0; variant < 4; ++variant) {
    const CastSite site = variant % 2 == 0 ? CastSite::kDevice : CastSite::kHost;
    const int split = variant / 2 == 0 ? 0 : (variant == 2 ? 1 : 3);
    SCOPED_TRACE(testing::Message() << "site " << static_cast<int>(site) << " split " << split);
    const Stream compute = dev->create_stream(StreamRole::kCompute);
    {  // the pipeline goes before the stream it was given (it synchronizes it when it goes)
      OptimOffloadOptions o;
      o.hp = hp;
      o.cast = site;
      o.device_buckets = split;
      OptimizerOffload off(*dev, compute, w0.data(), n, buckets, o);
      std::vector<float> p = w0, m(n, 0.0f), v(n, 0.0f);
      int64_t step = 0;
      for (int s = 0; s < 5; ++s) {
        std::vector<uint16_t> g16(n);
        std::normal_distribution<float> gd(0.0f, s == 2 ? 1.0f : 1e-3f);  // step 2 clips
        for (uint16_t& x : g16) x = float_to_bf16(gd(g));
        dev->synchronize(compute);
        ASSERT_EQ(cudaMemcpy(off.device_grads(), g16.data(), n * 2, cudaMemcpyHostToDevice),
                  cudaSuccess);
        for (int b = static_cast<int>(buckets.size()) - 1; b >= 0; --b) off.on_bucket_grad(b);
        off.end_step();
        std::vector<float> g32(n);
        for (size_t i = 0; i < n; ++i) g32[i] = bf16_to_float(g16[i]);
        reference_adamw_step(hp, o.clip, p.data(), m.data(), v.data(), g32.data(), buckets, &step);
        const OptimState st = off.read_state();
        ASSERT_EQ(std::memcmp(st.p.data(), p.data(), n * 4), 0) << "step " << s;
        ASSERT_EQ(std::memcmp(st.m.data(), m.data(), n * 4), 0) << "step " << s;
        ASSERT_EQ(std::memcmp(st.v.data(), v.data(), n * 4), 0) << "step " << s;
      }
      dev->synchronize(compute);
      std::vector<uint16_t> w(n);
      ASSERT_EQ(cudaMemcpy(w.data(), off.device_weights(), n * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(w[i], float_to_bf16(p[i])) << i;
    }
    dev->destroy_stream(compute);
  }
}

}  // namespace
}  // namespace spillway::optim

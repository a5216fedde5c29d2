// spillway::optim::SpeculativeCpuAdamW (Note [Speculative CPU AdamW over parameters]), the CPU
// path of spillway.torch's CPUAdamW, from C++: speculative or not, fp32 and bf16 parameters,
// early weights, a clip and an abort, bitwise the non-speculative reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "spillway/core/error.hpp"
#include "spillway/optim/optim.hpp"

namespace spillway::optim {
namespace {

TEST(SpeculativeCpuAdamW, StepsBitwiseTheReferenceSpeculativeOrNotWithEarlyWeights) {
  const std::vector<int64_t> sizes = {300, 1000, 77};
  const std::vector<Bucket> buckets = {{0, 300}, {300, 1000}, {1300, 77}};
  const size_t n = 1377;
  std::mt19937 g(4);
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<float> w0(n);
  for (float& x : w0) x = d(g);
  for (bool speculative : {true, false}) {
    for (bool early : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "speculative " << speculative << " early " << early);
      SpeculativeCpuAdamW opt(sizes, 1.0, speculative, 2);
      std::vector<float> w = w0;  // the "parameters", one flat array
      for (size_t b = 0; b < buckets.size(); ++b)
        opt.load_weights(static_cast<int>(b), w.data() + buckets[b].offset, ParamDtype::kFp32);
      std::vector<float> p = w0, m(n, 0.0f), v(n, 0.0f);
      int64_t step = 0;
      AdamWParams hp;
      // Steps 1 and 2 clip; Note [Speculation after a clip]: steps 2 and 3 run with
      // speculation off (after a clip), step 4 speculates again and meets a NaN (skip), with
      // the early weights written and restored; step 5 speculates.
      for (int s = 0; s < 6; ++s) {
        std::vector<float> grad(n);
        std::normal_distribution<float> gd(0.0f, s == 1 || s == 2 ? 1.0f : 1e-3f);
        for (float& x : grad) x = gd(g);
        if (s == 4) grad[400] = std::nanf("");
        for (int b = static_cast<int>(buckets.size()) - 1; b >= 0; --b)
          opt.grad_ready(b, grad.data() + buckets[static_cast<size_t>(b)].offset, ParamDtype::kFp32,
                         early ? w.data() + buckets[static_cast<size_t>(b)].offset : nullptr);
        const CpuStepResult r = opt.finish();
        std::vector<void*> dst;
        for (const Bucket& k : buckets) dst.push_back(w.data() + k.offset);
        opt.store_all(dst, std::vector<ParamDtype>(buckets.size(), ParamDtype::kFp32));
        const StvOutcome want = reference_adamw_step(hp, 1.0, p.data(), m.data(), v.data(),
                                                     grad.data(), buckets, &step);
        EXPECT_EQ(r.outcome, want) << "step " << s;
        ASSERT_EQ(std::memcmp(w.data(), p.data(), n * sizeof(float)), 0) << "step " << s;
      }
      EXPECT_EQ(opt.counters().replays, 2);
      EXPECT_EQ(opt.counters().skips, 1);
      EXPECT_EQ(opt.counters().unspeculated_steps, speculative ? 2 : 0);
      // A step abandoned after its hand-over changes nothing (early weights restored).
      std::vector<float> grad(n, 0.5f);
      for (int b = 0; b < 3; ++b)
        opt.grad_ready(b, grad.data() + buckets[static_cast<size_t>(b)].offset, ParamDtype::kFp32,
                       early ? w.data() + buckets[static_cast<size_t>(b)].offset : nullptr);
      EXPECT_GT(opt.arrived_sum_of_squares(), 0.0);
      opt.abort();
      ASSERT_EQ(std::memcmp(w.data(), p.data(), n * sizeof(float)), 0) << "after abort";
      EXPECT_EQ(opt.step(), step);
    }
  }
}

TEST(SpeculativeCpuAdamW, Bf16ParametersGetTheRoundedMaster) {
  SpeculativeCpuAdamW opt({64}, 0.0, true, 1);
  std::vector<uint16_t> w(64);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float_to_bf16(0.01f * static_cast<float>(i));
  opt.load_weights(0, w.data(), ParamDtype::kBf16);
  std::vector<uint16_t> g(64, float_to_bf16(0.25f));
  opt.grad_ready(0, g.data(), ParamDtype::kBf16);
  EXPECT_EQ(opt.finish().outcome, StvOutcome::kCommit);
  opt.store_weights(0, w.data(), ParamDtype::kBf16);
  std::vector<float> p(64), m(64), v(64);
  opt.read_state(0, p.data(), m.data(), v.data());
  for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(w[i], float_to_bf16(p[i])) << i;
}

TEST(SpeculativeCpuAdamW, BadInputIsNamed) {
  EXPECT_THROW(SpeculativeCpuAdamW({}, 0.0, true, 1), Error);
  EXPECT_THROW(SpeculativeCpuAdamW({4, 0}, 0.0, true, 1), InputError);
  EXPECT_THROW(SpeculativeCpuAdamW({4}, 0.0, true, -1), InputError);
}

}  // namespace
}  // namespace spillway::optim

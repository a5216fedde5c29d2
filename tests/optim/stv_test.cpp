// Speculation-then-validation against the non-speculative optimizer: bitwise identical
// weights and moments after every step over 1,000 steps of random gradient streams with
// no clipping, clipping, and NaN/Inf in random buckets; any GPU/CPU split the same.
#include "optim/stv.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "spillway/error.hpp"

namespace spillway::optim {
namespace {

struct State {
  std::vector<float> p, m, v;
  explicit State(size_t n, uint32_t seed) : p(n), m(n, 0.0f), v(n, 0.0f) {
    std::mt19937 g(seed);
    std::normal_distribution<float> d(0.0f, 0.05f);
    for (float& x : p) x = d(g);
  }
  bool operator==(const State& o) const {
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
    };
    return same(p, o.p) && same(m, o.m) && same(v, o.v);
  }
};

std::vector<Bucket> random_buckets(size_t n, int count, std::mt19937& g) {
  std::vector<size_t> cuts = {0, n};
  while (static_cast<int>(cuts.size()) < count + 1) cuts.push_back(1 + g() % (n - 1));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<Bucket> out;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) out.push_back({cuts[i], cuts[i + 1] - cuts[i]});
  return out;
}

TEST(Stv, BitwiseIdenticalToTheNonSpeculativeOptimizerOver1000Steps) {
  const uint32_t seed = 4242;
  std::cout << "seed " << seed << "\n";
  std::mt19937 g(seed);
  const size_t n = 5003;
  const std::vector<Bucket> buckets = random_buckets(n, 8, g);
  const int nb = static_cast<int>(buckets.size());
  AdamWParams hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.1;
  const double clip = 1.0;
  AdamW pool(2);
  for (int device : {0, 1, 3, nb}) {
    SCOPED_TRACE(device);
    State ref(n, seed), spec(n, seed);
    int64_t ref_step = 0;
    StvAdamW stv(hp, clip, spec.p.data(), spec.m.data(), spec.v.data(), n, buckets, device,
                 device == 1 ? nullptr : &pool);
    std::vector<float> grad(n);
    int outcomes[3] = {0, 0, 0};
    for (int step = 0; step < 1000; ++step) {
      // Regimes: small gradients (commit), large ones (clip: replay), a NaN or Inf in a
      // random bucket (skip).
      const auto regime = g() % 10;
      const float sigma = regime < 6 ? 1e-3f : 0.5f;
      std::normal_distribution<float> d(0.0f, sigma);
      for (float& x : grad) x = d(g);
      if (regime == 9) {
        const Bucket& b = buckets[g() % buckets.size()];
        grad[b.offset + g() % b.n] = (g() % 2 == 0) ? std::numeric_limits<float>::quiet_NaN()
                                                    : std::numeric_limits<float>::infinity();
      }
      const StvOutcome want = reference_adamw_step(hp, clip, ref.p.data(), ref.m.data(),
                                                   ref.v.data(), grad.data(), buckets, &ref_step);
      // Backward delivers the last bucket first; now and then in a shuffled order.
      std::vector<int> order(static_cast<size_t>(nb));
      for (int b = 0; b < nb; ++b) order[static_cast<size_t>(b)] = nb - 1 - b;
      if (step % 7 == 0) std::shuffle(order.begin(), order.end(), g);
      for (int b : order) stv.on_bucket(b, grad.data() + buckets[static_cast<size_t>(b)].offset);
      const StvOutcome got = stv.finish();
      ASSERT_EQ(got, want) << "step " << step;
      ASSERT_TRUE(spec == ref) << "state differs after step " << step;
      ASSERT_EQ(stv.step(), ref_step);
      ++outcomes[static_cast<int>(got)];
    }
    EXPECT_GT(outcomes[0], 100);  // commits
    EXPECT_GT(outcomes[1], 100);  // replays (clipped)
    EXPECT_GT(outcomes[2], 30);   // skips (NaN/Inf)
    EXPECT_EQ(stv.counters().commits, outcomes[0]);
    EXPECT_EQ(stv.counters().replays, outcomes[1]);
    EXPECT_EQ(stv.counters().skips, outcomes[2]);
    EXPECT_TRUE(std::isfinite(spec.m[0]) && std::isfinite(spec.v[0]));
  }
}

TEST(Stv, UndoMemoryCoversOnlyTheSpeculativeBuckets) {
  std::vector<float> p(100), m(100), v(100);
  const std::vector<Bucket> buckets = {{0, 10}, {10, 30}, {40, 60}};
  AdamWParams hp;
  StvAdamW all(hp, 1.0, p.data(), m.data(), v.data(), 100, buckets, 0, nullptr);
  EXPECT_EQ(all.undo_bytes(), 100 * 12);
  StvAdamW split(hp, 1.0, p.data(), m.data(), v.data(), 100, buckets, 2, nullptr);
  EXPECT_EQ(split.undo_bytes(), 60 * 12);  // buckets 0 and 1 stay on the device
}

TEST(Stv, MisuseIsAnError) {
  std::vector<float> p(100), m(100), v(100), g(100, 0.0f);
  AdamWParams hp;
  EXPECT_THROW(
      StvAdamW(hp, 1.0, p.data(), m.data(), v.data(), 100, {{0, 10}, {20, 80}}, 0, nullptr),
      Error);  // a gap
  EXPECT_THROW(StvAdamW(hp, 1.0, p.data(), m.data(), v.data(), 100, {{0, 100}}, 2, nullptr),
               Error);  // more device buckets than buckets
  StvAdamW s(hp, 1.0, p.data(), m.data(), v.data(), 100, {{0, 50}, {50, 50}}, 0, nullptr);
  s.on_bucket(1, g.data() + 50);
  EXPECT_THROW(s.on_bucket(1, g.data() + 50), Error);  // twice
  EXPECT_THROW(s.finish(), Error);                     // bucket 0 missing
}

}  // namespace
}  // namespace spillway::optim

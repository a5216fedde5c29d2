// Speculation-then-validation against the non-speculative optimizer: bitwise identical
// weights and moments after every step over 1,000 steps of random gradient streams with
// no clipping, clipping, and NaN/Inf in random buckets; any GPU/CPU split and any undo
// memory limit the same.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "spillway/core/error.hpp"
#include "spillway/optim/optim.hpp"

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

// The caller's part of the split: the device buckets' sums of squares go in as they
// arrive, and after finish() they step with STV's scale and step counter.
void deliver(StvAdamW& stv, int device, const std::vector<Bucket>& buckets, const float* grad,
             int b) {
  const Bucket& k = buckets[static_cast<size_t>(b)];
  if (b < device) {
    stv.on_device_bucket(b, bucket_sum_of_squares(grad + k.offset, k.n));
  } else {
    stv.on_bucket(b, grad + k.offset);
  }
}

void step_device_buckets(const AdamWParams& hp, const StvAdamW& stv, StvOutcome outcome, int device,
                         const std::vector<Bucket>& buckets, State& s, const float* grad) {
  if (outcome == StvOutcome::kSkip) return;
  for (int b = 0; b < device; ++b) {
    const Bucket& k = buckets[static_cast<size_t>(b)];
    AdamWArgs a;
    a.p = s.p.data() + k.offset;
    a.m = s.m.data() + k.offset;
    a.v = s.v.data() + k.offset;
    a.g = grad + k.offset;
    a.grad_scale = stv.last_scale();
    a.n = k.n;
    a.step = stv.step();
    adamw_step_scalar(hp, a);
  }
}

// The state as STV holds it: CPU buckets from their current buffer (Note [Bounded undo]),
// device buckets from the caller's arrays (the test steps them there).
State current(const StvAdamW& stv, const State& arrays, int device,
              const std::vector<Bucket>& buckets) {
  State out = arrays;
  for (int b = device; b < static_cast<int>(buckets.size()); ++b) {
    const Bucket& k = buckets[static_cast<size_t>(b)];
    const StvAdamW::BucketState st = stv.state(b);
    std::memcpy(out.p.data() + k.offset, st.p, k.n * sizeof(float));
    std::memcpy(out.m.data() + k.offset, st.m, k.n * sizeof(float));
    std::memcpy(out.v.data() + k.offset, st.v, k.n * sizeof(float));
  }
  return out;
}

struct Variant {
  int device;          // GPU/CPU split
  int64_t undo_limit;  // bytes; < 0 unbounded
};

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
  // Splits of 0, 1, 3 and every bucket; undo memory for all, about half, and none of the
  // CPU buckets (Note [Bounded undo]).
  const std::vector<Variant> variants = {
      {0, -1}, {1, -1}, {3, -1}, {nb, -1}, {0, static_cast<int64_t>(n) * 6}, {2, 0}};
  for (const Variant& var : variants) {
    const int device = var.device;
    SCOPED_TRACE(testing::Message() << "device " << device << " undo limit " << var.undo_limit);
    State ref(n, seed), spec(n, seed);
    int64_t ref_step = 0;
    StvAdamW stv(hp, clip, spec.p.data(), spec.m.data(), spec.v.data(), n, buckets, device,
                 device == 1 ? nullptr : &pool, var.undo_limit);
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
      for (int b : order) deliver(stv, device, buckets, grad.data(), b);
      const StvOutcome got = stv.finish();
      step_device_buckets(hp, stv, got, device, buckets, spec, grad.data());
      ASSERT_EQ(got, want) << "step " << step;
      ASSERT_TRUE(current(stv, spec, device, buckets) == ref)
          << "state differs after step " << step;
      ASSERT_EQ(stv.step(), ref_step);
      ++outcomes[static_cast<int>(got)];
    }
    EXPECT_GT(outcomes[0], 100);  // commits
    EXPECT_GT(outcomes[1], 100);  // replays (clipped)
    EXPECT_GT(outcomes[2], 30);   // skips (NaN/Inf)
    EXPECT_EQ(stv.counters().commits, outcomes[0]);
    EXPECT_EQ(stv.counters().replays, outcomes[1]);
    EXPECT_EQ(stv.counters().skips, outcomes[2]);
    if (var.undo_limit == 0 && device < nb) {
      EXPECT_EQ(stv.counters().deferred, 1000 * (nb - device));  // every CPU bucket, always
    } else if (var.undo_limit > 0) {
      EXPECT_GT(stv.counters().deferred, 0);
      EXPECT_LT(stv.counters().deferred, 1000 * nb);
    } else {
      EXPECT_EQ(stv.counters().deferred, 0);
    }
    const State last = current(stv, spec, device, buckets);
    EXPECT_TRUE(std::isfinite(last.m[0]) && std::isfinite(last.v[0]));
  }
}

TEST(Stv, LimitedUndoMemoryGoesToTheBucketsInDeliveryOrder) {
  std::vector<float> p(100, 0.5f), m(100), v(100), g(100, 1e-3f);
  const std::vector<Bucket> buckets = {{0, 10}, {10, 30}, {40, 60}};
  AdamWParams hp;
  // Backward delivers 2, 1, 0: room for bucket 2 (60 elements, 64 with their padding to
  // kStateAlignFloats) and then bucket 0 (10, 16 padded), not for bucket 1 (30, 32) in
  // between.
  static_assert(kStateAlignFloats == 16);
  StvAdamW s(hp, 1.0, p.data(), m.data(), v.data(), 100, buckets, 0, nullptr, int64_t{84} * 12);
  EXPECT_EQ(s.undo_bytes(), (64 + 16) * 12);
  EXPECT_TRUE(s.admit(2));
  EXPECT_FALSE(s.admit(1));
  EXPECT_TRUE(s.admit(0));
  for (int b : {2, 1, 0}) s.on_bucket(b, g.data() + buckets[static_cast<size_t>(b)].offset);
  // Out of place: until finish() every bucket's current state is the old one.
  EXPECT_EQ(s.state(2).p[0], 0.5f);
  EXPECT_EQ(s.state(1).p[0], 0.5f);
  EXPECT_EQ(s.finish(), StvOutcome::kCommit);
  EXPECT_NE(s.state(2).p[0], 0.5f);
  EXPECT_NE(s.state(1).p[0], 0.5f);
  EXPECT_NE(s.state(2).p, p.data() + 40) << "a committed bucket lives in its second buffer";
  EXPECT_EQ(s.state(1).p, p.data() + 10) << "a deferred one steps in place";
  EXPECT_TRUE(s.stepped_late(1));
  EXPECT_FALSE(s.stepped_late(0));
  EXPECT_FALSE(s.stepped_late(2));
  EXPECT_EQ(s.counters().deferred, 1);
  // Fixed at construction: the next step the same.
  EXPECT_TRUE(s.admit(2));
  EXPECT_FALSE(s.admit(1));
  EXPECT_TRUE(s.admit(0));
  // A second commit brings bucket 2 back to the caller's array.
  for (int b : {2, 1, 0}) s.on_bucket(b, g.data() + buckets[static_cast<size_t>(b)].offset);
  EXPECT_EQ(s.finish(), StvOutcome::kCommit);
  EXPECT_EQ(s.state(2).p, p.data() + 40);
}

TEST(Stv, NormLanesAddUpInTheirDocumentedOrder) {
  // Note [Norm lanes]: lane c holds elements c, c + kNormLanes, ...; fp32 and bf16 agree.
  const size_t n = 2 * kNormLanes + 7;
  std::vector<float> g(n);
  std::vector<uint16_t> g16(n);
  std::mt19937 r(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    g16[i] = float_to_bf16(d(r));
    g[i] = bf16_to_float(g16[i]);
  }
  std::vector<double> lanes(kNormLanes), lanes16(kNormLanes);
  norm_lane_sums(g.data(), n, lanes.data());
  norm_lane_sums_bf16(g16.data(), n, lanes16.data());
  for (size_t c : {size_t{0}, size_t{6}, size_t{7}, kNormLanes - 1}) {
    double want = 0.0;
    for (size_t i = c; i < n; i += kNormLanes) want += static_cast<double>(g[i]) * g[i];
    EXPECT_EQ(lanes[c], want) << "lane " << c;
  }
  EXPECT_EQ(lanes, lanes16);  // doubles of finite sums: == is bitwise here
  double total = 0.0;
  for (double x : lanes) total += x;
  EXPECT_EQ(add_lane_sums(lanes.data(), n), total);
  EXPECT_EQ(bucket_sum_of_squares(g.data(), n), total);
  // A bucket shorter than the lanes uses only its own.
  std::vector<double> few(5);
  norm_lane_sums(g.data(), 5, few.data());
  EXPECT_EQ(add_lane_sums(few.data(), 5), bucket_sum_of_squares(g.data(), 5));
}

// Note [Clips the speculation saw]: before finish(), the sum over the buckets arrived so
// far; once all have arrived (an absent one adds 0) it is sum_of_squares(), bitwise.
TEST(Stv, ArrivedSumOfSquaresIsTheSumSoFar) {
  std::vector<float> p(100), m(100), v(100), g(100);
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.01f * static_cast<float>(i) - 0.3f;
  const std::vector<Bucket> buckets = {{0, 10}, {10, 30}, {40, 60}};
  StvAdamW s(AdamWParams{}, 0.0, p.data(), m.data(), v.data(), 100, buckets, 0, nullptr);
  EXPECT_EQ(s.arrived_sum_of_squares(), 0.0);
  s.on_bucket(2, g.data() + 40);
  EXPECT_EQ(s.arrived_sum_of_squares(), bucket_sum_of_squares(g.data() + 40, 60));
  EXPECT_THROW(s.sum_of_squares(), Error);  // not all arrived
  s.on_bucket(0, g.data());
  s.on_absent_bucket(1);
  EXPECT_EQ(s.arrived_sum_of_squares(), s.sum_of_squares());
  EXPECT_EQ(s.arrived_sum_of_squares(),
            bucket_sum_of_squares(g.data(), 10) + bucket_sum_of_squares(g.data() + 40, 60));
  s.abort();
  EXPECT_EQ(s.arrived_sum_of_squares(), 0.0);  // the next step starts from nothing
}

// Note [Weights shared with the parameters]: each CPU bucket's two weight buffers and which
// is current, as a caller whose parameters view them follows it: a speculated commit moves
// to the other buffer; a deferred step writing no copy stays in place, one writing a copy
// (an early destination) goes out of place. Every step bitwise the reference.
TEST(Stv, WeightBuffersSayWhereTheCurrentWeightsAre) {
  const size_t n = 100;
  const std::vector<Bucket> buckets = {{0, 40}, {40, 60}};
  State arrays(n, 7);
  State ref = arrays;
  int64_t ref_step = 0;
  AdamWParams hp;
  StvAdamW stv(hp, 0.0, arrays.p.data(), arrays.m.data(), arrays.v.data(), n, buckets, 1, nullptr);
  EXPECT_THROW((void)stv.weight_buffers(0), Error);  // a device bucket's are the caller's
  EXPECT_THROW((void)stv.current_buffer(0), Error);
  const auto [first, second] = stv.weight_buffers(1);
  EXPECT_EQ(first, arrays.p.data() + 40);
  ASSERT_NE(second, nullptr);
  std::vector<float> grad(n), copy(60);
  std::mt19937 g(3);
  std::normal_distribution<float> d(0.0f, 0.01f);
  auto step = [&](bool speculate, void* early) {
    for (float& x : grad) x = d(g);
    stv.set_speculation(speculate);
    stv.on_device_bucket(0, bucket_sum_of_squares(grad.data(), 40));
    stv.on_bucket(1, grad.data() + 40, early);
    ASSERT_EQ(stv.finish(), StvOutcome::kCommit);
    ASSERT_EQ(reference_adamw_step(hp, 0.0, ref.p.data(), ref.m.data(), ref.v.data(), grad.data(),
                                   buckets, &ref_step),
              StvOutcome::kCommit);
    const float* p = stv.state(1).p;
    EXPECT_EQ(p, stv.current_buffer(1) == 0 ? first : second);
    EXPECT_EQ(std::memcmp(p, ref.p.data() + 40, 60 * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(stv.state(1).m, ref.m.data() + 40, 60 * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(stv.state(1).v, ref.v.data() + 40, 60 * sizeof(float)), 0);
  };
  EXPECT_EQ(stv.current_buffer(1), 0);
  step(true, nullptr);  // speculated into the second buffer, committed: it is current
  EXPECT_EQ(stv.current_buffer(1), 1);
  step(false, nullptr);  // deferred, no copy: in place, where it was
  EXPECT_EQ(stv.current_buffer(1), 1);
  step(false, copy.data());  // deferred with a copy: out of place (streamed), the first again
  EXPECT_EQ(stv.current_buffer(1), 0);
  EXPECT_EQ(std::memcmp(copy.data(), ref.p.data() + 40, 60 * sizeof(float)), 0);
  step(true, nullptr);
  EXPECT_EQ(stv.current_buffer(1), 1);
}

TEST(Stv, UndoMemoryCoversOnlyTheSpeculativeBuckets) {
  std::vector<float> p(100), m(100), v(100);
  const std::vector<Bucket> buckets = {{0, 10}, {10, 30}, {40, 60}};
  AdamWParams hp;
  StvAdamW all(hp, 1.0, p.data(), m.data(), v.data(), 100, buckets, 0, nullptr);
  EXPECT_EQ(all.undo_bytes(), (16 + 32 + 64) * 12);  // each padded to kStateAlignFloats
  StvAdamW split(hp, 1.0, p.data(), m.data(), v.data(), 100, buckets, 2, nullptr);
  EXPECT_EQ(split.undo_bytes(), 64 * 12);  // buckets 0 and 1 stay on the device
}

TEST(Stv, MisuseIsAnError) {
  std::vector<float> p(100), m(100), v(100), g(100, 0.0f);
  AdamWParams hp;
  EXPECT_THROW(
      StvAdamW(hp, 1.0, p.data(), m.data(), v.data(), 100, {{0, 30}, {20, 80}}, 0, nullptr),
      Error);  // an overlap
  EXPECT_THROW(
      StvAdamW(hp, 1.0, p.data(), m.data(), v.data(), 100, {{0, 50}, {64, 40}}, 0, nullptr),
      Error);  // past the state
  // A gap is allowed (the CPU path pads each bucket's start to kStateAlignFloats).
  EXPECT_NO_THROW(
      StvAdamW(hp, 1.0, p.data(), m.data(), v.data(), 100, {{0, 10}, {16, 80}}, 0, nullptr));
  EXPECT_THROW(StvAdamW(hp, 1.0, p.data(), m.data(), v.data(), 100, {{0, 100}}, 2, nullptr),
               Error);  // more device buckets than buckets
  StvAdamW s(hp, 1.0, p.data(), m.data(), v.data(), 100, {{0, 50}, {50, 50}}, 0, nullptr);
  s.on_bucket(1, g.data() + 50);
  EXPECT_THROW(s.on_bucket(1, g.data() + 50), Error);  // twice
  EXPECT_THROW(s.on_device_bucket(0, 1.0), Error);     // not a device bucket
  EXPECT_THROW(s.finish(), Error);                     // bucket 0 missing
  StvAdamW split(hp, 1.0, p.data(), m.data(), v.data(), 100, {{0, 50}, {50, 50}}, 1, nullptr);
  EXPECT_THROW(split.on_bucket(0, g.data()), Error);  // a device bucket
  EXPECT_THROW(split.admit(0), Error);
}

}  // namespace

// Note [Per-bucket hyperparameters and steps]: two buckets with their own learning rates
// and weight decays step as two separate reference optimizers would (no clipping: the norm
// couples nothing); a bucket absent in a step keeps its state and its counter, and steps
// at its own count afterwards; a NaN in one bucket skips every bucket.
TEST(Stv, BucketsKeepTheirOwnHyperparametersAndStepCounters) {
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t na = 1000;
  const size_t nb = 700;
  const size_t n = na + nb;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  for (float& x : p) x = nd(rng);
  std::vector<float> ra(p.begin(), p.begin() + na), ma(na, 0.0f), va(na, 0.0f);
  std::vector<float> rb(p.begin() + na, p.end()), mb(nb, 0.0f), vb(nb, 0.0f);
  AdamWParams ha;
  ha.lr = 1e-2;
  ha.weight_decay = 0.1;
  AdamWParams hb;
  hb.lr = 3e-3;
  hb.weight_decay = 0.0;
  hb.beta2 = 0.99;
  StvAdamW stv(ha, 0.0, p.data(), m.data(), v.data(), n, {{0, na}, {na, nb}}, 0, nullptr);
  stv.set_hparams(1, hb);
  int64_t step_a = 0;
  int64_t step_b = 0;
  for (int s = 0; s < 6; ++s) {
    std::vector<float> g(n);
    for (float& x : g) x = nd(rng);
    const bool b_absent = s == 2;
    const bool nan = s == 4;
    if (nan) g[3] = std::numeric_limits<float>::quiet_NaN();
    if (b_absent) {
      stv.on_absent_bucket(1);
    } else {
      stv.on_bucket(1, g.data() + na);
    }
    stv.on_bucket(0, g.data());
    const StvOutcome out = stv.finish();
    if (nan) {
      EXPECT_EQ(out, StvOutcome::kSkip);
    } else {
      reference_adamw_step(ha, 0.0, ra.data(), ma.data(), va.data(), g.data(), {{0, na}}, &step_a);
      if (!b_absent) {
        reference_adamw_step(hb, 0.0, rb.data(), mb.data(), vb.data(), g.data() + na, {{0, nb}},
                             &step_b);
      }
    }
    const auto a = stv.state(0);
    const auto b = stv.state(1);
    ASSERT_EQ(0, std::memcmp(a.p, ra.data(), na * sizeof(float))) << "step " << s;
    ASSERT_EQ(0, std::memcmp(a.m, ma.data(), na * sizeof(float))) << "step " << s;
    ASSERT_EQ(0, std::memcmp(b.p, rb.data(), nb * sizeof(float))) << "step " << s;
    ASSERT_EQ(0, std::memcmp(b.v, vb.data(), nb * sizeof(float))) << "step " << s;
    EXPECT_EQ(stv.bucket_step(0), step_a);
    EXPECT_EQ(stv.bucket_step(1), step_b);
  }
  EXPECT_EQ(stv.bucket_step(0), 5);
  EXPECT_EQ(stv.bucket_step(1), 4);
  EXPECT_EQ(stv.step(), 5);  // steps that were not skipped
  EXPECT_THROW(stv.set_bucket_step(0, -1), InputError);
  stv.on_bucket(0, p.data());
  EXPECT_THROW(stv.set_hparams(1, hb), Error);  // not during a step
}

// Note [Norm lanes]: the lanes dealt to a pool's workers sum to the same bits as on one
// thread, fp32 and bf16, for sizes that end inside a row and cover several rows.
TEST(Stv, NormLanesOnThePoolEqualTheOneThreadSums) {
  AdamW pool(3);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (const size_t n : {4 * kNormLanes, 5 * kNormLanes + 123, 9 * kNormLanes - 1}) {
    std::vector<float> g(n);
    std::vector<uint16_t> h(n);
    for (size_t i = 0; i < n; ++i) {
      g[i] = nd(rng);
      h[i] = float_to_bf16(g[i]);
    }
    std::vector<double> one(kNormLanes, -1.0), many(kNormLanes, -2.0);
    norm_lane_sums(g.data(), n, one.data());
    norm_lane_sums(&pool, g.data(), n, many.data());
    ASSERT_EQ(0, std::memcmp(one.data(), many.data(), kNormLanes * sizeof(double))) << n;
    norm_lane_sums_bf16(h.data(), n, one.data());
    norm_lane_sums_bf16(&pool, h.data(), n, many.data());
    ASSERT_EQ(0, std::memcmp(one.data(), many.data(), kNormLanes * sizeof(double))) << n;
  }
}

}  // namespace spillway::optim

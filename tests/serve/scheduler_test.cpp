// The serving scheduler (Note [Serving scheduler]) and the alpha controller (Note [Alpha
// controller]): routing to the active slice, placement under the link-demand and HBM
// checks, eviction of idle models only (lowest priority, then least recent), waiting
// rather than preempting, the prefill chunk from the profile table; the controller's
// direction, steps, dead band and its convergence on a plant whose utilizations respond to
// alpha (no ringing).
#include "spillway/serve/scheduler.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <utility>

#include "spillway/core/error.hpp"

namespace spillway {
namespace {

// S bytes, TPOT ms: S / TPOT in GB/s = S / (TPOT * 1e6).
ServedModel model(const std::string& name, int64_t gb, double tpot_ms, int priority = 0) {
  ServedModel m;
  m.name = name;
  m.weight_bytes = gb * 1'000'000'000;
  m.tpot_ms = tpot_ms;
  m.ttft_ms = 500.0;
  m.priority = priority;
  m.kv_bytes_per_token = 1000;
  // 128-token chunks take 40 ms, 512: 100 ms, 2048: 300 ms (and need more HBM).
  m.chunks = {{2048, 300.0, 2'000'000}, {128, 40.0, 100'000}, {512, 100.0, 500'000}};
  return m;
}

std::vector<SliceSpec> slices(int n, int64_t hbm = int64_t{12} << 30) {
  return std::vector<SliceSpec>(static_cast<size_t>(n), SliceSpec{"1g.12gb", hbm, 500.0, 1e5});
}

TEST(Scheduler, RoutesPlacesAndEvictsOnlyIdleModels) {
  // Link 400 GB/s; each model 8 GB at 40 ms per token: 200 GB/s of demand. Two fit.
  Scheduler s(slices(3), 400.0);
  for (const char* n : {"a", "b", "c"}) s.add_model(model(n, 8, 40.0));
  Placement a = s.place("a", 100, 10);
  EXPECT_EQ(a.outcome, PlaceOutcome::kPlaced);
  Placement a2 = s.place("a", 100, 10);
  EXPECT_EQ(a2.outcome, PlaceOutcome::kRouted);
  EXPECT_EQ(a2.slice, a.slice);
  Placement b = s.place("b", 100, 10);
  EXPECT_EQ(b.outcome, PlaceOutcome::kPlaced);
  EXPECT_NE(b.slice, a.slice);
  EXPECT_DOUBLE_EQ(s.link_demand_gbps(), 400.0);
  // A third active model would need 600 GB/s: c waits, though a slice is idle, and no
  // running request is preempted.
  Placement c = s.place("c", 100, 10);
  EXPECT_EQ(c.outcome, PlaceOutcome::kWait);
  EXPECT_NE(c.why.find("link demand would be 600.0 GB/s of 400.0"), std::string::npos) << c.why;
  // b finishes: idle on its slice, it streams nothing, so c fits beside a on the idle
  // slice; b stays resident for its next request.
  s.finish(b.slice, 100, 10);
  EXPECT_DOUBLE_EQ(s.link_demand_gbps(), 200.0);
  c = s.place("c", 100, 10);
  EXPECT_EQ(c.outcome, PlaceOutcome::kPlaced);
  EXPECT_NE(c.slice, b.slice);
  EXPECT_EQ(s.slices()[static_cast<size_t>(b.slice)].model, "b");
  EXPECT_EQ(s.slices()[static_cast<size_t>(a.slice)].running, 2);
  // Two slices, both running: a third model waits; when one finishes, its slice is taken.
  Scheduler t(slices(2), 1000.0);
  for (const char* n : {"a", "b", "c"}) t.add_model(model(n, 8, 40.0));
  (void)t.place("a", 100, 10);
  const Placement tb = t.place("b", 100, 10);
  Placement tc = t.place("c", 100, 10);
  EXPECT_EQ(tc.outcome, PlaceOutcome::kWait);
  EXPECT_NE(tc.why.find("requests running"), std::string::npos) << tc.why;
  t.finish(tb.slice, 100, 10);
  tc = t.place("c", 100, 10);
  EXPECT_EQ(tc.outcome, PlaceOutcome::kEvicted);
  EXPECT_EQ(tc.evicted, "b");
  EXPECT_EQ(tc.slice, tb.slice);
}

TEST(Scheduler, EvictsTheLowestPriorityThenTheLeastRecentlyUsed) {
  Scheduler s(slices(3), 1000.0);
  s.add_model(model("hi", 1, 10.0, 5));
  s.add_model(model("lo", 1, 10.0, 1));
  s.add_model(model("mid", 1, 10.0, 3));
  s.add_model(model("new", 1, 10.0, 0));
  for (const char* n : {"hi", "lo", "mid"}) {
    const Placement p = s.place(n, 10, 1);
    s.finish(p.slice, 10, 1);
  }
  Placement p = s.place("new", 10, 1);
  EXPECT_EQ(p.outcome, PlaceOutcome::kEvicted);
  EXPECT_EQ(p.evicted, "lo");
  s.finish(p.slice, 10, 1);
  // Equal priorities: the least recently used goes.
  Scheduler t(slices(2), 1000.0);
  for (const char* n : {"x", "y", "z"}) t.add_model(model(n, 1, 10.0));
  const Placement x = t.place("x", 10, 1);
  const Placement y = t.place("y", 10, 1);
  t.finish(y.slice, 10, 1);
  t.finish(x.slice, 10, 1);  // x used more recently than y
  const Placement z = t.place("z", 10, 1);
  EXPECT_EQ(z.evicted, "y");
}

TEST(Scheduler, ThePrefillChunkIsTheSmallestThatMeetsTheTtft) {
  Scheduler s(slices(1), 1000.0);
  s.add_model(model("m", 1, 10.0));
  // 1000 tokens: 128-chunks 8 x 40 = 320 ms <= 500: the smallest meets it.
  Placement p = s.place("m", 1000, 0);
  EXPECT_EQ(p.chunk_tokens, 128);
  EXPECT_DOUBLE_EQ(p.prefill_ms, 320.0);
  EXPECT_TRUE(p.meets_ttft);
  s.finish(p.slice, 1000, 0);
  // 3000 tokens: 128 -> 24 x 40 = 960; 512 -> 6 x 100 = 600; 2048 -> 2 x 300 = 600: none
  // meets 500 ms; the fastest that fits is taken (512: the first of the two at 600).
  p = s.place("m", 3000, 0);
  EXPECT_EQ(p.chunk_tokens, 512);
  EXPECT_FALSE(p.meets_ttft);
  s.finish(p.slice, 3000, 0);
  // A slice whose HBM leaves 600 KB beside the KV cache: the 2048-chunk does not fit.
  Scheduler small(slices(1, 1000 * 1000 + 600'000), 1000.0);
  small.add_model(model("m", 1, 10.0));
  p = small.place("m", 1000, 0);  // 1 MB of KV cache
  EXPECT_EQ(p.outcome, PlaceOutcome::kPlaced);
  EXPECT_EQ(p.chunk_tokens, 128);
  Placement q = small.place("m", 1000, 0);  // another 1 MB of KV does not fit: wait
  EXPECT_EQ(q.outcome, PlaceOutcome::kWait);
  EXPECT_NE(q.why.find("KV cache"), std::string::npos) << q.why;
}

TEST(Scheduler, AModelTooBigForTheLinkIsServedAloneRatherThanNever) {
  Scheduler s(slices(2), 100.0);
  s.add_model(model("huge", 140, 100.0));  // 1400 GB/s of demand on a 100 GB/s link
  s.add_model(model("small", 1, 100.0));
  const Placement h = s.place("huge", 10, 1);
  EXPECT_EQ(h.outcome, PlaceOutcome::kPlaced);
  EXPECT_EQ(s.place("small", 10, 1).outcome, PlaceOutcome::kWait);  // not beside it
  // Past its TTFT target the request is placed anyway (aging): the link is oversubscribed.
  EXPECT_EQ(s.place("small", 10, 1, /*overdue=*/true).outcome, PlaceOutcome::kPlaced);
}

TEST(Scheduler, TheAblationsIgnoreTheLinkAndTheTtft) {
  // Random placement: c goes to a free slice though the link cannot carry three models.
  SchedulerOptions o;
  o.random_placement = true;
  Scheduler s(slices(3), 400.0, o);
  for (const char* n : {"a", "b", "c"}) s.add_model(model(n, 8, 40.0));
  (void)s.place("a", 100, 10);
  (void)s.place("b", 100, 10);
  const Placement c = s.place("c", 100, 10);
  EXPECT_NE(c.outcome, PlaceOutcome::kWait);
  EXPECT_GT(s.link_demand_gbps(), 400.0);
  // Fixed chunk: 512 even when 128 meets the TTFT.
  SchedulerOptions f;
  f.fixed_chunk = 512;
  Scheduler t(slices(1), 1000.0, f);
  t.add_model(model("m", 1, 10.0));
  const Placement p = t.place("m", 1000, 0);
  EXPECT_EQ(p.chunk_tokens, 512);
  EXPECT_DOUBLE_EQ(p.prefill_ms, 200.0);
}

TEST(Scheduler, BadModelsAndRequestsNameTheField) {
  Scheduler s(slices(1), 100.0);
  ServedModel m = model("m", 1, 10.0);
  m.chunks.clear();
  EXPECT_THROW(s.add_model(m), InputError);
  s.add_model(model("m", 1, 10.0));
  EXPECT_THROW(s.add_model(model("m", 1, 10.0)), InputError);
  EXPECT_THROW((void)s.place("absent", 1, 1), InputError);
  EXPECT_THROW((void)s.place("m", 0, 1), InputError);
  EXPECT_THROW(Scheduler({}, 1.0), InputError);
}

TEST(AlphaController, MovesTowardTheLessLoadedSideAndStaysInTheDeadBand) {
  AlphaControllerOptions o;
  o.ema = 1.0;  // no smoothing: each update sees its own sample
  AlphaController c(o);
  EXPECT_EQ(c.alpha(), 0.0);
  EXPECT_DOUBLE_EQ(c.update(10.0, 0.9, 0.2), o.eta_slow);               // HBM busier: up, slowly
  EXPECT_DOUBLE_EQ(c.update(80.0, 0.9, 0.2), o.eta_slow + o.eta_fast);  // over budget: fast
  const double a = c.alpha();
  EXPECT_DOUBLE_EQ(c.update(10.0, 0.5, 0.55), a);  // |delta| < tau: unchanged
  EXPECT_LT(c.update(10.0, 0.2, 0.9), a);          // link busier: down
  AlphaController d(o);
  for (int i = 0; i < 100; ++i) d.update(100.0, 1.0, 0.0);
  EXPECT_EQ(d.alpha(), 1.0);  // clipped
  for (int i = 0; i < 100; ++i) d.update(100.0, 0.0, 1.0);
  EXPECT_EQ(d.alpha(), 0.0);
  EXPECT_THROW(AlphaController(AlphaControllerOptions{0.0}), InputError);
}

TEST(AlphaController, ConvergesOnAPlantWithoutRinging) {
  // A slice whose link utilization rises with alpha and HBM's falls: they balance at
  // alpha = 0.577. Latency is over budget away from the balance, so steps start fast.
  // (Without smoothing and with tau 0.02 the steps of 0.05 straddle the dead band: without
  // the halving on reversals alpha would ring between 0.55 and 0.60 for ever.)
  for (auto [tau, ema] : {std::pair{0.02, 1.0}, std::pair{0.02, 0.3}, std::pair{0.1, 0.3}}) {
    SCOPED_TRACE(::testing::Message() << "tau " << tau << ", ema " << ema);
    AlphaControllerOptions o;
    o.tau = tau;
    o.ema = ema;
    AlphaController c(o);
    double last = 0.0;
    int changes_late = 0;
    for (int i = 0; i < 300; ++i) {
      const double a = c.alpha();
      const double u_link = 0.25 + 0.8 * a, u_hbm = 1.0 - 0.5 * a;
      const double latency = 40.0 + 100.0 * std::fabs(u_link - u_hbm);
      const double next = c.update(latency, u_hbm, u_link);
      if (i >= 200 && next != last) ++changes_late;
      last = next;
    }
    const double balance = 0.75 / 1.3;
    EXPECT_NEAR(c.alpha(), balance, tau / 1.3 + 0.02);
    EXPECT_EQ(changes_late, 0) << "alpha still moving after 200 intervals";
    EXPECT_LE(c.reversals(), 12);
  }
}

}  // namespace
}  // namespace spillway

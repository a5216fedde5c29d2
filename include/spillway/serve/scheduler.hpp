// The serving scheduler and the alpha controller (docs/serve.md): pure logic, no clock
// and no device, so that the simulated replay and a live server run the same code.
//
// Note [Serving scheduler]: per request of model m with p prompt tokens,
//   1. m is active on a slice: route there;
//   2. else an idle slice (no model) takes it if the active set's link demand with m fits,
//      sum over the models with requests running of S / TPOT <= the link's bandwidth (S:
//      weight bytes; TPOT: the per-token target: every decode step reads all of S over the
//      link; a model on its slice with nothing running streams nothing), and the
//      slice's HBM holds the request's KV cache (a model whose demand alone exceeds the
//      link is placed when no other model is active: served late rather than never);
//   3. else a slice whose model has no request running is taken from it (eviction: the
//      lowest priority first, then the least recently used), under the same two checks
//      with the evicted model's demand gone;
//   4. else the request waits (kWait, with the reason): a running request is never
//      preempted or dropped.
// A request that has waited past its TTFT target (the caller says so: the scheduler has no
// clock) skips the link-demand check in 2 and 3: the link then carries more than its
// bandwidth, every active model's tokens slow down, and the waiting one is served.
// The prefill chunk: the smallest chunk of the model's profile table whose prefill time,
// ceil(p / chunk) chunks, meets the TTFT target and whose HBM need fits the slice; if none
// meets the target, the fastest that fits (and the placement says so).
//
// Note [Alpha controller]: every interval the runtime reports the latency L and the link
// and HBM utilizations; they are smoothed by an EMA. delta = U_link - U_hbm; when |delta|
// < tau alpha stays (the dead band is the guard against oscillating between two
// neighbours); otherwise alpha moves by eta_fast if the smoothed latency is over its
// budget, else eta_slow: down when the link is the more loaded (toward the weight-
// stationary path, which reads each weight once), up when HBM is; clipped to [0, 1]. A
// step that reverses the previous one's direction is halved (down to eta_min), so a
// controller straddling its balance point converges instead of ringing. Alpha starts at
// 0 (link-frugal). The runtime applies the new value only between layers or requests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/serve/slices.hpp"

namespace spillway {

struct ChunkCost {
  int64_t tokens = 0;     // prefill chunk size
  double ms = 0.0;        // one chunk's prefill time on the slice
  int64_t hbm_bytes = 0;  // device memory one chunk needs (activations)
};

struct ServedModel {
  std::string name;
  int64_t weight_bytes = 0;        // S
  double tpot_ms = 50.0;           // per-token target
  double ttft_ms = 1000.0;         // time-to-first-token target
  int priority = 0;                // higher keeps its slice longer
  int64_t kv_bytes_per_token = 0;  // KV cache per token of context
  std::vector<ChunkCost> chunks;   // the prefill profile (any order)
};

enum class PlaceOutcome {
  kRouted,   // the model is active on the slice
  kPlaced,   // on an idle slice
  kEvicted,  // on a slice taken from an idle model
  kWait,     // no slice now; retry when a request finishes
};
const char* to_string(PlaceOutcome o);

struct Placement {
  PlaceOutcome outcome = PlaceOutcome::kWait;
  int slice = -1;
  std::string evicted;       // kEvicted: the model that lost the slice
  int64_t chunk_tokens = 0;  // the prefill chunk
  double prefill_ms = 0.0;   // ceil(prompt / chunk) * its time
  bool meets_ttft = false;   // prefill_ms <= the model's TTFT target
  std::string why;           // kWait: what stopped each option
};

struct SliceStatus {
  std::string model;  // active model, empty when idle
  int running = 0;    // requests in flight
  int64_t kv_bytes = 0;
  int64_t last_use = 0;
};

// Ablations of Note [Serving scheduler] (the replay's baselines), off by default.
struct SchedulerOptions {
  // Placement ignores the link demand: a model not active goes to a uniformly random slice
  // among those idle or with nothing running (seeded), or waits.
  bool random_placement = false;
  uint64_t seed = 1;
  // > 0: every prefill uses this chunk (the profile table's nearest that fits), whatever
  // the TTFT target.
  int64_t fixed_chunk = 0;
};

class Scheduler {
 public:
  Scheduler(std::vector<SliceSpec> slices, double link_gbps, const SchedulerOptions& o = {});
  void add_model(const ServedModel& m);  // checked: names, sizes, a non-empty chunk table
  const ServedModel& model(const std::string& name) const;

  // A request of `model` with `prompt_tokens` and up to `max_new_tokens`: where it runs.
  // A placement other than kWait counts the request as running on its slice until
  // finish(). `overdue`: the request has waited past its TTFT target; the link-demand
  // check no longer holds it back (Note [Serving scheduler]: aging, so that a model whose
  // demand does not fit beside the others is not starved by a steady stream of them).
  Placement place(const std::string& model, int64_t prompt_tokens, int64_t max_new_tokens,
                  bool overdue = false);
  // The request placed on `slice` (with the same token counts) is done.
  void finish(int slice, int64_t prompt_tokens, int64_t max_new_tokens);

  const std::vector<SliceStatus>& slices() const { return status_; }
  double link_demand_gbps() const;  // sum of S / TPOT over the models with requests running

 private:
  std::vector<SliceSpec> specs_;
  std::vector<SliceStatus> status_;
  std::vector<ServedModel> models_;
  double link_gbps_;
  SchedulerOptions opt_;
  uint64_t rng_;
  int64_t tick_ = 0;
  const ServedModel* find(const std::string& name) const;
};

struct AlphaControllerOptions {
  double ema = 0.3;        // weight of the newest sample
  double tau = 0.1;        // dead band on U_link - U_hbm
  double eta_fast = 0.2;   // step when the latency is over its budget
  double eta_slow = 0.05;  // step otherwise
  double eta_min = 0.01;   // reversals halve the step down to this
  double latency_budget_ms = 50.0;
};

class AlphaController {
 public:
  explicit AlphaController(const AlphaControllerOptions& o = {});
  double alpha() const { return alpha_; }
  // One interval's measurements (utilizations in [0, 1]); returns the new alpha.
  double update(double latency_ms, double u_hbm, double u_link);
  double smoothed_latency_ms() const { return l_; }
  int reversals() const { return reversals_; }

 private:
  AlphaControllerOptions o_;
  double alpha_ = 0.0;
  double l_ = 0.0, u_hbm_ = 0.0, u_link_ = 0.0;
  bool primed_ = false;
  int last_dir_ = 0;
  double shrink_ = 1.0;
  int reversals_ = 0;
};

}  // namespace spillway

// Simulator benchmark: events per second of the engine (target: over 1 million) and the
// time to simulate one training step of a 96-layer plan (target: under 50 ms).
//
// Workloads: the 96-layer dense model in the shape of GPT-3 175B (tp 8) planned with the
// offload strategy on an h100-sxm (copies snowball: every layer has transfers, stalls and
// contention, the engine's busiest case), one GPU, one micro-batch; and the same on 8 GPUs
// with 4 per link and 4 micro-batches for a large event count. Before timing, each result
// is checked (bytes issued = bytes completed, makespan > 0). Baseline in the same run: a
// bare binary-heap event loop (std::priority_queue push + pop per event, no model), the
// floor any discrete-event engine pays per event.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <random>
#include <vector>

#include "core/stats.hpp"
#include "spillway/core/error.hpp"
#include "spillway/sim/sim.hpp"

namespace {

using spillway::PlanRequest;

PlanRequest request_96(spillway::Policy s) {
  PlanRequest r;
  const nlohmann::json cfg = {{"model_type", "llama"},     {"hidden_size", 12288},
                              {"num_hidden_layers", 96},   {"num_attention_heads", 96},
                              {"num_key_value_heads", 96}, {"intermediate_size", 49152},
                              {"vocab_size", 50257},       {"tie_word_embeddings", true}};
  r.model = spillway::parse_model_config(cfg, "dense-96 (GPT-3 175B shape)", "bench");
  r.hardware = spillway::load_hardware("h100-sxm");
  r.work.shape.tp = 8;
  r.work.shape.micro_batch = 1;
  r.work.shape.seq_len = 8192;
  r.work.dp = 64;
  r.strategy = s;
  r.hbm_budget_gb = 1000.0;
  return r;
}

double median_ms(const std::function<void()>& f, int reps) {
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = spillway::Clock::now();
    f();
    ms.push_back(spillway::ms_since(t0));
  }
  return spillway::median(ms);
}

double heap_baseline_events_per_s(int64_t events) {
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> d(0.0, 1.0);
  const double ms = median_ms(
      [&] {
        std::priority_queue<double, std::vector<double>, std::greater<>> q;
        double now = 0.0;
        for (int i = 0; i < 8; ++i) q.push(d(rng));
        for (int64_t i = 0; i < events; ++i) {
          now = q.top();
          q.pop();
          q.push(now + d(rng));
        }
        if (now < 0) std::puts("");
      },
      7);
  return static_cast<double>(events) / (ms / 1e3);
}

}  // namespace

int main() {
  std::printf("simulator benchmark (median of 7 runs)\n");
  struct Case {
    const char* name;
    int gpus, per_link;
    int64_t grad_accum;
  };
  for (const Case c : {Case{"96 layers, 1 GPU, 1 micro-batch", 1, 1, 1},
                       Case{"96 layers, 8 GPUs (4 per link), 4 micro-batches", 8, 4, 4}}) {
    PlanRequest r = request_96(spillway::Policy::kOffload);
    r.work.grad_accum = c.grad_accum;
    const spillway::Plan plan = spillway::make_plan(r);
    spillway::SimOptions o;
    o.gpus = c.gpus;
    o.gpus_per_link = c.per_link;
    o.keep_tasks = false;
    spillway::SimResult check = spillway::simulate_training_step(plan, r, o);
    int64_t planned = 0;
    for (const auto& l : plan.layers) planned += l.offload_bytes;
    SPILLWAY_CHECK(check.summary.d2h_bytes == planned * c.gpus * c.grad_accum,
                   "D2H bytes {} != planned {}", check.summary.d2h_bytes,
                   planned * c.gpus * c.grad_accum);
    SPILLWAY_CHECK(check.summary.step_ms > 0.0, "empty simulation");
    const int64_t events = check.summary.events;
    const double ms = median_ms([&] { (void)spillway::simulate_training_step(plan, r, o); }, 7);
    const double ours = static_cast<double>(events) / (ms / 1e3);
    const double heap = heap_baseline_events_per_s(events);
    std::printf(
        "  %-50s %8lld events in %7.2f ms (graph build + run): %6.2f M events/s "
        "(target > 1 M); bare heap loop %6.1f M events/s, ratio %.3f%s\n",
        c.name, static_cast<long long>(events), ms, ours / 1e6, heap / 1e6, ours / heap,
        c.gpus == 1 ? "; one step of a 96-layer plan (target < 50 ms)" : "");
  }
  return 0;
}

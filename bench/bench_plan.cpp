// Planner benchmark: how long planning a 96-layer model takes, per strategy and for all
// six strategies in a row (the target: under 20 ms for all of them).
//
// Models: a 96-layer dense model in the shape of GPT-3 175B (hidden 12288, 96 heads) and
// the 94-layer Qwen3-235B-A22B MoE from the catalog; hardware gh200. "+profile" variants
// calibrate every layer with a different measured time (no layer shares its options). Before
// timing, each plan is checked (96 or 94 layers, the last layer not offloaded). Baseline in the
// same run: costing the layers alone (inventory + roofline, no decision), so the ratio says what
// the decision itself costs on top of the cost model.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/stats.hpp"
#include "plan/cost_model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/plan.hpp"

namespace {

using spillway::PlanRequest;
using spillway::Policy;

const std::vector<Policy> kStrategies = {Policy::kAuto,    Policy::kKeep,      Policy::kRecompute,
                                         Policy::kOffload, Policy::kSelective, Policy::kHybrid};

PlanRequest request_for(const std::string& model) {
  PlanRequest r;
  if (model == "dense-128+all") {
    // The planner's target: a 128-layer model with every option (sharding, optimizer and
    // gradient offload, chunked loss, tp/cp/dp collectives, a per-layer profile), auto.
    const nlohmann::json cfg = {{"model_type", "llama"},     {"hidden_size", 16384},
                                {"num_hidden_layers", 128},  {"num_attention_heads", 128},
                                {"num_key_value_heads", 16}, {"intermediate_size", 53248},
                                {"vocab_size", 128256}};
    r.model = spillway::parse_model_config(cfg, "dense-128 (Llama-3.1-405B shape)", "bench");
    r.hardware = spillway::load_hardware("gb200");
    r.work.shape.micro_batch = 1;
    r.work.shape.seq_len = 8192;
    r.work.shape.tp = 8;
    r.work.shape.cp = 2;
    r.work.dp = 64;
    r.work.grad_accum = 4;
    r.zero = 3;
    r.optimizer_offload = true;
    r.grad_offload = true;
    r.cpu_adam_gbps = 200.0;
    r.strategy = Policy::kAuto;
    for (size_t i = 0; i < r.model.layers.size(); ++i) {
      const double jitter = 1.0 + 0.01 * static_cast<double>(i % 7);
      r.profile.push_back({static_cast<int>(i), 10.0 * jitter, 20.0 * jitter});
    }
    return r;
  }
  const bool profiled = model.ends_with("+profile");
  const std::string base_model = profiled ? model.substr(0, model.size() - 8) : model;
  if (base_model == "dense-96") {
    const nlohmann::json cfg = {{"model_type", "llama"},     {"hidden_size", 12288},
                                {"num_hidden_layers", 96},   {"num_attention_heads", 96},
                                {"num_key_value_heads", 96}, {"intermediate_size", 49152},
                                {"vocab_size", 50257},       {"tie_word_embeddings", true}};
    r.model = spillway::parse_model_config(cfg, "dense-96 (GPT-3 175B shape)", "bench");
    r.work.shape.tp = 8;
    r.work.pp = 1;
    r.work.dp = 64;
  } else {
    r.model = spillway::load_model(base_model);
    r.work.shape.ep = 16;
    r.work.dp = 16;
  }
  r.hardware = spillway::load_hardware("gh200");
  r.work.shape.micro_batch = 1;
  r.work.shape.seq_len = 8192;
  r.hbm_budget_gb = 1000.0;  // the decision, not the budget, is what is timed
  if (profiled) {
    // Worst case for the planner: every layer measured with a different time, so no two
    // layers share their option set.
    for (size_t i = 0; i < r.model.layers.size(); ++i) {
      const double jitter = 1.0 + 0.01 * static_cast<double>(i % 7);
      r.profile.push_back({static_cast<int>(i), 10.0 * jitter, 20.0 * jitter});
    }
  }
  return r;
}

void check(const spillway::Plan& p, const PlanRequest& r) {
  SPILLWAY_CHECK(p.layers.size() == r.model.layers.size(), "plan has {} layers, model {}",
                 p.layers.size(), r.model.layers.size());
  SPILLWAY_CHECK(p.layers.back().offload_bytes == 0, "the last layer must not offload");
}

void BM_Plan(benchmark::State& state, std::string model, Policy s) {
  PlanRequest r = request_for(model);
  r.strategy = s;
  check(spillway::make_plan(r), r);
  for (auto _ : state) benchmark::DoNotOptimize(spillway::make_plan(r));
  state.SetLabel(model + " " + spillway::to_string(s));
}

// The baseline: costing every layer (inventory + roofline) without deciding anything.
void cost_all_layers(const PlanRequest& r) {
  for (const auto& l : r.model.layers) {
    benchmark::DoNotOptimize(
        spillway::cost_layer(l, r.model.hidden, r.work.shape, r.hardware, r.efficiency));
  }
}

void BM_CostOnly(benchmark::State& state, std::string model) {
  const PlanRequest r = request_for(model);
  for (auto _ : state) cost_all_layers(r);
  state.SetLabel(model + " cost model only (baseline)");
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

}  // namespace

int main(int argc, char** argv) {
  for (const std::string model : {"dense-96", "Qwen3-235B-A22B"}) {
    benchmark::RegisterBenchmark(("cost_only/" + model).c_str(), BM_CostOnly, model)
        ->Unit(benchmark::kMillisecond);
    for (Policy s : kStrategies) {
      benchmark::RegisterBenchmark(("plan/" + model + "/" + spillway::to_string(s)).c_str(),
                                   BM_Plan, model, s)
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::RegisterBenchmark("plan/dense-128+all/auto", BM_Plan, std::string("dense-128+all"),
                               Policy::kAuto)
      ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::printf(
      "\nsummary (median of 21 runs; target: all six strategies of a 96-layer model < 20 ms)\n");
  for (const std::string model :
       {"dense-96", "Qwen3-235B-A22B", "dense-96+profile", "Qwen3-235B-A22B+profile"}) {
    PlanRequest r = request_for(model);
    const double base = median_ms([&] { cost_all_layers(r); }, 21);
    const double all = median_ms(
        [&] {
          for (Policy s : kStrategies) {
            r.strategy = s;
            benchmark::DoNotOptimize(spillway::make_plan(r));
          }
        },
        21);
    std::printf(
        "  %-24s %3zu layers: all strategies %7.2f ms (%.2fx of the 20 ms target); "
        "cost model alone %6.3f ms, decision overhead %.1fx of it\n",
        model.c_str(), r.model.layers.size(), all, all / 20.0, base, all / (6.0 * base));
  }
  {
    PlanRequest r = request_for("dense-128+all");
    const double base = median_ms([&] { cost_all_layers(r); }, 21);
    const double one = median_ms([&] { benchmark::DoNotOptimize(spillway::make_plan(r)); }, 21);
    std::printf(
        "  %-24s %3zu layers, every option, auto: %7.2f ms (%.2fx of the 50 ms target); "
        "cost model alone %6.3f ms\n",
        "dense-128+all", r.model.layers.size(), one, one / 50.0, base);
  }
  return 0;
}

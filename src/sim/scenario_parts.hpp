// The parts both simulated scenarios are built of (scenario_parts.cpp): the streams and
// links of a topology, the tasks and their labels, a collective as a task, the memory
// curve, GPU 0's stall accounting, the memory verdict and the checks of a plan's inputs;
// the scenarios themselves are scenarios.cpp's (a training step) and weight_stream.cpp's.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "spillway/core/policy.hpp"
#include "spillway/plan/collectives.hpp"
#include "spillway/plan/plan.hpp"
#include "spillway/sim/sim.hpp"

namespace spillway::sim::detail {

// The streams and links of the simulated GPUs (make_topology).
struct Topology {
  int gpus = 1;
  int per_link = 1;
  std::vector<int> compute, d2h, h2d;   // streams per GPU
  std::vector<int> link_d2h, link_h2d;  // link per GPU
  // Made on first use (plans with collectives): per GPU, its communication stream and its
  // own links by (link name, GB/s).
  std::vector<int> comm;
  std::vector<std::map<std::pair<std::string, double>, int>> fabric;
};

Topology make_topology(Engine& e, int gpus, int per_link, double d2h_bytes_per_ms,
                       double h2d_bytes_per_ms, double hbm_bytes_per_ms);

// The simulated topology checked: gpus in [1, 1024], gpus_per_link dividing it.
void check_topology(int gpus, int per_link);

// What a scenario keeps beside the engine: the tasks' labels and GPU 0's bookkeeping.
struct Built {
  std::vector<std::string> labels;
  // GPU 0, micro-batch 0 bookkeeping for memory and backlog
  struct TensorTasks {
    int layer = 0;
    int64_t bytes = 0;
    Action action = Action::kKeep;
    int produced_by = -1;  // task whose end creates it (-1: start of step)
    int layer_fwd_end = -1;
    int d2h = -1;
    int h2d = -1;
    int recompute = -1;
    int backward = -1;
  };
  std::vector<TensorTasks> tensors;
  std::unordered_map<int, std::string> link_of;  // collective task -> its link's name
  std::vector<int> layer_last_fwd;               // GPU 0 mb 0
  std::vector<std::vector<int>> layer_d2h;       // GPU 0 mb 0
  // GPU 0, every micro-batch: [mb][layer] (the snowball is judged in each).
  std::vector<std::vector<int>> mb_last_fwd;
  std::vector<std::vector<std::vector<int>>> mb_layer_d2h;
  int head = -1;
};

// A task of the engine, labelled when `labelled` (scenario_parts.cpp).
Task make_task(TaskKind kind, int gpu, int layer, int mb, int stream, double work, int link,
               bool labelled, Built& b, const std::function<std::string()>& name);

// A collective as a task (Note [Collectives in the simulator], scenarios.cpp).
int add_collective(Engine& e, Topology& topo, Built& b, bool keep_tasks, size_t l,
                   const CollectivePlan& c, int g, int mbi, std::initializer_list<int> deps);

// Memory curve from (time, delta) events over `base`; its peak in `*peak`.
std::vector<MemoryPoint> memory_curve(std::vector<std::pair<double, int64_t>> ev, int64_t base,
                                      int64_t* peak);

// The engine's tasks as the result's records, when `keep` (the trace's).
void fill_records(const Engine& e, const Built& b, bool keep, SimResult& r);

// Stall accounting on GPU 0's compute stream (compute, recompute, stalls, collective waits).
void compute_stats(const Engine& e, int compute_stream, SimSummary& s);

// The memory verdict of a result (Note [Simulated memory verdict], scenario_parts.cpp).
void judge_memory(SimResult& r, const Plan& plan, const PlanRequest& req);

// The plan's collectives, checked before they become tasks.
void check_collectives(const Plan& plan);

}  // namespace spillway::sim::detail

// The simulator's discrete-event engine: a fluid model of streams, copy engines, shared
// host links and shared HBM bandwidth.
//
// Tasks run on serial streams (in submission order, as CUDA streams do) once their
// dependencies have finished. A compute task has work in milliseconds at full speed; a
// copy task has work in bytes and a link direction. Between two events every running task
// progresses at a constant rate:
//   - a copy gets an equal share of its link direction's capacity (re-split whenever a
//     transfer starts or ends); a transfer that crosses two link directions (a collective
//     through the host link sends on D2H and receives on H2D) runs at the smaller of its
//     two shares; a transfer's latency_ms (a collective's ring steps) runs first, on its
//     stream but off the link;
//   - Note [HBM sharing]: on a GPU running a memory-bound kernel, the kernel demands the
//     whole HBM bandwidth H and its copies demand their link rates r_i; when H + sum r_i
//     exceeds H, the kernel and the copies all slow by the factor H / (H + sum r_i). GEMMs
//     and attention are compute-bound and are not slowed. The model can be turned off.
// Invariants (checked by tests): time never runs backwards; a stream runs one task at a
// time; every byte issued completes; per-resource busy time <= makespan.
#pragma once

#include <cstdint>
#include <vector>

#include "spillway/sim.hpp"

namespace spillway::sim {

struct Task {
  TaskKind kind = TaskKind::kForward;
  int gpu = 0;
  int layer = -1;
  int micro_batch = 0;
  int label = -1;  // index into the scenario's label table (task names)
  int stream = -1;
  int link = -1;   // copies and collectives: link direction
  int link2 = -1;  // a second direction the transfer also occupies (-1: none)
  bool memory_bound = false;
  double work = 0.0;  // ms (compute) or bytes (copy)
  // A transfer's fixed time before its bytes move (a collective's ring-step latency), in
  // ms, during which it holds its stream but not its link.
  double latency_ms = 0.0;
  // filled by the run
  double ready_ms = -1.0;  // dependencies met (and head of its stream)
  double start_ms = -1.0;
  double end_ms = -1.0;
  int last_dep = -1;  // the dependency that finished last (what it waited on)
};

class Engine {
 public:
  // A serial stream of one GPU (compute, D2H engine, H2D engine or communication).
  int add_stream(int gpu, ResourceKind kind);
  // A link direction with a capacity in bytes per millisecond.
  int add_link(double bytes_per_ms);
  // HBM bandwidth of a GPU in bytes per ms (0 = no HBM sharing for that GPU).
  void set_hbm(int gpu, double bytes_per_ms);
  int add_task(const Task& t);  // appended to the end of t.stream's queue
  void add_dep(int task, int depends_on);
  void reserve(size_t tasks, size_t deps);

  void run();

  const std::vector<Task>& tasks() const { return tasks_; }
  ResourceKind stream_kind(int stream) const { return streams_[static_cast<size_t>(stream)].kind; }
  int stream_gpu(int stream) const { return streams_[static_cast<size_t>(stream)].gpu; }
  double makespan_ms() const { return now_; }
  int64_t events() const { return events_; }
  double worst_hbm_slowdown() const { return worst_slowdown_; }
  // Time during which the link direction carried at least one transfer.
  double link_busy_ms(int link) const { return links_[static_cast<size_t>(link)].busy_ms; }
  double stream_busy_ms(int stream) const { return streams_[static_cast<size_t>(stream)].busy_ms; }

 private:
  struct Stream {
    int gpu = 0;
    ResourceKind kind = ResourceKind::kCompute;
    std::vector<int> queue;
    size_t head = 0;
    bool running = false;
    double busy_ms = 0.0;
  };
  struct Link {
    double capacity = 0.0;
    int active = 0;
    double busy_ms = 0.0;
  };

  void try_start(int stream);
  void finish(int task);

  std::vector<Task> tasks_;
  std::vector<Stream> streams_;
  std::vector<Link> links_;
  std::vector<double> hbm_;                 // per GPU
  std::vector<int> unmet_;                  // per task
  std::vector<std::pair<int, int>> edges_;  // (depends_on, task), sorted into CSR at run()
  std::vector<int> dep_begin_;
  std::vector<int> dependents_;
  std::vector<int> active_;        // running tasks
  std::vector<double> remaining_;  // per task
  std::vector<double> rate_;       // per task
  std::vector<char> in_latency_;   // per task: still in its latency_ms
  double now_ = 0.0;
  int64_t events_ = 0;
  double worst_slowdown_ = 1.0;
};

}  // namespace spillway::sim

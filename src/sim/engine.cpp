// The fluid discrete-event engine (see engine.hpp for the model and its invariants).
#include "sim/engine.hpp"

#include <algorithm>
#include <limits>

#include "spillway/error.hpp"

namespace spillway::sim {

int Engine::add_stream(int gpu, ResourceKind kind) {
  Stream s;
  s.gpu = gpu;
  s.kind = kind;
  streams_.push_back(std::move(s));
  if (static_cast<size_t>(gpu) >= hbm_.size()) hbm_.resize(static_cast<size_t>(gpu) + 1, 0.0);
  return static_cast<int>(streams_.size() - 1);
}

int Engine::add_link(double bytes_per_ms) {
  SPILLWAY_CHECK(bytes_per_ms > 0.0, "link capacity must be positive, got {}", bytes_per_ms);
  links_.push_back(Link{bytes_per_ms, 0, 0.0});
  return static_cast<int>(links_.size() - 1);
}

void Engine::set_hbm(int gpu, double bytes_per_ms) {
  if (static_cast<size_t>(gpu) >= hbm_.size()) hbm_.resize(static_cast<size_t>(gpu) + 1, 0.0);
  hbm_[static_cast<size_t>(gpu)] = bytes_per_ms;
}

void Engine::reserve(size_t tasks, size_t deps) {
  tasks_.reserve(tasks);
  unmet_.reserve(tasks);
  edges_.reserve(deps);
}

int Engine::add_task(const Task& t) {
  SPILLWAY_CHECK(t.stream >= 0 && static_cast<size_t>(t.stream) < streams_.size(), "bad stream {}",
                 t.stream);
  SPILLWAY_CHECK(t.work >= 0.0, "task work must be >= 0, got {}", t.work);
  SPILLWAY_CHECK(t.latency_ms >= 0.0 && (t.latency_ms == 0.0 || t.link >= 0),
                 "a latency must be >= 0 and belongs to a transfer, got {}", t.latency_ms);
  const bool copy =
      t.kind == TaskKind::kD2H || t.kind == TaskKind::kH2D || t.kind == TaskKind::kCollective;
  SPILLWAY_CHECK(!copy || (t.link >= 0 && static_cast<size_t>(t.link) < links_.size()),
                 "a copy needs a link");
  SPILLWAY_CHECK(t.link2 < 0 || (t.link >= 0 && t.link2 != t.link &&
                                 static_cast<size_t>(t.link2) < links_.size()),
                 "a second link needs a first one, and another");
  const int id = static_cast<int>(tasks_.size());
  tasks_.push_back(t);
  unmet_.push_back(0);
  streams_[static_cast<size_t>(t.stream)].queue.push_back(id);
  return id;
}

void Engine::add_dep(int task, int depends_on) {
  SPILLWAY_CHECK(depends_on < task, "a dependency must be added before its dependent ({} on {})",
                 task, depends_on);
  edges_.emplace_back(depends_on, task);
  ++unmet_[static_cast<size_t>(task)];
}

void Engine::try_start(int s) {
  Stream& st = streams_[static_cast<size_t>(s)];
  if (st.running || st.head >= st.queue.size()) return;
  const int id = st.queue[st.head];
  Task& t = tasks_[static_cast<size_t>(id)];
  if (unmet_[static_cast<size_t>(id)] > 0) return;
  if (t.ready_ms < 0.0) t.ready_ms = now_;
  t.start_ms = now_;
  st.running = true;
  const bool latency = t.latency_ms > 0.0;
  in_latency_[static_cast<size_t>(id)] = latency ? 1 : 0;
  remaining_[static_cast<size_t>(id)] = latency ? t.latency_ms : t.work;
  active_.push_back(id);
  ++events_;
}

void Engine::finish(int id) {
  Task& t = tasks_[static_cast<size_t>(id)];
  t.end_ms = now_;
  Stream& st = streams_[static_cast<size_t>(t.stream)];
  st.running = false;
  st.busy_ms += t.end_ms - t.start_ms;
  ++st.head;
  ++events_;
  for (int k = dep_begin_[static_cast<size_t>(id)]; k < dep_begin_[static_cast<size_t>(id) + 1];
       ++k) {
    const int d = dependents_[static_cast<size_t>(k)];
    Task& dt = tasks_[static_cast<size_t>(d)];
    dt.last_dep = id;
    if (--unmet_[static_cast<size_t>(d)] == 0) {
      // Ready now if it is the head of its stream; otherwise when it becomes the head.
      const Stream& ds = streams_[static_cast<size_t>(dt.stream)];
      if (ds.head < ds.queue.size() && ds.queue[ds.head] == d) dt.ready_ms = now_;
    }
  }
}

void Engine::run() {
  // Dependencies in CSR form, built once.
  const size_t n = tasks_.size();
  dep_begin_.assign(n + 1, 0);
  for (const auto& e : edges_) ++dep_begin_[static_cast<size_t>(e.first) + 1];
  for (size_t i = 0; i < n; ++i) dep_begin_[i + 1] += dep_begin_[i];
  dependents_.assign(edges_.size(), 0);
  std::vector<int> fill(dep_begin_.begin(), dep_begin_.end() - 1);
  for (const auto& e : edges_)
    dependents_[static_cast<size_t>(fill[static_cast<size_t>(e.first)]++)] = e.second;
  remaining_.assign(n, 0.0);
  rate_.assign(n, 0.0);
  in_latency_.assign(n, 0);
  active_.reserve(streams_.size());
  now_ = 0.0;

  std::vector<double> gpu_copy_demand(hbm_.size(), 0.0);
  std::vector<char> gpu_memory_kernel(hbm_.size(), 0);
  std::vector<int> finished;
  finished.reserve(streams_.size());

  for (size_t s = 0; s < streams_.size(); ++s) try_start(static_cast<int>(s));
  size_t done = 0;
  while (done < n) {
    if (active_.empty()) {
      SPILLWAY_CHECK(false,
                     "simulation deadlock: {} of {} tasks cannot start (a dependency cycle "
                     "or a dependency on a later task of the same stream)",
                     n - done, n);
    }
    // Rates: fair link shares, then HBM sharing per GPU (Note [HBM sharing]).
    for (Link& l : links_) l.active = 0;
    std::fill(gpu_copy_demand.begin(), gpu_copy_demand.end(), 0.0);
    std::fill(gpu_memory_kernel.begin(), gpu_memory_kernel.end(), 0);
    // A transfer in its latency runs at 1 ms per ms and takes no link share.
    auto on_link = [&](int id) {
      return tasks_[static_cast<size_t>(id)].link >= 0 && !in_latency_[static_cast<size_t>(id)];
    };
    for (int id : active_) {
      const Task& t = tasks_[static_cast<size_t>(id)];
      if (on_link(id)) {
        ++links_[static_cast<size_t>(t.link)].active;
        if (t.link2 >= 0) ++links_[static_cast<size_t>(t.link2)].active;
      } else if (t.memory_bound && t.link < 0) {
        gpu_memory_kernel[static_cast<size_t>(t.gpu)] = 1;
      }
    }
    for (int id : active_) {
      const Task& t = tasks_[static_cast<size_t>(id)];
      if (on_link(id)) {
        const Link& l = links_[static_cast<size_t>(t.link)];
        double share = l.capacity / l.active;
        if (t.link2 >= 0) {
          const Link& l2 = links_[static_cast<size_t>(t.link2)];
          share = std::min(share, l2.capacity / l2.active);
        }
        rate_[static_cast<size_t>(id)] = share;
        gpu_copy_demand[static_cast<size_t>(t.gpu)] += rate_[static_cast<size_t>(id)];
      } else {
        rate_[static_cast<size_t>(id)] = 1.0;
      }
    }
    for (int id : active_) {
      const Task& t = tasks_[static_cast<size_t>(id)];
      const size_t g = static_cast<size_t>(t.gpu);
      if (hbm_[g] <= 0.0 || !gpu_memory_kernel[g] || gpu_copy_demand[g] <= 0.0) continue;
      const double factor = hbm_[g] / (hbm_[g] + gpu_copy_demand[g]);
      if (on_link(id) || (t.memory_bound && t.link < 0)) {
        rate_[static_cast<size_t>(id)] *= factor;
        worst_slowdown_ = std::max(worst_slowdown_, 1.0 / factor);
      }
    }
    double dt = std::numeric_limits<double>::infinity();
    for (int id : active_) {
      dt = std::min(dt, remaining_[static_cast<size_t>(id)] / rate_[static_cast<size_t>(id)]);
    }
    // Advance; link busy time counts intervals with at least one transfer.
    for (Link& l : links_) {
      if (l.active > 0) l.busy_ms += dt;
    }
    now_ += dt;
    finished.clear();
    for (size_t k = 0; k < active_.size();) {
      const int id = active_[k];
      double& rem = remaining_[static_cast<size_t>(id)];
      rem -= rate_[static_cast<size_t>(id)] * dt;
      const Task& t = tasks_[static_cast<size_t>(id)];
      const bool latency = in_latency_[static_cast<size_t>(id)] != 0;
      const double tol = 1e-9 * std::max(1.0, latency ? t.latency_ms : t.work);
      if (latency && rem <= tol) {
        // The latency is over: the bytes start moving (a rate change, not an end).
        in_latency_[static_cast<size_t>(id)] = 0;
        rem = t.work;
        ++events_;
        if (rem > 1e-9 * std::max(1.0, t.work)) {
          ++k;
          continue;
        }
      }
      if (rem <= tol) {
        finished.push_back(id);
        active_[k] = active_.back();
        active_.pop_back();
      } else {
        ++k;
      }
    }
    for (int id : finished) finish(id);
    done += finished.size();
    // Start whatever became startable: the streams of the finished tasks and of their
    // dependents.
    for (int id : finished) {
      try_start(tasks_[static_cast<size_t>(id)].stream);
      for (int k = dep_begin_[static_cast<size_t>(id)]; k < dep_begin_[static_cast<size_t>(id) + 1];
           ++k) {
        try_start(tasks_[static_cast<size_t>(dependents_[static_cast<size_t>(k)])].stream);
      }
    }
  }
}

}  // namespace spillway::sim

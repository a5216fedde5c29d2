// The discrete-event engine (spillway/sim/sim.hpp: the fluid model, Note [Fixed tasks], Note
// [Engine clients] and the invariants it keeps). Per event it allocates nothing once its
// vectors have grown: a run whose tasks are all submitted first (a training step) only
// walks them; a client's run reuses the ids of the tasks it recycles.
#include <algorithm>
#include <limits>
#include <numeric>

#include "spillway/core/error.hpp"
#include "spillway/sim/sim.hpp"

namespace spillway::sim {
namespace {

// The order of the heap of fixed ends: the earliest on top, equal ends in add order.
constexpr auto kEndsLater = [](const auto& a, const auto& b) {
  return a.end_ms != b.end_ms ? a.end_ms > b.end_ms : a.order > b.order;
};

}  // namespace

int Engine::add_stream(int gpu, ResourceKind kind) {
  SPILLWAY_CHECK(!running_, "streams are added before run()");
  Stream s;
  s.gpu = gpu;
  s.kind = kind;
  streams_.push_back(std::move(s));
  if (static_cast<size_t>(gpu) >= hbm_.size()) hbm_.resize(static_cast<size_t>(gpu) + 1, 0.0);
  return static_cast<int>(streams_.size() - 1);
}

int Engine::add_link(double bytes_per_ms) {
  SPILLWAY_CHECK(!running_, "links are added before run()");
  SPILLWAY_CHECK(bytes_per_ms > 0.0, "link capacity must be positive, got {}", bytes_per_ms);
  links_.push_back(Link{bytes_per_ms, 0, 0.0});
  return static_cast<int>(links_.size() - 1);
}

void Engine::set_hbm(int gpu, double bytes_per_ms) {
  SPILLWAY_CHECK(!running_, "HBM bandwidth is set before run()");
  if (static_cast<size_t>(gpu) >= hbm_.size()) hbm_.resize(static_cast<size_t>(gpu) + 1, 0.0);
  hbm_[static_cast<size_t>(gpu)] = bytes_per_ms;
}

void Engine::reserve(size_t tasks, size_t deps) {
  tasks_.reserve(tasks);
  unmet_.reserve(tasks);
  edges_.reserve(deps);
}

int Engine::add_task(const Task& t) {
  const bool copy =
      t.kind == TaskKind::kD2H || t.kind == TaskKind::kH2D || t.kind == TaskKind::kCollective;
  if (t.fixed) {  // Note [Fixed tasks]
    SPILLWAY_CHECK(t.stream >= -1 && t.stream < static_cast<int>(streams_.size()) && !copy &&
                       t.link < 0 && t.link2 < 0 && t.latency_ms == 0.0 && t.work >= 0.0 &&
                       t.not_before_ms >= 0.0,
                   "a fixed task has a stream or none (-1, got {}), no link and no latency, and "
                   "work and not_before_ms >= 0 (got {} and {})",
                   t.stream, t.work, t.not_before_ms);
  } else {
    SPILLWAY_CHECK(t.stream >= 0 && static_cast<size_t>(t.stream) < streams_.size(),
                   "bad stream {}", t.stream);
    SPILLWAY_CHECK(t.work >= 0.0 && t.not_before_ms == 0.0,
                   "task work must be >= 0, got {}; not_before_ms is a fixed task's, got {}",
                   t.work, t.not_before_ms);
    SPILLWAY_CHECK(t.latency_ms >= 0.0 && (t.latency_ms == 0.0 || t.link >= 0),
                   "a latency must be >= 0 and belongs to a transfer, got {}", t.latency_ms);
    SPILLWAY_CHECK(!copy || (t.link >= 0 && static_cast<size_t>(t.link) < links_.size()),
                   "a copy needs a link");
    SPILLWAY_CHECK(t.link2 < 0 || (t.link >= 0 && t.link2 != t.link &&
                                   static_cast<size_t>(t.link2) < links_.size()),
                   "a second link needs a first one, and another");
  }
  if (running_) return add_during_run(t);
  const int id = static_cast<int>(tasks_.size());
  tasks_.push_back(t);
  unmet_.push_back(0);
  if (t.stream >= 0) {
    streams_[static_cast<size_t>(t.stream)].queue.push_back(id);
  } else {
    timers_.push_back(id);
  }
  return id;
}

int Engine::add_during_run(const Task& t) {
  if (order_.empty()) {  // the first: from now on ids and add order part
    order_.resize(tasks_.size());
    std::iota(order_.begin(), order_.end(), int64_t{0});
  }
  int id = 0;
  if (!recycled_.empty()) {
    id = recycled_.back();
    recycled_.pop_back();
    tasks_[static_cast<size_t>(id)] = t;
    unmet_[static_cast<size_t>(id)] = 0;
    order_[static_cast<size_t>(id)] = static_cast<int64_t>(submitted_);
  } else {  // the per-task state run() sized, and no dependents
    id = static_cast<int>(tasks_.size());
    tasks_.push_back(t);
    unmet_.push_back(0);
    order_.push_back(static_cast<int64_t>(submitted_));
    remaining_.push_back(0.0);
    rate_.push_back(0.0);
    in_latency_.push_back(0);
    dep_begin_.push_back(dep_begin_.back());
  }
  ++submitted_;
  ++unfinished_;
  if (t.stream < 0) {
    start_fixed(id);
    return id;
  }
  Stream& st = streams_[static_cast<size_t>(t.stream)];
  if (st.head == st.queue.size()) {  // ran dry: a client's stream does not grow
    st.queue.clear();
    st.head = 0;
  }
  st.queue.push_back(id);
  try_start(t.stream);
  return id;
}

void Engine::add_dep(int task, int depends_on) {
  SPILLWAY_CHECK(depends_on < task && !running_,
                 "a dependency must be added before its dependent, and before run() ({} on {})",
                 task, depends_on);
  edges_.emplace_back(depends_on, task);
  ++unmet_[static_cast<size_t>(task)];
}

void Engine::recycle(int task) {
  const size_t id = static_cast<size_t>(task);
  SPILLWAY_CHECK(running_ && id < tasks_.size() && tasks_[id].end_ms >= 0.0 &&
                     dep_begin_[id] == dep_begin_[id + 1],
                 "only a finished task without dependents is recycled, once (task {})", task);
  tasks_[id].end_ms = -1.0;
  recycled_.push_back(task);
}

void Engine::try_start(int s) {
  Stream& st = streams_[static_cast<size_t>(s)];
  if (st.running || st.head >= st.queue.size()) return;
  const int id = st.queue[st.head];
  if (unmet_[static_cast<size_t>(id)] > 0) return;
  st.running = true;
  Task& t = tasks_[static_cast<size_t>(id)];
  if (t.fixed) {
    start_fixed(id);
    return;
  }
  if (t.ready_ms < 0.0) t.ready_ms = now_;
  t.start_ms = now_;
  const bool latency = t.latency_ms > 0.0;
  in_latency_[static_cast<size_t>(id)] = latency ? 1 : 0;
  remaining_[static_cast<size_t>(id)] = latency ? t.latency_ms : t.work;
  active_.push_back(id);
  ++events_;
}

void Engine::start_fixed(int id) {
  Task& t = tasks_[static_cast<size_t>(id)];
  if (t.ready_ms < 0.0) t.ready_ms = now_;
  t.start_ms = std::max(now_, t.not_before_ms);
  const int64_t order = order_.empty() ? id : order_[static_cast<size_t>(id)];
  fixed_.push_back(FixedEnd{t.start_ms + t.work, order, id});
  std::push_heap(fixed_.begin(), fixed_.end(), kEndsLater);
  ++events_;
}

void Engine::finish(int id) {
  Task& t = tasks_[static_cast<size_t>(id)];
  t.end_ms = now_;
  if (t.stream >= 0) {
    Stream& st = streams_[static_cast<size_t>(t.stream)];
    st.running = false;
    st.busy_ms += t.end_ms - t.start_ms;
    ++st.head;
  }
  ++events_;
  for (int k = dep_begin_[static_cast<size_t>(id)]; k < dep_begin_[static_cast<size_t>(id) + 1];
       ++k) {
    const int d = dependents_[static_cast<size_t>(k)];
    Task& dt = tasks_[static_cast<size_t>(d)];
    dt.last_dep = id;
    if (--unmet_[static_cast<size_t>(d)] == 0) {
      // Ready now if it is the head of its stream (or has none); otherwise when it becomes
      // the head.
      if (dt.stream < 0) {
        dt.ready_ms = now_;
      } else {
        const Stream& ds = streams_[static_cast<size_t>(dt.stream)];
        if (ds.head < ds.queue.size() && ds.queue[ds.head] == d) dt.ready_ms = now_;
      }
    }
  }
}

void Engine::start_timer(int id) {
  if (unmet_[static_cast<size_t>(id)] == 0 && tasks_[static_cast<size_t>(id)].start_ms < 0.0)
    start_fixed(id);
}

void Engine::end_next_fixed() {
  std::pop_heap(fixed_.begin(), fixed_.end(), kEndsLater);
  const FixedEnd e = fixed_.back();
  fixed_.pop_back();
  now_ = e.end_ms;
  finish(e.task);
  --unfinished_;
  const int s = tasks_[static_cast<size_t>(e.task)].stream;
  if (s >= 0) try_start(s);
  for (int k = dep_begin_[static_cast<size_t>(e.task)];
       k < dep_begin_[static_cast<size_t>(e.task) + 1]; ++k) {
    const int d = dependents_[static_cast<size_t>(k)];
    const int ds = tasks_[static_cast<size_t>(d)].stream;
    if (ds >= 0) {
      try_start(ds);
    } else {
      start_timer(d);
    }
  }
  if (on_finish_ != nullptr) (*on_finish_)(e.task);
}

void Engine::run(const FinishHook& on_finish) {
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
  order_.clear();  // the tasks added so far are in id order
  submitted_ = n;
  unfinished_ = n;
  active_.reserve(streams_.size());
  now_ = 0.0;
  on_finish_ = on_finish ? &on_finish : nullptr;
  running_ = true;

  std::vector<double> gpu_copy_demand(hbm_.size(), 0.0);
  std::vector<char> gpu_memory_kernel(hbm_.size(), 0);
  std::vector<int> finished;
  finished.reserve(streams_.size());

  for (size_t s = 0; s < streams_.size(); ++s) try_start(static_cast<int>(s));
  for (int id : timers_) start_timer(id);
  while (unfinished_ > 0) {
    if (active_.empty()) {
      SPILLWAY_CHECK(!fixed_.empty(),
                     "simulation deadlock: {} of {} tasks cannot start (a dependency cycle "
                     "or a dependency on a later task of the same stream)",
                     unfinished_, submitted_);
      end_next_fixed();
      continue;
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
    // A fixed task that ends first: the fluid tasks advance to its end, then it ends.
    const bool fixed_first = !fixed_.empty() && fixed_.front().end_ms <= now_ + dt;
    if (fixed_first) dt = fixed_.front().end_ms - now_;
    // Advance; link busy time counts intervals with at least one transfer.
    for (Link& l : links_) {
      if (l.active > 0) l.busy_ms += dt;
    }
    now_ = fixed_first ? fixed_.front().end_ms : now_ + dt;
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
    unfinished_ -= finished.size();
    // Start whatever became startable: the streams of the finished tasks and of their
    // dependents.
    for (int id : finished) {
      try_start(tasks_[static_cast<size_t>(id)].stream);
      for (int k = dep_begin_[static_cast<size_t>(id)]; k < dep_begin_[static_cast<size_t>(id) + 1];
           ++k) {
        const int d = dependents_[static_cast<size_t>(k)];
        const int ds = tasks_[static_cast<size_t>(d)].stream;
        if (ds >= 0) {
          try_start(ds);
        } else {
          start_timer(d);
        }
      }
    }
    if (on_finish_ != nullptr)
      for (int id : finished) (*on_finish_)(id);
    if (fixed_first) end_next_fixed();
  }
  running_ = false;
  on_finish_ = nullptr;
}

}  // namespace spillway::sim

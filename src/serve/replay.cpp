// Trace replay of host-resident serving (spillway/serve/replay.hpp, Note [Replay model]), a
// client of the simulator's engine (Note [Replay on the engine]): the served models'
// numbers, an iteration's cost, the replay of one configuration (Sim) and run_replay's
// configurations side by side. The trace is read by replay_trace.cpp; the results are
// reported by replay_report.cpp.
#include "spillway/serve/replay.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>

#include "serve/replay_impl.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/core/error.hpp"
#include "spillway/serve/hybrid_gemm.hpp"
#include "spillway/serve/scheduler.hpp"
#include "spillway/serve/slices.hpp"
#include "spillway/sim/sim.hpp"

namespace spillway {

namespace serve::detail {

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double at = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(at));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (at - static_cast<double>(lo));
}

}  // namespace serve::detail

namespace {

using serve::detail::percentile;

LatencyStats stats_of(const std::vector<double>& v) {
  return {percentile(v, 0.50), percentile(v, 0.95), percentile(v, 0.99)};
}

// One catalog architecture's numbers.
struct Arch {
  std::string name;
  int64_t weight_bytes = 0;  // bf16
  int64_t active_bytes = 0;  // per token
  int64_t hidden = 0;
  int64_t kv_per_token = 0;  // bf16 K and V of every attention layer
};

Arch arch_of(const ModelConfig& m, double bytes_per_param) {
  Arch a;
  a.name = m.name;
  a.weight_bytes = static_cast<int64_t>(static_cast<double>(parameter_count(m)) * bytes_per_param);
  a.active_bytes =
      static_cast<int64_t>(static_cast<double>(active_parameter_count(m)) * bytes_per_param);
  a.hidden = m.hidden;
  for (const LayerSpec& l : m.layers) {
    if (l.mixer != MixerKind::kAttention && l.shared_block < 0)
      continue;  // Zamba2: its shared attention
    const AttentionSpec& at = l.attn;
    if (at.kind == AttentionKind::kMla)
      a.kv_per_token += (at.kv_lora_rank + at.qk_rope_head_dim) * 2;
    else
      a.kv_per_token += at.kv_heads * (at.qk_head_dim + at.v_head_dim) * 2;
  }
  return a;
}

// Weight bytes an iteration of `tokens` touches: all of a dense model; an MoE's active
// bytes per token times the tokens, up to all of it.
int64_t touched_bytes(const Arch& a, int64_t tokens) {
  if (a.active_bytes >= a.weight_bytes) return a.weight_bytes;
  return std::min(a.weight_bytes, a.active_bytes * std::max<int64_t>(1, tokens));
}

enum class Routing { kScheduler, kDedicated, kTimeShare };

struct Config {
  std::string name;
  Routing routing = Routing::kScheduler;
  SchedulerOptions sched;
  bool controller = true;       // the alpha controller; false: alpha stays 0
  bool weights_in_hbm = false;  // dedicated GPUs and time sharing
};

struct Request {
  double arrival_ms = 0;
  int model = 0;  // served model index
  int64_t prompt = 0, output = 0;
  int64_t prefilled = 0, generated = 0;
  int64_t chunk = 512;
  double first_ms = -1, done_ms = -1;
  bool switched = false, cold = false;
  int slice = -1;
};

struct Served {
  std::string id;
  const Arch* arch = nullptr;
  double tpot_ms = 0, ttft_ms = 0;
};

// Time of one iteration on a slice (Note [Replay model]).
struct IterCost {
  double ms = 0, link_ms = 0, hbm_ms = 0, compute_ms = 0;
  int64_t link_bytes = 0;
};

IterCost iteration_cost(const Arch& a, int64_t tokens, int64_t kv_bytes, double alpha,
                        const SliceSpec& s, double link_share_gbps, bool in_hbm, double eff) {
  IterCost c;
  const int64_t touched = touched_bytes(a, tokens);
  if (in_hbm) {
    c.hbm_ms = static_cast<double>(touched + kv_bytes + tokens * a.hidden * 8) / (s.hbm_gbps * 1e6);
  } else {
    HybridGemmProblem p;
    p.m = std::max<int64_t>(1, tokens);
    p.k = a.hidden;
    p.n = std::max<int64_t>(1, touched / 2 / a.hidden);
    p.w_dtype = DType::kBf16;
    p.alpha = alpha;
    p.symmetric = p.asymmetric = {64, 128, 64};
    const GemmTraffic t = hybrid_gemm_traffic(p).total();
    c.link_bytes = t.link_bytes;
    c.link_ms = static_cast<double>(t.link_bytes) / (link_share_gbps * 1e6);
    c.hbm_ms = static_cast<double>(t.hbm_bytes() + kv_bytes) / (s.hbm_gbps * 1e6);
  }
  c.compute_ms = static_cast<double>(touched) * static_cast<double>(std::max<int64_t>(1, tokens)) /
                 (s.gflops * eff * 1e6);
  c.ms = std::max({c.link_ms, c.hbm_ms, c.compute_ms, 1e-3});
  return c;
}

class Sim {
 public:
  Sim(const Config& cfg, const ReplayOptions& o, const HardwareProfile& hw,
      const std::vector<Served>& served, std::vector<Request> reqs)
      : cfg_(cfg), o_(o), served_(served), reqs_(std::move(reqs)) {
    if (cfg.routing == Routing::kScheduler) {
      const SliceSetup setup = mig_slices(hw, o.profile, 1.0, 1.0);
      specs_ = setup.slices;
      link_gbps_ = setup.link_gbps;
    } else {
      // Whole GPUs with the weights in HBM: enough of them for the largest model (time
      // sharing) or one group per model (dedicated).
      SliceSpec whole{"gpu", static_cast<int64_t>(hw.hbm_gb * 1e9), hw.hbm_tbps * 1e3,
                      hw.bf16_dense.value * 1e3};
      auto gpus_for = [&](const Arch& a) {
        return std::max<int>(1, static_cast<int>(std::ceil(static_cast<double>(a.weight_bytes) /
                                                           (0.8 * hw.hbm_gb * 1e9))));
      };
      if (cfg.routing == Routing::kDedicated) {
        gpus_ = 0;
        for (const Served& m : served) {
          const int g = gpus_for(*m.arch);
          gpus_ += g;
          SliceSpec k = whole;
          k.hbm_bytes *= g;
          k.hbm_gbps *= g;
          k.gflops *= g;
          specs_.push_back(k);
        }
      } else {
        int g = 1;
        for (const Served& m : served) g = std::max(g, gpus_for(*m.arch));
        gpus_ = g;
        SliceSpec k = whole;
        k.hbm_bytes *= g;
        k.hbm_gbps *= g;
        k.gflops *= g;
        specs_.push_back(k);
      }
      link_gbps_ = hw.h2d_typical.value;
    }
    slices_.resize(specs_.size());
    for (Slice& s : slices_) s.ctrl = AlphaController(controller_options());
    if (cfg.routing == Routing::kDedicated)  // each model's weights in its GPUs' HBM from the start
      for (size_t i = 0; i < slices_.size(); ++i) slices_[i].model = static_cast<int>(i);
    if (cfg.routing == Routing::kScheduler) {
      sched_ = std::make_unique<Scheduler>(specs_, link_gbps_, cfg.sched);
      for (const Served& m : served) sched_->add_model(served_model(m));
    }
  }

  // Note [Replay on the engine]: the replay runs on the simulator's engine as its client
  // (spillway/sim/sim.hpp, Note [Engine clients]): each event is a fixed task, so the engine
  // keeps the clock and the order of the events, equal times in the order they were
  // scheduled (Note [Fixed tasks]). The trace is a stream of zero-length arrivals in time
  // order (equal times by request), all scheduled first: each waits for its time and for
  // the one before, so the engine holds one at a time. A model's load is a timer (no
  // stream) ending when the weights are usable; each slice is a stream, and each of its
  // iterations a fixed task of the iteration's duration. After every event, each slice
  // that can start an iteration starts one.
  ReplayResult run() {
    for (size_t s = 0; s < slices_.size(); ++s)
      slices_[s].stream = engine_.add_stream(static_cast<int>(s), ResourceKind::kCompute);
    const int trace = engine_.add_stream(0, ResourceKind::kCompute);
    std::vector<int> by_time(reqs_.size());
    for (size_t i = 0; i < by_time.size(); ++i) by_time[i] = static_cast<int>(i);
    std::stable_sort(by_time.begin(), by_time.end(), [&](int a, int b) {
      return reqs_[static_cast<size_t>(a)].arrival_ms < reqs_[static_cast<size_t>(b)].arrival_ms;
    });
    for (int r : by_time)
      schedule(Event::kArrival, r, reqs_[static_cast<size_t>(r)].arrival_ms, 0.0, trace);
    engine_.run([this](int task) { on_event(task); });
    return result();
  }

 private:
  struct Event {  // what a task of the engine stands for
    enum Kind { kArrival, kIterationEnd, kReady } kind = kArrival;
    int id = 0;  // the request (arrival) or the slice
  };
  struct Slice {
    int model = -1;   // served model index active (time sharing: loaded)
    int stream = -1;  // the engine's stream of its iterations
    std::deque<int> prefill;
    std::vector<int> decoding;
    bool busy = false;
    double ready_ms = 0;  // the active model's weights are usable from then
    AlphaController ctrl;
    IterCost cur;
    int prefill_req = -1;
    int64_t prefill_tokens = 0;
    double hbm_busy_ms = 0;
  };

  AlphaControllerOptions controller_options() const {
    AlphaControllerOptions c;
    c.latency_budget_ms = o_.tpot_ms;
    return c;
  }

  ServedModel served_model(const Served& m) const {
    ServedModel s;
    s.name = m.id;
    s.weight_bytes = m.arch->weight_bytes;
    s.tpot_ms = m.tpot_ms;
    s.ttft_ms = m.ttft_ms;
    s.kv_bytes_per_token = m.arch->kv_per_token;
    // The prefill profile on one slice alone (alpha 0, the whole link).
    for (int64_t c : {128, 256, 512, 1024, 2048}) {
      const IterCost k = iteration_cost(*m.arch, c, c * m.arch->kv_per_token, 0.0, specs_[0],
                                        link_gbps_, false, o_.efficiency);
      s.chunks.push_back({c, k.ms, c * m.arch->hidden * 16});
    }
    return s;
  }

  double now() const { return engine_.now_ms(); }

  // An event as a fixed task of the engine: it ends `ms` after it starts, which is not
  // before `at` (ms), on `stream` (-1: a timer).
  void schedule(Event::Kind kind, int id, double at, double ms, int stream) {
    sim::Task t;
    t.fixed = true;
    t.stream = stream;
    t.not_before_ms = at;
    t.work = ms;
    const auto task = static_cast<size_t>(engine_.add_task(t));
    if (task >= events_.size()) events_.resize(task + 1);
    events_[task] = Event{kind, id};
  }

  void on_event(int task) {
    const Event e = events_[static_cast<size_t>(task)];
    engine_.recycle(task);
    if (e.kind == Event::kArrival) {
      waiting_.push_back(e.id);
      drain_waiting();
    } else if (e.kind == Event::kIterationEnd) {
      end_iteration(e.id);
    } else {  // a model's load (cold start or reload) is done
      slices_[static_cast<size_t>(e.id)].ready_ms = now();
    }
    for (size_t s = 0; s < slices_.size(); ++s) maybe_start(static_cast<int>(s));
  }

  // Host memory: a model's weights are there, or load them (evicting LRU models that no
  // slice has active); returns when they are usable.
  double host_ready(int model) {
    auto it = host_.find(model);
    if (it != host_.end()) {
      it->second.last = now();
      return it->second.ready;
    }
    const Arch& a = *served_[static_cast<size_t>(model)].arch;
    const double budget = o_.host_budget_gb * 1e9;
    while (host_bytes_ + static_cast<double>(a.weight_bytes) > budget) {
      int victim = -1;
      double oldest = 0;
      for (const auto& [m, h] : host_) {
        bool active = false;
        for (const Slice& s : slices_) active = active || s.model == m;
        if (active || h.ready > now()) continue;
        if (victim < 0 || h.last < oldest) {
          victim = m;
          oldest = h.last;
        }
      }
      if (victim < 0) break;  // every resident model in use: over budget, counted
      host_bytes_ -= static_cast<double>(served_[static_cast<size_t>(victim)].arch->weight_bytes);
      host_.erase(victim);
    }
    const double ready = now() + static_cast<double>(a.weight_bytes) / (o_.disk_gbps * 1e6);
    host_[model] = {ready, now()};
    host_bytes_ += static_cast<double>(a.weight_bytes);
    ++cold_starts_;
    return ready;
  }

  void assign(int r, int slice, bool switched, int64_t chunk) {
    Request& q = reqs_[static_cast<size_t>(r)];
    Slice& s = slices_[static_cast<size_t>(slice)];
    q.slice = slice;
    q.chunk = chunk;
    if (switched) {
      ++switches_;
      q.switched = true;
      s.model = q.model;
      if (cfg_.weights_in_hbm) {  // time sharing: a reload of the weights into HBM
        const double reload =
            o_.reload_ms.empty()
                ? static_cast<double>(served_[static_cast<size_t>(q.model)].arch->weight_bytes) /
                      (link_gbps_ * 1e6)
                : o_.reload_ms[reload_next_++ % o_.reload_ms.size()];
        s.ready_ms = now() + reload;
        schedule(Event::kReady, slice, s.ready_ms, 0.0, -1);
      }
    }
    if (!cfg_.weights_in_hbm) {
      const int64_t cold_before = cold_starts_;
      const double ready = host_ready(q.model);
      q.cold = cold_starts_ > cold_before;
      if (ready > now()) schedule(Event::kReady, slice, ready, 0.0, -1);
      s.ready_ms = std::max(s.ready_ms, ready);
    }
    s.prefill.push_back(r);
  }

  // Tries the waiting requests in arrival order. Called when something changed (an
  // arrival, a request done); a model whose placement waited is not tried again in the
  // same pass (placing others only takes room).
  void drain_waiting() {
    std::deque<int> still;
    std::vector<char> waited(served_.size(), 0);
    while (!waiting_.empty()) {
      const int r = waiting_.front();
      waiting_.pop_front();
      const Request& q = reqs_[static_cast<size_t>(r)];
      if (cfg_.routing == Routing::kScheduler) {
        if (waited[static_cast<size_t>(q.model)] != 0) {
          still.push_back(r);
          continue;
        }
        const Served& m = served_[static_cast<size_t>(q.model)];
        const Placement p =
            sched_->place(m.id, q.prompt, q.output, now() - q.arrival_ms > m.ttft_ms);
        if (p.outcome == PlaceOutcome::kWait) {
          waited[static_cast<size_t>(q.model)] = 1;
          still.push_back(r);
          continue;
        }
        assign(r, p.slice, p.outcome != PlaceOutcome::kRouted, p.chunk_tokens);
      } else if (cfg_.routing == Routing::kDedicated) {
        assign(r, q.model, false, 512);
      } else {
        // Time sharing: the loaded model's requests join; another model waits until the
        // GPU is idle, then the oldest waiting request's model is loaded.
        Slice& s = slices_[0];
        const bool idle = !s.busy && s.prefill.empty() && s.decoding.empty();
        if (s.model == q.model && now() >= s.ready_ms - 1e-9) {
          assign(r, 0, false, 512);
        } else if (idle && still.empty()) {
          assign(r, 0, true, 512);
        } else {
          still.push_back(r);
        }
      }
    }
    waiting_ = std::move(still);
  }

  void maybe_start(int si) {
    Slice& s = slices_[static_cast<size_t>(si)];
    if (s.busy || s.model < 0 || now() < s.ready_ms - 1e-9) return;
    if (s.prefill.empty() && s.decoding.empty()) return;
    const Arch& a = *served_[static_cast<size_t>(s.model)].arch;
    int64_t kv = 0;
    for (int r : s.decoding) {
      const Request& q = reqs_[static_cast<size_t>(r)];
      kv += (q.prompt + q.generated) * a.kv_per_token;
    }
    s.prefill_req = -1;
    s.prefill_tokens = 0;
    if (!s.prefill.empty()) {
      const Request& q = reqs_[static_cast<size_t>(s.prefill.front())];
      s.prefill_req = s.prefill.front();
      s.prefill_tokens = std::min(q.chunk, q.prompt - q.prefilled);
    }
    const int64_t tokens = static_cast<int64_t>(s.decoding.size()) + s.prefill_tokens;
    kv += tokens * a.kv_per_token;
    int iterating = 1;
    for (const Slice& o : slices_) iterating += (&o != &s && o.busy) ? 1 : 0;
    const double alpha = cfg_.controller ? s.ctrl.alpha() : 0.0;
    s.cur = iteration_cost(a, tokens, kv, alpha, specs_[static_cast<size_t>(si)],
                           link_gbps_ / iterating, cfg_.weights_in_hbm, o_.efficiency);
    s.busy = true;
    link_bytes_ += static_cast<double>(s.cur.link_bytes);
    s.hbm_busy_ms += s.cur.hbm_ms;
    schedule(Event::kIterationEnd, si, 0.0, s.cur.ms, s.stream);
  }

  void end_iteration(int si) {
    Slice& s = slices_[static_cast<size_t>(si)];
    s.busy = false;
    if (cfg_.controller && !cfg_.weights_in_hbm)
      s.ctrl.update(s.cur.ms, s.cur.hbm_ms / s.cur.ms, s.cur.link_ms / s.cur.ms);
    std::vector<int> still;
    bool done = false;
    for (int r : s.decoding) {
      Request& q = reqs_[static_cast<size_t>(r)];
      if (++q.generated >= q.output) {
        finish(q, si);
        done = true;
      } else {
        still.push_back(r);
      }
    }
    s.decoding = std::move(still);
    if (s.prefill_req >= 0) {
      Request& q = reqs_[static_cast<size_t>(s.prefill_req)];
      q.prefilled += s.prefill_tokens;
      if (q.prefilled >= q.prompt) {
        s.prefill.pop_front();
        q.first_ms = now();
        q.generated = 1;
        if (q.generated >= q.output) {
          finish(q, si);
          done = true;
        } else {
          s.decoding.push_back(s.prefill_req);
        }
      }
    }
    if (done || (cfg_.routing == Routing::kTimeShare && s.prefill.empty() && s.decoding.empty()))
      drain_waiting();
  }

  void finish(Request& q, int si) {
    q.done_ms = now();
    if (sched_) sched_->finish(si, q.prompt, q.output);
  }

  ReplayResult result() {
    ReplayResult r;
    r.name = cfg_.name;
    r.requests = static_cast<int64_t>(reqs_.size());
    std::vector<double> ttft, tpot, sw, cold;
    int64_t ok = 0;
    double end = 0;
    for (const Request& q : reqs_) {
      if (q.done_ms < 0) continue;
      ++r.completed;
      end = std::max(end, q.done_ms);
      const double t1 = q.first_ms - q.arrival_ms;
      const double t2 =
          q.output > 1 ? (q.done_ms - q.first_ms) / static_cast<double>(q.output - 1) : 0.0;
      ttft.push_back(t1);
      tpot.push_back(t2);
      r.ttft_trace.emplace_back(q.arrival_ms / 1e3, t1);
      if (q.switched) sw.push_back(t1);
      if (q.cold) cold.push_back(t1);
      const Served& m = served_[static_cast<size_t>(q.model)];
      if (t1 <= m.ttft_ms && t2 <= m.tpot_ms) ++ok;
    }
    r.ttft_ms = stats_of(ttft);
    r.tpot_ms = stats_of(tpot);
    r.switch_ttft_ms = stats_of(sw);
    r.cold_ttft_ms = stats_of(cold);
    r.slo_attainment =
        r.completed > 0 ? static_cast<double>(ok) / static_cast<double>(r.requests) : 0.0;
    r.switches = switches_;
    r.cold_starts = cfg_.weights_in_hbm ? 0 : cold_starts_;
    r.makespan_s = end / 1e3;
    r.gpus = gpus_;
    if (end > 0) {
      r.link_utilization = link_bytes_ / (link_gbps_ * 1e6 * end);
      double h = 0;
      for (const Slice& s : slices_) h += s.hbm_busy_ms / end;
      r.hbm_utilization = h / static_cast<double>(slices_.size());
    }
    return r;
  }

  const Config& cfg_;
  const ReplayOptions& o_;
  const std::vector<Served>& served_;
  std::vector<Request> reqs_;
  std::vector<SliceSpec> specs_;
  double link_gbps_ = 0;
  int gpus_ = 1;
  std::vector<Slice> slices_;
  std::unique_ptr<Scheduler> sched_;
  sim::Engine engine_;
  std::vector<Event> events_;  // per task of the engine
  std::deque<int> waiting_;
  struct Host {
    double ready = 0, last = 0;
  };
  std::map<int, Host> host_;
  double host_bytes_ = 0;
  int64_t cold_starts_ = 0, switches_ = 0;
  size_t reload_next_ = 0;
  double link_bytes_ = 0;
};

}  // namespace

LatencyStats latency_stats(const std::vector<double>& v) {
  return stats_of(v);
}

std::vector<ReplayResult> run_replay(const std::vector<TraceRequest>& trace,
                                     const ReplayOptions& o) {
  if (trace.empty()) SPILLWAY_FIELD_ERROR("trace", 0, "must hold at least one request");
  if (!(o.time_scale > 0)) SPILLWAY_FIELD_ERROR("time_scale", o.time_scale, "must be > 0");
  // Time runs forward from the first request (Note [Replay on the engine]).
  for (size_t i = 0; i < trace.size(); ++i)
    if (!(trace[i].arrival_s >= 0))
      SPILLWAY_FIELD_ERROR(fmt::format("trace[{}].arrival_s", i), trace[i].arrival_s,
                           "must be >= 0 (seconds from the first request)");
  for (size_t i = 0; i < o.reload_ms.size(); ++i)
    if (!(o.reload_ms[i] >= 0))
      SPILLWAY_FIELD_ERROR(fmt::format("reload_ms[{}]", i), o.reload_ms[i], "must be >= 0");
  if (o.models.empty() && o.architectures.empty())
    SPILLWAY_FIELD_ERROR("models", 0, "must name at least one model");
  const HardwareProfile hw = load_hardware(o.hardware);
  std::vector<Arch> archs;
  if (!o.architectures.empty())
    for (const ModelConfig& m : o.architectures)
      archs.push_back(arch_of(m, o.weight_bytes_per_param));
  else
    for (const std::string& m : o.models)
      archs.push_back(arch_of(load_model(m), o.weight_bytes_per_param));
  // The trace's model ids by popularity, dealt round-robin over the architectures.
  const std::vector<std::string> by = models_by_popularity(trace);
  std::map<std::string, int> index;
  std::vector<Served> served;
  const double link = hw.h2d_typical.value;
  for (size_t i = 0; i < by.size(); ++i) {
    Served s;
    s.id = by[i];
    s.arch = &archs[i % archs.size()];
    // The TPOT target, or what the link allows a model streamed alone (x 1.25).
    s.tpot_ms =
        std::max(o.tpot_ms, 1.25 * static_cast<double>(s.arch->weight_bytes) / (link * 1e6));
    s.ttft_ms = o.ttft_ms;
    index[s.id] = static_cast<int>(i);
    served.push_back(s);
  }
  const std::vector<std::pair<int64_t, int64_t>> lengths = draw_token_counts(trace.size(), o);
  std::vector<Request> reqs;
  for (size_t i = 0; i < trace.size(); ++i) {
    Request r;
    r.arrival_ms = trace[i].arrival_s * 1e3 / o.time_scale;
    r.model = index[trace[i].model];
    r.prompt = lengths[i].first;
    r.output = lengths[i].second;
    reqs.push_back(r);
  }
  std::vector<Config> configs(6);
  configs[0].name = "host-resident";
  configs[1].name = "random placement";
  configs[1].sched.random_placement = true;
  configs[1].sched.seed = o.seed;
  configs[2].name = "default chunk (512)";
  configs[2].sched.fixed_chunk = 512;
  configs[3].name = "static alpha (0)";
  configs[3].controller = false;
  configs[4].name = "dedicated GPUs";
  configs[4].routing = Routing::kDedicated;
  configs[4].weights_in_hbm = true;
  configs[5].name = "time sharing + reload";
  configs[5].routing = Routing::kTimeShare;
  configs[5].weights_in_hbm = true;
  if (!o.baselines) configs.resize(1);
  std::vector<ReplayResult> out;
  out.reserve(configs.size());
  for (const Config& c : configs) out.push_back(Sim(c, o, hw, served, reqs).run());
  return out;
}

}  // namespace spillway

// Trace replay of host-resident serving (spillway/replay.hpp, Note [Replay model]), a
// client of the simulator's engine (Note [Replay on the engine]).
#include "spillway/replay.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <deque>
#include <fstream>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "spillway/error.hpp"
#include "spillway/hardware.hpp"
#include "spillway/hybrid_gemm.hpp"
#include "spillway/model.hpp"
#include "spillway/scheduler.hpp"
#include "spillway/sim.hpp"
#include "spillway/slices.hpp"

namespace spillway {
namespace {

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : line) {
    if (ch == ',') {
      out.push_back(cur);
      cur.clear();
    } else if (ch != '\r') {
      cur += ch;
    }
  }
  out.push_back(cur);
  return out;
}

int column(const std::vector<std::string>& header, const std::string& name,
           const std::string& path) {
  for (size_t i = 0; i < header.size(); ++i)
    if (header[i] == name) return static_cast<int>(i);
  SPILLWAY_INPUT_ERROR("{}: no column '{}' in the header", path, name);
}

// "YYYY-MM-DD HH:MM:SS" as seconds (UTC).
double parse_time(const std::string& s, const std::string& path, int64_t line) {
  std::tm tm{};
  std::istringstream in(s);
  in >> std::get_time(&tm, "%Y-%m-%d %H:%M:%S");
  if (in.fail())
    SPILLWAY_INPUT_ERROR("{}:{}: gmt_create is '{}'; expected YYYY-MM-DD HH:MM:SS", path, line, s);
  return static_cast<double>(timegm(&tm));
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double at = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(at));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (at - static_cast<double>(lo));
}

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
  // (spillway/sim.hpp, Note [Engine clients]): each event is a fixed task, so the engine
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

std::vector<TraceRequest> read_request_trace(const std::string& path, int64_t max_requests,
                                             int64_t* skipped) {
  if (skipped != nullptr) *skipped = 0;
  std::ifstream in(path);
  if (!in) SPILLWAY_INPUT_ERROR("{}: cannot open the request trace", path);
  std::string line;
  if (!std::getline(in, line)) SPILLWAY_INPUT_ERROR("{}: empty (no header)", path);
  const std::vector<std::string> header = split_csv(line);
  const int tcol = column(header, "gmt_create", path);
  const int mcol = column(header, "checkpoint_model_version_id", path);
  std::vector<std::pair<double, std::string>> rows;
  int64_t n = 1;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    const std::vector<std::string> f = split_csv(line);
    if (static_cast<int>(f.size()) <= std::max(tcol, mcol))
      SPILLWAY_INPUT_ERROR("{}:{}: {} fields; the header has {}", path, n, f.size(), header.size());
    if (f[static_cast<size_t>(mcol)].empty()) {  // a request with no model (PENDING rows)
      if (skipped != nullptr) ++*skipped;
      continue;
    }
    rows.emplace_back(parse_time(f[static_cast<size_t>(tcol)], path, n),
                      f[static_cast<size_t>(mcol)]);
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  if (max_requests > 0 && static_cast<int64_t>(rows.size()) > max_requests)
    rows.resize(static_cast<size_t>(max_requests));
  std::vector<TraceRequest> out;
  out.reserve(rows.size());
  for (const auto& [t, m] : rows) out.push_back({t - rows.front().first, m});
  return out;
}

std::vector<double> read_reload_latencies_ms(const std::string& path) {
  std::ifstream in(path);
  if (!in) SPILLWAY_INPUT_ERROR("{}: cannot open the reload latencies", path);
  std::string line;
  if (!std::getline(in, line)) SPILLWAY_INPUT_ERROR("{}: empty (no header)", path);
  const int vcol = column(split_csv(line), "value", path);
  std::vector<double> out;
  int64_t n = 1;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    const std::vector<std::string> f = split_csv(line);
    try {
      out.push_back(std::stod(f.at(static_cast<size_t>(vcol))));
    } catch (const std::exception&) {
      SPILLWAY_INPUT_ERROR("{}:{}: value is not a number", path, n);
    }
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> draw_token_counts(size_t n, const ReplayOptions& o) {
  if (o.prompt_min < 1 || o.prompt_max < o.prompt_min)
    SPILLWAY_FIELD_ERROR("prompt_max", o.prompt_max, "must be >= prompt_min ({}) >= 1",
                         o.prompt_min);
  if (o.output_min < 1 || o.output_max < o.output_min)
    SPILLWAY_FIELD_ERROR("output_max", o.output_max, "must be >= output_min ({}) >= 1",
                         o.output_min);
  std::mt19937_64 g(o.seed);
  std::lognormal_distribution<double> prompt(std::log(o.prompt_median), o.prompt_sigma);
  std::lognormal_distribution<double> output(std::log(o.output_median), o.output_sigma);
  std::vector<std::pair<int64_t, int64_t>> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t p = std::clamp<int64_t>(std::llround(prompt(g)), o.prompt_min, o.prompt_max);
    const int64_t q = std::clamp<int64_t>(std::llround(output(g)), o.output_min, o.output_max);
    out.emplace_back(p, q);
  }
  return out;
}

LatencyStats latency_stats(const std::vector<double>& v) {
  return stats_of(v);
}

std::vector<std::string> models_by_popularity(const std::vector<TraceRequest>& trace) {
  std::map<std::string, int64_t> count;
  for (const TraceRequest& t : trace) ++count[t.model];
  std::vector<std::pair<int64_t, std::string>> by;
  by.reserve(count.size());
  for (const auto& [m, c] : count) by.emplace_back(-c, m);
  std::sort(by.begin(), by.end());
  std::vector<std::string> out;
  out.reserve(by.size());
  for (auto& [c, m] : by) out.push_back(std::move(m));
  return out;
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

namespace {
std::vector<std::string> model_names(const ReplayOptions& o) {
  if (o.architectures.empty()) return o.models;
  std::vector<std::string> n;
  for (const ModelConfig& m : o.architectures) n.push_back(m.name);
  return n;
}
}  // namespace

std::string format_replay(const std::vector<ReplayResult>& r, const ReplayOptions& o,
                          int64_t distinct_models) {
  std::string s = fmt::format(
      "{} requests of {} trace models on {} ({} slices), models dealt over {}; arrivals x{:g}\n"
      "token counts are not in the trace: prompts log-normal (median {:g}, sigma {:g}, {}-{}), "
      "outputs log-normal (median {:g}, sigma {:g}, {}-{}), seed {}\n"
      "SLO: TTFT <= {:g} ms and TPOT <= max({:g} ms, 1.25 x weights / link)\n",
      r.empty() ? 0 : r[0].requests, distinct_models, o.hardware, o.profile,
      fmt::join(model_names(o), ", "), o.time_scale, o.prompt_median, o.prompt_sigma, o.prompt_min,
      o.prompt_max, o.output_median, o.output_sigma, o.output_min, o.output_max, o.seed, o.ttft_ms,
      o.tpot_ms);
  s += fmt::format("{:<24} {:>5} {:>27} {:>22} {:>6} {:>8} {:>12} {:>5} {:>12} {:>6} {:>6}\n", "",
                   "GPUs", "TTFT ms p50/p95/p99", "TPOT ms p50/p95/p99", "SLO", "switches",
                   "switch TTFT", "cold", "cold TTFT", "link", "HBM");
  for (const ReplayResult& x : r)
    s += fmt::format(
        "{:<24} {:>5} {:>9.0f}/{:>8.0f}/{:>8.0f} {:>7.1f}/{:>6.1f}/{:>7.1f} {:>5.1f}% {:>8} "
        "{:>10.0f}ms {:>5} {:>10.0f}ms {:>5.1f}% {:>5.1f}%\n",
        x.name, x.gpus, x.ttft_ms.p50, x.ttft_ms.p95, x.ttft_ms.p99, x.tpot_ms.p50, x.tpot_ms.p95,
        x.tpot_ms.p99, 100.0 * x.slo_attainment, x.switches, x.switch_ttft_ms.p50, x.cold_starts,
        x.cold_ttft_ms.p50, 100.0 * x.link_utilization, 100.0 * x.hbm_utilization);
  s += "switch TTFT, cold TTFT: the median TTFT of the requests that gave a slice another "
       "model, and of those whose model was loaded from disk first\n";
  return s;
}

std::string replay_json(const std::vector<ReplayResult>& r, const ReplayOptions& o) {
  nlohmann::json j;
  j["schema"] = "spillway.replay/1";
  j["hardware"] = o.hardware;
  j["profile"] = o.profile;
  j["models"] = model_names(o);
  j["time_scale"] = o.time_scale;
  j["seed"] = o.seed;
  j["lengths"] = {{"prompt_median", o.prompt_median},
                  {"prompt_sigma", o.prompt_sigma},
                  {"output_median", o.output_median},
                  {"output_sigma", o.output_sigma},
                  {"note", "drawn: the trace has no token counts"}};
  for (const ReplayResult& x : r) {
    auto st = [](const LatencyStats& l) {
      return nlohmann::json{{"p50", l.p50}, {"p95", l.p95}, {"p99", l.p99}};
    };
    j["configurations"].push_back({{"name", x.name},
                                   {"gpus", x.gpus},
                                   {"requests", x.requests},
                                   {"completed", x.completed},
                                   {"ttft_ms", st(x.ttft_ms)},
                                   {"tpot_ms", st(x.tpot_ms)},
                                   {"slo_attainment", x.slo_attainment},
                                   {"switches", x.switches},
                                   {"switch_ttft_ms", st(x.switch_ttft_ms)},
                                   {"cold_starts", x.cold_starts},
                                   {"cold_ttft_ms", st(x.cold_ttft_ms)},
                                   {"link_utilization", x.link_utilization},
                                   {"hbm_utilization", x.hbm_utilization},
                                   {"makespan_s", x.makespan_s}});
  }
  return j.dump(2) + "\n";
}

std::string replay_svg(const std::vector<ReplayResult>& r) {
  // Per configuration, the TTFT's median and 95th percentile over the requests arriving in
  // each of kBins slices of the replay (log scale): compact whatever the trace's length.
  constexpr int kBins = 60;
  const double w = 900, h = 420, left = 70, right = 200, top = 30, bottom = 50;
  double tmax = 1e-9, ymin = 1e9, ymax = 1.0;
  for (const ReplayResult& x : r)
    for (const auto& [t, y] : x.ttft_trace) {
      tmax = std::max(tmax, t);
      ymin = std::min(ymin, std::max(y, 1.0));
      ymax = std::max(ymax, y);
    }
  ymin = std::pow(10.0, std::floor(std::log10(std::max(ymin, 1.0))));
  ymax = std::pow(10.0, std::ceil(std::log10(std::max(ymax, 10.0))));
  auto X = [&](double t) { return left + (w - left - right) * t / tmax; };
  auto Y = [&](double y) {
    return top +
           (h - top - bottom) * (1.0 - (std::log10(std::max(y, ymin)) - std::log10(ymin)) /
                                           std::max(1e-9, std::log10(ymax) - std::log10(ymin)));
  };
  static const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"};
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
      "fill=\"white\"/>\n<text x=\"{}\" y=\"18\">TTFT over the replay: median (solid) and "
      "95th percentile (dashed) of the requests arriving in each of {} intervals</text>\n",
      w, h, left, kBins);
  for (double d = ymin; d <= ymax * 1.001; d *= 10)
    s += fmt::format(
        "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" stroke=\"#ddd\"/><text "
        "x=\"5\" y=\"{3:.1f}\">{4:g} ms</text>\n",
        left, w - right, Y(d), Y(d) + 4, d);
  s += fmt::format("<text x=\"{}\" y=\"{}\">arrival (s of the replay, {:.0f} s)</text>\n", left,
                   h - 15, tmax);
  for (size_t i = 0; i < r.size(); ++i) {
    const char* c = colors[i % 6];
    std::vector<std::vector<double>> bins(kBins);
    for (const auto& [t, y] : r[i].ttft_trace) {
      const int b = std::min(kBins - 1, static_cast<int>(t / tmax * kBins));
      bins[static_cast<size_t>(b)].push_back(y);
    }
    for (double q : {0.5, 0.95}) {
      std::string pts;
      for (int b = 0; b < kBins; ++b) {
        const std::vector<double>& v = bins[static_cast<size_t>(b)];
        if (v.empty()) continue;
        pts += fmt::format("{:.1f},{:.1f} ", X((b + 0.5) * tmax / kBins), Y(percentile(v, q)));
      }
      s += fmt::format(
          "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"{}/>\n", pts, c,
          q > 0.5 ? " stroke-dasharray=\"4 3\"" : "");
    }
    s += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" "
        "y=\"{}\">{}</text>\n",
        w - right + 10, top + 20.0 * static_cast<double>(i), c, w - right + 25,
        top + 20.0 * static_cast<double>(i) + 10, r[i].name);
  }
  return s + "</svg>\n";
}

}  // namespace spillway

// The serving scheduler and the alpha controller (spillway/serve/scheduler.hpp, Note [Serving
// scheduler], Note [Alpha controller]).
#include "spillway/serve/scheduler.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/enum_names.hpp"
#include "spillway/core/error.hpp"

namespace spillway {

constexpr EnumNames<PlaceOutcome, 4> kPlaceOutcomeNames = {{{PlaceOutcome::kRouted, "routed"},
                                                            {PlaceOutcome::kPlaced, "placed"},
                                                            {PlaceOutcome::kEvicted, "evicted"},
                                                            {PlaceOutcome::kWait, "wait"}}};

const char* to_string(PlaceOutcome o) {
  return name_of(kPlaceOutcomeNames, o).data();  // a literal: null-terminated
}

Scheduler::Scheduler(std::vector<SliceSpec> slices, double link_gbps, const SchedulerOptions& o)
    : specs_(std::move(slices)),
      status_(specs_.size()),
      link_gbps_(link_gbps),
      opt_(o),
      rng_(o.seed * 0x9E3779B97F4A7C15ULL + 1) {
  if (o.fixed_chunk < 0) SPILLWAY_FIELD_ERROR("fixed_chunk", o.fixed_chunk, "must be >= 0");
  if (specs_.empty()) SPILLWAY_FIELD_ERROR("slices", 0, "must be >= 1");
  if (!(link_gbps > 0)) SPILLWAY_FIELD_ERROR("link_gbps", link_gbps, "must be > 0");
}

const ServedModel* Scheduler::find(const std::string& name) const {
  for (const ServedModel& m : models_)
    if (m.name == name) return &m;
  return nullptr;
}

void Scheduler::add_model(const ServedModel& m) {
  if (m.name.empty()) SPILLWAY_FIELD_ERROR("name", "''", "must not be empty");
  if (find(m.name) != nullptr) SPILLWAY_FIELD_ERROR("name", m.name, "is already served");
  if (m.weight_bytes < 1) SPILLWAY_FIELD_ERROR("weight_bytes", m.weight_bytes, "must be >= 1");
  if (!(m.tpot_ms > 0)) SPILLWAY_FIELD_ERROR("tpot_ms", m.tpot_ms, "must be > 0 ({})", m.name);
  if (!(m.ttft_ms > 0)) SPILLWAY_FIELD_ERROR("ttft_ms", m.ttft_ms, "must be > 0 ({})", m.name);
  if (m.kv_bytes_per_token < 0)
    SPILLWAY_FIELD_ERROR("kv_bytes_per_token", m.kv_bytes_per_token, "must be >= 0");
  if (m.chunks.empty())
    SPILLWAY_FIELD_ERROR("chunks", 0, "must list the prefill profile ({})", m.name);
  for (const ChunkCost& c : m.chunks)
    if (c.tokens < 1 || !(c.ms > 0) || c.hbm_bytes < 0)
      SPILLWAY_FIELD_ERROR("chunks", fmt::format("{{{}, {}, {}}}", c.tokens, c.ms, c.hbm_bytes),
                           "need tokens >= 1, ms > 0, hbm_bytes >= 0 ({})", m.name);
  ServedModel k = m;
  std::sort(k.chunks.begin(), k.chunks.end(),
            [](const ChunkCost& a, const ChunkCost& b) { return a.tokens < b.tokens; });
  models_.push_back(std::move(k));
}

const ServedModel& Scheduler::model(const std::string& name) const {
  const ServedModel* m = find(name);
  if (m == nullptr) SPILLWAY_FIELD_ERROR("model", "'" + name + "'", "is not served");
  return *m;
}

double Scheduler::link_demand_gbps() const {
  // Models with requests running: an idle model on its slice streams nothing.
  double d = 0.0;
  for (const SliceStatus& s : status_)
    if (!s.model.empty() && s.running > 0) {
      const ServedModel& m = model(s.model);
      d += static_cast<double>(m.weight_bytes) / (m.tpot_ms * 1e6);
    }
  return d;
}

Placement Scheduler::place(const std::string& name, int64_t prompt_tokens, int64_t max_new_tokens,
                           bool overdue) {
  const ServedModel& m = model(name);
  if (prompt_tokens < 1) SPILLWAY_FIELD_ERROR("prompt_tokens", prompt_tokens, "must be >= 1");
  if (max_new_tokens < 0) SPILLWAY_FIELD_ERROR("max_new_tokens", max_new_tokens, "must be >= 0");
  const int64_t kv = m.kv_bytes_per_token * (prompt_tokens + max_new_tokens);
  const double demand_m = static_cast<double>(m.weight_bytes) / (m.tpot_ms * 1e6);
  const double demand = link_demand_gbps();
  Placement p;
  // The prefill time with chunks of c: ceil(p / c.tokens) chunks.
  auto prefill_ms = [&](const ChunkCost& c) {
    const int64_t chunks = (prompt_tokens + c.tokens - 1) / c.tokens;
    return static_cast<double>(chunks) * c.ms;
  };
  // The chunk for a slice with `free` bytes of HBM left after the KV cache.
  auto choose_chunk = [&](int64_t free) {
    if (opt_.fixed_chunk > 0) {  // ablation: one chunk size, the nearest the table has
      const ChunkCost* near = nullptr;
      for (const ChunkCost& c : m.chunks)
        if (c.hbm_bytes <= free &&
            (near == nullptr ||
             std::llabs(c.tokens - opt_.fixed_chunk) < std::llabs(near->tokens - opt_.fixed_chunk)))
          near = &c;
      if (near == nullptr) return false;
      p.chunk_tokens = near->tokens;
      p.prefill_ms = prefill_ms(*near);
      p.meets_ttft = p.prefill_ms <= m.ttft_ms;
      return true;
    }
    const ChunkCost* fastest = nullptr;
    for (const ChunkCost& c : m.chunks) {
      if (c.hbm_bytes > free) continue;
      const double ms = prefill_ms(c);
      if (fastest == nullptr || ms < prefill_ms(*fastest)) fastest = &c;
      if (ms <= m.ttft_ms) {
        p.chunk_tokens = c.tokens;
        p.prefill_ms = ms;
        p.meets_ttft = true;
        return true;
      }
    }
    if (fastest == nullptr) return false;
    p.chunk_tokens = fastest->tokens;
    p.prefill_ms = prefill_ms(*fastest);
    p.meets_ttft = false;
    return true;
  };
  auto take = [&](int slice, PlaceOutcome outcome) {
    SliceStatus& s = status_[static_cast<size_t>(slice)];
    s.model = name;
    ++s.running;
    s.kv_bytes += kv;
    s.last_use = ++tick_;
    p.outcome = outcome;
    p.slice = slice;
    return p;
  };
  std::string why;
  // 1. Active: route there (the slice with the fewest running requests that has room).
  int best = -1;
  for (size_t i = 0; i < status_.size(); ++i) {
    const SliceStatus& s = status_[i];
    if (s.model != name) continue;
    const int64_t free = specs_[i].hbm_bytes - s.kv_bytes - kv;
    if (free < 0) {
      why += fmt::format("slice {} (active): its HBM holds {} of KV cache, {} more do not fit; ", i,
                         s.kv_bytes, kv);
      continue;
    }
    if (best < 0 || s.running < status_[static_cast<size_t>(best)].running)
      best = static_cast<int>(i);
  }
  if (best >= 0) {
    const auto b = static_cast<size_t>(best);
    if (choose_chunk(specs_[b].hbm_bytes - status_[b].kv_bytes - kv))
      return take(best, PlaceOutcome::kRouted);
  }
  if (opt_.random_placement) {
    // Ablation: any slice idle or with nothing running, at random; no link-demand check.
    std::vector<int> free_slices;
    for (size_t i = 0; i < status_.size(); ++i)
      if (status_[i].running == 0 && specs_[i].hbm_bytes >= kv)
        free_slices.push_back(static_cast<int>(i));
    if (!free_slices.empty()) {
      rng_ = rng_ * 6364136223846793005ULL + 1442695040888963407ULL;
      const int pick = free_slices[(rng_ >> 33) % free_slices.size()];
      const auto v = static_cast<size_t>(pick);
      if (choose_chunk(specs_[v].hbm_bytes - kv)) {
        const bool had = !status_[v].model.empty();
        p.evicted = had ? status_[v].model : "";
        status_[v] = SliceStatus{};
        return take(pick, had ? PlaceOutcome::kEvicted : PlaceOutcome::kPlaced);
      }
    }
    p.outcome = PlaceOutcome::kWait;
    p.why = why + "every slice has requests running";
    return p;
  }
  // 2. An idle slice, if the link can carry one more active model.
  // A model whose demand alone exceeds the link still gets a slice when nothing else is
  // active (served late rather than never).
  const bool link_fits = demand + demand_m <= link_gbps_ || demand == 0.0 || overdue;
  for (size_t i = 0; i < status_.size(); ++i) {
    if (!status_[i].model.empty()) continue;
    if (!link_fits) {
      why += fmt::format("idle slice {}: the link demand would be {:.1f} GB/s of {:.1f}; ", i,
                         demand + demand_m, link_gbps_);
      break;
    }
    if (specs_[i].hbm_bytes < kv || !choose_chunk(specs_[i].hbm_bytes - kv)) {
      why += fmt::format("idle slice {}: {} bytes of HBM cannot hold the request; ", i,
                         specs_[i].hbm_bytes);
      continue;
    }
    return take(static_cast<int>(i), PlaceOutcome::kPlaced);
  }
  // 3. A slice whose model has nothing running: lowest priority, then least recently used.
  int victim = -1;
  for (size_t i = 0; i < status_.size(); ++i) {
    const SliceStatus& s = status_[i];
    if (s.model.empty() || s.model == name || s.running > 0) continue;
    const ServedModel& o = model(s.model);
    const double after = demand + demand_m;  // o has nothing running: it streams nothing
    if ((after > link_gbps_ && !overdue) || specs_[i].hbm_bytes < kv) continue;
    if (victim < 0) {
      victim = static_cast<int>(i);
      continue;
    }
    const SliceStatus& v = status_[static_cast<size_t>(victim)];
    const int pv = model(v.model).priority;
    if (o.priority < pv || (o.priority == pv && s.last_use < v.last_use))
      victim = static_cast<int>(i);
  }
  if (victim >= 0) {
    const auto v = static_cast<size_t>(victim);
    if (choose_chunk(specs_[v].hbm_bytes - kv)) {
      p.evicted = status_[v].model;
      status_[v] = SliceStatus{};
      return take(victim, PlaceOutcome::kEvicted);
    }
  }
  p.outcome = PlaceOutcome::kWait;
  p.why = why + "every other slice serves a model with requests running";
  return p;
}

void Scheduler::finish(int slice, int64_t prompt_tokens, int64_t max_new_tokens) {
  if (slice < 0 || slice >= static_cast<int>(status_.size()))
    SPILLWAY_FIELD_ERROR("slice", slice, "must be in [0, {})", status_.size());
  SliceStatus& s = status_[static_cast<size_t>(slice)];
  SPILLWAY_CHECK(s.running > 0, "finish() on slice {} with no request running", slice);
  --s.running;
  s.kv_bytes -= model(s.model).kv_bytes_per_token * (prompt_tokens + max_new_tokens);
  SPILLWAY_CHECK(s.kv_bytes >= 0, "slice {}: KV bytes went negative", slice);
  s.last_use = ++tick_;
}

// ---- alpha ---------------------------------------------------------------------------------

AlphaController::AlphaController(const AlphaControllerOptions& o) : o_(o) {
  if (!(o.ema > 0 && o.ema <= 1)) SPILLWAY_FIELD_ERROR("ema", o.ema, "must be in (0, 1]");
  if (!(o.tau >= 0 && o.tau < 1)) SPILLWAY_FIELD_ERROR("tau", o.tau, "must be in [0, 1)");
  if (!(o.eta_slow > 0 && o.eta_fast >= o.eta_slow && o.eta_fast <= 1))
    SPILLWAY_FIELD_ERROR("eta_fast", o.eta_fast, "must be in [eta_slow ({}), 1]", o.eta_slow);
  if (!(o.eta_min > 0 && o.eta_min <= o.eta_slow))
    SPILLWAY_FIELD_ERROR("eta_min", o.eta_min, "must be in (0, eta_slow]");
  if (!(o.latency_budget_ms > 0))
    SPILLWAY_FIELD_ERROR("latency_budget_ms", o.latency_budget_ms, "must be > 0");
}

double AlphaController::update(double latency_ms, double u_hbm, double u_link) {
  if (!primed_) {
    l_ = latency_ms;
    u_hbm_ = u_hbm;
    u_link_ = u_link;
    primed_ = true;
  } else {
    l_ += o_.ema * (latency_ms - l_);
    u_hbm_ += o_.ema * (u_hbm - u_hbm_);
    u_link_ += o_.ema * (u_link - u_link_);
  }
  const double delta = u_link_ - u_hbm_;
  if (std::fabs(delta) < o_.tau) return alpha_;
  const int dir = delta > 0 ? -1 : 1;  // link busier: toward weight-stationary (alpha down)
  if (last_dir_ != 0 && dir != last_dir_) {
    ++reversals_;
    shrink_ *= 0.5;
  }
  last_dir_ = dir;
  const double eta = l_ > o_.latency_budget_ms ? o_.eta_fast : o_.eta_slow;
  const double step = std::max(o_.eta_min, eta * shrink_);
  alpha_ = std::clamp(alpha_ + dir * step, 0.0, 1.0);
  return alpha_;
}

}  // namespace spillway

// The choice under the HBM budget: the greedy trade of time for bytes, then, when the
// budget binds, the budget search (Note [Budget search]) from several starts.
#include <algorithm>
#include <limits>

#include "plan/planner.hpp"

namespace spillway::planner {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Whether a timeline fits: peak HBM within the budget, pinned host memory within the
// host's share of one GPU, and no snowball.
bool fits(const Timeline& t, const Stage& st, double host_limit) {
  return t.peak.total() <= st.budget && static_cast<double>(t.host_pinned) <= host_limit &&
         t.snowball_layers.empty();
}

// Note [Budget search]: take the move that saves the most step time and keeps the plan
// feasible, until none is left. A move is screened with an O(1) estimate of the peak (the
// kept sum and the two max terms, the layer's own contribution taken out through the top
// two values) and confirmed by a timeline; a move the timeline rejects (a snowball, a
// real peak over budget) is struck from that layer's options.
// `repair` (when the choice does not fit): the move that lowers the estimated peak most
// per millisecond it costs; `improve` (when it fits): the move that saves the most time
// per byte it adds (moves that add none first), keeping the estimate within the budget.
void search_moves(const Stage& st, const LayerOptions& lo, double host_limit, Allowed& allowed,
                  Choice& c, bool repair) {
  const size_t n = st.layers.size();
  std::vector<const Option*>& ch = c.options;
  Timeline& t = c.timeline;
  for (int moves = 0; moves < 8 * static_cast<int>(n) + 16; ++moves) {
    if (repair && fits(t, st, host_limit)) return;
    int64_t kept = 0;
    int64_t pinned = 0;
    int64_t w1 = 0, w2 = 0, f1 = 0, f2 = 0;  // top two re-materialized / offload bytes
    for (size_t l = 0; l < n; ++l) {
      const ActionCost& cost = ch[l]->cost;
      kept += cost.kept_bytes;
      pinned += cost.offload_bytes;
      const int64_t w = cost.rematerialized_bytes;
      if (w > w1) {
        w2 = w1;
        w1 = w;
      } else if (w > w2) {
        w2 = w;
      }
      const int64_t f = cost.offload_bytes;
      if (f > f1) {
        f2 = f1;
        f1 = f;
      } else if (f > f2) {
        f2 = f;
      }
    }
    auto estimate = [&](int64_t k, int64_t w, int64_t f) {
      return st.static_bytes + k * st.mb_inflight + std::max(w, st.logits_bytes) + f * st.prefetch;
    };
    const int64_t peak_now = estimate(kept, w1, f1);
    double best_score = 0.0;
    size_t best_l = n;
    const Option* best_o = nullptr;
    for (size_t l = 0; l < n; ++l) {
      const ActionCost& cur = ch[l]->cost;
      const double t_cur = option_time(*ch[l], st, l);
      const int64_t w_rest = cur.rematerialized_bytes == w1 ? w2 : w1;
      const int64_t f_rest = cur.offload_bytes == f1 ? f2 : f1;
      for (const Option* o : allowed[l]) {
        if (o == ch[l]) continue;
        const double gain = t_cur - option_time(*o, st, l);
        const int64_t peak = estimate(kept - cur.kept_bytes + o->cost.kept_bytes,
                                      std::max(w_rest, o->cost.rematerialized_bytes),
                                      std::max(f_rest, o->cost.offload_bytes));
        const int64_t pin = (pinned - cur.offload_bytes + o->cost.offload_bytes) * st.mb_inflight;
        const double added = static_cast<double>(peak - peak_now);
        double score = 0.0;
        if (repair) {
          if (added >= 0.0) continue;
          score = -added / std::max(-gain, 1e-6);
        } else {
          if (gain <= 1e-9 || peak > st.budget || static_cast<double>(pin) > host_limit) continue;
          score = added <= 0.0 ? 1e30 + gain : gain / added;
        }
        if (score > best_score) {
          best_score = score;
          best_l = l;
          best_o = o;
        }
      }
    }
    if (best_o == nullptr) return;
    const Option* before = ch[best_l];
    ch[best_l] = best_o;
    Timeline t2 = run_timeline(st, ch, lo.recompute_ms, false);
    if (repair ? t2.snowball_layers.empty() : fits(t2, st, host_limit)) {
      t = std::move(t2);
    } else {
      ch[best_l] = before;
      auto& a = allowed[best_l];
      a.erase(std::remove(a.begin(), a.end(), best_o), a.end());
    }
  }
}

// The starts of the budget search: the smallest-memory choice, block recompute everywhere
// (auto and selective), each offloading policy on every layer that allows it (auto), and
// the greedy choice last.
std::vector<std::vector<const Option*>> search_starts(const LayerOptions& lo,
                                                      const Allowed& allowed, Policy strategy,
                                                      const std::vector<const Option*>& greedy) {
  const size_t n = allowed.size();
  std::vector<std::vector<const Option*>> starts;
  std::vector<const Option*> small(n);
  for (size_t l = 0; l < n; ++l) {
    small[l] = allowed[l].front();
    for (const Option* o : allowed[l]) {
      const Option* b = small[l];
      if (o->cost.kept_bytes < b->cost.kept_bytes ||
          (o->cost.kept_bytes == b->cost.kept_bytes &&
           o->cost.offload_bytes < b->cost.offload_bytes)) {
        small[l] = o;
      }
    }
  }
  starts.push_back(std::move(small));
  if (strategy == Policy::kAuto || strategy == Policy::kSelective) {
    std::vector<const Option*> rec(n);
    for (size_t l = 0; l < n; ++l) rec[l] = &lo.at(l).recompute;
    starts.push_back(std::move(rec));
  }
  if (strategy == Policy::kAuto) {
    // Uniform starts (one policy on every layer that allows it, recompute elsewhere): a
    // policy that pays only once in the peak (in-flight copies) is reached as a whole.
    for (Option OptionSet::*member :
         {&OptionSet::hybrid, &OptionSet::offload, &OptionSet::selective_recompute}) {
      std::vector<const Option*> uni(n);
      for (size_t l = 0; l < n; ++l) {
        const Option* o = &(lo.at(l).*member);
        const bool ok = std::find(allowed[l].begin(), allowed[l].end(), o) != allowed[l].end();
        uni[l] = ok ? o : &lo.at(l).recompute;
      }
      starts.push_back(std::move(uni));
    }
  }
  starts.push_back(greedy);
  return starts;
}

}  // namespace

Choice choose_greedy(const Stage& st, const LayerOptions& lo, Allowed& allowed, Policy strategy) {
  const size_t n = st.layers.size();
  Choice c;
  c.options.resize(n);
  std::vector<const Option*>& choice = c.options;
  for (size_t l = 0; l < n; ++l) choice[l] = fastest_option(allowed[l], st, l);

  Timeline& tl = c.timeline;
  for (int round = 0; round < 4 * static_cast<int>(n) + 8; ++round) {
    tl = run_timeline(st, choice, lo.recompute_ms, false);
    while (tl.peak.total() > st.budget) {
      double best_ratio = kInf;
      size_t best_l = n;
      const Option* best_o = nullptr;
      for (size_t l = 0; l < n; ++l) {
        const Option* cur = choice[l];
        for (const Option* o : allowed[l]) {
          const int64_t saved = cur->cost.kept_bytes - o->cost.kept_bytes;
          if (saved <= 0) continue;
          const double dt = option_time(*o, st, l) - option_time(*cur, st, l);
          const double ratio = dt / static_cast<double>(saved);
          if (ratio < best_ratio) {
            best_ratio = ratio;
            best_l = l;
            best_o = o;
          }
        }
      }
      if (best_o == nullptr) break;  // nothing left to trade
      choice[best_l] = best_o;
      tl = run_timeline(st, choice, lo.recompute_ms, false);
    }
    if (strategy != Policy::kAuto || tl.snowball_layers.empty()) break;
    // Auto: a layer that misses its window once neighbours' copies are counted gives up
    // its offload for the fastest option that moves fewer bytes.
    for (size_t l : tl.snowball_layers) {
      const int64_t cur = choice[l]->cost.offload_bytes;
      auto& a = allowed[l];
      a.erase(std::remove_if(a.begin(), a.end(),
                             [&](const Option* o) { return o->cost.offload_bytes >= cur; }),
              a.end());
      choice[l] = fastest_option(a, st, l);
    }
  }
  return c;
}

// The final choice: the greedy one, unless the budget binds; then the fastest fitting
// result of Note [Budget search] from several starts (the greedy trades by kept bytes and
// can miss what the max terms of the peak, in-flight copies and one layer's re-materialized
// set, or the host memory decide, and it can stop in a local optimum).
Choice choose_under_budget(const Stage& st, const LayerOptions& lo, Allowed& allowed,
                           Policy strategy, double host_limit, Choice greedy) {
  const size_t n = st.layers.size();
  // The budget binds when the plan does not fit or some layer runs slower than its fastest
  // allowed option.
  bool binds = !fits(greedy.timeline, st, host_limit);
  for (size_t l = 0; l < n && !binds; ++l) {
    for (const Option* o : allowed[l]) {
      if (option_time(*o, st, l) < option_time(*greedy.options[l], st, l) - 1e-9) binds = true;
    }
  }
  if (!binds) return greedy;
  std::vector<std::vector<const Option*>> starts =
      search_starts(lo, allowed, strategy, greedy.options);
  Choice best = std::move(greedy);
  for (std::vector<const Option*>& start : starts) {
    Choice c;
    c.timeline = run_timeline(st, start, lo.recompute_ms, false);
    c.options = std::move(start);
    if (!fits(c.timeline, st, host_limit)) search_moves(st, lo, host_limit, allowed, c, true);
    if (!fits(c.timeline, st, host_limit)) continue;
    search_moves(st, lo, host_limit, allowed, c, false);
    if (!fits(best.timeline, st, host_limit) || c.timeline.step_ms < best.timeline.step_ms) {
      best = std::move(c);
    }
  }
  return best;
}

}  // namespace spillway::planner

// The options of one layer (keep, block recompute, checkpoint, offload, hybrid and the
// selective knapsack's two variants), shared by identical layers, and those each strategy
// allows.
#include <algorithm>

#include "plan/planner.hpp"

namespace spillway::planner {

namespace {

constexpr size_t kMaxKnapsackGroups = 14;

Option make_option(const CostedLayer& c, Policy p, std::vector<Action> actions) {
  Option o;
  o.policy = p;
  o.cost = evaluate_actions(c, actions);
  o.actions = std::move(actions);
  return o;
}

// The MLP's saved outputs the offload policy moves: with them (and, in an MoE layer, the
// experts' down-projection output that the combine's backward reads) on the host, no MLP
// GEMM runs again in backward.
bool is_mlp_tensor(const std::string& n) {
  return n == "mlp.gate_out" || n == "mlp.up_out" || n == "mlp.act" || n == "moe.expert_out";
}

// Forward deadline of layer l alone (engine free at its start): end of layer l+1.
double standalone_deadline(const Stage& st, size_t l) {
  return st.layers[l].fwd_ms + st.comm_fwd_ms[l] + st.layers[l + 1].fwd_ms + st.comm_fwd_ms[l + 1];
}

// The bytes layer l may move at the derated rate: in steady state the engine has one
// next-layer forward per layer (the no-snowball condition, docs/offload.md: V_l / B_d2h <=
// T_fwd(l+1)), whatever the production times.
double standalone_capacity_bytes(const Stage& st, size_t l) {
  return st.d2h_bytes_per_ms / (1.0 + st.margin) *
         (st.layers[l + 1].fwd_ms + st.comm_fwd_ms[l + 1]);
}

// Builds the options a strategy can use (the knapsack only where it is needed).
OptionSet build_options(const Stage& st, size_t l, Policy strategy) {
  const bool need_hybrid = strategy == Policy::kAuto || strategy == Policy::kHybrid;
  const bool need_selective = strategy == Policy::kAuto || strategy == Policy::kSelective;
  const CostedLayer& c = st.layers[l];
  OptionSet os;
  const size_t nt = c.inv.tensors.size();
  os.keep = make_option(c, Policy::kKeep, std::vector<Action>(nt, Action::kKeep));
  const std::vector<Action> rec = recompute_actions(c);
  os.recompute = make_option(c, Policy::kRecompute, rec);
  if (strategy == Policy::kCheckpoint)
    os.checkpoint = make_option(c, Policy::kCheckpoint, checkpoint_actions(c));
  os.can_offload = l + static_cast<size_t>(st.keep_last) < st.layers.size();
  if (!os.can_offload) return os;

  if (!st.offload_named.empty()) {
    // Note [Named offload tensors]: exactly the named set, the rest recomputed or kept.
    std::vector<Action> off = rec;
    std::vector<Action> off_keep(nt, Action::kKeep);
    for (size_t i = 0; i < nt; ++i) {
      const TensorInfo& t = c.inv.tensors[i];
      if (t.saved && std::find(st.offload_named.begin(), st.offload_named.end(), t.name) !=
                         st.offload_named.end()) {
        off[i] = Action::kOffload;
        off_keep[i] = Action::kOffload;
      }
    }
    os.offload = make_option(c, Policy::kOffload, std::move(off));
    os.offload_keep = make_option(c, Policy::kOffload, std::move(off_keep));
    return os;
  }
  std::vector<Action> off = rec;
  for (size_t i = 0; i < nt; ++i) {
    if (c.inv.tensors[i].saved && is_mlp_tensor(c.inv.tensors[i].name)) off[i] = Action::kOffload;
  }
  os.offload = make_option(c, Policy::kOffload, off);

  const double rate = st.d2h_bytes_per_ms / (1.0 + st.margin);
  const double deadline = standalone_deadline(st, l);
  const double capacity = standalone_capacity_bytes(st, l);

  // Hybrid: offload GEMM/attention outputs that the block policy would recompute, most
  // expensive per byte first, while they fit the window; recompute the cheap rest.
  if (need_hybrid) {
    std::vector<size_t> cand;
    for (size_t i = 0; i < nt; ++i) {
      const TensorInfo& t = c.inv.tensors[i];
      if (!t.saved || rec[i] != Action::kRecompute || t.producer < 0 || t.bytes == 0) continue;
      if (c.inv.ops[static_cast<size_t>(t.producer)].kind == OpKind::kMemory) continue;
      cand.push_back(i);
    }
    std::stable_sort(cand.begin(), cand.end(), [&](size_t a, size_t b) {
      const auto& ta = c.inv.tensors[a];
      const auto& tb = c.inv.tensors[b];
      return c.op_fwd_ms[static_cast<size_t>(ta.producer)] / static_cast<double>(ta.bytes) >
             c.op_fwd_ms[static_cast<size_t>(tb.producer)] / static_cast<double>(tb.bytes);
    });
    std::vector<Action> hyb = rec;
    for (size_t i : cand) {
      hyb[i] = Action::kOffload;
      if (static_cast<double>(evaluate_actions(c, hyb).offload_bytes) > capacity ||
          copy_finish_ms(c, hyb, rate, 0.0, nullptr) > deadline) {
        hyb[i] = Action::kRecompute;
      }
    }
    os.hybrid = make_option(c, Policy::kHybrid, hyb);
  }

  // Selective: an exhaustive knapsack over groups of tensors, a group being the saved
  // outputs of one op (offloading half of an op's outputs saves no recompute), at most
  // kMaxKnapsackGroups of the largest; two variants: the rest recomputed by the block
  // policy (minimize recompute time, then kept bytes) or the rest kept (maximize bytes
  // offloaded). Both must fit the window (capacity and deadline).
  if (need_selective) {
    std::vector<std::vector<size_t>> groups;
    std::vector<int64_t> group_bytes;
    std::vector<double> group_time;  // production time of the group
    for (int op = -1; op < static_cast<int>(c.inv.ops.size()); ++op) {
      std::vector<size_t> g;
      int64_t bytes = 0;
      for (size_t i = 0; i < nt; ++i) {
        const TensorInfo& t = c.inv.tensors[i];
        if (t.saved && t.producer == op && t.bytes > 0) {
          g.push_back(i);
          bytes += t.bytes;
        }
      }
      if (g.empty()) continue;
      groups.push_back(std::move(g));
      group_bytes.push_back(bytes);
      group_time.push_back(c.produced_at_ms[groups.back().front()]);
    }
    // Keep the largest groups, in production order.
    if (groups.size() > kMaxKnapsackGroups) {
      std::vector<size_t> idx(groups.size());
      for (size_t k = 0; k < idx.size(); ++k) idx[k] = k;
      std::stable_sort(idx.begin(), idx.end(),
                       [&](size_t x, size_t y) { return group_bytes[x] > group_bytes[y]; });
      idx.resize(kMaxKnapsackGroups);
      std::sort(idx.begin(), idx.end());
      std::vector<std::vector<size_t>> g2;
      std::vector<int64_t> b2;
      std::vector<double> t2;
      for (size_t k : idx) {
        g2.push_back(groups[k]);
        b2.push_back(group_bytes[k]);
        t2.push_back(group_time[k]);
      }
      groups = std::move(g2);
      group_bytes = std::move(b2);
      group_time = std::move(t2);
    }

    Option best_r = os.recompute;
    best_r.policy = Policy::kSelective;
    Option best_k = os.keep;
    best_k.policy = Policy::kSelective;
    int64_t best_k_bytes = 0;
    uint32_t best_k_mask = 0;
    std::vector<Action> trial(nt);
    const uint32_t limit = 1u << groups.size();
    for (uint32_t mask = 1; mask < limit; ++mask) {
      double t = 0.0;
      int64_t bytes = 0;
      for (size_t k = 0; k < groups.size(); ++k) {
        if (!(mask >> k & 1u)) continue;
        t = std::max(t, group_time[k]) + static_cast<double>(group_bytes[k]) / rate;
        bytes += group_bytes[k];
      }
      if (t > deadline || static_cast<double>(bytes) > capacity) continue;
      if (bytes > best_k_bytes) {
        best_k_bytes = bytes;
        best_k_mask = mask;
      }
      trial = rec;
      for (size_t k = 0; k < groups.size(); ++k) {
        if (!(mask >> k & 1u)) continue;
        for (size_t i : groups[k]) trial[i] = Action::kOffload;
      }
      const ActionCost ac = evaluate_actions(c, trial);
      if (!ac.valid) continue;
      const bool better = ac.recompute_ms < best_r.cost.recompute_ms - 1e-12 ||
                          (ac.recompute_ms <= best_r.cost.recompute_ms + 1e-12 &&
                           ac.kept_bytes < best_r.cost.kept_bytes);
      if (better) {
        best_r.actions = trial;
        best_r.cost = ac;
      }
    }
    if (best_k_mask != 0) {
      std::vector<Action> keep_rest(nt, Action::kKeep);
      for (size_t k = 0; k < groups.size(); ++k) {
        if (!(best_k_mask >> k & 1u)) continue;
        for (size_t i : groups[k]) keep_rest[i] = Action::kOffload;
      }
      best_k = make_option(c, Policy::kSelective, std::move(keep_rest));
    }
    os.selective_recompute = best_r;
    os.selective_keep = best_k;
  }
  return os;
}

bool fits_window(const Option& o, const Stage& st, size_t l) {
  if (o.cost.offload_bytes == 0) return true;
  const double rate = st.d2h_bytes_per_ms / (1.0 + st.margin);
  return static_cast<double>(o.cost.offload_bytes) <=
             standalone_capacity_bytes(st, l) * (1 + 1e-12) &&
         copy_finish_ms(st.layers[l], o.actions, rate, 0.0, nullptr) <=
             standalone_deadline(st, l) + 1e-9;
}

}  // namespace

double option_time(const Option& o, const Stage& st, size_t l) {
  // Recompute plus the reload stall this layer would see behind the next layers' backward
  // (taken to run the same policy: their recompute counts in the window too).
  double t = o.cost.recompute_ms;
  if (o.cost.offload_bytes > 0 && l + 1 < st.layers.size()) {
    const double h2d = static_cast<double>(o.cost.offload_bytes) / st.h2d_bytes_per_ms;
    const double window =
        (st.layers[l + 1].bwd_ms + o.cost.recompute_ms) * static_cast<double>(st.prefetch);
    t += std::max(0.0, h2d - window);
  }
  return t;
}

LayerOptions build_layer_options(const Stage& st, Policy strategy) {
  // Options depend only on the layer, its forward time, the next layer's and whether it
  // may offload: identical layers (the common case) share one set.
  const size_t n = st.layers.size();
  LayerOptions lo;
  std::vector<size_t> first_of_set;
  lo.set_of.resize(n);
  lo.unique.reserve(n);
  for (size_t l = 0; l < n; ++l) {
    const bool can_offload = l + static_cast<size_t>(st.keep_last) < n;
    const double next_fwd = l + 1 < n ? st.layers[l + 1].fwd_ms : 0.0;
    size_t k = 0;
    for (; k < lo.unique.size(); ++k) {
      const size_t m = first_of_set[k];
      const double m_next = m + 1 < n ? st.layers[m + 1].fwd_ms : 0.0;
      if (st.layers[m].spec == st.layers[l].spec && st.layers[m].fwd_ms == st.layers[l].fwd_ms &&
          st.layers[m].op_fwd_ms == st.layers[l].op_fwd_ms && m_next == next_fwd &&
          lo.unique[k].can_offload == can_offload) {
        break;
      }
    }
    if (k == lo.unique.size()) {
      lo.unique.push_back(build_options(st, l, strategy));
      first_of_set.push_back(l);
    }
    lo.set_of[l] = k;
  }
  lo.recompute_ms.resize(n);
  for (size_t l = 0; l < n; ++l) lo.recompute_ms[l] = lo.at(l).recompute.cost.recompute_ms;
  return lo;
}

Allowed allowed_options(const LayerOptions& lo, const Stage& st, Policy strategy) {
  const size_t n = st.layers.size();
  Allowed allowed(n);
  for (size_t l = 0; l < n; ++l) {
    const OptionSet& os = lo.at(l);
    auto& a = allowed[l];
    if (!st.offload_named.empty()) {
      // Note [Named offload tensors]: an offloading layer offloads exactly the named set.
      switch (strategy) {
        case Policy::kKeep:
          a = {os.can_offload ? &os.offload_keep : &os.keep};
          break;
        case Policy::kAuto:
          a = {&os.keep, &os.recompute};
          if (os.can_offload) {
            for (const Option* o : {&os.offload, &os.offload_keep}) {
              if (fits_window(*o, st, l)) a.push_back(o);
            }
          }
          break;
        default:  // recompute, offload (validate() refuses the others)
          a = {os.can_offload ? &os.offload : &os.recompute};
          break;
      }
      continue;
    }
    switch (strategy) {
      case Policy::kKeep:
        a = {&os.keep};
        break;
      case Policy::kRecompute:
        a = {&os.recompute};
        break;
      case Policy::kCheckpoint:
        a = {&os.checkpoint};
        break;
      case Policy::kOffload:
        a = {os.can_offload ? &os.offload : &os.recompute};
        break;
      case Policy::kHybrid:
        a = {os.can_offload ? &os.hybrid : &os.recompute};
        break;
      case Policy::kSelective:
        if (os.can_offload) {
          a = {&os.selective_keep, &os.selective_recompute};
        } else {
          a = {&os.recompute};
        }
        break;
      case Policy::kAuto:
        a = {&os.keep, &os.recompute};
        if (os.can_offload) {
          for (const Option* o :
               {&os.offload, &os.hybrid, &os.selective_keep, &os.selective_recompute}) {
            if (fits_window(*o, st, l)) a.push_back(o);
          }
        }
        break;
    }
  }
  return allowed;
}

const Option* fastest_option(const std::vector<const Option*>& allowed, const Stage& st, size_t l) {
  const Option* best = nullptr;
  for (const Option* o : allowed) {
    if (best == nullptr || option_time(*o, st, l) < option_time(*best, st, l) - 1e-12 ||
        (option_time(*o, st, l) <= option_time(*best, st, l) + 1e-12 &&
         o->cost.kept_bytes < best->cost.kept_bytes)) {
      best = o;
    }
  }
  return best;
}

}  // namespace spillway::planner

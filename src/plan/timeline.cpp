// The timeline of a choice: one micro-batch's forward copies (D2H, in production order),
// backward reloads (H2D, prefetched), stalls and peak memory, which judge a choice of
// options.
//
// Note [Forward window]: layer l's offloaded tensors are copied by the D2H engine in
// production order (a tensor can start when its producing op ends and the engine is
// free, carrying over the previous layer's backlog); they must all be copied by the end
// of layer l+1's forward, at the bandwidth derated by the margin: bytes / (B / (1 +
// margin)). This is the no-snowball condition (docs/offload.md) V_l / B_d2h <= T_fwd(l+1), extended
// to tensors produced earlier in the layer (which start earlier: the reason selective
// offload spreads transfers over the attention and MLP phases).
//
// Note [FP8 recompute] (docs/planner.md): with fp8 GEMMs (--dtype fp8: GEMMs at the fp8
// peak, activations saved in fp8), a recomputed GEMM must run with the scaling state its
// forward used: delayed scaling derives each step's scales from an amax history, and a
// recompute that updated or re-derived it would produce different fp8 values and a wrong
// gradient. So a layer that recomputes fp8 GEMMs keeps that state, per GEMM an amax
// history of kFp8AmaxHistory steps for its three fp8 operands and their scales
// (kFp8ScalingStateBytesPerGemm), counted with its kept activations, and the plan names
// how many GEMMs of each layer it covers; the recompute must not step the history.
//
// Note [Peak memory]: at the start of backward the device holds every layer's kept
// tensors (times the micro-batches in flight: pp for the first 1F1B stage), plus either
// the logits and their gradient (fp32) or, while a layer runs backward, its re-
// materialized tensors (reloaded + recomputed); plus the copies in flight (the prefetched
// reloads, prefetch_depth layers, or the D2H backlog if the forward outran the link).
#include <algorithm>
#include <bit>

#include "plan/planner.hpp"
#include "spillway/core/units.hpp"

namespace spillway::planner {

namespace {

constexpr const char* kBytesWhat =
    "plan: the memory total (micro-batch * seq-len * widths * layers)";

// Note [Forward paced by the gathers]: the overlapped forward weight gathers (ZeRO-3's in
// every micro-batch, ZeRO-1/2's in the first: Stage::gather_fwd_ms) run on the GPU's one
// communication stream in issue order, as the simulator runs them (Note [Collectives in the
// simulator]): layer l + 1's is issued as layer l starts, and layer l + 1 waits for it;
// layer l's exposed collectives (its all-to-alls) queue behind it. When the gathers take
// longer than the compute, they pace the forward: the layers start later and the tensors
// after a delayed all-to-all are produced later, which widens the copies' windows. The
// copies are judged on this forward (`fstart`, `late`: per tensor, ms later than its
// unpaced production within the layer); the step's time keeps the unpaced forward, the
// gathers' share of it being overlapped_step_delay's. A host-link gather beside a layer's
// copies takes min(ring, copies) longer (Note [The host link is shared]).
void paced_forward(const Stage& st, const std::vector<const Option*>& choice,
                   std::vector<double>& fstart, std::vector<std::vector<double>>& late) {
  const size_t n = st.layers.size();
  std::vector<double> gf(n, 0.0);
  bool any = false;
  for (size_t l = 0; l < n; ++l) {
    gf[l] = l < st.gather_fwd_ms.size() ? st.gather_fwd_ms[l] : 0.0;
    any |= gf[l] > 0.0;
    if (gf[l] > 0.0 && l > 0 && st.gather_fwd_host[l] && st.d2h_bytes_per_ms > 0.0) {
      const double copies =
          static_cast<double>(choice[l - 1]->cost.offload_bytes) / st.d2h_bytes_per_ms;
      gf[l] = shared_link_ms(gf[l], copies);
    }
  }
  fstart[0] = 0.0;
  if (!any) {
    for (size_t l = 0; l < n; ++l)
      fstart[l + 1] = fstart[l] + st.layers[l].fwd_ms + st.comm_fwd_ms[l];
    return;
  }
  double comm = gf[0];
  double t = comm;  // layer 0 waits for its weights
  for (size_t l = 0; l < n; ++l) {
    const CostedLayer& cl = st.layers[l];
    late[l].assign(cl.inv.tensors.size(), 0.0);
    fstart[l] = t;
    double next = 0.0;
    if (l + 1 < n) {
      comm = std::max(comm, t) + gf[l + 1];
      next = comm;
    }
    double op_sum = 0.0;
    for (double ms : cl.op_fwd_ms) op_sum += ms;
    const double scale = op_sum > 0.0 ? cl.fwd_ms / op_sum : 0.0;
    double cur = t;
    double done = 0.0;  // ms of the layer's compute run
    for (const auto& [after, ms] : st.exposed_fwd[l]) {
      double offset = 0.0;
      for (int k = 0; k <= after && k < static_cast<int>(cl.op_fwd_ms.size()); ++k)
        offset += cl.op_fwd_ms[static_cast<size_t>(k)] * scale;
      offset = std::min(offset, cl.fwd_ms);
      cur += offset - done;
      done = offset;
      const double wait = std::max(0.0, comm - cur);
      cur += wait + ms;
      comm = cur;
      for (size_t i = 0; i < cl.inv.tensors.size(); ++i) {
        if (cl.inv.tensors[i].producer > after) late[l][i] += wait;
      }
    }
    t = std::max(cur + cl.fwd_ms - done, next);
  }
  fstart[n] = t;
}

}  // namespace

Timeline run_timeline(const Stage& st, const std::vector<const Option*>& choice,
                      const std::vector<double>& recompute_policy_ms, bool detail) {
  const size_t n = st.layers.size();
  Timeline tl;
  tl.layers.resize(n);
  std::vector<double> start(n + 1, 0.0);
  for (size_t l = 0; l < n; ++l) start[l + 1] = start[l] + st.layers[l].fwd_ms + st.comm_fwd_ms[l];
  tl.fwd_ms = start[n];
  // The forward the copies see (Note [Forward paced by the gathers]): `fstart`, and per
  // tensor how much later than the unpaced timing it is produced within its layer (left
  // empty without gathers).
  std::vector<double> fstart(n + 1, 0.0);
  std::vector<std::vector<double>> produced_late(n);
  paced_forward(st, choice, fstart, produced_late);
  // Forward-frame times to the unpaced frame the backward runs in (same offset from the
  // end of the forward).
  const double paced_by = fstart[n] - start[n];

  // Forward D2H: FIFO across layers, once at the real rate (timeline, backlog) and once
  // derated by the margin (the feasibility judgement). See Note [Forward window].
  const double rate_real = st.d2h_bytes_per_ms;
  const double rate_margin = st.d2h_bytes_per_ms / (1.0 + st.margin);
  double free_real = 0.0;
  double free_margin = 0.0;
  std::vector<double> d2h_done(n, 0.0);
  struct Copy {
    double produced, begin, end;
    int64_t bytes;
  };
  std::vector<Copy> copies;
  for (size_t l = 0; l < n; ++l) {
    const CostedLayer& c = st.layers[l];
    const Option& o = *choice[l];
    LayerPlan& lp = tl.layers[l];
    lp.offload_bytes = o.cost.offload_bytes;
    if (o.cost.offload_bytes == 0) continue;
    // The host-link ring issued as this layer starts takes its share of the link (Note
    // [The host link is shared]).
    const double alone = static_cast<double>(o.cost.offload_bytes) / rate_real;
    const double share = alone / shared_link_ms(alone, st.host_comm_fwd_ms[l]);
    const double rate_real_l = rate_real * share;
    std::vector<size_t> order;
    for (size_t i = 0; i < o.actions.size(); ++i) {
      if (c.inv.tensors[i].saved && o.actions[i] == Action::kOffload) order.push_back(i);
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return c.produced_at_ms[a] < c.produced_at_ms[b]; });
    auto produced_at = [&](size_t i) {
      return fstart[l] + c.produced_at_ms[i] +
             (produced_late[l].empty() ? 0.0 : produced_late[l][i]);
    };
    // At the rate derated by the margin (the judgement), and at the real rate (the
    // timeline, the backlog).
    for (size_t i : order) {
      free_margin = std::max(free_margin, produced_at(i)) +
                    static_cast<double>(c.inv.tensors[i].bytes) / (rate_margin * share);
    }
    const double fin_margin = free_margin;
    for (size_t i : order) {
      const double produced = produced_at(i);
      const double b = std::max(free_real, produced);
      const double e = b + static_cast<double>(c.inv.tensors[i].bytes) / rate_real_l;
      copies.push_back({produced, b, e, c.inv.tensors[i].bytes});
      free_real = e;
    }
    d2h_done[l] = free_real - paced_by;
    const double deadline = fstart[std::min(l + 2, n)];
    lp.d2h_ms = static_cast<double>(o.cost.offload_bytes) / rate_real_l;
    // The layer's own window: from its first offloaded tensor to the end of the next
    // forward (what it would have with an idle engine); lateness includes the backlog.
    lp.window_ms = deadline - produced_at(order.front());
    lp.margin = lp.window_ms / lp.d2h_ms - 1.0;
    lp.late_ms = std::max(0.0, fin_margin - deadline);
    if (fin_margin > deadline + 1e-9) {
      lp.snowball = true;
      tl.snowball_layers.push_back(l);
    }
  }
  // Backlog at the end of each layer's forward (real rate): bytes of tensors that exist
  // but are not yet on the host, counting the unfinished part of a running copy. Copies
  // are in FIFO order, so production, begin and end times all increase along the list:
  // at boundary t the pending copies are a contiguous range [done, produced).
  // Only the first of them can be running (one engine), so prefix sums give each
  // boundary in O(1).
  {
    std::vector<double> prefix(copies.size() + 1, 0.0);
    for (size_t k = 0; k < copies.size(); ++k)
      prefix[k + 1] = prefix[k] + static_cast<double>(copies[k].bytes);
    size_t done = 0;
    size_t produced = 0;
    for (size_t l = 0; l < n; ++l) {
      const double t = fstart[l + 1];
      while (done < copies.size() && copies[done].end <= t) ++done;
      while (produced < copies.size() && copies[produced].produced <= t) ++produced;
      double pending = 0.0;
      if (produced > done) {
        pending = prefix[produced] - prefix[done];
        const Copy& cp = copies[done];
        if (cp.begin < t)
          pending -= static_cast<double>(cp.bytes) * (t - cp.begin) / (cp.end - cp.begin);
      }
      tl.layers[l].backlog_bytes = static_cast<int64_t>(pending);
    }
  }
  for (const LayerPlan& lp : tl.layers) tl.max_backlog = std::max(tl.max_backlog, lp.backlog_bytes);

  // Backward: layers in reverse; reload of layer l issued when layer l + prefetch starts
  // its backward (or at the start of backward), never before its offload finished.
  double t = tl.fwd_ms + st.head_ms;
  std::vector<double> bwd_start(n, 0.0);
  double h2d_free = 0.0;
  std::vector<double> reload_done(n, 0.0);
  std::vector<char> issued(n, 0);
  // The reloads issued as a layer's backward starts share the link with the host-link
  // rings issued then (Note [The host link is shared]): `ring` ms of them are left.
  std::vector<double> reload_ms(n, 0.0);
  auto issue = [&](size_t l, double now, double& ring) {
    if (issued[l] || choice[l]->cost.offload_bytes == 0) return;
    issued[l] = 1;
    const double b = std::max({h2d_free, now, d2h_done[l]});
    const double alone = static_cast<double>(choice[l]->cost.offload_bytes) / st.h2d_bytes_per_ms;
    reload_ms[l] = shared_link_ms(alone, ring);
    ring -= std::min(ring, alone);
    h2d_free = b + reload_ms[l];
    reload_done[l] = h2d_free;
  };
  for (size_t l = n; l-- > 0;) {
    // When layer l starts its backward, its own reload (if not yet issued: the first
    // layers of backward) and those of the next `prefetch` layers are issued.
    double ring = st.host_comm_bwd_ms[l];
    for (size_t k = 0; k <= static_cast<size_t>(st.prefetch) && k <= l; ++k) issue(l - k, t, ring);
    bwd_start[l] = t;
    const Option& o = *choice[l];
    const double ready = o.cost.offload_bytes > 0 ? reload_done[l] : t;
    const double stall = std::max(0.0, ready - t);
    LayerPlan& lp = tl.layers[l];
    lp.stall_ms = stall;
    lp.h2d_ms = reload_ms[l];
    tl.stall_ms += stall;
    t += stall + o.cost.recompute_ms + st.comm_bwd_ms[l] + st.layers[l].bwd_ms;
  }
  tl.step_ms = t;

  // Per-layer report fields and memory (Note [Peak memory]).
  int64_t kept = 0;
  int64_t working = 0;
  int64_t max_offload = 0;
  for (size_t l = 0; l < n; ++l) {
    const CostedLayer& c = st.layers[l];
    const Option& o = *choice[l];
    LayerPlan& lp = tl.layers[l];
    lp.index = static_cast<int>(l);
    lp.block = c.spec.block_name();
    lp.policy = o.policy;
    lp.kept_bytes = o.cost.kept_bytes;
    lp.params = st.layer_params[l];
    lp.rematerialized_bytes = o.cost.rematerialized_bytes;
    if (st.fp8) {  // Note [FP8 recompute]
      uint64_t gemms = 0;
      for (size_t i = 0; i < c.inv.tensors.size(); ++i) {
        const TensorInfo& ti = c.inv.tensors[i];
        if (ti.saved && o.actions[i] == Action::kRecompute && ti.producer >= 0 &&
            c.inv.ops[static_cast<size_t>(ti.producer)].kind == OpKind::kGemm)
          gemms |= uint64_t{1} << ti.producer;
      }
      lp.fp8_recomputed_gemms = std::popcount(gemms);
      lp.fp8_scaling_state_bytes = lp.fp8_recomputed_gemms * kFp8ScalingStateBytesPerGemm;
      kept = checked_add(kept, lp.fp8_scaling_state_bytes, kBytesWhat);
    }
    lp.fwd_ms = c.fwd_ms;
    lp.bwd_ms = c.bwd_ms;
    if (detail) lp.collectives = st.collectives[l];
    for (size_t k = 0; k < c.inv.ops.size(); ++k) {
      const OpCost& op = c.inv.ops[k];
      lp.fwd_flops += op.fwd_flops;
      lp.bwd_flops += op.bwd_flops;
      lp.fwd_bytes = checked_add(lp.fwd_bytes, op.fwd_bytes, kBytesWhat);
      lp.bwd_bytes = checked_add(lp.bwd_bytes, op.bwd_bytes, kBytesWhat);
      if (detail) {
        OpPlan& p = lp.ops.emplace_back(OpPlan{op.name,
                                               op.kind,
                                               op.fwd_flops,
                                               op.fwd_bytes,
                                               op.bwd_flops,
                                               op.bwd_bytes,
                                               c.op_fwd_ms[k],
                                               c.op_bwd_ms[k],
                                               {},
                                               {}});
        for (int ti : op.inputs) p.inputs.push_back(c.inv.tensors[static_cast<size_t>(ti)].name);
        for (int ti : op.outputs) p.outputs.push_back(c.inv.tensors[static_cast<size_t>(ti)].name);
      }
    }
    lp.recompute_ms = o.cost.recompute_ms;
    lp.recompute_avoided_ms = recompute_policy_ms[l] - o.cost.recompute_ms;
    for (size_t i = 0; detail && i < c.inv.tensors.size(); ++i) {
      const TensorInfo& ti = c.inv.tensors[i];
      if (!ti.saved) continue;
      TensorPlan tp;
      tp.name = ti.name;
      tp.shape = ti.shape;
      tp.dtype = ti.dtype;
      tp.bytes = ti.bytes;
      tp.action = o.actions[i];
      tp.recompute_ms = ti.producer >= 0 ? c.op_fwd_ms[static_cast<size_t>(ti.producer)] : 0.0;
      tp.recompute_flops =
          ti.producer >= 0 ? c.inv.ops[static_cast<size_t>(ti.producer)].fwd_flops : 0.0;
      tp.produced_at_ms = c.produced_at_ms[i];
      tp.producer = ti.producer;
      lp.tensors.push_back(std::move(tp));
    }
    kept = checked_add(kept, o.cost.kept_bytes, kBytesWhat);
    working = std::max(working, o.cost.rematerialized_bytes);
    max_offload = std::max(max_offload, o.cost.offload_bytes);
    tl.host_pinned = checked_add(tl.host_pinned, o.cost.offload_bytes, kBytesWhat);
  }
  tl.host_pinned = checked_add(checked_mul(tl.host_pinned, st.mb_inflight, kBytesWhat),
                               st.host_static, kBytesWhat);
  tl.peak = st.static_mem;
  // The peak is while the head runs (the logits) or in a layer's backward (its
  // re-materialized set), whichever holds more.
  tl.peak.activations = checked_mul(kept, st.mb_inflight, kBytesWhat);
  if (st.logits_bytes > working) {
    tl.peak.logits = st.logits_bytes;
  } else {
    tl.peak.activations = checked_add(tl.peak.activations, working, kBytesWhat);
  }
  tl.peak.in_flight_copies =
      std::max(checked_mul(max_offload, st.prefetch, kBytesWhat), tl.max_backlog);
  // The total must fit too (MemoryBreakdown::total() adds without checks).
  (void)checked_add(
      checked_add(checked_add(tl.peak.weights, tl.peak.gradients, kBytesWhat),
                  checked_add(tl.peak.optimizer_states, tl.peak.activations, kBytesWhat),
                  kBytesWhat),
      checked_add(checked_add(tl.peak.in_flight_copies, tl.peak.logits, kBytesWhat),
                  tl.peak.buffers, kBytesWhat),
      kBytesWhat);
  return tl;
}

Timelines final_timelines(const Stage& st, const LayerOptions& lo,
                          const std::vector<const Option*>& choice) {
  const size_t n = st.layers.size();
  std::vector<const Option*> all_rec(n);
  std::vector<const Option*> all_keep(n);
  for (size_t l = 0; l < n; ++l) {
    all_rec[l] = &lo.at(l).recompute;
    all_keep[l] = &lo.at(l).keep;
  }
  Timelines t;
  t.recompute = run_timeline(st, all_rec, lo.recompute_ms, false);
  t.keep = run_timeline(st, all_keep, lo.recompute_ms, false);
  t.chosen = run_timeline(st, choice, lo.recompute_ms, true);
  return t;
}

}  // namespace spillway::planner

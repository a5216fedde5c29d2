// The collectives each layer of the stage carries (tensor, expert and data parallelism)
// and their time: the exposed ones woven into the layer's timing, the overlapped ones on
// the GPU's one communication stream, and the host link they share with the offload copies.
#include <algorithm>
#include <utility>

#include "plan/planner.hpp"
#include "spillway/core/units.hpp"

namespace spillway::planner {

// Note [Collectives in the plan]: per layer, the collectives its parallelism needs
// (docs/collectives.md), with ranks laid out tp fastest, then cp, ep
// and dp (a group's members are spaced by the product of the faster sizes):
//   - tp > 1 (Megatron with sequence parallelism): an all-gather and a reduce-scatter of
//     the T x d activation around attention and around the MLP, forward and backward;
//     exposed (they feed the next GEMM);
//   - ep > 1: the MoE dispatch and combine all-to-alls of T x top_k / tp rows of d,
//     forward and backward; exposed;
//   - dp > 1: the layer's gradients after its backward (an all-reduce at ZeRO 0; a
//     reduce-scatter at 1-3, each GPU stepping its shard, as Megatron's distributed
//     optimizer does: with the gather of the updated weights it moves what one all-reduce
//     moves), once per step (the last micro-batch); at ZeRO 3 the layer's
//     weights gathered before its forward and again before its backward; at ZeRO 1-2 the
//     updated weights gathered once per step, in the first micro-batch's forward. These
//     overlap compute on one communication stream per GPU, in issue order, as the
//     simulator runs them (overlapped_delay): a layer waits for its gathered weights, and
//     the step's end for the last gradient reduction; what they do not hide is on the
//     critical path.
// Each is ring_ms over collective_link (spillway/plan/collectives.hpp). The exposed ones sit
// where the simulator puts them (Note [Collectives in the simulator]): a dispatch after
// the op moe.dispatch, a combine before moe.combine, the others at the end of the forward,
// the backward ones before the layer's backward; the timeline waits for them, so they
// widen the forward windows and delay the tensors produced after them. Not modelled: CP's
// key/value exchange and pipeline sends. Host-link collectives share the link with the
// offload copies (Note [The host link is shared]).
std::vector<CollectivePlan> layer_collectives(const PlanRequest& r, const LayerSpec& spec,
                                              int64_t params, int64_t T) {
  const ShardShape& s = r.work.shape;
  const double lat = r.hardware.interconnect.collective_latency_us;
  const int64_t bytes = s.dtype == DType::kFp32 ? 4 : 2;
  const int64_t d = r.model.hidden;
  std::vector<CollectivePlan> out;
  auto add = [&](CollectiveKind k, const char* what, bool backward, int64_t b, int64_t group,
                 const CollectiveLink& link, bool exposed) {
    if (group <= 1 || b <= 0) return;
    CollectivePlan c = make_collective(k, what, backward, b, group, link, lat);
    c.exposed = exposed;
    out.push_back(std::move(c));
  };
  const char* what = "collective bytes";
  const int64_t tokens = checked_mul(checked_mul(T, d, what), bytes, what);
  for (bool bwd : {false, true}) {
    if (s.tp > 1) {
      const CollectiveLink tp = collective_link(r.hardware, s.tp, 1);
      add(CollectiveKind::kAllGather, "tp.attn_gather", bwd, tokens, s.tp, tp, true);
      add(CollectiveKind::kReduceScatter, "tp.attn_scatter", bwd, tokens, s.tp, tp, true);
      add(CollectiveKind::kAllGather, "tp.mlp_gather", bwd, tokens, s.tp, tp, true);
      add(CollectiveKind::kReduceScatter, "tp.mlp_scatter", bwd, tokens, s.tp, tp, true);
    }
    if (spec.mlp.kind == MlpKind::kMoe && s.ep > 1) {
      const CollectiveLink ep = collective_link(r.hardware, s.ep, s.tp * s.cp);
      const int64_t rows = checked_mul(T, spec.mlp.top_k, what) / s.tp;
      const int64_t b = checked_mul(checked_mul(rows, d, what), bytes, what);
      add(CollectiveKind::kAllToAll, "ep.dispatch", bwd, b, s.ep, ep, true);
      add(CollectiveKind::kAllToAll, "ep.combine", bwd, b, s.ep, ep, true);
    }
  }
  if (r.work.dp > 1) {
    const CollectiveLink dp = collective_link(r.hardware, r.work.dp, s.tp * s.cp * s.ep);
    const int64_t layer = checked_mul(params, bytes, what);
    if (r.zero >= 3) {
      add(CollectiveKind::kAllGather, "zero.weight_gather", false, layer, r.work.dp, dp, false);
      add(CollectiveKind::kAllGather, "zero.weight_gather", true, layer, r.work.dp, dp, false);
    } else if (r.zero >= 1) {
      add(CollectiveKind::kAllGather, "zero.param_gather", false, layer, r.work.dp, dp, false);
    }
    add(r.zero >= 1 ? CollectiveKind::kReduceScatter : CollectiveKind::kAllReduce, "dp.grad_reduce",
        true, layer, r.work.dp, dp, false);
  }
  return out;
}

void weave_exposed(const std::vector<CollectivePlan>& cs, CostedLayer& c, double& fwd_extra,
                   double& bwd_extra) {
  fwd_extra = 0.0;
  bwd_extra = 0.0;
  for (const CollectivePlan& col : cs) {
    if (!col.exposed) continue;
    if (col.backward) {
      bwd_extra += col.ms;
      continue;
    }
    // The delay applies to the ops after this one.
    const int after = exposed_forward_position(
        col, c.inv.ops.size(), [&](size_t k) -> std::string_view { return c.inv.ops[k].name; });
    fwd_extra += col.ms;
    for (size_t t = 0; t < c.inv.tensors.size(); ++t) {
      if (c.inv.tensors[t].producer > after) c.produced_at_ms[t] += col.ms;
    }
  }
}

// Note [The host link is shared]: a collective on the "host" link (docs/collectives.md)
// runs through the root complex the offload copies use, in both directions, and the link
// is shared fairly between what runs on it, as the simulator shares it. Two transfers that
// start together and would take c and x ms alone both run at half rate until the shorter
// ends: the longer ends at max(c, x) + min(c, x), the shorter at 2 min(c, x), both having
// lost min(c, x) (shared_link_ms). The planner applies this per window:
//   - the ring issued as layer l's forward starts (the weight gather of layer l + 1: ZeRO-3
//     every micro-batch, ZeRO-1/2 in one micro-batch of grad_accum) beside layer l's D2H
//     copies: the copies run at rate x / (x + min(c, x)) of the link (forward_copy_rate),
//     which the forward window judges; the ring runs min(c, x) longer (overlapped_delay);
//   - the rings issued as layer l's backward starts (the weight gather of layer l - 1, the
//     gradient reduction of layer l + 1 in one micro-batch of grad_accum) beside the
//     reloads issued then, the same way.
// The ring issued before layer 0 and the reductions after the last backward find no
// copies. Exposed collectives (all-to-alls) are on the critical path already and are not
// shared here. Not modelled: copies that spill from one window into the next (a backlog)
// sharing with the next window's ring.
double shared_link_ms(double own_ms, double other_ms) {
  return own_ms + std::min(own_ms, other_ms);
}

void host_link_collectives(const PlanRequest& r, Stage& st) {
  const size_t n = st.collectives.size();
  const double per_mb = 1.0 / static_cast<double>(r.work.grad_accum);
  st.host_comm_fwd_ms.assign(n, 0.0);
  st.host_comm_bwd_ms.assign(n, 0.0);
  for (size_t l = 0; l < n; ++l) {
    for (const CollectivePlan& c : st.collectives[l]) {
      if (c.link != "host" || c.exposed) continue;
      if (c.what == "zero.weight_gather" && !c.backward) {
        if (l > 0) st.host_comm_fwd_ms[l - 1] += c.ms;
      } else if (c.what == "zero.param_gather") {
        if (l > 0) st.host_comm_fwd_ms[l - 1] += c.ms * per_mb;
      } else if (c.what == "zero.weight_gather") {
        if (l + 1 < n) st.host_comm_bwd_ms[l + 1] += c.ms;
      } else if (c.what == "dp.grad_reduce") {
        if (l > 0) st.host_comm_bwd_ms[l - 1] += c.ms * per_mb;
      }
    }
  }
}

namespace {

// The overlapped collectives of one micro-batch on the GPU's one communication stream (as
// the simulator runs them, in issue order): a forward weight gather of layer l issued when
// layer l - 1 starts (layer 0's at the start) and waited for by layer l; a backward gather
// of layer l issued when layer l + 1 starts its backward (the last layer's when the head
// starts) and waited for by layer l's backward; with `reduce`, each layer's gradient
// reduction after its backward, which the step's end (the optimizer) waits for; with
// `param_gather`, the ZeRO-1/2 weight gathers as forward gathers. Returns how much later
// the micro-batch ends than without them.
double overlapped_delay(const Stage& st, const std::vector<LayerPlan>& layers, bool reduce,
                        bool param_gather) {
  const size_t n = layers.size();
  // Per layer: forward compute, its exposed collectives (offset into the forward's ops,
  // ms), the backward before its exposed ones (stall, recompute) and after (backward).
  std::vector<double> f(n), b_pre(n), b_post(n), gf(n, 0.0), gb(n, 0.0), rd(n, 0.0);
  std::vector<std::vector<std::pair<double, double>>> fx(n);
  std::vector<std::vector<double>> bx(n);
  // Host-link rings share the link with the copies beside them (Note [The host link is
  // shared]): per window, the ring ms issued as the layer's forward (backward) starts and
  // the copy ms running then alone.
  std::vector<double> ring_f(n, 0.0), ring_b(n, 0.0), copy_f(n, 0.0), copy_b(n, 0.0);
  const double d2h = st.d2h_bytes_per_ms;
  const double h2d = st.h2d_bytes_per_ms;
  double base = st.head_ms;
  for (size_t l = 0; l < n; ++l) {
    const LayerPlan& lp = layers[l];
    const CostedLayer& cl = st.layers[l];
    f[l] = lp.fwd_ms;
    b_pre[l] = lp.stall_ms + lp.recompute_ms;
    b_post[l] = lp.bwd_ms;
    base += f[l] + b_pre[l] + b_post[l];
    const bool host_copies = d2h > 0.0 && h2d > 0.0 && lp.offload_bytes > 0;
    if (host_copies) {
      copy_f[l] = static_cast<double>(lp.offload_bytes) / d2h;
      // The reload issued as layer w = l + prefetch starts its backward (the last layers'
      // own reloads as backward starts).
      copy_b[std::min(n - 1, l + static_cast<size_t>(st.prefetch))] +=
          static_cast<double>(lp.offload_bytes) / h2d;
    }
    double op_sum = 0.0;
    for (double ms : cl.op_fwd_ms) op_sum += ms;
    const double scale = op_sum > 0.0 ? f[l] / op_sum : 0.0;
    for (const CollectivePlan& c : st.collectives[l]) {
      const bool host = c.link == "host";
      if (c.exposed) {
        base += c.ms;
        if (c.backward) {
          bx[l].push_back(c.ms);
          continue;
        }
        const int after = exposed_forward_position(
            c, cl.inv.ops.size(), [&](size_t k) -> std::string_view { return cl.inv.ops[k].name; });
        double offset = 0.0;
        for (int k = 0; k <= after && k < static_cast<int>(cl.op_fwd_ms.size()); ++k)
          offset += cl.op_fwd_ms[static_cast<size_t>(k)] * scale;
        fx[l].emplace_back(std::min(offset, f[l]), c.ms);
      } else if (c.what == "zero.weight_gather") {
        (c.backward ? gb[l] : gf[l]) += c.ms;
        if (host && !c.backward && l > 0) ring_f[l - 1] += c.ms;
        if (host && c.backward && l + 1 < n) ring_b[l + 1] += c.ms;
      } else if (c.what == "zero.param_gather" && param_gather) {
        gf[l] += c.ms;
        if (host && l > 0) ring_f[l - 1] += c.ms;
      } else if (c.what == "dp.grad_reduce" && reduce) {
        rd[l] += c.ms;
        if (host && l > 0) ring_b[l - 1] += c.ms;
      }
    }
    std::stable_sort(fx[l].begin(), fx[l].end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
  }
  if (n == 0) return 0.0;
  // Each window's rings lose min(ring, copies) in all, spread over them pro rata.
  auto share = [](double ring, double copies, double& ms) {
    if (ring > 0.0) ms *= shared_link_ms(ring, copies) / ring;
  };
  for (size_t l = 0; l + 1 < n; ++l) share(ring_f[l], copy_f[l], gf[l + 1]);
  for (size_t l = 0; l < n; ++l) {
    if (l > 0) share(ring_b[l], copy_b[l], gb[l - 1]);
    if (l + 1 < n) share(ring_b[l], copy_b[l], rd[l + 1]);
  }
  // One communication stream in issue order: a layer's exposed collectives queue behind
  // the gather issued as the layer started (and anything before it).
  double comm = gf[0];
  double t = comm;  // layer 0 waits for its weights
  std::vector<double> ready(n, 0.0);
  for (size_t l = 0; l < n; ++l) {
    double next = 0.0;
    if (l + 1 < n) {
      comm = std::max(comm, t) + gf[l + 1];
      next = comm;
    }
    double cur = t;
    double done = 0.0;  // ms of the layer's ops run
    for (const auto& [offset, ms] : fx[l]) {
      cur += offset - done;
      done = offset;
      cur = std::max(cur, comm) + ms;
      comm = cur;
    }
    t = std::max(cur + f[l] - done, next);
  }
  t += st.head_ms;
  comm = std::max(comm, t - st.head_ms) + gb[n - 1];
  ready[n - 1] = comm;
  for (size_t l = n; l-- > 0;) {
    t = std::max(t, ready[l]);
    if (l > 0) {
      comm = std::max(comm, t) + gb[l - 1];
      ready[l - 1] = comm;
    }
    t += b_pre[l];
    for (double ms : bx[l]) {
      t = std::max(t, comm) + ms;
      comm = t;
    }
    t += b_post[l];
    if (rd[l] > 0.0) comm = std::max(comm, t) + rd[l];
  }
  const double end = reduce ? std::max(t, comm) : t;
  return std::max(0.0, end - base);
}

}  // namespace

double overlapped_step_delay(const Stage& st, const std::vector<LayerPlan>& layers,
                             int64_t grad_accum) {
  if (grad_accum == 1) return overlapped_delay(st, layers, true, true);
  return overlapped_delay(st, layers, false, true) + overlapped_delay(st, layers, true, false) +
         static_cast<double>(grad_accum - 2) * overlapped_delay(st, layers, false, false);
}

void plan_collective_time(const PlanRequest& r, double overlapped, Plan& plan) {
  const double ga = static_cast<double>(r.work.grad_accum);
  double total = 0.0;
  double exposed = 0.0;
  for (const LayerPlan& lp : plan.layers) {
    for (const CollectivePlan& c : lp.collectives) {
      const bool per_step = c.what == "dp.grad_reduce" || c.what == "zero.param_gather";
      total += c.ms * (per_step ? 1.0 : ga);
      if (c.exposed) exposed += c.ms * ga;
    }
  }
  plan.summary.collective_ms = exposed + overlapped;
  plan.summary.collective_total_ms = total;
}

}  // namespace spillway::planner

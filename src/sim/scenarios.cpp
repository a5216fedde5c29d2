// The simulator's scenarios: a training step of a plan, and a weight-streaming pass (a
// forward pass whose layers' weights are copied in d layers ahead, with the plan's exposed
// forward collectives after each layer's compute). This file: the training step; the
// weight-streaming pass is weight_stream.cpp's, the parts both are built of (topology,
// tasks, memory curve, stall accounting, memory verdict) scenario_parts.cpp's.
//
// Training step, per GPU and micro-batch (grad_accum of them, one after the other):
//   forward   every op of every layer on the compute stream; an offloaded tensor's D2H
//             copy is issued when its producing op ends (the layer input when the previous
//             layer ends); with an in-flight bound, the op after a producer waits until
//             the copies ahead of the new one have drained below the bound (back-pressure);
//   head      LM head + loss;
//   backward  layers in reverse: layer l's reloads (H2D, one per tensor) are issued when
//             layer l + prefetch_depth starts its backward and never before their D2H
//             copy ended; the layer's recompute, then its backward, wait for them.
// Memory (GPU 0): static memory and the other micro-batches in flight of a pipeline stage
// (Note [Micro-batches in flight]), plus each saved tensor from its production to the end of
// its layer's backward, except: an offloaded tensor leaves HBM when its D2H copy ends and
// returns when its reload starts; a recomputed tensor leaves when its layer's forward
// ends and returns when the recompute starts; the logits live while the head runs.
//
// Note [Collectives in the simulator]: every CollectivePlan of a layer becomes one task on
// its GPU's communication stream (collectives of one GPU run one at a time, in issue order,
// as NCCL kernels on one stream do), whose work is the ring's byte volume (ring_bytes:
// 2(n-1)/n x S for an all-reduce, (n-1)/n x S otherwise), after its ring-step latency
// (ring_latency_ms: ring_steps x L, on the stream but off the link). Where it sits:
//   - exposed (all-to-all) in the forward: inside the layer, blocking compute: a
//     "...dispatch" after the op moe.dispatch, a "...combine" before the op moe.combine,
//     anything else after the layer's last op; the next op waits for it;
//   - exposed in the backward: after the layer's recompute, before its backward;
//   - overlapped in the forward (a weight gather): layer l's is issued when layer l - 1
//     starts its forward (layer 0's at the start), and layer l's first op waits for it;
//   - overlapped all-gather in the backward: layer l's is issued when layer l + 1 starts its
//     backward (the last layer's when the head starts), and layer l's recompute and
//     backward wait for it;
//   - other overlapped backward collectives (gradient reductions): after the layer's
//     backward, in the last micro-batch only (gradients are reduced once per step, as DDP's
//     no_sync and Megatron's gradient accumulation do); nothing waits for them but the
//     end of the step.
// The link: a "host" collective occupies both directions of its GPU's shared host link
// (it sends device->host and receives host->device), fairly shared with the offload copies
// of every GPU on that link, at the link's capacity (not the plan's gbps, which is already
// a fair share); an "nvlink" or "network" one gets its GPU's own link at the plan's gbps.
// Gathered weight buffers are not in the memory curve.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "sim/scenario_parts.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/collectives.hpp"
#include "spillway/sim/sim.hpp"

namespace spillway {

namespace {

using sim::Engine;
using sim::Task;
using sim::detail::add_collective;
using sim::detail::Built;
using sim::detail::check_collectives;
using sim::detail::check_topology;
using sim::detail::compute_stats;
using sim::detail::fill_records;
using sim::detail::judge_memory;
using sim::detail::make_task;
using sim::detail::make_topology;
using sim::detail::memory_curve;
using sim::detail::Topology;

// One training step as tasks of the engine (the scenario at the top of this file), built
// phase by phase: the streams and links; per GPU and micro-batch, the forward, the head
// and the backward; the optimizer once per step; after the run, the results. The phases
// add their tasks in this order, which fixes the tasks' ids.
class TrainingStep {
 public:
  TrainingStep(const Plan& plan, const PlanRequest& req, const SimOptions& o);
  SimResult run();

 private:
  // One micro-batch on one GPU: what its forward hands to its head and backward.
  struct Pass {
    Pass(int gpu, int64_t micro_batch, size_t layers)
        : g(gpu),
          mb(micro_batch),
          mbi(static_cast<int>(micro_batch)),
          track(gpu == 0 && micro_batch == 0),
          layer_tensor_d2h(layers),
          before_fwd(layers),
          bwd_task(layers, -1),
          reloads(layers),
          before_bwd(layers) {}
    int g = 0;
    int64_t mb = 0;
    int mbi = 0;
    bool track = false;  // GPU 0, micro-batch 0: the memory and backlog bookkeeping
    // In-flight accounting for back-pressure: D2H tasks of this GPU in issue order.
    std::vector<std::pair<int, int64_t>> d2h_issued;
    size_t drained = 0;  // copies known complete before the next compute op
    int64_t inflight = 0;
    std::vector<std::vector<std::pair<int, int>>> layer_tensor_d2h;  // (tensor idx, task)
    std::vector<int> pending_gate;  // D2H task the next compute op must wait for
    std::vector<int> pending_comm;  // collectives the next compute task must wait for
    // Overlapped forward collectives (weight gathers), issued one layer ahead.
    std::vector<std::vector<int>> before_fwd;
    int last_fwd = -1;
    int head = -1;
    // Backward: bwd_task[l] is layer l's backward; reloads of layer l wait for the end of
    // the backward of layer l + prefetch + 1 (i.e. the start of l + prefetch).
    std::vector<int> bwd_task;
    std::vector<std::vector<int>> reloads;
    std::vector<std::vector<int>> before_bwd;  // overlapped all-gathers, one layer ahead
  };

  int collective(size_t l, const CollectivePlan& c, const Pass& p, std::initializer_list<int> deps);
  void reserve();
  void forward(Pass& p);
  void forward_layer(Pass& p, size_t l);
  void issue_before_forward(Pass& p, size_t l, int after);
  void issue_d2h(Pass& p, size_t l, size_t ti, int producer_task);
  void head(Pass& p);
  void backward(Pass& p);
  void backward_layer(Pass& p, size_t l);
  void issue_reloads(Pass& p, size_t l, int after);
  void issue_before_backward(Pass& p, size_t l, int after);
  void optimizer();
  void summarize(SimResult& r) const;
  void backlog(SimResult& r) const;
  void memory(SimResult& r) const;

  const Plan& plan_;
  const PlanRequest& req_;
  const SimOptions& o_;
  int gpus_ = 1;
  int per_link_ = 1;
  int prefetch_ = 0;
  int64_t ga_ = 1;
  size_t n_ = 0;           // layers
  double link_d2h_ = 0.0;  // GB/s per direction
  double link_h2d_ = 0.0;
  Engine e_;
  Topology topo_;
  Built b_;
  std::unordered_map<int, size_t> tensor_of_d2h_;  // GPU 0, micro-batch 0
  std::vector<size_t> layer_first_tensor_;         // GPU 0, micro-batch 0
};

TrainingStep::TrainingStep(const Plan& plan, const PlanRequest& req, const SimOptions& o)
    : plan_(plan), req_(req), o_(o) {
  gpus_ = o.gpus > 0 ? o.gpus : plan.summary.gpus_per_link;
  per_link_ = o.gpus_per_link > 0 ? o.gpus_per_link : gpus_;
  check_topology(gpus_, per_link_);
  if (o.inflight_bound_bytes < 0)
    SPILLWAY_FIELD_ERROR("inflight_bound_bytes", o.inflight_bound_bytes, "must be >= 0");
  prefetch_ = o.prefetch_depth > 0 ? o.prefetch_depth : req.prefetch_depth;
  ga_ = req.work.grad_accum;
  n_ = plan.layers.size();
  SPILLWAY_CHECK(n_ > 0, "the plan has no layers");

  // The link's capacity: the plan's per-GPU figure times the GPUs it assumed per link.
  link_d2h_ = plan.summary.d2h_gbps * plan.summary.gpus_per_link;
  link_h2d_ = plan.summary.h2d_gbps * plan.summary.gpus_per_link;
  const double hbm = o.hbm_contention ? req.hardware.hbm_tbps * 1e9 : 0.0;  // bytes per ms
  topo_ = make_topology(e_, gpus_, per_link_, link_d2h_ * 1e6, link_h2d_ * 1e6, hbm);
  b_.layer_last_fwd.assign(n_, -1);
  b_.layer_d2h.assign(n_, {});
  b_.mb_last_fwd.assign(static_cast<size_t>(ga_), std::vector<int>(n_, -1));
  b_.mb_layer_d2h.assign(static_cast<size_t>(ga_), std::vector<std::vector<int>>(n_));
  check_collectives(plan);
}

SimResult TrainingStep::run() {
  reserve();
  for (int g = 0; g < gpus_; ++g) {
    for (int64_t mb = 0; mb < ga_; ++mb) {
      Pass p(g, mb, n_);
      forward(p);
      head(p);
      backward(p);
    }
  }
  optimizer();
  e_.run();

  SimResult r;
  r.scenario = "train-step";
  r.gpus = gpus_;
  r.gpus_per_link = per_link_;
  r.link_d2h_gbps = link_d2h_;
  r.link_h2d_gbps = link_h2d_;
  summarize(r);
  backlog(r);
  memory(r);
  judge_memory(r, plan_, req_);
  fill_records(e_, b_, o_.keep_tasks, r);
  return r;
}

int TrainingStep::collective(size_t l, const CollectivePlan& c, const Pass& p,
                             std::initializer_list<int> deps) {
  return add_collective(e_, topo_, b_, o_.keep_tasks, l, c, p.g, p.mbi, deps);
}

void TrainingStep::reserve() {
  size_t task_estimate = 0;
  for (const LayerPlan& l : plan_.layers) task_estimate += l.ops.size() + 2 * l.tensors.size() + 2;
  e_.reserve(task_estimate * static_cast<size_t>(gpus_ * ga_) + 8,
             task_estimate * 3 * static_cast<size_t>(gpus_ * ga_));
}

// ---- forward ----

void TrainingStep::forward(Pass& p) {
  for (size_t l = 0; l < n_; ++l) forward_layer(p, l);
}

void TrainingStep::issue_before_forward(Pass& p, size_t l, int after) {
  for (const CollectivePlan& c : plan_.layers[l].collectives) {
    if (!c.backward && !c.exposed) p.before_fwd[l].push_back(collective(l, c, p, {after}));
  }
}

void TrainingStep::issue_d2h(Pass& p, size_t l, size_t ti, int producer_task) {
  const TensorPlan& tp = plan_.layers[l].tensors[ti];
  const auto g = static_cast<size_t>(p.g);
  const int id = e_.add_task(make_task(
      TaskKind::kD2H, p.g, static_cast<int>(l), p.mbi, topo_.d2h[g], static_cast<double>(tp.bytes),
      topo_.link_d2h[g], o_.keep_tasks, b_, [&] { return fmt::format("L{} {}", l, tp.name); }));
  if (producer_task >= 0) e_.add_dep(id, producer_task);
  p.layer_tensor_d2h[l].emplace_back(static_cast<int>(ti), id);
  if (p.track) b_.layer_d2h[l].push_back(id);
  if (p.g == 0) b_.mb_layer_d2h[static_cast<size_t>(p.mb)][l].push_back(id);
  // Back-pressure: the next compute op waits for the oldest copies until the bytes in
  // flight, this copy included, fit the bound.
  p.d2h_issued.emplace_back(id, tp.bytes);
  p.inflight += tp.bytes;
  if (o_.inflight_bound_bytes > 0) {
    while (p.inflight > o_.inflight_bound_bytes && p.drained < p.d2h_issued.size()) {
      p.pending_gate.push_back(p.d2h_issued[p.drained].first);
      p.inflight -= p.d2h_issued[p.drained].second;
      ++p.drained;
    }
  }
}

void TrainingStep::forward_layer(Pass& p, size_t l) {
  const LayerPlan& lp = plan_.layers[l];
  std::vector<int> op_task(lp.ops.size(), -1);
  const int layer_input_task = p.last_fwd;
  if (l == 0) issue_before_forward(p, 0, -1);
  if (l + 1 < n_) issue_before_forward(p, l + 1, layer_input_task);
  // Offload of the layer input: issued at the layer's start.
  for (size_t ti = 0; ti < lp.tensors.size(); ++ti) {
    if (lp.tensors[ti].producer < 0 && lp.tensors[ti].action == Action::kOffload)
      issue_d2h(p, l, ti, layer_input_task);
  }
  for (size_t k = 0; k < lp.ops.size(); ++k) {
    const OpPlan& op = lp.ops[k];
    Task t = make_task(TaskKind::kForward, p.g, static_cast<int>(l), p.mbi,
                       topo_.compute[static_cast<size_t>(p.g)], op.fwd_ms, -1, o_.keep_tasks, b_,
                       [&] { return fmt::format("L{} {}", l, op.name); });
    t.memory_bound = op.kind == OpKind::kMemory;
    const int id = e_.add_task(t);
    for (int gate : p.pending_gate) e_.add_dep(id, gate);
    p.pending_gate.clear();
    for (int c : p.pending_comm) e_.add_dep(id, c);
    p.pending_comm.clear();
    if (k == 0) {
      for (int c : p.before_fwd[l]) e_.add_dep(id, c);
    }
    op_task[k] = id;
    p.last_fwd = id;
    for (size_t ti = 0; ti < lp.tensors.size(); ++ti) {
      if (lp.tensors[ti].producer == static_cast<int>(k) &&
          lp.tensors[ti].action == Action::kOffload) {
        issue_d2h(p, l, ti, id);
      }
    }
    for (const CollectivePlan& c : lp.collectives) {
      if (!c.backward && c.exposed &&
          exposed_forward_position(c, lp.ops.size(), [&](size_t i) -> std::string_view {
            return lp.ops[i].name;
          }) == static_cast<int>(k))
        p.pending_comm.push_back(collective(l, c, p, {id}));
    }
  }
  if (p.g == 0) b_.mb_last_fwd[static_cast<size_t>(p.mb)][l] = p.last_fwd;
  if (!p.track) return;
  b_.layer_last_fwd[l] = p.last_fwd;
  layer_first_tensor_.push_back(b_.tensors.size());
  for (size_t ti = 0; ti < lp.tensors.size(); ++ti) {
    const TensorPlan& tp = lp.tensors[ti];
    Built::TensorTasks tt;
    tt.layer = static_cast<int>(l);
    tt.bytes = tp.bytes;
    tt.action = tp.action;
    tt.produced_by =
        tp.producer >= 0 ? op_task[static_cast<size_t>(tp.producer)] : layer_input_task;
    tt.layer_fwd_end = p.last_fwd;
    for (const auto& [tensor, task] : p.layer_tensor_d2h[l]) {
      if (tensor == static_cast<int>(ti)) {
        tt.d2h = task;
        tensor_of_d2h_[task] = b_.tensors.size();
      }
    }
    b_.tensors.push_back(tt);
  }
}

// ---- head ----

void TrainingStep::head(Pass& p) {
  p.head = e_.add_task(make_task(TaskKind::kHead, p.g, -1, p.mbi,
                                 topo_.compute[static_cast<size_t>(p.g)], plan_.summary.head_ms, -1,
                                 o_.keep_tasks, b_, [] { return std::string("LM head + loss"); }));
  for (int gate : p.pending_gate) e_.add_dep(p.head, gate);
  p.pending_gate.clear();
  for (int c : p.pending_comm) e_.add_dep(p.head, c);
  p.pending_comm.clear();
  if (p.track) b_.head = p.head;
}

// ---- backward ----

void TrainingStep::issue_reloads(Pass& p, size_t l, int after) {
  const LayerPlan& lp = plan_.layers[l];
  const auto g = static_cast<size_t>(p.g);
  for (const auto& [ti, d2h_task] : p.layer_tensor_d2h[l]) {
    const TensorPlan& tp = lp.tensors[static_cast<size_t>(ti)];
    const int id =
        e_.add_task(make_task(TaskKind::kH2D, p.g, static_cast<int>(l), p.mbi, topo_.h2d[g],
                              static_cast<double>(tp.bytes), topo_.link_h2d[g], o_.keep_tasks, b_,
                              [&] { return fmt::format("L{} {}", l, tp.name); }));
    e_.add_dep(id, d2h_task);
    if (after >= 0) e_.add_dep(id, after);
    p.reloads[l].push_back(id);
    if (p.track) b_.tensors[tensor_of_d2h_.at(d2h_task)].h2d = id;
  }
}

// Overlapped backward all-gathers, issued one layer ahead (Note [Collectives in the
// simulator]).
void TrainingStep::issue_before_backward(Pass& p, size_t l, int after) {
  for (const CollectivePlan& c : plan_.layers[l].collectives) {
    if (c.backward && !c.exposed && c.kind == CollectiveKind::kAllGather)
      p.before_bwd[l].push_back(collective(l, c, p, {after}));
  }
}

void TrainingStep::backward(Pass& p) {
  // Reloads due at the start of backward: layers n-1-prefetch .. n-1.
  for (size_t l = n_; l-- > 0;) {
    if (l + static_cast<size_t>(prefetch_) + 1 >= n_) issue_reloads(p, l, p.head);
  }
  issue_before_backward(p, n_ - 1, p.last_fwd);  // when the head starts
  for (size_t l = n_; l-- > 0;) backward_layer(p, l);
}

void TrainingStep::backward_layer(Pass& p, size_t l) {
  const LayerPlan& lp = plan_.layers[l];
  const auto g = static_cast<size_t>(p.g);
  // Gradients are reduced once per step, in its last micro-batch.
  const bool reduce_now = p.mb + 1 == ga_;
  const int previous = l + 1 < n_ ? p.bwd_task[l + 1] : p.head;
  int rc = -1;
  if (lp.recompute_ms > 0.0) {
    rc = e_.add_task(make_task(TaskKind::kRecompute, p.g, static_cast<int>(l), p.mbi,
                               topo_.compute[g], lp.recompute_ms, -1, o_.keep_tasks, b_,
                               [&] { return fmt::format("L{} recompute", l); }));
    for (int r : p.reloads[l]) e_.add_dep(rc, r);
    for (int c : p.before_bwd[l]) e_.add_dep(rc, c);
  }
  for (const CollectivePlan& c : lp.collectives) {
    if (c.backward && c.exposed)
      p.pending_comm.push_back(collective(l, c, p, {rc >= 0 ? rc : previous}));
  }
  const int bw = e_.add_task(make_task(TaskKind::kBackward, p.g, static_cast<int>(l), p.mbi,
                                       topo_.compute[g], lp.bwd_ms, -1, o_.keep_tasks, b_,
                                       [&] { return fmt::format("L{} backward", l); }));
  for (int r : p.reloads[l]) e_.add_dep(bw, r);
  for (int c : p.before_bwd[l]) e_.add_dep(bw, c);
  for (int c : p.pending_comm) e_.add_dep(bw, c);
  p.pending_comm.clear();
  p.bwd_task[l] = bw;
  if (l >= 1) issue_before_backward(p, l - 1, previous);
  for (const CollectivePlan& c : lp.collectives) {
    if (reduce_now && c.backward && !c.exposed && c.kind != CollectiveKind::kAllGather)
      collective(l, c, p, {bw});
  }
  if (p.track) {
    const size_t end = l + 1 < n_ ? layer_first_tensor_[l + 1] : b_.tensors.size();
    for (size_t k = layer_first_tensor_[l]; k < end; ++k) {
      b_.tensors[k].backward = bw;
      b_.tensors[k].recompute = rc;
    }
  }
  // The end of this backward lets layer l - prefetch - 1 reload.
  if (l >= static_cast<size_t>(prefetch_) + 1)
    issue_reloads(p, l - static_cast<size_t>(prefetch_) - 1, bw);
}

// ---- optimizer ----

// The optimizer once per step after the last backward (Note [Training state] in
// src/plan/stage.cpp): the device AdamW, or the offloaded pipeline's tail. It steps
// reduced gradients: it waits for the GPU's last collective too.
void TrainingStep::optimizer() {
  if (!(plan_.summary.state.optimizer_ms > 0.0)) return;
  std::vector<int> last_collective(static_cast<size_t>(gpus_), -1);
  for (size_t id = 0; id < e_.tasks().size(); ++id) {
    const Task& t = e_.tasks()[id];
    if (t.kind == TaskKind::kCollective)
      last_collective[static_cast<size_t>(t.gpu)] = static_cast<int>(id);
  }
  for (int g = 0; g < gpus_; ++g) {
    const int opt =
        e_.add_task(make_task(TaskKind::kOptimizer, g, -1, 0, topo_.compute[static_cast<size_t>(g)],
                              plan_.summary.state.optimizer_ms, -1, o_.keep_tasks, b_,
                              [] { return std::string("optimizer"); }));
    if (last_collective[static_cast<size_t>(g)] >= 0)
      e_.add_dep(opt, last_collective[static_cast<size_t>(g)]);
  }
}

// ---- results ----

// Step time, GPU 0's split, collectives and the achieved link bandwidth.
void TrainingStep::summarize(SimResult& r) const {
  SimSummary& s = r.summary;
  s.events = e_.events();
  s.hbm_slowdown = e_.worst_hbm_slowdown();
  s.gpu_step_ms.assign(static_cast<size_t>(gpus_), 0.0);
  for (const Task& t : e_.tasks()) {
    s.gpu_step_ms[static_cast<size_t>(t.gpu)] =
        std::max(s.gpu_step_ms[static_cast<size_t>(t.gpu)], t.end_ms);
    if (t.kind == TaskKind::kD2H) s.d2h_bytes += static_cast<int64_t>(t.work);
    if (t.kind == TaskKind::kH2D) s.h2d_bytes += static_cast<int64_t>(t.work);
    if (t.kind == TaskKind::kCollective) {
      ++s.collectives;
      s.collective_bytes += static_cast<int64_t>(t.work);
      if (t.link2 >= 0) s.collective_host_bytes += static_cast<int64_t>(t.work);
    }
  }
  s.step_ms = e_.makespan_ms();
  compute_stats(e_, topo_.compute[0], s);
  double last_compute = 0.0;
  double last_copy = 0.0;
  double last_backward = 0.0;  // compute before the optimizer
  double last_collective = 0.0;
  for (const Task& t : e_.tasks()) {
    if (t.gpu != 0) continue;
    if (t.stream == topo_.compute[0]) last_compute = std::max(last_compute, t.end_ms);
    if (t.stream == topo_.compute[0] && t.kind != TaskKind::kOptimizer)
      last_backward = std::max(last_backward, t.end_ms);
    if (t.kind == TaskKind::kD2H || t.kind == TaskKind::kH2D)
      last_copy = std::max(last_copy, t.end_ms);
    if (t.kind == TaskKind::kCollective) last_collective = std::max(last_collective, t.end_ms);
  }
  s.exposed_copy_ms = std::max(0.0, last_copy - last_compute);
  // The collectives' tail: how long the last of them runs past the end of backward and of
  // the copies (the optimizer, when there is one, waits for it).
  s.collective_tail_ms = std::max(0.0, last_collective - std::max(last_backward, last_copy));
  if (!topo_.comm.empty()) s.collective_ms = e_.stream_busy_ms(topo_.comm[0]);
  s.idle_ms = std::max(
      0.0, s.gpu_step_ms[0] - s.compute_ms - s.recompute_ms - s.stall_ms - s.collective_wait_ms);
  const double busy_d2h = e_.link_busy_ms(topo_.link_d2h[0]);
  const double busy_h2d = e_.link_busy_ms(topo_.link_h2d[0]);
  // Achieved bandwidth of the first link: its GPUs' bytes over the time it was busy.
  int64_t link0_d2h = 0;
  int64_t link0_h2d = 0;
  for (const Task& t : e_.tasks()) {  // copies and collectives through the host
    if (t.link == topo_.link_d2h[0]) link0_d2h += static_cast<int64_t>(t.work);
    if (t.link == topo_.link_h2d[0] || t.link2 == topo_.link_h2d[0])
      link0_h2d += static_cast<int64_t>(t.work);
  }
  s.link_d2h_gbps = busy_d2h > 0.0 ? static_cast<double>(link0_d2h) / busy_d2h / 1e6 : 0.0;
  s.link_h2d_gbps = busy_h2d > 0.0 ? static_cast<double>(link0_h2d) / busy_h2d / 1e6 : 0.0;
  s.link_gbps_achieved = std::max(s.link_d2h_gbps, s.link_h2d_gbps);
}

// Backlog and snowball (GPU 0, micro-batch 0).
void TrainingStep::backlog(SimResult& r) const {
  SimSummary& s = r.summary;
  const std::vector<Task>& tk = e_.tasks();
  r.layer_fwd_end_ms.resize(n_);
  for (size_t l = 0; l < n_; ++l)
    r.layer_fwd_end_ms[l] = tk[static_cast<size_t>(b_.layer_last_fwd[l])].end_ms;
  // Produced (the producing op ended) but not yet copied at each boundary t. GPU 0's
  // first micro-batch's copies run in FIFO order on one engine, so production, start and
  // end times increase along them: the pending ones are a contiguous range whose first
  // member alone may be running (counted pro rata); prefix sums make it O(1) per layer.
  s.backlog_bytes.assign(n_, 0);
  std::vector<int> order;
  for (size_t l = 0; l < n_; ++l)
    order.insert(order.end(), b_.layer_d2h[l].begin(), b_.layer_d2h[l].end());
  std::vector<double> prefix(order.size() + 1, 0.0);
  for (size_t k = 0; k < order.size(); ++k)
    prefix[k + 1] = prefix[k] + tk[static_cast<size_t>(order[k])].work;
  auto produced_at = [&](const Task& c) {
    return c.last_dep >= 0 ? tk[static_cast<size_t>(c.last_dep)].end_ms : 0.0;
  };
  size_t done = 0;
  size_t produced = 0;
  for (size_t l = 0; l < n_; ++l) {
    const double t = r.layer_fwd_end_ms[l];
    while (done < order.size() && tk[static_cast<size_t>(order[done])].end_ms <= t) ++done;
    while (produced < order.size() &&
           produced_at(tk[static_cast<size_t>(order[produced])]) <= t + 1e-9)
      ++produced;
    double pending = 0.0;
    if (produced > done) {
      pending = prefix[produced] - prefix[done];
      const Task& c = tk[static_cast<size_t>(order[done])];
      if (c.start_ms < t) pending -= c.work * (t - c.start_ms) / (c.end_ms - c.start_ms);
    }
    s.backlog_bytes[l] = static_cast<int64_t>(pending);
  }
  // A layer whose copies end after the next layer's forward: the queue carries over and
  // grows; the first such layer, in any micro-batch of GPU 0 (ZeRO-1/2's weight gathers
  // pace the first one's forward only: Note [Forward paced by the gathers] in
  // src/plan/timeline.cpp), names the snowball.
  for (size_t mb = 0; mb < b_.mb_layer_d2h.size(); ++mb) {
    const std::vector<std::vector<int>>& d2h = b_.mb_layer_d2h[mb];
    for (size_t l = 0; l + 1 < n_; ++l) {
      if (d2h[l].empty()) continue;
      const double last = tk[static_cast<size_t>(d2h[l].back())].end_ms;
      const double next_end = tk[static_cast<size_t>(b_.mb_last_fwd[mb][l + 1])].end_ms;
      if (last > next_end * (1.0 + 1e-9) + 1e-9) {
        s.snowball = true;
        if (!s.snowball_first_layer || static_cast<int>(l) < *s.snowball_first_layer)
          s.snowball_first_layer = static_cast<int>(l);
        break;
      }
    }
  }
}

// Memory over time (GPU 0; micro-batch 0 drives the shape, later ones repeat it).
void TrainingStep::memory(SimResult& r) const {
  const std::vector<Task>& tk = e_.tasks();
  std::vector<std::pair<double, int64_t>> ev;
  auto end_of = [&](int id) { return id >= 0 ? tk[static_cast<size_t>(id)].end_ms : 0.0; };
  auto start_of = [&](int id) { return tk[static_cast<size_t>(id)].start_ms; };
  for (const Built::TensorTasks& tt : b_.tensors) {
    const double born = end_of(tt.produced_by);
    const double gone = end_of(tt.backward);
    ev.emplace_back(born, tt.bytes);
    switch (tt.action) {
      case Action::kKeep:
        ev.emplace_back(gone, -tt.bytes);
        break;
      case Action::kOffload:
        ev.emplace_back(end_of(tt.d2h), -tt.bytes);
        ev.emplace_back(tt.h2d >= 0 ? start_of(tt.h2d) : gone, tt.bytes);
        ev.emplace_back(gone, -tt.bytes);
        break;
      case Action::kRecompute:
        ev.emplace_back(end_of(tt.layer_fwd_end), -tt.bytes);
        ev.emplace_back(tt.recompute >= 0 ? start_of(tt.recompute) : start_of(tt.backward),
                        tt.bytes);
        ev.emplace_back(gone, -tt.bytes);
        break;
    }
  }
  if (b_.head >= 0 && plan_.summary.logits_bytes > 0) {
    ev.emplace_back(start_of(b_.head), plan_.summary.logits_bytes);
    ev.emplace_back(end_of(b_.head), -plan_.summary.logits_bytes);
  }
  const MemoryBreakdown& pk = plan_.summary.peak;
  // Note [Micro-batches in flight]: the plan is the first 1F1B stage, which holds
  // pp micro-batches at once (docs/planner.md, Note [Peak memory] in src/plan/timeline.cpp).
  // In 1F1B's steady state, while GPU 0's micro-batch runs its forward and backward, the
  // pp - 1 others in flight hold what their forward left on the device: each layer's kept
  // tensors (fp8 scaling state included); their offloaded tensors are on the host.
  int64_t kept = 0;
  for (const LayerPlan& lp : plan_.layers) kept += lp.kept_bytes + lp.fp8_scaling_state_bytes;
  const int64_t in_flight = (req_.work.pp - 1) * kept;
  const int64_t base = pk.weights + pk.gradients + pk.optimizer_states + pk.buffers + in_flight;
  r.memory = memory_curve(std::move(ev), base, &r.summary.peak_hbm_bytes);
}

}  // namespace

SimResult simulate_training_step(const Plan& plan, const PlanRequest& req, const SimOptions& o) {
  return TrainingStep(plan, req, o).run();
}

}  // namespace spillway

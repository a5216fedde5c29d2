// `spillway train`: one policy's run (run_policy): the host device, the model, the
// offloaded optimizer when asked, the offload engine sized for the policy, and the steps,
// each measured, with the re-plans between them (trainer.cpp runs the policies).
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <random>

#include "core/stats.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device.hpp"
#include "spillway/offload/offload.hpp"
#include "spillway/train/train.hpp"
#include "train/trainer_impl.hpp"

namespace spillway::train {

using namespace spillway::nn;  // the reference model this application trains

namespace {

// Note [Train offload sizing]: the pinned pool holds one step's offloaded tensors; the
// device pool (the documented staging, part of the device budget) holds the reloads of
// prefetch_depth + 1 layers (the one in use and those prefetched); in-flight D2H bytes are bounded
// at one layer's worth, so offload holds at most one layer's offloaded bytes beyond what recompute
// holds (plus that staging), and a copy engine that cannot keep up stalls compute (counted as
// back-pressure) instead of holding device memory without limit.
OffloadOptions offload_options(const Model& m, const MemoryPolicy& p, int batch, int seq) {
  const RefConfig& c = m.config();
  int64_t total = 0, layer_max = 0, tensor_max = 0;
  int tensors = 0;
  for (int l = 0; l < c.layers(); ++l) {
    const std::vector<int64_t> bytes = m.saved_tensor_bytes(l, batch, seq);
    int64_t layer = 0;
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (p.layers[static_cast<size_t>(l)].actions[i] != Action::kOffload) continue;
      const int64_t b = (bytes[i] + 255) / 256 * 256;
      layer += b;
      tensor_max = std::max(tensor_max, b);
      ++tensors;
    }
    total += layer;
    layer_max = std::max(layer_max, layer);
  }
  OffloadOptions o;
  o.pinned_slabs = 2;
  o.pinned_bytes = total + 2 * tensor_max + 4096;
  o.device_pool_bytes = (p.prefetch_depth + 1) * layer_max + 2 * tensor_max + 4096;
  o.inflight_bound_bytes = layer_max;
  o.max_tensors = tensors + 16;
  return o;
}

// Note [A run's link time]: each step copies the policy's offloaded tensors down and
// reloads them; over the steps, at the throttles (and the --link-schedule's changes), that
// takes at least so long. A run over o.max_link_seconds is refused before its first step,
// naming the slower direction's flag. Unthrottled copies (0) run at memcpy speed: no bound.
void check_link_time(const Model& m, const MemoryPolicy& p, const TrainOptions& o) {
  const RefConfig& c = m.config();
  double step_bytes = 0;
  for (int l = 0; l < c.layers(); ++l) {
    const std::vector<int64_t> bytes = m.saved_tensor_bytes(l, o.micro_batch, o.seq_len);
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (p.layers[static_cast<size_t>(l)].actions[i] == Action::kOffload)
        step_bytes += static_cast<double>(bytes[i]);
    }
  }
  if (step_bytes <= 0) return;
  struct Direction {
    const char* flag;
    double gbps;
    LinkTime time;
  };
  Direction dirs[] = {{"--d2h-gbps", o.d2h_gbps, {}}, {"--h2d-gbps", o.h2d_gbps, {}}};
  for (Direction& d : dirs) {
    if (d.gbps <= 0) continue;
    double gbps = d.gbps;
    for (int s = 0; s < o.steps; ++s) {
      for (const LinkChange& ch : o.link_schedule) {
        if (ch.step == s + 1) gbps = ch.gbps;
      }
      d.time.add(step_bytes, gbps);
    }
  }
  const Direction& slow = dirs[0].time.seconds >= dirs[1].time.seconds ? dirs[0] : dirs[1];
  if (!slow.time.over(o.max_link_seconds)) return;
  SPILLWAY_INPUT_ERROR(
      "{} is {}; the {} policy's {} steps copy at least {:.1f} MB each way ({} steps x {:.3f} MB "
      "of offloaded activations), {:.3g} s at {} GB/s{}: more than the {:.0f} s a run may take; "
      "raise {} to {:.3g} or more, or lower --steps",
      slow.flag, slow.gbps, p.name, o.steps, slow.time.bytes / 1e6, o.steps, step_bytes / 1e6,
      slow.time.seconds, slow.gbps, o.link_schedule.empty() ? "" : " (and the --link-schedule)",
      o.max_link_seconds, slow.flag, slow.time.bytes / 1e9 / o.max_link_seconds);
}

std::vector<int32_t> batch_tokens(const std::vector<int32_t>& corpus, uint64_t seed, int step,
                                  int batch, int seq) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(step));
  const size_t span = static_cast<size_t>(seq) + 1;
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(batch) * span);
  for (int b = 0; b < batch; ++b) {
    const size_t start = static_cast<size_t>(rng() % (corpus.size() - span + 1));
    out.insert(out.end(), corpus.begin() + static_cast<std::ptrdiff_t>(start),
               corpus.begin() + static_cast<std::ptrdiff_t>(start + span));
  }
  return out;
}

std::string count_actions(const MemoryPolicy& p) {
  return fmt::format("{} kept, {} offloaded, {} recomputed tensors", p.count(Action::kKeep),
                     p.count(Action::kOffload), p.count(Action::kRecompute));
}

}  // namespace

namespace detail {

PolicyResult run_policy(const RefConfig& c, const TrainOptions& o, const MemoryPolicy& first,
                        const std::vector<int32_t>& corpus,
                        const std::function<void(const std::string&)>& progress,
                        const Replanner& replan) {
  HostDeviceOptions ho;
  ho.device_bytes = static_cast<int64_t>(o.device_memory_mb * 1048576.0);
  ho.d2h_gbps = o.d2h_gbps;
  ho.h2d_gbps = o.h2d_gbps;
  // Note [A link that changes speed]: the device's copies go through a link whose speed the
  // schedule sets before the steps it names.
  if (!o.link_schedule.empty()) ho.link = std::make_shared<HostLink>(o.h2d_gbps, o.d2h_gbps);
  std::unique_ptr<Device> dev = make_host_device(ho);
  MemoryPolicy pol = first;
  PolicyResult r;
  r.name = pol.name;
  const bool offload_optimizer = o.optimizer == "offload";
  Model model(c, *dev, o.seed, !offload_optimizer);
  // Optimizer offload: the model's AdamW constants, PyTorch's update (decoupled decay).
  std::unique_ptr<optim::AdamW> pool;
  std::unique_ptr<optim::OptimizerOffload> optimizer;
  if (offload_optimizer) {
    optim::OptimOffloadOptions oo;
    oo.hp.lr = o.lr;
    oo.hp.beta1 = 0.9;
    oo.hp.beta2 = 0.95;
    oo.hp.eps = 1e-8;
    oo.hp.weight_decay = 0.1;
    oo.clip = o.clip;
    oo.cast = optim::CastSite::kHost;
    oo.device_buckets = o.device_buckets;
    oo.undo_limit_bytes = o.undo_mb < 0 ? -1 : static_cast<int64_t>(o.undo_mb * 1048576.0);
    oo.device_weights = model.device_weights_bf16();  // caller-owned: the model's buffers
    oo.device_grads = model.device_grads_bf16();
    pool = std::make_unique<optim::AdamW>();
    const std::vector<float> w0 = model.parameters();
    optimizer = std::make_unique<optim::OptimizerOffload>(*dev, model.compute_stream(), w0.data(),
                                                          w0.size(), model.parameter_buckets(), oo,
                                                          pool.get());
  }
  check_link_time(model, pol, o);
  std::unique_ptr<OffloadEngine> engine;
  std::unique_ptr<OffloadHooks> offload_hooks;
  std::unique_ptr<optim::OptimizerHooks> optimizer_hooks;
  if (optimizer) optimizer_hooks = std::make_unique<optim::OptimizerHooks>(*optimizer);
  // Note [Hook sequence]: the offload engine first, so that its step_end (telemetry) comes
  // before the optimizer's validation, as the step runs. A re-plan (between steps) makes
  // the engine again for the new policy: its pools are sized once per policy.
  CompositeHooks hooks;
  auto install = [&] {
    hooks = CompositeHooks();
    offload_hooks.reset();
    engine.reset();
    if (pol.any_offload()) {
      const OffloadOptions oo = offload_options(model, pol, o.micro_batch, o.seq_len);
      r.inflight_bound_bytes = std::max(r.inflight_bound_bytes, oo.inflight_bound_bytes);
      engine = std::make_unique<OffloadEngine>(*dev, model.compute_stream(), pol, oo);
      offload_hooks = std::make_unique<OffloadHooks>(*engine);
      hooks.add(offload_hooks.get());
    }
    if (optimizer_hooks) hooks.add(optimizer_hooks.get());
  };
  install();
  // Note [The model's own update]: the device optimizer, unless offloaded (or lr is 0).
  TextbookAdamW adamw(o.lr);
  const nn::ParameterUpdate update =
      optimizer || o.lr <= 0 ? nn::ParameterUpdate{} : adamw.update();
  std::vector<double> times, stalls, optimizer_times;
  r.layer_fwd_ms.assign(static_cast<size_t>(c.layers()), 0.0);
  r.layer_bwd_ms.assign(static_cast<size_t>(c.layers()), 0.0);
  for (int s = 0; s < o.steps; ++s) {
    for (const LinkChange& ch : o.link_schedule) {
      if (ch.step == s + 1) {
        ho.link->set_gbps(ch.gbps, ch.gbps);
        if (progress)
          progress(fmt::format("{:<10} step {:>3}: the link now runs at {} GB/s", pol.name, s + 1,
                               ch.gbps));
      }
    }
    const std::vector<int32_t> tokens = batch_tokens(corpus, o.seed, s, o.micro_batch, o.seq_len);
    const StepStats st = model.step(tokens, o.micro_batch, o.seq_len, pol, hooks, update);
    const StepTelemetry tel = offload_hooks ? offload_hooks->telemetry() : StepTelemetry{};
    StepRecord rec;
    rec.step = s;
    rec.loss = st.loss;
    rec.step_ms = st.step_ms;
    rec.optimizer_ms = st.optimizer_ms;
    rec.peak_device_bytes = st.peak_device_bytes;
    rec.offloaded_bytes = tel.d2h_bytes;
    rec.reloaded_bytes = tel.h2d_bytes;
    rec.stall_ms = tel.stall_ms;
    rec.snowball = tel.snowball;
    rec.snowball_layer = tel.snowball_first_layer;
    r.steps.push_back(rec);
    if (s > 0 || o.steps == 1) {
      times.push_back(st.step_ms);
      stalls.push_back(tel.stall_ms);
      optimizer_times.push_back(st.optimizer_ms);
      for (int l = 0; l < c.layers(); ++l) {
        r.layer_fwd_ms[static_cast<size_t>(l)] += st.layer_fwd_ms[static_cast<size_t>(l)];
        r.layer_bwd_ms[static_cast<size_t>(l)] += st.layer_bwd_ms[static_cast<size_t>(l)];
      }
    }
    r.peak_device_bytes = std::max(r.peak_device_bytes, st.peak_device_bytes);
    r.recomputed_ops = st.recomputed_ops;
    r.recomputed_scans = st.recomputed_scans;
    // The summary's verdict is the steady state's: the first step also pays first-touch
    // page faults (its per-step line still warns).
    if (rec.snowball && !r.snowball && (s > 0 || o.steps == 1)) {
      r.snowball = true;
      r.snowball_layer = rec.snowball_layer;
    }
    if (progress) {
      std::string line = fmt::format(
          "{:<10} step {:>3}/{}  loss {:.4f}  {:>8.2f} ms  peak {:>7} MB  offloaded {:>6} MB  "
          "reloaded {:>6} MB  stall {:.2f} ms",
          pol.name, s + 1, o.steps, st.loss, st.step_ms, mb(st.peak_device_bytes),
          mb(rec.offloaded_bytes), mb(rec.reloaded_bytes), rec.stall_ms);
      if (optimizer) line += fmt::format("  optimizer +{:.2f} ms", rec.optimizer_ms);
      if (rec.snowball)
        line += fmt::format(
            "\n  warning: snowball: layer {}'s copies were not done when the next "
            "layer's forward ended; the copy queue grows (slower link than the "
            "plan assumed, or a plan without margin)",
            rec.snowball_layer.value_or(-1));
      progress(line);
    }
    if (replan && s + 1 < o.steps) {
      if (std::optional<MemoryPolicy> next = replan(s, st, tel, *dev)) {
        pol = std::move(*next);
        install();
        r.replans.push_back(pol.note);
        if (progress) progress(fmt::format("{:<10} {}", pol.name, pol.note));
      }
    }
  }
  const double n = static_cast<double>(times.size());
  for (double& v : r.layer_fwd_ms) v /= n;
  for (double& v : r.layer_bwd_ms) v /= n;
  r.loss = r.steps.back().loss;
  r.step_ms = median(times);
  r.stall_ms = median(stalls);
  r.offloaded_bytes = r.steps.back().offloaded_bytes;
  r.final_gradients = model.gradients();
  r.optimizer_ms = median(optimizer_times);
  if (optimizer) {
    r.optimizer_counters = optimizer->counters();
    r.final_master_weights = optimizer->read_state().p;
  }
  r.plan_note = count_actions(pol);
  if (!pol.note.empty()) r.plan_note += "; " + pol.note;
  return r;
}

double mean_layer_fwd_ms(const PolicyResult& r) {
  double s = 0;
  for (double v : r.layer_fwd_ms) s += v;
  return r.layer_fwd_ms.empty() ? 0.0 : s / static_cast<double>(r.layer_fwd_ms.size());
}

}  // namespace detail

}  // namespace spillway::train

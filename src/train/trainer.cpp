// `spillway train`: see spillway/train/train.hpp. The run (run): its options checked, the
// calibration, and each policy made (make_policy: a named strategy, auto fitted to the
// arena by measurement, or a plan file) and run (policy_run.cpp), the losses compared;
// the report is train_report.cpp's.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "spillway/core/error.hpp"
#include "spillway/core/units.hpp"
#include "spillway/device/device.hpp"
#include "spillway/offload/offload.hpp"
#include "spillway/probe/probe.hpp"
#include "spillway/train/train.hpp"
#include "train/adaptive.hpp"
#include "train/trainer_impl.hpp"

namespace spillway::train {

using namespace spillway::nn;  // the reference model this application trains

using detail::mean_layer_fwd_ms;
using detail::run_policy;

namespace {

void validate(const TrainOptions& o) {
  // Errors name the TrainOptions field (the CLI shows its flag).
  using L = TrainLimits;
  auto at_least = [](const char* field, double v, double lo) {
    if (!(v >= lo)) SPILLWAY_FIELD_ERROR(field, v, "must be >= {}", lo);
  };
  auto within = [](const char* field, double v, double lo, double hi) {
    if (!(v >= lo && v <= hi)) SPILLWAY_FIELD_ERROR(field, v, "must be in [{}, {}]", lo, hi);
  };
  within("steps", o.steps, 1, L::kMaxSteps);
  within("micro_batch", o.micro_batch, 1, L::kMaxMicroBatch);
  at_least("seq_len", o.seq_len, 2);
  at_least("device_memory_mb", o.device_memory_mb, 1);
  // A throttle is 0 (none) or a link speed with a meaning (1e-300 GB/s would never end).
  auto throttle = [](const char* field, double v) {
    if (!(v == 0.0 || (v >= PlanLimits::kMinGbps && v <= PlanLimits::kMaxGbps)))
      SPILLWAY_FIELD_ERROR(field, v, "must be 0 (no throttle) or in [{}, {}]", PlanLimits::kMinGbps,
                           PlanLimits::kMaxGbps);
  };
  throttle("d2h_gbps", o.d2h_gbps);
  throttle("h2d_gbps", o.h2d_gbps);
  within("prefetch_depth", o.prefetch_depth, 1, PlanLimits::kMaxPrefetchDepth);
  if (!o.link_schedule.empty()) {
    // Note [A link that changes speed]: a shared link, with a speed before the first change.
    if (o.d2h_gbps <= 0 || o.h2d_gbps <= 0)
      SPILLWAY_FIELD_ERROR("link_schedule", fmt::format("{} change(s)", o.link_schedule.size()),
                           "needs d2h_gbps and h2d_gbps (the link's speed before the first "
                           "change)");
    int last = 0;
    for (const LinkChange& ch : o.link_schedule) {
      if (ch.step <= last || ch.step > o.steps)
        SPILLWAY_FIELD_ERROR("link_schedule", fmt::format("{}:{}", ch.step, ch.gbps),
                             "steps must increase, each in [1, steps ({})]", o.steps);
      if (!(ch.gbps >= PlanLimits::kMinGbps && ch.gbps <= PlanLimits::kMaxGbps))
        SPILLWAY_FIELD_ERROR("link_schedule", fmt::format("{}:{}", ch.step, ch.gbps),
                             "the speed must be in [{}, {}] GB/s", PlanLimits::kMinGbps,
                             PlanLimits::kMaxGbps);
      last = ch.step;
    }
  }
  at_least("keep_last", o.keep_last, 1);
  within("margin", o.margin, 0, 10);
  if (o.layer_fwd_ms)
    within("layer_fwd_ms", *o.layer_fwd_ms, PlanLimits::kMinLayerMs, PlanLimits::kMaxLayerMs);
  within("lr", o.lr, 0, L::kMaxLr);
  if (o.seq_len > L::kMaxSeqLen)
    SPILLWAY_FIELD_ERROR("seq_len", o.seq_len, "the reference model takes <= {}", L::kMaxSeqLen);
  if (o.device_memory_mb > L::kMaxDeviceMemoryMb)
    SPILLWAY_FIELD_ERROR("device_memory_mb", o.device_memory_mb, "must be <= {}",
                         L::kMaxDeviceMemoryMb);
  if (o.device != "host") {
    if (o.device == "cuda")
      SPILLWAY_INPUT_ERROR(
          "--device cuda: the reference model's ops are a CPU reference (cblas); it has no CUDA "
          "kernels yet, so it trains on the host backend only (--device host)");
    SPILLWAY_FIELD_ERROR("device", fmt::format("'{}'", o.device), "must be host or cuda");
  }
  if (o.optimizer != "device" && o.optimizer != "offload")
    SPILLWAY_FIELD_ERROR("optimizer", fmt::format("'{}'", o.optimizer),
                         "must be device or offload");
  at_least("device_buckets", o.device_buckets, 0);
  within("clip", o.clip, 0, L::kMaxClip);
  if (!(o.undo_mb < 0 || o.undo_mb <= L::kMaxUndoMb))
    SPILLWAY_FIELD_ERROR("undo_mb", o.undo_mb, "must be <= {} (or < 0: every CPU bucket)",
                         L::kMaxUndoMb);
  if (o.optimizer == "device" && (o.device_buckets != 0 || o.undo_mb >= 0))
    SPILLWAY_INPUT_ERROR(
        "--device-buckets and --undo-mb set the offloaded optimizer: add --optimizer offload");
}

}  // namespace

// The emulated device as a hardware profile, so that the planner can plan for it: HBM =
// the arena, the link = the throttles (unthrottled: this machine's memcpy speed, ~20 GB/s
// here); compute is calibrated from measured layer times, so the peak figures only seed
// the roofline before the calibration scales it.
HardwareProfile host_profile(const TrainOptions& o) {
  HardwareProfile hw;
  hw.name = "host-backend";
  hw.description = "the host backend: an emulated device in host memory";
  hw.source = "spillway train";
  hw.hbm_gb = o.device_memory_mb * 1048576.0 / 1e9;
  hw.hbm_tbps = 0.02;
  hw.sms = 1;
  hw.bf16_dense = TFlops(0.05);
  hw.fp8_dense = TFlops(0.05);
  hw.link_kind = "emulated";
  const double d2h = o.d2h_gbps > 0 ? o.d2h_gbps : 20.0;
  const double h2d = o.h2d_gbps > 0 ? o.h2d_gbps : 20.0;
  hw.d2h_nominal = GBps(d2h);
  hw.d2h_typical = GBps(d2h);
  hw.h2d_nominal = GBps(h2d);
  hw.h2d_typical = GBps(h2d);
  hw.gpus_per_link = 1;
  hw.host_memory_gb = 16;
  hw.gpus_per_host_memory = 1;
  return hw;
}

namespace {

// Note [A fixed calibration]: `--layer-fwd-ms MS` gives the planner the layers' forward time
// instead of measuring it (no calibration run; under --compare not the keep run's either),
// and adaptive judges each step by the link's emulated speed, the throttle the schedule
// set for that step, with the layers at MS and no lateness, instead of by a probe copy and
// the step's timing: on a loaded machine those vary, so its re-plans did too. The run's
// times are still measured and printed; its plans and re-plans are the same everywhere.
double scheduled_d2h_gbps(const TrainOptions& o, int step) {
  double gbps = o.d2h_gbps > 0 ? o.d2h_gbps : 20.0;
  for (const LinkChange& ch : o.link_schedule)
    if (ch.step <= step) gbps = ch.gbps;
  return gbps;
}

}  // namespace

PlanRequest plan_request(const RefConfig& c, const TrainOptions& o, Policy s,
                         std::optional<double> layer_fwd_ms) {
  PlanRequest r;
  r.model = c.model;
  r.hardware = host_profile(o);
  r.work.shape.micro_batch = o.micro_batch;
  r.work.shape.seq_len = o.seq_len;
  r.work.shape.dtype = DType::kFp32;
  r.work.shape.fused_swiglu = o.fused_swiglu;
  r.strategy = s;
  r.margin = o.margin;
  r.layer_fwd_ms = layer_fwd_ms;
  r.hbm_budget_gb = r.hardware.hbm_gb;
  r.d2h_gbps = r.hardware.d2h_typical.value;
  r.h2d_gbps = r.hardware.h2d_typical.value;
  r.keep_last_layers = o.keep_last;
  r.prefetch_depth = o.prefetch_depth;
  r.offload_tensors = o.offload_tensors;
  return r;
}

namespace {

Policy strategy_of(const std::string& name) {
  if (name == "keep") return Policy::kKeep;
  if (name == "recompute") return Policy::kRecompute;
  if (name == "offload") return Policy::kOffload;
  if (name == "selective") return Policy::kSelective;
  if (name == "hybrid") return Policy::kHybrid;
  if (name == "checkpoint") return Policy::kCheckpoint;
  if (name == "auto" || name == "adaptive") return Policy::kAuto;
  SPILLWAY_INPUT_ERROR(
      "--policy is '{}'; must be keep, recompute, offload, selective, hybrid, checkpoint, auto, "
      "adaptive or a plan JSON file (spillway plan --json)",
      name);
}

// MemAvailable of /proc/meminfo in bytes; 0 when unknown (then nothing is refused by it).
int64_t host_memory_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

// Note [Work fits before it starts]: the sizes of a run are checked before anything is
// allocated: the token batch in host memory (the corpus sample, the inputs and the targets:
// 12 bytes per token) against the host memory available, and the embedding's output (the
// first activation, hidden x 4 bytes per token) against the device arena; either refusal
// names the numbers, instead of a std::bad_alloc or an arena error seconds later.
void check_work_fits(const RefConfig& c, const TrainOptions& o) {
  const double tokens = static_cast<double>(o.micro_batch) * static_cast<double>(o.seq_len + 1);
  const double host_bytes = tokens * 12.0;
  const int64_t available = host_memory_available_bytes();
  if (available > 0 && host_bytes > 0.5 * static_cast<double>(available))
    SPILLWAY_FIELD_ERROR("micro_batch", o.micro_batch,
                         "micro_batch x (seq_len + 1) = {:.0f} tokens need {:.0f} bytes of host "
                         "memory for the batch alone; {} bytes are available",
                         tokens, host_bytes, available);
  const double arena = o.device_memory_mb * 1048576.0;
  const double first = static_cast<double>(o.micro_batch) * static_cast<double>(o.seq_len) *
                       static_cast<double>(c.hidden) * 4.0;
  if (first > arena)
    SPILLWAY_FIELD_ERROR("micro_batch", o.micro_batch,
                         "micro_batch x seq_len x hidden ({}) x 4 bytes = {:.0f} bytes for the "
                         "embedding's output alone; the device arena is {:.0f} bytes "
                         "(device_memory_mb {})",
                         c.hidden, first, arena, o.device_memory_mb);
}

bool is_plan_path(const std::string& p) {
  return p.size() > 5 && p.compare(p.size() - 5, 5, ".json") == 0;
}

// The policy named `name`, planned with the layer time `fwd_ms`; the plan itself in `*plan`.
MemoryPolicy make_policy(const RefConfig& c, const TrainOptions& o, const std::string& name,
                         double fwd_ms, const std::vector<int32_t>& corpus, Plan* plan) {
  if (is_plan_path(name)) {
    PlanRequest req;
    *plan = load_plan_json(name, &req);
    // The plan must be one for this model and workload (the reference model saves a
    // subset of the planner's tensors: reference_policy maps the names).
    check_plan_matches(*plan, req, plan_request(c, o, Policy::kAuto, fwd_ms), name);
    MemoryPolicy p = policy_from_plan(c, *plan, name);
    p.prefetch_depth = o.prefetch_depth;
    if (!plan->notes.empty()) {
      // Note [Plans re-timed from their actions]: an edited file's predictions were made
      // before the edit; its actions are planned again for this run's request.
      std::vector<std::string> notes = plan->notes;
      *plan = retime_plan(plan_request(c, o, req.strategy, fwd_ms), *plan);
      plan->notes = notes;
      p.note = fmt::format("{}; the prediction is re-planned from its actions for this run",
                           fmt::join(notes, "; "));
    }
    return p;
  }
  const Policy s = strategy_of(name);
  PlanRequest req = plan_request(c, o, s, fwd_ms);
  *plan = make_plan(req);
  if (s == Policy::kKeep) {  // every tensor the plan saves (all but mlp.act when fused)
    MemoryPolicy p = policy_from_plan(c, *plan, name);
    p.prefetch_depth = o.prefetch_depth;
    return p;
  }
  if (s != Policy::kAuto) {
    MemoryPolicy p = policy_from_plan(c, *plan, name);
    p.prefetch_depth = o.prefetch_depth;
    return p;
  }
  // Note [Auto fits the arena]: the planner's peak leaves out what only the runtime has
  // (backward temporaries, the engine's reload staging, the arena's alignment), so auto
  // measures its plan: one step without update on the arena the user asked for (never a
  // larger one: the host reserves the arena), and when the measured peak exceeds it less 2%
  // for fragmentation, it plans again with the budget lowered by the excess; a plan that
  // runs out of the arena altogether lowers the budget by a tenth of the arena (from the
  // plan's planned peak, where the budget starts to bind; eight times at most).
  //
  // Note [Auto covers the copies' pace]: the measured peak is one run's; what a run can vary
  // is the offloaded tensors whose D2H copy has not ended (their device memory is released
  // when it has): the copy engine runs beside compute, so under load it lags and holds them
  // longer. The engine bounds those bytes (OffloadOptions::inflight_bound_bytes: compute
  // waits rather than exceed it, Note [Train offload sizing]), and everything else in the
  // arena is allocated in the same order in every run (compute is in program order; where
  // the blocks land may differ, which the 2% stands for), so a run's peak is at most the
  // probe's plus that bound: auto judges the probe's peak plus the bound, whatever the
  // timing was.
  const int64_t full = static_cast<int64_t>(o.device_memory_mb * 1048576.0);
  const int64_t arena = static_cast<int64_t>(o.device_memory_mb * 1048576.0 * 0.98);
  TrainOptions probe = o;
  probe.steps = 1;
  probe.lr = 0;
  // The measured peak, or more than the arena when the plan ran out of it.
  auto measured_peak = [&](const MemoryPolicy& p) -> int64_t {
    try {
      const PolicyResult r = run_policy(c, probe, p, corpus, nullptr);
      return r.peak_device_bytes + r.inflight_bound_bytes;  // Note [Auto covers the copies' pace]
    } catch (const Error&) {
      return full + full / 10;
    }
  };
  auto fits = [&](const MemoryPolicy& p) { return measured_peak(p) <= arena; };
  double budget_gb = *req.hbm_budget_gb;
  for (int attempt = 0; attempt < 8 && plan->summary.feasible; ++attempt) {
    MemoryPolicy p = policy_from_plan(c, *plan, name);
    p.prefetch_depth = o.prefetch_depth;
    const int64_t peak = measured_peak(p);
    if (peak <= arena) {
      p.note = fmt::format("the planner's fastest plan for a budget of {:.1f} MB", budget_gb * 1e3);
      return p;
    }
    // From the plan's own peak: a budget above it does not bind, and lowering that by the
    // excess would give the same plan again.
    budget_gb = std::min(budget_gb, static_cast<double>(plan->summary.peak.total()) / 1e9) -
                static_cast<double>(peak - arena) * 1.02 / 1e9;
    if (budget_gb <= 0) break;
    req.hbm_budget_gb = budget_gb;
    *plan = make_plan(req);
  }
  // The named strategies, fastest first by the planner's step time: the first that fits.
  std::vector<std::pair<Plan, Policy>> named;
  for (Policy t : {Policy::kSelective, Policy::kHybrid, Policy::kOffload, Policy::kRecompute}) {
    PlanRequest rq = plan_request(c, o, t, fwd_ms);
    rq.hbm_budget_gb = 1e6;  // judged by measurement, not by the planner's peak
    named.emplace_back(make_plan(rq), t);
  }
  std::stable_sort(named.begin(), named.end(), [](const auto& x, const auto& y) {
    return x.first.summary.step_ms < y.first.summary.step_ms;
  });
  for (const auto& [pl, t] : named) {
    MemoryPolicy p = policy_from_plan(c, pl, name);
    p.prefetch_depth = o.prefetch_depth;
    if (fits(p)) {
      *plan = pl;
      p.note = fmt::format("the {} plan, the fastest whose measured peak fits", to_string(t));
      return p;
    }
  }
  SPILLWAY_INPUT_ERROR(
      "--policy auto: no plan fits {} MiB of device memory at micro-batch {} x seq {}: even "
      "the recompute policy's measured peak exceeds it; raise --device-memory-mb or lower "
      "--micro-batch or --seq-len",
      o.device_memory_mb, o.micro_batch, o.seq_len);
}

}  // namespace

std::vector<int32_t> load_corpus(const std::string& path) {
  // A regular file of a size that fits in memory as tokens (4 bytes each), checked before
  // reading: a directory, a device such as /dev/zero or a FIFO would never end or fail late.
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status))
    SPILLWAY_INPUT_ERROR(
        "--corpus: cannot read '{}': no such file (a text file; byte-level "
        "tokens)",
        path);
  if (!std::filesystem::is_regular_file(status))
    SPILLWAY_INPUT_ERROR("--corpus: '{}' is not a regular file (a text file; byte-level tokens)",
                         path);
  const uintmax_t bytes = std::filesystem::file_size(path, ec);
  const int64_t available = host_memory_available_bytes();
  if (ec ||
      (available > 0 && static_cast<double>(bytes) * 4.0 > 0.5 * static_cast<double>(available)))
    SPILLWAY_INPUT_ERROR(
        "--corpus: '{}' is {} bytes: as tokens (4 bytes each) it needs {} bytes, more than half "
        "of the {} bytes of host memory available",
        path, bytes, bytes * 4, available);
  std::ifstream in(path, std::ios::binary);
  if (!in)
    SPILLWAY_INPUT_ERROR("--corpus: cannot read '{}': {} (a text file; byte-level tokens)", path,
                         std::strerror(errno));
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(bytes));
  for (std::istreambuf_iterator<char> it(in), end; it != end; ++it)
    out.push_back(static_cast<int32_t>(static_cast<unsigned char>(*it)));
  return out;
}

TrainReport run(const TrainOptions& o, const std::function<void(const std::string&)>& progress) {
  validate(o);
  const RefConfig c = load_reference_config(o.model);
  check_work_fits(c, o);
  if (o.keep_last > c.layers())
    SPILLWAY_FIELD_ERROR("keep_last", o.keep_last, "must be <= the model's layers ({})",
                         c.layers());
  const int buckets = c.layers() + 2;  // Model::parameter_buckets
  if (o.device_buckets > buckets)
    SPILLWAY_FIELD_ERROR("device_buckets", o.device_buckets,
                         "{} has {} optimizer buckets (the embedding, {} layers, the head): must "
                         "be <= {}",
                         o.model, buckets, c.layers(), buckets);
  TrainReport rep;
  rep.corpus = o.corpus.empty() ? kDefaultCorpus : o.corpus;
  const std::vector<int32_t> corpus = load_corpus(rep.corpus);
  rep.corpus_bytes = static_cast<int64_t>(corpus.size());
  if (rep.corpus_bytes < o.seq_len + 1)
    SPILLWAY_INPUT_ERROR("--corpus: '{}' has {} bytes; --seq-len {} needs at least {}", rep.corpus,
                         corpus.size(), o.seq_len, o.seq_len + 1);
  rep.memcpy_gbps = measure_host_copy_gbps(size_t{1} << 20, 0.2);  // Note [The machine is ...]

  // Calibration (trainer.hpp): the keep run's layer times under --compare, else two
  // calibration steps under the recompute policy (it fits where the others fit; its
  // forward is the same as every policy's), the second one measured.
  std::vector<std::string> names;
  if (o.compare) {
    names = {"keep", "checkpoint", "recompute", "offload", "selective", "hybrid", "auto"};
  } else {
    names = {o.policy};
    if (!is_plan_path(o.policy)) strategy_of(o.policy);  // a bad name fails before any work
  }
  double fwd_ms = 0;
  TrainOptions cal = o;
  cal.steps = 2;
  cal.lr = 0;
  cal.optimizer = "device";  // timing of forward only
  cal.device_buckets = 0;
  cal.undo_mb = -1;
  // Timing only, on the arena the user asked for (recompute is the leanest policy: when it
  // does not fit, no policy does, and the error says so).
  auto calibrate = [&] {
    Plan plan;
    const MemoryPolicy rec = make_policy(c, o, "recompute", 1.0, corpus, &plan);
    try {
      fwd_ms = mean_layer_fwd_ms(run_policy(c, cal, rec, corpus, nullptr));
    } catch (const Error& e) {
      SPILLWAY_INPUT_ERROR(
          "the recompute policy (the leanest) does not fit {} MiB of device memory at "
          "micro-batch {} x seq {}, so no policy does: raise --device-memory-mb or lower "
          "--micro-batch or --seq-len ({})",
          o.device_memory_mb, o.micro_batch, o.seq_len, e.what());
    }
  };
  for (const std::string& name : names) {
    Plan plan;
    PolicyResult r;
    try {
      if (o.layer_fwd_ms) fwd_ms = *o.layer_fwd_ms;    // Note [A fixed calibration]
      if (name != "keep" && fwd_ms <= 0) calibrate();  // no keep run (or it failed)
      if (name == "adaptive") {
        // Note [Re-planning while training]: auto's plan first, re-made between steps.
        const double fwd = fwd_ms > 0 ? fwd_ms : 1.0;
        MemoryPolicy pol = make_policy(c, o, "auto", fwd, corpus, &plan);
        pol.name = name;
        PlanRequest req = plan_request(c, o, Policy::kAuto, fwd);
        req.hbm_budget_gb = static_cast<double>(plan.summary.peak.total()) / 1e9;
        AdaptivePlanner adaptive(c, std::move(req), pol, plan, o.prefetch_depth);
        if (o.layer_fwd_ms) adaptive.link_as_scheduled();
        r = run_policy(c, o, pol, corpus, progress,
                       [&](int step, const StepStats& st, const StepTelemetry& tel, Device& d) {
                         if (!o.layer_fwd_ms) return adaptive.after_step(step, st, tel, d);
                         // Note [A fixed calibration]: the link as the schedule set it for
                         // this step, the layers as fixed, no lateness.
                         StepStats fixed = st;
                         fixed.layer_fwd_ms.assign(st.layer_fwd_ms.size(), *o.layer_fwd_ms);
                         return adaptive.after_step(step, fixed, StepTelemetry{},
                                                    scheduled_d2h_gbps(o, step + 1));
                       });
      } else {
        const MemoryPolicy pol = make_policy(c, o, name, fwd_ms > 0 ? fwd_ms : 1.0, corpus, &plan);
        r = run_policy(c, o, pol, corpus, progress);
      }
    } catch (const Error& e) {
      if (!o.compare) throw;
      r.name = name;
      r.error = e.what();  // --compare goes on with the other policies
      if (progress) progress(fmt::format("{:<10} failed: {}", name, r.error));
    }
    if (name == "keep" && r.error.empty() && !o.layer_fwd_ms) fwd_ms = mean_layer_fwd_ms(r);
    // keep ran before its own calibration: its prediction is planned now; the others
    // were planned with the calibrated time (auto: with the budget that fits).
    if (name == "keep")
      plan = make_plan(plan_request(c, o, Policy::kKeep, fwd_ms > 0 ? fwd_ms : 1.0));
    r.predicted_step_ms = plan.summary.step_ms;
    r.predicted_peak_bytes = plan.summary.peak.total();
    r.predicted_feasible = plan.summary.feasible;
    // A plan file's prediction is its own, unless the file was edited (re-planned for this
    // run: Note [Plans re-timed from their actions]).
    r.prediction_calibrated = !is_plan_path(name) || !plan.notes.empty();
    rep.policies.push_back(std::move(r));
  }
  const PolicyResult* ref = nullptr;
  for (const PolicyResult& p : rep.policies) {
    if (!p.error.empty()) continue;
    ++rep.policies_compared;
    if (ref == nullptr) {
      ref = &p;
      continue;
    }
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() &&
             (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    };
    if (p.loss != ref->loss || !same(p.final_gradients, ref->final_gradients) ||
        !same(p.final_master_weights, ref->final_master_weights)) {
      rep.losses_identical = false;
    }
  }
  rep.parameters = ref == nullptr ? 0 : static_cast<int64_t>(ref->final_gradients.size());
  return rep;
}

}  // namespace spillway::train

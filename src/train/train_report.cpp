// `spillway train`'s report: the table and notes (format_train_report) and the JSON
// (train_report_json) of a TrainReport.
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "spillway/probe/probe.hpp"
#include "spillway/train/train.hpp"
#include "train/trainer_impl.hpp"

namespace spillway::train {

using detail::mb;

namespace {

// The fastest the run asks of the emulated link (GB/s): its throttles, an unthrottled
// direction at the 20 GB/s host_profile plans it at, and every --link-schedule speed.
double asked_link_gbps(const TrainOptions& o) {
  double gbps = std::max(o.d2h_gbps > 0 ? o.d2h_gbps : 20.0, o.h2d_gbps > 0 ? o.h2d_gbps : 20.0);
  for (const LinkChange& ch : o.link_schedule) gbps = std::max(gbps, ch.gbps);
  return gbps;
}

}  // namespace

std::string format_train_report(const TrainReport& r, const TrainOptions& o) {
  std::string out;
  out += fmt::format(
      "model {} ({} parameters), micro-batch {} x seq {}, {} steps, seed {}, corpus {} ({} "
      "bytes, byte-level tokens)\n",
      o.model, r.parameters, o.micro_batch, o.seq_len, o.steps, o.seed, r.corpus, r.corpus_bytes);
  out += fmt::format(
      "device: host backend, {} MiB, copies {} / {}\n\n", o.device_memory_mb,
      o.d2h_gbps > 0 ? fmt::format("D2H {} GB/s", o.d2h_gbps) : std::string("D2H unthrottled"),
      o.h2d_gbps > 0 ? fmt::format("H2D {} GB/s", o.h2d_gbps) : std::string("H2D unthrottled"));
  if (r.memcpy_gbps > 0.0) {  // Note [The machine is the limit] (spillway/probe/probe.hpp)
    const double link = asked_link_gbps(o);
    const std::string limit = machine_limit_note(
        link, r.memcpy_gbps,
        "the stalls, step times and their ratios below (and the plan's times, made for the "
        "link)");
    out = out.substr(0, out.size() - 1);  // the device line's blank line comes after
    out += fmt::format(
        "this machine: memcpy {:.2f} GB/s (the probe, unthrottled, in this run); "
        "the link asked for {:.2f} GB/s{}\n",
        r.memcpy_gbps, link,
        o.d2h_gbps > 0 && o.h2d_gbps > 0 ? "" : " (unthrottled: planned at 20)");
    if (!limit.empty()) out += limit + "\n";
    out += "\n";
  }
  const PolicyResult* keep = nullptr;
  const PolicyResult* rec = nullptr;
  for (const PolicyResult& p : r.policies) {
    if (p.name == "keep") keep = &p;
    if (p.name == "recompute") rec = &p;
  }
  out += fmt::format(
      "{:<10} {:>9} {:>10} {:>7} {:>7} {:>9} {:>7} {:>7} {:>10} {:>8} {:>9}  {:>10} {:>10}\n",
      "policy", "loss", "peak MB", "/keep", "/recomp", "step ms", "/keep", "/recomp", "offload MB",
      "stall ms", "snowball", "plan MB", "plan ms");
  for (const PolicyResult& p : r.policies) {
    if (!p.error.empty()) {
      out += fmt::format("{:<10} could not run: {}\n", p.name, p.error);
      continue;
    }
    auto ratio = [](double a, const PolicyResult* b, bool peak) {
      if (b == nullptr) return std::string("-");
      const double den = peak ? static_cast<double>(b->peak_device_bytes) : b->step_ms;
      return den > 0 ? fmt::format("{:.2f}", a / den) : std::string("-");
    };
    out += fmt::format(
        "{:<10} {:>9.4f} {:>10} {:>7} {:>7} {:>9.2f} {:>7} {:>7} {:>10} {:>8.2f} {:>9}  {:>10} "
        "{:>10}\n",
        p.name, p.loss, mb(p.peak_device_bytes),
        ratio(static_cast<double>(p.peak_device_bytes), keep, true),
        ratio(static_cast<double>(p.peak_device_bytes), rec, true), p.step_ms,
        ratio(p.step_ms, keep, false), ratio(p.step_ms, rec, false), mb(p.offloaded_bytes),
        p.stall_ms,
        p.snowball ? fmt::format("layer {}", p.snowball_layer.value_or(-1)) : std::string("no"),
        mb(p.predicted_peak_bytes),
        fmt::format("{:.2f}{}", p.predicted_step_ms, p.prediction_calibrated ? "" : "*"));
  }
  out += "\n";
  for (const PolicyResult& p : r.policies) {
    if (p.error.empty())
      out += fmt::format("{:<10} loss {:.4f} -> {:.4f}; {}; {} ops recomputed a step{}\n", p.name,
                         p.steps.front().loss, p.loss, p.plan_note, p.recomputed_ops,
                         p.recomputed_scans > 0
                             ? fmt::format(" ({} of them Mamba scans)", p.recomputed_scans)
                             : std::string());
  }
  if (o.optimizer == "device" && o.lr > 0) {
    for (const PolicyResult& p : r.policies) {
      if (p.error.empty())
        out += fmt::format(
            "{:<10} optimizer on the device (the model's AdamW): {:.2f} ms after "
            "backward (median)\n",
            p.name, p.optimizer_ms);
    }
  }
  if (o.optimizer == "offload") {
    for (const PolicyResult& p : r.policies) {
      if (!p.error.empty()) continue;
      const optim::StvCounters& k = p.optimizer_counters;
      out += fmt::format(
          "{:<10} optimizer offloaded (STV, {} buckets on the device): {} commits, {} replays "
          "(clipped), {} skips (NaN/Inf), {} buckets deferred; {:.2f} ms past backward "
          "(median)\n",
          p.name, o.device_buckets, k.commits, k.replays, k.skips, k.deferred, p.optimizer_ms);
    }
  }
  if (r.policies_compared > 1) {
    out += r.losses_identical
               ? "loss and every gradient bitwise identical across the policies\n"
               : "WARNING: losses or gradients differ across policies (a bug: they must be "
                 "bitwise identical)\n";
  }
  out += fmt::format(
      "\npeak MB: the device arena's peak during a step (parameters, gradients, AdamW moments, "
      "activations, backward temporaries, the offload engine's reload staging{}). step ms: the "
      "median step after the first (forward and backward). plan: the planner's prediction for "
      "the same policy, "
      "calibrated with {}; its peak counts weights, "
      "gradients, optimizer states and saved activations, not the backward temporaries.\n",
      o.optimizer == "offload"
          ? "; with --optimizer offload no AdamW moments but the pipeline's bf16 weights and "
            "gradients, the fp32 copy the reference ops compute with, and the split's state"
          : "",
      o.layer_fwd_ms
          ? fmt::format("the layer forward time given ({} ms, --layer-fwd-ms)", *o.layer_fwd_ms)
      : o.compare ? "the measured mean layer forward time (of the keep run)"
                  : "the measured mean layer forward time (of a calibration run)");
  for (const PolicyResult& p : r.policies) {
    if (p.prediction_calibrated) continue;
    out +=
        "*: a plan file's own prediction (its hardware and layer times), not calibrated to this "
        "run\n";
    break;
  }
  if (o.optimizer == "offload")
    out +=
        "optimizer offload: fp32 master weights and moments in host memory, stepped on the CPU "
        "as each bucket's gradients arrive (speculation then validation); the planner's peak "
        "still counts optimizer states on the device.\n";
  return out;
}

std::string train_report_json(const TrainReport& r, const TrainOptions& o) {
  nlohmann::json j;
  j["schema"] = "spillway.train/1";
  j["model"] = o.model;
  j["parameters"] = r.parameters;
  j["micro_batch"] = o.micro_batch;
  j["seq_len"] = o.seq_len;
  j["steps"] = o.steps;
  j["seed"] = o.seed;
  j["device_memory_bytes"] = static_cast<int64_t>(o.device_memory_mb * 1048576.0);
  j["d2h_gbps"] = o.d2h_gbps;
  j["h2d_gbps"] = o.h2d_gbps;
  j["memcpy_gbps"] = r.memcpy_gbps;
  j["machine_is_the_limit"] = !machine_limit_note(asked_link_gbps(o), r.memcpy_gbps, "").empty();
  j["corpus"] = r.corpus;
  // Nothing is claimed when fewer than two policies ran: null, not true.
  j["bitwise_identical"] =
      r.policies_compared > 1 ? nlohmann::json(r.losses_identical) : nlohmann::json();
  j["policies_compared"] = r.policies_compared;
  j["optimizer"] = o.optimizer;
  nlohmann::json arr = nlohmann::json::array();
  for (const PolicyResult& p : r.policies) {
    nlohmann::json q;
    q["name"] = p.name;
    if (!p.error.empty()) {
      q["error"] = p.error;  // --compare: this policy could not run
      arr.push_back(q);
      continue;
    }
    q["loss"] = p.loss;
    q["first_loss"] = p.steps.front().loss;
    q["peak_device_bytes"] = p.peak_device_bytes;
    q["recomputed_ops"] = p.recomputed_ops;
    q["recomputed_scans"] = p.recomputed_scans;
    q["step_ms"] = p.step_ms;
    q["offloaded_bytes"] = p.offloaded_bytes;
    q["stall_ms"] = p.stall_ms;
    q["snowball"] = p.snowball;
    if (!p.replans.empty()) q["replans"] = p.replans;
    q["snowball_layer"] = p.snowball_layer ? nlohmann::json(*p.snowball_layer) : nlohmann::json();
    q["predicted_step_ms"] = p.predicted_step_ms;
    q["predicted_peak_bytes"] = p.predicted_peak_bytes;
    q["predicted_feasible"] = p.predicted_feasible;
    q["prediction_calibrated"] = p.prediction_calibrated;
    q["actions"] = p.plan_note;
    q["optimizer_ms"] = p.optimizer_ms;
    if (o.optimizer == "offload") {
      const optim::StvCounters& k = p.optimizer_counters;
      q["optimizer"] = {{"kind", "offload"},
                        {"device_buckets", o.device_buckets},
                        {"optimizer_ms", p.optimizer_ms},
                        {"commits", k.commits},
                        {"replays", k.replays},
                        {"skips", k.skips},
                        {"deferred", k.deferred}};
    }
    nlohmann::json losses = nlohmann::json::array();
    nlohmann::json offloaded = nlohmann::json::array();
    for (const StepRecord& s : p.steps) {
      losses.push_back(s.loss);
      offloaded.push_back(s.offloaded_bytes);
    }
    q["losses"] = losses;
    q["step_offloaded_bytes"] = offloaded;
    arr.push_back(q);
  }
  j["policies"] = arr;
  return j.dump(2) + "\n";
}

}  // namespace spillway::train

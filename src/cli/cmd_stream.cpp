// `spillway stream`: layerwise weight streaming (docs/stream.md). Without --explain: the
// reference model run with its weights streamed on the host backend (a throttled link),
// against the same model all-resident in the same run (train::run_streamed_reference),
// beside the simulator's prediction (Note [Streamed weights]). --explain: the choice among full
// copy, sharded + all-gather and in-place reading for a catalog model on a machine, with the
// arithmetic shown (Note [Stream mode model]) beside the simulator's prediction.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/plan_flags.hpp"
#include "spillway/core/error.hpp"
#include "spillway/plan/stream_mode.hpp"
#include "spillway/probe/probe.hpp"
#include "spillway/sim/sim.hpp"
#include "spillway/stream/weight_streamer.hpp"
#include "spillway/train/train.hpp"

namespace spillway::cli {

namespace {

// A run (train::run_streamed_reference) printed, its simulator prediction beside it, and
// written as JSON; exit 1 when the streamed losses differ from the resident ones.
void run_streamed(const train::StreamedRunOptions& o, const std::string& json_path) {
  const bool training = o.training;
  const int N = o.gpus_per_link;
  const int depth = o.prefetch_depth;
  const train::StreamedRunReport r = train::run_streamed_reference(
      o, [&](const std::string& line) { say_beside_json(json_path, line + "\n"); });
  if (r.refused)
    SPILLWAY_INPUT_ERROR(
        "--link-gbps is {}; {}", o.link_gbps,
        fmt::format("the {} streamed steps copy at least {:.1f} MB over the link ({} steps x "
                    "{:.1f} MB of layer weights{}), {:.3g} s at {} GB/s: more than the {:.0f} s "
                    "a run may take; raise --link-gbps to {:.3g} or more, or lower --steps",
                    o.steps, r.min_link_bytes / 1e6, o.steps,
                    static_cast<double>(r.model_bytes) / 1e6,
                    r.link_copies > 1 ? fmt::format(" x {} GPUs", N) : "", r.min_link_seconds,
                    o.link_gbps, kMaxRunSeconds, r.min_link_bytes / 1e9 / kMaxRunSeconds));
  const std::string& mode = r.mode;
  const WeightStreamTelemetry& t = r.telemetry;
  const StreamModeInput& in = r.prediction_input;
  const StreamModeChoice& choice = r.prediction;
  const double res_ms = r.resident_ms, str_ms = r.streamed_ms;
  std::string text = fmt::format(
      "{} ({} layers, {:.1f} MB of layer weights, fp32), batch {} x {} tokens{}, {}; link {:.2f} "
      "GB/s host->device, depth {} ({} device slots of {:.1f} MB)\n",
      o.ref_model, r.layers, static_cast<double>(r.model_bytes) / 1e6, o.micro_batch, o.seq_len,
      N > 1 ? (training ? " (the same on every GPU)" : " per GPU") : "",
      training ? "training steps (forward, backward re-streamed, AdamW)" : "inference (forward)",
      o.link_gbps, depth, depth + 1, static_cast<double>(r.slot_bytes) / 1e6);
  if (N == 1) {
    text += fmt::format("  mode            {} (one emulated GPU on its link)\n", mode);
  } else {
    text += fmt::format("  mode            {} ({} emulated GPUs sharing the link{}{})\n", mode, N,
                        mode == "sharded" ? ", each copying 1/N of a layer and all-gathering" : "",
                        o.mode == "auto" ? "; chosen by the model below" : "; --mode");
  }
  text += fmt::format("  all resident    {:9.2f} ms per step (median of {}{})\n", res_ms,
                      r.timed_steps, N > 1 ? ", the slowest GPU" : "");
  text += fmt::format("  streamed        {:9.2f} ms per step ({:+.1f}%)\n", str_ms,
                      100.0 * (str_ms / res_ms - 1.0));
  const double steps = static_cast<double>(std::max<int64_t>(1, t.steps));
  text += fmt::format(
      "  per step        {:.1f} MB copied {}in {:.1f} loads ({:.1f} hits), stalls {:.2f} ms, "
      "copy stream {:.2f} GB/s\n",
      static_cast<double>(t.bytes) / 1e6 / steps, N > 1 ? "by GPU 0 " : "",
      static_cast<double>(t.loads) / steps, static_cast<double>(t.hits) / steps, t.stall_ms / steps,
      t.gbps);
  if (N > 1)
    text += fmt::format("  link            {:.1f} MB per step for the {} GPUs\n",
                        static_cast<double>(t.bytes) * N / 1e6 / steps, N);
  text += fmt::format("  losses          {}\n", r.bitwise_identical
                                                    ? "bitwise identical to the resident model's"
                                                    : "DIFFER from the resident model's");
  text += fmt::format(
      "  predicted       {:9.2f} ms per step of layers (Note [Stream mode model], {:.2f} ms of "
      "them compute{})\n",
      r.predicted_ms, choice.compute_ms,
      N > 1 ? fmt::format("; peer copies at this machine's memcpy, {:.1f} GB/s", in.peer_gbps)
            : "");
  if (o.mode == "auto" && N > 1)
    for (const StreamModeEstimate& e : choice.modes)
      if (e.available && e.mode != mode)
        text += fmt::format("                  {} would take {:.2f} ms\n", e.mode, e.step_ms);
  // The simulator's prediction for the same setup, from the same per-layer compute.
  double sim_ms = 0.0;
  {
    Plan plan;
    for (int l = 0; l < r.layers; ++l) {
      LayerPlan lp;
      lp.params = in.layer_bytes[static_cast<size_t>(l)] / 4;
      lp.fwd_ms = in.fwd_ms[static_cast<size_t>(l)];
      if (training) lp.bwd_ms = in.bwd_ms[static_cast<size_t>(l)];
      plan.layers.push_back(lp);
    }
    plan.summary.h2d_gbps = o.link_gbps / N;  // per GPU; the link: times the GPUs on it
    plan.summary.d2h_gbps = o.link_gbps / N;
    plan.summary.gpus_per_link = N;
    PlanRequest req;
    req.work.shape.dtype = DType::kFp32;
    StreamOptions sim_o;
    sim_o.depth = depth;
    sim_o.gpus = N;
    sim_o.gpus_per_link = N;
    sim_o.sharded = mode == "sharded";
    sim_o.peer_gbps = in.peer_gbps;
    sim_o.training = training;
    sim_o.keep_tasks = false;
    sim_ms = simulate_weight_streaming(plan, req, sim_o).summary.step_ms;
    text += fmt::format("  simulator       {:9.2f} ms per {} of the layers\n", sim_ms,
                        training ? "forward and backward" : "forward");
  }
  say_beside_json(json_path, text);
  if (!json_path.empty()) {
    nlohmann::json j;
    j["schema"] = "spillway.stream-run/1";
    j["ref_model"] = o.ref_model;
    j["training"] = training;
    j["depth"] = depth;
    j["link_gbps"] = o.link_gbps;
    j["gpus_per_link"] = N;
    j["mode"] = mode;
    j["resident_ms"] = res_ms;
    j["streamed_ms"] = str_ms;
    j["bytes_per_step"] = static_cast<double>(t.bytes) / steps;
    j["link_bytes_per_step"] = static_cast<double>(t.bytes) * N / steps;
    j["loads"] = t.loads;
    j["hits"] = t.hits;
    j["stall_ms"] = t.stall_ms;
    j["copy_gbps"] = t.gbps;
    j["bitwise_identical"] = r.bitwise_identical;
    j["predicted_ms"] = r.predicted_ms;
    if (N > 1) j["peer_gbps"] = in.peer_gbps;
    j["simulator_ms"] = sim_ms;
    write_output(json_path, j.dump(2) + "\n");
  }
  if (!r.bitwise_identical)
    throw Error("spillway stream: the streamed model's losses differ from the resident one's");
}

}  // namespace

void add_stream_command(CLI::App& app) {
  overview_line("stream", Group::kTrain, "layerwise weight streaming from pinned host memory");
  struct State {
    PlanFlags flags;
    train::StreamedRunOptions run;
    bool explain = false;
    bool training = false;
    int gpus_per_link = 0;
    double peer_gbps = -1.0;
    std::string sysfs = "/sys";
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "stream",
      "Layerwise weight streaming: the weights live in pinned host memory and each layer is "
      "copied into a ring of depth+1 device buffers while the layers before it compute.\n"
      "Without --explain: the reference model (--ref-model) runs with its weights streamed on "
      "the host backend through a throttled link (--link-gbps), step after step beside the same "
      "model with every layer resident, and prints both step times, the bytes, loads and "
      "stalls per step, whether the losses are bitwise equal (they must be: exit 1 if not), and "
      "the predicted and simulated times for the same setup. --training streams training steps "
      "(forward, backward re-streaming the layers in reverse, AdamW), else inference. A run "
      "uses 2 x 256 tokens unless --micro-batch / --seq-len say otherwise. The reference model "
      "computes on the host's cores, which the emulated copy engine shares: its achieved GB/s "
      "is this machine's, not a GPU's. --gpus-per-link N runs N emulated GPUs (threads) behind "
      "the one link, each with its own batch (training: the same batch), full-copy or sharded "
      "(--mode).\n"
      "--explain chooses how, for the model and machine given: every GPU copies whole layers "
      "(full-copy), the GPUs sharing one host link each copy 1/N and all-gather (sharded), or, "
      "on a coherent NVLink-C2C link, kernels read the host weights in place; it prints each "
      "mode's step time, stalls and link bytes, and the simulator's prediction.\n"
      "The GPUs per link come from the PCI tree (/sys) when NVIDIA GPUs are there, else from "
      "the hardware profile, else --gpus-per-link. A mode whose ring (prefetch-depth + 1 "
      "layers) does not fit in the HBM left for weights is ruled out, with the numbers; when "
      "none is left, --explain exits 3, as `spillway plan` does for an infeasible plan.\n\n"
      "Examples:\n"
      "  spillway stream\n"
      "  spillway stream --training --link-gbps 2 --prefetch-depth 2\n"
      "  spillway stream --gpus-per-link 4 --mode sharded\n"
      "  spillway stream --explain --model Llama-3.1-70B --hardware h100-pcie --gpus-per-link 4\n"
      "  spillway stream --explain --model Llama-3.1-70B --hardware gh200 --training");
  add_plan_flags(*cmd, st->flags);
  cmd->add_flag("--explain", st->explain, "Print the mode choice and its arithmetic")
      ->group("Streaming");
  cmd->add_flag("--training", st->training,
                "A training step: forward, then backward re-streaming the layers in reverse")
      ->group("Streaming");
  in_range(cmd->add_option("--gpus-per-link", st->gpus_per_link,
                           "GPUs sharing one host link (--explain default: detected, else the "
                           "profile's; a run: emulated GPUs behind the throttled link, 1 to 16, "
                           "default 1)")
               ->group("Streaming"),
           closed(1, 1024));
  in_range(cmd->add_option("--peer-gbps", st->peer_gbps,
                           "GPU-to-GPU bandwidth per GPU for the all-gather, GB/s (default: the "
                           "profile's NVLink, else its host link figure: PCIe peer-to-peer "
                           "through the shared switch)")
               ->group("Streaming"),
           closed_or(PlanLimits::kMinGbps, 100000, 0));
  cmd->add_option("--sysfs", st->sysfs, "Read the PCI device tree under this sysfs root")
      ->capture_default_str()
      ->group("Streaming");
  cmd->add_option("--ref-model", st->run.ref_model,
                  "Run: the reference model (tiny-moe, small-moe, or a config.json path)")
      ->capture_default_str()
      ->group("Run");
  in_range(cmd->add_option("--steps", st->run.steps,
                           "Run: steps of each model; the first is "
                           "the warm-up")
               ->capture_default_str()
               ->group("Run"),
           closed(2, 100000));
  in_range(
      cmd->add_option("--link-gbps", st->run.link_gbps, "Run: the emulated host->device link, GB/s")
          ->capture_default_str()
          ->group("Run"),
      closed(kMinRunLinkGbps, 100000));
  in_range(cmd->add_option("--device-memory-mb", st->run.device_memory_mb,
                           "Run: the emulated device's memory, MiB (2^20 bytes)")
               ->capture_default_str()
               ->group("Run"),
           closed(16, 1 << 20));
  cmd->add_option("--mode", st->run.mode,
                  "Run: auto (the mode the arithmetic of --explain picks for the measured "
                  "compute), full-copy (every GPU copies whole layers) or sharded (each of the "
                  "--gpus-per-link GPUs copies 1/N and all-gathers)")
      ->check(CLI::IsMember({"auto", "full-copy", "sharded"}))
      ->capture_default_str()
      ->group("Run");
  cmd->add_option("--json", st->json_path,
                  "Write the run or the choice as JSON to FILE ('-' for stdout)")
      ->group("Output");
  cmd->callback([st, cmd]() {
    if (!st->explain) {
      // The catalog-model flags describe --explain's machine; a run uses the reference
      // model: given here they would be silently ignored.
      for (const char* f : {"--model", "--hardware", "--peer-gbps", "--sysfs"})
        if (cmd->count(f) > 0)
          throw CLI::ValidationError(f,
                                     "applies to --explain; a run uses --ref-model and "
                                     "--link-gbps (its all-gather copies at this machine's "
                                     "memcpy speed)");
      st->run.gpus_per_link = st->gpus_per_link > 0 ? st->gpus_per_link : 1;
      if (st->run.gpus_per_link > 16)
        throw InputError("--gpus-per-link", std::to_string(st->run.gpus_per_link),
                         "must be in [1, 16] for a run (emulated GPUs, one thread each)");
      if (st->run.mode == "sharded" && st->run.gpus_per_link < 2)
        throw CLI::ValidationError("--mode", "sharded needs --gpus-per-link 2 or more");
      // 2 x 256 tokens unless given: the planner's defaults are a GPU's.
      if (cmd->count("--micro-batch") > 0)
        st->run.micro_batch = static_cast<int>(st->flags.micro_batch);
      if (cmd->count("--seq-len") > 0) st->run.seq_len = static_cast<int>(st->flags.seq_len);
      st->run.prefetch_depth = std::max(1, st->flags.prefetch_depth);
      st->run.training = st->training;
      st->run.max_link_seconds = kMaxRunSeconds;
      run_streamed(st->run, st->json_path);
      return;
    }
    for (const char* f : {"--ref-model", "--steps", "--link-gbps", "--device-memory-mb", "--mode"})
      if (cmd->count(f) > 0) throw CLI::ValidationError(f, "applies to a run (without --explain)");
    const PlanRequest req = make_request(st->flags);
    const Plan plan = make_plan(req);
    const HardwareProfile& hw = req.hardware;
    const HostTopology topo = detect_host_topology(st->sysfs);
    int per_link = hw.gpus_per_link;
    std::string source = fmt::format("the {} profile", hw.name);
    if (st->gpus_per_link > 0) {
      per_link = st->gpus_per_link;
      source = "--gpus-per-link";
    } else if (topo.max_gpus_per_link > 0) {
      per_link = topo.max_gpus_per_link;
      source = fmt::format("the PCI tree ({} GPUs in {} link groups)", topo.gpus.size(),
                           topo.link_groups.size());
    }
    StreamModeInput in;
    const int64_t wbytes = req.work.shape.dtype == DType::kFp32 ? 4 : 2;
    for (const LayerPlan& lp : plan.layers) {
      in.layer_bytes.push_back(lp.params * wbytes);
      in.fwd_ms.push_back(lp.fwd_ms);
      if (st->training) in.bwd_ms.push_back(lp.bwd_ms);
    }
    in.gpus_per_link = per_link;
    in.link_h2d_gbps = plan.summary.h2d_gbps;  // one GPU alone: the link's capacity
    in.peer_gbps = st->peer_gbps >= 0.0                ? st->peer_gbps
                   : hw.interconnect.nvlink_gbps > 0.0 ? hw.interconnect.nvlink_gbps
                                                       : plan.summary.h2d_gbps;
    in.c2c = hw.link_kind == "nvlink-c2c";
    in.depth = std::max(1, req.prefetch_depth);
    const MemoryBreakdown& peak = plan.summary.peak;
    // The HBM the ring may take: the budget less the plan's activations and logits (a
    // training step's, so an upper bound for inference). Not less the plan's gradients and
    // optimizer states: those are a resident model's, sized by all its weights, while a
    // streamed model's weights, and what is updated with them, live in host memory.
    in.hbm_free_bytes =
        std::max<int64_t>(0, plan.summary.hbm_budget_bytes - peak.activations - peak.logits);
    const StreamModeChoice c = choose_stream_mode(in);
    std::string text =
        fmt::format("{} on {}: GPUs per link {} (from {}){}\n", req.model.name, hw.name, per_link,
                    source, topo.note.empty() ? "" : "; " + topo.note);
    text += explain_stream_mode(c, in);
    StreamOptions so;
    so.depth = in.depth;
    so.gpus = per_link;
    so.gpus_per_link = per_link;
    so.keep_tasks = false;
    nlohmann::json sim_json;
    if (!st->training && !c.chosen.empty()) {
      // The simulator runs the full-copy and sharded modes as events (its link: the plan's
      // per-GPU figure times the profile's GPUs per link).
      const SimResult r = simulate_weight_streaming(plan, req, so);
      text += fmt::format("simulator (full copy, {} GPUs on the link): forward {:.2f} ms\n",
                          per_link, r.summary.step_ms);
      sim_json = {{"full_copy_forward_ms", r.summary.step_ms}};
      if (per_link > 1 && in.peer_gbps > 0) {
        StreamOptions sh = so;
        sh.sharded = true;
        sh.peer_gbps = in.peer_gbps;
        const SimResult q = simulate_weight_streaming(plan, req, sh);
        text += fmt::format("simulator (sharded, {} GPUs on the link): forward {:.2f} ms\n",
                            per_link, q.summary.step_ms);
        sim_json["sharded_forward_ms"] = q.summary.step_ms;
      }
    }
    write_output("-", text);
    if (!st->json_path.empty()) {
      nlohmann::json j;
      j["schema"] = "spillway.stream-choice/1";
      j["model"] = req.model.name;
      j["hardware"] = hw.name;
      j["gpus_per_link"] = per_link;
      j["chosen"] = c.chosen.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.chosen);
      j["hbm_free_bytes"] = in.hbm_free_bytes;
      j["compute_ms"] = c.compute_ms;
      j["weight_bytes"] = c.weight_bytes;
      j["weights_fit"] = c.weights_fit;
      j["warnings"] = c.warnings;
      for (const StreamModeEstimate& e : c.modes) {
        j["modes"].push_back({{"mode", e.mode},
                              {"available", e.available},
                              {"why_not", e.why_not},
                              {"step_ms", e.step_ms},
                              {"stall_ms", e.stall_ms},
                              {"link_ms", e.copy_ms},
                              {"gather_ms", e.gather_ms},
                              {"link_bytes", e.link_bytes},
                              {"gpu_bytes", e.gpu_bytes},
                              {"ring_bytes", e.slot_bytes}});
      }
      if (!sim_json.is_null()) j["simulator"] = sim_json;
      write_output(st->json_path, j.dump(2) + "\n");
    }
    // As `spillway plan` does for an infeasible plan: the reasons printed, exit 3.
    if (c.chosen.empty()) throw CLI::RuntimeError(3);
  });
}

}  // namespace spillway::cli

// `spillway stream`: layerwise weight streaming (DESIGN section 5). Without --explain: the
// reference model run with its weights streamed on the host backend (a throttled link),
// against the same model all-resident in the same run, beside the simulator's prediction
// (Note [Streamed weights]). --explain: the choice among full copy, sharded + all-gather
// and in-place reading for a catalog model on a machine, with the arithmetic shown (Note
// [Stream mode model]) beside the simulator's prediction.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>

#include "cli/commands.hpp"
#include "cli/plan_flags.hpp"
#include "core/stats.hpp"
#include "spillway/error.hpp"
#include "spillway/nn.hpp"
#include "spillway/probe.hpp"
#include "spillway/sim.hpp"
#include "spillway/stream.hpp"
#include "spillway/stream_mode.hpp"

namespace spillway::cli {

namespace {

struct RunFlags {
  std::string ref_model = "small-moe";
  int steps = 5;
  double link_gbps = 1.0;
  double device_memory_mb = 512;
  uint64_t seed = 1;
  bool batch_given = false;  // else 2 x 256 tokens (the planner's defaults are a GPU's)
  bool seq_given = false;
};

// The reference model, resident and streamed, same seed and batches, interleaved step by
// step; losses compared bit for bit.
void run_streamed_reference(const RunFlags& rf, const PlanFlags& pf, bool training,
                            const std::string& json_path) {
  const nn::RefConfig c = nn::load_reference_config(rf.ref_model);
  const int batch = static_cast<int>(rf.batch_given ? pf.micro_batch : 2);
  const int seq = static_cast<int>(rf.seq_given ? pf.seq_len : 256);
  const int depth = std::max(1, pf.prefetch_depth);
  HostDeviceOptions o;
  o.device_bytes = static_cast<int64_t>(rf.device_memory_mb * kMiB);
  o.h2d_gbps = rf.link_gbps;
  auto dev = make_host_device(o);
  nn::Model resident(c, *dev, rf.seed);
  nn::Model streamed(c, *dev, rf.seed);
  WeightStreamOptions so;
  so.depth = depth;
  so.training = training;
  WeightStreamer ws(*dev, streamed.compute_stream(), streamed.layer_weight_bytes(), so);
  streamed.stream_weights(&ws);
  const MemoryPolicy policy = nn::keep_policy(c);
  TrainingHooks none;
  std::mt19937 g(static_cast<uint32_t>(rf.seed));
  std::vector<double> t_res, t_str;
  std::vector<std::vector<double>> fwd_ms(static_cast<size_t>(c.layers())),
      bwd_ms(static_cast<size_t>(c.layers()));
  bool bitwise = true;
  const double lr = training ? 1e-3 : 0.0;
  for (int step = 0; step < rf.steps; ++step) {
    std::vector<int32_t> tokens(static_cast<size_t>(batch) * static_cast<size_t>(seq + 1));
    for (int32_t& t : tokens) t = static_cast<int32_t>(g() % static_cast<uint32_t>(c.vocab));
    double loss_res = 0, loss_str = 0;
    for (nn::Model* m : {&resident, &streamed}) {
      const auto t0 = std::chrono::steady_clock::now();
      double loss = 0;
      if (training) {
        const nn::StepStats st = m->step(tokens, batch, seq, policy, none, lr);
        loss = st.loss;
        if (m == &resident) {
          for (int l = 0; l < c.layers(); ++l) {
            fwd_ms[static_cast<size_t>(l)].push_back(st.layer_fwd_ms[static_cast<size_t>(l)]);
            bwd_ms[static_cast<size_t>(l)].push_back(st.layer_bwd_ms[static_cast<size_t>(l)]);
          }
        }
      } else {
        loss = m->forward_loss(tokens, batch, seq);
      }
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      (m == &resident ? loss_res : loss_str) = loss;
      if (step > 0) (m == &resident ? t_res : t_str).push_back(ms);
    }
    bitwise = bitwise && loss_res == loss_str;
    say_beside_json(
        json_path, fmt::format("step {}: loss {:.6f} resident, {:.6f} streamed{}\n", step, loss_res,
                               loss_str, loss_res == loss_str ? "" : "  DIFFERENT"));
  }
  const WeightStreamTelemetry t = ws.telemetry();
  streamed.stream_weights(nullptr);
  const double res_ms = median(t_res), str_ms = median(t_str);
  const std::vector<size_t> bytes = streamed.layer_weight_bytes();
  int64_t model_bytes = 0;
  for (size_t b : bytes) model_bytes += static_cast<int64_t>(b);
  std::string text = fmt::format(
      "{} ({} layers, {:.1f} MB of layer weights, fp32), batch {} x {} tokens, {}; link {:.2f} "
      "GB/s host->device, depth {} ({} device slots of {:.1f} MB)\n",
      rf.ref_model, c.layers(), static_cast<double>(model_bytes) / 1e6, batch, seq,
      training ? "training steps (forward, backward re-streamed, AdamW)" : "inference (forward)",
      rf.link_gbps, depth, depth + 1, static_cast<double>(ws.slot_bytes()) / 1e6);
  text += fmt::format("  mode            full-copy (one emulated GPU on its link)\n");
  text +=
      fmt::format("  all resident    {:9.2f} ms per step (median of {})\n", res_ms, t_res.size());
  text += fmt::format("  streamed        {:9.2f} ms per step ({:+.1f}%)\n", str_ms,
                      100.0 * (str_ms / res_ms - 1.0));
  const double steps = static_cast<double>(std::max<int64_t>(1, t.steps));
  text += fmt::format(
      "  per step        {:.1f} MB copied in {:.1f} loads ({:.1f} hits), stalls {:.2f} ms, copy "
      "stream {:.2f} GB/s\n",
      static_cast<double>(t.bytes) / 1e6 / steps, static_cast<double>(t.loads) / steps,
      static_cast<double>(t.hits) / steps, t.stall_ms / steps, t.gbps);
  text +=
      fmt::format("  losses          {}\n", bitwise ? "bitwise identical to the resident model's"
                                                    : "DIFFER from the resident model's");
  // The predictions for the same setup, from the measured per-layer compute (training) or
  // the resident pass spread evenly (inference: forward_loss does not time layers).
  StreamModeInput in;
  for (int l = 0; l < c.layers(); ++l) {
    in.layer_bytes.push_back(static_cast<int64_t>(bytes[static_cast<size_t>(l)]));
    in.fwd_ms.push_back(training ? median(fwd_ms[static_cast<size_t>(l)]) : res_ms / c.layers());
    if (training) in.bwd_ms.push_back(median(bwd_ms[static_cast<size_t>(l)]));
  }
  in.link_h2d_gbps = rf.link_gbps;
  in.depth = depth;
  const StreamModeChoice choice = choose_stream_mode(in);
  text += fmt::format(
      "  predicted       {:9.2f} ms per step of layers (Note [Stream mode model], "
      "{:.2f} ms of them compute)\n",
      choice.modes[0].step_ms, choice.compute_ms);
  double sim_ms = 0.0;
  if (!training) {
    Plan plan;
    for (int l = 0; l < c.layers(); ++l) {
      LayerPlan lp;
      lp.params = static_cast<int64_t>(bytes[static_cast<size_t>(l)] / 4);
      lp.fwd_ms = in.fwd_ms[static_cast<size_t>(l)];
      plan.layers.push_back(lp);
    }
    plan.summary.h2d_gbps = rf.link_gbps;
    plan.summary.d2h_gbps = rf.link_gbps;
    plan.summary.gpus_per_link = 1;
    PlanRequest req;
    req.work.shape.dtype = DType::kFp32;
    StreamOptions sim_o;
    sim_o.depth = depth;
    sim_o.keep_tasks = false;
    sim_ms = simulate_weight_streaming(plan, req, sim_o).summary.step_ms;
    text += fmt::format("  simulator       {:9.2f} ms per forward of the layers\n", sim_ms);
  }
  say_beside_json(json_path, text);
  if (!json_path.empty()) {
    nlohmann::json j;
    j["schema"] = "spillway.stream-run/1";
    j["ref_model"] = rf.ref_model;
    j["training"] = training;
    j["depth"] = depth;
    j["link_gbps"] = rf.link_gbps;
    j["resident_ms"] = res_ms;
    j["streamed_ms"] = str_ms;
    j["bytes_per_step"] = static_cast<double>(t.bytes) / steps;
    j["loads"] = t.loads;
    j["hits"] = t.hits;
    j["stall_ms"] = t.stall_ms;
    j["copy_gbps"] = t.gbps;
    j["bitwise_identical"] = bitwise;
    j["predicted_ms"] = choice.modes[0].step_ms;
    if (!training) j["simulator_ms"] = sim_ms;
    write_output(json_path, j.dump(2) + "\n");
  }
  if (!bitwise)
    throw Error("spillway stream: the streamed model's losses differ from the resident one's");
}

}  // namespace

void add_stream_command(CLI::App& app) {
  struct State {
    PlanFlags flags;
    RunFlags run;
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
      "is this machine's, not a GPU's.\n"
      "--explain chooses how, for the model and machine given: every GPU copies whole layers "
      "(full-copy), the GPUs sharing one host link each copy 1/N and all-gather (sharded), or, "
      "on a coherent NVLink-C2C link, kernels read the host weights in place; it prints each "
      "mode's step time, stalls and link bytes, and the simulator's prediction.\n"
      "The GPUs per link come from the PCI tree (/sys) when NVIDIA GPUs are there, else from "
      "the hardware profile, else --gpus-per-link.\n\n"
      "Examples:\n"
      "  spillway stream\n"
      "  spillway stream --training --link-gbps 2 --prefetch-depth 2\n"
      "  spillway stream --explain --model Llama-3.1-70B --hardware h100-pcie --gpus-per-link 4\n"
      "  spillway stream --explain --model Llama-3.1-70B --hardware gh200 --training");
  add_plan_flags(*cmd, st->flags);
  cmd->add_flag("--explain", st->explain, "Print the mode choice and its arithmetic")
      ->group("Streaming");
  cmd->add_flag("--training", st->training,
                "A training step: forward, then backward re-streaming the layers in reverse")
      ->group("Streaming");
  in_range(cmd->add_option("--gpus-per-link", st->gpus_per_link,
                           "GPUs sharing one host link (default: detected, else the profile's)")
               ->group("Streaming"),
           closed(1, 1024));
  in_range(cmd->add_option("--peer-gbps", st->peer_gbps,
                           "GPU-to-GPU bandwidth per GPU for the all-gather, GB/s (default: the "
                           "profile's NVLink, else its host link figure: PCIe peer-to-peer "
                           "through the shared switch)")
               ->group("Streaming"),
           closed(0, 100000));
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
      open_closed(0, 100000));
  in_range(cmd->add_option("--device-memory-mb", st->run.device_memory_mb,
                           "Run: the emulated device's memory, MiB (2^20 bytes)")
               ->capture_default_str()
               ->group("Run"),
           closed(16, 1 << 20));
  cmd->add_option("--json", st->json_path,
                  "Write the run or the choice as JSON to FILE ('-' for stdout)")
      ->group("Output");
  cmd->callback([st, cmd]() {
    if (!st->explain) {
      // The catalog-model flags describe --explain's machine; a run uses the reference
      // model: given here they would be silently ignored.
      for (const char* f : {"--model", "--hardware", "--gpus-per-link", "--peer-gbps"})
        if (cmd->count(f) > 0)
          throw CLI::ValidationError(f,
                                     "applies to --explain; a run uses --ref-model and "
                                     "--link-gbps");
      st->run.batch_given = cmd->count("--micro-batch") > 0;
      st->run.seq_given = cmd->count("--seq-len") > 0;
      run_streamed_reference(st->run, st->flags, st->training, st->json_path);
      return;
    }
    for (const char* f : {"--ref-model", "--steps", "--link-gbps", "--device-memory-mb"})
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
    in.hbm_free_bytes =
        std::max<int64_t>(0, plan.summary.hbm_budget_bytes - peak.activations - peak.logits -
                                 peak.gradients - peak.optimizer_states);
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
    if (!st->training) {
      // The simulator runs the full-copy mode as events (its link: the plan's per-GPU
      // figure times the profile's GPUs per link).
      const SimResult r = simulate_weight_streaming(plan, req, so);
      text += fmt::format("simulator (full copy, {} GPUs on the link): forward {:.2f} ms\n",
                          per_link, r.summary.step_ms);
      sim_json = {{"full_copy_forward_ms", r.summary.step_ms}};
    }
    write_output("-", text);
    if (!st->json_path.empty()) {
      nlohmann::json j;
      j["schema"] = "spillway.stream-choice/1";
      j["model"] = req.model.name;
      j["hardware"] = hw.name;
      j["gpus_per_link"] = per_link;
      j["chosen"] = c.chosen;
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
  });
}

}  // namespace spillway::cli

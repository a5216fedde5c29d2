// `spillway stream`: layerwise weight streaming (DESIGN section 5). Today: --explain, the
// choice among full copy, sharded + all-gather and in-place reading for a model on a
// machine, with the arithmetic shown (Note [Stream mode model]) beside the simulator's
// prediction; running the reference model with streamed weights comes next (issue 16).
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/plan_flags.hpp"
#include "spillway/error.hpp"
#include "spillway/probe.hpp"
#include "spillway/sim.hpp"
#include "spillway/stream_mode.hpp"

namespace spillway::cli {

void add_stream_command(CLI::App& app) {
  struct State {
    PlanFlags flags;
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
      "--explain chooses how, for the model and machine given: every GPU copies whole layers "
      "(full-copy), the GPUs sharing one host link each copy 1/N and all-gather (sharded), or, "
      "on a coherent NVLink-C2C link, kernels read the host weights in place; it prints each "
      "mode's step time, stalls and link bytes, and the simulator's prediction.\n"
      "The GPUs per link come from the PCI tree (/sys) when NVIDIA GPUs are there, else from "
      "the hardware profile, else --gpus-per-link.\n\n"
      "Examples:\n"
      "  spillway stream --explain --model Llama-3.1-70B --hardware h100-pcie --gpus-per-link 4\n"
      "  spillway stream --explain --model Llama-3.1-70B --hardware gh200 --training\n"
      "Running the reference model with streamed weights is not built yet: without --explain "
      "the command says so and exits with 2.");
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
  cmd->add_option("--json", st->json_path, "Write the choice as JSON to FILE ('-' for stdout)")
      ->group("Output");
  cmd->callback([st]() {
    if (!st->explain) {
      throw CLI::ValidationError(
          "--explain",
          "running the reference model with streamed weights is not built yet (issue 16); "
          "--explain prints the mode choice");
    }
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

// `spillway simulate`: replay a plan as a timeline; find snowballs and stalls; draw them.
#include <cstdio>
#include <memory>

#include "cli/commands.hpp"
#include "cli/plan_flags.hpp"
#include "spillway/core/error.hpp"
#include "spillway/sim/sim.hpp"

namespace spillway::cli {

void add_simulate_command(CLI::App& app) {
  overview_line("simulate", Group::kPlan,
                "a plan's step as discrete events: stalls, peak HBM, a trace");
  struct State {
    PlanFlags flags;
    std::string plan_path;
    std::string scenario = "train";
    int gpus = 0;
    int gpus_per_link = 0;
    bool no_contention = false;
    double inflight_bound_mb = 0.0;
    bool sharded = false;
    bool stream_training = false;
    double peer_gbps = -1.0;
    std::string trace_path;
    std::string plot_path;
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "simulate",
      "Replay a plan as discrete events: per GPU a compute stream, a D2H and an H2D copy engine; "
      "host links shared fairly by the GPUs behind them; HBM bandwidth shared by copies and "
      "memory-bound kernels. Reports the step time and its split, achieved link bandwidth, the "
      "copy backlog at every layer boundary (a growing backlog is a snowball) and peak HBM.\n\n"
      "Examples:\n"
      "  spillway simulate --model Qwen3-30B-A3B --hardware gh200 --seq-len 8192 --ep 8 --dp 8 \\\n"
      "      --trace step.json --plot step.svg\n"
      "  spillway plan ... --json plan.json && spillway simulate --plan plan.json --gpus 4 "
      "--gpus-per-link 4\n"
      "  spillway simulate --model Llama-3.1-70B --hardware gh200 --scenario stream "
      "--prefetch-depth 2\n"
      "Exit status: 0 when the simulated peak HBM fits the GPU's HBM and the budget, 3 when "
      "it does not (the reasons are printed).");
  add_plan_flags(*cmd, st->flags);
  cmd->add_option("--plan", st->plan_path,
                  "Simulate this plan JSON (spillway.plan/1) instead of planning from the flags")
      ->group("Simulation");
  cmd->add_option(
         "--scenario", st->scenario,
         "train: one training step (grad-accum micro-batches); stream: a forward pass "
         "streaming every layer's weights prefetch-depth layers ahead into depth+1 buffers")
      ->capture_default_str()
      ->check(CLI::IsMember({"train", "stream"}))
      ->group("Simulation");
  // 0 is the "not given" of these two, so a given 0 (or less) is refused at parse time
  // rather than silently meaning the default.
  in_range(cmd->add_option("--gpus", st->gpus,
                           "GPUs running the plan (default: the profile's GPUs per link)")
               ->group("Simulation"),
           closed(1, 1024));
  in_range(cmd->add_option("--gpus-per-link", st->gpus_per_link,
                           "GPUs sharing one host link (default: all of them); the link's "
                           "capacity is the plan's per-GPU figure times the profile's GPUs per "
                           "link")
               ->group("Simulation"),
           closed(1, 1024));
  cmd->add_flag("--no-hbm-contention", st->no_contention,
                "Do not slow copies and memory-bound kernels that share HBM bandwidth")
      ->group("Simulation");
  in_range(cmd->add_option("--inflight-bound-mb", st->inflight_bound_mb,
                           "Back-pressure: compute waits while more D2H bytes than this, in MiB "
                           "(2^20 bytes), are in flight (0 = no bound)")
               ->capture_default_str()
               ->group("Simulation"),
           closed(0, kMaxHostMiB));
  cmd->add_flag("--sharded", st->sharded,
                "stream: the GPUs of a link each copy 1/N of a layer and all-gather the rest "
                "(Note [Sharded streaming])")
      ->group("Simulation");
  cmd->add_flag("--stream-training", st->stream_training,
                "stream: a training step (forward, then backward re-streaming all layers but the "
                "turn's prefetch-depth+1)")
      ->group("Simulation");
  in_range(cmd->add_option("--peer-gbps", st->peer_gbps,
                           "stream --sharded: GPU-to-GPU bandwidth per GPU for the all-gather, "
                           "GB/s (default: the profile's NVLink, else its host link figure)")
               ->group("Simulation"),
           closed(PlanLimits::kMinGbps, 100000));
  cmd->add_option("--trace", st->trace_path, "Write a Chrome trace-event JSON (open in Perfetto)")
      ->group("Output");
  cmd->add_option("--plot", st->plot_path,
                  "Write an SVG: memory over time and the D2H backlog per layer")
      ->group("Output");
  cmd->add_option("--json", st->json_path, "Write the summary JSON to FILE ('-' for stdout)")
      ->group("Output");
  cmd->callback([st, cmd]() {
    PlanRequest req;
    Plan plan;
    if (!st->plan_path.empty()) {
      plan = load_plan_json(st->plan_path, &req);
      refuse_flags_beside_plan(*cmd, st->flags, plan, req, st->plan_path);
      // Note [Plans re-timed from their actions]: an edited file is said, once, on stderr.
      for (const std::string& note : plan.notes)
        std::fprintf(stderr, "spillway simulate: note: %s\n", note.c_str());
    } else {
      req = make_request(st->flags);
      plan = make_plan(req);
    }
    SimResult result;
    if (st->scenario != "stream")
      for (const char* f : {"--sharded", "--stream-training", "--peer-gbps"})
        if (cmd->count(f) > 0) throw CLI::ValidationError(f, "applies to --scenario stream");
    if (st->scenario == "train") {
      SimOptions o;
      o.gpus = st->gpus;
      o.gpus_per_link = st->gpus_per_link;
      o.hbm_contention = !st->no_contention;
      o.inflight_bound_bytes = static_cast<int64_t>(st->inflight_bound_mb * kMiB);
      o.keep_tasks = !st->trace_path.empty() || !st->plot_path.empty();
      result = simulate_training_step(plan, req, o);
    } else {
      StreamOptions o;
      o.depth = req.prefetch_depth;
      o.gpus = st->gpus > 0 ? st->gpus : 1;
      o.gpus_per_link = st->gpus_per_link > 0 ? st->gpus_per_link : o.gpus;
      o.training = st->stream_training;
      o.sharded = st->sharded;
      if (st->sharded) {
        if (o.gpus_per_link < 2)
          throw CLI::ValidationError("--sharded",
                                     "needs 2 or more GPUs per link (--gpus, --gpus-per-link)");
        o.peer_gbps = st->peer_gbps > 0.0 ? st->peer_gbps
                      : req.hardware.interconnect.nvlink_gbps > 0.0
                          ? req.hardware.interconnect.nvlink_gbps
                          : plan.summary.h2d_gbps;
      }
      result = simulate_weight_streaming(plan, req, o);
    }
    if (st->json_path != "-") write_output("-", format_sim_report(result, req));
    const std::string title = fmt::format("{} on {}", req.model.name, req.hardware.name);
    if (!st->trace_path.empty()) write_output(st->trace_path, sim_trace_json(result));
    if (!st->plot_path.empty()) write_output(st->plot_path, sim_plot_svg(result, title));
    if (!st->json_path.empty()) write_output(st->json_path, sim_summary_json(result));
    // An infeasible result is still a result: every output above is written first.
    if (!result.summary.feasible) throw CLI::RuntimeError(3);
  });
}

}  // namespace spillway::cli

// `spillway plan`: what should spill, and what will it cost.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>

#include "cli/commands.hpp"
#include "cli/plan_flags.hpp"
#include "spillway/core/units.hpp"
#include "spillway/plan/plan.hpp"
#include "tool/output_path.hpp"

namespace spillway::cli {

void add_plan_command(CLI::App& app) {
  overview_line("plan", Group::kPlan,
                "what to keep, offload or recompute per layer under the HBM budget");
  struct State {
    PlanFlags flags;
    std::string json_path;
    bool quiet = false;
    std::optional<double> cpu_adam_gbps;  // unset: no split reported
    std::optional<int> explain;           // a layer to explain term by term
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      fmt::format(
          "Decide per layer what to keep, offload or recompute under the HBM budget and the "
          "no-snowball condition, and report HBM by category, host memory and step time. "
          "With no arguments: the first example.\n\n"
          "Examples:\n"
          "  spillway plan {}\n"
          "  spillway plan --model Llama-3.1-70B --hardware h100-sxm --tp 8 --policy offload"
          "   (infeasible: the reasons in numbers)\n",
          kPlanExampleArgs) +
          std::string("  spillway plan --model ./config.json --hardware gb200 --layer-fwd-ms 12.5 "
                      "--json plan.json\n"
                      "Exit status: 0 when the plan is feasible, 3 when it is not (the reasons "
                      "are printed)."));
  add_plan_flags(*cmd, st->flags);
  CLI::Option* json_opt =
      cmd->add_option("--json", st->json_path,
                      "Write the plan (schema spillway.plan/1, docs/plan-schema.md) to FILE, '-' "
                      "for stdout")
          ->group("Output");
  // Alone it would print nothing at all: it needs the file the plan goes to.
  cmd->add_flag("--quiet", st->quiet, "Do not print the report (needs --json FILE)")
      ->group("Output")
      ->needs(json_opt);
  in_range(cmd->add_option("--cpu-adam-gbps", st->cpu_adam_gbps,
                           "The CPU AdamW's state GB/s (`spillway bench adam`): with --optimizer "
                           "offload the CPU pipeline's speed (default: 50, said to be assumed); "
                           "with the optimizer on the GPU, adds the GPU/CPU split that offloading "
                           "it would choose (docs/optim.md)")
               ->group("Training state"),
           closed(PlanLimits::kMinGbps, PlanLimits::kMaxGbps));
  in_range(cmd->add_option("--explain", st->explain,
                           "After the report, every term of this layer's time and memory with "
                           "its formula (ops' roofline terms, copies and window, collectives, "
                           "saved tensors, training state)")
               ->group("Output"),
           up_to(0, "the first stage's layers - 1"));
  cmd->callback([st, cmd]() {
    // No arguments at all: the example a newcomer should see first, said so.
    size_t given = 0;
    for (const CLI::Option* opt : cmd->get_options()) given += opt->count();
    if (given == 0) {
      st->flags.micro_batch = 2;
      st->flags.seq_len = 8192;
      st->flags.ep = 8;
      st->flags.dp = 8;
      std::fprintf(stderr,
                   "spillway plan: no arguments, so the first example: spillway plan %s "
                   "(`spillway plan --help` lists the flags)\n",
                   kPlanExampleArgs);
    }
    tool::check_output_path(st->json_path);
    PlanRequest req = make_request(st->flags);
    req.cpu_adam_gbps = st->cpu_adam_gbps;
    const Plan plan = make_plan(req);
    if (!st->quiet && st->json_path != "-") {
      std::string report = format_plan_report(plan, req);
      // The device optimizer's split as it would be offloaded (an offloaded plan reports
      // its own).
      if (st->cpu_adam_gbps && !req.optimizer_offload) {
        const OptimizerSplit s = plan_optimizer_split(plan, req, *st->cpu_adam_gbps);
        report += fmt::format(
            "\noptimizer offload (CPU AdamW at {:.1f} GB/s of state): keep the optimizer step of "
            "the first {} of {} layers on the GPU ({} of fp32 state, {} of HBM free): the step "
            "ends {:.2f} ms after backward starts, {:.2f} ms with every layer on the CPU "
            "(backward: {:.2f} ms)\n",
            s.cpu_adam_gbps, s.layers_on_device, s.layers, to_string(Bytes(s.device_state_bytes)),
            to_string(Bytes(s.free_hbm_bytes)), s.end_ms, s.cpu_only_ms, s.backward_ms);
      }
      if (st->explain) report += format_plan_explain(plan, req, *st->explain);
      write_output("-", report);
    }
    if (!st->json_path.empty()) write_output(st->json_path, plan_to_json(plan, req));
    if (!plan.summary.feasible) throw CLI::RuntimeError(3);
  });
}

}  // namespace spillway::cli

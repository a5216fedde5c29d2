// `spillway train`: the reference MoE model trained end to end under a memory policy, or
// every policy with --compare (include/spillway/train/train.hpp).
#include <fmt/format.h>

#include <cstdio>
#include <memory>

#include "cli/commands.hpp"
#include "cli/plan_flags.hpp"
#include "spillway/core/error.hpp"
#include "spillway/train/train.hpp"

namespace spillway::cli {

void add_train_command(CLI::App& app) {
  overview_line("train", Group::kTrain, "train the reference MoE model under a memory policy");
  auto o = std::make_shared<train::TrainOptions>();
  auto json = std::make_shared<std::string>();
  auto quiet = std::make_shared<bool>(false);
  auto margin = std::make_shared<std::string>("10%");
  auto plan_file = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train the reference MoE transformer (src/nn: Qwen3-MoE-shaped, fp32, explicit forward and "
      "backward) on the host backend under a memory policy: keep every saved tensor, recompute "
      "(block-type rules), offload through the activation offload engine, selective, hybrid, "
      "auto (the planner's fastest plan that fits --device-memory-mb), or a plan JSON. Prints "
      "loss, step time, peak device memory, bytes offloaded and reloaded, stall and snowball "
      "warnings per step, then a summary. --compare runs every policy on the same seed: the "
      "losses and gradients are bitwise identical, and the table shows peak memory and step "
      "time as ratios to keep and to recompute beside the planner's prediction (calibrated from "
      "the keep run's layer times). --optimizer offload moves the fp32 master weights and AdamW "
      "moments to host memory and steps them on the CPU as backward hands each layer's "
      "gradients over (speculation then validation, docs/optim.md); the model then computes "
      "with bf16 weights.\n\n"
      "Examples:\n"
      "  spillway train --steps 20\n"
      "  spillway train --policy offload --d2h-gbps 2 --h2d-gbps 2\n"
      "  spillway train --compare --steps 5 --json train.json\n"
      "  spillway train --policy auto --device-memory-mb 18\n"
      "  spillway train --optimizer offload --device-buckets 2 --d2h-gbps 16 --h2d-gbps 16\n"
      "  spillway plan --model ./config.json --hardware gh200 --json plan.json && "
      "spillway train --model ./config.json --plan plan.json");
  cmd->add_option("--model", o->model,
                  "tiny-moe (embedded: 4 layers, hidden 64, 8 experts of 32 top-2, first layer "
                  "dense of 128), small-moe (8 layers, hidden 256, 4 experts of 256 top-2, first "
                  "layer dense of 512), or a Qwen3-MoE-style config.json (GQA, vocab >= 256); "
                  "`spillway plan --model` knows the two embedded ones too")
      ->capture_default_str();
  using L = train::TrainLimits;
  in_range(cmd->add_option("--steps", o->steps, "Training steps per policy")->capture_default_str(),
           closed(1, L::kMaxSteps));
  in_range(cmd->add_option("--micro-batch", o->micro_batch,
                           "Sequences per step (the host memory the run needs is checked first)")
               ->capture_default_str(),
           closed(1, L::kMaxMicroBatch));
  in_range(cmd->add_option("--seq-len", o->seq_len, "Tokens per sequence (bytes of the corpus)")
               ->capture_default_str(),
           closed(2, L::kMaxSeqLen));
  CLI::Option* policy_opt =
      cmd->add_option("--policy", o->policy,
                      "keep, recompute, offload, selective, hybrid, checkpoint, auto, or "
                      "adaptive (auto's plan, re-made between steps when the link or the layers "
                      "drift; each change is printed) (a plan file: --plan)")
          ->capture_default_str();
  cmd->add_option("--plan", *plan_file,
                  "A plan JSON file (spillway.plan/1, `spillway plan --json`): its per-tensor "
                  "actions are the policy (as for `spillway simulate --plan`)")
      ->excludes(policy_opt);
  cmd->add_flag("--compare", o->compare,
                "Run keep, checkpoint, recompute, offload, selective, hybrid and auto on the same "
                "seed and "
                "print one table");
  cmd->add_option("--offload-tensors", o->offload_tensors,
                  "Exactly these saved tensors are offloaded in every layer that offloads "
                  "(comma-separated names or groups, as for `spillway plan "
                  "--offload-tensors`); the rest follows --policy")
      ->delimiter(',')
      ->excludes("--plan")
      ->excludes("--compare");
  cmd->add_option_function<std::vector<std::string>>(
         "--link-schedule",
         [o](const std::vector<std::string>& changes) {
           for (const std::string& v : changes) {
             const size_t colon = v.find(':');
             train::LinkChange ch;
             try {
               size_t a = 0, b = 0;
               if (colon == std::string::npos) throw std::invalid_argument(v);
               ch.step = std::stoi(v.substr(0, colon), &a);
               ch.gbps = std::stod(v.substr(colon + 1), &b);
               if (a != colon || b != v.size() - colon - 1) throw std::invalid_argument(v);
             } catch (const std::exception&) {
               throw CLI::ValidationError("--link-schedule",
                                          "'" + v + "' is not STEP:GBPS (e.g. 5:0.05)");
             }
             o->link_schedule.push_back(ch);
           }
         },
         "STEP:GBPS,...: from step STEP on (1-based) the emulated link runs at GBPS both ways "
         "(another job on the link, a throttle lifted); needs --d2h-gbps and --h2d-gbps, its "
         "speed before. E.g. --policy adaptive --d2h-gbps 20 --h2d-gbps 20 --link-schedule "
         "5:0.05,9:20")
      ->delimiter(',');
  cmd->add_option("--device", o->device, "host (cuda: refused with the reason)")
      ->capture_default_str();
  in_range(cmd->add_option("--device-memory-mb", o->device_memory_mb,
                           "Capacity of the emulated device memory in MiB (2^20 bytes; the "
                           "budget: exceeding it is an error naming the policy and the bytes)")
               ->capture_default_str(),
           closed(1, L::kMaxDeviceMemoryMb));
  const FlagRange throttle = closed_or(PlanLimits::kMinGbps, PlanLimits::kMaxGbps, 0);
  in_range(
      cmd->add_option("--d2h-gbps", o->d2h_gbps,
                      "Throttle of device->host copies in GB/s (1e9 bytes/s; 0: not throttled, "
                      "the link's own speed: this machine's memcpy)")
          ->capture_default_str(),
      throttle);
  in_range(
      cmd->add_option("--h2d-gbps", o->h2d_gbps,
                      "Throttle of host->device copies in GB/s (1e9 bytes/s; 0: not throttled, "
                      "the link's own speed: this machine's memcpy)")
          ->capture_default_str(),
      throttle);
  in_range(cmd->add_option("--seed", o->seed, "Seed of the initial weights and of the batches")
               ->capture_default_str(),
           up_to(0, "2^64 - 1"));
  in_range(cmd->add_option("--lr", o->lr, "AdamW learning rate")->capture_default_str(),
           closed(0, L::kMaxLr));
  cmd->add_option(
      "--corpus", o->corpus,
      fmt::format("Text file read as byte-level tokens (default: {})", train::kDefaultCorpus));
  in_range(cmd->add_option("--prefetch-depth", o->prefetch_depth,
                           "Backward reloads this many layers ahead")
               ->capture_default_str(),
           closed(1, PlanLimits::kMaxPrefetchDepth));
  in_range(
      cmd->add_option("--keep-last", o->keep_last, "Layers at the end that never offload (planner)")
          ->capture_default_str(),
      up_to(1, "the model's layers"));
  in_range(cmd->add_option_function<double>(
               "--layer-fwd-ms", [o](double ms) { o->layer_fwd_ms = ms; },
               "Plan with this layer forward time (ms) instead of measuring it, and let "
               "--policy adaptive judge each step by the link's scheduled speed instead of a "
               "probe copy and the step's timing: its re-plans are then the same on every "
               "machine (the times printed are still measured)"),
           closed(PlanLimits::kMinLayerMs, PlanLimits::kMaxLayerMs));
  cmd->add_option("--margin", *margin,
                  "Planner headroom a copy must leave in its window: a percentage (10%) or a "
                  "fraction (0.1), as for `spillway plan` [0%, 1000%]")
      ->capture_default_str();
  cmd->add_flag("--fused-swiglu", o->fused_swiglu,
                "The fused SwiGLU variant: the MLP saves only its gate and up outputs and the "
                "backward recomputes mlp.act (every policy, and the planner, see it so)");
  cmd->add_option("--optimizer", o->optimizer,
                  "device: the model's AdamW on the device; offload: fp32 master weights and "
                  "moments in host memory, the CPU AdamW per layer during backward (STV)")
      ->capture_default_str();
  in_range(cmd->add_option("--device-buckets", o->device_buckets,
                           "With --optimizer offload: optimizer buckets (the embedding, then the "
                           "first layers: the last to arrive in backward) whose state and step "
                           "stay on the device")
               ->capture_default_str(),
           up_to(0, "the model's layers + 2"));
  in_range(cmd->add_option("--undo-mb", o->undo_mb,
                           "With --optimizer offload: STV's undo memory in MiB (2^20 bytes); "
                           "buckets beyond it wait for the gradient norm (-1: every CPU bucket)")
               ->capture_default_str(),
           closed_or(0, L::kMaxUndoMb, -1));
  in_range(cmd->add_option("--clip", o->clip,
                           "With --optimizer offload: gradient-norm clipping threshold (0: none)")
               ->capture_default_str(),
           closed(0, L::kMaxClip));
  cmd->add_option("--json", *json, "Write the per-policy figures as JSON to FILE ('-' for stdout)");
  cmd->add_flag("--quiet", *quiet, "No per-step lines");
  cmd->callback([o, json, quiet, margin, plan_file] {
    o->margin = parse_margin(*margin);
    if (!plan_file->empty()) {
      if (plan_file->size() <= 5 || plan_file->substr(plan_file->size() - 5) != ".json")
        SPILLWAY_INPUT_ERROR(
            "--plan is '{}'; a plan file is JSON (FILE.json, `spillway plan "
            "--json FILE.json`)",
            *plan_file);
      o->policy = *plan_file;
    } else if (o->policy.size() > 5 && o->policy.substr(o->policy.size() - 5) == ".json") {
      // The old spelling of a plan file: still accepted, said once.
      std::fprintf(stderr, "spillway train: --policy FILE is deprecated; write --plan %s\n",
                   o->policy.c_str());
    }
    const bool to_stdout = *json == "-";
    auto progress = [&](const std::string& line) {
      if (!*quiet && !to_stdout) std::fprintf(stderr, "%s\n", line.c_str());
    };
    const train::TrainReport r = train::run(*o, progress);
    if (!json->empty()) write_output(*json, train::train_report_json(r, *o));
    if (!to_stdout) write_output("-", train::format_train_report(r, *o));
  });
}

}  // namespace spillway::cli

// The spillway subcommands. Each registers its options on the app and runs from its
// callback; a callback reports failure by throwing spillway::Error (exit 1).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "tool/output.hpp"  // write_output: every output of every subcommand
#include "tool/ranges.hpp"  // in_range: every numeric flag

namespace spillway::cli {

// The edge every spillway tool shares (src/tool: checked outputs, numeric ranges), by its
// plain names in every subcommand.
using namespace spillway::tool;  // NOLINT(google-build-using-namespace)

// Note [Units at the edges]: a flag says its unit in its name and its --help, one meaning
// each: "-mb" flags are MiB (2^20 bytes, kMiB), "-gb" flags are GB (1e9 bytes), "-gbps"
// flags are GB/s (1e9 bytes/s); reports print bytes as GB and MB (1e9, 1e6), and transfer
// sizes with K/M/G suffixes are KiB/MiB/GiB.
inline constexpr double kMiB = 1048576.0;

// The plan a newcomer meets first (`spillway plan` with no arguments, the first example of
// `spillway --help` and of `spillway plan --help`, the README's worked example, `make run`):
// feasible, and it teaches (what offload over C2C buys against recomputing every layer, the
// collectives on the critical path, the budget by category).
inline constexpr const char* kPlanExampleArgs =
    "--model Qwen3-30B-A3B --hardware gh200 --micro-batch 2 --seq-len 8192 --ep 8 --dp 8";

// `spillway --version` and `spillway doctor` say it.
inline constexpr const char* kVersion = "0.1.0";

// Note [The overview] (overview.cpp): each subcommand says, where it is made, its group and
// its one line of `spillway`'s overview, so that the overview is taken from the commands.
enum class Group { kPlan, kTrain, kServe, kTools };
void overview_line(std::string name, Group group, std::string summary);
// The overview of the subcommands registered on `app`, in their groups and in the order they
// were registered; a subcommand without a line (or a line without a subcommand) is a defect:
// spillway::Error.
std::string overview(const CLI::App& app);

void add_plan_command(CLI::App& app);
void add_models_command(CLI::App& app);
void add_hardware_command(CLI::App& app);
void add_simulate_command(CLI::App& app);
void add_probe_command(CLI::App& app);
void add_bench_command(CLI::App& app);  // forwards to spillway-bench (bench/)
void add_train_command(CLI::App& app);
void add_stream_command(CLI::App& app);
void add_replay_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_checkpoint_command(CLI::App& app);
void add_load_command(CLI::App& app);
void add_tokenize_command(CLI::App& app);
void add_chat_template_command(CLI::App& app);
void add_doctor_command(CLI::App& app);

}  // namespace spillway::cli

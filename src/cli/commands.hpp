// The spillway subcommands. Each registers its options on the app and runs from its
// callback; a callback reports failure by throwing spillway::Error (exit 1).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace spillway::cli {

void add_plan_command(CLI::App& app);
void add_models_command(CLI::App& app);
void add_hardware_command(CLI::App& app);
void add_simulate_command(CLI::App& app);
void add_probe_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_train_command(CLI::App& app);

// Writes `text` to `path` atomically (a temporary file renamed into place), or to stdout
// when path is "-". A failed write leaves nothing half-written behind.
void write_output(const std::string& path, const std::string& text);

}  // namespace spillway::cli

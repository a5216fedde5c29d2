// `spillway bench`: the engines' benchmarks, each checked for correctness before it is
// timed and printed beside its baseline measured in the same run and its limit. One
// sub-subcommand per engine (`offload` for now).
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <memory>

#include "bench_offload.hpp"
#include "cli/commands.hpp"
#include "spillway/error.hpp"

namespace spillway::cli {

namespace {

void add_bench_offload_command(CLI::App& bench) {
  struct State {
    OffloadBenchOptions options;
    double tensor_mib = static_cast<double>(OffloadBenchOptions{}.tensor_bytes) / (1 << 20);
    std::string json_path;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = bench.add_subcommand(
      "offload",
      "The activation offload engine on the host backend (an emulated device whose copy engines "
      "are worker threads doing memcpy): offload (D2H) and reload (H2D) throughput of a "
      "training-loop-shaped run against plain memcpy bandwidth measured in the same run (the "
      "limit), and the CPU overhead per offloaded tensor in microseconds (many 64 KiB tensors, "
      "host time inside the engine's calls). Targets: at least 0.9 x memcpy; under 2 us per "
      "tensor; no device allocation in steady state. Every reloaded byte is checked against "
      "what was written before anything is timed; memcpy and engine runs are interleaved and "
      "figures are medians. Needs about 4 x layers x tensors x tensor size of host memory, plus "
      "0.5 GB.\n\n"
      "Examples:\n"
      "  spillway bench offload\n"
      "  spillway bench offload --layers 16 --tensor-mb 4 --steps 3 --json -\n"
      "  spillway bench offload --repeats 5 --json bench_offload.json");
  OffloadBenchOptions& o = st->options;
  cmd->add_option("--layers", o.layers, "Layers per step, each offloading its tensors")
      ->capture_default_str();
  cmd->add_option("--tensors-per-layer", o.tensors_per_layer, "Tensors offloaded per layer")
      ->capture_default_str();
  cmd->add_option("--tensor-mb", st->tensor_mib, "Size of each tensor in MiB (2^20 bytes)")
      ->capture_default_str();
  cmd->add_option("--steps", o.steps,
                  "Steps per repeat of each pass; the first is the warm-up (and the full "
                  "byte-for-byte check)")
      ->capture_default_str();
  cmd->add_option("--repeats", o.repeats,
                  "Times memcpy, the bandwidth pass and the overhead pass are interleaved")
      ->capture_default_str();
  cmd->add_option("--prefetch-depth", o.prefetch_depth, "Layers backward prefetches ahead")
      ->capture_default_str();
  cmd->add_option("--json", st->json_path,
                  "Write the results as JSON to FILE ('-' for stdout): offload_gbps, "
                  "reload_gbps, memcpy_gbps, overhead_us_per_tensor, allocations_steady_state, "
                  "then ratios, targets and samples");
  cmd->callback([st]() {
    OffloadBenchOptions options = st->options;
    if (options.layers < 1) SPILLWAY_INPUT_ERROR("--layers is {}; must be >= 1", options.layers);
    if (options.tensors_per_layer < 1) {
      SPILLWAY_INPUT_ERROR("--tensors-per-layer is {}; must be >= 1", options.tensors_per_layer);
    }
    if (options.steps < 2) {
      SPILLWAY_INPUT_ERROR("--steps is {}; must be >= 2 (the first is a warm-up)", options.steps);
    }
    if (options.repeats < 1) SPILLWAY_INPUT_ERROR("--repeats is {}; must be >= 1", options.repeats);
    if (options.prefetch_depth < 0) {
      SPILLWAY_INPUT_ERROR("--prefetch-depth is {}; must be >= 0", options.prefetch_depth);
    }
    const double bytes = std::round(st->tensor_mib * (1 << 20));
    if (!(bytes >= 1.0) || bytes > 64.0 * (1 << 30)) {
      SPILLWAY_INPUT_ERROR("--tensor-mb is {}; must be > 0 and at most 65536 (64 GiB)",
                           st->tensor_mib);
    }
    options.tensor_bytes = static_cast<size_t>(bytes);

    // Human-readable lines go to stdout, unless the JSON does (then to stderr).
    const bool json_on_stdout = st->json_path == "-";
    const auto say = [&](const std::string& text) {
      if (json_on_stdout) {
        std::fputs(text.c_str(), stderr);
      } else {
        write_output("-", text);
      }
    };
    say(fmt::format(
        "running: {} layers x {} tensors x {:g} MiB, {} steps x {} repeats (memcpy, bandwidth "
        "pass, overhead pass interleaved)...\n",
        options.layers, options.tensors_per_layer, st->tensor_mib, options.steps, options.repeats));
    const OffloadBenchResult result = run_offload_bench(options);
    say(format_offload_bench(result));
    if (!st->json_path.empty()) write_output(st->json_path, offload_bench_json(result));
  });
}

}  // namespace

void add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Benchmarks of spillway's engines on this machine: each checks its results before it "
      "times, and prints its baseline measured in the same run and the physical limit.\n\n"
      "Examples:\n"
      "  spillway bench offload\n"
      "  spillway bench offload --layers 16 --tensor-mb 4 --json -");
  bench->require_subcommand(1);
  add_bench_offload_command(*bench);
}

}  // namespace spillway::cli

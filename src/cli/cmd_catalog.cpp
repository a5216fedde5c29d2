// `spillway models` and `spillway hardware`: the embedded catalogs.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "cli/commands.hpp"
#include "spillway/device.hpp"
#include "spillway/hardware.hpp"
#include "spillway/model.hpp"

namespace spillway::cli {

void add_models_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "models",
      "List the embedded model catalog (Hugging Face config.json files in data/models/). Any "
      "other config.json can be passed by path to --model.");
  cmd->callback([]() {
    std::string out = fmt::format("{:<18} {:<10} {:>7} {:>11} {:>9} {:>8}  {}\n", "name", "type",
                                  "layers", "params (B)", "published", "active", "blocks");
    for (const ModelCatalogEntry& e : model_catalog()) {
      const ModelConfig m = load_model(e.name);
      // Layer counts per block type, in order of first appearance.
      std::vector<std::pair<std::string, int>> counts;
      for (const LayerSpec& l : m.layers) {
        const std::string b = l.block_name();
        auto it =
            std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == b; });
        if (it == counts.end()) {
          counts.emplace_back(b, 1);
        } else {
          ++it->second;
        }
      }
      std::string blocks;
      for (const auto& [b, n] : counts)
        blocks += fmt::format("{}{}x {}", blocks.empty() ? "" : ", ", n, b);
      out += fmt::format("{:<18} {:<10} {:>7} {:>11.2f} {:>9.1f} {:>8.2f}  {}\n", e.name,
                         m.model_type, m.layers.size(),
                         static_cast<double>(parameter_count(m)) / 1e9, e.published_params_b,
                         static_cast<double>(active_parameter_count(m)) / 1e9, blocks);
    }
    write_output("-", out);
  });
}

void add_hardware_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "hardware",
      "List the embedded hardware profiles (data/hardware/). Link figures are per direction for "
      "one GPU alone on its link; the planner divides the typical figure by the GPUs sharing "
      "the link. Pass your own profile by path to --hardware.");
  cmd->callback([]() {
    std::string out =
        fmt::format("{:<10} {:>7} {:>8} {:>10} {:>9}  {:<14} {:>17} {:>17} {:>5} {:>8}  {}\n",
                    "name", "HBM GB", "HBM TB/s", "bf16 TF/s", "fp8 TF/s", "host link",
                    "D2H GB/s typ/nom", "H2D GB/s typ/nom", "share", "host GB", "MIG");
    for (const std::string& name : hardware_names()) {
      const HardwareProfile h = load_hardware(name);
      std::string mig;
      for (const MigProfile& p : h.mig)
        mig += fmt::format("{}{}x{}", mig.empty() ? "" : " ", p.count, p.profile);
      out += fmt::format(
          "{:<10} {:>7.0f} {:>8.2f} {:>10.0f} {:>9.0f}  {:<14} {:>8.0f}/{:<8.0f} {:>8.0f}/{:<8.0f} "
          "{:>5} {:>8.0f}  {}{}\n",
          h.name, h.hbm_gb, h.hbm_tbps, h.bf16_dense.value, h.fp8_dense.value, h.link_kind,
          h.d2h_typical.value, h.d2h_nominal.value, h.h2d_typical.value, h.h2d_nominal.value,
          h.gpus_per_link, h.host_memory_gb, mig.empty() ? "-" : mig,
          h.projected ? "  (projected)" : "");
    }
    out += "\nfabric between GPUs (per GPU, per direction; docs/collectives.md):\n";
    for (const std::string& name : hardware_names()) {
      const HardwareProfile h = load_hardware(name);
      out += fmt::format("  {:<10} {}\n", h.name, describe_interconnect(h.interconnect));
    }
    const CudaInfo cuda = cuda_info();
    out += fmt::format("\nthis machine: CUDA backend {}, {} device(s){}\n",
                       cuda.compiled ? "compiled" : "not compiled", cuda.devices,
                       cuda.note.empty() ? "" : " (" + cuda.note + ")");
    write_output("-", out);
  });
}

}  // namespace spillway::cli

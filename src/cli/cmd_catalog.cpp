// `spillway models` and `spillway hardware`: the embedded catalogs.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "cli/commands.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/device/device.hpp"

namespace spillway::cli {

void add_models_command(CLI::App& app) {
  overview_line("models", Group::kPlan, "the model catalog (any config.json works by path too)");
  CLI::App* cmd = app.add_subcommand(
      "models",
      "List the embedded model catalog (Hugging Face config.json files in data/models/). Any "
      "other config.json can be passed by path to --model.");
  cmd->callback([]() {
    struct Row {
      std::string name, type, blocks;
      size_t layers = 0;
      double params = 0, published = 0, active = 0, published_active = 0;
    };
    std::vector<Row> rows;
    size_t name_w = 4;
    size_t type_w = 4;
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
      Row r;
      r.name = e.name;
      r.type = m.model_type;
      r.layers = m.layers.size();
      r.params = static_cast<double>(parameter_count(m)) / 1e9;
      r.published = e.published_params_b;
      r.active = static_cast<double>(active_parameter_count(m)) / 1e9;
      r.published_active = e.published_active_params_b;
      for (const auto& [b, n] : counts)
        r.blocks += fmt::format("{}{}x {}", r.blocks.empty() ? "" : ", ", n, b);
      name_w = std::max(name_w, r.name.size());
      type_w = std::max(type_w, r.type.size());
      rows.push_back(std::move(r));
    }
    std::string out =
        fmt::format("{:<{}} {:<{}} {:>7} {:>11} {:>9} {:>8} {:>9}  {}\n", "name", name_w, "type",
                    type_w, "layers", "params (B)", "published", "active", "published", "blocks");
    for (const Row& r : rows) {
      out += fmt::format("{:<{}} {:<{}} {:>7} {:>11.2f} {:>9.1f} {:>8.2f} {:>9.1f}  {}\n", r.name,
                         name_w, r.type, type_w, r.layers, r.params, r.published, r.active,
                         r.published_active, r.blocks);
    }
    out +=
        "\nparams and active: counted from the config (embeddings, final norm and an untied head "
        "included; MTP layers left out); published: the model card's figures "
        "(data/models/catalog.json says where from). Any other config.json plans by path.\n";
    write_output("-", out);
  });
}

void add_hardware_command(CLI::App& app) {
  overview_line("hardware", Group::kPlan, "the hardware profiles: GPUs, host links, MIG");
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

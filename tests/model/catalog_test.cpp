// The embedded catalogs: every model parses and its parameter count is within 2% of the
// published figure; every hardware profile loads and is self-consistent; the embedded
// copies are exactly the files of data/.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include "core/embedded_data.hpp"
#include "spillway/catalog/hardware.hpp"
#include "spillway/catalog/model.hpp"
#include "spillway/plan/plan.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(ModelCatalog, HasTheExpectedModels) {
  const std::vector<ModelCatalogEntry> cat = model_catalog();
  std::set<std::string> names;
  for (const ModelCatalogEntry& e : cat) {
    EXPECT_TRUE(names.insert(e.name).second) << "duplicate catalog name " << e.name;
    EXPECT_FALSE(e.file.empty()) << e.name;
    EXPECT_GT(e.published_params_b, 0.0) << e.name;
    EXPECT_LE(e.published_active_params_b, e.published_params_b) << e.name;
  }
  for (const char* n : {"Qwen3-30B-A3B", "Qwen3-14B", "Qwen3-235B-A22B", "Llama-3.1-8B",
                        "Llama-3.1-70B", "Mixtral-8x7B", "DeepSeek-V3", "GPT-OSS-20B", "Grok-2",
                        "Mistral-7B", "Qwen2-57B-A14B", "Qwen2.5-7B"}) {
    EXPECT_TRUE(names.count(n)) << "missing catalog model " << n;
  }
}

// Every shipped config counts the published total and active parameters: within
// 1%, or within the tolerance its catalog entry gives with the reason in params_source
// (a figure rounded to "1T" or "3B", a vision tower the planner does not plan); and each
// plans.
TEST(ModelCatalog, EveryParameterCountMatchesThePublishedFigures) {
  const std::vector<ModelCatalogEntry> cat = model_catalog();
  ASSERT_GE(cat.size(), 20u);
  for (const ModelCatalogEntry& e : cat) {
    SCOPED_TRACE(e.name);
    const ModelConfig m = load_model(e.name);
    const double counted = static_cast<double>(parameter_count(m));
    const double published = e.published_params_b * 1e9;
    const double rel = (counted - published) / published;
    // Some cards leave the input embedding, or it and the LM head, out of the active count
    // (the catalog says so).
    const int64_t head = m.tied_embeddings ? 0 : m.vocab * m.hidden;
    const int64_t active = active_parameter_count(m) -
                           (e.active_counts_embedding ? 0 : m.vocab * m.hidden) -
                           (e.active_counts_head ? 0 : head);
    const double active_rel = (static_cast<double>(active) - e.published_active_params_b * 1e9) /
                              (e.published_active_params_b * 1e9);
    std::cout << "  " << e.name << ": total " << counted / 1e9 << "B vs " << e.published_params_b
              << "B (" << rel * 100.0 << "%), active " << static_cast<double>(active) / 1e9
              << "B vs " << e.published_active_params_b << "B (" << active_rel * 100.0 << "%)\n";
    EXPECT_LE(std::abs(rel), e.params_tolerance + 1e-12)
        << e.name << ": counted " << counted << " vs published " << published;
    EXPECT_LE(std::abs(active_rel), e.active_tolerance + 1e-12)
        << e.name << ": active " << active << " vs published " << e.published_active_params_b;
    EXPECT_LE(active, parameter_count(m));
    const bool moe = std::any_of(m.layers.begin(), m.layers.end(),
                                 [](const LayerSpec& l) { return l.mlp.kind == MlpKind::kMoe; });
    if (!moe) {
      EXPECT_EQ(active, parameter_count(m)) << "a dense model's active count is its total";
    }
    PlanRequest r;
    r.model = m;
    r.hardware = load_hardware("gb200");
    r.work.shape.seq_len = 1024;
    r.hbm_budget_gb = 1e5;
    const Plan p = make_plan(r);
    EXPECT_EQ(p.params_total, parameter_count(m));
    EXPECT_GT(p.summary.step_ms, 0.0);
  }
}

TEST(ModelCatalog, LookupIsCaseInsensitiveAndByFileName) {
  const ModelConfig a = load_model("Qwen3-30B-A3B");
  const ModelConfig b = load_model("qwen3-30b-a3b");
  const ModelConfig c = load_model("QWEN3-30B-A3B.json");
  EXPECT_EQ(a.name, "Qwen3-30B-A3B");
  EXPECT_EQ(b.name, "Qwen3-30B-A3B");
  EXPECT_EQ(a.layers, b.layers);
  EXPECT_EQ(a.layers, c.layers);
  EXPECT_EQ(a.source, "data/models/qwen3-30b-a3b.json");
}

TEST(ModelCatalog, EmbeddedCopiesMatchDataDirectory) {
  const std::filesystem::path data(SPILLWAY_DATA_DIR);
  size_t on_disk = 0;
  for (const char* kind : {"models", "hardware", "nn"}) {
    for (const auto& f : std::filesystem::directory_iterator(data / kind)) {
      if (f.path().extension() != ".json") continue;
      ++on_disk;
      const EmbeddedFile* e = find_embedded(kind, f.path().filename().string());
      ASSERT_NE(e, nullptr) << f.path() << " is not embedded (rebuild?)";
      EXPECT_EQ(std::string(e->text), read_text(f.path())) << f.path();
    }
  }
  EXPECT_EQ(embedded_files().size(), on_disk);
  // Every model file is in the catalog and loads by path to the same layers.
  std::set<std::string> listed;
  for (const ModelCatalogEntry& e : model_catalog()) {
    listed.insert(e.file);
    const ModelConfig by_path = load_model((data / "models" / e.file).string());
    EXPECT_EQ(by_path.layers, load_model(e.name).layers) << e.file;
    EXPECT_EQ(by_path.hidden, load_model(e.name).hidden) << e.file;
  }
  for (const auto& f : std::filesystem::directory_iterator(data / "models")) {
    const std::string n = f.path().filename().string();
    if (f.path().extension() != ".json" || n == "catalog.json") continue;
    EXPECT_TRUE(listed.count(n)) << n << " is in data/models but not in catalog.json";
  }
}

TEST(HardwareCatalog, ExpectedProfilesPresent) {
  const std::vector<std::string> names = hardware_names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  for (const char* n : {"gb200", "gh200", "h100-sxm", "h100-pcie", "h200-sxm", "b200", "rubin"}) {
    EXPECT_TRUE(std::find(names.begin(), names.end(), n) != names.end()) << "missing " << n;
  }
}

TEST(HardwareCatalog, EveryProfileLoadsAndIsConsistent) {
  const std::vector<std::string> names = hardware_names();
  ASSERT_GE(names.size(), 7u);
  for (const std::string& n : names) {
    SCOPED_TRACE(n);
    const HardwareProfile h = load_hardware(n);
    EXPECT_EQ(h.name, n);
    EXPECT_EQ(h.source, "data/hardware/" + n + ".json");
    EXPECT_GT(h.hbm_gb, 0.0);
    EXPECT_GT(h.hbm_tbps, 0.0);
    EXPECT_GT(h.sms, 0);
    EXPECT_GT(h.bf16_dense.value, 0.0);
    EXPECT_GE(h.fp8_dense.value, h.bf16_dense.value);
    EXPECT_LE(h.d2h_typical.value, h.d2h_nominal.value);
    EXPECT_LE(h.h2d_typical.value, h.h2d_nominal.value);
    EXPECT_GT(h.d2h_typical.value, 0.0);
    EXPECT_GE(h.gpus_per_link, 1);
    EXPECT_GE(h.gpus_per_host_memory, 1);
    EXPECT_GT(h.host_memory_gb, 0.0);
    EXPECT_FALSE(h.link_kind.empty());
    for (const MigProfile& p : h.mig) {
      SCOPED_TRACE(p.profile);
      EXPECT_LE(p.hbm_gb, h.hbm_gb);
      EXPECT_LE(p.sms, h.sms);
      EXPECT_GE(p.count, 1);
      EXPECT_LE(p.hbm_tbps, h.hbm_tbps);
    }
  }
}

TEST(HardwareCatalog, FiguresOfTheDesignDoc) {
  // data/hardware/README.md: GH200's D2H is measured far below its H2D; PCIe Gen5 ~64 nominal.
  const HardwareProfile gh = load_hardware("gh200");
  EXPECT_DOUBLE_EQ(gh.hbm_gb, 96.0);
  EXPECT_DOUBLE_EQ(gh.d2h_nominal.value, 450.0);
  EXPECT_LT(gh.d2h_typical.value, gh.h2d_typical.value);
  const HardwareProfile h100 = load_hardware("h100-sxm");
  EXPECT_DOUBLE_EQ(h100.d2h_nominal.value, 64.0);
  EXPECT_TRUE(load_hardware("rubin").projected);
  EXPECT_FALSE(gh.projected);
}

TEST(HardwareCatalog, LoadsFromAFilePath) {
  const std::filesystem::path p =
      std::filesystem::path(SPILLWAY_DATA_DIR) / "hardware" / "gh200.json";
  const HardwareProfile by_path = load_hardware(p.string());
  const HardwareProfile by_name = load_hardware("gh200");
  EXPECT_EQ(by_path.source, p.string());
  EXPECT_EQ(by_path.name, by_name.name);
  EXPECT_EQ(by_path.d2h_typical, by_name.d2h_typical);
  EXPECT_EQ(by_path.mig.size(), by_name.mig.size());
}

}  // namespace
}  // namespace spillway

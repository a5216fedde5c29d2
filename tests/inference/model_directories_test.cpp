// Model directories (Note [Model directories], Note [Refused model directories]): a sharded
// checkpoint (Note [Sharded checkpoints]) serves as the single file it was split from and
// keeps the change-on-disk rules across shards (Note [Checkpoints that change on disk]);
// every bad directory is refused with its reason while the rest are served, and none left
// is an error naming every refusal.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "inference/served_models.hpp"
#include "spillway/core/error.hpp"
#include "spillway/inference/inference.hpp"
#include "spillway/serve/serve.hpp"
#include "test_support.hpp"

namespace spillway::inference {
namespace {

using testing::complete;
using testing::fast;
using testing::models;
using testing::request;

namespace fs = std::filesystem;
using spillway::testing::expect_error;
using spillway::testing::TempDir;

// Writes `from`'s checkpoint into `dir` as Hugging Face shards it: config.json, `shards`
// files named model-0000i-of-0000n.safetensors (the tensors dealt out in order) and
// model.safetensors.index.json. Returns the shard file names.
std::vector<std::string> write_sharded(const ModelFiles& from, const fs::path& dir, int shards) {
  fs::create_directories(dir);
  fs::copy_file(from.config_path, dir / "config.json");
  const SafetensorsFile f(from.weights_path);
  std::vector<std::vector<SafetensorsEntry>> parts(static_cast<size_t>(shards));
  std::vector<std::string> names;
  for (int i = 0; i < shards; ++i)
    names.push_back("model-0000" + std::to_string(i + 1) + "-of-0000" + std::to_string(shards) +
                    ".safetensors");
  std::string map;
  const size_t per =
      (f.tensors().size() + static_cast<size_t>(shards) - 1) / static_cast<size_t>(shards);
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const SafetensorsTensor& t = f.tensors()[i];
    parts[i / per].push_back({t.name, t.dtype, t.shape, {f.data(t), f.data(t) + t.bytes}});
    map += (map.empty() ? "" : ", ") + ("\"" + t.name + "\": \"" + names[i / per] + "\"");
  }
  for (size_t i = 0; i < parts.size(); ++i) write_safetensors((dir / names[i]).string(), parts[i]);
  std::ofstream((dir / "model.safetensors.index.json").string())
      << "{\"metadata\": {}, \"weight_map\": {" << map << "}}";
  return names;
}

TEST(ModelDirectories, AShardedCheckpointServesAsItsSingleFile) {
  const auto& m = models();
  TempDir dir;
  fs::create_directories(dir.path() / "single");
  fs::copy_file(m.files[0].config_path, dir.path() / "single" / "config.json");
  fs::copy_file(m.files[0].weights_path, dir.path() / "single" / "model.safetensors");
  const std::vector<std::string> shards = write_sharded(m.files[0], dir.path() / "sharded", 3);
  const std::vector<ModelFiles> files = find_models(dir.path().string());
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].name, "sharded");
  EXPECT_EQ(fs::path(files[0].weights_path).filename(), "model.safetensors.index.json");
  ServingEngine e(files, fast("7g.96gb", 0.5));
  EXPECT_EQ(e.models()[0].weight_bytes, e.models()[1].weight_bytes);
  const std::vector<int32_t> want = complete(e, request("single", "one file or three", 12));
  EXPECT_EQ(complete(e, request("sharded", "one file or three", 12)), want);

  // Note [Checkpoints that change on disk], across shards: a shard cut short (a fresh engine,
  // so the next request loads) makes the model unavailable, naming the shard; the good shard
  // put back by a rename, it is served again.
  const fs::path shard = dir.path() / "sharded" / shards[1];
  fs::copy_file(shard, dir.path() / "good.keep");
  ServingEngine f(files, fast("7g.96gb", 0.5));
  fs::resize_file(shard, 100);
  SubmitResult r = f.submit(request("sharded", "cut", 4));
  if (r.status == SubmitStatus::kAccepted) {
    std::vector<int32_t> t;
    while (r.completion->wait_tokens(t.size(), &t) == Completion::State::kRunning) {
    }
    EXPECT_EQ(r.completion->state(), Completion::State::kFailed);
    EXPECT_NE(r.completion->error().find(shards[1]), std::string::npos) << r.completion->error();
  }
  const SubmitResult again = f.submit(request("sharded", "cut", 4));
  EXPECT_EQ(again.status, SubmitStatus::kUnavailable);
  EXPECT_NE(again.message.find("model sharded"), std::string::npos) << again.message;
  EXPECT_NE(again.message.find(shards[1]), std::string::npos) << again.message;
  fs::rename(dir.path() / "good.keep", shard);
  EXPECT_EQ(complete(f, request("sharded", "one file or three", 12)), want);
}

TEST(ModelDirectories, EachBadDirectoryIsRefusedWithItsReasonAndTheRestServed) {
  const auto& m = models();
  TempDir dir;
  auto copy_model = [&](const std::string& name) {
    fs::create_directories(dir.path() / name);
    fs::copy_file(m.files[0].config_path, dir.path() / name / "config.json");
    fs::copy_file(m.files[0].weights_path, dir.path() / name / "model.safetensors");
  };
  copy_model("good");
  copy_model("both");  // a single file and an index
  write_sharded(m.files[0], dir.path() / "sharded", 2);
  fs::copy_file(m.files[0].weights_path, dir.path() / "both" / "model.safetensors.index.json");
  fs::create_directories(dir.path() / "bare");  // a config and no weights
  fs::copy_file(m.files[0].config_path, dir.path() / "bare" / "config.json");
  const std::vector<std::string> shards =
      write_sharded(m.files[0], dir.path() / "missing-shard", 2);
  fs::remove(dir.path() / "missing-shard" / shards[1]);
  copy_model("other-config");  // weights that do not match their config
  {
    std::ofstream(dir.path() / "other-config" / "config.json", std::ios::trunc)
        << "{\"model_type\": \"llama\", \"vocab_size\": 256, \"hidden_size\": 32, "
           "\"intermediate_size\": 64, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
           "\"num_key_value_heads\": 2, \"max_position_embeddings\": 128}";
  }
  fs::create_directories(dir.path() / "not-a-model");  // no config.json: not a model at all

  const ModelScan scan = scan_models(dir.path().string());
  std::vector<std::string> found;
  for (const ModelFiles& f : scan.models) found.push_back(f.name);
  EXPECT_EQ(found, (std::vector<std::string>{"good", "missing-shard", "other-config", "sharded"}));
  ASSERT_EQ(scan.refused.size(), 2u);
  EXPECT_EQ(scan.refused[0].name, "bare");
  EXPECT_NE(scan.refused[0].why.find("no model.safetensors"), std::string::npos);
  EXPECT_EQ(scan.refused[1].name, "both");
  for (const char* needle :
       {"both model.safetensors and model.safetensors.index.json", "ambiguous"})
    EXPECT_NE(scan.refused[1].why.find(needle), std::string::npos) << scan.refused[1].why;
  expect_error([&] { find_models(dir.path().string()); }, {"/bare'", "no model.safetensors"});

  // Strict (the default): the first model that cannot be registered fails the constructor.
  expect_error([&] { ServingEngine e(scan.models, fast("7g.96gb", 0.5)); },
               {"missing-shard", shards[1], "is missing"});
  // Tolerant: the rest are served; every refusal named with its reason, by name.
  EngineOptions o = fast("7g.96gb", 0.5);
  o.skip_refused = true;
  ServingEngine e(scan.models, o, scan.refused);
  ASSERT_EQ(e.models().size(), 2u);
  EXPECT_EQ(e.models()[0].name, "good");
  EXPECT_EQ(e.models()[1].name, "sharded");
  const std::vector<RefusedModel>& refused = e.refused();
  ASSERT_EQ(refused.size(), 4u);
  EXPECT_EQ(refused[0].name, "bare");
  EXPECT_EQ(refused[1].name, "both");
  EXPECT_EQ(refused[2].name, "missing-shard");
  EXPECT_NE(refused[2].why.find(shards[1]), std::string::npos) << refused[2].why;
  EXPECT_NE(refused[2].why.find("is missing"), std::string::npos) << refused[2].why;
  EXPECT_EQ(refused[3].name, "other-config");
  EXPECT_NE(refused[3].why.find("shape"), std::string::npos) << refused[3].why;
  EXPECT_EQ(complete(e, request("good", "still served", 6)).size(), 6u);
  EXPECT_EQ(e.submit(request("both", "x", 2)).status, SubmitStatus::kUnknownModel);

  // None left: an error naming every refusal.
  const std::vector<ModelFiles> bad = {scan.models[1], scan.models[2]};
  expect_error([&] { ServingEngine x(bad, o, scan.refused); },
               {"no model can be served", "refused bare:", "refused both:",
                "refused missing-shard:", "refused other-config:"});
}

}  // namespace
}  // namespace spillway::inference

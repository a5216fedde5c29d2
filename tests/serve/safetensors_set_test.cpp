// Sharded checkpoints (Note [Sharded checkpoints]): an index and its shards read as one
// file, tensors looked up by name across shards; every disagreement between the index and
// the shards, a missing shard and a shard path leaving the directory refused by name; the
// pool loads every shard into one model and finds a changed shard (kChanged), then reads it
// once refreshed.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "spillway/core/error.hpp"
#include "spillway/serve/serve.hpp"
#include "test_support.hpp"

namespace spillway {
namespace {

namespace fs = std::filesystem;
using spillway::testing::expect_error;
using spillway::testing::TempDir;

// n fp32 values seed, seed + 1, ...
SafetensorsEntry tensor(const std::string& name, int64_t n, float seed) {
  SafetensorsEntry e{name, DType::kFp32, {n}, std::vector<std::byte>(static_cast<size_t>(n) * 4)};
  for (int64_t i = 0; i < n; ++i) {
    const float v = seed + static_cast<float>(i);
    std::memcpy(e.bytes.data() + i * 4, &v, 4);
  }
  return e;
}

float first_float(const std::byte* p) {
  float v = 0;
  std::memcpy(&v, p, 4);
  return v;
}

// A model in two shards as Hugging Face writes it: a and b in the first, c in the second.
struct Sharded {
  TempDir dir;
  std::string one = "model-00001-of-00002.safetensors";
  std::string two = "model-00002-of-00002.safetensors";
  nlohmann::json map = {{"a", one}, {"b", one}, {"c", two}};
  Sharded() {
    write_safetensors(dir.file(one), {tensor("a", 16, 1.0f), tensor("b", 8, 100.0f)});
    write_safetensors(dir.file(two), {tensor("c", 32, 200.0f)});
    write_index();
  }
  std::string index() const { return dir.file("model.safetensors.index.json"); }
  void write_index() const {
    dir.write("model.safetensors.index.json",
              nlohmann::json{{"metadata", {{"total_size", 224}}}, {"weight_map", map}}.dump());
  }
};

TEST(SafetensorsSet, ShardsAreReadAsOneFile) {
  const Sharded s;
  const SafetensorsSet f(s.index());
  EXPECT_TRUE(f.sharded());
  ASSERT_EQ(f.tensors().size(), 3u);
  ASSERT_EQ(f.paths().size(), 3u);  // the index, then each shard
  EXPECT_EQ(f.paths()[0], s.index());
  EXPECT_EQ(f.stamps().size(), 3u);
  EXPECT_EQ(f.data_bytes(), (16 + 8 + 32) * 4);
  const SafetensorsTensor* c = f.find("c");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->shard, 1);
  EXPECT_EQ(f.file_of(*c), s.dir.file(s.two));
  EXPECT_EQ(f.find("d"), nullptr);
  std::vector<std::byte> buf(128);
  f.read(*c, buf.data());
  EXPECT_EQ(first_float(buf.data()), 200.0f);
  f.read(*f.find("b"), buf.data());
  EXPECT_EQ(first_float(buf.data()), 100.0f);
  EXPECT_EQ(SafetensorsSet::stamps_now(s.index()), f.stamps());
  // A single file is a set of one.
  const SafetensorsSet single(s.dir.file(s.two));
  EXPECT_FALSE(single.sharded());
  EXPECT_EQ(single.tensors().size(), 1u);
  EXPECT_EQ(SafetensorsSet::stamps_now(s.dir.file(s.two)), single.stamps());
}

TEST(SafetensorsSet, AnIndexThatDisagreesWithItsShardsIsRefusedByName) {
  {  // A tensor mapped to a shard that does not hold it.
    Sharded s;
    s.map["c"] = s.one;
    s.map["d"] = s.two;
    s.write_index();
    expect_error([&] { SafetensorsSet f(s.index()); },
                 {"model.safetensors.index.json", "maps tensor 'c'", s.one, "does not hold it"});
  }
  {  // A tensor in two shards.
    Sharded s;
    write_safetensors(s.dir.file(s.two), {tensor("c", 32, 200.0f), tensor("a", 16, 1.0f)});
    expect_error([&] { SafetensorsSet f(s.index()); },
                 {"tensor 'a'", "in shard " + s.one, "and in shard " + s.two, "one shard"});
  }
  {  // A tensor a shard holds and weight_map does not list.
    Sharded s;
    s.map.erase("b");
    s.write_index();
    expect_error([&] { SafetensorsSet f(s.index()); },
                 {"shard " + s.one, "holds tensor 'b'", "weight_map does not list"});
  }
  {  // A shard file in the directory that the index does not name.
    Sharded s;
    write_safetensors(s.dir.file("model-00003-of-00003.safetensors"), {tensor("e", 4, 0.0f)});
    expect_error([&] { SafetensorsSet f(s.index()); },
                 {"model-00003-of-00003.safetensors", "the index does not name"});
  }
  {  // Another safetensors file (Mistral's consolidated.safetensors) is not the checkpoint.
    Sharded s;
    write_safetensors(s.dir.file("consolidated.safetensors"), {tensor("e", 4, 0.0f)});
    SafetensorsSet f(s.index());
    EXPECT_EQ(f.find("e"), nullptr);
    EXPECT_EQ(f.tensors().size(), 3u);
  }
  {  // A missing shard: named, with the index.
    Sharded s;
    fs::remove(s.dir.file(s.two));
    expect_error(
        [&] { SafetensorsSet f(s.index()); },
        {"model.safetensors.index.json", "shard", s.dir.file(s.two), "is missing", "tensor 'c'"});
  }
  // Shard paths that leave the directory (or are not file names) are refused before any is
  // opened.
  for (const std::string bad :
       {"../x.safetensors", "/tmp/x.safetensors", "sub/x.safetensors", "..", ""}) {
    SCOPED_TRACE(bad);
    Sharded s;
    s.map["c"] = bad;
    s.write_index();
    expect_error([&] { SafetensorsSet f(s.index()); },
                 {"weight_map[\"c\"]", "\"" + bad + "\"", "a file name in the index's directory"});
  }
  {  // Not an index.
    Sharded s;
    s.dir.write("model.safetensors.index.json", "{\"metadata\": {}}");
    expect_error([&] { SafetensorsSet f(s.index()); }, {"no \"weight_map\" object"});
    s.dir.write("model.safetensors.index.json", "[1, 2]");
    expect_error([&] { SafetensorsSet f(s.index()); }, {"not a JSON object"});
    s.dir.write("model.safetensors.index.json", "{\"weight_map\": {\"a\": 3}}");
    expect_error([&] { SafetensorsSet f(s.index()); }, {"weight_map[\"a\"] is 3"});
    s.dir.write("model.safetensors.index.json", "{\"weight_map\": {}}");
    expect_error([&] { SafetensorsSet f(s.index()); }, {"weight_map is empty"});
    fs::remove(s.index());
    expect_error([&] { SafetensorsSet f(s.index()); }, {"model.safetensors.index.json", "cannot"});
  }
  {  // A shard that is not a safetensors file: its own check, naming it.
    Sharded s;
    s.dir.write(s.two, "not a safetensors file at all");
    expect_error([&] { SafetensorsSet f(s.index()); }, {s.dir.file(s.two)});
  }
}

TEST(SafetensorsSet, ThePoolLoadsEveryShardAndFindsOneChanged) {
  Sharded s;
  auto dev = make_host_device(HostDeviceOptions{int64_t{1} << 20, 0.0, 0.0});
  ModelPool pool(*dev, ModelPoolOptions{int64_t{1} << 20});
  pool.add("m", s.index());
  {
    PoolAcquire a = pool.acquire("m");
    ASSERT_EQ(a.status, PoolStatus::kOk) << a.why;
    EXPECT_TRUE(a.cold);
    EXPECT_EQ(first_float(a.handle.tensor("a").host), 1.0f);
    EXPECT_EQ(first_float(a.handle.tensor("b").host), 100.0f);
    EXPECT_EQ(first_float(a.handle.tensor("c").host), 200.0f);
    EXPECT_EQ(a.handle.tensors().size(), 3u);
    EXPECT_EQ(a.handle.weight_bytes(), 64 + 64 + 128);  // every shard, 64-byte aligned
    EXPECT_EQ(pool.stats().resident_bytes, 64 + 64 + 128);
    EXPECT_EQ(pool.stats().cold_load_bytes, (16 + 8 + 32) * 4);
  }
  // The second shard replaced by a rename: a cold load (another pool, the same files) answers
  // kChanged naming the shard; refreshed, the next load reads the new shard.
  ModelPool other(*dev, ModelPoolOptions{int64_t{1} << 20});
  other.add("m", s.index());
  const std::vector<FileStamp> before = SafetensorsSet::stamps_now(s.index());
  write_safetensors(s.dir.file("new.tmp"), {tensor("c", 32, 300.0f)});
  fs::rename(s.dir.file("new.tmp"), s.dir.file(s.two));
  EXPECT_NE(SafetensorsSet::stamps_now(s.index()), before);
  PoolAcquire x = other.acquire("m");
  EXPECT_EQ(x.status, PoolStatus::kChanged);
  for (const std::string& needle :
       {std::string("model 'm'"), s.dir.file(s.two), std::string("another file was put")})
    EXPECT_NE(x.why.find(needle), std::string::npos) << needle << " in: " << x.why;
  {
    const SafetensorsSet f(s.index());
    other.refresh("m", f);
  }
  x = other.acquire("m");
  ASSERT_EQ(x.status, PoolStatus::kOk) << x.why;
  EXPECT_EQ(first_float(x.handle.tensor("c").host), 300.0f);
  EXPECT_EQ(first_float(x.handle.tensor("a").host), 1.0f);
  x.handle.release();
  // A shard gone: kChanged naming it.
  ModelPool third(*dev, ModelPoolOptions{int64_t{1} << 20});
  third.add("m", s.index());
  fs::remove(s.dir.file(s.one));
  const PoolAcquire gone = third.acquire("m");
  EXPECT_EQ(gone.status, PoolStatus::kChanged);
  for (const std::string& needle :
       {std::string("model 'm'"), s.dir.file(s.one), std::string("is missing")})
    EXPECT_NE(gone.why.find(needle), std::string::npos) << needle << " in: " << gone.why;
}

}  // namespace
}  // namespace spillway

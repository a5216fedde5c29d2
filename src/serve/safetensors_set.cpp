// A checkpoint as one set of safetensors files (spillway/serve/serve.hpp, Note [Sharded
// checkpoints]): a single file, or a Hugging Face index and its shards. Every shard is opened
// and checked, and the index checked against what the shards hold, before the object exists:
// a caller never sees a set whose index and shards disagree.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <system_error>

#include "core/json_keys.hpp"
#include "spillway/core/error.hpp"
#include "spillway/serve/serve.hpp"

namespace spillway {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kIndexSuffix = ".index.json";

bool is_index(const std::string& path) {
  return path.size() >= kIndexSuffix.size() &&
         path.compare(path.size() - kIndexSuffix.size(), kIndexSuffix.size(), kIndexSuffix) == 0;
}

struct Index {
  std::map<std::string, std::string> weight_map;  // tensor: shard file name
  std::set<std::string> shards;                   // the file names, sorted
};

// The index at `path`, read and checked (not yet against its shards).
Index read_index(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    SPILLWAY_INPUT_ERROR("{}: cannot open: {}", path, std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    SPILLWAY_INPUT_ERROR("{}: is {}, not a safetensors index", path,
                         S_ISDIR(st.st_mode) ? "a directory" : "not a regular file");
  if (st.st_size > kSafetensorsMaxHeaderBytes)
    SPILLWAY_INPUT_ERROR("{}: the index is {} bytes; the limit is {}", path, st.st_size,
                         kSafetensorsMaxHeaderBytes);
  std::ifstream in(path, std::ios::binary);
  if (!in) SPILLWAY_INPUT_ERROR("{}: cannot open: {}", path, std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    SPILLWAY_INPUT_ERROR(
        "{}: is not a JSON object (a safetensors index: {{\"weight_map\": {{tensor: shard "
        "file}}}})",
        path);
  refuse_duplicate_keys(ss.str(), fmt::format("{}: the index", path), "");
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    SPILLWAY_INPUT_ERROR("{}: has no \"weight_map\" object (tensor: shard file)", path);
  Index out;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string())
      SPILLWAY_INPUT_ERROR("{}: weight_map[\"{}\"] is {}; must be a shard's file name", path,
                           it.key(), it.value().dump());
    const std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos)
      SPILLWAY_INPUT_ERROR(
          "{}: weight_map[\"{}\"] is \"{}\"; a shard must be a file name in the index's "
          "directory (no '/', '.' or '..')",
          path, it.key(), shard);
    out.weight_map.emplace(it.key(), shard);
    out.shards.insert(shard);
  }
  if (out.weight_map.empty()) SPILLWAY_INPUT_ERROR("{}: weight_map is empty", path);
  return out;
}

fs::path dir_of(const std::string& index) {
  const fs::path d = fs::path(index).parent_path();
  return d.empty() ? fs::path(".") : d;
}

}  // namespace

SafetensorsSet::SafetensorsSet(const std::string& path) : path_(path), sharded_(is_index(path)) {
  if (!sharded_) {
    shards_.push_back(std::make_unique<SafetensorsFile>(path));
    paths_.push_back(path);
    stamps_.push_back(shards_.front()->stamp());
    tensors_ = shards_.front()->tensors();
  } else {
    // The index's stamp before it is read: one replaced meanwhile is found changed later.
    paths_.push_back(path);
    stamps_.push_back(file_stamp(path));
    const Index idx = read_index(path);
    const fs::path dir = dir_of(path);
    std::map<std::string, int> shard_of;  // file name: index in shards_
    for (const std::string& name : idx.shards) {
      const fs::path p = dir / name;
      std::error_code ec;
      if (!fs::exists(fs::symlink_status(p, ec))) {
        const auto first = std::find_if(idx.weight_map.begin(), idx.weight_map.end(),
                                        [&](const auto& kv) { return kv.second == name; });
        SPILLWAY_INPUT_ERROR("{}: shard {} is missing (weight_map maps tensor '{}' to it)", path,
                             p.string(), first->first);
      }
      shard_of[name] = static_cast<int>(shards_.size());
      shards_.push_back(std::make_unique<SafetensorsFile>(p.string()));
      paths_.push_back(p.string());
      stamps_.push_back(shards_.back()->stamp());
    }
    for (const auto& [tensor, shard] : idx.weight_map)
      if (shards_[static_cast<size_t>(shard_of[shard])]->find(tensor) == nullptr)
        SPILLWAY_INPUT_ERROR("{}: weight_map maps tensor '{}' to shard {}, which does not hold it",
                             path, tensor, shard);
    for (const auto& [name, i] : shard_of) {
      for (SafetensorsTensor t : shards_[static_cast<size_t>(i)]->tensors()) {
        const auto it = idx.weight_map.find(t.name);
        if (it == idx.weight_map.end())
          SPILLWAY_INPUT_ERROR("{}: shard {} holds tensor '{}', which weight_map does not list",
                               path, name, t.name);
        if (it->second != name)
          SPILLWAY_INPUT_ERROR(
              "{}: tensor '{}' is in shard {} and in shard {} (weight_map names {}); a tensor "
              "must be in one shard",
              path, t.name, it->second, name, it->second);
      }
    }
    // A shard of a save (model-NNNNN-of-NNNNN.safetensors) beside the shards that the index
    // does not name: a shard of another save, half replaced; which is the model is not for us
    // to guess. Other safetensors files are not the checkpoint and are not read, as
    // transformers does not read them (Mistral's repositories ship consolidated.safetensors,
    // the original format, beside the Hugging Face shards).
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
      const std::string name = it->path().filename().string();
      const bool shard_name = name.starts_with("model-") && name.find("-of-") != std::string::npos;
      if (shard_name && name.ends_with(".safetensors") && idx.shards.count(name) == 0 &&
          it->is_regular_file(ec))
        SPILLWAY_INPUT_ERROR(
            "{}: {} is a safetensors file the index does not name (a shard of another save?); "
            "remove it or name it in weight_map",
            path, it->path().string());
    }
    if (ec) SPILLWAY_INPUT_ERROR("{}: cannot list {}: {}", path, dir.string(), ec.message());
    for (size_t i = 0; i < shards_.size(); ++i)
      for (SafetensorsTensor t : shards_[i]->tensors()) {
        t.shard = static_cast<int>(i);
        tensors_.push_back(std::move(t));
      }
  }
  for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace_back(tensors_[i].name, i);
  std::sort(by_name_.begin(), by_name_.end());
}

SafetensorsSet::~SafetensorsSet() = default;

const SafetensorsTensor* SafetensorsSet::find(const std::string& name) const {
  const auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                                   [](const auto& e, const std::string& n) { return e.first < n; });
  return it != by_name_.end() && it->first == name ? &tensors_[it->second] : nullptr;
}

const std::string& SafetensorsSet::file_of(const SafetensorsTensor& t) const {
  return shards_.at(static_cast<size_t>(t.shard))->path();
}

void SafetensorsSet::read(const SafetensorsTensor& t, std::byte* dst) const {
  shards_.at(static_cast<size_t>(t.shard))->read(t, dst);
}

int64_t SafetensorsSet::data_bytes() const {
  int64_t n = 0;
  for (const auto& f : shards_) n += f->data_bytes();
  return n;
}

std::vector<FileStamp> SafetensorsSet::stamps_now(const std::string& path) {
  std::vector<FileStamp> out{file_stamp(path)};
  if (!is_index(path)) return out;
  try {
    const Index idx = read_index(path);
    for (const std::string& name : idx.shards)
      out.push_back(file_stamp((dir_of(path) / name).string()));
  } catch (const Error&) {
    // Unreadable: its own stamp says when to look again.
  }
  return out;
}

}  // namespace spillway

// Model directories (Note [Model directories] in spillway/server.hpp): finding them,
// checking a checkpoint against its config, and writing the reference model's.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/embedded_data.hpp"
#include "spillway/device_math.hpp"
#include "spillway/error.hpp"
#include "spillway/serve.hpp"
#include "spillway/server.hpp"

namespace spillway::server {

namespace fs = std::filesystem;

std::vector<ModelFiles> find_models(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    SPILLWAY_INPUT_ERROR(
        "--models: '{}' is not a directory (one subdirectory per model, each "
        "with config.json and model.safetensors)",
        dir);
  std::vector<ModelFiles> out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    if (!e.is_directory()) continue;
    const fs::path config = e.path() / "config.json";
    if (!fs::exists(config)) continue;
    const fs::path weights = e.path() / "model.safetensors";
    if (!fs::exists(weights))
      SPILLWAY_INPUT_ERROR("model directory '{}' has a config.json but no model.safetensors",
                           e.path().string());
    out.push_back(
        {e.path().filename().string(), e.path().string(), config.string(), weights.string()});
  }
  if (out.empty())
    SPILLWAY_INPUT_ERROR(
        "--models: '{}' holds no model (a subdirectory with config.json and "
        "model.safetensors; `spillway checkpoint` writes one)",
        dir);
  std::sort(out.begin(), out.end(),
            [](const ModelFiles& a, const ModelFiles& b) { return a.name < b.name; });
  return out;
}

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// Writes `bytes` to path through a temporary renamed into place.
void write_file(const fs::path& path, const std::string& bytes) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.flush();
    if (!f) {
      std::error_code ec;
      fs::remove(tmp, ec);
      SPILLWAY_INPUT_ERROR("cannot write {}", path.string());
    }
  }
  fs::rename(tmp, path);
}

}  // namespace

std::vector<std::vector<std::string>> resolve_checkpoint(const std::string& model,
                                                         const nn::RefConfig& c,
                                                         const SafetensorsFile& f) {
  const std::string& path = f.path();
  std::vector<std::vector<std::string>> parts;
  std::set<std::string> used;
  DType first = DType::kFp32;
  bool any = false;
  auto take = [&](const std::string& name, const std::vector<int64_t>& shape) {
    const SafetensorsTensor* t = f.find(name);
    if (t->shape != shape)
      SPILLWAY_INPUT_ERROR("model {}: tensor {} in {} has shape {}; its config.json needs {}",
                           model, name, path, shape_text(t->shape), shape_text(shape));
    if (any && t->dtype != first)
      SPILLWAY_INPUT_ERROR("model {}: tensor {} is {} and others {}; one dtype per checkpoint",
                           model, name, to_string(t->dtype), to_string(first));
    first = t->dtype;
    any = true;
    used.insert(name);
  };
  const std::string qkv = "self_attn.qkv_proj.weight";
  const int64_t d = c.hidden, hd = c.head_dim;
  for (const nn::WeightSpec& s : nn::weight_specs(c)) {
    if (f.find(s.name) != nullptr) {
      take(s.name, s.shape);
      parts.push_back({s.name});
      continue;
    }
    // Note [Checkpoint resolution]: q, k and v as Hugging Face stores them.
    if (s.name.size() > qkv.size() &&
        s.name.compare(s.name.size() - qkv.size(), qkv.size(), qkv) == 0) {
      const std::string p = s.name.substr(0, s.name.size() - qkv.size()) + "self_attn.";
      const std::string q = p + "q_proj.weight", k = p + "k_proj.weight", v = p + "v_proj.weight";
      if (f.find(q) != nullptr && f.find(k) != nullptr && f.find(v) != nullptr) {
        take(q, {c.heads * hd, d});
        take(k, {c.kv_heads * hd, d});
        take(v, {c.kv_heads * hd, d});
        parts.push_back({q, k, v});
        continue;
      }
      SPILLWAY_INPUT_ERROR(
          "model {}: {} has neither {} (shape {}) nor {}q_proj, k_proj and "
          "v_proj that its config.json needs",
          model, path, s.name, shape_text(s.shape), p);
    }
    if (s.name == "lm_head.weight" && c.model.tied_embeddings &&
        f.find("model.embed_tokens.weight") != nullptr) {
      parts.push_back({"model.embed_tokens.weight"});  // tied: taken as the embedding
      continue;
    }
    SPILLWAY_INPUT_ERROR("model {}: {} has no tensor {} (shape {}) that its config.json needs",
                         model, path, s.name, shape_text(s.shape));
  }
  // Every tensor is read: one the reference model has no use for (q/k norms, biases, ...)
  // would be ignored, and the served model would not be the checkpoint's.
  for (const SafetensorsTensor& t : f.tensors()) {
    static const std::string inv_freq = "rotary_emb.inv_freq";  // RoPE's, recomputed
    if (used.count(t.name) != 0 ||
        (t.name.size() >= inv_freq.size() &&
         t.name.compare(t.name.size() - inv_freq.size(), inv_freq.size(), inv_freq) == 0))
      continue;
    SPILLWAY_INPUT_ERROR(
        "model {}: {} holds tensor {}, which the reference model has no use "
        "for (it runs no q/k norms, biases or shared experts): served, the "
        "model would not be the checkpoint's",
        model, path, t.name);
  }
  return parts;
}

void check_checkpoint(const std::string& model, const nn::RefConfig& c,
                      const std::string& weights_path) {
  const SafetensorsFile f(weights_path);  // Note [Safetensors checks]
  (void)resolve_checkpoint(model, c, f);
}

void check_servable_config(const std::string& model, const std::string& config_text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(config_text);
  } catch (const nlohmann::json::exception& e) {
    SPILLWAY_INPUT_ERROR("model {}: config.json is not JSON ({})", model, e.what());
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
    SPILLWAY_INPUT_ERROR(
        "model {}: config.json has rope_scaling {}; the reference model's RoPE "
        "is unscaled, so the served model would not be the checkpoint's",
        model, j["rope_scaling"].dump());
  for (const char* flag : {"attention_bias", "mlp_bias"})
    if (j.contains(flag) && j[flag].is_boolean() && j[flag].get<bool>())
      SPILLWAY_INPUT_ERROR(
          "model {}: config.json has {} true; the reference model runs no "
          "biases",
          model, flag);
}

void write_checkpoint(const std::string& config_name_or_path, uint64_t seed, const std::string& dir,
                      DType dtype) {
  if (dtype != DType::kFp32 && dtype != DType::kBf16)
    SPILLWAY_FIELD_ERROR("dtype", to_string(dtype), "must be fp32 or bf16");
  std::string text;
  if (const EmbeddedFile* e = find_embedded("nn", config_name_or_path + ".json")) {
    text = e->text;
  } else {
    std::ifstream in(config_name_or_path, std::ios::binary);
    if (!in)
      SPILLWAY_INPUT_ERROR(
          "--config: '{}' is neither an embedded reference model (tiny-moe, "
          "small-moe) nor a readable config.json",
          config_name_or_path);
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  const nn::RefConfig c = nn::load_reference_config(config_name_or_path);
  int64_t params = 0;
  for (const nn::WeightSpec& s : nn::weight_specs(c)) params += s.elements();
  // The model's own initialization: its parameters, gradients and moments on a host device.
  auto dev = make_host_device(HostDeviceOptions{params * 16 + (int64_t{1} << 20), 0.0, 0.0});
  nn::Model m(c, *dev, seed);
  std::vector<SafetensorsEntry> entries;
  for (const nn::NamedWeight& w : m.named_weights()) {
    SafetensorsEntry e;
    e.name = w.spec.name;
    e.dtype = dtype;
    e.shape = w.spec.shape;
    const auto n = static_cast<size_t>(w.spec.elements());
    if (dtype == DType::kFp32) {
      e.bytes.resize(n * 4);
      std::memcpy(e.bytes.data(), w.data, n * 4);
    } else {
      e.bytes.resize(n * 2);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t b = float_to_bf16(w.data[i]);
        std::memcpy(e.bytes.data() + i * 2, &b, 2);
      }
    }
    entries.push_back(std::move(e));
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) SPILLWAY_INPUT_ERROR("--out: cannot create directory '{}': {}", dir, ec.message());
  const fs::path weights = fs::path(dir) / "model.safetensors";
  const fs::path tmp = weights.string() + ".tmp";
  write_safetensors(tmp.string(), entries);
  fs::rename(tmp, weights);
  write_file(fs::path(dir) / "config.json", text);
}

}  // namespace spillway::server

// Model directories (Note [Model directories] in spillway/inference/inference.hpp): finding them,
// checking a checkpoint against its config, and writing the reference model's.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/embedded_data.hpp"
#include "core/json_keys.hpp"
#include "spillway/core/error.hpp"
#include "spillway/device/device_math.hpp"
#include "spillway/inference/inference.hpp"
#include "spillway/serve/serve.hpp"

namespace spillway::inference {

namespace fs = std::filesystem;

ModelScan scan_models(const std::string& dir) {
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    SPILLWAY_INPUT_ERROR("--models: cannot read '{}': {}", dir, ec.message());
  if (!fs::is_directory(st))
    SPILLWAY_INPUT_ERROR(
        "--models: '{}' is not a directory (one subdirectory per model, each "
        "with config.json and model.safetensors)",
        dir);
  // Every filesystem call with an error code: an unreadable entry is named with the OS's
  // reason, never a bare filesystem_error.
  auto unreadable = [](const fs::path& p, const std::error_code& e) {
    SPILLWAY_INPUT_ERROR("--models: cannot read '{}': {}", p.string(), e.message());
  };
  ModelScan out;
  fs::directory_iterator it(dir, ec);
  if (ec) unreadable(dir, ec);
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) unreadable(dir, ec);
    const fs::directory_entry& e = *it;
    if (!e.is_directory(ec)) continue;
    const std::string name = e.path().filename().string();
    const std::string where = e.path().string();
    auto refuse = [&](std::string why) { out.refused.push_back({name, where, std::move(why)}); };
    auto what = [](const fs::file_status& s) {
      return fs::is_directory(s) ? "a directory" : "not a regular file";
    };
    const fs::path config = e.path() / "config.json";
    const fs::file_status cs = fs::status(config, ec);
    if (ec && ec != std::errc::no_such_file_or_directory) {
      refuse(fmt::format("cannot read '{}': {}", config.string(), ec.message()));
      continue;
    }
    if (!fs::exists(cs)) continue;
    if (!fs::is_regular_file(cs)) {
      refuse(fmt::format("model directory '{}': config.json is {}, not a file", where, what(cs)));
      continue;
    }
    // Note [Sharded checkpoints] (spillway/serve/serve.hpp): one file, or an index and its shards.
    const fs::path single = e.path() / "model.safetensors";
    const fs::path index = e.path() / "model.safetensors.index.json";
    fs::file_status ss = fs::status(single, ec);
    if (ec && ec != std::errc::no_such_file_or_directory) {
      refuse(fmt::format("cannot read '{}': {}", single.string(), ec.message()));
      continue;
    }
    fs::file_status is = fs::status(index, ec);
    if (ec && ec != std::errc::no_such_file_or_directory) {
      refuse(fmt::format("cannot read '{}': {}", index.string(), ec.message()));
      continue;
    }
    if (fs::exists(ss) && fs::exists(is)) {
      refuse(fmt::format(
          "model directory '{}' has both model.safetensors and model.safetensors.index.json: "
          "which one is the model is ambiguous; remove one",
          where));
      continue;
    }
    if (!fs::exists(ss) && !fs::exists(is)) {
      refuse(
          fmt::format("model directory '{}' has a config.json but no model.safetensors (nor "
                      "model.safetensors.index.json)",
                      where));
      continue;
    }
    const fs::path weights = fs::exists(ss) ? single : index;
    const fs::file_status ws = fs::exists(ss) ? ss : is;
    if (!fs::is_regular_file(ws)) {
      refuse(fmt::format("model directory '{}': {} is {}, not a file", where,
                         weights.filename().string(), what(ws)));
      continue;
    }
    out.models.push_back({name, where, config.string(), weights.string()});
  }
  if (ec) unreadable(dir, ec);
  std::sort(out.models.begin(), out.models.end(),
            [](const ModelFiles& a, const ModelFiles& b) { return a.name < b.name; });
  std::sort(out.refused.begin(), out.refused.end(),
            [](const RefusedModel& a, const RefusedModel& b) { return a.name < b.name; });
  return out;
}

std::vector<ModelFiles> find_models(const std::string& dir) {
  ModelScan scan = scan_models(dir);
  if (!scan.refused.empty()) SPILLWAY_INPUT_ERROR("{}", scan.refused.front().why);
  if (scan.models.empty())
    SPILLWAY_INPUT_ERROR(
        "--models: '{}' holds no model (a subdirectory with config.json and "
        "model.safetensors; `spillway checkpoint` writes one)",
        dir);
  return std::move(scan.models);
}

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// Writes `bytes` to `path` (a temporary of write_checkpoint's, renamed by it): every write
// and the close checked, an error naming the path and the system's reason.
void write_file(const fs::path& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) SPILLWAY_INPUT_ERROR("cannot write '{}': {}", path.string(), std::strerror(errno));
  int err = 0;
  for (size_t at = 0; at < bytes.size() && err == 0;) {
    const ssize_t n = ::write(fd, bytes.data() + at, bytes.size() - at);
    if (n < 0) {
      if (errno != EINTR) err = errno;
    } else {
      at += static_cast<size_t>(n);
    }
  }
  if (::close(fd) != 0 && err == 0 && errno != EINTR) err = errno;
  if (err != 0) SPILLWAY_INPUT_ERROR("cannot write '{}': {}", path.string(), std::strerror(err));
}

// Renames `from` over `to`, an error naming `to` and the system's reason.
void rename_file(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    SPILLWAY_INPUT_ERROR("cannot write '{}': {}", to.string(), std::strerror(errno));
}

// This machine's memory (0: unknown).
double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

}  // namespace

namespace {

template <typename Checkpoint>  // SafetensorsFile or SafetensorsSet
bool has_qk_norms(const nn::RefConfig& c, const Checkpoint& f) {
  for (int l = 0; l < c.layers(); ++l) {
    const LayerSpec& s = c.model.layers[static_cast<size_t>(l)];
    if (s.mixer != MixerKind::kAttention) continue;
    return s.attn.qk_norm &&
           f.find(fmt::format("model.layers.{}.self_attn.q_norm.weight", l)) != nullptr;
  }
  return false;
}

// Mixtral's name of an MoE weight of weight_specs (its router and experts under
// block_sparse_moe, the experts' gate, down and up projections as w1, w2 and w3); "" for
// another weight.
std::string mixtral_name(const std::string& name) {
  static constexpr std::string_view kMlp = ".mlp.";
  const size_t at = name.find(kMlp);
  if (at == std::string::npos) return {};
  std::string rest = name.substr(at + kMlp.size());
  if (rest != "gate.weight" && rest.rfind("experts.", 0) != 0) return {};
  for (const auto& [ours, theirs] :
       {std::pair<std::string_view, std::string_view>{".gate_proj.", ".w1."},
        {".down_proj.", ".w2."},
        {".up_proj.", ".w3."}}) {
    if (const size_t p = rest.find(ours); p != std::string::npos)
      rest.replace(p, ours.size(), theirs);
  }
  return name.substr(0, at) + ".block_sparse_moe." + rest;
}

// transformers 5's fused experts (Note [Checkpoint resolution]): for an expert's projection
// of weight_specs ("P.mlp.experts.E.gate_proj.weight", up_proj, down_proj), the fused
// tensor's name ("P.mlp.experts.gate_up_proj" or "P.mlp.experts.down_proj"), the expert and
// whether it is the up projection; {} for another weight.
struct FusedExpert {
  std::string tensor;
  int64_t expert = -1;
  bool up = false, down = false;
};
FusedExpert fused_expert(const std::string& name) {
  static constexpr std::string_view kExperts = "mlp.experts.";
  const size_t at = name.find(kExperts);
  if (at == std::string::npos) return {};
  const std::string rest = name.substr(at + kExperts.size());  // E.gate_proj.weight
  const size_t dot = rest.find('.');
  if (dot == std::string::npos || dot == 0 || rest.find_first_not_of("0123456789") != dot)
    return {};
  const std::string proj = rest.substr(dot + 1);
  FusedExpert f;
  f.expert = std::stoll(rest.substr(0, dot));
  const std::string p = name.substr(0, at + kExperts.size());
  if (proj == "gate_proj.weight" || proj == "up_proj.weight") {
    f.tensor = p + "gate_up_proj";
    f.up = proj[0] == 'u';
  } else if (proj == "down_proj.weight") {
    f.tensor = p + "down_proj";
    f.down = true;
  } else {
    return {};
  }
  return f;
}

template <typename Checkpoint>  // SafetensorsFile or SafetensorsSet
ResolvedWeights resolve(const std::string& model, const nn::RefConfig& c, const Checkpoint& f) {
  const std::string& path = f.path();
  ResolvedWeights parts;
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
  const int64_t d = c.hidden, hd = c.head_dim;
  for (const nn::WeightSpec& s : nn::weight_specs(c)) {
    if (f.find(s.name) != nullptr) {
      take(s.name, s.shape);
      parts.push_back({s.name});
      continue;
    }
    // Note [Checkpoint resolution]: the MoE under Mixtral's names.
    if (const std::string alt = mixtral_name(s.name); !alt.empty() && f.find(alt) != nullptr) {
      take(alt, s.shape);
      parts.push_back({alt});
      continue;
    }
    // An expert as rows of transformers 5's fused experts.
    if (const FusedExpert fe = fused_expert(s.name);
        !fe.tensor.empty() && f.find(fe.tensor) != nullptr) {
      // (ffn, hidden) or (hidden, ffn): the expert's rows of the fused (experts, ...) tensor.
      const int64_t rows = s.shape[0], width = s.shape[1];
      int layer = -1;
      (void)std::sscanf(s.name.c_str(), "model.layers.%d.", &layer);
      SPILLWAY_CHECK(layer >= 0 && layer < c.layers(), "resolve: no layer in {}", s.name);
      const int64_t experts = c.model.layers[static_cast<size_t>(layer)].mlp.experts;
      take(fe.tensor, {experts, fe.down ? rows : 2 * rows, width});
      const int64_t per = fe.down ? rows : 2 * rows;
      parts.push_back({{fe.tensor, fe.expert * per + (fe.up ? rows : 0), rows}});
      continue;
    }
    // q, k and v (weights, and biases when the attention has them) as Hugging Face stores
    // them.
    static constexpr std::string_view kFused = "self_attn.qkv_proj.";
    const size_t at = s.name.find(kFused);
    if (at != std::string::npos) {
      const std::string p = s.name.substr(0, at) + "self_attn.";
      const std::string kind = s.name.substr(at + kFused.size());  // weight or bias
      const bool bias = kind == "bias";
      const auto part = [&](const char* proj) { return fmt::format("{}{}.{}", p, proj, kind); };
      const std::string q = part("q_proj"), k = part("k_proj"), v = part("v_proj");
      auto shape = [&](int64_t heads) {
        return bias ? std::vector<int64_t>{heads * hd} : std::vector<int64_t>{heads * hd, d};
      };
      if (f.find(q) != nullptr && f.find(k) != nullptr && f.find(v) != nullptr) {
        take(q, shape(c.heads));
        take(k, shape(c.kv_heads));
        take(v, shape(c.kv_heads));
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
      parts.push_back({WeightPart{"model.embed_tokens.weight"}});  // tied: taken as the embedding
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
        "model {}: {} holds tensor {}, which the reference model has no use for with this "
        "config.json (it runs q/k norms only where the config's family has them, and no MLP "
        "biases or shared experts): served, the model would not be the checkpoint's",
        model, path, t.name);
  }
  return parts;
}

}  // namespace

bool checkpoint_has_qk_norms(const nn::RefConfig& c, const SafetensorsSet& f) {
  return has_qk_norms(c, f);
}
bool checkpoint_has_qk_norms(const nn::RefConfig& c, const SafetensorsFile& f) {
  return has_qk_norms(c, f);
}
ResolvedWeights resolve_checkpoint(const std::string& model, const nn::RefConfig& c,
                                   const SafetensorsSet& f) {
  return resolve(model, c, f);
}
ResolvedWeights resolve_checkpoint(const std::string& model, const nn::RefConfig& c,
                                   const SafetensorsFile& f) {
  return resolve(model, c, f);
}

void check_checkpoint(const std::string& model, const nn::RefConfig& c,
                      const std::string& weights_path) {
  const SafetensorsSet f(weights_path);  // Note [Safetensors checks], [Sharded checkpoints]
  nn::RefConfig served = c;
  served.qk_norm = checkpoint_has_qk_norms(c, f);
  (void)resolve_checkpoint(model, served, f);
}

void check_servable_config(const std::string& model, const std::string& config_text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(config_text);
  } catch (const nlohmann::json::exception& e) {
    SPILLWAY_INPUT_ERROR("model {}: config.json is not JSON ({})", model, e.what());
  }
  refuse_duplicate_keys(config_text, fmt::format("model {}: config.json", model), "");
  // RoPE's scaling is read (and an unserved type refused) with the config: Note [RoPE
  // scaling] in spillway/nn/nn.hpp.
  // Attention biases are served (Note [Served attention extras] in spillway/nn/nn.hpp).
  // Quantized checkpoints (FP8, AWQ, GPTQ, bitsandbytes, ...): their weights need their
  // method's dequantization, which the decoder does not run.
  if (j.contains("quantization_config") && !j["quantization_config"].is_null()) {
    const nlohmann::json& q = j["quantization_config"];
    const std::string method =
        q.is_object() && q.contains("quant_method") && q["quant_method"].is_string()
            ? q["quant_method"].get<std::string>()
            : q.dump();
    SPILLWAY_INPUT_ERROR(
        "model {}: config.json has a quantization_config (quant_method \"{}\"); the decoder "
        "serves unquantized F32 and BF16 checkpoints only",
        model, method);
  }
  if (j.contains("mlp_bias") && j["mlp_bias"].is_boolean() && j["mlp_bias"].get<bool>())
    SPILLWAY_INPUT_ERROR(
        "model {}: config.json has mlp_bias true; the reference model runs no MLP biases", model);
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
  // The model's own initialization: its parameters, gradients and moments on a host device
  // (the emulated arena), 16 bytes a parameter. Refused up front when this machine has not
  // that much memory: the arena might be granted (overcommitted) and the process killed
  // when the initialization touches it.
  const double arena_bytes =
      static_cast<double>(params) * 16.0 + static_cast<double>(int64_t{1} << 20);
  const double memory = physical_memory_bytes();
  const auto too_large = [&](const std::string& why) {
    SPILLWAY_INPUT_ERROR(
        "--config: '{}' has {:.3g} parameters ({:.2f} GB of weights in {}); writing its "
        "checkpoint initializes the reference model in an emulated device arena of {:.2f} GB "
        "(16 bytes a parameter: weights, gradients, AdamW moments), {}; choose a smaller "
        "--config (fewer num_hidden_layers, hidden_size, intermediate_size or num_experts)",
        config_name_or_path, static_cast<double>(params),
        static_cast<double>(params) * (dtype == DType::kFp32 ? 4.0 : 2.0) / 1e9, to_string(dtype),
        arena_bytes / 1e9, why);
  };
  if (memory > 0.0 && arena_bytes > memory)
    too_large(fmt::format("more than this machine's {:.2f} GB of memory", memory / 1e9));
  std::unique_ptr<Device> dev;
  try {
    dev = make_host_device(HostDeviceOptions{static_cast<int64_t>(arena_bytes), 0.0, 0.0});
  } catch (const Error& e) {
    too_large(fmt::format("which this machine could not reserve ({})", e.what()));
  }
  nn::Model m(c, *dev, seed);
  // Note [Written checkpoints]: the tensors as transformers names and loads them for the
  // config's architecture, so that its from_pretrained finds no key missing or unexpected:
  // attention's fused q, k, v written as q_proj, k_proj and v_proj (its rows in that order);
  // a tied LM head not written (transformers ties it to the embedding; the server reads it
  // as the embedding); the rest under weight_specs' names (q/k norms where the family has
  // them, python/tests/test_checkpoint_hf.py).
  std::vector<SafetensorsEntry> entries;
  const auto add = [&](std::string name, std::vector<int64_t> shape, const float* data) {
    SafetensorsEntry e;
    e.name = std::move(name);
    e.dtype = dtype;
    e.shape = std::move(shape);
    size_t n = 1;
    for (const int64_t x : e.shape) n *= static_cast<size_t>(x);
    if (dtype == DType::kFp32) {
      e.bytes.resize(n * 4);
      std::memcpy(e.bytes.data(), data, n * 4);
    } else {
      e.bytes.resize(n * 2);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t b = float_to_bf16(data[i]);
        std::memcpy(e.bytes.data() + i * 2, &b, 2);
      }
    }
    entries.push_back(std::move(e));
  };
  static constexpr std::string_view kFused = "self_attn.qkv_proj.weight";
  for (const nn::NamedWeight& w : m.named_weights()) {
    if (w.spec.name == "lm_head.weight" && c.model.tied_embeddings) continue;
    const size_t at = w.spec.name.find(kFused);
    if (at == std::string::npos) {
      add(w.spec.name, w.spec.shape, w.data);
      continue;
    }
    const std::string p = w.spec.name.substr(0, at) + "self_attn.";
    const int64_t d = c.hidden;
    int64_t row = 0;
    for (const auto& [proj, heads] :
         {std::pair{"q_proj", c.heads}, {"k_proj", c.kv_heads}, {"v_proj", c.kv_heads}}) {
      const int64_t rows = int64_t{heads} * c.head_dim;
      add(p + proj + ".weight", {rows, d}, w.data + row * d);
      row += rows;
    }
  }
  // Both files to temporaries in the directory, then renamed over the old ones: on any
  // failure the temporaries are removed (and the directory, when this call created it and
  // it is empty), so no half-written checkpoint is left to be served.
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) SPILLWAY_INPUT_ERROR("--out: cannot create directory '{}': {}", dir, ec.message());
  const fs::path weights = fs::path(dir) / "model.safetensors";
  const fs::path config = fs::path(dir) / "config.json";
  const std::string tag = fmt::format(".{}.tmp", ::getpid());
  const fs::path weights_tmp = fs::path(dir) / (".model.safetensors" + tag);
  const fs::path config_tmp = fs::path(dir) / (".config.json" + tag);
  try {
    write_safetensors(weights_tmp.string(), entries);
    write_file(config_tmp, text);
    rename_file(weights_tmp, weights);
    rename_file(config_tmp, config);
  } catch (const Error& e) {
    fs::remove(weights_tmp, ec);
    fs::remove(config_tmp, ec);
    if (!existed) fs::remove(dir, ec);  // only when empty
    SPILLWAY_INPUT_ERROR("--out: the checkpoint in '{}' was not written: {}", dir, e.what());
  }
}

}  // namespace spillway::inference

// Note [Model text] (spillway/inference/inference.hpp): a model directory's tokenizer, chat
// template and end-of-sequence tokens, read once at start.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/json_keys.hpp"
#include "spillway/core/error.hpp"
#include "spillway/inference/inference.hpp"

namespace spillway::inference {

namespace {

namespace fs = std::filesystem;

bool read_file(const fs::path& p, std::string* out) {
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return false;
  std::ifstream in(p, std::ios::binary);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

// A token string of tokenizer_config.json: "..." or {"content": "..."}.
std::string token_string(const nlohmann::json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string())
    return j["content"].get<std::string>();
  return {};
}

}  // namespace

ModelText read_model_text(const std::string& dir) {
  ModelText t;
  const fs::path d(dir);
  std::string text;
  if (!read_file(d / "tokenizer.json", &text)) {
    t.unavailable = "no tokenizer.json: token ids only";
    t.chat_unavailable = t.unavailable;
    return t;
  }
  try {
    t.tokenizer = std::make_unique<text::Tokenizer>(
        text::Tokenizer::from_json(text, (d / "tokenizer.json").string()));
  } catch (const Error& e) {
    t.unavailable = e.what();
    t.chat_unavailable = t.unavailable;
    return t;
  }
  nlohmann::json cfg = nlohmann::json::object();
  std::string cfg_text;
  // A key written twice is refused, not read as its last value (Note [Duplicate keys]): it
  // would pick the template, the special tokens or the EOS ids the model stops at.
  if (read_file(d / "tokenizer_config.json", &cfg_text)) {
    cfg = nlohmann::json::parse(cfg_text, nullptr, false);
    if (cfg.is_discarded() || !cfg.is_object()) {
      t.chat_unavailable = "tokenizer_config.json is not a JSON object";
      cfg = nlohmann::json::object();
    } else {
      refuse_duplicate_keys(cfg_text, "tokenizer_config.json",
                            (d / "tokenizer_config.json").string());
    }
  }
  if (cfg.contains("bos_token")) t.bos_token = token_string(cfg["bos_token"]);
  if (cfg.contains("eos_token")) t.eos_token = token_string(cfg["eos_token"]);
  // The chat template: chat_template.jinja (transformers' newer layout), or the config's.
  std::string source;
  if (!read_file(d / "chat_template.jinja", &source) && cfg.contains("chat_template")) {
    const nlohmann::json& c = cfg["chat_template"];
    if (c.is_string()) {
      source = c.get<std::string>();
    } else if (c.is_array()) {  // named templates: the default one
      for (const nlohmann::json& e : c)
        if (e.is_object() && e.value("name", std::string()) == "default" && e.contains("template"))
          source = e["template"].get<std::string>();
    }
  }
  if (source.empty()) {
    if (t.chat_unavailable.empty()) t.chat_unavailable = "no chat template in the directory";
  } else {
    try {
      t.chat = std::make_unique<text::ChatTemplate>(source, (d / "chat_template").string());
    } catch (const Error& e) {
      t.chat_unavailable = e.what();
    }
  }
  // EOS ids: generation_config.json's, else the EOS string's.
  std::string gen_text;
  if (read_file(d / "generation_config.json", &gen_text)) {
    const nlohmann::json g = nlohmann::json::parse(gen_text, nullptr, false);
    if (!g.is_discarded())
      refuse_duplicate_keys(gen_text, "generation_config.json",
                            (d / "generation_config.json").string());
    if (g.is_object() && g.contains("eos_token_id")) {
      const nlohmann::json& e = g["eos_token_id"];
      for (const nlohmann::json& v : e.is_array() ? e : nlohmann::json::array({e}))
        if (v.is_number_integer()) t.eos.push_back(v.get<int32_t>());
    }
  }
  if (t.eos.empty() && !t.eos_token.empty()) {
    const int32_t id = t.tokenizer->token_to_id(t.eos_token);
    if (id >= 0) t.eos.push_back(id);
  }
  if (t.eos.size() > 16) t.eos.resize(16);
  return t;
}

}  // namespace spillway::inference

// `spillway tokenize`: a model's tokenizer (tokenizer.json) from the command line: encode a
// text, decode ids, run a JSON-lines batch of both (what python/tests/test_tokenizer.py
// compares with the `tokenizers` package), or time the encoding of a file. `spillway
// chat-template`: a chat template rendered for JSON-lines contexts (what
// python/tests/test_chat_template.py compares with transformers' apply_chat_template).
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.hpp"
#include "core/json_keys.hpp"
#include "spillway/core/error.hpp"
#include "spillway/text/chat_template.hpp"
#include "spillway/text/tokenizer.hpp"

namespace spillway::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string read_text(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) SPILLWAY_INPUT_ERROR("{}: cannot read '{}'", flag, path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Each non-empty line of --jsonl `path` ('-': stdin), parsed as JSON (ordered: a chat
// template shows its keys in order), with its line number; a line not JSON is an error.
void for_each_json_line(const std::string& path,
                        const std::function<void(const nlohmann::ordered_json&, size_t)>& fn) {
  std::ifstream file;
  if (path != "-") {
    file.open(path, std::ios::binary);
    if (!file) SPILLWAY_INPUT_ERROR("--jsonl: cannot read '{}'", path);
  }
  std::istream& in = path == "-" ? std::cin : file;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    nlohmann::ordered_json j;
    try {
      j = nlohmann::ordered_json::parse(line);
    } catch (const nlohmann::ordered_json::exception& e) {
      SPILLWAY_INPUT_ERROR("--jsonl: line {} is not JSON ({})", n, e.what());
    }
    refuse_duplicate_keys(line, fmt::format("--jsonl: line {}", n), "");
    fn(j, n);
  }
}

// A tokenizer.json, or a model directory holding one.
text::Tokenizer load(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path file = fs::path(path) / "tokenizer.json";
    if (!fs::exists(file, ec))
      SPILLWAY_INPUT_ERROR("--tokenizer: the directory '{}' holds no tokenizer.json", path);
    return text::Tokenizer::from_file(file.string());
  }
  return text::Tokenizer::from_file(path);
}

// One JSON line: {"text": s[, "add_special_tokens": b]} gives {"ids": [...]};
// {"ids": [...][, "skip_special_tokens": b]} gives {"text": s, "stream": [pieces]}.
json run_line(const text::Tokenizer& t, const nlohmann::ordered_json& in, size_t line) {
  if (in.contains("text") && in["text"].is_string())
    return {{"ids", t.encode(in["text"].get<std::string>(), in.value("add_special_tokens", true))}};
  if (in.contains("ids") && in["ids"].is_array()) {
    std::vector<int32_t> ids;
    for (const auto& v : in["ids"]) {
      if (!v.is_number_integer())
        SPILLWAY_INPUT_ERROR("--jsonl: line {}: \"ids\" holds {}, not a token id", line, v.dump());
      ids.push_back(v.get<int32_t>());
    }
    const bool skip = in.value("skip_special_tokens", false);
    json pieces = json::array();
    text::StreamDecoder s(t, skip);
    for (int32_t id : ids) pieces.push_back(s.push(id));
    pieces.push_back(s.finish());
    return {{"text", t.decode(ids, skip)}, {"stream", pieces}};
  }
  SPILLWAY_INPUT_ERROR("--jsonl: line {}: an object with \"text\" or \"ids\", not {}", line,
                       in.dump());
}

}  // namespace

void add_tokenize_command(CLI::App& app) {
  overview_line("tokenize", Group::kTools,
                "a model's tokenizer (tokenizer.json) from the command line");
  struct State {
    std::string tokenizer, text, jsonl, bench;
    bool no_special = false;
    int repeat = 3;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize",
      "A model's tokenizer (its tokenizer.json, Hugging Face's format) from the command line: "
      "the ids of --text, a JSON-lines batch (--jsonl: each line {\"text\": ...} gives its "
      "ids, {\"ids\": [...]} its text and the pieces a stream sends), or the encoding speed "
      "over a file (--bench). Byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece-style "
      "BPE with byte fallback (Llama 2, Mistral, Gemma); what a file uses beyond them is "
      "refused, named.\n\n"
      "Examples:\n"
      "  spillway tokenize --tokenizer models/qwen3 --text 'Hello, world'\n"
      "  spillway tokenize --tokenizer tokenizer.json --jsonl batch.jsonl\n"
      "  spillway tokenize --tokenizer tokenizer.json --bench corpus.txt");
  cmd->add_option("--tokenizer", st->tokenizer,
                  "A tokenizer.json, or a model directory holding one")
      ->required();
  auto* text = cmd->add_option("--text", st->text, "Encode this text: prints its ids (JSON)");
  auto* jsonl = cmd->add_option("--jsonl", st->jsonl,
                                "A file of JSON lines to encode and decode ('-': stdin); one "
                                "JSON line out per line in");
  auto* bench = cmd->add_option("--bench", st->bench,
                                "Encode this file's text --repeat times; prints tokens/s and "
                                "MB/s (the best run)");
  text->excludes(jsonl)->excludes(bench);
  jsonl->excludes(bench);
  cmd->add_flag("--no-special", st->no_special,
                "Without the post-processor's special tokens (a BOS) for --text and --bench");
  in_range(cmd->add_option("--repeat", st->repeat, "Runs of --bench")->capture_default_str(),
           closed(1, 1000));
  cmd->callback([st, text, jsonl, bench]() {
    const text::Tokenizer t = load(st->tokenizer);
    if (text->count() > 0) {
      std::printf("%s\n", json(t.encode(st->text, !st->no_special)).dump().c_str());
      return;
    }
    if (jsonl->count() > 0) {
      for_each_json_line(st->jsonl, [&](const nlohmann::ordered_json& j, size_t n) {
        std::printf("%s\n",
                    run_line(t, j, n).dump(-1, ' ', false, json::error_handler_t::replace).c_str());
      });
      return;
    }
    if (bench->count() > 0) {
      const std::string corpus = read_text(st->bench, "--bench");
      double best = 1e300, first = 0;
      size_t tokens = 0;
      for (int r = 0; r < st->repeat; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        tokens = t.encode(corpus, !st->no_special).size();
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, s);
        if (r == 0) first = s;
      }
      // The first run starts with an empty cache of words; the best has it warm.
      std::printf(
          "{\"bytes\": %zu, \"tokens\": %zu, \"seconds\": %.6f, \"tokens_per_s\": %.0f, "
          "\"first_tokens_per_s\": %.0f, \"mb_per_s\": %.3f}\n",
          corpus.size(), tokens, best, static_cast<double>(tokens) / best,
          static_cast<double>(tokens) / first, static_cast<double>(corpus.size()) / best / 1e6);
      return;
    }
    SPILLWAY_INPUT_ERROR("tokenize: give --text, --jsonl or --bench");
  });
}

void add_chat_template_command(CLI::App& app) {
  overview_line("chat-template", Group::kTools,
                "a model's chat template rendered as transformers renders it");
  struct State {
    std::string file, jsonl;
  };
  auto st = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "chat-template",
      "A model's chat template (a .jinja file, or the chat_template of a tokenizer_config.json) "
      "rendered as transformers' apply_chat_template renders it, for each JSON line of --jsonl "
      "(a context: {\"messages\": [...], \"add_generation_prompt\": true, \"bos_token\": ...}): "
      "one line out, {\"text\": ...} or {\"error\": ...} (the template's raise_exception, or "
      "what went wrong). A template using Jinja beyond what chat templates use is refused, "
      "naming the construct and its line.\n\n"
      "Examples:\n"
      "  echo '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
      "\"add_generation_prompt\": true}' | spillway chat-template --template "
      "tokenizer_config.json --jsonl -");
  cmd->add_option("--template", st->file, "A .jinja file, or a tokenizer_config.json")->required();
  cmd->add_option("--jsonl", st->jsonl, "Contexts, one JSON object a line ('-': stdin)")
      ->required();
  cmd->callback([st]() {
    std::string source = read_text(st->file, "--template");
    if (st->file.size() >= 5 && st->file.compare(st->file.size() - 5, 5, ".json") == 0) {
      const json cfg = json::parse(source, nullptr, false);
      if (!cfg.is_discarded()) refuse_duplicate_keys(source, "--template", st->file);
      if (!cfg.is_object() || !cfg.contains("chat_template") || !cfg["chat_template"].is_string())
        SPILLWAY_INPUT_ERROR("--template: '{}' has no \"chat_template\" string", st->file);
      source = cfg["chat_template"].get<std::string>();
    }
    const text::ChatTemplate tmpl(source, st->file);
    for_each_json_line(st->jsonl, [&](const nlohmann::ordered_json& ctx, size_t) {
      json out;
      try {
        out = {{"text", tmpl.render(ctx)}};
      } catch (const Error& e) {
        out = {{"error", e.what()}};
      }
      std::printf("%s\n", out.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
    });
  });
}

}  // namespace spillway::cli

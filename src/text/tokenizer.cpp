// Note [Tokenizer pipeline]: encoding as the `tokenizers` package does it
// (tokenizer/mod.rs, added_vocabulary.rs):
//   1. added tokens: the text is split on the added tokens matched as written
//      ("normalized": false), leftmost, longest first; lstrip/rstrip take the whitespace
//      beside a match into it, single_word matches only a whole word;
//   2. each remaining piece is normalized, then split on the added tokens matched after
//      normalization ("normalized": true);
//   3. each remaining piece is pre-tokenized into words (a piece knows whether it starts
//      the text: Metaspace's "first" prepends only there), each word split by the model;
//   4. with add_special_tokens, the post-processor's template (Llama's BOS).
// Decoding maps ids to tokens (added tokens by content), drops special ones when asked and
// runs the decoder chain over the token strings; without a decoder the tokens are joined
// with spaces. Components: normalizers NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace,
// Strip, Sequence; pre-tokenizers ByteLevel, Split, Metaspace, Digits, Punctuation,
// WhitespaceSplit, Sequence; the BPE model (bpe.cpp); post-processors TemplateProcessing,
// ByteLevel, Sequence; decoders ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence.
// Anything else is refused at load, naming its type and where it is in the file.
#include "spillway/text/tokenizer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/json_keys.hpp"
#include "spillway/core/error.hpp"
#include "text/bpe.hpp"
#include "text/tokenizer_impl.hpp"
#include "text/unicode.hpp"

namespace spillway::text {

using namespace detail;  // the components (tokenizer_impl.hpp)

namespace {

// ---- added tokens --------------------------------------------------------------------

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = false;
};

// A byte trie of added tokens' contents: the longest token starting at a position.
class AddedTrie {
 public:
  void add(const std::string& s, int index) {
    int node = 0;
    for (char c : s) {
      auto& next = nodes_[static_cast<size_t>(node)].next;
      const auto it = next.find(c);
      if (it != next.end()) {
        node = it->second;
      } else {
        nodes_.push_back({});
        const int created = static_cast<int>(nodes_.size()) - 1;
        nodes_[static_cast<size_t>(node)].next.emplace(c, created);
        node = created;
      }
    }
    nodes_[static_cast<size_t>(node)].token = index;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The longest token at s[at], as (token index, length); (-1, 0) if none.
  std::pair<int, size_t> longest(std::string_view s, size_t at) const {
    int node = 0;
    std::pair<int, size_t> best{-1, 0};
    for (size_t i = at; i < s.size(); ++i) {
      const auto& next = nodes_[static_cast<size_t>(node)].next;
      const auto it = next.find(s[i]);
      if (it == next.end()) break;
      node = it->second;
      if (nodes_[static_cast<size_t>(node)].token >= 0)
        best = {nodes_[static_cast<size_t>(node)].token, i + 1 - at};
    }
    return best;
  }

 private:
  struct Node {
    std::map<char, int> next;
    int token = -1;
  };
  std::vector<Node> nodes_{Node{}};
};

// A piece of the input: text to tokenize (token < 0) or an added token.
struct Segment {
  std::string text;
  int32_t token = -1;
  bool at_start = false;
};

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  std::vector<AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;
  std::unordered_map<std::string, int32_t> added_by_content;
  AddedTrie raw_trie, normalized_trie;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Bpe> model;
  std::unique_ptr<Decoder> decoder;
  std::vector<int32_t> prefix_ids, suffix_ids;  // the post-processor's single template
  bool byte_fallback_decoder = false;           // a ByteFallback decoder joins <0xXX> runs
  int32_t vocab = 0;

  // Splits `s` on the tokens of `trie` (Note [Tokenizer pipeline], steps 1 and 2).
  void split_added(const Segment& seg, const AddedTrie& trie, std::vector<Segment>& out) const {
    const std::string& s = seg.text;
    size_t piece = 0;  // start of the text not yet emitted
    for (size_t at = 0; at < s.size();) {
      const auto [index, len] = trie.longest(s, at);
      if (index < 0) {
        ++at;
        continue;
      }
      const AddedToken& t = added[static_cast<size_t>(index)];
      size_t b = at, e = at + len;
      if (t.single_word) {
        const bool left_word = b > 0 && word_char_before(s, b);
        const bool right_word = e < s.size() && is_alphanumeric_or_underscore(s, e);
        if (left_word || right_word) {
          ++at;
          continue;
        }
      }
      if (t.lstrip)
        while (b > piece && is_whitespace(static_cast<unsigned char>(s[b - 1]))) --b;
      if (t.rstrip)
        while (e < s.size() && is_whitespace(static_cast<unsigned char>(s[e]))) ++e;
      if (b > piece) out.push_back({s.substr(piece, b - piece), -1, seg.at_start && piece == 0});
      out.push_back({std::string(), t.id, false});
      piece = e;
      at = e;
    }
    if (piece < s.size()) out.push_back({s.substr(piece), -1, seg.at_start && piece == 0});
  }
  static bool is_alphanumeric_or_underscore(std::string_view s, size_t i) {
    const char32_t c = utf8_decode(s, i).first;
    return c == '_' || is_alphanumeric(c);
  }
  static bool word_char_before(std::string_view s, size_t i) {
    size_t p = i - 1;
    while (p > 0 && (static_cast<uint8_t>(s[p]) & 0xC0) == 0x80) --p;
    return is_alphanumeric_or_underscore(s, p);
  }

  void encode_text(const Segment& seg, std::vector<int32_t>& out) const {
    std::vector<Piece> pieces{{seg.text, seg.at_start}};
    if (pre_tokenizer) pre_tokenizer->apply(pieces);
    for (const Piece& p : pieces) model->encode_word(p.text, out);
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) SPILLWAY_INPUT_ERROR("tokenizer: cannot read '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return from_json(ss.str(), path);
}

Tokenizer Tokenizer::from_json(std::string_view text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    SPILLWAY_INPUT_ERROR("tokenizer: not valid JSON ({}) (file: {})", e.what(), source);
  }
  refuse_duplicate_keys(text, "tokenizer", source);
  if (!j.is_object()) refuse(source, "the file", "is not a JSON object");
  auto m = std::make_unique<Impl>();
  m->source = source;
  if (!j.contains("model")) refuse(source, "model", "is missing");
  const std::string model_type = type_of(j["model"], source, "model");
  if (model_type != "BPE")
    refuse(source, "model",
           fmt::format("model type \"{}\" is not supported (BPE is: GPT-2, Llama, Qwen, "
                       "Mistral, Gemma use it)",
                       model_type));
  m->model = std::make_unique<Bpe>(j["model"], source);
  m->vocab = m->model->size();
  for (const char* key : {"truncation", "padding"})
    if (j.contains(key) && !j[key].is_null())
      refuse(source, key, "is set; the server tokenizes whole texts (set it to null)");
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const json& a : j["added_tokens"]) {
      AddedToken t;
      if (!a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
          !a["content"].is_string() || a["content"].get<std::string>().empty())
        refuse(source, "added_tokens", fmt::format("entry {} has no id or content", a.dump()));
      t.id = a["id"].get<int32_t>();
      t.content = a["content"].get<std::string>();
      t.special = a.value("special", false);
      t.lstrip = a.value("lstrip", false);
      t.rstrip = a.value("rstrip", false);
      t.single_word = a.value("single_word", false);
      t.normalized = a.value("normalized", !t.special);
      if (t.id < 0) refuse(source, "added_tokens", fmt::format("id {} is negative", t.id));
      const int index = static_cast<int>(m->added.size());
      (t.normalized && j.contains("normalizer") && !j["normalizer"].is_null() ? m->normalized_trie
                                                                              : m->raw_trie)
          .add(t.content, index);
      m->added_by_id[t.id] = m->added.size();
      m->added_by_content[t.content] = t.id;
      m->vocab = std::max(m->vocab, t.id + 1);
      m->added.push_back(std::move(t));
    }
  }
  if (j.contains("normalizer") && !j["normalizer"].is_null())
    m->normalizer = make_normalizer(j["normalizer"], source, "normalizer");
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null())
    m->pre_tokenizer = make_pre_tokenizer(j["pre_tokenizer"], source, "pre_tokenizer");
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    m->decoder = make_decoder(j["decoder"], source, "decoder");
    m->byte_fallback_decoder = j["decoder"].dump().find("\"ByteFallback\"") != std::string::npos;
  }
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    // TemplateProcessing's "single" (alone or in a Sequence with ByteLevel, whose offsets
    // trimming changes no id).
    const std::function<void(const json&, const std::string&)> post =
        [&](const json& p, const std::string& where) {
          const std::string type = type_of(p, source, where);
          if (type == "ByteLevel") return;
          if (type == "Sequence") {
            const json& list = p.value("processors", json::array());
            for (size_t i = 0; i < list.size(); ++i)
              post(list[i], fmt::format("{}.processors[{}]", where, i));
            return;
          }
          if (type != "TemplateProcessing")
            refuse(source, where, fmt::format("post-processor type \"{}\" is not supported", type));
          bool seen_a = false;
          for (const json& item : p.value("single", json::array())) {
            if (item.contains("Sequence")) {
              seen_a = true;
              continue;
            }
            if (!item.contains("SpecialToken") || !item["SpecialToken"].contains("id"))
              refuse(source, where, fmt::format("template item {} is not understood", item.dump()));
            const std::string name = item["SpecialToken"]["id"].get<std::string>();
            const json& specials = p.value("special_tokens", json::object());
            if (!specials.contains(name) || !specials[name].contains("ids"))
              refuse(source, where, fmt::format("special token \"{}\" has no ids", name));
            for (const json& id : specials[name]["ids"])
              (seen_a ? m->suffix_ids : m->prefix_ids).push_back(id.get<int32_t>());
          }
        };
    post(j["post_processor"], "post_processor");
  }
  return Tokenizer(std::move(m));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& m = *impl_;
  if (!utf8_valid(text)) {
    size_t bad = 0;
    while (bad < text.size() && utf8_valid(text.substr(0, bad + utf8_length(text, bad))))
      bad += utf8_length(text, bad);
    SPILLWAY_INPUT_ERROR("tokenizer: the text is not valid UTF-8 (at byte {})", bad);
  }
  std::vector<int32_t> out(m.prefix_ids.begin(),
                           add_special_tokens ? m.prefix_ids.end() : m.prefix_ids.begin());
  std::vector<Segment> raw;
  m.split_added({std::string(text), -1, true}, m.raw_trie, raw);
  std::vector<Segment> parts;
  for (Segment& s : raw) {
    if (s.token >= 0) {
      out.push_back(s.token);
      continue;
    }
    if (m.normalizer) s.text = m.normalizer->apply(std::move(s.text));
    parts.clear();
    if (m.normalized_trie.empty())
      parts.push_back(std::move(s));
    else
      m.split_added(s, m.normalized_trie, parts);
    for (const Segment& p : parts) {
      if (p.token >= 0)
        out.push_back(p.token);
      else if (!p.text.empty())
        m.encode_text(p, out);
    }
  }
  if (add_special_tokens) out.insert(out.end(), m.suffix_ids.begin(), m.suffix_ids.end());
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& m = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (const auto it = m.added_by_id.find(id); it != m.added_by_id.end()) {
      const AddedToken& t = m.added[it->second];
      if (!(skip_special && t.special)) tokens.push_back(t.content);
      continue;
    }
    // An id that names no token (a model's padded vocabulary rows) is skipped, as the
    // package does.
    if (const std::string* t = m.model->id_to_token(id)) tokens.push_back(*t);
  }
  if (!m.decoder) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  m.decoder->apply(tokens);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

int32_t Tokenizer::vocab_size() const {
  return impl_->vocab;
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = impl_->added_by_content.find(std::string(token));
      it != impl_->added_by_content.end())
    return it->second;
  return impl_->model->token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (const auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end())
    return impl_->added[it->second].content;
  const std::string* t = impl_->model->id_to_token(id);
  return t == nullptr ? std::string() : *t;
}

bool Tokenizer::is_special(int32_t id) const {
  const auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

bool Tokenizer::joins_bytes(int32_t id) const {
  // (an added token's content goes through the decoder too: <0xXX> added tokens join)
  return impl_->byte_fallback_decoder && ByteFallbackDec::byte_of(id_to_token(id)) >= 0;
}

const std::string& Tokenizer::source() const {
  return impl_->source;
}

// Note [Streaming detokenization]: the text of ids_[prefix_, n) minus the text of
// ids_[prefix_, read_) already emitted; when the new text ends in an incomplete
// character (U+FFFD at the end, or a cut sequence), nothing is emitted yet. The window
// moves on once text is emitted, so each push decodes a few tokens, not the whole output.
StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tok_(tokenizer), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  ids_.push_back(id);
  if (tok_.joins_bytes(id)) return {};  // its byte run may still change
  const std::span<const int32_t> all(ids_);
  const std::string before = tok_.decode(all.subspan(prefix_, read_ - prefix_), skip_special_);
  const std::string now = tok_.decode(all.subspan(prefix_), skip_special_);
  const bool incomplete = now.size() >= 3 && now.compare(now.size() - 3, 3, "\xEF\xBF\xBD") == 0;
  if (incomplete || now.size() <= before.size() || now.compare(0, before.size(), before) != 0)
    return {};
  std::string piece = now.substr(before.size());
  prefix_ = read_;
  read_ = ids_.size();
  return piece;
}

std::string StreamDecoder::finish() {
  const std::span<const int32_t> all(ids_);
  const std::string before = tok_.decode(all.subspan(prefix_, read_ - prefix_), skip_special_);
  const std::string now = tok_.decode(all.subspan(prefix_), skip_special_);
  prefix_ = read_ = ids_.size();
  // What follows the text already sent (all of `before`, or as much as the decoder kept).
  size_t same = 0;
  while (same < before.size() && same < now.size() && before[same] == now[same]) ++same;
  if (same < before.size()) {
    while (same > 0 && (static_cast<uint8_t>(now[same]) & 0xC0) == 0x80) --same;
    return now.size() > before.size() ? now.substr(before.size()) : std::string();
  }
  return now.substr(same);
}

}  // namespace spillway::text

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
#include "spillway/tokenizer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "core/json_keys.hpp"
#include "spillway/error.hpp"
#include "text/bpe.hpp"
#include "text/unicode.hpp"

namespace spillway::text {

namespace {

using json = nlohmann::json;

[[noreturn]] void refuse(const std::string& source, const std::string& where,
                         const std::string& what) {
  SPILLWAY_INPUT_ERROR("tokenizer: {}: {} (file: {})", where, what, source);
}

std::string type_of(const json& j, const std::string& source, const std::string& where) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    refuse(source, where, "has no \"type\"");
  return j["type"].get<std::string>();
}

// A pattern of Replace or Split: {"String": s} or {"Regex": r}.
struct Pattern {
  std::string literal;
  std::shared_ptr<Regex> regex;
  Pattern(const json& p, const std::string& source, const std::string& where) {
    if (p.is_object() && p.contains("String") && p["String"].is_string()) {
      literal = p["String"].get<std::string>();
      if (literal.empty()) refuse(source, where, "an empty \"String\" pattern");
    } else if (p.is_object() && p.contains("Regex") && p["Regex"].is_string()) {
      regex = std::make_shared<Regex>(p["Regex"].get<std::string>(), where);
    } else {
      refuse(source, where, fmt::format("pattern {} is neither String nor Regex", p.dump()));
    }
  }
  // (begin, end) of every match.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const {
    if (regex) return regex->find_all(s);
    std::vector<std::pair<size_t, size_t>> out;
    for (size_t at = s.find(literal); at != std::string_view::npos;
         at = s.find(literal, at + literal.size()))
      out.emplace_back(at, at + literal.size());
    return out;
  }
};

std::string replace_all(std::string_view s, const Pattern& p, std::string_view with) {
  std::string out;
  size_t at = 0;
  for (const auto& [b, e] : p.find_all(s)) {
    out.append(s.substr(at, b - at));
    out.append(with);
    at = e;
  }
  out.append(s.substr(at));
  return out;
}

// ---- normalizers ---------------------------------------------------------------------

struct Normalizer {
  virtual ~Normalizer() = default;
  virtual std::string apply(std::string s) const = 0;
};

std::unique_ptr<Normalizer> make_normalizer(const json& j, const std::string& source,
                                            const std::string& where);

struct NormalFormNorm : Normalizer {
  NormalForm form;
  explicit NormalFormNorm(NormalForm f) : form(f) {}
  std::string apply(std::string s) const override { return normalize(s, form); }
};
struct LowercaseNorm : Normalizer {
  std::string apply(std::string s) const override { return lowercase(s); }
};
struct PrependNorm : Normalizer {
  std::string prepend;
  std::string apply(std::string s) const override { return s.empty() ? s : prepend + s; }
};
struct ReplaceNorm : Normalizer {
  Pattern pattern;
  std::string content;
  ReplaceNorm(Pattern p, std::string c) : pattern(std::move(p)), content(std::move(c)) {}
  std::string apply(std::string s) const override { return replace_all(s, pattern, content); }
};
struct StripNorm : Normalizer {
  bool left = true, right = true;
  std::string apply(std::string s) const override {
    size_t b = 0, e = s.size();
    while (left && b < e) {
      const auto [c, n] = utf8_decode(s, b);
      if (!is_whitespace(c)) break;
      b += n;
    }
    while (right && e > b) {
      size_t p = e - 1;
      while (p > b && (static_cast<uint8_t>(s[p]) & 0xC0) == 0x80) --p;
      if (!is_whitespace(utf8_decode(s, p).first)) break;
      e = p;
    }
    return s.substr(b, e - b);
  }
};
struct SequenceNorm : Normalizer {
  std::vector<std::unique_ptr<Normalizer>> steps;
  std::string apply(std::string s) const override {
    for (const auto& n : steps) s = n->apply(std::move(s));
    return s;
  }
};

std::unique_ptr<Normalizer> make_normalizer(const json& j, const std::string& source,
                                            const std::string& where) {
  const std::string type = type_of(j, source, where);
  const std::string here = fmt::format("{} ({})", where, type);
  if (type == "NFC") return std::make_unique<NormalFormNorm>(NormalForm::kNfc);
  if (type == "NFD") return std::make_unique<NormalFormNorm>(NormalForm::kNfd);
  if (type == "NFKC") return std::make_unique<NormalFormNorm>(NormalForm::kNfkc);
  if (type == "NFKD") return std::make_unique<NormalFormNorm>(NormalForm::kNfkd);
  if (type == "Lowercase") return std::make_unique<LowercaseNorm>();
  if (type == "Prepend") {
    auto n = std::make_unique<PrependNorm>();
    n->prepend = j.value("prepend", std::string());
    return n;
  }
  if (type == "Replace")
    return std::make_unique<ReplaceNorm>(Pattern(j.value("pattern", json()), source, here),
                                         j.value("content", std::string()));
  if (type == "Strip") {
    auto n = std::make_unique<StripNorm>();
    n->left = j.value("strip_left", true);
    n->right = j.value("strip_right", true);
    return n;
  }
  if (type == "Sequence") {
    auto n = std::make_unique<SequenceNorm>();
    const json& list = j.value("normalizers", json::array());
    for (size_t i = 0; i < list.size(); ++i)
      n->steps.push_back(
          make_normalizer(list[i], source, fmt::format("{}.normalizers[{}]", where, i)));
    return n;
  }
  refuse(source, where, fmt::format("normalizer type \"{}\" is not supported", type));
}

// ---- pre-tokenizers ------------------------------------------------------------------

struct Piece {
  std::string text;
  bool at_start = false;  // begins at offset 0 of the original text
};

// Splits by the `tokenizers` SplitDelimiterBehavior: matches are the delimiters (invert:
// the pieces).
enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

void split_piece(const Piece& p, const std::vector<std::pair<size_t, size_t>>& matches,
                 Behavior how, bool invert, std::vector<Piece>& out) {
  // (begin, end, is_delimiter) covering the text.
  std::vector<std::tuple<size_t, size_t, bool>> parts;
  size_t at = 0;
  for (const auto& [b, e] : matches) {
    if (b > at) parts.emplace_back(at, b, invert);
    parts.emplace_back(b, e, !invert);
    at = e;
  }
  if (at < p.text.size()) parts.emplace_back(at, p.text.size(), invert);
  std::vector<std::pair<size_t, size_t>> spans;
  bool prev_delim = false;
  for (const auto& [b, e, delim] : parts) {
    switch (how) {
      case Behavior::kRemoved:
        if (!delim) spans.emplace_back(b, e);
        break;
      case Behavior::kIsolated:
        spans.emplace_back(b, e);
        break;
      case Behavior::kMergedWithPrevious:
        if (delim && !spans.empty() && !prev_delim)
          spans.back().second = e;
        else
          spans.emplace_back(b, e);
        break;
      case Behavior::kMergedWithNext:
        if (!delim && !spans.empty() && prev_delim)
          spans.back().second = e;
        else
          spans.emplace_back(b, e);
        break;
      case Behavior::kContiguous:
        if (delim && prev_delim && !spans.empty())
          spans.back().second = e;
        else
          spans.emplace_back(b, e);
        break;
    }
    prev_delim = delim;
  }
  for (const auto& [b, e] : spans)
    if (e > b) out.push_back({p.text.substr(b, e - b), p.at_start && b == 0});
}

struct PreTokenizer {
  virtual ~PreTokenizer() = default;
  virtual void apply(std::vector<Piece>& pieces) const = 0;
};

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const std::string& source,
                                                 const std::string& where);

// GPT-2's pattern, which ByteLevel splits with (use_regex).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct ByteLevelPre : PreTokenizer {
  bool add_prefix_space = false;
  std::unique_ptr<Regex> regex;  // null: use_regex false
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    for (Piece& p : pieces) {
      if (add_prefix_space && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, " ");
      if (regex)
        split_piece(p, regex->find_all(p.text), Behavior::kIsolated, false, out);
      else if (!p.text.empty())
        out.push_back(std::move(p));
    }
    for (Piece& p : out) {
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (char c : p.text) mapped += byte_to_unicode(static_cast<uint8_t>(c));
      p.text = std::move(mapped);
    }
    pieces = std::move(out);
  }
};

struct SplitPre : PreTokenizer {
  std::optional<Pattern> pattern;
  Behavior how = Behavior::kIsolated;
  bool invert = false;
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    for (const Piece& p : pieces) split_piece(p, pattern->find_all(p.text), how, invert, out);
    pieces = std::move(out);
  }
};

struct MetaspacePre : PreTokenizer {
  std::string replacement;
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;
  bool split = true;
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    const Pattern space(json{{"String", " "}}, "", "");
    const Pattern rep(json{{"String", replacement}}, "", "");
    for (Piece& p : pieces) {
      p.text = replace_all(p.text, space, replacement);
      const bool starts = p.text.compare(0, replacement.size(), replacement) == 0;
      if (!starts && (prepend == Prepend::kAlways || (prepend == Prepend::kFirst && p.at_start)))
        p.text.insert(0, replacement);
      if (split)
        split_piece(p, rep.find_all(p.text), Behavior::kMergedWithNext, false, out);
      else if (!p.text.empty())
        out.push_back(std::move(p));
    }
    pieces = std::move(out);
  }
};

struct DigitsPre : PreTokenizer {
  bool individual = false;
  std::unique_ptr<Regex> regex;
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    for (const Piece& p : pieces)
      split_piece(p, regex->find_all(p.text),
                  individual ? Behavior::kIsolated : Behavior::kContiguous, false, out);
    pieces = std::move(out);
  }
};

// Punctuation (the package's: ASCII punctuation and Unicode's P categories), each character
// a delimiter.
struct PunctuationPre : PreTokenizer {
  Behavior how = Behavior::kIsolated;
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    for (const Piece& p : pieces) {
      std::vector<std::pair<size_t, size_t>> marks;
      for (size_t i = 0; i < p.text.size();) {
        const auto [c, n] = utf8_decode(p.text, i);
        if (is_punctuation(c)) marks.emplace_back(i, i + n);
        i += n;
      }
      split_piece(p, marks, how, false, out);
    }
    pieces = std::move(out);
  }
};

struct WhitespaceSplitPre : PreTokenizer {
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    for (const Piece& p : pieces) {
      std::vector<std::pair<size_t, size_t>> ws;
      for (size_t i = 0; i < p.text.size();) {
        const auto [c, n] = utf8_decode(p.text, i);
        if (is_whitespace(c)) {
          if (!ws.empty() && ws.back().second == i)
            ws.back().second = i + n;
          else
            ws.emplace_back(i, i + n);
        }
        i += n;
      }
      split_piece(p, ws, Behavior::kRemoved, false, out);
    }
    pieces = std::move(out);
  }
};

struct SequencePre : PreTokenizer {
  std::vector<std::unique_ptr<PreTokenizer>> steps;
  void apply(std::vector<Piece>& pieces) const override {
    for (const auto& s : steps) s->apply(pieces);
  }
};

Behavior behavior_of(const json& j, const std::string& source, const std::string& where) {
  const std::string b = j.value("behavior", std::string("Isolated"));
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  refuse(source, where, fmt::format("split behavior \"{}\" is not known", b));
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const std::string& source,
                                                 const std::string& where) {
  const std::string type = type_of(j, source, where);
  const std::string here = fmt::format("{} ({})", where, type);
  if (type == "ByteLevel") {
    auto p = std::make_unique<ByteLevelPre>();
    p->add_prefix_space = j.value("add_prefix_space", true);
    if (j.value("use_regex", true)) p->regex = std::make_unique<Regex>(kGpt2Pattern, here);
    return p;
  }
  if (type == "Split") {
    auto p = std::make_unique<SplitPre>();
    p->pattern.emplace(j.value("pattern", json()), source, here);
    p->how = behavior_of(j, source, here);
    p->invert = j.value("invert", false);
    return p;
  }
  if (type == "Metaspace") {
    auto p = std::make_unique<MetaspacePre>();
    p->replacement = j.value("replacement", std::string("\xE2\x96\x81"));
    if (utf8_length(p->replacement, 0) != p->replacement.size())
      refuse(source, here, "\"replacement\" must be one character");
    const std::string scheme = j.contains("prepend_scheme") && j["prepend_scheme"].is_string()
                                   ? j["prepend_scheme"].get<std::string>()
                                   : (j.value("add_prefix_space", true) ? "always" : "never");
    if (scheme == "always")
      p->prepend = MetaspacePre::Prepend::kAlways;
    else if (scheme == "first")
      p->prepend = MetaspacePre::Prepend::kFirst;
    else if (scheme == "never")
      p->prepend = MetaspacePre::Prepend::kNever;
    else
      refuse(source, here, fmt::format("prepend_scheme \"{}\" is not known", scheme));
    p->split = j.value("split", true);
    return p;
  }
  if (type == "Digits") {
    auto p = std::make_unique<DigitsPre>();
    p->individual = j.value("individual_digits", false);
    p->regex = std::make_unique<Regex>(R"(\p{N})", here);
    return p;
  }
  if (type == "WhitespaceSplit") return std::make_unique<WhitespaceSplitPre>();
  if (type == "Punctuation") {
    auto p = std::make_unique<PunctuationPre>();
    p->how = behavior_of(j, source, here);
    return p;
  }
  if (type == "Sequence") {
    auto p = std::make_unique<SequencePre>();
    const json& list = j.value("pretokenizers", json::array());
    for (size_t i = 0; i < list.size(); ++i)
      p->steps.push_back(
          make_pre_tokenizer(list[i], source, fmt::format("{}.pretokenizers[{}]", where, i)));
    return p;
  }
  refuse(source, where, fmt::format("pre-tokenizer type \"{}\" is not supported", type));
}

// ---- decoders ------------------------------------------------------------------------

struct Decoder {
  virtual ~Decoder() = default;
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};

std::unique_ptr<Decoder> make_decoder(const json& j, const std::string& source,
                                      const std::string& where);

struct ByteLevelDec : Decoder {
  void apply(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& t : tokens) {
      // A token all of whose characters are byte stand-ins is those bytes; another is its
      // own UTF-8 (an added token's text).
      std::string mine;
      bool all = true;
      for (size_t i = 0; i < t.size() && all;) {
        const auto [c, n] = utf8_decode(t, i);
        const int b = unicode_to_byte(c);
        all = b >= 0;
        if (all) mine.push_back(static_cast<char>(b));
        i += n;
      }
      bytes += all ? mine : t;
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

struct MetaspaceDec : Decoder {
  std::string replacement;
  bool strip_first = true;  // prepend_scheme other than never
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      for (size_t at = 0; at < t.size();) {
        if (t.compare(at, replacement.size(), replacement) == 0) {
          if (!(i == 0 && strip_first)) out.push_back(' ');
          at += replacement.size();
        } else {
          out.push_back(t[at]);
          ++at;
        }
      }
      tokens[i] = std::move(out);
    }
  }
};

struct ReplaceDec : Decoder {
  Pattern pattern;
  std::string content;
  ReplaceDec(Pattern p, std::string c) : pattern(std::move(p)), content(std::move(c)) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) t = replace_all(t, pattern, content);
  }
};

// <0xXX> tokens as bytes: a run of them that is well-formed UTF-8 is its text, else one
// U+FFFD per byte (the package's ByteFallback).
struct ByteFallbackDec : Decoder {
  static int byte_of(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    int v = 0;
    for (int k = 3; k < 5; ++k) {
      const char c = t[static_cast<size_t>(k)];
      const int d = c >= '0' && c <= '9'   ? c - '0'
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                           : -1;
      if (d < 0) return -1;
      v = v * 16 + d;
    }
    return v;
  }
  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string run;
    size_t run_tokens = 0;
    const auto flush = [&] {
      if (run_tokens == 0) return;
      if (utf8_valid(run)) {
        out.push_back(run);
      } else {
        for (size_t k = 0; k < run_tokens; ++k) out.emplace_back("\xEF\xBF\xBD");
      }
      run.clear();
      run_tokens = 0;
    };
    for (std::string& t : tokens) {
      const int b = byte_of(t);
      if (b >= 0) {
        run.push_back(static_cast<char>(b));
        ++run_tokens;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

struct FuseDec : Decoder {
  void apply(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.clear();
    tokens.push_back(std::move(all));
  }
};

struct StripDec : Decoder {
  std::string content;
  size_t start = 0, stop = 0;
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      size_t b = 0, e = t.size();
      for (size_t k = 0; k < start && t.compare(b, content.size(), content) == 0 && b < e; ++k)
        b += content.size();
      for (size_t k = 0; k < stop && e >= b + content.size() &&
                         t.compare(e - content.size(), content.size(), content) == 0;
           ++k)
        e -= content.size();
      t = t.substr(b, e - b);
    }
  }
};

struct SequenceDec : Decoder {
  std::vector<std::unique_ptr<Decoder>> steps;
  void apply(std::vector<std::string>& tokens) const override {
    for (const auto& s : steps) s->apply(tokens);
  }
};

std::unique_ptr<Decoder> make_decoder(const json& j, const std::string& source,
                                      const std::string& where) {
  const std::string type = type_of(j, source, where);
  const std::string here = fmt::format("{} ({})", where, type);
  if (type == "ByteLevel") return std::make_unique<ByteLevelDec>();
  if (type == "Metaspace") {
    auto d = std::make_unique<MetaspaceDec>();
    d->replacement = j.value("replacement", std::string("\xE2\x96\x81"));
    const std::string scheme = j.contains("prepend_scheme") && j["prepend_scheme"].is_string()
                                   ? j["prepend_scheme"].get<std::string>()
                                   : (j.value("add_prefix_space", true) ? "always" : "never");
    d->strip_first = scheme != "never";
    return d;
  }
  if (type == "Replace")
    return std::make_unique<ReplaceDec>(Pattern(j.value("pattern", json()), source, here),
                                        j.value("content", std::string()));
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDec>();
  if (type == "Fuse") return std::make_unique<FuseDec>();
  if (type == "Strip") {
    auto d = std::make_unique<StripDec>();
    d->content = j.value("content", std::string(" "));
    d->start = j.value("start", size_t{0});
    d->stop = j.value("stop", size_t{0});
    if (d->content.empty()) refuse(source, here, "an empty \"content\"");
    return d;
  }
  if (type == "Sequence") {
    auto d = std::make_unique<SequenceDec>();
    const json& list = j.value("decoders", json::array());
    for (size_t i = 0; i < list.size(); ++i)
      d->steps.push_back(make_decoder(list[i], source, fmt::format("{}.decoders[{}]", where, i)));
    return d;
  }
  refuse(source, where, fmt::format("decoder type \"{}\" is not supported", type));
}

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

// The tokenizer's components (Note [Tokenizer pipeline] in tokenizer.cpp) from their objects
// of a tokenizer.json: normalizers, pre-tokenizers and decoders (the BPE model is bpe.cpp's).
// A type not implemented here is refused, naming it and where it is in the file.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "spillway/core/error.hpp"
#include "text/tokenizer_impl.hpp"
#include "text/unicode.hpp"

namespace spillway::text::detail {

[[noreturn]] void refuse(const std::string& source, const std::string& where,
                         const std::string& what) {
  SPILLWAY_INPUT_ERROR("tokenizer: {}: {} (file: {})", where, what, source);
}

std::string type_of(const json& j, const std::string& source, const std::string& where) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    refuse(source, where, "has no \"type\"");
  return j["type"].get<std::string>();
}

namespace {

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

}  // namespace

// ---- normalizers ---------------------------------------------------------------------

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

int ByteFallbackDec::byte_of(const std::string& t) {
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

void ByteFallbackDec::apply(std::vector<std::string>& tokens) const {
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

namespace {

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

}  // namespace

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

}  // namespace spillway::text::detail

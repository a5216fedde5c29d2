// Note [BPE]: the `tokenizers` package's BPE (models/bpe), for the options real checkpoints
// use. A word starts as its characters, each the vocabulary's id of that character; a
// character the vocabulary lacks becomes its bytes' <0xXX> tokens (byte_fallback) or the
// unknown token (fused with a preceding one under fuse_unk), or is dropped when there is
// none, as the package does. Then, lowest merge rank first (leftmost among equals), an
// adjacent pair with a merge becomes the merged token, until no pair has one: a heap of
// candidate pairs over a linked list of symbols, O(n log n) in the word's length. With
// ignore_merges (Llama 3), a word that is itself a token is that token. Dropout,
// continuing-subword prefixes and end-of-word suffixes are refused at load.
#include "text/bpe.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <queue>

#include "spillway/core/error.hpp"
#include "text/unicode.hpp"

namespace spillway::text {

namespace {

constexpr size_t kCacheWords = 1 << 16;
// Words longer than this are merged every time, never cached (as the package does: a
// SentencePiece-style text without a pre-tokenizer is one word).
constexpr size_t kCacheWordBytes = 256;

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

Bpe::Bpe(const nlohmann::json& m, const std::string& source) {
  const auto refuse = [&](const std::string& what) {
    SPILLWAY_INPUT_ERROR("tokenizer: model: {} (file: {})", what, source);
  };
  if (!m.contains("vocab") || !m["vocab"].is_object()) refuse("\"vocab\" is not an object");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(key) && !m[key].is_null() &&
        !(m[key].is_string() && m[key].get<std::string>().empty()))
      refuse(fmt::format("\"{}\" is {}; not supported (no LLM tokenizer uses it)", key,
                         m[key].dump()));
  if (m.contains("dropout") && m["dropout"].is_number() && m["dropout"].get<double>() > 0)
    refuse(fmt::format("\"dropout\" is {}; encoding would be random", m["dropout"].dump()));
  int32_t max_id = -1;
  for (const auto& [tok, id] : m["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > (1 << 26))
      refuse(fmt::format("vocab[\"{}\"] is {}; ids are integers in [0, 2^26]", tok, id.dump()));
    const auto i = static_cast<int32_t>(id.get<int64_t>());
    vocab_[tok] = i;
    max_id = std::max(max_id, i);
  }
  tokens_.assign(static_cast<size_t>(max_id) + 1, std::string());
  for (const auto& [tok, id] : vocab_) tokens_[static_cast<size_t>(id)] = tok;
  byte_ids_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    const auto it = vocab_.find(fmt::format("<0x{:02X}>", b));
    if (it != vocab_.end()) byte_ids_[static_cast<size_t>(b)] = it->second;
  }
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    const auto it = vocab_.find(m["unk_token"].get<std::string>());
    if (it == vocab_.end())
      refuse(fmt::format("\"unk_token\" {} is not in the vocabulary", m["unk_token"].dump()));
    unk_ = it->second;
  }
  const auto flag = [&](const char* key) {
    return m.contains(key) && m[key].is_boolean() && m[key].get<bool>();
  };
  fuse_unk_ = flag("fuse_unk");
  byte_fallback_ = flag("byte_fallback");
  ignore_merges_ = flag("ignore_merges");
  if (!m.contains("merges") || !m["merges"].is_array()) refuse("\"merges\" is not an array");
  int32_t rank = 0;
  for (const nlohmann::json& mg : m["merges"]) {
    std::string a, b;
    if (mg.is_string()) {  // "a b"
      const std::string s = mg.get<std::string>();
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) refuse(fmt::format("merge {} is not two tokens", mg.dump()));
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
      a = mg[0].get<std::string>();
      b = mg[1].get<std::string>();
    } else {
      refuse(fmt::format("merge {} is neither \"a b\" nor [\"a\", \"b\"]", mg.dump()));
    }
    const auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end())
      refuse(fmt::format("merge {} names a token the vocabulary lacks", mg.dump()));
    merges_.emplace(pair_key(ia->second, ib->second), std::make_pair(rank, iab->second));
    ++rank;
  }
}

int32_t Bpe::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(std::string(token));
  return it == vocab_.end() ? -1 : it->second;
}

const std::string* Bpe::id_to_token(int32_t id) const {
  if (id < 0 || id >= size() || tokens_[static_cast<size_t>(id)].empty()) return nullptr;
  return &tokens_[static_cast<size_t>(id)];
}

void Bpe::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    if (const auto it = vocab_.find(std::string(word)); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() > kCacheWordBytes) {
    merge_word(word, out);
    return;
  }
  std::string key(word);
  {
    std::lock_guard lk(cache_mu_);
    if (const auto it = cache_.find(key); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t at = out.size();
  merge_word(word, out);
  std::lock_guard lk(cache_mu_);
  if (cache_.size() >= kCacheWords) cache_.clear();
  cache_.emplace(std::move(key),
                 std::vector<int32_t>(out.begin() + static_cast<long>(at), out.end()));
}

void Bpe::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> sym;
  bool last_unk = false;
  for (size_t i = 0; i < word.size();) {
    const size_t n = utf8_length(word, i);
    const std::string ch(word.substr(i, n));
    i += n;
    if (const auto it = vocab_.find(ch); it != vocab_.end()) {
      sym.push_back({it->second, 0, 0, true});
      last_unk = false;
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : ch) all = all && byte_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        for (char c : ch) sym.push_back({byte_ids_[static_cast<uint8_t>(c)], 0, 0, true});
        last_unk = false;
        continue;
      }
    }
    if (unk_ < 0) continue;  // no unknown token: the character is dropped, as the package does
    if (!(fuse_unk_ && last_unk)) sym.push_back({unk_, 0, 0, true});
    last_unk = true;
  }
  const int n = static_cast<int>(sym.size());
  for (int i = 0; i < n; ++i) {
    sym[static_cast<size_t>(i)].prev = i - 1;
    sym[static_cast<size_t>(i)].next = i + 1 < n ? i + 1 : -1;
  }
  // (rank, position, merged id): the lowest rank first, the leftmost among equal ranks.
  using Cand = std::tuple<int32_t, int, int32_t>;
  std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
  const auto push = [&](int pos) {
    if (pos < 0) return;
    const Symbol& s = sym[static_cast<size_t>(pos)];
    if (s.next < 0) return;
    const auto it = merges_.find(pair_key(s.id, sym[static_cast<size_t>(s.next)].id));
    if (it != merges_.end()) heap.emplace(it->second.first, pos, it->second.second);
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const auto [rank, pos, merged] = heap.top();
    heap.pop();
    Symbol& s = sym[static_cast<size_t>(pos)];
    if (!s.alive || s.next < 0) continue;
    Symbol& right = sym[static_cast<size_t>(s.next)];
    const auto it = merges_.find(pair_key(s.id, right.id));
    if (it == merges_.end() || it->second.second != merged || it->second.first != rank) continue;
    s.id = merged;
    right.alive = false;
    s.next = right.next;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = pos;
    push(s.prev);
    push(pos);
  }
  for (int i = n > 0 ? 0 : -1; i >= 0; i = sym[static_cast<size_t>(i)].next)
    out.push_back(sym[static_cast<size_t>(i)].id);
}

}  // namespace spillway::text

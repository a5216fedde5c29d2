// The BPE model of a tokenizer.json (Note [BPE] in bpe.cpp): a pre-token's characters
// merged pair by pair in the order of the merges' ranks, as the `tokenizers` package does.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace spillway::text {

class Bpe {
 public:
  // From the tokenizer.json's "model" object (`source` names the file in errors).
  Bpe(const nlohmann::json& model, const std::string& source);

  // Appends the ids of one pre-token (a "word") to `out`. Thread-safe.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  int32_t token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;  // null: not a model token
  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }

 private:
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> tokens_;  // by id ("" for an id the vocabulary skips)
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  int32_t unk_ = -1;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_ids_{};  // <0xXX> tokens (byte fallback), -1 if absent
  // Words already merged (bounded): most of a text's pre-tokens repeat.
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace spillway::text

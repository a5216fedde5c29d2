// A model's own tokenizer, read from its tokenizer.json (Hugging Face's `tokenizers`
// format): encoding text to token ids and decoding them back, identically to the
// `tokenizers` package for the components real checkpoints use (Note [Tokenizer pipeline]
// in src/text/tokenizer.cpp): BPE (byte-level, as GPT-2, Llama 3 and Qwen; or over
// SentencePiece pieces with byte fallback, as Llama 2 and Mistral), the normalizers,
// pre-tokenizers, post-processors and decoders they combine, added and special tokens, and
// streaming detokenization that never emits half a UTF-8 character. A component the file
// names and this reader does not implement is refused at load, naming it and where.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace spillway::text {

class Tokenizer {
 public:
  // From a tokenizer.json's text (`source` names it in errors) or a path to one.
  static Tokenizer from_json(std::string_view json, const std::string& source);
  static Tokenizer from_file(const std::string& path);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The ids of `text` (UTF-8; ill-formed bytes are refused, naming the offset): added and
  // special tokens found in it, the rest normalized, pre-tokenized and split by the model;
  // with add_special_tokens, the post-processor's (a BOS, for Llama). Thread-safe.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // The text of `ids` through the decoder (special tokens left out when skip_special);
  // ill-formed bytes (half a character) become U+FFFD, as the package does. An id that
  // names no token (a model's padded vocabulary rows) is skipped, as the package does.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // Every id (model and added tokens) is below vocab_size().
  int32_t vocab_size() const;
  // -1: not a token.
  int32_t token_to_id(std::string_view token) const;
  // "" for an id that names no token.
  std::string id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  // Whether the decoder joins `id` with the byte tokens next to it (a <0xXX> token under a
  // ByteFallback decoder): a stream holds the text back while one ends it.
  bool joins_bytes(int32_t id) const;
  const std::string& source() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend class StreamDecoder;
};

// Note [Streaming detokenization]: a request's text as its tokens come, each piece the
// difference between the decoded text of a window of recent tokens with and without the
// newest, held back while it ends in an incomplete character or a byte-fallback token (whose
// run a next byte token may turn into U+FFFDs), so a client never receives half of a
// character and the pieces concatenated are decode() of all the tokens (tested against the
// `tokenizers` package, random ids included). Text the decoder would rewrite is never
// retracted: finish() sends what follows the part already sent.
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false);
  // The text `id` completes (possibly empty).
  std::string push(int32_t id);
  // What is still held back at the end (an incomplete character, as U+FFFD).
  std::string finish();

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  size_t prefix_ = 0;  // ids_[prefix_, read_) decoded to text already emitted
  size_t read_ = 0;
};

}  // namespace spillway::text

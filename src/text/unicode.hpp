// UTF-8 and Unicode helpers of the tokenizer (Note [Tokenizer pipeline] in tokenizer.cpp):
// code point iteration, the byte-level alphabet of GPT-2's byte-level BPE, lossy decoding
// as Rust's String::from_utf8_lossy does it (each maximal ill-formed subpart becomes one
// U+FFFD), Unicode normalization (utf8proc) and regular expressions with Unicode classes
// (PCRE2, JIT-compiled when the platform has it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spillway::text {

// The length of the UTF-8 sequence starting at s[i] (1 for a byte that does not start a
// valid sequence); s must be valid UTF-8 for the lengths to be code points.
size_t utf8_length(std::string_view s, size_t i);
// The code point at s[i] (s valid UTF-8 there) and its length.
std::pair<char32_t, size_t> utf8_decode(std::string_view s, size_t i);
void utf8_append(std::string& out, char32_t c);
// Whether `s` is well-formed UTF-8.
bool utf8_valid(std::string_view s);
// `bytes` as text, each maximal ill-formed subpart replaced by U+FFFD (Rust's
// String::from_utf8_lossy, Python's errors="replace").
std::string utf8_lossy(std::string_view bytes);
// The length of the longest prefix of `bytes` that ends on a code point boundary (a partial
// sequence at the end may still be completed by more bytes; an ill-formed one is counted
// as complete: it will become U+FFFD whatever follows).
size_t utf8_complete_prefix(std::string_view bytes);

// GPT-2's byte-level alphabet: byte b as the UTF-8 of its printable stand-in, and back
// (-1: not a stand-in).
const std::string& byte_to_unicode(uint8_t b);
int unicode_to_byte(char32_t c);

// Unicode normalization forms, case mapping and whitespace as Rust's char has them.
enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
std::string normalize(std::string_view s, NormalForm form);
std::string lowercase(std::string_view s);
bool is_whitespace(char32_t c);
bool is_alphanumeric(char32_t c);
// ASCII punctuation or Unicode's P categories (the package's Punctuation pre-tokenizer).
bool is_punctuation(char32_t c);

// A compiled regular expression (PCRE2, UTF and Unicode properties on: \p{L}, \s over
// Unicode), its matches over a subject.
class Regex {
 public:
  // Throws spillway::Error naming `what` and PCRE2's message for a pattern it refuses.
  Regex(std::string_view pattern, const std::string& what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Every non-overlapping match of the pattern in `s`, left to right, as (begin, end) byte
  // offsets (an empty match advances by one code point).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spillway::text

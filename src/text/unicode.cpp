// UTF-8, the byte-level alphabet, normalization and regular expressions (unicode.hpp).
#include "text/unicode.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <array>
#include <cstdlib>

#include "spillway/core/error.hpp"

namespace spillway::text {

namespace {

// The length a lead byte announces (0: not a lead byte), and the range its second byte
// must be in (Unicode's table 3-7 of well-formed sequences).
struct Lead {
  size_t length = 0;
  uint8_t lo = 0x80, hi = 0xBF;
};
Lead lead_of(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {};
}

// The well-formed sequence at s[i]: its length, or 0 with *subpart the length of the
// maximal ill-formed subpart there (>= 1), or 0 with *subpart 0 when the sequence is a
// well-formed prefix cut by the end of s.
size_t sequence_at(std::string_view s, size_t i, size_t* subpart) {
  const auto b = static_cast<uint8_t>(s[i]);
  const Lead l = lead_of(b);
  if (l.length == 1) return 1;
  if (l.length == 0) {
    *subpart = 1;
    return 0;
  }
  for (size_t k = 1; k < l.length; ++k) {
    if (i + k >= s.size()) {
      *subpart = 0;
      return 0;
    }
    const auto c = static_cast<uint8_t>(s[i + k]);
    const uint8_t lo = k == 1 ? l.lo : 0x80, hi = k == 1 ? l.hi : 0xBF;
    if (c < lo || c > hi) {
      *subpart = k;
      return 0;
    }
  }
  return l.length;
}

// GPT-2's bytes_to_unicode: the printable bytes stand for themselves, the others for 256,
// 257, ... in byte order.
struct ByteAlphabet {
  std::array<std::string, 256> to_unicode;
  std::array<int, 324> to_byte{};
  ByteAlphabet() {
    to_byte.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const int c = printable ? b : next++;
      utf8_append(to_unicode[static_cast<size_t>(b)], static_cast<char32_t>(c));
      to_byte[static_cast<size_t>(c)] = b;
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

}  // namespace

size_t utf8_length(std::string_view s, size_t i) {
  size_t subpart = 0;
  const size_t n = sequence_at(s, i, &subpart);
  return n > 0 ? n : 1;
}

std::pair<char32_t, size_t> utf8_decode(std::string_view s, size_t i) {
  const size_t n = utf8_length(s, i);
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (n == 1) return {b0 < 0x80 ? b0 : 0xFFFD, 1};
  char32_t c = b0 & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) c = (c << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  return {c, n};
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

bool utf8_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    size_t subpart = 0;
    const size_t n = sequence_at(s, i, &subpart);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    size_t subpart = 0;
    const size_t n = sequence_at(bytes, i, &subpart);
    if (n > 0) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");                     // U+FFFD
      i += subpart > 0 ? subpart : bytes.size() - i;  // a cut sequence: the rest
    }
  }
  return out;
}

size_t utf8_complete_prefix(std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    size_t subpart = 0;
    const size_t n = sequence_at(bytes, i, &subpart);
    if (n == 0 && subpart == 0) return i;  // a well-formed start cut by the end
    i += n > 0 ? n : subpart;
  }
  return i;
}

const std::string& byte_to_unicode(uint8_t b) {
  return alphabet().to_unicode[b];
}

int unicode_to_byte(char32_t c) {
  return c < 324 ? alphabet().to_byte[c] : -1;
}

std::string normalize(std::string_view s, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    SPILLWAY_INPUT_ERROR("tokenizer: normalization failed: {}", utf8proc_errmsg(n));
  }
  std::string r(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return r;
}

std::string lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto [c, n] = utf8_decode(s, i);
    utf8_append(out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
    i += n;
  }
  return out;
}

bool is_whitespace(char32_t c) {
  // Rust's char::is_whitespace: the White_Space property.
  switch (c) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool is_alphanumeric(char32_t c) {
  const utf8proc_category_t cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  switch (cat) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

bool is_punctuation(char32_t c) {
  if (c < 0x80) {
    return (c >= '!' && c <= '/') || (c >= ':' && c <= '@') || (c >= '[' && c <= '`') ||
           (c >= '{' && c <= '~');
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO:
      return true;
    default:
      return false;
  }
}

struct Regex::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
};

Regex::Regex(std::string_view pattern, const std::string& what) : impl_(std::make_unique<Impl>()) {
  int err = 0;
  PCRE2_SIZE at = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &at, nullptr);
  if (impl_->code == nullptr) {
    std::array<PCRE2_UCHAR, 256> msg{};
    pcre2_get_error_message(err, msg.data(), msg.size());
    SPILLWAY_INPUT_ERROR("tokenizer: {}: the regular expression '{}' is refused at offset {}: {}",
                         what, pattern, at, reinterpret_cast<const char*>(msg.data()));
  }
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() {
  pcre2_code_free(impl_->code);
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> out;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t at = 0;
  while (at <= s.size()) {
    // The subject is checked once by the caller (valid UTF-8): no check per call.
    const int rc =
        impl_->jit
            ? pcre2_jit_match(impl_->code, subject, s.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr)
            : pcre2_match(impl_->code, subject, s.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(md);
      SPILLWAY_INPUT_ERROR("tokenizer: a regular expression failed to match (PCRE2 error {})", rc);
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e > b) {
      out.emplace_back(b, e);
      at = e;
    } else {
      at = b < s.size() ? b + utf8_length(s, b) : s.size() + 1;  // empty: step one code point
    }
  }
  pcre2_match_data_free(md);
  return out;
}

}  // namespace spillway::text

// The chat template engine's lexers (Note [Chat templates] in chat_template.cpp): a
// template into its text, output and block tags, with jinja2's whitespace control
// (lstrip_blocks, trim_blocks, "-" and "+"), and a tag's inside into tokens.
#include <fmt/format.h>

#include <algorithm>

#include "text/chat_template_impl.hpp"
#include "text/unicode.hpp"

namespace spillway::text::jinja {

// ---- lexing --------------------------------------------------------------------------

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

std::vector<Tag> lex_template(std::string_view src, const std::string& name) {
  std::vector<Tag> out;
  size_t at = 0;
  int line = 1;
  // How the previous tag ended: '-' strips the whitespace after it; a block or comment tag
  // (trim_blocks) takes one newline.
  char after = 0;  // 0: nothing to do, '-': strip, 't': trim one newline
  bool line_starting = true;
  for (;;) {
    size_t open = src.find('{', at);
    while (open != std::string_view::npos &&
           (open + 1 >= src.size() ||
            (src[open + 1] != '{' && src[open + 1] != '%' && src[open + 1] != '#')))
      open = open + 1 >= src.size() ? std::string_view::npos : src.find('{', open + 1);
    const size_t text_end = open == std::string_view::npos ? src.size() : open;
    std::string text(src.substr(at, text_end - at));
    line += static_cast<int>(std::count(text.begin(), text.end(), '\n'));
    if (after == '-') {
      size_t k = 0;
      while (k < text.size() && is_space(text[k])) ++k;
      line_starting = k > 0 && text[k - 1] == '\n';
      text.erase(0, k);
    } else if (after == 't' && !text.empty() && text[0] == '\n') {
      text.erase(0, 1);
      line_starting = true;
    } else {
      line_starting = after == 0 && at == 0;
    }
    if (open == std::string_view::npos) {
      if (!text.empty() && text.back() == '\n') text.pop_back();  // keep_trailing_newline off
      if (!text.empty()) out.push_back({Tag::Kind::kText, text, line});
      break;
    }
    const char type = src[open + 1];
    const char sign = open + 2 < src.size() ? src[open + 2] : '\0';
    if (sign == '-') {
      while (!text.empty() && is_space(text.back())) text.pop_back();
    } else if (sign != '+' && type != '{') {
      // lstrip_blocks: a block or comment tag after only whitespace on its line.
      const size_t nl = text.rfind('\n');
      const size_t from = nl == std::string::npos ? 0 : nl + 1;
      bool blank = from < text.size();
      for (size_t k = from; k < text.size() && blank; ++k) blank = is_space(text[k]);
      if (blank && (nl != std::string::npos || line_starting)) text.erase(from);
    }
    if (!text.empty()) out.push_back({Tag::Kind::kText, text, line});
    const size_t inner = open + 2 + (sign == '-' || sign == '+' ? 1 : 0);
    const std::string_view close = type == '{' ? "}}" : type == '%' ? "%}" : "#}";
    // The closing tag, outside string literals (for {{ and {%).
    size_t end = inner;
    char quote = 0;
    for (; end + 1 < src.size(); ++end) {
      const char ch = src[end];
      if (type != '#') {
        if (quote != 0) {
          if (ch == '\\') {
            ++end;
            continue;
          }
          if (ch == quote) quote = 0;
          continue;
        }
        if (ch == '\'' || ch == '"') {
          quote = ch;
          continue;
        }
      }
      if (src.compare(end, 2, close) == 0) break;
    }
    if (end + 1 >= src.size())
      fail(fmt::format("{}: line {}: a tag opened with '{{{}' is not closed", name, line, type));
    size_t content_end = end;
    bool close_strip = false, close_keep = false;
    if (content_end > inner && src[content_end - 1] == '-') {
      close_strip = true;
      --content_end;
    } else if (content_end > inner && src[content_end - 1] == '+') {
      close_keep = true;
      --content_end;
    }
    const std::string content(src.substr(inner, content_end - inner));
    if (type == '{') out.push_back({Tag::Kind::kOutput, content, line});
    if (type == '%') out.push_back({Tag::Kind::kBlock, content, line});
    line += static_cast<int>(std::count(content.begin(), content.end(), '\n'));
    at = end + 2;
    after = close_strip ? '-' : (!close_keep && type != '{') ? 't' : 0;
  }
  return out;
}

// ---- expression lexing ---------------------------------------------------------------

std::vector<Token> lex_expr(const std::string& s, const std::string& where) {
  std::vector<Token> out;
  size_t k = 0;
  while (k < s.size()) {
    const char c = s[k];
    if (is_space(c)) {
      ++k;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = k;
      while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      out.push_back({Token::Kind::kName, s.substr(k, e - k)});
      k = e;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = k;
      bool is_float = false;
      while (e < s.size() && (std::isdigit(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      if (e + 1 < s.size() && s[e] == '.' && std::isdigit(static_cast<unsigned char>(s[e + 1]))) {
        is_float = true;
        ++e;
        while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
      }
      if (e < s.size() && (s[e] == 'e' || s[e] == 'E')) {
        is_float = true;
        ++e;
        if (e < s.size() && (s[e] == '+' || s[e] == '-')) ++e;
        while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
      }
      std::string num = s.substr(k, e - k);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      Token t{is_float ? Token::Kind::kFloat : Token::Kind::kInt, num};
      if (is_float)
        t.f = std::stod(num);
      else
        t.i = std::stoll(num);
      out.push_back(t);
      k = e;
      continue;
    }
    if (c == '\'' || c == '"') {
      std::string v;
      size_t e = k + 1;
      for (; e < s.size() && s[e] != c; ++e) {
        if (s[e] != '\\' || e + 1 >= s.size()) {
          v += s[e];
          continue;
        }
        const char n = s[++e];
        switch (n) {
          case 'n':
            v += '\n';
            break;
          case 't':
            v += '\t';
            break;
          case 'r':
            v += '\r';
            break;
          case '\\':
            v += '\\';
            break;
          case '\'':
            v += '\'';
            break;
          case '"':
            v += '"';
            break;
          case '0':
            v += '\0';
            break;
          case 'u':
          case 'x': {
            const size_t digits = n == 'u' ? 4 : 2;
            if (e + digits >= s.size()) fail(where + ": a bad escape in a string");
            const auto cp = static_cast<char32_t>(std::stoul(s.substr(e + 1, digits), nullptr, 16));
            utf8_append(v, cp);
            e += digits;
            break;
          }
          default:
            v += '\\';
            v += n;
        }
      }
      if (e >= s.size()) fail(where + ": a string is not closed");
      out.push_back({Token::Kind::kString, v});
      k = e + 1;
      continue;
    }
    static const char* const kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                                       "/",  "%",  "~",  "<",  ">",  "(",  ")", "[", "]",
                                       "{",  "}",  ",",  ":",  ".",  "|",  "="};
    bool matched = false;
    for (const char* op : kOps) {
      const size_t n = std::char_traits<char>::length(op);
      if (s.compare(k, n, op) == 0) {
        out.push_back({Token::Kind::kOp, op});
        k += n;
        matched = true;
        break;
      }
    }
    if (!matched) fail(fmt::format("{}: unexpected character '{}'", where, c));
  }
  out.push_back({Token::Kind::kEnd, ""});
  return out;
}

}  // namespace spillway::text::jinja

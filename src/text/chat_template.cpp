// Note [Chat templates]: a Jinja interpreter for the subset chat templates use, with
// transformers' environment (chat_template_utils._compile_jinja_template:
// ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loopcontrols), tojson
// as json.dumps(ensure_ascii=False), raise_exception, strftime_now, namespace).
//
// Lexing follows jinja2's lexer: "{%-"/"{{-"/"{#-" strip the whitespace before the tag,
// "-%}"/"-}}"/"-#}" the whitespace after it; with lstrip_blocks a block or comment tag alone
// on its line after spaces takes them with it; with trim_blocks the newline right after a
// block or comment tag goes; "+" keeps either; one trailing newline of the template goes.
//
// Values are Python's as jinja2 sees them: undefined (printed as "", iterated as empty,
// false, an error when its attribute is taken), None, bool, int, float, str, list, dict
// (insertion-ordered, as the request's JSON), namespace, and callables (macros, globals).
// Printing is Python's str() (True, None, 1.0, ['a'], {'k': 1}); arithmetic, comparison,
// truthiness, `in` and slicing are Python's; a.b reads the attribute (a dict's methods)
// then the key, a[b] the key then the attribute.
//
// Statements: if/elif/else, for (tuple targets, `if` filter, else, loop.*: index, index0,
// revindex, revindex0, first, last, length, previtem, nextitem, cycle), set (a name, a
// namespace attribute, a block), macro (defaults, caller-free), break, continue, generation
// (transformers' marker: rendered as its body). Filters, tests and methods: those listed in
// kFilters / kTests / call_method below. Anything else is refused at parse (a statement, a
// filter or test name unknown) or at render (a method).
#include "spillway/chat_template.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>
#include <set>
#include <unordered_map>
#include <variant>

#include "spillway/error.hpp"
#include "text/unicode.hpp"

namespace spillway::text {

namespace {

// ---- values -------------------------------------------------------------------------

struct Value;
using List = std::vector<Value>;
struct Dict;
struct Callable;

struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;  // also a namespace (ns = true)
  std::shared_ptr<Callable> fn;
  bool ns = false;
  std::string undefined_name;  // for messages

  static Value none() { return make(Kind::kNone); }
  static Value boolean(bool v) {
    Value x = make(Kind::kBool);
    x.b = v;
    return x;
  }
  static Value integer(int64_t v) {
    Value x = make(Kind::kInt);
    x.i = v;
    return x;
  }
  static Value number(double v) {
    Value x = make(Kind::kFloat);
    x.f = v;
    return x;
  }
  static Value string(std::string v) {
    Value x = make(Kind::kString);
    x.s = std::move(v);
    return x;
  }
  static Value of_list(List v) {
    Value x = make(Kind::kList);
    x.list = std::make_shared<List>(std::move(v));
    return x;
  }
  static Value undefined(std::string name) {
    Value x;
    x.undefined_name = std::move(name);
    return x;
  }
  static Value make(Kind k) {
    Value x;
    x.kind = k;
    return x;
  }
  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_number() const {
    return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool;
  }
  double as_double() const {
    return kind == Kind::kFloat ? f : kind == Kind::kInt ? static_cast<double>(i) : (b ? 1 : 0);
  }
  int64_t as_int() const {
    return kind == Kind::kInt ? i : kind == Kind::kBool ? (b ? 1 : 0) : static_cast<int64_t>(f);
  }
};

struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view k) const {
    for (const auto& [key, v] : items)
      if (key == k) return &v;
    return nullptr;
  }
  void set(const std::string& k, Value v) {
    for (auto& [key, old] : items) {
      if (key == k) {
        old = std::move(v);
        return;
      }
    }
    items.emplace_back(k, std::move(v));
  }
};

Value of_dict(Dict d, bool ns = false) {
  Value x = Value::make(Value::Kind::kDict);
  x.dict = std::make_shared<Dict>(std::move(d));
  x.ns = ns;
  return x;
}

[[noreturn]] void fail(const std::string& what) {
  SPILLWAY_INPUT_ERROR("chat template: {}", what);
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float:
      return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& e : j) l.push_back(from_json(e));
      return Value::of_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (const auto& [k, v] : j.items()) d.items.emplace_back(k, from_json(v));
      return of_dict(std::move(d));
    }
    default:
      return Value::none();
  }
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.b;
    case Value::Kind::kInt:
      return v.i != 0;
    case Value::Kind::kFloat:
      return v.f != 0;
    case Value::Kind::kString:
      return !v.s.empty();
    case Value::Kind::kList:
      return !v.list->empty();
    case Value::Kind::kDict:
      return v.ns || !v.dict->items.empty();
    case Value::Kind::kCallable:
      return true;
  }
  return false;
}

// Python's repr of a float.
std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == std::floor(d) && std::fabs(d) < 1e16) return fmt::format("{:.1f}", d);
  std::string s = fmt::format("{}", d);  // shortest round trip
  // Python writes exponents as e+20 / e-05.
  const size_t e = s.find('e');
  if (e != std::string::npos) {
    std::string mant = s.substr(0, e), ex = s.substr(e + 1);
    const char sign = ex[0] == '-' ? '-' : '+';
    if (ex[0] == '-' || ex[0] == '+') ex = ex.substr(1);
    if (ex.size() < 2) ex = "0" + ex;
    s = mant + "e" + sign + ex;
  }
  return s;
}

std::string repr(const Value& v);

std::string str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.b ? "True" : "False";
    case Value::Kind::kInt:
      return std::to_string(v.i);
    case Value::Kind::kFloat:
      return float_repr(v.f);
    case Value::Kind::kString:
      return v.s;
    case Value::Kind::kList:
    case Value::Kind::kDict:
    case Value::Kind::kCallable:
      return repr(v);
  }
  return "";
}

std::string string_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c == q) {
          out += '\\';
          out += c;
        } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) {
          out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  return out + q;
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kString:
      return string_repr(v.s);
    case Value::Kind::kList: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      return out + "]";
    }
    case Value::Kind::kDict: {
      if (v.ns) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (const auto& [k, e] : v.dict->items) {
        out += (first ? "" : ", ") + string_repr(k) + ": " + repr(e);
        first = false;
      }
      return out + "}";
    }
    case Value::Kind::kCallable:
      return "<function>";
    default:
      return str(v);
  }
}

// json.dumps(x, ensure_ascii, indent, separators, sort_keys) as Python writes it.
void to_json(const Value& v, std::string& out, bool ascii, int indent, const std::string& item_sep,
             const std::string& key_sep, bool sort, int depth) {
  const auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent) * static_cast<size_t>(d), ' ');
  };
  switch (v.kind) {
    case Value::Kind::kUndefined:
      fail("tojson: a value is undefined (" + v.undefined_name + ")");
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.b ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.i);
      return;
    case Value::Kind::kFloat:
      out += std::isnan(v.f)   ? "NaN"
             : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity")
                               : float_repr(v.f);
      return;
    case Value::Kind::kString: {
      out += '"';
      for (size_t k = 0; k < v.s.size();) {
        const auto c = static_cast<unsigned char>(v.s[k]);
        switch (c) {
          case '"':
            out += "\\\"";
            ++k;
            continue;
          case '\\':
            out += "\\\\";
            ++k;
            continue;
          case '\n':
            out += "\\n";
            ++k;
            continue;
          case '\r':
            out += "\\r";
            ++k;
            continue;
          case '\t':
            out += "\\t";
            ++k;
            continue;
          case '\b':
            out += "\\b";
            ++k;
            continue;
          case '\f':
            out += "\\f";
            ++k;
            continue;
          default:
            break;
        }
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
          ++k;
        } else if (c < 0x80 || !ascii) {
          const size_t n = utf8_length(v.s, k);
          out.append(v.s, k, n);
          k += n;
        } else {
          const auto [cp, n] = utf8_decode(v.s, k);
          if (cp >= 0x10000) {
            const char32_t u = cp - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (u >> 10), 0xDC00 + (u & 0x3FF));
          } else {
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(cp));
          }
          k += n;
        }
      }
      out += '"';
      return;
    }
    case Value::Kind::kList: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k > 0) out += item_sep;
        newline(depth + 1);
        to_json((*v.list)[k], out, ascii, indent, item_sep, key_sep, sort, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& e : v.dict->items) items.push_back(&e);
      if (sort)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k > 0) out += item_sep;
        newline(depth + 1);
        to_json(Value::string(items[k]->first), out, ascii, indent, item_sep, key_sep, sort,
                depth + 1);
        out += key_sep;
        to_json(items[k]->second, out, ascii, indent, item_sep, key_sep, sort, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    case Value::Kind::kCallable:
      fail("tojson: a function is not JSON");
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::kFloat || b.kind == Value::Kind::kFloat)
      return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.s == b.s;
    case Value::Kind::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::Kind::kDict:
      if (a.dict == b.dict) return true;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->find(k);
        if (o == nullptr || !equal(v, *o)) return false;
      }
      return true;
    default:
      return a.fn == b.fn;
  }
}

// -1, 0, 1; numbers with numbers, strings with strings, lists element-wise.
int compare(const Value& a, const Value& b, const char* op) {
  if (a.is_number() && b.is_number()) {
    const double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.kind == Value::Kind::kString && b.kind == Value::Kind::kString)
    return a.s < b.s ? -1 : a.s > b.s ? 1 : 0;
  if (a.kind == Value::Kind::kList && b.kind == Value::Kind::kList) {
    for (size_t k = 0; k < std::min(a.list->size(), b.list->size()); ++k) {
      const int c = compare((*a.list)[k], (*b.list)[k], op);
      if (c != 0) return c;
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size() ? 1 : 0;
  }
  fail(fmt::format("'{}' is not supported between {} and {}", op, repr(a), repr(b)));
}

// Python's len.
int64_t length(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kString: {
      int64_t n = 0;
      for (size_t k = 0; k < v.s.size(); k += utf8_length(v.s, k)) ++n;
      return n;
    }
    case Value::Kind::kList:
      return static_cast<int64_t>(v.list->size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(v.dict->items.size());
    case Value::Kind::kUndefined:
      return 0;
    default:
      fail(fmt::format("object of type {} has no length", repr(v)));
  }
}

// What a for loop iterates: a list's items, a dict's keys, a string's characters.
List iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kList:
      return *v.list;
    case Value::Kind::kDict: {
      List keys;
      for (const auto& [k, e] : v.dict->items) keys.push_back(Value::string(k));
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (size_t k = 0; k < v.s.size();) {
        const size_t n = utf8_length(v.s, k);
        chars.push_back(Value::string(v.s.substr(k, n)));
        k += n;
      }
      return chars;
    }
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kNone:
      fail("'NoneType' object is not iterable");
    default:
      fail(fmt::format("{} is not iterable", repr(v)));
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Value::Kind::kString:
      if (item.kind != Value::Kind::kString) fail("'in <string>' requires a string");
      return container.s.find(item.s) != std::string::npos;
    case Value::Kind::kList:
      return std::any_of(container.list->begin(), container.list->end(),
                         [&](const Value& e) { return equal(e, item); });
    case Value::Kind::kDict:
      return item.kind == Value::Kind::kString && container.dict->find(item.s) != nullptr;
    case Value::Kind::kUndefined:
      return false;
    default:
      fail(fmt::format("argument of type {} is not iterable", repr(container)));
  }
}

// ---- syntax -------------------------------------------------------------------------

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
struct Arg {
  std::string name;  // "" for positional
  ExprPtr value;
};

struct Expr {
  enum class Kind {
    kLiteral,
    kName,
    kAttr,
    kIndex,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNot,
    kNeg,
    kBinary,
    kAnd,
    kOr,
    kCond,
    kList,
    kDict
  } kind;
  Value literal;
  std::string name;  // kName, kAttr, kFilter, kTest; kBinary: the operator
  ExprPtr a, b, c;   // operands; kSlice: start, stop, step (null if absent) on `a`... see below
  ExprPtr obj;       // kAttr, kIndex, kSlice, kCall, kFilter, kTest
  std::vector<Arg> args;
  std::vector<std::pair<ExprPtr, ExprPtr>> pairs;  // kDict
  bool negated = false;                            // kTest
  int line = 0;
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind {
    kText,
    kOutput,
    kIf,
    kFor,
    kSet,
    kSetBlock,
    kMacro,
    kBreak,
    kContinue,
    kBlock
  } kind;
  std::string text;                                     // kText
  ExprPtr expr;                                         // kOutput, kFor (iterable), kSet value
  std::vector<std::pair<ExprPtr, Body>> branches;       // kIf (cond, body); else: cond null
  std::vector<std::string> targets;                     // kFor targets; kSet: name (and attr)
  ExprPtr filter;                                       // kFor `if`
  Body body, else_body;                                 // kFor, kSetBlock, kMacro, kBlock
  std::vector<std::pair<std::string, ExprPtr>> params;  // kMacro (default or null)
  int line = 0;
};

// ---- lexing --------------------------------------------------------------------------

struct Tag {
  enum class Kind { kText, kOutput, kBlock } kind;
  std::string content;  // text, or the tag's inside
  int line = 0;
};

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

// ---- expression parsing ----------------------------------------------------------------

struct Token {
  enum class Kind { kName, kString, kInt, kFloat, kOp, kEnd } kind;
  std::string text;
  int64_t i = 0;
  double f = 0;
};

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

const std::set<std::string>& known_filters() {
  static const std::set<std::string> f = {
      "abs",        "capitalize", "count",    "d",       "default", "dictsort", "e",
      "escape",     "first",      "float",    "indent",  "int",     "items",    "join",
      "last",       "length",     "list",     "lower",   "map",     "max",      "min",
      "reject",     "rejectattr", "replace",  "reverse", "round",   "safe",     "select",
      "selectattr", "sort",       "string",   "sum",     "title",   "tojson",   "trim",
      "unique",     "upper",      "wordcount"};
  return f;
}
const std::set<std::string>& known_tests() {
  static const std::set<std::string> t = {
      "boolean", "callable", "defined",  "divisibleby", "eq",   "equalto",   "even",
      "false",   "float",    "ge",       "gt",          "in",   "integer",   "iterable",
      "le",      "lower",    "lt",       "mapping",     "ne",   "none",      "number",
      "odd",     "sameas",   "sequence", "string",      "true", "undefined", "upper",
      "==",      "!=",       "<",        ">",           "<=",   ">="};
  return t;
}

class ExprParser {
 public:
  ExprParser(std::vector<Token> toks, std::string where, int line)
      : t_(std::move(toks)), where_(std::move(where)), line_(line) {}

  ExprPtr parse() { return cond(); }
  bool at_end() const { return t_[k_].kind == Token::Kind::kEnd; }
  const Token& peek(size_t ahead = 0) const { return t_[std::min(k_ + ahead, t_.size() - 1)]; }
  bool is_name(const char* n, size_t ahead = 0) const {
    return peek(ahead).kind == Token::Kind::kName && peek(ahead).text == n;
  }
  bool is_op(const char* o) const { return peek().kind == Token::Kind::kOp && peek().text == o; }
  void expect_op(const char* o) {
    if (!is_op(o)) error(fmt::format("expected '{}'", o));
    ++k_;
  }
  std::string name() {
    if (peek().kind != Token::Kind::kName) error("expected a name");
    return t_[k_++].text;
  }
  [[noreturn]] void error(const std::string& what) const {
    fail(fmt::format("{}: line {}: {} near '{}'", where_, line_, what, peek().text));
  }
  ExprPtr make(Expr::Kind k) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line_;
    return e;
  }

  // a if c else b (no else: undefined)
  ExprPtr cond() {
    ExprPtr a = or_expr();
    while (is_name("if")) {
      ++k_;
      ExprPtr c = or_expr();
      ExprPtr b;
      if (is_name("else")) {
        ++k_;
        b = cond();
      }
      auto e = make(Expr::Kind::kCond);
      e->a = std::move(a);
      e->c = std::move(c);
      e->b = std::move(b);
      a = std::move(e);
    }
    return a;
  }
  ExprPtr or_expr() {
    ExprPtr a = and_expr();
    while (is_name("or")) {
      ++k_;
      auto e = make(Expr::Kind::kOr);
      e->a = std::move(a);
      e->b = and_expr();
      a = std::move(e);
    }
    return a;
  }
  ExprPtr and_expr() {
    ExprPtr a = not_expr();
    while (is_name("and")) {
      ++k_;
      auto e = make(Expr::Kind::kAnd);
      e->a = std::move(a);
      e->b = not_expr();
      a = std::move(e);
    }
    return a;
  }
  ExprPtr not_expr() {
    if (is_name("not")) {
      ++k_;
      auto e = make(Expr::Kind::kNot);
      e->a = not_expr();
      return e;
    }
    return compare();
  }
  ExprPtr binary(std::string op, ExprPtr a, ExprPtr b) {
    auto e = make(Expr::Kind::kBinary);
    e->name = std::move(op);
    e->a = std::move(a);
    e->b = std::move(b);
    return e;
  }
  ExprPtr compare() {
    ExprPtr a = add();
    for (;;) {
      const Token& t = peek();
      if (t.kind == Token::Kind::kOp && (t.text == "==" || t.text == "!=" || t.text == "<" ||
                                         t.text == ">" || t.text == "<=" || t.text == ">=")) {
        const std::string op = t_[k_++].text;
        a = binary(op, std::move(a), add());
      } else if (is_name("in")) {
        ++k_;
        a = binary("in", std::move(a), add());
      } else if (is_name("not") && is_name("in", 1)) {
        k_ += 2;
        a = binary("not in", std::move(a), add());
      } else {
        return a;
      }
    }
  }
  ExprPtr add() {
    ExprPtr a = concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = t_[k_++].text;
      a = binary(op, std::move(a), concat());
    }
    return a;
  }
  ExprPtr concat() {
    ExprPtr a = mul();
    while (is_op("~")) {
      ++k_;
      a = binary("~", std::move(a), mul());
    }
    return a;
  }
  ExprPtr mul() {
    ExprPtr a = pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = t_[k_++].text;
      a = binary(op, std::move(a), pow());
    }
    return a;
  }
  ExprPtr pow() {
    ExprPtr a = unary();
    while (is_op("**")) {
      ++k_;
      a = binary("**", std::move(a), unary());
    }
    return a;
  }
  ExprPtr unary() {
    if (is_op("-")) {
      ++k_;
      auto e = make(Expr::Kind::kNeg);
      e->a = unary_plain();
      return filters(std::move(e));
    }
    if (is_op("+")) {
      ++k_;
      return filters(unary_plain());
    }
    return filters(postfix(primary()));
  }
  ExprPtr unary_plain() {
    if (is_op("-")) {
      ++k_;
      auto e = make(Expr::Kind::kNeg);
      e->a = unary_plain();
      return e;
    }
    return postfix(primary());
  }
  void call_args(std::vector<Arg>& args) {
    expect_op("(");
    while (!is_op(")")) {
      Arg a;
      if (peek().kind == Token::Kind::kName && peek(1).kind == Token::Kind::kOp &&
          peek(1).text == "=") {
        a.name = name();
        ++k_;
      }
      a.value = cond();
      args.push_back(std::move(a));
      if (!is_op(")")) expect_op(",");
    }
    ++k_;
  }
  ExprPtr filters(ExprPtr e) {
    for (;;) {
      if (is_op("|")) {
        ++k_;
        auto f = make(Expr::Kind::kFilter);
        f->name = name();
        if (known_filters().count(f->name) == 0)
          error(fmt::format("the filter '{}' is not supported", f->name));
        f->obj = std::move(e);
        if (is_op("(")) call_args(f->args);
        e = std::move(f);
      } else if (is_name("is")) {
        ++k_;
        auto t = make(Expr::Kind::kTest);
        if (is_name("not")) {
          ++k_;
          t->negated = true;
        }
        if (peek().kind == Token::Kind::kName) {
          t->name = name();
        } else if (peek().kind == Token::Kind::kOp) {
          t->name = t_[k_++].text;
        } else {
          error("expected a test name");
        }
        if (known_tests().count(t->name) == 0)
          error(fmt::format("the test '{}' is not supported", t->name));
        t->obj = std::move(e);
        if (is_op("(")) {
          call_args(t->args);
        } else if (peek().kind == Token::Kind::kString || peek().kind == Token::Kind::kInt ||
                   peek().kind == Token::Kind::kFloat ||
                   (peek().kind == Token::Kind::kName && !is_name("and") && !is_name("or") &&
                    !is_name("else") && !is_name("if") && !is_name("in") && !is_name("not"))) {
          Arg a;
          a.value = postfix(primary());
          t->args.push_back(std::move(a));
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }
  ExprPtr postfix(ExprPtr e) {
    for (;;) {
      if (is_op(".")) {
        ++k_;
        auto a = make(Expr::Kind::kAttr);
        if (peek().kind == Token::Kind::kInt) {
          a->name = std::to_string(t_[k_++].i);
        } else {
          a->name = name();
        }
        a->obj = std::move(e);
        e = std::move(a);
      } else if (is_op("[")) {
        ++k_;
        ExprPtr start, stop, step;
        bool slice = false;
        if (!is_op(":")) start = cond();
        if (is_op(":")) {
          slice = true;
          ++k_;
          if (!is_op("]") && !is_op(":")) stop = cond();
          if (is_op(":")) {
            ++k_;
            if (!is_op("]")) step = cond();
          }
        }
        expect_op("]");
        auto x = make(slice ? Expr::Kind::kSlice : Expr::Kind::kIndex);
        x->obj = std::move(e);
        x->a = std::move(start);
        x->b = std::move(stop);
        x->c = std::move(step);
        e = std::move(x);
      } else if (is_op("(")) {
        auto c = make(Expr::Kind::kCall);
        c->obj = std::move(e);
        call_args(c->args);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
  ExprPtr primary() {
    const Token t = peek();
    if (t.kind == Token::Kind::kString) {
      ++k_;
      std::string s = t.text;
      while (peek().kind == Token::Kind::kString) s += t_[k_++].text;  // adjacent literals
      auto e = make(Expr::Kind::kLiteral);
      e->literal = Value::string(s);
      return e;
    }
    if (t.kind == Token::Kind::kInt || t.kind == Token::Kind::kFloat) {
      ++k_;
      auto e = make(Expr::Kind::kLiteral);
      e->literal = t.kind == Token::Kind::kInt ? Value::integer(t.i) : Value::number(t.f);
      return e;
    }
    if (t.kind == Token::Kind::kName) {
      ++k_;
      auto e = make(Expr::Kind::kLiteral);
      if (t.text == "true" || t.text == "True") {
        e->literal = Value::boolean(true);
      } else if (t.text == "false" || t.text == "False") {
        e->literal = Value::boolean(false);
      } else if (t.text == "none" || t.text == "None") {
        e->literal = Value::none();
      } else {
        e->kind = Expr::Kind::kName;
        e->name = t.text;
      }
      return e;
    }
    if (is_op("(")) {
      ++k_;
      ExprPtr first = cond();
      if (is_op(",")) {  // a tuple: a list here
        auto l = make(Expr::Kind::kList);
        l->args.push_back({"", std::move(first)});
        while (is_op(",")) {
          ++k_;
          if (is_op(")")) break;
          l->args.push_back({"", cond()});
        }
        expect_op(")");
        return l;
      }
      expect_op(")");
      return first;
    }
    if (is_op("[")) {
      ++k_;
      auto l = make(Expr::Kind::kList);
      while (!is_op("]")) {
        l->args.push_back({"", cond()});
        if (!is_op("]")) expect_op(",");
      }
      ++k_;
      return l;
    }
    if (is_op("{")) {
      ++k_;
      auto d = make(Expr::Kind::kDict);
      while (!is_op("}")) {
        ExprPtr key = cond();
        expect_op(":");
        d->pairs.emplace_back(std::move(key), cond());
        if (!is_op("}")) expect_op(",");
      }
      ++k_;
      return d;
    }
    error("unexpected token");
  }

  size_t k_ = 0;

 private:
  std::vector<Token> t_;
  std::string where_;
  int line_;
};

// ---- template parsing -----------------------------------------------------------------

class TemplateParser {
 public:
  TemplateParser(std::vector<Tag> tags, std::string name)
      : tags_(std::move(tags)), name_(std::move(name)) {}

  Body parse_all() {
    Body b = body({});
    if (k_ < tags_.size())
      fail(fmt::format("{}: line {}: unexpected '{}'", name_, tags_[k_].line, tags_[k_].content));
    return b;
  }

 private:
  // The statement keyword of block tag k, and a parser over the rest.
  std::string keyword(size_t k) const {
    const std::string& c = tags_[k].content;
    size_t b = 0;
    while (b < c.size() && is_space(c[b])) ++b;
    size_t e = b;
    while (e < c.size() && (std::isalnum(static_cast<unsigned char>(c[e])) || c[e] == '_')) ++e;
    return c.substr(b, e - b);
  }
  ExprParser rest(size_t k) const {
    const std::string& c = tags_[k].content;
    ExprParser p(lex_expr(c, name_), name_, tags_[k].line);
    ++p.k_;  // the keyword
    return p;
  }

  Body body(const std::set<std::string>& until) {
    Body out;
    while (k_ < tags_.size()) {
      const Tag& t = tags_[k_];
      if (t.kind == Tag::Kind::kText) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kText;
        n->text = t.content;
        out.push_back(std::move(n));
        ++k_;
        continue;
      }
      if (t.kind == Tag::Kind::kOutput) {
        ExprParser p(lex_expr(t.content, name_), name_, t.line);
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kOutput;
        n->expr = p.parse();
        if (!p.at_end()) p.error("unexpected token");
        out.push_back(std::move(n));
        ++k_;
        continue;
      }
      const std::string kw = keyword(k_);
      if (until.count(kw) != 0) return out;
      out.push_back(statement(kw));
    }
    if (!until.empty())
      fail(
          fmt::format("{}: the template ends inside a block (expected {})", name_, *until.begin()));
    return out;
  }

  std::unique_ptr<Node> statement(const std::string& kw) {
    const size_t at = k_;
    const int line = tags_[at].line;
    auto n = std::make_unique<Node>();
    n->line = line;
    ExprParser p = rest(at);
    const auto done = [&] {
      if (!p.at_end()) p.error("unexpected token");
    };
    ++k_;
    if (kw == "if") {
      n->kind = Node::Kind::kIf;
      ExprPtr c = p.parse();
      done();
      for (;;) {
        Body b = body({"elif", "else", "endif"});
        n->branches.emplace_back(std::move(c), std::move(b));
        if (k_ >= tags_.size()) fail(fmt::format("{}: line {}: 'if' without 'endif'", name_, line));
        const std::string end = keyword(k_);
        ExprParser q = rest(k_);
        ++k_;
        if (end == "elif") {
          c = q.parse();
          continue;
        }
        if (end == "else") {
          Body e = body({"endif"});
          n->branches.emplace_back(nullptr, std::move(e));
          ++k_;
        }
        break;
      }
      return n;
    }
    if (kw == "for") {
      n->kind = Node::Kind::kFor;
      n->targets.push_back(p.name());
      while (p.is_op(",")) {
        ++p.k_;
        n->targets.push_back(p.name());
      }
      if (!p.is_name("in")) p.error("expected 'in'");
      ++p.k_;
      n->expr = p.or_expr();  // not `cond`: a trailing `if` filters
      if (p.is_name("if")) {
        ++p.k_;
        n->filter = p.parse();
      }
      if (p.is_name("recursive")) p.error("recursive loops are not supported");
      done();
      n->body = body({"else", "endfor"});
      if (k_ >= tags_.size()) fail(fmt::format("{}: line {}: 'for' without 'endfor'", name_, line));
      if (keyword(k_) == "else") {
        ++k_;
        n->else_body = body({"endfor"});
      }
      ++k_;
      return n;
    }
    if (kw == "set") {
      std::string target = p.name();
      if (p.is_op(".")) {
        ++p.k_;
        n->targets = {target, p.name()};
      } else {
        n->targets = {target};
      }
      if (p.is_op("=")) {
        ++p.k_;
        n->kind = Node::Kind::kSet;
        n->expr = p.parse();
        done();
        return n;
      }
      done();
      n->kind = Node::Kind::kSetBlock;
      n->body = body({"endset"});
      ++k_;
      return n;
    }
    if (kw == "macro") {
      n->kind = Node::Kind::kMacro;
      n->targets = {p.name()};
      p.expect_op("(");
      while (!p.is_op(")")) {
        std::string param = p.name();
        ExprPtr def;
        if (p.is_op("=")) {
          ++p.k_;
          def = p.parse();
        }
        n->params.emplace_back(std::move(param), std::move(def));
        if (!p.is_op(")")) p.expect_op(",");
      }
      ++p.k_;
      done();
      n->body = body({"endmacro"});
      ++k_;
      return n;
    }
    if (kw == "break" || kw == "continue") {
      done();
      n->kind = kw == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      return n;
    }
    if (kw == "generation") {  // transformers' assistant-mask marker: its body as is
      done();
      n->kind = Node::Kind::kBlock;
      n->body = body({"endgeneration"});
      ++k_;
      return n;
    }
    fail(fmt::format("{}: line {}: the statement '{}' is not supported", name_, line,
                     kw.empty() ? tags_[at].content : kw));
  }

  std::vector<Tag> tags_;
  std::string name_;
  size_t k_ = 0;
};

// ---- rendering ----------------------------------------------------------------------

struct Callable {
  std::function<Value(std::vector<Value>&, std::vector<std::pair<std::string, Value>>&)> call;
};

Value callable(
    std::function<Value(std::vector<Value>&, std::vector<std::pair<std::string, Value>>&)> f) {
  Value v = Value::make(Value::Kind::kCallable);
  v.fn = std::make_shared<Callable>(Callable{std::move(f)});
  return v;
}

struct LoopControl {
  enum class Kind { kNone, kBreak, kContinue } kind = Kind::kNone;
};

std::string strip_chars(const std::string& s, const std::string* chars, bool left, bool right) {
  const auto drop = [&](size_t at) {
    const auto [c, n] = utf8_decode(s, at);
    if (chars == nullptr) return std::make_pair(is_whitespace(c), n);
    return std::make_pair(chars->find(s.substr(at, n)) != std::string::npos, n);
  };
  size_t b = 0, e = s.size();
  while (left && b < e) {
    const auto [d, n] = drop(b);
    if (!d) break;
    b += n;
  }
  while (right && e > b) {
    size_t p = e - 1;
    while (p > b && (static_cast<uint8_t>(s[p]) & 0xC0) == 0x80) --p;
    if (!drop(p).first) break;
    e = p;
  }
  return s.substr(b, e - b);
}

class Renderer {
 public:
  Renderer(const std::string& name) : name_(name) {}

  std::vector<std::unordered_map<std::string, Value>> scopes;

  Value lookup(const std::string& n) const {
    for (auto it = scopes.rbegin(); it != scopes.rend(); ++it) {
      const auto f = it->find(n);
      if (f != it->end()) return f->second;
    }
    return Value::undefined(n);
  }
  void assign(const std::string& n, Value v) { scopes.back()[n] = std::move(v); }

  [[noreturn]] void error(const Expr& e, const std::string& what) const {
    fail(fmt::format("{}: line {}: {}", name_, e.line, what));
  }

  Value attr(const Value& obj, const std::string& n, const Expr& e) {
    if (obj.kind == Value::Kind::kDict) {
      if (!obj.ns && is_dict_method(n)) return method(obj, n);
      if (const Value* v = obj.dict->find(n)) return *v;
      return Value::undefined(n);
    }
    if (obj.kind == Value::Kind::kString && is_string_method(n)) return method(obj, n);
    if (obj.kind == Value::Kind::kString || obj.kind == Value::Kind::kList)
      return Value::undefined(n);  // Python's getattr fails: jinja2 gives undefined
    if (obj.is_undefined())
      error(e,
            fmt::format("'{}' is undefined (reading its attribute '{}')", obj.undefined_name, n));
    return Value::undefined(n);
  }
  static bool is_string_method(const std::string& n) {
    static const std::set<std::string> m = {
        "strip",   "lstrip",     "rstrip",  "split",   "rsplit",     "startswith", "endswith",
        "replace", "lower",      "upper",   "title",   "capitalize", "find",       "count",
        "join",    "splitlines", "isdigit", "isalpha", "isspace",    "isalnum"};
    return m.count(n) != 0;
  }
  static bool is_dict_method(const std::string& n) {
    return n == "items" || n == "keys" || n == "values" || n == "get";
  }

  Value index(const Value& obj, const Value& key, const Expr& e) {
    if (obj.kind == Value::Kind::kDict) {
      if (key.kind == Value::Kind::kString) {
        if (const Value* v = obj.dict->find(key.s)) return *v;
      }
      return Value::undefined(str(key));
    }
    if (obj.kind == Value::Kind::kList || obj.kind == Value::Kind::kString) {
      if (key.kind == Value::Kind::kString) return attr(obj, key.s, e);
      if (key.kind != Value::Kind::kInt && key.kind != Value::Kind::kBool)
        error(e, "an index must be an integer");
      const List items = obj.kind == Value::Kind::kList ? *obj.list : iterate(obj);
      int64_t k = key.as_int();
      const auto n = static_cast<int64_t>(items.size());
      if (k < 0) k += n;
      if (k < 0 || k >= n) return Value::undefined(fmt::format("[{}]", key.as_int()));
      return items[static_cast<size_t>(k)];
    }
    if (obj.is_undefined())
      error(e, fmt::format("'{}' is undefined (indexing it)", obj.undefined_name));
    return Value::undefined(str(key));
  }

  Value slice(const Value& obj, const Value* start, const Value* stop, const Value* step) {
    const List items = iterate(obj);
    const auto n = static_cast<int64_t>(items.size());
    const int64_t st = step != nullptr && !step->is_undefined() && step->kind != Value::Kind::kNone
                           ? step->as_int()
                           : 1;
    if (st == 0) fail("slice step cannot be zero");
    const auto bound = [&](const Value* v, int64_t dflt) {
      if (v == nullptr || v->kind == Value::Kind::kNone || v->is_undefined()) return dflt;
      int64_t x = v->as_int();
      if (x < 0) x += n;
      return st > 0 ? std::clamp<int64_t>(x, 0, n) : std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t b = bound(start, st > 0 ? 0 : n - 1), e = bound(stop, st > 0 ? n : -1);
    List out;
    for (int64_t k = b; st > 0 ? k < e : k > e; k += st)
      out.push_back(items[static_cast<size_t>(k)]);
    if (obj.kind == Value::Kind::kString) {
      std::string s;
      for (const Value& c : out) s += c.s;
      return Value::string(s);
    }
    return Value::of_list(std::move(out));
  }

  Value method(const Value& obj, const std::string& n) {
    return callable(
        [this, self = obj, n](std::vector<Value>& a, std::vector<std::pair<std::string, Value>>& kw) {
          return call_method(self, n, a, kw);
        });
  }

  Value call_method(const Value& self, const std::string& n, std::vector<Value>& a,
                    std::vector<std::pair<std::string, Value>>& kw) {
    (void)kw;
    const auto arg = [&](size_t k) -> const Value* { return k < a.size() ? &a[k] : nullptr; };
    if (self.kind == Value::Kind::kString) {
      const std::string& s = self.s;
      if (n == "strip" || n == "lstrip" || n == "rstrip") {
        const Value* c = arg(0);
        const std::string* chars =
            c != nullptr && c->kind == Value::Kind::kString ? &c->s : nullptr;
        return Value::string(strip_chars(s, chars, n != "rstrip", n != "lstrip"));
      }
      if (n == "split" || n == "rsplit") {
        const Value* sep = arg(0);
        int64_t maxsplit = arg(1) != nullptr ? arg(1)->as_int() : -1;
        for (auto& [k, v] : kw)
          if (k == "maxsplit") maxsplit = v.as_int();
        List out;
        if (sep == nullptr || sep->kind == Value::Kind::kNone) {
          size_t k = 0;
          while (k < s.size()) {
            while (k < s.size() && is_space(s[k])) ++k;
            if (k >= s.size()) break;
            size_t e = k;
            if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) e = s.size();
            while (e < s.size() && !is_space(s[e])) ++e;
            out.push_back(Value::string(s.substr(k, e - k)));
            k = e;
          }
          return Value::of_list(std::move(out));
        }
        if (sep->s.empty()) fail("empty separator");
        if (n == "rsplit" && maxsplit >= 0) {
          std::vector<std::string> parts;
          size_t end = s.size();
          while (static_cast<int64_t>(parts.size()) < maxsplit) {
            const size_t at =
                end >= sep->s.size() ? s.rfind(sep->s, end - sep->s.size()) : std::string::npos;
            if (at == std::string::npos) break;
            parts.push_back(s.substr(at + sep->s.size(), end - at - sep->s.size()));
            end = at;
          }
          parts.push_back(s.substr(0, end));
          for (auto it = parts.rbegin(); it != parts.rend(); ++it)
            out.push_back(Value::string(*it));
          return Value::of_list(std::move(out));
        }
        size_t at = 0;
        for (;;) {
          if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
          const size_t f = s.find(sep->s, at);
          if (f == std::string::npos) break;
          out.push_back(Value::string(s.substr(at, f - at)));
          at = f + sep->s.size();
        }
        out.push_back(Value::string(s.substr(at)));
        return Value::of_list(std::move(out));
      }
      if (n == "startswith" || n == "endswith") {
        const Value* p = arg(0);
        if (p == nullptr) fail(n + "() takes an argument");
        const List opts = p->kind == Value::Kind::kList ? *p->list : List{*p};
        for (const Value& o : opts) {
          if (o.kind != Value::Kind::kString) fail(n + "() takes strings");
          if (n == "startswith" ? s.compare(0, o.s.size(), o.s) == 0
                                : s.size() >= o.s.size() &&
                                      s.compare(s.size() - o.s.size(), o.s.size(), o.s) == 0)
            return Value::boolean(true);
        }
        return Value::boolean(false);
      }
      if (n == "replace") {
        if (arg(0) == nullptr || arg(1) == nullptr) fail("replace() takes two arguments");
        return Value::string(replace_str(s, arg(0)->s, arg(1)->s, arg(2) ? arg(2)->as_int() : -1));
      }
      if (n == "lower") return Value::string(lowercase(s));
      if (n == "upper") return Value::string(upper(s));
      if (n == "title") return Value::string(title(s));
      if (n == "capitalize") return Value::string(capitalize(s));
      if (n == "find") {
        const size_t f = s.find(arg(0) ? arg(0)->s : "");
        return Value::integer(f == std::string::npos ? -1 : static_cast<int64_t>(f));
      }
      if (n == "count") {
        int64_t c = 0;
        const std::string& sub = arg(0) ? arg(0)->s : "";
        for (size_t f = s.find(sub); f != std::string::npos && !sub.empty();
             f = s.find(sub, f + sub.size()))
          ++c;
        return Value::integer(c);
      }
      if (n == "join") {
        std::string out;
        const List items = arg(0) ? iterate(*arg(0)) : List{};
        for (size_t k = 0; k < items.size(); ++k) out += (k ? s : "") + str(items[k]);
        return Value::string(out);
      }
      if (n == "splitlines") {
        List out;
        size_t at = 0;
        while (at < s.size()) {
          size_t e = s.find('\n', at);
          if (e == std::string::npos) e = s.size();
          std::string piece = s.substr(at, e - at);
          if (!piece.empty() && piece.back() == '\r') piece.pop_back();
          out.push_back(Value::string(piece));
          at = e + 1;
        }
        return Value::of_list(std::move(out));
      }
      if (n == "isdigit" || n == "isalpha" || n == "isspace" || n == "isalnum") {
        bool all = !s.empty();
        for (unsigned char c : s)
          all = all && (n == "isdigit"   ? std::isdigit(c) != 0
                        : n == "isalpha" ? std::isalpha(c) != 0
                        : n == "isspace" ? std::isspace(c) != 0
                                         : std::isalnum(c) != 0);
        return Value::boolean(all);
      }
    }
    if (self.kind == Value::Kind::kDict) {
      if (n == "items") {
        List out;
        for (const auto& [k, v] : self.dict->items)
          out.push_back(Value::of_list({Value::string(k), v}));
        return Value::of_list(std::move(out));
      }
      if (n == "keys" || n == "values") {
        List out;
        for (const auto& [k, v] : self.dict->items)
          out.push_back(n == "keys" ? Value::string(k) : v);
        return Value::of_list(std::move(out));
      }
      if (n == "get") {
        if (arg(0) != nullptr && arg(0)->kind == Value::Kind::kString)
          if (const Value* v = self.dict->find(arg(0)->s)) return *v;
        return arg(1) != nullptr ? *arg(1) : Value::none();
      }
    }
    fail(fmt::format("{}: the method '{}' of {} is not supported", name_, n,
                     repr(self).substr(0, 40)));
  }

  static std::string replace_str(const std::string& s, const std::string& a, const std::string& b,
                                 int64_t count) {
    if (a.empty()) return s;
    std::string out;
    size_t at = 0;
    int64_t done = 0;
    for (size_t f = s.find(a); f != std::string::npos && (count < 0 || done < count);
         f = s.find(a, at)) {
      out += s.substr(at, f - at) + b;
      at = f + a.size();
      ++done;
    }
    return out + s.substr(at);
  }
  static std::string upper(const std::string& s) {
    std::string out;
    for (char c : s) out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return out;
  }
  static std::string capitalize(const std::string& s) {
    std::string out = lowercase(s);
    if (!out.empty()) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
    return out;
  }
  static std::string title(const std::string& s) {
    std::string out;
    bool start = true;
    for (char c : s) {
      const auto u = static_cast<unsigned char>(c);
      out += static_cast<char>(start ? std::toupper(u) : std::tolower(u));
      start = !std::isalpha(u);
    }
    return out;
  }

  Value eval(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.literal;
      case Expr::Kind::kName:
        return lookup(e.name);
      case Expr::Kind::kAttr:
        return attr(eval(*e.obj), e.name, e);
      case Expr::Kind::kIndex:
        return index(eval(*e.obj), eval(*e.a), e);
      case Expr::Kind::kSlice: {
        const Value obj = eval(*e.obj);
        Value a, b, c;
        if (e.a) a = eval(*e.a);
        if (e.b) b = eval(*e.b);
        if (e.c) c = eval(*e.c);
        return slice(obj, e.a ? &a : nullptr, e.b ? &b : nullptr, e.c ? &c : nullptr);
      }
      case Expr::Kind::kCall: {
        const Value f = eval(*e.obj);
        std::vector<Value> args;
        std::vector<std::pair<std::string, Value>> kw;
        for (const Arg& a : e.args) {
          if (a.name.empty())
            args.push_back(eval(*a.value));
          else
            kw.emplace_back(a.name, eval(*a.value));
        }
        if (f.kind != Value::Kind::kCallable) {
          const std::string what = e.obj->kind == Expr::Kind::kName ? e.obj->name : repr(f);
          error(e, fmt::format("'{}' is not a function", what));
        }
        return f.fn->call(args, kw);
      }
      case Expr::Kind::kFilter:
        return filter(e);
      case Expr::Kind::kTest: {
        const bool r = test(e);
        return Value::boolean(e.negated ? !r : r);
      }
      case Expr::Kind::kNot:
        return Value::boolean(!truthy(eval(*e.a)));
      case Expr::Kind::kNeg: {
        const Value v = eval(*e.a);
        if (v.kind == Value::Kind::kInt) return Value::integer(-v.i);
        if (v.kind == Value::Kind::kFloat) return Value::number(-v.f);
        error(e, "bad operand for unary -");
      }
      case Expr::Kind::kAnd: {
        Value a = eval(*e.a);
        return truthy(a) ? eval(*e.b) : a;
      }
      case Expr::Kind::kOr: {
        Value a = eval(*e.a);
        return truthy(a) ? a : eval(*e.b);
      }
      case Expr::Kind::kCond:
        if (truthy(eval(*e.c))) return eval(*e.a);
        return e.b ? eval(*e.b) : Value::undefined("if-expression");
      case Expr::Kind::kList: {
        List l;
        for (const Arg& a : e.args) l.push_back(eval(*a.value));
        return Value::of_list(std::move(l));
      }
      case Expr::Kind::kDict: {
        Dict d;
        for (const auto& [k, v] : e.pairs) {
          const Value key = eval(*k);
          if (key.kind != Value::Kind::kString) error(e, "dict keys must be strings here");
          d.set(key.s, eval(*v));
        }
        return of_dict(std::move(d));
      }
      case Expr::Kind::kBinary:
        return binary(e);
    }
    return Value();
  }

  Value binary(const Expr& e) {
    const std::string& op = e.name;
    const Value a = eval(*e.a);
    const Value b = eval(*e.b);
    if (op == "==") return Value::boolean(equal(a, b));
    if (op == "!=") return Value::boolean(!equal(a, b));
    if (op == "<") return Value::boolean(compare(a, b, "<") < 0);
    if (op == ">") return Value::boolean(compare(a, b, ">") > 0);
    if (op == "<=") return Value::boolean(compare(a, b, "<=") <= 0);
    if (op == ">=") return Value::boolean(compare(a, b, ">=") >= 0);
    if (op == "in") return Value::boolean(contains(b, a));
    if (op == "not in") return Value::boolean(!contains(b, a));
    if (op == "~") return Value::string(str(a) + str(b));
    if (op == "+") {
      if (a.kind == Value::Kind::kString && b.kind == Value::Kind::kString)
        return Value::string(a.s + b.s);
      if (a.kind == Value::Kind::kList && b.kind == Value::Kind::kList) {
        List l = *a.list;
        l.insert(l.end(), b.list->begin(), b.list->end());
        return Value::of_list(std::move(l));
      }
    }
    if (op == "*" && a.kind == Value::Kind::kString && (b.kind == Value::Kind::kInt)) {
      std::string out;
      for (int64_t k = 0; k < b.i; ++k) out += a.s;
      return Value::string(out);
    }
    if (!a.is_number() || !b.is_number())
      error(e, fmt::format("unsupported operand types for {}: {} and {}", op, repr(a), repr(b)));
    const bool ints = a.kind != Value::Kind::kFloat && b.kind != Value::Kind::kFloat;
    if (op == "/") {
      if (b.as_double() == 0) error(e, "division by zero");
      return Value::number(a.as_double() / b.as_double());
    }
    if (ints) {
      const int64_t x = a.as_int(), y = b.as_int();
      if (op == "+") return Value::integer(x + y);
      if (op == "-") return Value::integer(x - y);
      if (op == "*") return Value::integer(x * y);
      if (op == "//" || op == "%") {
        if (y == 0) error(e, "division by zero");
        int64_t q = x / y, r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) {
          --q;
          r += y;
        }
        return Value::integer(op == "//" ? q : r);
      }
      if (op == "**") return Value::integer(static_cast<int64_t>(std::pow(x, y)));
    }
    const double x = a.as_double(), y = b.as_double();
    if (op == "+") return Value::number(x + y);
    if (op == "-") return Value::number(x - y);
    if (op == "*") return Value::number(x * y);
    if (op == "//") return Value::number(std::floor(x / y));
    if (op == "%") return Value::number(x - std::floor(x / y) * y);
    if (op == "**") return Value::number(std::pow(x, y));
    error(e, "unknown operator " + op);
  }

  // A test's truth (before `not`).
  bool test(const Expr& e) {
    const Value v = eval(*e.obj);
    const std::string& t = e.name;
    const auto arg = [&](size_t k) { return k < e.args.size() ? eval(*e.args[k].value) : Value(); };
    if (t == "defined") return !v.is_undefined();
    if (t == "undefined") return v.is_undefined();
    if (t == "none") return v.kind == Value::Kind::kNone;
    if (t == "string") return v.kind == Value::Kind::kString;
    if (t == "number") return v.kind == Value::Kind::kInt || v.kind == Value::Kind::kFloat;
    if (t == "integer") return v.kind == Value::Kind::kInt;
    if (t == "float") return v.kind == Value::Kind::kFloat;
    if (t == "boolean") return v.kind == Value::Kind::kBool;
    if (t == "true") return v.kind == Value::Kind::kBool && v.b;
    if (t == "false") return v.kind == Value::Kind::kBool && !v.b;
    if (t == "mapping") return v.kind == Value::Kind::kDict;
    if (t == "iterable")
      return v.kind == Value::Kind::kList || v.kind == Value::Kind::kDict ||
             v.kind == Value::Kind::kString;
    if (t == "sequence")
      return v.kind == Value::Kind::kList || v.kind == Value::Kind::kDict ||
             v.kind == Value::Kind::kString;
    if (t == "callable") return v.kind == Value::Kind::kCallable;
    if (t == "odd") return v.as_int() % 2 != 0;
    if (t == "even") return v.as_int() % 2 == 0;
    if (t == "divisibleby") return arg(0).as_int() != 0 && v.as_int() % arg(0).as_int() == 0;
    if (t == "lower") return v.kind == Value::Kind::kString && lowercase(v.s) == v.s;
    if (t == "upper") return v.kind == Value::Kind::kString && upper(v.s) == v.s;
    if (t == "eq" || t == "equalto" || t == "==" || t == "sameas") return equal(v, arg(0));
    if (t == "ne" || t == "!=") return !equal(v, arg(0));
    if (t == "lt" || t == "<") return compare(v, arg(0), "<") < 0;
    if (t == "gt" || t == ">") return compare(v, arg(0), ">") > 0;
    if (t == "le" || t == "<=") return compare(v, arg(0), "<=") <= 0;
    if (t == "ge" || t == ">=") return compare(v, arg(0), ">=") >= 0;
    if (t == "in") return contains(arg(0), v);
    error(e, "unknown test " + t);
  }

  // A test by name on a value (select, reject, selectattr).
  bool test_value(const std::string& t, const Value& v, const Value* arg, const Expr& e) {
    Expr probe;
    probe.kind = Expr::Kind::kTest;
    probe.name = t;
    probe.line = e.line;
    auto lit = std::make_unique<Expr>();
    lit->kind = Expr::Kind::kLiteral;
    lit->literal = v;
    probe.obj = std::move(lit);
    if (arg != nullptr) {
      auto a = std::make_unique<Expr>();
      a->kind = Expr::Kind::kLiteral;
      a->literal = *arg;
      probe.args.push_back({"", std::move(a)});
    }
    if (known_tests().count(t) == 0) error(e, fmt::format("the test '{}' is not supported", t));
    return test(probe);
  }

  Value filter(const Expr& e) {
    const Value v = eval(*e.obj);
    std::vector<Value> args;
    std::map<std::string, Value> kw;
    for (const Arg& a : e.args) {
      if (a.name.empty())
        args.push_back(eval(*a.value));
      else
        kw[a.name] = eval(*a.value);
    }
    const auto arg = [&](size_t k, const char* key) -> const Value* {
      if (k < args.size()) return &args[k];
      const auto it = kw.find(key);
      return it == kw.end() ? nullptr : &it->second;
    };
    const std::string& f = e.name;
    if (f == "trim") {
      const Value* c = arg(0, "chars");
      return Value::string(strip_chars(str(v), c ? &c->s : nullptr, true, true));
    }
    if (f == "length" || f == "count") return Value::integer(length(v));
    if (f == "tojson") {
      const Value* indent = arg(0, "indent");
      const Value* ascii = kw.count("ensure_ascii") ? &kw["ensure_ascii"] : nullptr;
      const Value* sort = kw.count("sort_keys") ? &kw["sort_keys"] : nullptr;
      const Value* seps = kw.count("separators") ? &kw["separators"] : nullptr;
      const int ind = indent != nullptr && indent->kind != Value::Kind::kNone
                          ? static_cast<int>(indent->as_int())
                          : -1;
      std::string item_sep = ind >= 0 ? "," : ", ", key_sep = ": ";
      if (seps != nullptr && seps->kind == Value::Kind::kList && seps->list->size() == 2) {
        item_sep = (*seps->list)[0].s;
        key_sep = (*seps->list)[1].s;
      }
      std::string out;
      to_json(v, out, ascii != nullptr && truthy(*ascii), ind, item_sep, key_sep,
              sort != nullptr && truthy(*sort), 0);
      return Value::string(out);
    }
    if (f == "string") return Value::string(str(v));
    if (f == "safe" || f == "e" || f == "escape")
      return f == "safe" ? v : Value::string(html_escape(str(v)));
    if (f == "lower") return Value::string(lowercase(str(v)));
    if (f == "upper") return Value::string(upper(str(v)));
    if (f == "capitalize") return Value::string(capitalize(str(v)));
    if (f == "title") return Value::string(title(str(v)));
    if (f == "replace") {
      const Value* a = arg(0, "old");
      const Value* b = arg(1, "new");
      if (a == nullptr || b == nullptr) error(e, "replace takes two arguments");
      return Value::string(
          replace_str(str(v), str(*a), str(*b), arg(2, "count") ? arg(2, "count")->as_int() : -1));
    }
    if (f == "default" || f == "d") {
      const Value* d = arg(0, "default_value");
      const Value* boolean = arg(1, "boolean");
      const bool use = v.is_undefined() || (boolean != nullptr && truthy(*boolean) && !truthy(v));
      return use ? (d != nullptr ? *d : Value::string("")) : v;
    }
    if (f == "first" || f == "last") {
      const List items = iterate(v);
      if (items.empty()) return Value::undefined(f);
      return f == "first" ? items.front() : items.back();
    }
    if (f == "list") return Value::of_list(iterate(v));
    if (f == "items") {
      if (v.is_undefined()) return Value::of_list({});
      if (v.kind != Value::Kind::kDict) error(e, "items needs a mapping");
      std::vector<Value> none;
      std::vector<std::pair<std::string, Value>> no_kw;
      return call_method(v, "items", none, no_kw);
    }
    if (f == "join") {
      const Value* sep = arg(0, "d");
      const Value* attribute = arg(1, "attribute");
      std::string out;
      const List items = iterate(v);
      for (size_t k = 0; k < items.size(); ++k) {
        const Value item = attribute != nullptr ? attr(items[k], str(*attribute), e) : items[k];
        out += (k && sep ? sep->s : "") + str(item);
      }
      return Value::string(out);
    }
    if (f == "select" || f == "reject") {
      List out;
      for (const Value& item : iterate(v)) {
        bool ok = args.empty()
                      ? truthy(item)
                      : test_value(args[0].s, item, args.size() > 1 ? &args[1] : nullptr, e);
        if (ok == (f == "select")) out.push_back(item);
      }
      return Value::of_list(std::move(out));
    }
    if (f == "selectattr" || f == "rejectattr") {
      if (args.empty()) error(e, f + " needs an attribute");
      List out;
      for (const Value& item : iterate(v)) {
        const Value a = attr(item, args[0].s, e);
        const bool ok = args.size() < 2
                            ? truthy(a)
                            : test_value(args[1].s, a, args.size() > 2 ? &args[2] : nullptr, e);
        if (ok == (f == "selectattr")) out.push_back(item);
      }
      return Value::of_list(std::move(out));
    }
    if (f == "map") {
      List out;
      const Value* attribute = kw.count("attribute") ? &kw["attribute"] : nullptr;
      for (const Value& item : iterate(v)) {
        if (attribute != nullptr) {
          Value a = attr(item, str(*attribute), e);
          if (a.is_undefined() && kw.count("default")) a = kw["default"];
          out.push_back(a);
        } else if (!args.empty() && args[0].kind == Value::Kind::kString) {
          auto fe = std::make_unique<Expr>();
          fe->kind = Expr::Kind::kFilter;
          fe->name = args[0].s;
          fe->line = e.line;
          auto lit = std::make_unique<Expr>();
          lit->kind = Expr::Kind::kLiteral;
          lit->literal = item;
          fe->obj = std::move(lit);
          if (known_filters().count(fe->name) == 0)
            error(e, "the filter '" + fe->name + "' is not supported");
          out.push_back(filter(*fe));
        } else {
          error(e, "map needs a filter name or attribute=");
        }
      }
      return Value::of_list(std::move(out));
    }
    if (f == "indent") {
      const Value* w = arg(0, "width");
      const Value* first = arg(1, "first");
      const Value* blank = arg(2, "blank");
      const std::string pad = w == nullptr ? std::string(4, ' ')
                              : w->kind == Value::Kind::kString
                                  ? w->s
                                  : std::string(static_cast<size_t>(w->as_int()), ' ');
      const std::string s = str(v);
      std::string out;
      size_t at = 0;
      bool first_line = true;
      while (at <= s.size()) {
        size_t nl = s.find('\n', at);
        const bool last = nl == std::string::npos;
        if (last) nl = s.size();
        const std::string line = s.substr(at, nl - at);
        const bool indent_it = first_line ? (first != nullptr && truthy(*first))
                                          : (!line.empty() || (blank != nullptr && truthy(*blank)));
        out += (indent_it ? pad : "") + line;
        if (last) break;
        out += '\n';
        at = nl + 1;
        first_line = false;
      }
      return Value::string(out);
    }
    if (f == "int") {
      if (v.kind == Value::Kind::kString) {
        try {
          return Value::integer(std::stoll(v.s));
        } catch (...) {
          return Value::integer(0);
        }
      }
      return Value::integer(v.is_number() ? v.as_int() : 0);
    }
    if (f == "float")
      return Value::number(v.kind == Value::Kind::kString ? std::atof(v.s.c_str()) : v.as_double());
    if (f == "abs")
      return v.kind == Value::Kind::kInt ? Value::integer(std::llabs(v.i))
                                         : Value::number(std::fabs(v.as_double()));
    if (f == "round") {
      const Value* p = arg(0, "precision");
      const double scale = std::pow(10.0, p ? p->as_double() : 0.0);
      return Value::number(std::nearbyint(v.as_double() * scale) / scale);
    }
    if (f == "reverse") {
      if (v.kind == Value::Kind::kString) {
        List chars = iterate(v);
        std::string out;
        for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += it->s;
        return Value::string(out);
      }
      List items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::of_list(std::move(items));
    }
    if (f == "unique") {
      List out;
      for (const Value& item : iterate(v))
        if (std::none_of(out.begin(), out.end(), [&](const Value& o) { return equal(o, item); }))
          out.push_back(item);
      return Value::of_list(std::move(out));
    }
    if (f == "sort" || f == "dictsort") {
      std::vector<Value> none;
      std::vector<std::pair<std::string, Value>> no_kw;
      List items = f == "dictsort" ? *call_method(v, "items", none, no_kw).list : iterate(v);
      const Value* attribute = kw.count("attribute") ? &kw["attribute"] : nullptr;
      const bool rev = kw.count("reverse") && truthy(kw["reverse"]);
      std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
        const Value x = attribute ? attr(a, str(*attribute), e) : a;
        const Value y = attribute ? attr(b, str(*attribute), e) : b;
        return rev ? compare(x, y, "<") > 0 : compare(x, y, "<") < 0;
      });
      return Value::of_list(std::move(items));
    }
    if (f == "sum" || f == "max" || f == "min") {
      const List items = iterate(v);
      if (f == "sum") {
        Value acc = Value::integer(0);
        for (const Value& item : items) {
          acc = acc.kind == Value::Kind::kInt && item.kind == Value::Kind::kInt
                    ? Value::integer(acc.i + item.i)
                    : Value::number(acc.as_double() + item.as_double());
        }
        return acc;
      }
      if (items.empty()) return Value::undefined(f);
      Value best = items.front();
      for (const Value& item : items)
        if ((f == "max") ? compare(item, best, ">") > 0 : compare(item, best, "<") < 0) best = item;
      return best;
    }
    if (f == "wordcount") {
      std::vector<Value> none;
      std::vector<std::pair<std::string, Value>> no_kw;
      return Value::integer(static_cast<int64_t>(
          call_method(Value::string(str(v)), "split", none, no_kw).list->size()));
    }
    error(e, "the filter '" + f + "' is not supported");
  }

  static std::string html_escape(const std::string& s) {
    std::string out;
    for (char c : s) {
      switch (c) {
        case '&':
          out += "&amp;";
          break;
        case '<':
          out += "&lt;";
          break;
        case '>':
          out += "&gt;";
          break;
        case '"':
          out += "&#34;";
          break;
        case '\'':
          out += "&#39;";
          break;
        default:
          out += c;
      }
    }
    return out;
  }

  // Renders `body` into `out`; a break or continue inside a loop comes back in `ctl`.
  void render(const Body& body, std::string& out, LoopControl& ctl) {
    for (const auto& n : body) {
      if (ctl.kind != LoopControl::Kind::kNone) return;
      switch (n->kind) {
        case Node::Kind::kText:
          out += n->text;
          break;
        case Node::Kind::kOutput:
          out += str(eval(*n->expr));
          break;
        case Node::Kind::kIf:
          for (const auto& [cond, b] : n->branches) {
            if (!cond || truthy(eval(*cond))) {
              render(b, out, ctl);
              break;
            }
          }
          break;
        case Node::Kind::kFor:
          render_for(*n, out);
          break;
        case Node::Kind::kSet:
          set(*n, eval(*n->expr));
          break;
        case Node::Kind::kSetBlock: {
          std::string captured;
          LoopControl inner;
          render(n->body, captured, inner);
          set(*n, Value::string(captured));
          break;
        }
        case Node::Kind::kMacro:
          define_macro(*n);
          break;
        case Node::Kind::kBreak:
          ctl.kind = LoopControl::Kind::kBreak;
          return;
        case Node::Kind::kContinue:
          ctl.kind = LoopControl::Kind::kContinue;
          return;
        case Node::Kind::kBlock:
          render(n->body, out, ctl);
          break;
      }
    }
  }

  void set(const Node& n, Value v) {
    if (n.targets.size() == 1) {
      assign(n.targets[0], std::move(v));
      return;
    }
    const Value ns = lookup(n.targets[0]);
    if (ns.kind != Value::Kind::kDict || !ns.ns)
      fail(fmt::format("{}: line {}: '{}' is not a namespace: cannot set its attribute '{}'", name_,
                       n.line, n.targets[0], n.targets[1]));
    ns.dict->set(n.targets[1], std::move(v));
  }

  void render_for(const Node& n, std::string& out) {
    const Value seq = eval(*n.expr);
    List items = iterate(seq);
    if (n.filter) {
      List kept;
      scopes.emplace_back();
      for (const Value& item : items) {
        bind_targets(n, item);
        if (truthy(eval(*n.filter))) kept.push_back(item);
      }
      scopes.pop_back();
      items = std::move(kept);
    }
    if (items.empty()) {
      LoopControl ctl;
      render(n.else_body, out, ctl);
      return;
    }
    scopes.emplace_back();
    const auto count = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < count; ++k) {
      const Value& item = items[static_cast<size_t>(k)];
      bind_targets(n, item);
      Dict loop;
      loop.set("index", Value::integer(k + 1));
      loop.set("index0", Value::integer(k));
      loop.set("revindex", Value::integer(count - k));
      loop.set("revindex0", Value::integer(count - k - 1));
      loop.set("first", Value::boolean(k == 0));
      loop.set("last", Value::boolean(k == count - 1));
      loop.set("length", Value::integer(count));
      loop.set("previtem",
               k > 0 ? items[static_cast<size_t>(k - 1)] : Value::undefined("loop.previtem"));
      loop.set("nextitem", k + 1 < count ? items[static_cast<size_t>(k + 1)]
                                         : Value::undefined("loop.nextitem"));
      const int64_t at = k;
      loop.set("cycle",
               callable([at](std::vector<Value>& a, std::vector<std::pair<std::string, Value>>&) {
                 return a.empty() ? Value::none() : a[static_cast<size_t>(at) % a.size()];
               }));
      Value lv = of_dict(std::move(loop));
      lv.ns = true;  // attributes only
      assign("loop", lv);
      LoopControl ctl;
      render(n.body, out, ctl);
      if (ctl.kind == LoopControl::Kind::kBreak) break;
    }
    scopes.pop_back();
  }

  void bind_targets(const Node& n, const Value& item) {
    if (n.targets.size() == 1) {
      assign(n.targets[0], item);
      return;
    }
    const List parts = iterate(item);
    if (parts.size() != n.targets.size())
      fail(fmt::format("{}: line {}: cannot unpack {} values into {}", name_, n.line, parts.size(),
                       n.targets.size()));
    for (size_t k = 0; k < parts.size(); ++k) assign(n.targets[k], parts[k]);
  }

  void define_macro(const Node& n) {
    const Node* m = &n;
    assign(n.targets[0], callable([this, m](std::vector<Value>& args,
                                            std::vector<std::pair<std::string, Value>>& kw) {
             std::unordered_map<std::string, Value> frame;
             for (size_t k = 0; k < m->params.size(); ++k) {
               const auto& [pname, def] = m->params[k];
               Value v = k < args.size() ? args[k] : Value::undefined(pname);
               for (auto& [key, val] : kw)
                 if (key == pname) v = val;
               if (v.is_undefined() && def) v = eval(*def);
               frame[pname] = v;
             }
             // A macro sees the template's globals and its arguments, not the caller's locals.
             std::vector<std::unordered_map<std::string, Value>> saved;
             saved.swap(scopes);
             scopes.push_back(saved[0]);
             if (saved.size() > 1) scopes.push_back(saved[1]);
             scopes.push_back(std::move(frame));
             std::string out;
             LoopControl ctl;
             try {
               render(m->body, out, ctl);
             } catch (...) {
               scopes.swap(saved);
               throw;
             }
             scopes.swap(saved);
             return Value::string(out);
           }));
  }

 private:
  std::string name_;
};

}  // namespace

struct ChatTemplate::Impl {
  std::string name;
  Body body;
};

ChatTemplate::ChatTemplate(std::string_view source, const std::string& name)
    : impl_(std::make_unique<Impl>()) {
  impl_->name = name;
  TemplateParser p(lex_template(source, name), name);
  impl_->body = p.parse_all();
}
ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  Renderer r(impl_->name);
  std::unordered_map<std::string, Value> globals;
  globals["raise_exception"] =
      callable([](std::vector<Value>& a, std::vector<std::pair<std::string, Value>>&) -> Value {
        fail(a.empty() ? std::string("raise_exception()") : str(a[0]));
      });
  globals["strftime_now"] =
      callable([](std::vector<Value>& a, std::vector<std::pair<std::string, Value>>&) {
        const std::time_t now = std::time(nullptr);
        std::tm tm{};
        localtime_r(&now, &tm);
        std::array<char, 256> buf{};
        const size_t n =
            std::strftime(buf.data(), buf.size(), a.empty() ? "%Y-%m-%d" : a[0].s.c_str(), &tm);
        return Value::string(std::string(buf.data(), n));
      });
  const auto make_dict = [](std::vector<Value>& a, std::vector<std::pair<std::string, Value>>& kw,
                            bool ns) {
    Dict d;
    if (!a.empty() && a[0].kind == Value::Kind::kDict) d = *a[0].dict;
    for (auto& [k, v] : kw) d.set(k, v);
    return of_dict(std::move(d), ns);
  };
  globals["namespace"] =
      callable([make_dict](std::vector<Value>& a, std::vector<std::pair<std::string, Value>>& kw) {
        return make_dict(a, kw, true);
      });
  globals["dict"] =
      callable([make_dict](std::vector<Value>& a, std::vector<std::pair<std::string, Value>>& kw) {
        return make_dict(a, kw, false);
      });
  globals["range"] =
      callable([](std::vector<Value>& a, std::vector<std::pair<std::string, Value>>&) {
        int64_t b = 0, e = 0, st = 1;
        if (a.size() == 1) e = a[0].as_int();
        if (a.size() >= 2) {
          b = a[0].as_int();
          e = a[1].as_int();
        }
        if (a.size() >= 3) st = a[2].as_int();
        if (st == 0) fail("range() step must not be zero");
        List out;
        for (int64_t k = b; st > 0 ? k < e : k > e; k += st) out.push_back(Value::integer(k));
        return Value::of_list(std::move(out));
      });
  if (context.is_object())
    for (const auto& [k, v] : context.items()) globals[k] = from_json(v);
  r.scopes.push_back(std::move(globals));
  r.scopes.emplace_back();  // the template's own top-level sets
  std::string out;
  LoopControl ctl;
  r.render(impl_->body, out, ctl);
  return out;
}

}  // namespace spillway::text

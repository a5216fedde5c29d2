// The chat template engine's values (Note [Chat templates] in chat_template.cpp): Python's
// as jinja2 sees them, from the request's JSON; printed as str() and repr() print them,
// written as json.dumps writes them (tojson), compared, measured, iterated and searched as
// Python does.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "spillway/core/error.hpp"
#include "text/chat_template_impl.hpp"
#include "text/unicode.hpp"

namespace spillway::text::jinja {

Value of_dict(Dict d, bool ns) {
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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

Value callable(
    std::function<Value(std::vector<Value>&, std::vector<std::pair<std::string, Value>>&)> f) {
  Value v = Value::make(Value::Kind::kCallable);
  v.fn = std::make_shared<Callable>(Callable{std::move(f)});
  return v;
}

}  // namespace spillway::text::jinja

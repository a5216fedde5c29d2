// The chat template engine's attributes, indexing, slicing and methods (Note [Chat
// templates] in chat_template.cpp): a.b reads the attribute (a dict's methods) then the key,
// a[b] the key then the attribute; slices and the str and dict methods are Python's.
#include <fmt/format.h>

#include <algorithm>

#include "text/chat_template_impl.hpp"
#include "text/unicode.hpp"

namespace spillway::text::jinja {

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

Value Renderer::attr(const Value& obj, const std::string& n, const Expr& e) {
  if (obj.kind == Value::Kind::kDict) {
    if (!obj.ns && is_dict_method(n)) return method(obj, n);
    if (const Value* v = obj.dict->find(n)) return *v;
    return Value::undefined(n);
  }
  if (obj.kind == Value::Kind::kString && is_string_method(n)) return method(obj, n);
  if (obj.kind == Value::Kind::kString || obj.kind == Value::Kind::kList)
    return Value::undefined(n);  // Python's getattr fails: jinja2 gives undefined
  if (obj.is_undefined())
    error(e, fmt::format("'{}' is undefined (reading its attribute '{}')", obj.undefined_name, n));
  return Value::undefined(n);
}

bool Renderer::is_string_method(const std::string& n) {
  static const std::set<std::string> m = {
      "strip",   "lstrip",     "rstrip",  "split",   "rsplit",     "startswith", "endswith",
      "replace", "lower",      "upper",   "title",   "capitalize", "find",       "count",
      "join",    "splitlines", "isdigit", "isalpha", "isspace",    "isalnum"};
  return m.count(n) != 0;
}

bool Renderer::is_dict_method(const std::string& n) {
  return n == "items" || n == "keys" || n == "values" || n == "get";
}

Value Renderer::index(const Value& obj, const Value& key, const Expr& e) {
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

Value Renderer::slice(const Value& obj, const Value* start, const Value* stop, const Value* step) {
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
  for (int64_t k = b; st > 0 ? k < e : k > e; k += st) out.push_back(items[static_cast<size_t>(k)]);
  if (obj.kind == Value::Kind::kString) {
    std::string s;
    for (const Value& c : out) s += c.s;
    return Value::string(s);
  }
  return Value::of_list(std::move(out));
}

Value Renderer::method(const Value& obj, const std::string& n) {
  return callable(
      [this, self = obj, n](std::vector<Value>& a, std::vector<std::pair<std::string, Value>>& kw) {
        return call_method(self, n, a, kw);
      });
}

Value Renderer::call_method(const Value& self, const std::string& n, std::vector<Value>& a,
                            std::vector<std::pair<std::string, Value>>& kw) {
  (void)kw;
  const auto arg = [&](size_t k) -> const Value* { return k < a.size() ? &a[k] : nullptr; };
  if (self.kind == Value::Kind::kString) {
    const std::string& s = self.s;
    if (n == "strip" || n == "lstrip" || n == "rstrip") {
      const Value* c = arg(0);
      const std::string* chars = c != nullptr && c->kind == Value::Kind::kString ? &c->s : nullptr;
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
        for (auto it = parts.rbegin(); it != parts.rend(); ++it) out.push_back(Value::string(*it));
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
        if (n == "startswith"
                ? s.compare(0, o.s.size(), o.s) == 0
                : s.size() >= o.s.size() && s.compare(s.size() - o.s.size(), o.s.size(), o.s) == 0)
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
      for (const auto& [k, v] : self.dict->items) out.push_back(n == "keys" ? Value::string(k) : v);
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

std::string Renderer::replace_str(const std::string& s, const std::string& a, const std::string& b,
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

std::string Renderer::upper(const std::string& s) {
  std::string out;
  for (char c : s) out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

std::string Renderer::capitalize(const std::string& s) {
  std::string out = lowercase(s);
  if (!out.empty()) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

std::string Renderer::title(const std::string& s) {
  std::string out;
  bool start = true;
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    out += static_cast<char>(start ? std::toupper(u) : std::tolower(u));
    start = !std::isalpha(u);
  }
  return out;
}

}  // namespace spillway::text::jinja

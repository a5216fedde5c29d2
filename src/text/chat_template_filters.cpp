// The chat template engine's tests (`x is defined`) and filters (`x | tojson`) (Note [Chat
// templates] in chat_template.cpp): jinja2's, with transformers' tojson (json.dumps,
// ensure_ascii off); the names the parser accepts are known_tests() and known_filters().
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "text/chat_template_impl.hpp"
#include "text/unicode.hpp"

namespace spillway::text::jinja {

// A test's truth (before `not`).
bool Renderer::test(const Expr& e) {
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
bool Renderer::test_value(const std::string& t, const Value& v, const Value* arg, const Expr& e) {
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

Value Renderer::filter(const Expr& e) {
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
      bool ok = args.empty() ? truthy(item)
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

std::string Renderer::html_escape(const std::string& s) {
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

}  // namespace spillway::text::jinja

// The chat template engine's shared pieces (Note [Chat templates] in chat_template.cpp):
// the runtime value (chat_template_values.cpp), the tags and tokens of the lexers
// (chat_template_lexer.cpp), the syntax tree the parser builds (chat_template_parser.cpp),
// and the renderer that walks it (chat_template_render.cpp; its attributes, indexing and
// methods in chat_template_methods.cpp, its tests and filters in chat_template_filters.cpp).
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace spillway::text::jinja {

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

Value of_dict(Dict d, bool ns = false);
[[noreturn]] void fail(const std::string& what);
Value from_json(const nlohmann::ordered_json& j);
bool truthy(const Value& v);
// Python's str() and repr().
std::string str(const Value& v);
std::string repr(const Value& v);
// json.dumps(x, ensure_ascii, indent, separators, sort_keys) as Python writes it.
void to_json(const Value& v, std::string& out, bool ascii, int indent, const std::string& item_sep,
             const std::string& key_sep, bool sort, int depth);
bool equal(const Value& a, const Value& b);
// -1, 0, 1; numbers with numbers, strings with strings, lists element-wise.
int compare(const Value& a, const Value& b, const char* op);
// Python's len.
int64_t length(const Value& v);
// What a for loop iterates: a list's items, a dict's keys, a string's characters.
List iterate(const Value& v);
bool contains(const Value& container, const Value& item);

struct Callable {
  std::function<Value(std::vector<Value>&, std::vector<std::pair<std::string, Value>>&)> call;
};

Value callable(
    std::function<Value(std::vector<Value>&, std::vector<std::pair<std::string, Value>>&)> f);

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

bool is_space(char c);
std::vector<Tag> lex_template(std::string_view src, const std::string& name);

struct Token {
  enum class Kind { kName, kString, kInt, kFloat, kOp, kEnd } kind;
  std::string text;
  int64_t i = 0;
  double f = 0;
};

std::vector<Token> lex_expr(const std::string& s, const std::string& where);

// ---- parsing --------------------------------------------------------------------------

// The filters and tests a template may name.
const std::set<std::string>& known_filters();
const std::set<std::string>& known_tests();
// The statements of a template's tags (`name` labels it in errors).
Body parse_template(std::vector<Tag> tags, const std::string& name);

// ---- rendering ----------------------------------------------------------------------

struct LoopControl {
  enum class Kind { kNone, kBreak, kContinue } kind = Kind::kNone;
};

// str.strip/lstrip/rstrip and the trim filter: whitespace, or the characters of `chars`.
std::string strip_chars(const std::string& s, const std::string* chars, bool left, bool right);

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

  // Attributes, indexing, slicing and the methods of strings and dicts
  // (chat_template_methods.cpp).
  Value attr(const Value& obj, const std::string& n, const Expr& e);
  static bool is_string_method(const std::string& n);
  static bool is_dict_method(const std::string& n);
  Value index(const Value& obj, const Value& key, const Expr& e);
  Value slice(const Value& obj, const Value* start, const Value* stop, const Value* step);
  Value method(const Value& obj, const std::string& n);
  Value call_method(const Value& self, const std::string& n, std::vector<Value>& a,
                    std::vector<std::pair<std::string, Value>>& kw);
  static std::string replace_str(const std::string& s, const std::string& a, const std::string& b,
                                 int64_t count);
  static std::string upper(const std::string& s);
  static std::string capitalize(const std::string& s);
  static std::string title(const std::string& s);

  // Expressions and statements (chat_template_render.cpp).
  Value eval(const Expr& e);
  Value binary(const Expr& e);
  void render(const Body& body, std::string& out, LoopControl& ctl);
  void set(const Node& n, Value v);
  void render_for(const Node& n, std::string& out);
  void bind_targets(const Node& n, const Value& item);
  void define_macro(const Node& n);

  // Tests and filters (chat_template_filters.cpp).
  bool test(const Expr& e);
  bool test_value(const std::string& t, const Value& v, const Value* arg, const Expr& e);
  Value filter(const Expr& e);
  static std::string html_escape(const std::string& s);

 private:
  std::string name_;
};

}  // namespace spillway::text::jinja

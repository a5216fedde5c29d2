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
// kFilters / kTests / call_method (chat_template_parser.cpp, chat_template_methods.cpp).
// Anything else is refused at parse (a statement, a filter or test name unknown) or at
// render (a method).
#include "spillway/text/chat_template.hpp"

#include <array>
#include <ctime>
#include <unordered_map>

#include "text/chat_template_impl.hpp"

namespace spillway::text {

using namespace jinja;  // the engine's pieces (chat_template_impl.hpp)

struct ChatTemplate::Impl {
  std::string name;
  Body body;
};

ChatTemplate::ChatTemplate(std::string_view source, const std::string& name)
    : impl_(std::make_unique<Impl>()) {
  impl_->name = name;
  impl_->body = parse_template(lex_template(source, name), name);
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

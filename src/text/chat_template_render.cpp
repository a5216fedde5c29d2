// The chat template engine's renderer (Note [Chat templates] in chat_template.cpp): the
// expressions' values (Python's arithmetic, comparison, `in`, and/or, conditionals) and the
// statements' text: if, for with jinja2's loop variable, set, macros, break and continue.
#include <fmt/format.h>

#include <cmath>
#include <unordered_map>

#include "text/chat_template_impl.hpp"

namespace spillway::text::jinja {

Value Renderer::eval(const Expr& e) {
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

Value Renderer::binary(const Expr& e) {
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

// Renders `body` into `out`; a break or continue inside a loop comes back in `ctl`.
void Renderer::render(const Body& body, std::string& out, LoopControl& ctl) {
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

void Renderer::set(const Node& n, Value v) {
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

void Renderer::render_for(const Node& n, std::string& out) {
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
    loop.set("nextitem",
             k + 1 < count ? items[static_cast<size_t>(k + 1)] : Value::undefined("loop.nextitem"));
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

void Renderer::bind_targets(const Node& n, const Value& item) {
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

void Renderer::define_macro(const Node& n) {
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

}  // namespace spillway::text::jinja

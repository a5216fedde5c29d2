// The chat template engine's parser (Note [Chat templates] in chat_template.cpp): a tag's
// tokens into an expression (ExprParser, by Python's precedence, with filters and tests),
// the tags into statements (TemplateParser). A statement, filter or test outside the subset
// is refused here, naming it and its line.
#include <fmt/format.h>

#include <algorithm>

#include "text/chat_template_impl.hpp"

namespace spillway::text::jinja {

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

namespace {

// ---- expression parsing ----------------------------------------------------------------

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

}  // namespace

Body parse_template(std::vector<Tag> tags, const std::string& name) {
  TemplateParser p(std::move(tags), name);
  return p.parse_all();
}

}  // namespace spillway::text::jinja

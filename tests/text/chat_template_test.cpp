// The chat template interpreter (spillway/text/chat_template.hpp) on small templates whose
// expected outputs are jinja2's under transformers' environment (trim_blocks, lstrip_blocks,
// its tojson), computed with transformers 5.23 / jinja2 3.1.6: whitespace control, loops and
// their variables, namespaces, macros, tojson as json.dumps, Python's printing and
// arithmetic, undefined values; refusals naming the construct and the line.
// python/tests/test_chat_template.py compares 28 published templates live.
#include "spillway/text/chat_template.hpp"

#include <gtest/gtest.h>

#include "spillway/core/error.hpp"
#include "test_support.hpp"

namespace spillway::text {
namespace {

using ordered_json = nlohmann::ordered_json;

std::string render(const std::string& src, const ordered_json& ctx = ordered_json::object()) {
  return ChatTemplate(src, "t.jinja").render(ctx);
}

TEST(ChatTemplate, RendersAsJinjaUnderTransformersEnvironment) {
  EXPECT_EQ(
      render("{% for m in messages %}\n  {{ m.role }}: {{ m.content | trim }}\n{% endfor %}\n",
             ordered_json::parse(R"({"messages": [{"role": "user", "content": " hi "},
                                                        {"role": "assistant", "content": "yo"}]})")),
      "  user: hi\n  assistant: yo\n");
  EXPECT_EQ(render("a  {%- if true -%}  b  {%- endif -%}  c\n"), "abc");
  EXPECT_EQ(render("{% for x in [1, 2, 3] if x != 2 %}{{ loop.index }}/{{ loop.length }}"
                   "{{ ',' if not loop.last }}{{ loop.previtem|default('-') }}{% endfor %}"),
            "1/2,-2/21");
  EXPECT_EQ(render("{% set ns = namespace(n=0, s='') %}{% for k, v in d.items() %}"
                   "{% set ns.n = ns.n + v %}{% set ns.s = ns.s ~ k %}{% endfor %}"
                   "{{ ns.n }} {{ ns.s }}",
                   ordered_json::parse(R"({"d": {"b": 2, "a": 1}})")),
            "3 ba");
  EXPECT_EQ(
      render("{% macro t(x, y=3) %}[{{ x }}{{ y }}]{% endmacro %}{{ t(1) }}{{ t(1, y='z') }}"),
      "[13][1z]");
  EXPECT_EQ(render("{{ d | tojson }}|{{ d | tojson(indent=2) }}|"
                   "{{ [1.0, 2.5e-7, none, true, 'é\"'] | tojson }}",
                   ordered_json::parse(R"({"d": {"k": [1, {"x": "y"}], "e": {}}})")),
            "{\"k\": [1, {\"x\": \"y\"}], \"e\": {}}|{\n  \"k\": [\n    1,\n    {\n      \"x\": "
            "\"y\"\n    }\n  ],\n  \"e\": {}\n}|[1.0, 2.5e-07, null, true, \"é\\\"\"]");
  EXPECT_EQ(render("{{ [1, 'a', none, true, 1.5] }} {{ {'a': 1} }} {{ 7 // 2 }} {{ -7 % 3 }} "
                   "{{ 7 / 2 }} {{ 'ab' * 2 }} {{ 'x,y,,z'.split(',') }} {{ '  p q '.split() }} "
                   "{{ 'abc'[::-1] }} {{ [1,2,3][-1] }}"),
            "[1, 'a', None, True, 1.5] {'a': 1} 3 2 3.5 abab ['x', 'y', '', 'z'] ['p', 'q'] cba 3");
  EXPECT_EQ(render("{{ missing }}|{{ missing is defined }}|{{ d.nokey is defined }}|"
                   "{{ (missing or 'dflt') }}|{{ missing|length }}",
                   ordered_json::parse(R"({"d": {}})")),
            "|False|False|dflt|0");
}

TEST(ChatTemplate, TheTemplatesRefusalsAndOursNameWhat) {
  testing::expect_error(
      [] { (void)render("{{ raise_exception('Conversation roles must alternate') }}"); },
      {"Conversation roles must alternate"});
  testing::expect_error([] { (void)render("line one\n{% include 'x' %}"); },
                        {"t.jinja", "line 2", "the statement 'include' is not supported"});
  testing::expect_error([] { (void)render("{{ x | pprint }}"); }, {"the filter 'pprint'"});
  testing::expect_error([] { (void)render("{% if x %}"); }, {"ends inside a block"});
  testing::expect_error([] { (void)render("{{ missing.attr }}"); },
                        {"'missing' is undefined (reading its attribute 'attr')"});
}

}  // namespace
}  // namespace spillway::text

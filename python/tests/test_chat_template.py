"""spillway's chat templates (`spillway chat-template`, include/spillway/text/chat_template.hpp)
against transformers' apply_chat_template (jinja2, transformers' environment), byte for byte:
the 28 published templates of data/chat_templates/ over conversations with and without a
system prompt, multi-turn, with tools and a tool call's round trip, with and without
add_generation_prompt, and each template's own refusals (raise_exception) refused alike.
Note [Chat templates]."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
from transformers.utils import chat_template_utils  # noqa: E402

BUILD = os.environ.get("SPILLWAY_BUILD", "")
pytestmark = pytest.mark.skipif(not BUILD, reason="needs SPILLWAY_BUILD (the CLI's build tree)")
DATA = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
TOKENS: dict[str, dict[str, Any]] = json.loads((DATA / "tokens.json").read_text())

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
U1 = {"role": "user", "content": "Hello! Wie geht's? 你好 🙂"}
A1 = {"role": "assistant", "content": "Hi there!\n  How can I help?  "}
U2 = {"role": "user", "content": 'What is the weather in Paris? Answer in "JSON".'}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "days": {"type": "integer", "description": "Forecast days", "default": 1},
                },
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call_0001",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
        }
    ],
}
RESULT = {
    "role": "tool",
    "tool_call_id": "call_0001",
    "name": "get_weather",
    "content": '{"temp_c": 21.5, "sky": "clear"}',
}
CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [SYSTEM, U1, A1, U2]},
    {"messages": [U1, A1, U2]},
    {"messages": [U1]},
    {"messages": [U1], "add_generation_prompt": False},
    {"messages": [SYSTEM, U1, A1], "add_generation_prompt": False},
    {"messages": [SYSTEM, U1, A1, U2], "tools": TOOLS},
    {"messages": [SYSTEM, U2, CALL, RESULT], "tools": TOOLS},
    {"messages": [U1, A1, U1, A1, U2]},
]


def transformers_render(template: str, ctx: dict[str, Any]) -> tuple[str | None, str | None]:
    try:
        out = chat_template_utils.render_jinja_template(
            conversations=[ctx["messages"]],
            chat_template=template,
            tools=ctx.get("tools"),
            add_generation_prompt=ctx.get("add_generation_prompt", True),
            bos_token=ctx["bos_token"],
            eos_token=ctx["eos_token"],
        )
        return out[0][0], None
    except Exception as e:  # noqa: BLE001 (the template's own refusals: compared as refusals)
        return None, str(e)


def spillway_render(path: Path, contexts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = subprocess.run(
        [str(Path(BUILD) / "bin" / "spillway"), "chat-template", "--template", str(path)]
        + ["--jsonl", "-"],
        input="\n".join(json.dumps(c) for c in contexts),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.splitlines()]


@pytest.mark.parametrize("name", sorted(TOKENS))
def test_published_templates_render_as_transformers(name: str) -> None:
    path = DATA / f"{name}.jinja"
    template = path.read_text(encoding="utf-8")
    contexts = []
    for conv in CONVERSATIONS:
        ctx = {
            "messages": conv["messages"],
            "tools": conv.get("tools"),
            "documents": None,
            "add_generation_prompt": conv.get("add_generation_prompt", True),
            "bos_token": TOKENS[name]["bos_token"] or "",
            "eos_token": TOKENS[name]["eos_token"] or "",
        }
        contexts.append(ctx)
    for _attempt in range(2):  # strftime_now: both renders on the same day
        day = time.strftime("%Y-%m-%d")
        got = spillway_render(path, contexts)
        want = [transformers_render(template, c) for c in contexts]
        if time.strftime("%Y-%m-%d") == day:
            break
    rendered = 0
    for ctx, g, (text, error) in zip(contexts, got, want, strict=True):
        if error is not None:
            assert "error" in g, (name, ctx["messages"], g)
            continue
        assert g.get("text") == text, (name, ctx["messages"], g.get("error"))
        rendered += 1
    # Each renders some (the tool-use templates of Command-R+ and Hermes 3 need tools).
    assert rendered >= 2, (name, rendered)


def test_a_template_beyond_the_subset_is_refused_naming_the_construct(tmp_path: Path) -> None:
    for source, named in [
        ("{% for m in messages %}{% include 'x' %}{% endfor %}", "the statement 'include'"),
        ("{{ messages | pprint }}", "the filter 'pprint'"),
        ("{% if x is escaped %}{% endif %}", "the test 'escaped'"),
        ("{% for m in messages %}", "ends inside a block"),
    ]:
        path = tmp_path / "t.jinja"
        path.write_text(source)
        r = subprocess.run(
            [str(Path(BUILD) / "bin" / "spillway"), "chat-template", "--template", str(path)]
            + ["--jsonl", "-"],
            input="{}",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1, (source, r.stdout)
        assert named in r.stderr, (source, r.stderr)

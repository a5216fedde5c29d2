"""The README's serving start: the OpenAI client against `spillway serve`.

  python examples/serve/chat.py [--url http://127.0.0.1:8000/v1] [--model tiny-qwen]

Waits up to 30 s for the server to listen, lists its models, then asks for a chat
completion, whole and streamed (greedy: temperature 0, so the reply is the same every run).
"""

import argparse
import time

from openai import APIConnectionError, OpenAI

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
ap.add_argument("--model", default="tiny-qwen")
args = ap.parse_args()

client = OpenAI(base_url=args.url, api_key="unused", max_retries=0)
for _ in range(300):  # the server may still be loading
    try:
        models = [m.id for m in client.models.list().data]
        break
    except APIConnectionError:
        time.sleep(0.1)
else:
    raise SystemExit(f"no server at {args.url}: start it with `spillway serve --models DIR`")
print("models:", ", ".join(models))

messages = [{"role": "user", "content": "Say something about the sea."}]
r = client.chat.completions.create(
    model=args.model, messages=messages, max_tokens=12, temperature=0
)
print(
    "reply:",
    repr(r.choices[0].message.content),
    f"({r.choices[0].finish_reason},",
    f"{r.usage.prompt_tokens} prompt tokens, {r.usage.completion_tokens} completion tokens)",
)
stream = client.chat.completions.create(
    model=args.model, messages=messages, max_tokens=12, temperature=0, stream=True
)
text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
print("streamed:", repr(text))

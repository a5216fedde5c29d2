"""The OpenAI client against `spillway serve` on loopback (Note [Chat completions], Note [Text
out], Note [Model text]): a tiny random Qwen2 model saved by transformers beside a real
tokenizer and chat template (Qwen2.5's, data/tokenizers/qwen2.5), served as a Hugging Face
directory is downloaded; models.list and models.retrieve; chat.completions.create and
completions.create with text, streamed and not, equal to transformers' generate() from
apply_chat_template's (or the tokenizer's) ids, decoded; an EOS from generation_config.json
ending the reply; stop strings ending the text before them."""

from __future__ import annotations

import lzma
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_serve_hf import serve, tiny

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

DATA = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "qwen2.5"
EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something about the sea, 海."},
]


def model_dir(root: Path) -> Path:
    """A tiny Qwen2 with Qwen2.5's tokenizer, chat template and EOS tokens, as downloaded."""
    d = root / "models" / "qwen-chat"
    model = tiny("qwen2", 41, tied=True, vocab_size=151936)
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(d, safe_serialization=True)
    (d / "tokenizer.json").write_bytes(lzma.decompress((DATA / "tokenizer.json.xz").read_bytes()))
    shutil.copy(DATA / "tokenizer_config.json", d / "tokenizer_config.json")
    return d


def reference(d: Path, ids: list[int], n: int) -> tuple[str, str]:
    """transformers' greedy continuation of `ids`: its text (special tokens skipped) and
    finish reason."""
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=0
        )
    new = out[0, len(ids) :].tolist()
    stopped = bool(new) and new[-1] in EOS
    return tok.decode(new, skip_special_tokens=True), "stop" if stopped else "length"


def test_the_openai_client_talks_to_spillway_serve(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    chat_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(chat_ids, list):  # transformers 5 returns a BatchEncoding
        chat_ids = chat_ids["input_ids"]
    want_chat, want_chat_finish = reference(d, chat_ids, 12)
    prompt = "The sea is"
    want_text, want_text_finish = reference(d, tok(prompt)["input_ids"], 10)
    proc, url = serve(tmp_path / "models", tmp_path)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["qwen-chat"]
        assert client.models.retrieve("qwen-chat").id == "qwen-chat"

        r = client.chat.completions.create(
            model="qwen-chat",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
        )
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == want_chat
        assert r.choices[0].finish_reason == want_chat_finish
        assert r.usage is not None and r.usage.prompt_tokens == len(chat_ids)

        chunks = list(
            client.chat.completions.create(
                model="qwen-chat",
                messages=MESSAGES,
                max_completion_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want_chat
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == want_chat_finish
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(chat_ids)

        c = client.completions.create(
            model="qwen-chat", prompt=prompt, max_tokens=10, temperature=0
        )
        assert c.choices[0].text == want_text
        assert c.choices[0].finish_reason == want_text_finish
        streamed = client.completions.create(
            model="qwen-chat", prompt=prompt, max_tokens=10, temperature=0, stream=True
        )
        assert "".join(x.choices[0].text for x in streamed) == want_text

        # A stop string ends the text before it (Note [Text out]).
        assert len(want_chat) > 4, want_chat  # the fixed seed's reply: room for a stop string
        stop = want_chat[2:4]
        s = client.chat.completions.create(
            model="qwen-chat",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stop=[stop],
        )
        assert s.choices[0].message.content == want_chat[: want_chat.find(stop)]
        assert s.choices[0].finish_reason == "stop"

        # What the server does not do is refused by name, through the client's error.
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.chat.completions.create(
                model="qwen-chat",
                messages=MESSAGES,
                logprobs=True,
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0

"""spillway's tokenizer (`spillway tokenize`, include/spillway/text/tokenizer.hpp) against the
`tokenizers` package, byte for byte: the real tokenizer.json files of data/tokenizers/ (GPT-2,
Phi-2, Qwen2.5, Phi-3 / Llama 2, Falcon) and tokenizers trained here with the package (byte-level
and SentencePiece-style BPE with the options real files use), over a corpus of multilingual
text, emoji, code, whitespace runs and special-token strings in user text: the ids with and
without the special tokens, the decoded text with and without them, decoding of random ids
(byte-fallback pieces that are not whole characters included), and the streamed pieces, which
never hold half a character and add up to the decoded text (Note [Streaming detokenization])."""

from __future__ import annotations

import json
import lzma
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

tokenizers = pytest.importorskip("tokenizers")

BUILD = os.environ.get("SPILLWAY_BUILD", "")
pytestmark = pytest.mark.skipif(not BUILD, reason="needs SPILLWAY_BUILD (the CLI's build tree)")
DATA = Path(__file__).resolve().parents[2] / "data" / "tokenizers"
REAL = ["gpt2", "phi2", "qwen2.5", "phi3", "falcon"]

CORPUS = [
    "Hello world! How are you doing today?",
    "Grüße, naïve café — déjà vu; Ñandú; İstanbul; ǅemal; ß→SS",
    "你好，世界。今天天气很好！こんにちは、元気ですか？안녕하세요 여러분",
    "Привет, мир! Γειά σου Κόσμε! שלום עולם مرحبا بالعالم नमस्ते दुनिया สวัสดีชาวโลก",
    "emoji: 🙂🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ ✨ 🤖",
    "e\u0301 vs é, A\u030a vs Å, ﬁ ligature, ① ② ③, ＡＢＣ full width, x² and H₂O",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '{"key": [1, 2.5e-3, null], "s": "a\\tb"}  // a comment\n\tint x = 0x1F; x <<= 2;',
    "    four spaces\n\n\n\ttab\t\ttabs\r\nwindows\u3000ideographic\u00a0nbsp   trailing   ",
    " ",
    "",
    "\n",
    "1234567890 3.14159 1,000,000 2024-11-27 12:34:56 +1-555-0100",
    "user text with <|endoftext|> and <|im_start|>assistant<|im_end|> and <s> </s> [INST]",
    "<|user|>\nhello<|end|>\n<|assistant|>\n>>TITLE<< >>ABSTRACT<<",
    "it's they're we've I'm you'll he'd IT'S THEY'RE",
    "a" * 300 + " " + "ab" * 150,
    "Mixed: The 3rd of March, 2021 — résumé №5 costs €12.50 (≈ $13)!!! ???",
]


def materialize(name: str, tmp: Path) -> Path:
    path = tmp / f"{name}.json"
    path.write_bytes(lzma.decompress((DATA / name / "tokenizer.json.xz").read_bytes()))
    return path


def run(tokenizer: Path, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = subprocess.run(
        [str(Path(BUILD) / "bin" / "spillway"), "tokenize", "--tokenizer", str(tokenizer)]
        + ["--jsonl", "-"],
        input="\n".join(json.dumps(x) for x in lines),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.splitlines()]


def assert_parity(path: Path, corpus: list[str]) -> None:
    ref = tokenizers.Tokenizer.from_file(str(path))
    enc = [{"text": t, "add_special_tokens": s} for t in corpus for s in (True, False)]
    for q, got in zip(enc, run(path, enc), strict=True):
        want = ref.encode(q["text"], add_special_tokens=q["add_special_tokens"]).ids
        assert got["ids"] == want, (path.name, q)
    # Decoding: the corpus's ids, and random ids (pieces of characters included).
    rng = random.Random(7)
    vocab = ref.get_vocab_size(with_added_tokens=True)
    id_lists = [ref.encode(t).ids for t in corpus]
    id_lists += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(40)]
    dec = [{"ids": ids, "skip_special_tokens": s} for ids in id_lists for s in (False, True)]
    for q, got in zip(dec, run(path, dec), strict=True):
        want = ref.decode(q["ids"], skip_special_tokens=q["skip_special_tokens"])
        assert got["text"] == want, (path.name, q)
        # Note [Streaming detokenization]: whole characters, adding up to the text.
        assert "".join(got["stream"]) == want, (path.name, q)
        for piece in got["stream"][:-1]:
            assert not piece.endswith("\ufffd") or piece == "\ufffd" * len(piece), (q, piece)


@pytest.mark.parametrize("name", REAL)
def test_real_tokenizers_encode_and_decode_as_the_package(name: str, tmp_path: Path) -> None:
    assert_parity(materialize(name, tmp_path), CORPUS)


def trained(kind: str, tmp: Path) -> Path:
    """A tokenizer trained here by the package on the corpus, in one of the forms real files
    take (`kind`)."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    if kind.startswith("bytelevel"):
        tok = tokenizers.Tokenizer(models.BPE(ignore_merges=kind == "bytelevel-ignore-merges"))
        if kind == "bytelevel-split":  # Llama 3's and Qwen's form: a Split regex, then bytes
            tok.normalizer = normalizers.NFKC()
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(
                        tokenizers.Regex(
                            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                        ),
                        behavior="isolated",
                    ),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(
                add_prefix_space=kind == "bytelevel-prefix"
            )
        if kind == "bytelevel-lower":
            tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel()]
            )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    else:  # SentencePiece-style with byte fallback: Metaspace (first, always) or legacy
        tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        if kind == "metaspace-legacy":
            tok.normalizer = normalizers.Sequence(
                [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
            )
            tok.decoder = decoders.Sequence(
                [
                    decoders.Replace("▁", " "),
                    decoders.ByteFallback(),
                    decoders.Fuse(),
                    decoders.Strip(" ", 1, 0),
                ]
            )
        else:
            scheme = "first" if kind == "metaspace-first" else "always"
            split = kind == "metaspace-split"
            tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme, split=split)
            tok.decoder = decoders.Sequence(
                [
                    decoders.Metaspace(prepend_scheme=scheme, split=split),
                    decoders.ByteFallback(),
                    decoders.Fuse(),
                ]
            )
        bytes_ = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=special + bytes_)
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    path = tmp / f"{kind}.json"
    tok.save(str(path))
    return path


@pytest.mark.parametrize(
    "kind",
    [
        "bytelevel",
        "bytelevel-prefix",
        "bytelevel-ignore-merges",
        "bytelevel-split",
        "bytelevel-lower",
        "metaspace-first",
        "metaspace-always",
        "metaspace-split",
        "metaspace-legacy",
    ],
)
def test_trained_tokenizers_encode_and_decode_as_the_package(kind: str, tmp_path: Path) -> None:
    assert_parity(trained(kind, tmp_path), CORPUS)


def test_what_the_tokenizer_does_not_implement_is_refused_naming_it(tmp_path: Path) -> None:
    from tokenizers import models

    tok = tokenizers.Tokenizer(models.Unigram([("a", -1.0), ("<unk>", -2.0)], 1))
    path = tmp_path / "unigram.json"
    tok.save(str(path))
    r = subprocess.run(
        [str(Path(BUILD) / "bin" / "spillway"), "tokenize", "--tokenizer", str(path)]
        + ["--text", "a"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, r.stdout
    assert 'model type "Unigram" is not supported' in r.stderr, r.stderr

"""Tokenizer throughput: spillway's (`spillway tokenize --bench`) against the `tokenizers`
package in the same run, single thread, on a 1 MB text (Python's standard library sources,
code and prose, with a tenth of multilingual text and emoji), for each real tokenizer of
data/tokenizers/. Prints tokens/s of both, the ratio (goal: spillway within 2x of the package),
and checks the ids are the same. Best of --repeat runs each (both cache repeated words of
up to 256 bytes), and the first runs' ratio (cold caches).

    python bench/text/bench_tokenizer.py [--build build] [--repeat 3] [--mb 1]
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "tokenizers"
MULTILINGUAL = (
    "Grüße, naïve café — déjà vu. 你好，世界。今天天气很好！こんにちは、元気ですか？"
    "안녕하세요 여러분. Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم नमस्ते दुनिया "
    "🙂🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷 1234567890 3.14159\n"
)


def corpus(mb: float) -> str:
    """`mb` MB of text: the standard library's sources in a fixed order, a tenth multilingual."""
    target = int(mb * 1e6)
    parts: list[str] = []
    size = 0
    lib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(lib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        parts.append(MULTILINGUAL * max(1, len(text.encode()) // (9 * len(MULTILINGUAL.encode()))))
        size += len(text.encode()) * 10 // 9
        if size >= target:
            break
    out = "".join(parts).encode()[:target].decode("utf-8", errors="ignore")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mb", type=float, default=1.0)
    args = ap.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import tokenizers  # noqa: PLC0415 (the benchmark's baseline, installed with the tests)

    text = corpus(args.mb)
    cli = Path(args.build) / "bin" / "spillway"
    print(
        f"tokenizer throughput: {len(text.encode()) / 1e6:.2f} MB of text, single thread, best of "
        f"{args.repeat} (tokenizers {tokenizers.__version__})"
    )
    print(
        f"{'tokenizer':<10} {'tokens':>9} {'spillway tok/s':>15} {'package tok/s':>14} "
        f"{'ratio':>6} {'cold ratio':>10}"
    )
    worst = float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        corpus_path = Path(tmp) / "corpus.txt"
        corpus_path.write_text(text, encoding="utf-8")
        for name in sorted(p.name for p in DATA.iterdir() if p.is_dir()):
            tok_path = Path(tmp) / f"{name}.json"
            tok_path.write_bytes(lzma.decompress((DATA / name / "tokenizer.json.xz").read_bytes()))
            ref = tokenizers.Tokenizer.from_file(str(tok_path))
            best = float("inf")
            first = 0.0
            for run in range(args.repeat):
                t0 = time.perf_counter()
                ids = ref.encode(text).ids
                best = min(best, time.perf_counter() - t0)
                if run == 0:
                    first = time.perf_counter() - t0
            r = subprocess.run(
                [str(cli), "tokenize", "--tokenizer", str(tok_path), "--bench", str(corpus_path)]
                + ["--repeat", str(args.repeat)],
                capture_output=True,
                text=True,
                check=True,
            )
            ours = json.loads(r.stdout)
            same = subprocess.run(
                [str(cli), "tokenize", "--tokenizer", str(tok_path), "--jsonl", "-"],
                input=json.dumps({"text": text}),
                capture_output=True,
                text=True,
                check=True,
            )
            if json.loads(same.stdout)["ids"] != ids:
                print(f"{name}: the ids differ from the package's", file=sys.stderr)
                return 1
            theirs = len(ids) / best
            ratio = ours["tokens_per_s"] / theirs
            cold = ours["first_tokens_per_s"] / (len(ids) / first)
            worst = min(worst, ratio, cold)
            print(
                f"{name:<10} {len(ids):>9} {ours['tokens_per_s']:>15,.0f} {theirs:>14,.0f} "
                f"{ratio:>5.2f}x {cold:>9.2f}x"
            )
    print(f"worst ratio {worst:.2f}x, warm or cold (goal >= 0.5x: within 2x of the package)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

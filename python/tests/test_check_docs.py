"""scripts/check_docs.py, the doc test: its parser, its masks and its verdicts on small
fixtures, a deliberate mismatch among them (it must fail, naming the file and line)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
E = "\u2026"


def load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_docs", ROOT / "scripts/check_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_docs"] = module
    spec.loader.exec_module(module)
    return module


cd = load_checker()

FIXTURE = f"""# a page

```sh
echo not run
```

```console
$ echo one
one
$ printf 'a\\nb \\n' \\
    && echo c
a
b
c
```

<!-- doc-test: skip: needs a GPU -->
```console
$ nvidia-smi
{E}
```

```text
$ not a command
```
"""


def test_parser_finds_console_blocks_commands_outputs_and_skips() -> None:
    blocks = cd.parse_markdown(FIXTURE, "page.md")
    assert [(b.line, b.skip) for b in blocks] == [(7, None), (18, "needs a GPU")]
    one, two = blocks[0].commands
    assert (one.text, one.line, one.expected, one.expected_line) == ("echo one", 8, ["one"], 9)
    assert two.text == "printf 'a\\nb \\n' \\\n    && echo c"
    assert (two.line, two.expected, two.expected_line) == (10, ["a", "b", "c"], 12)
    assert blocks[1].commands[0].expected == [E]


def test_output_before_the_first_command_is_an_error() -> None:
    with pytest.raises(ValueError, match="line 2: output before"):
        cd.parse_markdown("```console\nstray\n$ true\n```\n", "bad.md")


def test_an_ellipsis_in_a_line_matches_any_text_on_that_line() -> None:
    assert cd.line_matches(f"step 1 {E} ms, loss 4.1", "step 1 12.34 ms, loss 4.1")
    assert cd.line_matches(f"{E}", "anything at all")
    assert cd.line_matches(f"took {E}", "took ")
    assert not cd.line_matches(f"step 1 {E} ms, loss 4.1", "step 1 12.34 ms, loss 4.2")
    assert not cd.line_matches("a.c", "abc")  # the rest is literal, not a regex


def test_a_lone_ellipsis_matches_any_number_of_lines() -> None:
    assert cd.outputs_match(["head", E, "tail"], ["head", "tail"])
    assert cd.outputs_match(["head", E, "tail"], ["head", "x", "y", "tail"])
    assert cd.outputs_match([E], [])
    assert not cd.outputs_match(["head", E, "tail"], ["head", "x"])
    assert not cd.outputs_match(["a", "b"], ["a", "b", "c"])  # no extra lines unless masked


def test_the_diff_shows_the_markdown_line_and_both_sides() -> None:
    text = cd.diff(["loss 4.1", E, "peak 2 MB"], ["loss 4.1", "x", "peak 3 MB"], "p.md", 40)
    assert "--- p.md (expected, line 40)" in text
    assert "@@ p.md:40 @@" in text
    assert "-peak 2 MB" in text and "+peak 3 MB" in text
    assert f" {E}" in text


def run_checker(tmp_path: Path, page: str) -> subprocess.CompletedProcess[str]:
    build = tmp_path / "build"
    (build / "bin").mkdir(parents=True)
    fake = build / "bin" / "spillway"
    fake.write_text('#!/bin/sh\necho spillway stand-in "$@"\n')
    fake.chmod(0o755)
    md = tmp_path / "page.md"
    md.write_text(page)
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/check_docs.py"), "--build", str(build), str(md)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_passing_page_exits_0_and_lists_its_skips(tmp_path: Path) -> None:
    page = FIXTURE + f"\n```console\n$ spillway plan\nspillway stand-in {E}\n```\n"
    r = run_checker(tmp_path, page)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "skip " in r.stdout and "needs a GPU" in r.stdout
    assert "3 command(s) run, 0 mismatch(es), 1 block(s) skipped" in r.stdout


def test_a_deliberate_mismatch_fails_naming_the_file_and_line(tmp_path: Path) -> None:
    page = "text\n\n```console\n$ echo 2 + 2\n2 + 2\n$ echo four\n5\n```\n"
    r = run_checker(tmp_path, page)
    assert r.returncode == 1, r.stdout + r.stderr
    assert ":6: $ echo four" in r.stdout
    assert "@@ " in r.stdout and "page.md:7 @@" in r.stdout
    assert "-5" in r.stdout and "+four" in r.stdout
    assert "1 mismatch(es)" in r.stdout


def test_commands_run_in_a_copy_and_never_write_the_checkout(tmp_path: Path) -> None:
    # A command that overwrites a committed file writes the copy's, which the next command
    # of its block sees; the checkout's README.md is untouched.
    before = (ROOT / "pyproject.toml").read_bytes()
    page = "```console\n$ echo x > pyproject.toml && cat pyproject.toml\nx\n```\n"
    r = run_checker(tmp_path, page)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (ROOT / "pyproject.toml").read_bytes() == before


def test_a_python_example_is_skipped_when_the_build_has_no_extension(tmp_path: Path) -> None:
    page = "```console\n$ python -c 'print(1)'\n2\n```\n"
    r = run_checker(tmp_path, page)  # the stand-in build has no build/python/spillway
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the build has no Python extension" in r.stdout
    assert "0 command(s) run, 0 mismatch(es), 1 block(s) skipped" in r.stdout

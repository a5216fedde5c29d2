#!/usr/bin/env python3
"""Runs the checked examples of README.md and docs/ (and docs/guide/) and compares their output.

The format is docs/writing-docs.md's: a fenced block whose info string is `console` is a
checked example; a line starting with `$ ` is a command (continued on the next line by a
trailing ` \\`), the lines after it up to the next command or the block's end are its
expected output (stdout and stderr together, trailing spaces stripped); `…` inside a line
matches any text on that line, a line that is only `…` any number of lines; an exit status
is not compared. `<!-- doc-test: skip: REASON -->` on the line before the fence skips the
block, and the checker lists it with its reason.

Where the commands run: each block in a fresh temporary copy of the repository's files
(`git ls-files`: the tracked ones and the untracked ones not ignored), its commands in
order in that copy's root, so a command may write files (`--json plan.json`, `--svg
docs/img/...`) and a later command of the same block read them, and nothing a command
writes can touch the checkout. PATH starts with the build's
bin/ (so `spillway` is the built binary), then the Python environment's bin/ (so `python`
is its interpreter); PYTHONPATH and SPILLWAY_BUILD name the build's Python package.

Exit status: 0 when every checked command printed what its block says, 1 on any mismatch
(each reported as a diff naming the file and line), 2 on a usage error.

    python scripts/check_docs.py [--build build] [--python PY] [--list] [FILE.md ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ELLIPSIS = "\u2026"
SKIP_MARK = re.compile(r"^\s*<!--\s*doc-test:\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")


@dataclasses.dataclass
class Command:
    """One `$ ` command of a block and the output the block expects of it."""

    text: str  # the command as bash reads it (continuation lines included)
    line: int  # 1-based line of the `$ ` in the Markdown file
    expected: list[str]  # the expected lines, trailing spaces stripped
    expected_line: int  # 1-based line of the first expected line


@dataclasses.dataclass
class Block:
    """A `console` block of a Markdown file."""

    path: str
    line: int  # 1-based line of the opening fence
    commands: list[Command]
    skip: str | None  # the reason, when the block is skipped


def parse_markdown(text: str, path: str = "<text>") -> list[Block]:
    """The `console` blocks of a Markdown text, in order, with their skip reasons."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info")
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if info != "console":
            continue
        skip = None
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        if prev >= 0:
            sm = SKIP_MARK.match(lines[prev])
            if sm:
                skip = sm.group("reason") or "no reason given"
        blocks.append(Block(path, start + 1, parse_console(body, start + 2), skip))
    return blocks


def parse_console(body: list[str], first_line: int) -> list[Command]:
    """The commands of a console block's body; first_line is the body's first line."""
    commands: list[Command] = []
    j = 0
    while j < len(body):
        line = body[j]
        if not line.startswith("$ "):
            if commands:
                commands[-1].expected.append(line.rstrip())
            elif line.strip():
                raise ValueError(
                    f"line {first_line + j}: output before the block's first `$ ` command: {line!r}"
                )
            j += 1
            continue
        cmd_line = first_line + j
        parts = [line[2:]]
        while parts[-1].endswith("\\") and j + 1 < len(body):
            j += 1
            parts.append(body[j])
        j += 1
        commands.append(Command("\n".join(parts), cmd_line, [], first_line + j))
    for c in commands:
        while c.expected and not c.expected[-1]:
            c.expected.pop()
    return commands


def line_matches(pattern: str, actual: str) -> bool:
    """Whether an actual line matches an expected line, where `…` matches any text."""
    if ELLIPSIS not in pattern:
        return pattern == actual
    regex = ".*".join(re.escape(p) for p in pattern.split(ELLIPSIS))
    return re.fullmatch(regex, actual, flags=re.DOTALL) is not None


def align(expected: list[str], actual: list[str]) -> list[tuple[str, int, int]]:
    """A least-edit alignment of the expected lines with the actual ones.

    Returns ops in order: ("=", i, j) a match, ("…", i, j) actual[j] taken by the lone `…`
    at expected[i], ("~", i, j) expected[i] printed as actual[j], ("-", i, -1) an expected
    line missing, ("+", -1, j) an extra actual line. The output matches exactly when every
    op is "=" or "…". A lone `…` takes lines at a small cost, so that a diff shows a changed
    line after it as changed rather than as taken by the mask.
    """
    edit, take = 1000, 1  # a changed, missing or extra line; a line a lone `…` takes
    n, m = len(expected), len(actual)
    inf = edit * (n + m + 1)
    # cost[i][j]: the cheapest alignment of expected[i:] with actual[j:]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cost[n][m] = 0

    def moves(i: int, j: int) -> list[tuple[int, str, int, int]]:
        """(cost, op, next i, next j) of each move from (i, j)."""
        out: list[tuple[int, str, int, int]] = []
        if i < n and expected[i] == ELLIPSIS:
            out.append((cost[i + 1][j], "skip", i + 1, j))
            if j < m:
                out.append((cost[i][j + 1] + take, ELLIPSIS, i, j + 1))
            return out
        if i < n and j < m:
            if line_matches(expected[i], actual[j]):
                out.append((cost[i + 1][j + 1], "=", i + 1, j + 1))
            out.append((cost[i + 1][j + 1] + edit, "~", i + 1, j + 1))
        if i < n:
            out.append((cost[i + 1][j] + edit, "-", i + 1, j))
        if j < m:
            out.append((cost[i][j + 1] + edit, "+", i, j + 1))
        return out

    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i < n or j < m:
                cost[i][j] = min(c for c, _, _, _ in moves(i, j))
    ops: list[tuple[str, int, int]] = []
    i = j = 0
    while i < n or j < m:
        _, op, ni, nj = min(moves(i, j), key=lambda mv: mv[0])
        if op != "skip":
            ops.append((op, i if op != "+" else -1, j if op != "-" else -1))
        i, j = ni, nj
    return ops


def outputs_match(expected: list[str], actual: list[str]) -> bool:
    """Whether the actual lines are what the expected lines (with their masks) say."""
    return all(op in ("=", ELLIPSIS) for op, _, _ in align(expected, actual))


def diff(
    expected: list[str], actual: list[str], path: str, first_line: int, context: int = 3
) -> str:
    """A unified diff of a mismatch: `-` lines as the Markdown file has them (its line
    numbers in the hunk headers), `+` lines as the command printed them. Lines a lone `…`
    took are shown as one ` …` context line."""
    ops = align(expected, actual)
    rows: list[tuple[str, str, int]] = []  # (mark, text, markdown line or -1)
    for k, (op, i, j) in enumerate(ops):
        if op == "=":
            rows.append((" ", actual[j], first_line + i))
        elif op == ELLIPSIS:
            if k == 0 or ops[k - 1][0] != ELLIPSIS:
                rows.append((" ", ELLIPSIS, first_line + i))
        elif op == "~":
            rows.append(("-", expected[i], first_line + i))
            rows.append(("+", actual[j], -1))
        elif op == "-":
            rows.append(("-", expected[i], first_line + i))
        else:
            rows.append(("+", actual[j], -1))
    changed = [k for k, r in enumerate(rows) if r[0] != " "]
    out = [f"--- {path} (expected, line {first_line})", "+++ the command's output"]
    k = 0
    while k < len(changed):
        lo = max(0, changed[k] - context)
        hi = min(len(rows), changed[k] + context + 1)
        while k + 1 < len(changed) and changed[k + 1] - context <= hi:
            k += 1
            hi = min(len(rows), changed[k] + context + 1)
        md_lines = [r[2] for r in rows[lo:hi] if r[2] >= 0]
        at = md_lines[0] if md_lines else first_line
        out.append(f"@@ {path}:{at} @@")
        out.extend(f"{mark}{text}" for mark, text, _ in rows[lo:hi])
        k += 1
    return "\n".join(out)


def python_env(root: Path) -> Path | None:
    """The Python environment's folder (scripts/install-python.sh --print), if it exists."""
    try:
        out = subprocess.run(
            ["bash", str(root / "scripts/install-python.sh"), "--print"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return Path(out) if out and Path(out).is_dir() else None


def copy_tracked(root: Path, dest: Path) -> None:
    """A copy of the repository's tracked files under dest (the checkout is never written)."""
    names = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in names:
        if not raw:
            continue
        rel = raw.decode()
        src = root / rel
        if not src.is_file():
            continue  # deleted in the work tree, or a submodule
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def run_block(
    block: Block, root: Path, env: dict[str, str], timeout_s: float
) -> list[tuple[Command, list[str]]]:
    """Runs a block's commands in order in a fresh copy of the repository; their outputs."""
    results: list[tuple[Command, list[str]]] = []
    with tempfile.TemporaryDirectory(prefix="spillway-doc-") as tmp:
        work = Path(tmp) / "repo"
        work.mkdir()
        copy_tracked(root, work)
        for command in block.commands:
            try:
                proc = subprocess.run(
                    ["bash", "-c", command.text],
                    cwd=work,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=timeout_s,
                )
                text = proc.stdout.decode(errors="replace")
            except subprocess.TimeoutExpired as e:
                partial = e.stdout.decode(errors="replace") if e.stdout else ""
                text = partial + f"\n(check_docs: timed out after {timeout_s:.0f} s)"
            lines = [ln.rstrip() for ln in text.split("\n")]
            while lines and not lines[-1]:
                lines.pop()
            results.append((command, lines))
    return results


PYTHON_COMMAND = re.compile(r"(^|[\s;&|(])python3?\b")


def missing_python(block: Block, build: Path) -> str | None:
    """Why a block that runs `python` cannot run with this build, or None when it can."""
    if not any(PYTHON_COMMAND.search(c.text) for c in block.commands):
        return None
    if any((build / "python" / "spillway").glob("_spillway*")):
        return None
    return (
        f"it runs python, and the build has no Python extension ({build}/python/spillway/"
        "_spillway*): configure with the Python environment (make configure)"
    )


def default_files(root: Path) -> list[Path]:
    """README.md, docs/*.md and the user guide's docs/guide/*.md, those that exist."""
    files = [root / "README.md"] if (root / "README.md").is_file() else []
    return files + sorted((root / "docs").glob("*.md")) + sorted((root / "docs/guide").glob("*.md"))


def main(argv: list[str] | None = None) -> int:
    """The command line: check the files' console blocks, report, and exit 0, 1 or 2."""
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "files", nargs="*", type=Path, help="Markdown files (README.md, docs/*.md, docs/guide/*.md)"
    )
    ap.add_argument("--build", type=Path, default=root / "build", help="the CMake build folder")
    ap.add_argument("--python", type=Path, help="the Python environment's folder (its bin/python)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per command")
    ap.add_argument("--list", action="store_true", help="list the blocks, run nothing")
    args = ap.parse_args(argv)

    files = args.files or default_files(root)
    blocks: list[Block] = []
    for f in files:
        shown = os.path.relpath(f.resolve(), root)
        try:
            blocks += parse_markdown(f.read_text(encoding="utf-8"), shown)
        except (OSError, ValueError) as e:
            print(f"check_docs: {shown}: {e}", file=sys.stderr)
            return 2

    if args.list:
        for b in blocks:
            state = f"skip: {b.skip}" if b.skip else f"{len(b.commands)} command(s)"
            print(f"{b.path}:{b.line}: {state}")
        return 0

    build = args.build.resolve()
    if not (build / "bin" / "spillway").is_file():
        print(f"check_docs: no {build}/bin/spillway: build the CLI first", file=sys.stderr)
        return 2
    env = dict(os.environ)
    path = [str(build / "bin")]
    pyenv = args.python or python_env(root)
    if pyenv is not None:
        path.append(str(Path(pyenv).resolve() / "bin"))
    env["PATH"] = os.pathsep.join(path + [env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(build / "python"), env.get("PYTHONPATH", "")] if p
    )
    env["SPILLWAY_BUILD"] = str(build)
    env.setdefault("LC_ALL", "C.UTF-8")

    failures = commands_run = 0
    skipped: list[Block] = []
    started = time.monotonic()
    for b in blocks:
        b.skip = b.skip or missing_python(b, build)
        if b.skip:
            skipped.append(b)
            continue
        t0 = time.monotonic()
        for command, lines in run_block(b, root, env, args.timeout):
            commands_run += 1
            if outputs_match(command.expected, lines):
                continue
            failures += 1
            first = command.text.split("\n")[0]
            print(f"FAIL {b.path}:{command.line}: $ {first}")
            print(diff(command.expected, lines, b.path, command.expected_line))
            print()
        print(
            f"ran  {b.path}:{b.line} ({len(b.commands)} command(s), {time.monotonic() - t0:.1f} s)"
        )
    for b in skipped:
        print(f"skip {b.path}:{b.line}: {b.skip}")
    print(
        f"check_docs: {len(blocks)} console block(s) in {len(files)} file(s): "
        f"{commands_run} command(s) run, {failures} mismatch(es), {len(skipped)} block(s) "
        f"skipped, {time.monotonic() - started:.1f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

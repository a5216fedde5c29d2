#!/usr/bin/env python3
"""The layering rule of docs/architecture.md, checked from the includes (the build runs it).

Each part is a folder of src/ and its public headers are a folder of include/spillway/
(include/spillway/<part>/x.hpp, included as "spillway/<part>/x.hpp": the folder names the
owner). A file of a part may include:
  - its own part's headers, public or private;
  - core's private headers (src/core/: the base every part speaks: JSON, embedded data,
    timing, the arena) and the public headers of core;
  - the public headers (include/spillway/<part>/*.hpp) of the parts it depends on (the arrows
    below, transitively) and nothing else: never another part's src/ header.
bench/ (a leaf over the library, white-box like the tests) may include any part's headers
but never cli/'s; nothing includes cli/. Public headers themselves follow the same arrows
and include no src/ header (they are installed).

The arrows are cmake/arrows.txt's (Note [The arrows]): CMake links by the same table, and
docs/architecture.md's list of them must be it.

Usage: check_layering.py ROOT [--stamp FILE]   exit 1 and one line per violation.
"""
import os
import re
import sys

# Note [The arrows]: part -> the parts it may depend on (direct arrows; the closure is taken
# below), read from the one table CMake links by (cmake/arrows.txt, beside this script's
# tree: a fixture tree under check is held to the project's arrows).
ARROWS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cmake", "arrows.txt")
# docs/architecture.md shows the table in the fenced block after this line, and must agree.
DOCS_MARK = "<!-- the arrows: cmake/arrows.txt, checked by scripts/check_layering.py -->"


def read_arrows(path):
    """The table's lines "part: dep dep", comments and blank lines left out."""
    arrows = {}
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            part, sep, deps = line.partition(":")
            if not sep or not part.strip().isidentifier():
                sys.exit(f"layering: {path}:{n}: {raw.strip()!r} is not 'part: the parts it depends on'")
            arrows[part.strip()] = deps.split()
    for part, deps in arrows.items():
        for d in deps:
            if d not in arrows:
                sys.exit(f"layering: {path}: {part} depends on {d}, which is not a part")
    return arrows


ARROWS = read_arrows(ARROWS_FILE)


def docs_disagree(root):
    """Why docs/architecture.md's list of the arrows is not the table (None: it is)."""
    path = os.path.join(root, "docs", "architecture.md")
    if not os.path.isfile(path):
        return None  # a fixture tree without docs
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if DOCS_MARK not in lines:
        return f"docs/architecture.md: no list of the arrows (a fenced block after {DOCS_MARK})"
    i = lines.index(DOCS_MARK) + 1
    if i >= len(lines) or not lines[i].startswith("```"):
        return f"docs/architecture.md:{i + 1}: the list of the arrows is not a fenced block"
    shown = []
    for line in lines[i + 1:]:
        if line.startswith("```"):
            break
        shown.append(line.strip())
    want = [f"{p}: {' '.join(d)}".rstrip() for p, d in ARROWS.items()]
    if shown != want:
        extra = [x for x in shown if x not in want]
        missing = [x for x in want if x not in shown]
        return (f"docs/architecture.md:{i + 2}: the list of the arrows is not cmake/arrows.txt's "
                f"(shown, not in the table: {extra or 'none'}; in the table, not shown: "
                f"{missing or 'none'}; or their order differs)")
    return None


# src/ folder -> part
FOLDERS = {"hw": "catalog", "model": "catalog"}
# Sockets: public headers that only their part's backends include; every other part uses
# the face (spillway/device/device.hpp for spillway/device/device_backend.hpp). Tests may
# include them.
SOCKETS = {"device/device_backend": "device"}

PLACE = "a public header lives in include/spillway/<part>/"


def owner_of_public(name):
    """The part that owns spillway/NAME.hpp: <part> of NAME = <part>/x (None: no part folder)."""
    part, sep, rest = name.partition("/")
    if not sep or not rest or "/" in rest or part not in ARROWS:
        return None
    return part

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')


def closure(part):
    seen, todo = set(), [part]
    while todo:
        p = todo.pop()
        for d in ARROWS[p]:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen | {"core"}


def part_of_src(folder):
    return FOLDERS.get(folder, folder)


def check_file(path, part, is_public, violations, white_box=False):
    allowed = closure(part) if part else set(ARROWS)
    with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            inc = m.group(1)
            where = f"{path}:{n}: {inc}"
            if inc.startswith("spillway/"):
                name = inc[len("spillway/"):].removesuffix(".hpp")
                owner = owner_of_public(name)
                if owner is None:
                    violations.append(f"{where}: {PLACE} (one of cmake/arrows.txt's parts)")
                elif name in SOCKETS and part != SOCKETS[name]:
                    violations.append(f"{where}: the socket a backend fills; only "
                                      f"{SOCKETS[name]} implements it (use its face)")
                elif owner == "cli":
                    violations.append(f"{where}: nothing depends on cli")
                elif owner != part and owner not in allowed:
                    violations.append(f"{where}: {part or 'bench'} may not depend on {owner}")
                continue
            folder = inc.split("/")[0] if "/" in inc else None
            if (part is not None and folder is None
                    and os.path.isfile(os.path.join(ROOT, "bench", inc))
                    and not os.path.isfile(os.path.join(ROOT, os.path.dirname(path), inc))):
                violations.append(f"{where}: bench/ is a leaf: nothing under src/ includes it")
                continue
            if folder is None or not os.path.isdir(os.path.join(ROOT, "src", folder)):
                continue  # a system header or a header of the including folder
            owner = part_of_src(folder)
            if owner == "cli" and part != "cli":
                violations.append(f"{where}: nothing depends on cli")
            elif is_public:
                violations.append(f"{where}: a public header includes a src/ header")
            elif white_box:
                continue
            elif owner not in (part, "core") and not (owner == "tool" and owner in allowed):
                # tool has no public header: its own src/ headers are its face (the tools')
                violations.append(
                    f"{where}: {part} may include only its own and core's private headers; "
                    f"{owner}'s is private (use include/spillway/<part>/)")


def main():
    global ROOT
    args = sys.argv[1:]
    stamp = None
    if "--stamp" in args:
        i = args.index("--stamp")
        stamp = args[i + 1]
        del args[i:i + 2]
    ROOT = os.path.abspath(args[0] if args else ".")
    violations = []
    src = os.path.join(ROOT, "src")
    for folder in sorted(os.listdir(src)):
        part = part_of_src(folder)
        if part not in ARROWS:
            violations.append(f"src/{folder}: not a known part (add it to cmake/arrows.txt)")
            continue
        for dirpath, _, files in os.walk(os.path.join(src, folder)):
            for fn in sorted(files):
                if fn.endswith((".cpp", ".hpp", ".cu", ".cuh")):
                    check_file(os.path.relpath(os.path.join(dirpath, fn), ROOT), part, False,
                               violations)
    inc = os.path.join(ROOT, "include", "spillway")
    for dirpath, dirs, files in os.walk(inc):
        dirs.sort()
        for fn in sorted(files):
            rel = os.path.relpath(os.path.join(dirpath, fn), inc)
            owner = owner_of_public(rel.removesuffix(".hpp"))
            if owner is None or not fn.endswith(".hpp"):
                violations.append(f"include/spillway/{rel}: {PLACE} (one of cmake/arrows.txt's "
                                  "parts)")
                continue
            check_file(os.path.relpath(os.path.join(dirpath, fn), ROOT), owner, True, violations)
    pysrc = os.path.join(ROOT, "python", "src")
    if os.path.isdir(pysrc):
        for fn in sorted(os.listdir(pysrc)):
            if fn.endswith((".cpp", ".hpp")):
                check_file(os.path.relpath(os.path.join(pysrc, fn), ROOT), "python", False,
                           violations)
    bench = os.path.join(ROOT, "bench")
    if os.path.isdir(bench):
        for fn in sorted(os.listdir(bench)):
            if fn.endswith((".cpp", ".hpp")):
                check_file(os.path.relpath(os.path.join(bench, fn), ROOT), None, False,
                           violations, white_box=True)
    why = docs_disagree(ROOT)
    if why:
        violations.append(why)
    for v in violations:
        print(f"layering: {v}", file=sys.stderr)
    if violations:
        print(f"layering: {len(violations)} violation(s); the arrows are in cmake/arrows.txt "
              "(Note [The arrows]), shown in docs/architecture.md", file=sys.stderr)
        return 1
    if stamp:
        with open(stamp, "w") as f:
            f.write("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

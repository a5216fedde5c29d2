#!/usr/bin/env python3
"""The layering rule of docs/architecture.md, checked from the includes (the build runs it).

Each part is a folder of src/ (and its public headers under include/spillway/). A file of a
part may include:
  - its own part's headers, public or private;
  - core's private headers (src/core/: the base every part speaks: JSON, embedded data,
    timing, the arena) and the public headers of core;
  - the PUBLIC headers (include/spillway/*.hpp) of the parts it depends on (the arrows
    below, transitively) and nothing else: never another part's src/ header.
bench/ (a leaf over the library, white-box like the tests) may include any part's headers
but never cli/'s; nothing includes cli/. Public headers themselves follow the same arrows
and include no src/ header (they are installed).

Usage: check_layering.py ROOT [--stamp FILE]   exit 1 and one line per violation.
"""
import os
import re
import sys

# part -> the parts it may depend on (direct arrows; the closure is taken below).
ARROWS = {
    "core": [],
    "device": ["core"],
    "memory": ["device"],
    "offload": ["memory"],
    "optim": ["memory"],
    "stream": ["memory"],  # layerwise weight streaming (docs/stream.md)
    "catalog": ["core"],  # src/hw + src/model: hardware profiles and model configs
    "probe": ["device", "catalog"],
    "plan": ["catalog"],
    "sim": ["plan"],
    "nn": ["device", "plan"],  # the reference model: the engines only through the socket (hooks.hpp)
    "train": ["nn", "probe", "offload", "optim", "stream"],  # the reference model trained with the engines
    # host-resident serving (docs/serve.md); its trace replay runs on the simulator's engine
    "serve": ["memory", "catalog", "sim"],
    "text": ["core"],  # a model's tokenizer and chat templates
    "inference": ["nn", "serve", "text"],  # the inference engine: the decoder over the serving parts
    "http": ["inference"],  # its front ends: the HTTP endpoint, live replay and load (httplib)
    "cli": ["train", "sim", "probe", "serve", "inference", "http", "text", "tool"],  # a leaf: nothing depends on it
    "tool": ["core"],  # what the spillway tools share (the CLI, spillway-bench): outputs, ranges
    # python/src: the extension module of the Python package, a leaf over the engines'
    # and the planner's public headers (docs/python.md)
    "python": ["offload", "optim", "stream", "plan"],
}
# src/ folder -> part
FOLDERS = {"hw": "catalog", "model": "catalog"}
# public header (include/spillway/NAME.hpp) -> the part that owns it
PUBLIC = {
    "error": "core", "units": "core", "policy": "core",
    "device": "device", "device_math": "device", "hooks": "device", "device_backend": "device",
    "memory": "memory",
    "offload": "offload",
    "optim": "optim",
    "stream": "stream",
    "hardware": "catalog", "model": "catalog", "inventory": "catalog",
    "probe": "probe",
    "plan": "plan", "collectives": "plan", "stream_mode": "plan",
    "sim": "sim",
    "nn": "nn", "decoder": "nn",
    "train": "train",
    "serve": "serve", "hybrid_gemm": "serve", "slices": "serve", "scheduler": "serve", "replay": "serve",
    "inference": "inference", "http_server": "http", "live": "http",
    "tokenizer": "text", "chat_template": "text",
}

# Sockets: public headers that only their part's backends include; every other part uses
# the face (spillway/device.hpp for spillway/device_backend.hpp). Tests may include them.
SOCKETS = {"device_backend": "device"}

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
                owner = PUBLIC.get(name)
                if owner is None:
                    violations.append(f"{where}: unknown public header (add it to PUBLIC)")
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
                    f"{owner}'s is private (use include/spillway/)")


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
            violations.append(f"src/{folder}: not a known part (add it to ARROWS)")
            continue
        for dirpath, _, files in os.walk(os.path.join(src, folder)):
            for fn in sorted(files):
                if fn.endswith((".cpp", ".hpp", ".cu", ".cuh")):
                    check_file(os.path.relpath(os.path.join(dirpath, fn), ROOT), part, False,
                               violations)
    inc = os.path.join(ROOT, "include", "spillway")
    for fn in sorted(os.listdir(inc)):
        name = fn.removesuffix(".hpp")
        if name not in PUBLIC:
            violations.append(f"include/spillway/{fn}: no owning part (add it to PUBLIC)")
            continue
        check_file(os.path.relpath(os.path.join(inc, fn), ROOT), PUBLIC[name], True,
                   violations)
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
    for v in violations:
        print(f"layering: {v}", file=sys.stderr)
    if violations:
        print(f"layering: {len(violations)} forbidden include(s); the arrows are in "
              "scripts/check_layering.py and docs/architecture.md", file=sys.stderr)
        return 1
    if stamp:
        with open(stamp, "w") as f:
            f.write("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

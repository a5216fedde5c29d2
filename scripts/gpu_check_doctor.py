#!/usr/bin/env python3
"""The doctor stage of scripts/gpu-check.sh reads `spillway doctor --json` with this.

Usage: gpu_check_doctor.py DOCTOR_JSON [GPU_NAME]

Prints the report's figures as NAME<TAB>VALUE lines, then one line without a tab: the
verdict. Exits 0 when the report (schema spillway.doctor/1) lists a CUDA device, names the
GPU nvidia-smi named (GPU_NAME, either name containing the other, case ignored) and its
device backend path runs (CUDA, not the host emulation); else 1, the verdict saying why.
Tested on recorded reports: tests/scripts/gpu_check_doctor_test.sh.
"""

import json
import sys


def main(argv):
    if len(argv) < 2:
        print("usage: gpu_check_doctor.py DOCTOR_JSON [GPU_NAME]")
        return 2
    path, want = argv[1], (argv[2] if len(argv) > 2 else "")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        print(f"doctor JSON {path} unreadable: {e}")
        return 1
    if d.get("schema") != "spillway.doctor/1":
        print(f"doctor JSON schema {d.get('schema')!r}, want 'spillway.doctor/1'")
        return 1
    cuda = d.get("cuda") or {}
    devices = cuda.get("devices") or []
    print(f"doctor CUDA driver\t{cuda.get('driver_version') or 'none'}")
    for i, g in enumerate(devices):
        gb = (g.get("bytes_total") or 0) / 1e9
        print(
            f"doctor cuda:{i}\t{g.get('name')} (compute {g.get('compute_capability')}, "
            f"{gb:.1f} GB, PCI {g.get('pci_bus_id')})"
        )
    link = d.get("link") or {}
    if link and not link.get("error"):
        print(
            f"doctor link pinned H2D / D2H GB/s\t{link.get('h2d_pinned_gbps', 0):.1f} / "
            f"{link.get('d2h_pinned_gbps', 0):.1f} ({link.get('backend')})"
        )
    paths = d.get("paths") or []
    for p in paths:
        print(f"doctor path {p.get('name')}\t{'yes' if p.get('runs') else 'no'}: {p.get('detail')}")
    if not devices:
        print(f"doctor names no GPU: {cuda.get('note') or 'no reason given'}")
        return 1
    names = [str(g.get("name") or "") for g in devices]
    if want and not any(
        want.lower() in n.lower() or (n and n.lower() in want.lower()) for n in names
    ):
        print(f"doctor names {', '.join(names)}, not nvidia-smi's {want}")
        return 1
    backend = next((p for p in paths if p.get("name") == "device backend"), None)
    if backend is None or not backend.get("runs"):
        detail = backend.get("detail") if backend else "no 'device backend' path"
        print(f"doctor's device backend is not CUDA: {detail}")
        return 1
    print(f"doctor names {names[0]} and runs the CUDA backend")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python
"""Where a traced TPU step's time goes: the device's operations by kind, and the device's idle gaps.

Reads a ``jax.profiler`` trace (the ``*.trace.json.gz`` that ``scripts/bench/tpu.py --profile --trace-dir DIR``
keeps) and, optionally, the step's optimized HLO (``XLA_FLAGS=--xla_dump_to=D --xla_dump_hlo_as_text``: the
largest ``*after_optimizations.txt`` under D is the train step). Prints, per traced step:

* the device's time by kind of operation: matmuls (fusions holding a ``convolution``), the attention kernels
  (custom calls), stacking copies (``dynamic-update-slice`` fusions: a scan's saved activations and per-layer
  gradients), other copies and transposes, reductions, and the rest (elementwise fusions);
* the busiest operations with what each fusion holds (its output shape and the operations inside);
* the gaps between the device's programs (the device idle) with the host's longest events during each.

It runs where the trace is (the TPU host) and prints a few kilobytes, so only text has to come back.

    python scripts/bench/tpu_trace.py TRACE_DIR [--hlo DUMP_DIR] [--steps N] [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re


def load_events(trace_dir: str) -> tuple:
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise SystemExit(f"error: no *.trace.json.gz under {trace_dir}")
    with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        out.append((procs.get(e.get("pid"), ""), threads.get((e.get("pid"), e.get("tid")), ""), e))
    return out


def parse_hlo(dump_dir: str) -> dict:
    """``{instruction name: (opcode or fusion kind, output shape, {opcode: count} inside)}`` of the largest
    optimized module under ``dump_dir``."""
    paths = glob.glob(os.path.join(dump_dir, "**", "*after_optimizations.txt"), recursive=True)
    if not paths:
        return {}
    text = open(max(paths, key=os.path.getsize)).read()
    comps: dict = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            current = m.group(1)
            comps[current] = collections.Counter()
            continue
        if current and line.startswith("  "):
            m = re.search(r"= [^ ]+ ([\w\-]+)\(", line)
            if m:
                comps[current][m.group(1)] += 1
    info = {}
    for line in text.splitlines():
        m = re.match(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(", line)
        if not m:
            continue
        name, shape, op = m.groups()
        inside = collections.Counter()
        c = re.search(r"calls=%?([\w.\-]+)", line)
        if c and c.group(1) in comps:
            inside = comps[c.group(1)]
        k = re.search(r"kind=(\w+)", line)
        t = re.search(r'custom_call_target="([^"]+)"', line)
        kind = op if not k else f"{op}:{k.group(1)}"
        if t:
            kind = f"custom-call:{t.group(1)}"
        info[name] = (kind, re.sub(r"\{[^}]*\}", "", shape)[:60], inside)
    return info


def category(name: str, hlo: dict) -> str:
    kind, _, inside = hlo.get(name, ("", "", collections.Counter()))
    low = name.lower()
    if "splash" in low or "flash" in low or kind.startswith("custom-call"):
        return "attention kernels (custom calls)"
    if "convolution" in low or inside.get("convolution") or kind == "convolution":
        return "matmuls (convolution fusions)"
    if "dynamic-update-slice" in low or inside.get("dynamic-update-slice"):
        return "stacking (dynamic-update-slice)"
    only_moves = bool(inside) and set(inside) <= {"copy", "transpose", "bitcast", "parameter"}
    if low.startswith(("copy", "transpose")) or kind in ("copy", "transpose") or only_moves:
        return "copies and transposes"
    if "reduce" in low or inside.get("reduce"):
        return "reductions (norms, sums)"
    if low.startswith("while") or low.startswith("conditional") or low.startswith("call"):
        return "(control flow, counted by its contents)"
    return "elementwise and other fusions"


def steps_in_window(module_ms: list) -> float:
    """How many steps a trace window holds, from its program runs' durations (ms): the device's busy time over
    the longest run, the one step the window holds whole (its ends cut the others short)."""
    return sum(module_ms) / max(module_ms) if module_ms else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--hlo", help="the XLA dump folder of the run")
    ap.add_argument("--steps", type=float, default=None,
                    help="steps the trace covers (figures are per step); by default the device's busy time over the "
                         "longest program run, the one step the window holds whole (its ends cut the others short)")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    events = load_events(args.trace_dir)
    hlo = parse_hlo(args.hlo) if args.hlo else {}
    dev = [(t, e) for p, t, e in events if "TPU:0" in p]
    ops = [e for t, e in dev if "XLA Ops" in t]
    modules = sorted((e for t, e in dev if "XLA Modules" in t), key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in modules) / 1e3
    n = args.steps or steps_in_window([e["dur"] / 1e3 for e in modules])
    total = collections.defaultdict(float)
    count = collections.Counter()
    by_cat = collections.defaultdict(float)
    for e in ops:
        total[e["name"]] += e["dur"] / 1e3
        count[e["name"]] += 1
    for name, ms in total.items():
        by_cat[category(name, hlo)] += ms
    print(f"device programs: {busy / n:.1f} ms per step, {n:.2f} steps in {len(modules)} program runs")
    for name, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {ms / n:9.1f} ms  {name}")
    print("busiest operations (ms per step, runs per step, kind, output, inside):")
    for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[: args.top]:
        kind, shape, inside = hlo.get(name, ("", "", collections.Counter()))
        ins = ",".join(f"{k}{'x' + str(v) if v > 1 else ''}" for k, v in inside.most_common(6) if k != "parameter")
        print(f"  {ms / n:8.2f} x{count[name] / n:<5.0f} {name[:44]:<44} {kind[:26]:<26} {shape:<40} {ins[:90]}")
    # The profiler tags each operation with the Python line that made it ("source") and XLA's category.
    by_source = collections.defaultdict(float)
    by_hlo_cat = collections.defaultdict(float)
    moved = collections.defaultdict(float)
    for e in ops:
        a = e.get("args") or {}
        if e["name"].startswith(("while", "conditional", "call")):
            continue
        src = a.get("source") or "(no source)"
        src = "/".join(src.split("/")[-2:])
        by_source[src] += e["dur"] / 1e3
        by_hlo_cat[a.get("hlo_category", "?")] += e["dur"] / 1e3
        try:
            moved[a.get("hlo_category", "?")] += float(a.get("bytes_accessed", 0))
        except ValueError:
            pass
    if by_hlo_cat:
        print("by XLA's category (ms per step, GB moved per step, GB/s):")
        for k, ms in sorted(by_hlo_cat.items(), key=lambda kv: -kv[1]):
            gb = moved[k] / 1e9 / n
            print(f"  {ms / n:9.1f} ms  {gb:7.2f} GB  {gb / (ms / n / 1e3) if ms else 0:7.0f} GB/s  {k}")
        print("by the Python line that made the operation (ms per step):")
        for k, ms in sorted(by_source.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {ms / n:9.1f} ms  {k[:110]}")
    print("device programs and the idle gaps between them:")
    host = [(t, e) for p, t, e in events if "TPU" not in p]
    for a, b in zip(modules, modules[1:] + [None]):
        line = f"  {a['name'][:40]:<40} {a['dur'] / 1e3:9.2f} ms"
        if b is not None:
            gap = (b["ts"] - (a["ts"] + a["dur"])) / 1e3
            line += f"   then idle {gap:7.2f} ms"
            if gap > 1.0:
                lo, hi = a["ts"] + a["dur"], b["ts"]
                during = collections.defaultdict(float)
                for t, e in host:
                    overlap = min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"])
                    if overlap > 0:
                        during[f"{t[:20]}: {e['name'][:60]}"] += overlap / 1e3
                top = sorted(during.items(), key=lambda kv: -kv[1])[:8]
                line += "\n" + "\n".join(f"        host {ms:7.2f} ms  {k}" for k, ms in top)
        print(line)


if __name__ == "__main__":
    main()

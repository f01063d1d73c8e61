#!/usr/bin/env python
"""Compare two training runs' ``metrics.jsonl`` files for what they trained on and what it gave, bit for bit.

Two runs of one config that must read the same data (before and after a change to the data path, say)
log, per step, ``data/fingerprint`` (global indices, sources, source indices and, with
``fingerprint_tokens``, the tokens), ``data/source_counts/*``, ``train/loss``, ``train/grad_norm`` and the
learning rate, and at eval steps every ``eval/*`` figure. This script compares every logged key except
those that measure time (``throughput/*``, ``data/wait_seconds``, anything with ``seconds``): values must
be equal exactly (floats compared as logged, i.e. to the last bit of their JSON repr).

    python scripts/compare_runs.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl [--json out.json]

Prints the number of steps and values compared per kind of key and, if any, the first difference; exits
with status 1 when the runs differ (2 for a missing or unreadable file).
"""

from __future__ import annotations

import argparse
import json
import sys


def timing_key(key: str) -> bool:
    return key.startswith("throughput/") or "seconds" in key


def kind_of(key: str) -> str:
    if key.startswith("eval/"):
        return "eval"
    if key.startswith("data/source_counts/"):
        return "source_counts"
    return key


def load(path: str) -> dict[int, dict]:
    """``{step: {key: value}}`` over every line (a step logged on several lines is merged; a key logged
    twice for one step keeps its last value, as a resumed run's reader would)."""
    out: dict[int, dict] = {}
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                step = row.pop("step")
                out.setdefault(int(step), {}).update({k: v for k, v in row.items() if not timing_key(k)})
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot read the metrics file {path}: {e}. Pass the metrics.jsonl of a finished run.",
              file=sys.stderr)
        sys.exit(2)
    return out


def compare(a: dict[int, dict], b: dict[int, dict]) -> dict:
    """Counts of values compared per kind of key, and the differences (step, key, a, b) in step order."""
    counts: dict[str, int] = {}
    diffs = []
    for step in sorted(set(a) | set(b)):
        ra, rb = a.get(step, {}), b.get(step, {})
        for key in sorted(set(ra) | set(rb)):
            va, vb = ra.get(key, "<missing>"), rb.get(key, "<missing>")
            counts[kind_of(key)] = counts.get(kind_of(key), 0) + 1
            # repr: floats equal as logged to the last bit, and a NaN equals a NaN.
            if repr(va) != repr(vb):
                diffs.append({"step": step, "key": key, "a": va, "b": vb})
    return {"steps": len(set(a) | set(b)), "values": counts, "differences": diffs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="the first run's metrics.jsonl")
    parser.add_argument("b", help="the second run's metrics.jsonl")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    res = compare(load(args.a), load(args.b))
    print(f"{res['steps']} steps compared; values per kind: "
          + ", ".join(f"{k} {n}" for k, n in sorted(res["values"].items())))
    if res["differences"]:
        d = res["differences"][0]
        print(f"DIFFERENT: {len(res['differences'])} values differ; first at step {d['step']}, {d['key']}: "
              f"{d['a']!r} vs {d['b']!r}")
    else:
        print("identical")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())

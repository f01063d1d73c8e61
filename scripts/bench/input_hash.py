#!/usr/bin/env python
"""Benchmark: how fast a cache's input file is hashed (``levanter.ingest.identity.hash_file``).

A token cache records the SHA-256 of each local input file's whole content, and hashes a file again
whenever its size, mtime, ctime or inode changed (or always, with ``cache_options.verify_inputs: full``).
This measures that hash on one file of random bytes (1 GiB; ``--quick``: 256 MiB), in GB/s
(10^9 bytes per second), median over ``--repeats`` with min and max:

* **hash_file**: the streamed hash as a cache check runs it (8 MiB reads into one buffer), the file in
  the page cache (written just before): the hashing speed itself, which is the floor of a check.
* **read only**: the same reads without hashing: what the disk path costs on its own, for comparison.

A file that is not in the page cache is read at the disk's speed on top; on a disk slower than the hash
that is the limit (the figure to compare is the disk's sequential read speed).

Usage::

    .venv/bin/python scripts/bench/input_hash.py                  # 1 GiB file, 3 repeats
    .venv/bin/python scripts/bench/input_hash.py --quick --json out.json
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from _common import parser, write_json

from levanter.ingest.identity import hash_file

QUICK = {"mib": 256, "repeats": 3}
FULL = {"mib": 1024, "repeats": 3}
_BLOCK = 8 * 2**20


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _write(path: str, mib: int) -> None:
    chunk = os.urandom(_BLOCK)
    with open(path, "wb") as f:
        for _ in range(mib * 2**20 // _BLOCK):
            f.write(chunk)


def _read_only(path: str) -> None:
    buf = bytearray(_BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def run(cfg: dict, work: str | None = None) -> dict:
    """Hash a file of ``cfg["mib"]`` MiB ``cfg["repeats"]`` times; figures in GB/s."""
    with tempfile.TemporaryDirectory(dir=work) as d:
        path = os.path.join(d, "input.bin")
        _write(path, cfg["mib"])
        size = os.path.getsize(path)
        _read_only(path)  # into the page cache
        hashed, read = [], []
        for _ in range(cfg["repeats"]):
            t0 = time.perf_counter()
            hash_file(path)
            hashed.append(size / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            _read_only(path)
            read.append(size / (time.perf_counter() - t0) / 1e9)
    return {"bytes": size, "hash_gb_per_s": _stats(hashed), "read_gb_per_s": _stats(read)}


def _fmt(s: dict) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"


def print_section(res: dict) -> None:
    print(f"\nInput hash: SHA-256 of a {res['bytes'] / 2**30:.2f} GiB file in the page cache, GB/s, "
          "median [min, max]")
    print(f"  hash_file  {_fmt(res['hash_gb_per_s'])}")
    print(f"  read only  {_fmt(res['read_gb_per_s'])}")


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a 256 MiB file instead of 1 GiB")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.repeats:
        cfg["repeats"] = args.repeats
    res = run(cfg)
    print_section(res)
    write_json(args.json, res)


if __name__ == "__main__":
    main()

"""Shared by the benchmark scripts in this folder: what every one of them does the same way around its
measurements (command line, load average note, tables, JSON output), so the scripts hold only what they
measure.

Only the standard library is imported, so upstream's venv can import this file too (as it does
``_synthetic.py``). Nothing here is timed: these run before or after the measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parser(doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of the script's docstring ``doc``."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0], **kwargs)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, ``"0.52 0.61 0.70"``: a busy machine skews every figure."""
    return "%.2f %.2f %.2f" % os.getloadavg()


def note_load_average() -> None:
    """``# load average ...`` on stderr, before a measurement starts."""
    print(f"# load average {load_average()}", file=sys.stderr)


def write_json(path: str | None, result, **kwargs) -> None:
    """Write ``result`` as indented JSON to ``path`` (the script's ``--json``); nothing when it is None."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, **kwargs)


def print_table(title: str, columns: list[tuple[str, int]], rows: list[list[str]]) -> None:
    """A fixed-width table on stdout: ``columns`` are ``(header, width)``, cells right-aligned."""
    print()
    print(title)
    header = " ".join(f"{name:>{width}}" for name, width in columns)
    print(header)
    print("-" * len(header))
    for row in rows:
        print(" ".join(f"{cell:>{width}}" for cell, (_, width) in zip(row, columns)))

"""Large allocations on transparent huge pages for the training command, on Linux with glibc.

Why: XLA on CPU allocates each run's temporary buffer with ``malloc`` (~288 MB for the nano GPT-2 train
step at batch 32). glibc serves an allocation that large with a fresh ``mmap`` and unmaps it on
``free``, so every step the kernel faults in the whole buffer as zeroed 4 KiB pages, a large share of
a small model's step on CPU. glibc's tunable ``glibc.malloc.hugetlb=1`` (glibc >= 2.35) makes malloc
ask for transparent huge pages (``madvise``) on the memory it maps, which removes nearly all of those
faults (figures in docs/bench/2026-12-03-cpu-levers.md). Accelerator
runs are unaffected either way (their buffers are the device's), so the setting is harmless there.

glibc reads tunables once, when a process starts, so the training commands (``python -m
levanter.main.train_lm``, ``sft``, ``lora_lm``) re-execute themselves once, before their heavy imports (the
cost of a second interpreter start-up), with the tunable added to ``GLIBC_TUNABLES``. They do not when the
platform is not Linux/glibc >= 2.35, when transparent huge pages are disabled (``never``), when
``GLIBC_TUNABLES`` already sets ``glibc.malloc.hugetlb`` (the user's value wins, and it also ends the
re-execution), or when ``LEVANTER_MALLOC_HUGETLB=0``.
``main(config)`` called from Python is never re-executed.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

__all__ = ["hugepage_tunables", "reexec_with_hugepage_malloc"]

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "LEVANTER_MALLOC_HUGETLB"  # "0" disables the re-execution
MARKER = "LEVANTER_MALLOC_REEXEC"  # set in the re-executed process (for its log line)
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def hugepage_tunables(current: Optional[str], libc_version: Optional[str]) -> Optional[str]:
    """The ``GLIBC_TUNABLES`` value to re-execute with, or None when nothing should change.

    ``libc_version`` is ``os.confstr("CS_GNU_LIBC_VERSION")`` (e.g. ``"glibc 2.36"``).
    """
    if not libc_version or not libc_version.startswith("glibc "):
        return None
    try:
        major, minor = (int(x) for x in libc_version.split()[1].split(".")[:2])
    except ValueError:
        return None
    if (major, minor) < (2, 35):
        return None
    entries = [e for e in (current or "").split(":") if e]
    if any(e.split("=", 1)[0] == TUNABLE for e in entries):
        return None
    return ":".join([*entries, f"{TUNABLE}=1"])


def _thp_possible() -> bool:
    try:
        with open(_THP_ENABLED) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def reexec_with_hugepage_malloc(environ: Mapping[str, str] = os.environ) -> None:
    """Replace this process with the same command and ``glibc.malloc.hugetlb=1``, when that applies."""
    if sys.platform != "linux" or environ.get(OPT_OUT) == "0" or not hasattr(sys, "orig_argv"):
        return
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        return
    tunables = hugepage_tunables(environ.get("GLIBC_TUNABLES"), libc)
    if tunables is None or not _thp_possible():
        return
    env = dict(environ, GLIBC_TUNABLES=tunables, **{MARKER: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)

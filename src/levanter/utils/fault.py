"""Deterministic fault injection for crash-safety tests.

Code that must survive a crash calls :func:`fault_point` at the moments worth testing (between writing
data and committing the ledger, for example). With ``LEVANTER_FAULT_KILL_AT="name:k[,name2:k2]"`` in the
environment, the ``k``-th time the process reaches point ``name`` it SIGKILLs itself -- the same as a
``kill -9`` from outside, but at a reproducible moment. ``LEVANTER_FAULT_SIGNAL=SIGINT`` (any signal
name) sends that signal instead, to test a handler (Ctrl-C at a known step). With
``LEVANTER_FAULT_DELAY="name:seconds[,...]"`` every visit of point ``name`` first sleeps that long, to hold
a moment open (a background checkpoint write that is still running while the next steps train). With
``LEVANTER_FAULT_RAISE="name:k"`` the ``k``-th visit of point ``name`` raises an ``OSError`` (EIO), a
storage error at a known moment (one process's checkpoint write failing in a multi-process run). Unset
(always, in production) they cost three dict lookups.

In-process tests hold a point with :func:`holding`: every thread that reaches it waits until the test
releases it, so a test checks what happens *while* a moment lasts (a save returned, its write not yet
committed) by events rather than by timings.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator

__all__ = ["fault_point", "holding"]

_ENV = "LEVANTER_FAULT_KILL_AT"
_DELAY_ENV = "LEVANTER_FAULT_DELAY"
_RAISE_ENV = "LEVANTER_FAULT_RAISE"
_hits: Counter = Counter()
_raise_hits: Counter = Counter()
_held: dict[str, tuple[threading.Event, threading.Event, float]] = {}  # name -> (reached, release, limit)


def _targets(env: str = _ENV, kind=int) -> dict:
    spec = os.environ.get(env, "")
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.rpartition(":")
        out[name] = kind(value)
    return out


@contextlib.contextmanager
def holding(name: str, *, limit_s: float = 120.0) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold point ``name`` in this process: a thread reaching it sets ``reached`` and waits for ``release``
    (set by the caller, and on leaving the block). ``limit_s`` bounds the wait, so that code which should
    not have waited for the held thread shows up as a failed assertion rather than a hung test."""
    reached, release = threading.Event(), threading.Event()
    _held[name] = (reached, release, limit_s)
    try:
        yield reached, release
    finally:
        release.set()
        _held.pop(name, None)


def fault_point(name: str) -> None:
    held = _held.get(name)
    if held is not None:
        held[0].set()
        held[1].wait(held[2])
    if _DELAY_ENV in os.environ:
        time.sleep(_targets(_DELAY_ENV, float).get(name, 0.0))
    if _RAISE_ENV in os.environ:
        _raise_hits[name] += 1
        if _targets(_RAISE_ENV).get(name) == _raise_hits[name]:
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected at {name})")
    if _ENV not in os.environ:
        return
    _hits[name] += 1
    if _targets().get(name) == _hits[name]:
        os.kill(os.getpid(), signal.Signals[os.environ.get("LEVANTER_FAULT_SIGNAL", "SIGKILL")])

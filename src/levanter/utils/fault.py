"""Deterministic fault injection for crash-safety tests.

Code that must survive a crash calls :func:`fault_point` at the moments worth testing (between writing
data and committing the ledger, for example). With ``LEVANTER_FAULT_KILL_AT="name:k[,name2:k2]"`` in the
environment, the ``k``-th time the process reaches point ``name`` it SIGKILLs itself -- the same as a
``kill -9`` from outside, but at a reproducible moment. ``LEVANTER_FAULT_SIGNAL=SIGINT`` (any signal
name) sends that signal instead, to test a handler (Ctrl-C at a known step). With
``LEVANTER_FAULT_DELAY="name:seconds[,...]"`` every visit of point ``name`` first sleeps that long, to hold
a moment open (a background checkpoint write that is still running while the next steps train). Unset
(always, in production) they cost two dict lookups.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

__all__ = ["fault_point"]

_ENV = "LEVANTER_FAULT_KILL_AT"
_DELAY_ENV = "LEVANTER_FAULT_DELAY"
_hits: Counter = Counter()


def _targets(env: str = _ENV, kind=int) -> dict:
    spec = os.environ.get(env, "")
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.rpartition(":")
        out[name] = kind(value)
    return out


def fault_point(name: str) -> None:
    if _DELAY_ENV in os.environ:
        time.sleep(_targets(_DELAY_ENV, float).get(name, 0.0))
    if _ENV not in os.environ:
        return
    _hits[name] += 1
    if _targets().get(name) == _hits[name]:
        os.kill(os.getpid(), signal.Signals[os.environ.get("LEVANTER_FAULT_SIGNAL", "SIGKILL")])

"""Command-line arguments as every entry point reads them, before draccus or argparse sees them.

Two things argparse gets wrong for dotted config overrides:

- a value that starts with ``-`` but is not a number (``--trainer.checkpointer.save_interval -5s``) is
  taken for a flag, and argparse reports "expected one argument" instead of the value's real problem;
  :func:`join_dash_values` turns such a pair into ``--key=-5s`` so the value is parsed (and refused, naming
  the key, when it is wrong);
- its did-you-mean only compares whole spellings, so ``--save_interval`` or ``--cache_options.backend``
  (a key given without its section) finds nothing; :func:`suggest_key` also looks for the known keys that
  end with what was typed (``--trainer.checkpointer.save_interval``, ``--data.cache_options.backend``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence

__all__ = ["join_dash_values", "key_is_known", "suggest_key"]


def join_dash_values(args: Sequence[str]) -> list[str]:
    """``["--a.b", "-5s"]`` -> ``["--a.b=-5s"]``: a ``--key`` followed by a value starting with a single
    ``-`` (``-5s``, ``-1``, ``-inf``) is one override, not a key and a flag. ``-h`` stays a flag."""
    out: list[str] = []
    args = list(args)
    i = 0
    while i < len(args):
        a = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if (a.startswith("--") and "=" not in a and len(a) > 2 and nxt is not None and nxt.startswith("-")
                and not nxt.startswith("--") and nxt not in ("-h", "-")):
            out.append(f"{a}={nxt}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def _pattern(known_key: str) -> re.Pattern:
    """A known key as a pattern: ``configs.<name>.cache_dir`` matches ``configs.code.cache_dir``."""
    return re.compile(r"[^.]+".join(re.escape(p) for p in known_key.split("<name>")))


def key_is_known(key: str, known: Iterable[str]) -> bool:
    """Whether ``key`` (dotted, no ``--``) names a known key, a section holding some (``cache_options``),
    or a place inside a known key that holds a mapping or a list (``train_weights``)."""
    for k in known:
        if _pattern(k).fullmatch(key) or any(_pattern(k).fullmatch(key[: m.start()]) for m in re.finditer(r"\.", key)):
            return True
        if k.startswith(key + "."):
            return True
    return False


def suggest_key(key: str, known: Iterable[str]) -> str | None:
    """The known key the user most likely meant by ``key`` (dotted, without ``--``), or None: a
    known key that ends with ``key`` (the section left out); else a close spelling of the whole key; else
    one whose last part is a close spelling of ``key``'s last part."""
    known = [k for k in known if "<name>" not in k]
    nested = sorted((k for k in known if k.endswith("." + key)), key=len)
    if nested:
        return nested[0]
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return close[0]
    last = key.rpartition(".")[2]
    by_last: dict[str, list[str]] = {}
    for k in known:
        by_last.setdefault(k.rpartition(".")[2], []).append(k)
    close = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.8)
    if close:
        return sorted(by_last[close[0]], key=len)[0]
    return None

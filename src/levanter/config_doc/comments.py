"""Field descriptions read from the source of the config dataclasses.

A field's description is the comment directly above it in its dataclass (contiguous ``#`` lines; else an
inline ``# ...`` comment, else a string literal right below it, as draccus also reads them).

Trade-off: descriptions come from the source text (``inspect.getsource``), so a config class defined
where no source is available (an interactive session) gets empty descriptions instead of an error.
"""

from __future__ import annotations

import functools
import inspect
import re

__all__ = ["description"]

_FIELD_LINE = re.compile(r"^\s*(\w+)\s*:")


@functools.lru_cache(maxsize=None)
def _class_comments(cls: type) -> dict:
    """``{field name: description}`` for the fields ``cls`` itself declares (not its bases')."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    own = set(cls.__dict__.get("__annotations__", {}))
    indent = None
    out: dict = {}
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("class ")) + 1
    for i, line in enumerate(lines[start:], start=start):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        width = len(line) - len(line.lstrip())
        indent = width if indent is None else indent
        if width != indent:
            continue  # inside a docstring, a method, a nested statement
        m = _FIELD_LINE.match(line)
        if m is None or m.group(1) not in own or m.group(1) in out:
            continue
        above = []
        j = i - 1
        while j >= start and lines[j].strip().startswith("#"):
            above.append(lines[j].strip().lstrip("#").strip())
            j -= 1
        text = " ".join(reversed(above)).strip()
        if not text and "#" in line:
            text = line.split("#", 1)[1].strip()
        if not text:
            text = _docstring_below(lines, i, indent)
        out[m.group(1)] = text
    return out


def _docstring_below(lines: list, i: int, indent: int) -> str:
    """A string literal right after the field declared on line ``i`` (after its continuation lines)."""
    j = i + 1
    while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > indent:
        j += 1
    if j >= len(lines):
        return ""
    first = lines[j].strip()
    quote = first[:3]
    if quote not in ('"""', "'''"):
        return ""
    body = [first[3:]]
    while quote not in body[-1] and j + 1 < len(lines):
        j += 1
        body.append(lines[j].strip())
    return " ".join(" ".join(body).split(quote, 1)[0].split())


def description(cls: type, name: str) -> str:
    """The comment above field ``name`` in the nearest class (of ``cls``'s MRO) that declares it with a
    comment; "" if none. A subclass that redeclares a field only to change its default (``num_layers: int =
    12``) keeps the base class's description; one that comments its redeclaration replaces it."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            text = _class_comments(klass).get(name, "")
            if text:
                return text
    return ""

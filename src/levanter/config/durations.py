"""Durations in configs: ``30s``, ``15m``, ``1h30m``, ``2d`` or a number of seconds, for every
``datetime.timedelta`` field.

The decoder and encoder are registered with draccus when this module is imported (the package
:mod:`levanter.config` imports it), so every entry point's config reads ``save_interval: 15m`` and writes
back the same form.

Trade-off: a unit-less number is accepted only alone or last (``1h 30``? no): it reads as seconds, and a
bare number in the middle of a duration is more likely a typo than an intent.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Sequence
from typing import Any

import draccus

__all__ = ["parse_timedelta"]

_UNITS = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hrs": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_timedelta(value: Any) -> datetime.timedelta:
    """A duration from a config value: ``"15m"``, ``"30s"``, ``"1h"``, ``"2d"``, ``"10min"``, ``"1h30m"``,
    or a plain number (seconds). Raises ValueError for anything else, or a negative duration."""
    if isinstance(value, datetime.timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as '15m' or '30s', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"a duration must be a non-negative number of seconds, got {value!r}")
        return datetime.timedelta(seconds=value)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("-"):
            raise ValueError(f"a duration must not be negative, got {value!r}: use e.g. '30s', '15m' or '1h'")
        seconds, pos = 0.0, 0
        while pos < len(text):
            m = _DURATION_PART.match(text, pos)
            if m is None or m.end() == pos or m.group(2).lower() not in _UNITS:
                break
            if m.group(2) == "" and m.end() != len(text):
                break  # a unit-less number is only allowed alone or last ("1h 30" is not a duration)
            seconds += float(m.group(1)) * _UNITS[m.group(2).lower()]
            pos = m.end()
        else:
            if text:
                return datetime.timedelta(seconds=seconds)
    raise ValueError(
        f"cannot parse {value!r} as a duration: use a number of seconds or a number with a unit "
        "(s, m/min, h, d), e.g. '30s', '15m', '1h', '1h30m'"
    )


def _format_timedelta(td: datetime.timedelta) -> str:
    seconds = td.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _decode_timedelta(raw_value: Any, path: Sequence[str] = ()) -> datetime.timedelta:
    try:
        return parse_timedelta(raw_value)
    except ValueError as e:
        raise draccus.utils.DecodingError(path, str(e)) from None


draccus.decode.register(datetime.timedelta, _decode_timedelta)
draccus.encode.register(datetime.timedelta, lambda td, *_: _format_timedelta(td))


def _decode_str(raw_value: Any, path: Sequence[str] = ()) -> str:
    """A string field takes a YAML scalar (a number becomes its text), never a list or mapping: draccus's
    default ``str(value)`` turned ``[embed, mlp]`` into the string "['embed', 'mlp']", and since equal
    unions share one decoder whatever their order, a ``Union[List[str], str]`` field could get that string
    instead of the list."""
    if isinstance(raw_value, (list, tuple, dict)):
        raise draccus.utils.DecodingError(path, f"expected a string, got {raw_value!r}")
    return str(raw_value)


draccus.decode.register(str, _decode_str)

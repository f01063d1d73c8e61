"""Config keys accepted from upstream configs but refused when set: the ``refused`` field marker and its check.

Upstream Levanter configs carry keys this code does not implement. :func:`refused` declares such a field
so that those configs still parse, and :func:`check_refused` (run by each config's validation before any
work) rejects it, naming the key and what to do instead, when it is set to anything but its default. The
help generator (:mod:`levanter.config_doc`) reads the same marker to list the field as refused, and the
test that every field is read somewhere accepts marked fields without a list to maintain.

This module imports nothing of ``levanter``, so a config dataclass in any part can use the marker without
importing the help generator.

Trade-off: a refused field is compared with its default by ``!=``, so a value equal to the default (an
upstream config spelling out the default) passes silently; that is what "not set" means here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

# The field metadata key holding the reason a field is refused, and the one holding other values accepted.
REFUSED = "levanter.refused"
ALSO_ACCEPTED = "levanter.refused.also_accepted"


def refused(why: str, default: Any = None, *, default_factory: Any = dataclasses.MISSING, also: tuple = ()):
    """A dataclass field accepted so that upstream configs parse, refused by :func:`check_refused` when set
    to anything but its default (or one of ``also``: values that change nothing here, such as upstream's
    own default written out by its exported configs); ``why`` says what to do instead (it ends the error
    message)."""
    metadata = {REFUSED: why, ALSO_ACCEPTED: tuple(also)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value (``dataclasses.MISSING`` if it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def check_refused(config: Any, prefix: str = "") -> None:
    """Raise ``ValueError`` naming the first refused field (see :func:`refused`) set in ``config`` to
    anything but its default, searching nested sections, mappings and lists of sections."""
    for key, f, value in _set_fields(config, prefix):
        if REFUSED in f.metadata and value != field_default(f) and value not in f.metadata.get(ALSO_ACCEPTED, ()):
            raise ValueError(f"{key}={value!r} is not supported: {f.metadata[REFUSED]}")


def _set_fields(obj: Any, prefix: str) -> Iterator[tuple[str, dataclasses.Field, Any]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            key = f"{prefix}.{f.name}" if prefix else f.name
            yield key, f, value
            yield from _set_fields(value, key)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _set_fields(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _set_fields(v, f"{prefix}.{i}" if prefix else str(i))


__all__ = ["REFUSED", "check_refused", "field_default", "refused"]

"""Walking a config class: its keys as rows (type and default in YAML terms, description, refusal),
grouped in sections, one per nested config (per member of a union, per ``type:`` of a choice, per
mapping value).

Trade-off: types and defaults are shown as a user writes them in YAML (``duration (30s, 15m, 1h)``,
``null``), not as Python spells them, so ``--help`` and the reference read like the config files.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import typing
from collections.abc import Sequence
from typing import Any, Optional, Union

import draccus

from ..refused_keys import REFUSED, field_default
from .comments import description

__all__ = [
    "FieldDoc",
    "Section",
    "choice_name",
    "default_text",
    "first_line",
    "is_registry",
    "section_classes",
    "sections",
    "type_text",
]


@dataclasses.dataclass
class FieldDoc:
    """One key: dotted name, type (in YAML terms), default (as YAML), description, refusal (or None)."""

    key: str
    type: str
    default: str
    description: str
    refused: Optional[str] = None
    owner: Optional[type] = None
    name: str = ""


@dataclasses.dataclass
class Section:
    """The keys of one config class at ``prefix`` (``title`` says which, for a union or a choice)."""

    title: str
    prefix: str
    doc: str
    fields: list


def is_registry(t) -> bool:
    return isinstance(t, type) and issubclass(t, draccus.choice_types.ChoiceRegistryBase)


def _members(t) -> list:
    if typing.get_origin(t) is Union:
        return [a for a in typing.get_args(t) if a is not type(None)]
    return [t]


def section_classes(t) -> list:
    """The config classes a field of type ``t`` holds directly (a dataclass, a union of them, a choice)."""
    out = []
    for m in _members(t):
        if typing.get_origin(m) in (tuple, typing.Tuple):
            args = [a for a in typing.get_args(m) if a is not Ellipsis]
            out += [a for a in args if is_registry(a) or dataclasses.is_dataclass(a)]
        elif is_registry(m) or dataclasses.is_dataclass(m):
            out.append(m)
    seen: list = []
    for c in out:
        if c not in seen:
            seen.append(c)
    return seen


def _element_class(t):
    """The config class of the values of a mapping or the items of a list field (``data.configs``), if any."""
    for m in _members(t):
        origin, args = typing.get_origin(m), typing.get_args(m)
        if origin in (dict, typing.Dict) and len(args) == 2 and dataclasses.is_dataclass(args[1]):
            return "mapping", args[1]
        if origin in (list, typing.List) and args and dataclasses.is_dataclass(args[0]):
            return "list", args[0]
    return None


def type_text(t) -> str:
    """A type as a user writes its values: ``int``, ``str or null``, ``list of str``, ``duration``..."""
    if t is type(None):
        return "null"
    if t is datetime.timedelta:
        return "duration (30s, 15m, 1h)"
    if t is Any:
        return "any"
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is Union:
        # Sorted, not in the order written: typing caches a Union by its set of members, so the order
        # get_args gives is that of whichever equal Union was made first in the process.
        text = " or ".join(sorted(type_text(a) for a in args if a is not type(None)))
        return text + " or null" if type(None) in args else text
    if origin in (list, typing.List, Sequence, tuple, typing.Tuple):
        inner = [a for a in args if a is not Ellipsis]
        if origin in (tuple, typing.Tuple) and len(inner) > 1 and Ellipsis not in args:
            return "[" + ", ".join(type_text(a) for a in inner) + "]"
        return f"list of {type_text(inner[0])}" if inner else "list"
    if origin in (dict, typing.Dict, typing.Mapping):
        return f"mapping of {type_text(args[0])} to {type_text(args[1])}" if args else "mapping"
    if is_registry(t):
        return "section with type: " + "|".join(sorted(t.get_known_choices()))
    if dataclasses.is_dataclass(t):
        return "section"
    return getattr(t, "__name__", str(t))


def default_text(value: Any) -> str:
    """A default as YAML would write it (``null``, ``true``, ``[]``, ``15m``); ``(required)`` for none."""
    if value is dataclasses.MISSING:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime.timedelta):
        return str(draccus.encode(value))  # the form levanter.config registers: 15m, 30s
    if dataclasses.is_dataclass(value):
        if is_registry(type(value)):
            return f"type: {choice_name(type(value))}"
        encoded = draccus.encode(value)
        return _flow(encoded)
    return _flow(value)


def _flow(value: Any) -> str:
    if isinstance(value, str):
        return repr(value) if value == "" or value.strip() != value else value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return _flow(draccus.encode(value))
    return str(value)


def choice_name(cls: type) -> str:
    """The name ``cls`` is registered under in its registry (the first, for a class with aliases)."""
    for base in cls.__mro__[1:]:
        if is_registry(base) and base not in (draccus.ChoiceRegistry, draccus.PluginRegistry):
            try:
                for name in base.get_known_choices():
                    if base.get_choice_class(name) is cls:
                        return name
            except Exception:  # noqa: BLE001 -- a base that is not a registry root
                continue
    return cls.__name__


def _choice_aliases(registry: type, cls: type) -> list:
    return [n for n in registry.get_known_choices() if registry.get_choice_class(n) is cls]


def first_line(doc: Optional[str], cls: Optional[type] = None) -> str:
    if not doc or (cls is not None and doc.startswith(f"{cls.__name__}(")):  # dataclass's generated __doc__
        return ""
    text = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(text.split())


def _rows(cls: type, prefix: str, skip: Sequence[str] = ()) -> list:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, Any)
        if f.name in skip or (f.name == "type" and is_registry(cls)):
            continue
        if section_classes(t) and all(section_classes(m) for m in _members(t)):
            continue  # a nested section: its keys are listed in a section of their own
        rows.append(
            FieldDoc(
                key=f"{prefix}.{f.name}" if prefix else f.name,
                type=type_text(t),
                default=default_text(field_default(f)),
                description=description(cls, f.name),
                refused=f.metadata.get(REFUSED),
                owner=cls,
                name=f.name,
            )
        )
    return rows


def sections(cls: type, prefix: str = "", title: Optional[str] = None) -> list:
    """Every key of config class ``cls`` (at ``prefix``), as sections: the class's own keys first, then
    one section per nested config (per member of a union, per ``type:`` of a choice, per mapping value)."""
    if not dataclasses.is_dataclass(cls):  # a union at the top (a data-only config: one source or a mixture)
        return _union_sections(section_classes(cls), prefix, None)
    head = title or (prefix or "top level")
    out = [Section(head, prefix, first_line(cls.__doc__, cls), _rows(cls, prefix))]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, Any)
        key = f"{prefix}.{f.name}" if prefix else f.name
        classes = section_classes(t)
        default = field_default(f)
        if len(classes) == 1 and not is_registry(classes[0]):
            out += sections(classes[0], key)
        elif len(classes) > 1 and not any(is_registry(c) for c in classes):
            out += _union_sections(classes, key, default)
        elif classes:
            for registry in classes:
                out += _choice_sections(registry, key, default)
        element = _element_class(t)
        if element is not None:
            kind, ecls = element
            sub = f"{key}.<name>" if kind == "mapping" else f"{key}[]"
            out += sections(ecls, sub)
    # A section holding only nested sections has no rows of its own to list.
    return [s for s in out if s.fields or s is not out[0] or not prefix]


def _union_sections(classes: list, key: str, default: Any) -> list:
    """A union of config classes (``data``: one source or a mixture): the keys they share (declared by the
    same class) once, then each member's own keys."""
    shared = set.intersection(*({f.name for f in dataclasses.fields(c)} for c in classes))
    shared = {n for n in shared if len({_declarer(c, n) for c in classes}) == 1}
    base = classes[0]
    common_rows = [r for r in _rows(base, key) if r.name in shared]
    where = key or "top level"
    out = [Section(f"{where} (every form)", key, "", common_rows)] if common_rows else []
    for c in classes:
        mark = " (the default)" if type(default) is c else ""
        part = sections(c, key, title=f"{where} as {c.__name__}{mark}")
        part[0].fields = [r for r in part[0].fields if r.name not in shared]
        out += part
    return out


def _declarer(cls: type, name: str) -> type:
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return klass
    return cls


def _choice_sections(registry: type, key: str, default: Any) -> list:
    out = []
    seen: list = []
    for name in sorted(registry.get_known_choices()):
        cls = registry.get_choice_class(name)
        if cls in seen:
            continue
        seen.append(cls)
        names = _choice_aliases(registry, cls)
        shown = " or ".join(f"type: {n}" for n in names)
        mark = " (the default)" if type(default) is cls else ""
        out += sections(cls, key, title=f"{key} with {shown}{mark}")
    return out

"""The commands whose keys are documented: an :class:`EntryPoint` per command module (its ``CONFIG_DOC``,
or one made from its ``main`` function's config class) and its sections in the order they are shown.

Trade-off: a command module may define ``config_doc()`` instead of ``CONFIG_DOC`` where building the entry
imports what a usage error should not wait for; the module's attributes are therefore looked up by name.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Sequence
from typing import Any

from ..refused_keys import field_default
from .comments import description
from .fields import FieldDoc, Section, choice_name, first_line, is_registry, section_classes, sections

__all__ = ["EntryPoint", "FIRST_TITLE", "all_fields", "entry_point", "entry_sections"]


@dataclasses.dataclass
class EntryPoint:
    """A command whose keys are documented: ``module`` (``python -m ...``), a one-line ``summary``, its
    config class (None: it takes another command's config, which ``note`` names), the key prefix its config
    sits under, and the command's own options (FieldDocs whose keys have no prefix)."""

    module: str
    summary: str
    config_class: Any = None
    prefix: str = ""
    options: list = dataclasses.field(default_factory=list)
    note: str = ""
    usage: str = "--config_path FILE.yaml [--key value ...]"
    # Keys listed first, in this order, in a section of their own (each is also in its own section):
    # the ones people set most, which a listing in declaration order buries among a thousand lines.
    first: Sequence[str] = ()


FIRST_TITLE = "the keys set most often (each is also listed in its section below)"


def entry_sections(entry: EntryPoint) -> list:
    """The command's own options (if any), the keys set most often (``entry.first``), then its config's
    sections."""
    out = [Section("command-line options", "", "", list(entry.options))] if entry.options else []
    if entry.config_class is not None:
        found = _once(sections(entry.config_class, entry.prefix))
        if entry.first:
            out.append(Section(FIRST_TITLE, "", "", [_first_row(entry.config_class, found, k) for k in entry.first]))
        out += found
    return out


def _first_row(config_class: type, found: list, key: str) -> FieldDoc:
    """The row of ``key`` for the keys-set-most section: from the section listing it (the default member of
    a union or choice where several do), or, for a choice's ``type`` key, one made from the choice."""
    rows = [(s, r) for s in found for r in s.fields if r.key == key]
    if rows:
        return next((r for s, r in rows if "(the default)" in s.title), rows[0][1])
    parent, _, last = key.rpartition(".")
    owner, field = _field_at(config_class, parent)
    if last == "type" and field is not None:
        registries = [c for c in section_classes(typing.get_type_hints(owner).get(field.name)) if is_registry(c)]
        if registries:
            choices = sorted({choice_name(registries[0].get_choice_class(n))
                              for n in registries[0].get_known_choices()})
            return FieldDoc(key=key, type="one of " + ", ".join(choices),
                            default=choice_name(type(field_default(field))),
                            description=description(owner, field.name) + f" Each type's keys: {parent} with type: X.",
                            owner=owner, name="type")
    raise ValueError(f"EntryPoint.first names {key!r}, which the config does not have")


def _field_at(cls: type, dotted: str):
    """``(class declaring it, dataclass field)`` of the section field at ``dotted`` (``model``), else
    ``(cls, None)``."""
    owner, field = cls, None
    for part in dotted.split(".") if dotted else ():
        fields = {f.name: f for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
        if part not in fields:
            return cls, None
        field = fields[part]
        if part != dotted.split(".")[-1]:
            classes = section_classes(typing.get_type_hints(owner).get(part))
            owner = classes[0] if classes else owner
    return owner, field


def _once(found: list) -> list:
    """Sections without repeats: a section two union members share (``data.cache_options``) is listed once."""
    seen, out = set(), []
    for s in found:
        mark = (s.prefix, tuple((r.key, r.type, r.default) for r in s.fields))
        if s.fields and mark in seen:
            continue
        seen.add(mark)
        out.append(s)
    return out


def _module_name(module) -> str:
    """The importable name of ``module``, also when it runs as ``python -m`` (``__main__``)."""
    spec = getattr(module, "__spec__", None)
    return spec.name if spec is not None and spec.name else module.__name__


def _main_config_class(module):
    """The config class of the module's ``main(config)`` (its first parameter's annotation), if any."""
    fn = getattr(module, "main", None)
    if not callable(fn):
        return None
    try:
        params = list(inspect.signature(fn).parameters.values())
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError):
        return None
    cls = hints.get(params[0].name) if params else None
    return cls if dataclasses.is_dataclass(cls) else None


def entry_point(module) -> EntryPoint:
    """A command module's :class:`EntryPoint`: its ``CONFIG_DOC`` if it has one, else one made from its
    docstring and the config class of its ``levanter.config.main`` function (``config_doc()`` where making
    it is slow), listing first the keys of the module's ``HELP_FIRST`` (if any)."""
    first = tuple(getattr(module, "HELP_FIRST", ()))
    doc = getattr(module, "CONFIG_DOC", None)
    if doc is not None:
        return doc
    make = getattr(module, "config_doc", None)
    if callable(make):  # made on demand where building it imports what a usage error should not wait for
        return make()
    for value in vars(module).values():
        config_class = getattr(value, "config_class", None)
        if config_class is not None and callable(value):
            return EntryPoint(_module_name(module), first_line(module.__doc__), config_class, first=first)
    config_class = _main_config_class(module)
    if config_class is not None:
        return EntryPoint(_module_name(module), first_line(module.__doc__), config_class, first=first)
    raise ValueError(f"{module.__name__}: no CONFIG_DOC and no levanter.config.main function")


def all_fields(entry: EntryPoint) -> list:
    """Every FieldDoc of an entry point's config (not its command-line options)."""
    if entry.config_class is None:
        return []
    return [r for s in _once(sections(entry.config_class, entry.prefix)) for r in s.fields]

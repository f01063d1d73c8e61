"""What each config key means: the one-line descriptions, defaults and types behind ``--help`` and
``docs/reference/config.md``, and the fields accepted from upstream configs but refused when set.

A field's description is the comment directly above it in its dataclass (contiguous ``#`` lines; else an
inline ``# ...`` comment, else a string literal right below it, as draccus also reads them): one place,
read by both ``--help`` and the reference generator (``scripts/gen_config_reference.py``), so the two
never disagree. ``--help`` is printed here rather than by draccus because draccus's help repeats the
keys that the members of a union share, and shows no default for a field without a description.

Fields marked :func:`~levanter.refused_keys.refused` (upstream keys not built here, rejected by
:func:`~levanter.refused_keys.check_refused` when set) are listed as refused by ``--help`` and the
reference; the marker lives in :mod:`levanter.refused_keys`, so that config dataclasses do not import
this module.

Trade-off: descriptions come from the source text (``inspect.getsource``), so a config class defined
where no source is available (an interactive session) gets empty descriptions instead of an error.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import re
import textwrap
import typing
from collections.abc import Sequence
from typing import Any, Optional, Union

import draccus

# The refused-key marker lives in its own module, which config dataclasses import without this one;
# it is re-exported here for code written against this module.
from .refused_keys import REFUSED, field_default

# -- descriptions --------------------------------------------------------------------------------------------
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


# -- walking config classes ------------------------------------------------------------------------------
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


def _is_registry(t) -> bool:
    return isinstance(t, type) and issubclass(t, draccus.choice_types.ChoiceRegistryBase)


def _members(t) -> list:
    if typing.get_origin(t) is Union:
        return [a for a in typing.get_args(t) if a is not type(None)]
    return [t]


def _section_classes(t) -> list:
    """The config classes a field of type ``t`` holds directly (a dataclass, a union of them, a choice)."""
    out = []
    for m in _members(t):
        if typing.get_origin(m) in (tuple, typing.Tuple):
            args = [a for a in typing.get_args(m) if a is not Ellipsis]
            out += [a for a in args if _is_registry(a) or dataclasses.is_dataclass(a)]
        elif _is_registry(m) or dataclasses.is_dataclass(m):
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
    if _is_registry(t):
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
        if _is_registry(type(value)):
            return f"type: {_choice_name(type(value))}"
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


def _choice_name(cls: type) -> str:
    """The name ``cls`` is registered under in its registry (the first, for a class with aliases)."""
    for base in cls.__mro__[1:]:
        if _is_registry(base) and base not in (draccus.ChoiceRegistry, draccus.PluginRegistry):
            try:
                for name in base.get_known_choices():
                    if base.get_choice_class(name) is cls:
                        return name
            except Exception:  # noqa: BLE001 -- a base that is not a registry root
                continue
    return cls.__name__


def _choice_aliases(registry: type, cls: type) -> list:
    return [n for n in registry.get_known_choices() if registry.get_choice_class(n) is cls]


def _first_line(doc: Optional[str], cls: Optional[type] = None) -> str:
    if not doc or (cls is not None and doc.startswith(f"{cls.__name__}(")):  # dataclass's generated __doc__
        return ""
    text = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(text.split())


def _rows(cls: type, prefix: str, skip: Sequence[str] = ()) -> list:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, Any)
        if f.name in skip or (f.name == "type" and _is_registry(cls)):
            continue
        if _section_classes(t) and all(_section_classes(m) for m in _members(t)):
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
        return _union_sections(_section_classes(cls), prefix, None)
    head = title or (prefix or "top level")
    out = [Section(head, prefix, _first_line(cls.__doc__, cls), _rows(cls, prefix))]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, Any)
        key = f"{prefix}.{f.name}" if prefix else f.name
        classes = _section_classes(t)
        default = field_default(f)
        if len(classes) == 1 and not _is_registry(classes[0]):
            out += sections(classes[0], key)
        elif len(classes) > 1 and not any(_is_registry(c) for c in classes):
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


# -- output --------------------------------------------------------------------------------------------------
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
        registries = [c for c in _section_classes(typing.get_type_hints(owner).get(field.name)) if _is_registry(c)]
        if registries:
            choices = sorted({_choice_name(registries[0].get_choice_class(n))
                              for n in registries[0].get_known_choices()})
            return FieldDoc(key=key, type="one of " + ", ".join(choices),
                            default=_choice_name(type(field_default(field))),
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
            classes = _section_classes(typing.get_type_hints(owner).get(part))
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
            return EntryPoint(_module_name(module), _first_line(module.__doc__), config_class, first=first)
    config_class = _main_config_class(module)
    if config_class is not None:
        return EntryPoint(_module_name(module), _first_line(module.__doc__), config_class, first=first)
    raise ValueError(f"{module.__name__}: no CONFIG_DOC and no levanter.config.main function")


def _plain(text: str) -> str:
    """reST markup as a terminal shows it: ````x```` as x, ``:func:`~a.b``` as b."""
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return text.replace("``", "")


def format_help(entry: EntryPoint, width: int = 100) -> str:
    """``--help`` text: usage, then each section's keys with type, default and description, once each; the
    section's refused keys (see :func:`refused`) are named together on its last line."""
    lines = [f"usage: python -m {entry.module} {entry.usage}", "", entry.summary, ""]
    if entry.note:
        lines += textwrap.wrap(entry.note, width=width) + [""]
    lines += textwrap.wrap(
        "Keys are set in the YAML file or on the command line with their dotted names (--a.b value). Keys "
        "listed as refused are accepted from upstream configs but stop the run if given a value. "
        "The same, as tables, with what each refused key would do: docs/reference/config.md.",
        width=width,
    )
    pad = " " * 6
    for s in entry_sections(entry):
        if not s.fields:
            continue
        lines += [""] + textwrap.wrap(_plain(f"{s.title}:" + (f" {s.doc}" if s.doc else "")), width=width,
                                      subsequent_indent="  ")
        for r in s.fields:
            if r.refused:
                continue
            lines.append(f"  --{r.key} ({r.type}; default {r.default})")
            text = _plain(r.description)
            lines += textwrap.wrap(text, width=width, initial_indent=pad, subsequent_indent=pad)
        refused_keys = [f"--{r.key}" for r in s.fields if r.refused]
        if refused_keys:
            text = "refused if set (upstream keys not built here): " + ", ".join(refused_keys)
            lines += textwrap.wrap(text, width=width, initial_indent="  ", subsequent_indent=pad)
    return "\n".join(lines) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_markdown(entries: Sequence[EntryPoint]) -> str:
    """The reference page: per entry point, per section, a table of key, type, default, description. A
    section an earlier command already lists (``data_schedule`` and ``eval_lm`` take ``train_lm``'s
    ``data``, ``trainer``, ...) is named with a link to that table rather than repeated."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from the config dataclasses by `python scripts/gen_config_reference.py`; "
        "do not edit. -->",
        "",
        "Every key each command accepts, with its type, its default and what it does. A key is set in the",
        "YAML file given with `--config_path`, or on the command line with its dotted name",
        "(`--trainer.num_train_steps 100`). Sections whose title says `type: X` apply when the section's",
        "`type:` is `X`; `<name>` stands for a name you choose (a mixture's source). Keys marked",
        "**refused** are accepted so that upstream Levanter configs load, and stop the run with an error",
        "if set to anything but their default.",
        "",
    ]
    listed: dict = {}  # a section's content -> the heading that lists it
    for e in entries:
        out += [f"## `python -m {e.module}`", "", e.summary, ""]
        out += [f"Usage: `python -m {e.module} {e.usage}`", ""]
        if e.note:
            out += [e.note, ""]
        own, shared = [], []
        for s in entry_sections(e):
            if not s.fields:
                continue
            mark = (s.title, tuple(dataclasses.astuple(r)[:5] for r in s.fields))
            if mark in listed:
                shared.append(f"[{s.title}](#{_anchor(listed[mark])})")
            else:
                listed[mark] = f"{e.module.rsplit('.', 1)[-1]}: {s.title}"
                own.append(s)
        if shared:
            out += ["Also these sections, listed above: " + ", ".join(shared) + ".", ""]
        for s in own:
            out += [f"### {e.module.rsplit('.', 1)[-1]}: {s.title}", ""]
            if s.doc:
                out += [s.doc, ""]
            out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
            for r in s.fields:
                desc = _md_cell(r.description or "")
                if r.refused:
                    desc = f"**refused** ({_md_cell(r.refused)}). {desc}"
                out.append(f"| `{r.key}` | {_md_cell(r.type)} | `{_md_cell(r.default)}` | {desc} |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def all_fields(entry: EntryPoint) -> list:
    """Every FieldDoc of an entry point's config (not its command-line options)."""
    if entry.config_class is None:
        return []
    return [r for s in _once(sections(entry.config_class, entry.prefix)) for r in s.fields]


__all__ = [
    "EntryPoint",
    "FIRST_TITLE",
    "FieldDoc",
    "Section",
    "all_fields",
    "entry_point",
    "entry_sections",
    "default_text",
    "description",
    "format_help",
    "format_markdown",
    "sections",
    "type_text",
]

"""Config errors in the user's terms: :class:`ConfigError`, and one paragraph for each error draccus raises.

draccus reports an unknown key, a missing ``type:``, a value of the wrong type or a failed union as text
naming its internal classes. :func:`describe_error` turns that into one paragraph: where the key was set
(the file, the file an ``!include`` brought it from, or the command-line override), which key, what is
wrong, and a did-you-mean or the known choices. It walks the raw config alongside the config classes to
find the member of a union the user meant, and decodes that member again to report its own error rather
than draccus's list of every member's failure.

Trade-off: draccus's messages are matched by regular expressions, so a new draccus wording falls back to
the message as draccus wrote it (still one paragraph, with the key), never to a traceback.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import re
import typing
from collections.abc import Iterator, Sequence
from typing import Any, Union

import draccus
import yaml

__all__ = ["ConfigError", "describe_error"]


class ConfigError(ValueError):
    """A user error in a config file or on the command line."""


# -- explaining draccus's errors -----------------------------------------------------------------------------
def _overrides(args: Sequence[str]) -> list[tuple[str, str]]:
    """``["--a.b", "1", "--c=x"]`` -> ``[("a.b", "1"), ("c", "x")]``: the dotted overrides as given."""
    out = []
    args = list(args)
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if not a.startswith("--"):
            continue
        key, eq, value = a[2:].partition("=")
        if not eq and i < len(args) and not args[i].startswith("--"):
            value = args[i]
            i += 1
        out.append((key, value))
    return out


def _with_overrides(raw: dict, given: Sequence[tuple[str, str]]) -> dict:
    """``raw`` with the overrides applied, as draccus applies them (values read as YAML)."""
    merged = copy.deepcopy(raw)
    for key, text in given:
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        node = merged
        *parents, last = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            node[last] = {**node[last], **value}
        else:
            node[last] = value
    return merged


def _is_registry(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, draccus.choice_types.ChoiceRegistryBase)


def _is_sequence_type(cls) -> bool:
    return typing.get_origin(cls) in (list, tuple, Sequence, typing.Sequence)


def _is_mapping_type(cls) -> bool:
    return typing.get_origin(cls) in (dict, typing.Mapping) or cls is dict


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


def _union_member(cls, value):
    """The member of a union ``cls`` the user evidently meant by ``value``: by shape (a mapping, a list,
    a scalar), then, among config classes, the one whose keys ``value`` uses most (the first on a tie)."""
    if typing.get_origin(cls) is not Union:
        return cls
    members = [a for a in typing.get_args(cls) if a is not type(None)]
    if isinstance(value, dict):
        shaped = [m for m in members if dataclasses.is_dataclass(m) or _is_registry(m) or _is_mapping_type(m)]
    elif isinstance(value, list):
        shaped = [m for m in members if _is_sequence_type(m)]
    else:
        shaped = [m for m in members if not (dataclasses.is_dataclass(m) or _is_sequence_type(m))]
    candidates = shaped or members
    if len(candidates) == 1 or not isinstance(value, dict):
        return candidates[0]
    return max(candidates, key=lambda m: len(set(value) & set(_fields(_choice(m, value)))))


def _choice(cls, value):
    """For a registry (``model``, ``tracker``, ...): the class registered under ``value``'s ``type:``."""
    if _is_registry(cls) and isinstance(value, dict):
        name = value.get("type") or cls.default_choice_name()
        try:
            return cls.get_choice_class(name)
        except Exception:  # noqa: BLE001 -- an unknown type is reported elsewhere
            return cls
    return cls


def _child_type(cls, key: str):
    if dataclasses.is_dataclass(cls):
        try:
            return typing.get_type_hints(cls).get(key)
        except Exception:  # noqa: BLE001 -- a hint is best effort
            return None
    args = typing.get_args(cls)
    if _is_sequence_type(cls) and args:
        return args[0]
    if _is_mapping_type(cls) and len(args) == 2:
        return args[1]
    return None


def _children(value) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        yield from ((str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        yield from ((str(i), v) for i, v in enumerate(value))


def _walk(cls, value, path: tuple = ()) -> Iterator[tuple[tuple, Any, Any]]:
    """Every (key path, declared type, raw value) in a raw config; unions are followed into the member
    ``_union_member`` picks."""
    yield path, cls, value
    cls = _choice(_union_member(cls, value), value)
    for key, child in _children(value):
        child_type = _child_type(cls, key)
        if child_type is not None:
            yield from _walk(child_type, child, (*path, key))


def _at(root, raw, key_path: Sequence[str]):
    """(declared type, raw value) at ``key_path``, or (None, None)."""
    for path, cls, value in _walk(root, raw):
        if path == tuple(key_path):
            return cls, value
    return None, None


def _resolve_class(dotted: str):
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _did_you_mean(word: str, choices: Sequence[str], quote: str = "`") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {quote}{close[0]}{quote}?" if close else ""


_UNKNOWN_FIELDS = re.compile(r"The fields (?P<fields>.*) are not valid for \S+$")
_MISSING_FIELDS = re.compile(r"Missing required field\(s\) (?P<fields>.*) for \S+$")
_NO_CHOICE = re.compile(r"Couldn't find a choice class for '(?P<value>.*)' in <class '(?P<cls>[\w.]+)'>$")
_NO_TYPE_KEY = re.compile(r"Expected a dict with a 'type' key for <class '(?P<cls>[\w.]+)'>, got ")
_CHOICE_NOT_DICT = re.compile(r"Expected a dict for a choice class, got (?P<value>.*)$", re.S)
_UNION = "Could not decode the value into any of the given types"
_DRACCUS_FAILED = re.compile(
    r"Failed when parsing value='(?P<value>.*)' into field \".*\" of type (?P<type>.*?)\.\s*"
    r"Underlying error is \"(?P<cause>.*)\"\s*$",
    re.S,
)


def _explain(e: Exception, root, raw, depth: int = 0) -> tuple[tuple | None, str]:
    """(key path or None, what is wrong there) for a draccus error, in the user's terms: the key, the
    value, the choices and a did-you-mean, never draccus's list of internal class names."""
    if isinstance(e, draccus.utils.DecodingError):
        key_path, message = tuple(e.key_path), e.message
        if message.startswith(_UNION) and depth < 8:
            # draccus tried every member of a union (the ``data`` section: one source or a mixture) and
            # lists why each failed; decode again as the member the keys given point to, and report that.
            declared, value = _at(root, raw, key_path)
            members = [a for a in typing.get_args(declared) if a is not type(None)]
            if members and not any(dataclasses.is_dataclass(m) or typing.get_origin(m) for m in members):
                # A union of plain types (``shuffle: Union[bool, int]``): name them all.
                names = " or ".join(getattr(m, "__name__", str(m)) for m in members)
                return key_path, f"expected {names}, got {value!r}"
            member = _union_member(declared, value) if declared is not None else None
            if member is not None and typing.get_origin(member) is not Union:
                try:
                    draccus.decode(member, value)
                except draccus.utils.DecodingError as inner:
                    where = (*key_path, *inner.key_path)
                    return _explain(draccus.utils.DecodingError(where, inner.message), root, raw, depth + 1)
                except draccus.utils.ParsingError as inner:
                    return _explain_parsing(inner, root, raw, key_path)
                except Exception:  # noqa: BLE001 -- fall back to draccus's message
                    pass
            return key_path, " ".join(message.split())
        return _explain_decoding(key_path, message, root, raw)
    return _explain_parsing(e, root, raw, None)


def _other_entry_point(root, key_path: tuple, unknown: Sequence[str]) -> str | None:
    """For unknown top-level keys that a config class lists in ``OTHER_ENTRY_POINTS`` (key -> the upstream
    entry point whose configs carry it): the file is that entry point's config, refused as such."""
    table = getattr(root, "OTHER_ENTRY_POINTS", None)
    hits = [k for k in unknown if table and k in table] if not key_path else []
    if not hits:
        return None
    keys = ", ".join(f"`{k}`" for k in hits)
    return f"top-level {keys}: a config of {table[hits[0]]}, is not supported here: this file is not a config for it"


def _explain_decoding(key_path: tuple, message: str, root, raw) -> tuple[tuple | None, str]:
    m = _UNKNOWN_FIELDS.match(message)
    if m is not None:
        declared, value = _at(root, raw, key_path)
        names = [n for n in _fields(_choice(_union_member(declared, value), value)) if n != "type"]
        unknown = re.findall(r"`([^`]+)`", m["fields"])
        foreign = _other_entry_point(root, key_path, unknown)
        if foreign is not None:
            return key_path, foreign
        what = f"unknown {'top-level ' if not key_path else ''}key{'s' if len(unknown) > 1 else ''} "
        what += ", ".join(f"`{u}`" for u in unknown)
        hints = [h for h in (_did_you_mean(u, names) for u in unknown) if h]
        if hints:
            what += f" ({'; '.join(hints)})"
        elif names:
            what += f"; known keys: {', '.join(names[:20])}{', ...' if len(names) > 20 else ''}"
        return key_path, what
    m = _MISSING_FIELDS.match(message)
    if m is not None:
        return key_path, f"missing required key(s) {m['fields']}"
    m = _NO_CHOICE.match(message)
    if m is not None:
        registry = _resolve_class(m["cls"])
        try:
            known = sorted(registry.get_known_choices())
        except Exception:  # noqa: BLE001
            known = []
        what = f"unknown type {m['value']!r}"
        if known:
            what += f"; known types: {', '.join(known)}"
            hint = _did_you_mean(m["value"], known, quote="'")
            what += f"; {hint}" if hint else ""
        return key_path, what
    m = _DRACCUS_FAILED.match(message)
    if m is None:
        return key_path, message
    type_text = m["type"]
    cls_match = re.fullmatch(r"<class '(?P<cls>[\w.]+)'>", type_text)
    expected, why = type_text, f" ({m['cause']})"
    if cls_match is not None:
        cls = _resolve_class(cls_match["cls"])
        expected = cls_match["cls"].rpartition(".")[2]
        if cls is not None and dataclasses.is_dataclass(cls):
            # A section written as a list or a scalar: the cause (some AttributeError) says nothing more.
            expected, why = f"a mapping of {cls.__name__} fields (key: value lines)", ""
    return key_path, f"expected {expected}, got {m['value']}{why}"


def _explain_parsing(e: Exception, root, raw, key_path: tuple | None) -> tuple[tuple | None, str]:
    """A draccus error without a key path: a registry section without ``type:`` (found by walking the raw
    config), or a config class's own validation (its ``__post_init__`` message)."""
    message = str(e)
    m = _NO_TYPE_KEY.match(message)
    if m is not None:
        registry = _resolve_class(m["cls"])
        for path, cls, value in _walk(root, raw):
            if _union_member(cls, value) is registry and isinstance(value, dict) and "type" not in value:
                return path, _missing_type(registry, value)
    m = _CHOICE_NOT_DICT.match(message)
    if m is not None:
        for path, cls, value in _walk(root, raw):
            cls = _union_member(cls, value)
            if _is_registry(cls) and not isinstance(value, dict):
                known = ", ".join(sorted(cls.get_known_choices()))
                return path, f"expected a mapping with `type:` (one of {known}), got {value!r}"
    cause = e.__cause__ if isinstance(e.__cause__, ValueError) else e
    return key_path, " ".join(str(cause).split())


def _missing_type(registry, value: dict) -> str:
    known = sorted(registry.get_known_choices())
    what = f"no `type:` given; add `type:` with one of: {', '.join(known)}"
    typo = [k for k in value if difflib.get_close_matches(str(k), ["type"], n=1)]
    if typo:
        return what + f" (did you mean `type` for `{typo[0]}`?)"
    fits = [n for n in known if set(value) <= set(_fields(registry.get_choice_class(n)))]
    if len(fits) == 1:
        return what + f" (did you mean `type: {fits[0]}`? the keys given are its)"
    return what


def describe_error(
    e: Exception,
    root,
    raw: dict,
    *,
    source: str | None,
    args: Sequence[str] = (),
    prefix: Sequence[str] = (),
    origins: dict | None = None,
) -> str:
    """One paragraph for a draccus error in decoding ``raw`` (a file's mapping, before the overrides in
    ``args``) as ``root``: where it is (the file, or the command-line override that set the key) and what
    is wrong. ``prefix`` is the key path of ``raw`` within the whole config (``("data",)`` for a data
    section read on its own). ``origins`` (:func:`load_yaml_origins`): where an included file wrote the
    key at fault, that file and line are named instead of ``source``."""
    head = ".".join(prefix) + "." if prefix else ""
    given = [(k, v) for k, v in _overrides(args) if k.startswith(head)]
    merged = _with_overrides(raw, [(k[len(head):], v) for k, v in given])
    key_path, what = _explain(e, root, merged)
    full = None if key_path is None else (*prefix, *key_path)
    key = ".".join(full) if full else ""
    if full is not None:  # the override that set this key (or a section holding it)
        blamed = [(k, v) for k, v in given if full[: len(k.split("."))] == tuple(k.split("."))]
        blamed = sorted(blamed, key=lambda kv: len(kv[0]))[-1:]
    else:  # a check across keys (``__post_init__``): the overrides its message names
        blamed = [(k, v) for k, v in given if re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", what)]
    if blamed:
        where = "command line: " + " ".join(f"--{k} {v}" for k, v in blamed)
        return f"{where}: {what}" if key in ("", blamed[0][0]) else f"{where}: `{key}`: {what}"
    where = _included_origin(origins or {}, full, what, source) or source or "command line"
    return f"{where}: `{key}`: {what}" if key else f"{where}: {what}"


def _included_origin(origins: dict, key_path: tuple | None, what: str, source: str | None) -> str | None:
    """``"<file>, line N (included from <source>)"`` when the key at fault (an unknown key the message
    names, the key path, or the section holding it; for a check across keys, the longest key the message
    names) was written by a file ``source`` includes; None otherwise."""
    if key_path is not None:
        unknown = re.findall(r"unknown (?:top-level )?keys? `([^`]+)`", what)
        candidates = [(*key_path, u) for u in unknown] + [key_path[:i] for i in range(len(key_path), 0, -1)]
    else:
        named = [k for k in origins if re.search(rf"(?<![\w.]){re.escape('.'.join(k))}(?![\w])", what)]
        candidates = sorted(named, key=len, reverse=True)
    for candidate in candidates:
        if candidate in origins:
            file, line = origins[candidate]
            return None if file == source else f"{file}, line {line} (included from {source})"
    return None

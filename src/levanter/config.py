"""Reading configs: YAML files (local or fsspec URLs) and dotted CLI overrides, parsed by draccus into
typed dataclasses.

``main`` wraps a ``main(config)`` function into a command-line entry point:
``python -m levanter.main.x --config_path config/foo.yaml --trainer.num_train_steps 100``. Tests call the
wrapped function directly with a config object. User errors (a missing, unreadable or malformed file, a
key given twice, an unknown key, a value of the wrong type) are reported as one paragraph naming the file
or the command-line override and the key, without a traceback, and exit with status 2.

Config files are UTF-8 YAML. ``key: !include other.yaml`` splices in another file (relative to the one
that names it; ``<<: !include other.yaml`` merges its keys), as upstream Levanter's configs do. A key
given twice in one mapping is an error rather than "last one wins": a second ``optimizer:`` block would
otherwise silently reset every setting of the first to its default.

A ``datetime.timedelta`` field takes a duration: ``30s``, ``15m``, ``1h30m``, ``2d`` or a number of seconds
(:func:`parse_timedelta`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import difflib
import functools
import importlib
import inspect
import io
import logging
import math
import os
import posixpath
import re
import sys
import tempfile
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, Union

import draccus
import fsspec
import yaml

from .cli_args import join_dash_values, suggest_key
from levanter.utils import fs

T = TypeVar("T")
logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A user error in a config file or on the command line."""


# -- durations ----------------------------------------------------------------------------------------------
# Registered with draccus here, where every entry point's config is parsed, so that a ``datetime.timedelta``
# field reads ``15m`` or ``30s`` and writes back the same form.
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


# -- reading YAML -------------------------------------------------------------------------------------------
_MERGE_TAG = "tag:yaml.org,2002:merge"
_MAX_INCLUDE_DEPTH = 16


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _read_text(path: str) -> str:
    """The text of the config file ``path``; every way of failing to read it names the file."""
    local = path[len("file://"):] if path.startswith("file://") else path
    if _is_local(path) and os.path.isdir(local):
        inside = sorted(n for n in os.listdir(local) if n.endswith((".yaml", ".yml")))
        hint = f" (it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})" if inside else ""
        raise ConfigError(f"{path} is a directory, expected a YAML file{hint}: give the config file itself")
    try:
        with fsspec.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path!r}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory, expected a YAML file") from None
    except PermissionError:
        raise ConfigError(f"cannot read the config file {path}: permission denied") from None
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        line = data.count(b"\n", 0, e.start) + 1
        column = len(data[line_start:e.start].decode("utf-8")) + 1  # in characters, as an editor counts
        raise ConfigError(
            f"{path}, line {line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at column {column}); "
            "save the config as UTF-8"
        ) from None


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` plus ``!include`` (a path relative to the including file), also as a merge
    source (``<<: !include base.yaml``)."""

    path: str = "<string>"
    including: tuple = ()
    included: dict  # id(node) of an `!include` -> the included file's origins (see _origins)
    merged: dict  # id(mapping node) -> the origins of the file `<<: !include` merged into it

    def flatten_mapping(self, node):
        for i, (key_node, value_node) in enumerate(node.value):
            if key_node.tag == _MERGE_TAG and value_node.tag == "!include":
                value = self.construct_object(value_node, deep=True)
                self.merged[id(node)] = self.included.get(id(value_node), {})
                if not isinstance(value, dict):
                    raise ConfigError(
                        f"{self.path}, line {value_node.start_mark.line + 1}: "
                        f"`<<: !include {value_node.value}` "
                        f"needs a file holding a mapping, got {type(value).__name__}"
                    )
                node.value[i] = (key_node, yaml.representer.SafeRepresenter().represent_data(value))
        super().flatten_mapping(node)


def _include(loader: _Loader, node: yaml.Node):
    line = node.start_mark.line + 1
    if not isinstance(node, yaml.ScalarNode) or not node.value:
        raise ConfigError(f"{loader.path}, line {line}: `!include` takes a file name (`!include a.yaml`)")
    name = node.value
    if "://" in name or os.path.isabs(name):
        target = name
    elif _is_local(loader.path):
        target = os.path.normpath(os.path.join(os.path.dirname(loader.path), name))
    else:
        target = posixpath.join(posixpath.dirname(loader.path), name)
    chain = (*loader.including, loader.path)
    if target in chain or len(chain) >= _MAX_INCLUDE_DEPTH:
        loop = " -> ".join((*chain, target))
        raise ConfigError(f"{loader.path}, line {line}: `!include {name}` loops (or nests too deep): {loop}")
    value, origins = _load(target, chain)
    loader.included[id(node)] = origins
    return value


_Loader.add_constructor("!include", _include)


def _origins(loader: _Loader, node: yaml.Node, key_path: tuple, out: dict, seen: set) -> dict:
    """``{key path: (file, line)}`` for every key under ``node``: the file that wrote it, so that an
    error in an ``!include``d file names that file rather than the one including it."""
    if id(node) in seen:  # an alias of a node already walked
        return out
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for sub, where in loader.merged.get(id(node), {}).items():  # `<<: !include`: its keys, here
            out[(*key_path, *sub)] = where
        for key_node, value_node in node.value:
            if key_node.start_mark is None or not isinstance(key_node, yaml.ScalarNode):
                continue  # a key merged in from an included file: recorded above
            path = (*key_path, key_node.value)
            out[path] = (loader.path, key_node.start_mark.line + 1)
            if id(value_node) in loader.included:
                out.update({(*path, *sub): where for sub, where in loader.included[id(value_node)].items()})
            else:
                _origins(loader, value_node, path, out, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if id(item) in loader.included:
                out.update({(*key_path, str(i), *sub): w for sub, w in loader.included[id(item)].items()})
            else:
                _origins(loader, item, (*key_path, str(i)), out, seen)
    return out


def _check_duplicates(node: yaml.Node, path: str, key_path: tuple = (), seen: set | None = None) -> None:
    """Refuse a key given twice in one mapping (at any depth): YAML keeps the last silently."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias of a node already checked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *base`: keys given here override the merged ones, by design
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None:
                line = key_node.start_mark.line + 1
                if (key_node.tag, key) in first:
                    dotted = ".".join((*key_path, key))
                    raise ConfigError(
                        f"{path}: duplicate key `{dotted}` on lines {first[key_node.tag, key]} and {line}; "
                        "YAML would keep only the last one and drop the other's settings. "
                        "Merge the two into one."
                    )
                first[key_node.tag, key] = line
            _check_duplicates(value_node, path, (*key_path, str(key)), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicates(item, path, (*key_path, str(i)), seen)


def _load(path: str, including: tuple = ()) -> tuple[Any, dict]:
    """The value in the YAML file ``path`` and the origins of its keys (:func:`_origins`)."""
    text = _read_text(path)
    loader = _Loader(text)
    loader.path, loader.including = path, including
    loader.included, loader.merged = {}, {}
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        _check_duplicates(node, path)
        value = loader.construct_document(node)
        return value, _origins(loader, node, (), {}, set())
    except yaml.reader.ReaderError as e:  # a character YAML does not allow (a control character, ...)
        line = text.count("\n", 0, e.position) + 1
        what = f"{e.reason} (character {e.character!r})"
        raise ConfigError(f"{path}, line {line}: malformed YAML: {what}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
    finally:
        loader.dispose()


def load_yaml(path: str) -> dict:
    """The mapping in the YAML file ``path`` (``!include`` resolved); errors name the file and the line."""
    return load_yaml_origins(path)[0]


def load_yaml_origins(path: str) -> tuple[dict, dict]:
    """:func:`load_yaml`, and ``{key path: (file, line)}``: which file (``path`` or one it includes)
    wrote each key, for :func:`describe_error`."""
    data, origins = _load(path)
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data, origins


# -- parsing -------------------------------------------------------------------------------------------------
def parse_config(
    config_class: type[T],
    config_path: str | None = None,
    args: Sequence[str] = (),
    *,
    section: str | None = None,
    extra: dict | None = None,
) -> T:
    """Parse ``config_path`` (if given) plus dotted overrides ``args`` into ``config_class``.

    ``section``: the file holds only that section of the config (a data-only file read as ``data``);
    ``extra``: keys set besides the file's (``{"trainer": {"num_train_steps": 100}}``), under the
    command-line overrides."""
    args = join_dash_values(args)
    if "--help" in args or "-h" in args:
        _print_help_for(config_class)
        raise SystemExit(0)
    raw: dict = {}
    origins: dict = {}
    checked = None
    try:
        if config_path is not None:
            raw, origins = load_yaml_origins(config_path)
        if section is not None:
            raw = {section: raw}
            origins = {(section, *k): v for k, v in origins.items()}
        for key, value in (extra or {}).items():
            raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
        if raw or config_path is not None:
            # draccus is given the mapping checked above (includes spliced in, duplicates refused), as a
            # local file, rather than reading the original itself.
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, encoding="utf-8") as tmp:
                checked = tmp.name
                yaml.safe_dump(raw, tmp, sort_keys=False, allow_unicode=True)
        return expand_user_paths(_parse_quietly(config_class, checked, args))
    except draccus.utils.ParsingError as e:
        raise ConfigError(
            describe_error(e, config_class, raw, source=config_path, args=args, origins=origins)
        ) from None
    finally:
        if checked is not None:
            os.unlink(checked)


# Config keys that name local paths (or URLs): ``~`` in them is the home directory (fs.expand_user). Matched
# by field name in every section, so a new section's ``log_dir`` or ``cache_dir`` is covered too.
LOCAL_PATH_KEYS = frozenset({
    "cache_dir", "train_urls", "validation_urls", "base_path", "log_dir", "logdir", "dir",
    "load_checkpoint_path", "initialize_from", "initialize_from_checkpoint_path", "initialize_from_hf",
    "hf_save_path", "tokenizer", "output_dir", "checkpoint_path", "jax_compilation_cache_dir",
})


def _expanded(value):
    if isinstance(value, str):
        return fs.expand_user(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return type(value)(fs.expand_user(v) for v in value)
    return value


def expand_user_paths(config: T) -> T:
    """``config`` with ``~`` expanded in every :data:`LOCAL_PATH_KEYS` field of it and of its nested
    sections (dataclasses, and lists and mappings of them), in place; returns it."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if f.name in LOCAL_PATH_KEYS:
                new = _expanded(value)
                if new != value:
                    object.__setattr__(config, f.name, new)  # sections may be frozen dataclasses
            else:
                expand_user_paths(value)
    elif isinstance(config, dict):
        for v in config.values():
            expand_user_paths(v)
    elif isinstance(config, (list, tuple)):
        for v in config:
            expand_user_paths(v)
    return config


def _parse_quietly(config_class, config_path, args):
    """``draccus.parse``, with argparse's complaints about the command line (an unknown ``--key``, a value
    outside a choice) turned into a one-line :class:`ConfigError` instead of a screenful of usage."""
    buf = io.StringIO()
    failed = None
    try:
        with contextlib.redirect_stderr(buf):
            return draccus.parse(config_class=config_class, config_path=config_path, args=args)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            raise
        failed = _argparse_error(buf.getvalue())
    finally:
        if failed is None:
            sys.stderr.write(buf.getvalue())  # help text, warnings: anything else printed still shows
    raise ConfigError(f"command line: {failed}")


def _argparse_error(text: str) -> str:
    """The ``error:`` line argparse printed, plus a did-you-mean for an unrecognized ``--key``."""
    errors = [line.split(": error: ", 1)[1] for line in text.splitlines() if ": error: " in line]
    message = errors[-1] if errors else "invalid arguments"
    if message.startswith("unrecognized arguments:"):
        known = {k[2:] for k in re.findall(r"\[(--[\w.]+)", text)}
        hints = []
        for arg in message.split(":", 1)[1].split():
            if arg.startswith("--"):
                close = suggest_key(arg[2:].split("=", 1)[0], known)
                if close:
                    hints.append(f"--{close}")
        message += " (not config keys"
        message += f"; did you mean {', '.join(hints)}?)" if hints else ")"
    return message


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


# -- entry points --------------------------------------------------------------------------------------------
def split_config_path(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--config_path X`` (or ``--config_path=X``) out of ``argv``: (X or None, the other arguments).
    A ``--config_path`` with no file after it is an error, not a run without a config."""
    rest, path = [], None
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if a == "--config_path" or a.startswith("--config_path="):
            if a == "--config_path":
                value = argv[i] if i < len(argv) else None
                i += 1
            else:
                value = a.split("=", 1)[1]
            if not value or value.startswith("--"):
                got = f" (got {value} after it)" if value else ""
                raise ConfigError(
                    f"--config_path needs a file{got}: give the YAML config right after it, "
                    "e.g. --config_path config/gpt2_nano.yaml"
                )
            if path is not None and value != path:  # one file per run: the second would silently win
                raise ConfigError(f"--config_path given twice ({path} and {value}): give one config file")
            path = value
        else:
            rest.append(a)
    return path, rest


def main(fn: Callable[[T], object]) -> Callable[..., object]:
    """Decorator: ``fn(config)`` stays callable with a config; with no arguments it parses ``sys.argv``."""
    config_class = next(iter(inspect.signature(fn).parameters.values())).annotation
    if isinstance(config_class, str):
        config_class = fn.__globals__[config_class]

    @functools.wraps(fn)
    def wrapper(config: T | None = None, argv: Sequence[str] | None = None):
        if config is not None:
            return fn(config)
        args = sys.argv[1:] if argv is None else list(argv)
        if "--help" in args or "-h" in args:
            print_help(sys.modules[fn.__module__])
            raise SystemExit(0)
        try:
            path, rest = split_config_path(args)
            cfg = parse_config(config_class, path, rest)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return fn(cfg)

    wrapper.config_class = config_class  # type: ignore[attr-defined]  # for --help and the config reference
    return wrapper


def _print_help_for(config_class) -> None:
    """``--help`` for a command that parses ``config_class``: the running module's (or else a loaded command
    module's) where it documents that class, else a listing of the class's keys."""
    from .config_doc import EntryPoint, entry_point, format_help

    main_module = sys.modules.get("__main__")
    commands = [m for n, m in sorted(sys.modules.items()) if n.startswith("levanter.main.") and m is not None]
    for module in [main_module, *commands]:
        try:
            entry = entry_point(module)
        except (ValueError, TypeError):
            continue
        if entry.config_class is config_class:
            break
    else:
        name = getattr(getattr(main_module, "__spec__", None), "name", None) or "levanter"
        entry = EntryPoint(name, (config_class.__doc__ or "").strip().split("\n")[0], config_class)
    print(format_help(entry), end="")


def print_help(module) -> None:
    """Print ``--help`` for the command module ``module``: every key once, with its type, default and the
    comment above its dataclass field (:mod:`levanter.config_doc`)."""
    from .config_doc import entry_point, format_help

    print(format_help(entry_point(module)), end="")

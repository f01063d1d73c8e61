"""Reading configs: YAML files (local or fsspec URLs) and dotted command-line overrides, parsed by draccus
into typed dataclasses (:func:`parse_config`).

Config files are UTF-8 YAML. ``key: !include other.yaml`` splices in another file (relative to the one
that names it; ``<<: !include other.yaml`` merges its keys), as upstream Levanter's configs do. A key
given twice in one mapping is an error rather than "last one wins": a second ``optimizer:`` block would
otherwise silently reset every setting of the first to its default. Every key's origin (file and line,
through includes) is recorded, so an error names the file that wrote the key
(:func:`levanter.config.explain.describe_error`). Local path keys (:data:`LOCAL_PATH_KEYS`) have ``~``
expanded.

Trade-off: draccus is handed the checked mapping as a temporary YAML file rather than the original, so
includes and the duplicate check are ours, at the cost of one small file written per parse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import posixpath
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, TypeVar

import draccus
import fsspec
import yaml

from levanter.cli_args import join_dash_values, suggest_key
from levanter.utils import fs

from .explain import ConfigError, describe_error
from .help import print_help_for

__all__ = ["load_yaml", "load_yaml_origins", "parse_config", "expand_user_paths", "LOCAL_PATH_KEYS"]

T = TypeVar("T")


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
        print_help_for(config_class)
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

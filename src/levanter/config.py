"""Reading configs: YAML files (local or fsspec URLs) and dotted CLI overrides, parsed by draccus into
typed dataclasses.

``main`` wraps a ``main(config)`` function into a command-line entry point:
``python -m levanter.main.x --config_path config/foo.yaml --trainer.num_train_steps 100``. Tests call the
wrapped function directly with a config object. User errors (a missing or malformed file, an unknown
key, a value of the wrong type) are reported as one paragraph naming the file and key, without a
traceback, and exit with status 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import inspect
import io
import logging
import os
import re
import sys
import tempfile
import typing
from collections.abc import Callable, Sequence
from typing import TypeVar, Union

import draccus
import fsspec
import yaml

T = TypeVar("T")
logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A user error in a config file or on the command line."""


def load_yaml(path: str) -> dict:
    """The mapping in the YAML file ``path``; errors name the file (and the line for syntax errors)."""
    try:
        with fsspec.open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path!r}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def parse_config(config_class: type[T], config_path: str | None = None, args: Sequence[str] = ()) -> T:
    """Parse ``config_path`` (if given) plus dotted overrides ``args`` into ``config_class``."""
    args = list(args)
    local_path = None
    try:
        if config_path is not None:
            load_yaml(config_path)  # clear errors for missing / malformed files before draccus sees them
            if "://" in config_path and not config_path.startswith("file://"):
                with fsspec.open(config_path, "r") as f, tempfile.NamedTemporaryFile(
                    "w", suffix=".yaml", delete=False
                ) as tmp:
                    tmp.write(f.read())
                local_path = config_path = tmp.name
        return _parse_quietly(config_class, config_path, args)
    except draccus.utils.DecodingError as e:
        raise ConfigError(
            f"{config_path or 'command line'}: {_describe_decoding_error(e, config_class)}"
        ) from None
    except draccus.utils.ParsingError as e:
        # A config class's own validation (``__post_init__``) raised: show that message, not draccus's.
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else e
        raise ConfigError(f"{config_path or 'command line'}: {cause}") from None
    finally:
        if local_path is not None:
            os.unlink(local_path)


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
        known = set(re.findall(r"\[(--[\w.]+)", text))
        hints = []
        for arg in message.split(":", 1)[1].split():
            if arg.startswith("--"):
                close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1)
                if close:
                    hints.append(close[0])
        message += " (not config keys"
        message += f"; did you mean {', '.join(hints)}?)" if hints else ")"
    return message


_DRACCUS_FAILED = re.compile(
    r"Failed when parsing value='(?P<value>.*)' into field \".*\" of type (?P<type>.*?)\.\s*"
    r"Underlying error is \"(?P<cause>.*)\"\s*$",
    re.S,
)


_UNKNOWN_FIELDS = re.compile(r"The fields (?P<fields>.*) are not valid for \S+$")
_NO_CHOICE = re.compile(r"Couldn't find a choice class for '(?P<value>.*)' in <class '(?P<cls>[\w.]+)'>$")


def _resolve_class(dotted: str):
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _dataclass_at(root: type, key_path: Sequence[str]):
    """The dataclass type of the config section at ``key_path``, or None if it is not one plain dataclass."""
    cls = root
    for key in key_path:
        if not dataclasses.is_dataclass(cls):
            return None
        cls = typing.get_type_hints(cls).get(key)
        if typing.get_origin(cls) is Union:  # Optional[X] -> X; a real union has no single answer
            args = [a for a in typing.get_args(cls) if a is not type(None)]
            cls = args[0] if len(args) == 1 else None
    return cls if dataclasses.is_dataclass(cls) else None


def _describe_decoding_error(e: "draccus.utils.DecodingError", config_class: type | None = None) -> str:
    """draccus's message, made to name the key and say what was expected: unknown fields get a
    did-you-mean, an unknown ``type:`` lists the known ones, and the two-line "Failed when parsing
    value=... Underlying error is ..." form becomes "`key`: expected T, got V"."""
    key = ".".join(e.key_path) or "config"
    m = _UNKNOWN_FIELDS.match(e.message)
    if m is not None and config_class is not None:
        try:
            cls = _dataclass_at(config_class, e.key_path)
        except Exception:  # noqa: BLE001 -- a hint is best effort
            cls = None
        if cls is not None:
            names = [f.name for f in dataclasses.fields(cls)]
            hints = []
            for unknown in re.findall(r"`([^`]+)`", m["fields"]):
                close = difflib.get_close_matches(unknown, names, n=1)
                if close:
                    hints.append(f"`{close[0]}`")
            if hints:
                return f"{e} (did you mean {', '.join(hints)}?)"
        return str(e)
    m = _NO_CHOICE.match(e.message)
    if m is not None:
        registry = _resolve_class(m["cls"])
        try:
            known = ", ".join(sorted(registry.get_known_choices()))
        except Exception:  # noqa: BLE001
            known = ""
        return f"`{key}`: unknown type {m['value']!r}" + (f"; known types: {known}" if known else "")
    m = _DRACCUS_FAILED.match(e.message)
    if m is None:
        return str(e)
    type_text = m["type"]
    cls_match = re.fullmatch(r"<class '(?P<cls>[\w.]+)'>", type_text)
    expected, why = type_text, f" ({m['cause']})"
    if cls_match is not None:
        cls = _resolve_class(cls_match["cls"])
        expected = cls_match["cls"].rpartition(".")[2]
        if cls is not None and dataclasses.is_dataclass(cls):
            # A section written as a list or a scalar: the cause (some AttributeError) says nothing more.
            expected, why = f"a mapping of {cls.__name__} fields (key: value lines)", ""
    return f"`{key}`: expected {expected}, got {m['value']}{why}"


def _split_config_path(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    rest, path = [], None
    it = iter(argv)
    for a in it:
        if a == "--config_path":
            path = next(it, None)
        elif a.startswith("--config_path="):
            path = a.split("=", 1)[1]
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
        path, rest = _split_config_path(sys.argv[1:] if argv is None else argv)
        try:
            cfg = parse_config(config_class, path, rest)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return fn(cfg)

    return wrapper

"""Reading configs: YAML files (local or fsspec URLs) and dotted CLI overrides, parsed by draccus into
typed dataclasses.

``main`` wraps a ``main(config)`` function into a command-line entry point:
``python -m levanter.main.x --config_path config/foo.yaml --trainer.num_train_steps 100``. Tests call the
wrapped function directly with a config object. User errors (a missing or malformed file, an unknown
key, a value of the wrong type) are reported as one paragraph naming the file and key, without a
traceback, and exit with status 2.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import TypeVar

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
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{where} malformed YAML: {getattr(e, 'problem', None) or e}") from None
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
        return draccus.parse(config_class=config_class, config_path=config_path, args=args)
    except draccus.utils.DecodingError as e:
        raise ConfigError(f"{config_path or 'command line'}: {e}") from None
    except draccus.utils.ParsingError as e:
        # A config class's own validation (``__post_init__``) raised: show that message, not draccus's.
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else e
        raise ConfigError(f"{config_path or 'command line'}: {cause}") from None
    finally:
        if local_path is not None:
            os.unlink(local_path)


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

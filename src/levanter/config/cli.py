"""Entry points' command lines: ``--config_path``, the ``main`` decorator, and ``--help``.

``main`` wraps a ``main(config)`` function into a command-line entry point:
``python -m levanter.main.x --config_path config/foo.yaml --trainer.num_train_steps 100``. Tests call the
wrapped function directly with a config object. A user error (a missing, unreadable or malformed file, a
key given twice, an unknown key, a value of the wrong type) is printed as one ``error:`` paragraph naming
the file or the override and the key, without a traceback, and the command exits with status 2.
``--help`` prints every key with its type, default and description (:mod:`levanter.config.help`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from .explain import ConfigError
from .help import print_help
from .loading import parse_config

__all__ = ["split_config_path", "main"]

T = TypeVar("T")


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

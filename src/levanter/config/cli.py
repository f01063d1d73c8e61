"""Entry points' command lines: ``--config_path``, the ``main`` decorator, and ``--help``.

``main`` wraps a ``main(config)`` function into a command-line entry point:
``python -m levanter.main.x --config_path config/foo.yaml --trainer.num_train_steps 100``. Tests call the
wrapped function directly with a config object. A user error (a missing, unreadable or malformed file, a
key given twice, an unknown key, a value of the wrong type) is printed as one ``error:`` paragraph naming
the file or the override and the key, without a traceback, and the command exits with status 2.
``--help`` prints every key with its type, default and description (:mod:`levanter.config_doc`).

Trade-off: the help generator is imported only when help is asked for, so starting a run never pays for
reading the config classes' source.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from .explain import ConfigError
from .loading import parse_config

__all__ = ["split_config_path", "main", "print_help_for", "print_help"]

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


def print_help_for(config_class) -> None:
    """``--help`` for a command that parses ``config_class``: the running module's (or else a loaded command
    module's) where it documents that class, else a listing of the class's keys."""
    from ..config_doc import EntryPoint, entry_point, format_help

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
    from ..config_doc import entry_point, format_help

    print(format_help(entry_point(module)), end="")

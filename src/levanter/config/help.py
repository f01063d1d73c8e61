"""``--help`` for the entry points: every key with its type, default and description.

Both the ``main`` decorator (:mod:`levanter.config.cli`) and :func:`~levanter.config.loading.parse_config`
(a ``--help`` among the overrides handed to it directly) print help, so it lives here, below both, rather
than in either of them.

Trade-off: the help generator (:mod:`levanter.config_doc`) is imported only when help is asked for, so
starting a run never pays for reading the config classes' source.
"""

from __future__ import annotations

import sys

__all__ = ["print_help_for", "print_help"]


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

"""A facade's public names, gathered from the ``__all__`` of the modules behind it.

Every module lists its public names once, in a literal ``__all__``; a package's ``__init__`` (or a door
module such as :mod:`levanter.utils.fs`) names the modules it stands for and re-exports their names with
one line::

    __all__, __getattr__, __dir__ = facade(__name__, __package__, ("cache", "ledger"))

Eager (the default): the modules are imported now and their names bound in the facade's namespace, for
packages whose import must have side effects (``levanter.tracker`` registers its backends, ``levanter.config``
its duration decoder). ``lazy=True``: each module's ``__all__`` is read from its source (``ast``, nothing
imported) and a name is imported on first use, then cached; ``levanter.ingest`` stays cheap for tokenizer
pool workers that never load tensorstore.

Trade-off: the re-exported names are not visible to static tools reading the facade (pyflakes sees no
import to flag, an IDE no name to complete); in exchange a name is written once, where it is defined, and a
name offered by two modules of one facade is an ``ImportError`` at import, not a silent shadowing (unless,
in an eager facade, both offer the same object: one module re-exports the other's name).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence

__all__ = ["facade", "literal_all"]

# ``__all__ = [...]`` at the start of a line; tests/project/test_architecture.py checks with ``ast`` that every
# module's ``__all__`` is such a literal list of strings, so a pattern is enough here and the lazy
# facades import neither ``ast`` nor the modules they stand for.
_ALL = re.compile(r"^__all__(?:\s*:[^=\n]*)?\s*=\s*[\[(](.*?)[\])]", re.M | re.S)
_NAME = re.compile(r"[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']")


def literal_all(source: str, where: str) -> list[str]:
    """The names in the module-level ``__all__ = [...]`` of ``source`` (``where`` names it in errors)."""
    m = _ALL.search(source)
    if m is None:
        raise ImportError(f"{where}: no module-level __all__ = [...] listing its public names")
    return _NAME.findall(re.sub(r"#[^\n]*", "", m.group(1)))


def _names_of(package: str, module: str, *, lazy: bool) -> list[str]:
    if not lazy:
        return list(importlib.import_module(f".{module}", package).__all__)
    base = os.path.join(os.path.dirname(sys.modules[package].__file__), *module.split("."))
    path = base + ".py" if os.path.exists(base + ".py") else os.path.join(base, "__init__.py")
    with open(path, encoding="utf-8") as f:
        return literal_all(f.read(), path)


def _same(package: str, first: str, second: str, public: str) -> bool:
    """Whether modules ``first`` and ``second`` offer the same object as ``public`` (one re-exports it)."""
    get = importlib.import_module
    return getattr(get(f".{first}", package), public) is getattr(get(f".{second}", package), public)


def facade(
    name: str, package: str, modules: Sequence[str], *, lazy: bool = False
) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for the facade module ``name``, which re-exports every name in
    the ``__all__`` of ``modules`` (relative to ``package``)."""
    where: dict[str, str] = {}
    for module in modules:
        for public in _names_of(package, module, lazy=lazy):
            if public in where and not (not lazy and _same(package, where[public], module, public)):
                raise ImportError(f"{name}: {public!r} is offered by both .{where[public]} and .{module}")
            where.setdefault(public, module)
    names = sorted(where)

    def __getattr__(attr: str):
        module = where.get(attr)
        if module is None:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        value = getattr(importlib.import_module(f".{module}", package), attr)
        setattr(sys.modules[name], attr, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[name])) | set(names))

    if not lazy:
        for public in names:
            setattr(sys.modules[name], public, __getattr__(public))
    return names, __getattr__, __dir__

"""A package's public names, imported from their modules on first use, from a hand-written table.

``levanter.data`` re-exports its modules' public names (its doors) without importing those modules up
front: importing the package stays cheap, and no module of the package imports a sibling through the
package's ``__init__``. Each name is resolved once, then cached in the package's namespace. The other
packages use :func:`levanter.utils.facade.facade`, which reads the names from each module's ``__all__``
instead of a second list; ``levanter.data`` moves to it once its modules list their names.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, Sequence[str]]
) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package`` whose ``exports`` map each submodule (relative
    name) to the names it provides."""
    where = {name: module for module, names in exports.items() for name in names}
    public = sorted(where)

    def __getattr__(name: str):
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return public, __getattr__, __dir__

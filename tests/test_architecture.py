"""The allowed import directions between the parts of ``levanter`` (docs/design/architecture.md).

Every module under ``src/levanter`` is parsed and every import in it is checked, including imports
inside functions and under ``TYPE_CHECKING``: a lazy import is still a dependency. Relative imports are
resolved against the importing module, and ``from package import name`` counts as an import of
``package.name``. Private names stay where they are defined: no import of another module's ``_name``
(a ``_module`` only from inside its package), and no ``obj._name`` whose module does not define it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# Part -> parts it must never import (a part is ``levanter.<part>``: a package or a top-level module).
FORBIDDEN: dict[str, frozenset[str]] = {
    "store": frozenset({"ingest", "data", "models", "trainer", "main", "checkpoint"}),
    "ingest": frozenset({"data", "models", "trainer", "main"}),
    "data": frozenset({"trainer", "models", "main", "checkpoint"}),
    "models": frozenset({"data", "trainer", "main"}),
    "compat": frozenset({"store", "ingest", "data", "trainer", "main"}),
    "checkpoint": frozenset({"trainer", "trainer_config", "main"}),
    "trainer_config": frozenset({"trainer", "main"}),
    "trainer": frozenset({"main"}),
    "lm_loss": frozenset({"trainer", "main"}),
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted((SRC / "levanter").rglob("*.py"))}


def imported_modules(module: str, source: str, *, is_package: bool) -> list[tuple[str, int]]:
    """``(absolute dotted target, line)`` for every import in ``source``.

    ``from a.b import c`` yields ``a.b.c`` whether ``c`` is a module or an attribute of ``a.b``: either
    way the last component is the name the importer reaches for.
    """
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                if alias.name == "*":
                    out.append((base, node.lineno))
                else:
                    out.append((f"{base}.{alias.name}", node.lineno))
    return out


def part_of(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "levanter" else None


def violations(
    module: str, source: str, *, is_package: bool = False, known: set[str] | None = None
) -> list[str]:
    """Every import in ``source`` (the text of ``module``) that breaks the rules, one line each."""
    known = set(all_modules()) if known is None else known
    own_part = part_of(module)
    found = []
    for target, line in imported_modules(module, source, is_package=is_package):
        part = part_of(target)
        if part is None:
            continue
        where = f"{module}:{line} imports {target}"
        if part in FORBIDDEN.get(own_part, ()):
            found.append(f"{where}: {own_part} must not import {part}")
        parts = target.split(".")
        own_entry = module.split(".")[2] if len(module.split(".")) > 2 else None
        if own_part == part == "main" and own_entry and len(parts) > 2 and parts[2] != own_entry:
            found.append(f"{where}: an entry point must not import another entry point")
        # An underscore name is private to the package that holds it (for a module) or to its module (for
        # an attribute); dunder names are not private.
        for i, name in enumerate(parts):
            if not name.startswith("_") or name.startswith("__"):
                continue
            holder = ".".join(parts[:i])
            is_module = ".".join(parts[: i + 1]) in known
            allowed = module.startswith(holder + ".") or module == holder
            if not is_module:
                allowed = module == holder
            if not allowed:
                kind = "module" if is_module else "name"
                found.append(f"{where}: private {kind} {name!r} of {holder}")
            break
    return found


# Private-looking attributes of other libraries used on purpose: ``os._exit`` (documented; a worker
# process must exit without running its parent's exit handlers).
FOREIGN_PRIVATE_ATTRIBUTES = frozenset({"_exit"})


def private_attribute_uses(module: str, source: str) -> list[str]:
    """Every ``obj._name`` in ``source`` where ``_name`` is defined nowhere in the module.

    A module may use the private attributes it defines (on ``self`` or on objects of its own classes);
    one it does not define belongs to another module, which it is reaching into.
    """
    tree = ast.parse(source)
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
            defined.add(node.value)  # __slots__ entries, setattr / object.__setattr__ names
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in defined and node.attr not in FOREIGN_PRIVATE_ATTRIBUTES:
                found.append(f"{module}:{node.lineno} uses {ast.unparse(node)}: private to another module")
    return found


def test_import_directions_hold_for_every_module():
    modules = all_modules()
    known = set(modules)
    problems = []
    for name, path in modules.items():
        problems += violations(name, path.read_text(), is_package=path.name == "__init__.py", known=known)
    assert not problems, "import rules broken (see docs/design/architecture.md):\n" + "\n".join(problems)


def test_no_module_reaches_into_another_modules_private_attributes():
    problems = []
    for name, path in all_modules().items():
        problems += private_attribute_uses(name, path.read_text())
    assert not problems, "\n".join(problems)


def test_private_attribute_checker_catches_a_reach():
    source = "def counts(mix):\n    return mix._drawn_in_stage(0, 10)\n"
    assert any("mix._drawn_in_stage" in v for v in private_attribute_uses("levanter.data.planner", source))
    own = "class A:\n    def __init__(self):\n        self._x = 1\n\ndef f(a):\n    return a._x\n"
    assert private_attribute_uses("levanter.data.a", own) == []


# The modules the synthetic cases below name, so that the checker can tell modules from attributes.
KNOWN = {
    "levanter.data", "levanter.data.mixture", "levanter.data._prp", "levanter.store", "levanter.store.cache",
    "levanter.main", "levanter.main.train_lm", "levanter.main.data_schedule", "levanter.models",
    "levanter.models.gpt2", "levanter.models.llama", "levanter.ingest", "levanter.trainer",
    "levanter.checkpoint", "levanter.checkpoint.resume", "levanter.config", "levanter.trainer_config",
}


@pytest.mark.parametrize(
    "module, source, fragment",
    [
        ("levanter.store.cache", "from levanter.data import MixtureDataset\n", "store must not import data"),
        ("levanter.store.cache", "from ..data.mixture import MixtureDataset\n", "store must not import data"),
        ("levanter.store.cache", "def f():\n    import levanter.ingest.build\n", "must not import ingest"),
        ("levanter.store.cache", "from .. import checkpoint\n", "store must not import checkpoint"),
        ("levanter.ingest.build", "from levanter.data.config import X\n", "ingest must not import data"),
        ("levanter.data.loader", "from ..trainer import Trainer\n", "data must not import trainer"),
        ("levanter.data.loader", "from levanter.models import LmConfig\n", "data must not import models"),
        ("levanter.data.loader", "import levanter.checkpoint\n", "data must not import checkpoint"),
        ("levanter.models.llama", "from ..data import Batch\n", "models must not import data"),
        ("levanter.trainer", "from .main.train_lm import main\n", "trainer must not import main"),
        ("levanter.trainer_config", "from .trainer import Trainer\n", "trainer_config must not import trainer"),
        ("levanter.checkpoint.resume", "from levanter.trainer_config import TrainerConfig\n",
         "checkpoint must not import trainer_config"),
        ("levanter.main.data_schedule", "from .train_lm import TrainLmConfig\n", "another entry point"),
        ("levanter.main.train_lm", "from levanter.data._prp import derive_seed\n", "private module '_prp'"),
        ("levanter.models.llama", "from .gpt2 import _check_config\n", "private name '_check_config'"),
        ("levanter.data.config", "from .mixture import _normalize\n", "private name '_normalize'"),
    ],
)
def test_checker_catches_a_violation(module, source, fragment):
    found = violations(module, source, known=KNOWN)
    assert any(fragment in v for v in found), found


@pytest.mark.parametrize(
    "module, source",
    [
        ("levanter.data.mixture", "from ._prp import derive_seed\n"),  # a package's private module, inside it
        ("levanter.data.loader", "from ..store import TokenCache\nfrom ..schedule import BatchSchedule\n"),
        ("levanter.main.train_lm", "from levanter.data import MixtureDataset\nfrom .. import trainer\n"),
        ("levanter.store.cache", "import numpy as np\nfrom . import ledger\n"),
        ("levanter.main.train_lm", "from . import train_lm\n"),
        ("levanter.models.gpt2", "from levanter import __version__\n"),
    ],
)
def test_checker_accepts_allowed_imports(module, source):
    assert violations(module, source, known=KNOWN) == []

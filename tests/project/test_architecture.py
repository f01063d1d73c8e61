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

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"

# Part -> parts it must never import (a part is ``levanter.<part>``: a package or a top-level module).
FORBIDDEN: dict[str, frozenset[str]] = {
    "store": frozenset({"ingest", "data", "models", "training", "main", "checkpoint"}),
    "ingest": frozenset({"data", "models", "training", "main"}),
    "data": frozenset({"training", "models", "main", "checkpoint"}),
    "models": frozenset({"data", "training", "main"}),
    "compat": frozenset({"store", "ingest", "data", "training", "main"}),
    "checkpoint": frozenset({"training", "main"}),
    "training": frozenset({"main"}),
    "run": frozenset({"main"}),
    "sft_config": frozenset({"main", "run"}),
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



# Inside ``training``: the modules that every entry point, the memory plan and the evaluator read (the
# ``trainer:`` section, the loss, how compiled programs are called, the profiler) import nothing else of the
# package, so that parsing a config or building a loss does not import the step and the loop.
TRAINING_APART = frozenset({"config", "loss", "dispatch", "profiler"})


def training_reaches(module: str, source: str) -> list[str]:
    """The modules of ``training`` outside ``TRAINING_APART`` that ``module`` (one inside it) imports."""
    found = []
    for target, line in imported_modules(module, source, is_package=False):
        parts = target.split(".")
        if parts[:2] == ["levanter", "training"] and len(parts) > 2 and parts[2] not in TRAINING_APART:
            found.append(f"{module}:{line} imports {target}")
    return found


def test_the_training_config_and_loss_import_nothing_of_the_step_or_the_loop():
    modules = all_modules()
    problems = []
    for name in sorted(TRAINING_APART):
        module = f"levanter.training.{name}"
        problems += training_reaches(module, modules[module].read_text())
    assert not problems, "\n".join(problems)
    assert training_reaches("levanter.training.config", "from .trainer import Trainer\n")
    assert training_reaches("levanter.training.loss", "from levanter.training.loop import StepLoop\n")
    assert training_reaches("levanter.training.config", "from .dispatch import FlatStep\n") == []

# The modules the synthetic cases below name, so that the checker can tell modules from attributes.
KNOWN = {
    "levanter.data", "levanter.data.mixture", "levanter.data._prp", "levanter.store", "levanter.store.cache",
    "levanter.main", "levanter.main.train_lm", "levanter.main.data_schedule", "levanter.models",
    "levanter.models.gpt2", "levanter.models.llama", "levanter.ingest", "levanter.training",
    "levanter.training.trainer", "levanter.checkpoint", "levanter.checkpoint.resume", "levanter.config",
    "levanter.training.config",
}


@pytest.mark.parametrize(
    "module, source, fragment",
    [
        ("levanter.store.cache", "from levanter.data import MixtureDataset\n", "store must not import data"),
        ("levanter.store.cache", "from ..data.mixture import MixtureDataset\n", "store must not import data"),
        ("levanter.store.cache", "def f():\n    import levanter.ingest.build\n", "must not import ingest"),
        ("levanter.store.cache", "from .. import checkpoint\n", "store must not import checkpoint"),
        ("levanter.ingest.build", "from levanter.data.config import X\n", "ingest must not import data"),
        ("levanter.data.loader", "from ..training import Trainer\n", "data must not import training"),
        ("levanter.data.loader", "from levanter.models import LmConfig\n", "data must not import models"),
        ("levanter.data.loader", "import levanter.checkpoint\n", "data must not import checkpoint"),
        ("levanter.models.llama", "from ..data import Batch\n", "models must not import data"),
        ("levanter.training.trainer", "from ..main.train_lm import main\n", "training must not import main"),
        ("levanter.checkpoint.resume", "from levanter.training.config import TrainerConfig\n",
         "checkpoint must not import training"),
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
        ("levanter.main.train_lm", "from levanter.data import MixtureDataset\nfrom .. import training\n"),
        ("levanter.store.cache", "import numpy as np\nfrom . import ledger\n"),
        ("levanter.main.train_lm", "from . import train_lm\n"),
        ("levanter.models.gpt2", "from levanter import __version__\n"),
    ],
)
def test_checker_accepts_allowed_imports(module, source):
    assert violations(module, source, known=KNOWN) == []


# ---------------------------------------------------------------------------------------------------------
# The doc's tables and rules, read from docs/design/architecture.md, against the code.
# ---------------------------------------------------------------------------------------------------------

DOC = SRC.parent / "docs" / "design" / "architecture.md"


def doc_section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end >= 0 else len(text)]


def table_rows(section: str) -> list[list[str]]:
    """The cells of each body row of the first Markdown table in ``section``."""
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def ticked(text: str) -> list[str]:
    """The backticked names in ``text``, leaving out what stands in parentheses (explanations)."""
    import re

    while True:
        stripped = re.sub(r"\([^()]*\)", "", text)
        if stripped == text:
            break
        text = stripped
    return re.findall(r"`([^`]+)`", text)


def code_parts() -> set[str]:
    """Every top-level part of ``src/levanter``: a package, or a module other than ``__init__``."""
    root = SRC / "levanter"
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in root.glob("*.py") if p.name != "__init__.py"}
    return packages | modules


def doc_parts() -> list[str]:
    return [name.removesuffix(".*") for row in table_rows(doc_section("The parts")) for name in ticked(row[0])]


def test_parts_table_lists_every_part_and_only_parts_that_exist():
    listed = doc_parts()
    assert len(listed) == len(set(listed)), "a part is listed twice in docs/design/architecture.md"
    missing_in_code = set(listed) - code_parts()
    missing_in_doc = code_parts() - set(listed)
    assert not missing_in_code, f"the parts table lists parts that do not exist: {sorted(missing_in_code)}"
    assert not missing_in_doc, f"parts missing from the table in docs/design/architecture.md: {sorted(missing_in_doc)}"


def test_every_module_path_the_doc_names_exists():
    import re

    named = set(re.findall(r"`([a-z_/]+(?:\.py|/))`", DOC.read_text()))
    root = SRC.parent
    files = {str(p.relative_to(SRC / "levanter")) for p in (SRC / "levanter").rglob("*.py")}

    def exists(p: str) -> bool:  # from the repository root, from src/levanter, or a module named in its part's row
        return (root / p).exists() or (SRC / "levanter" / p).exists() or any(f.endswith("/" + p) for f in files)

    missing = sorted(p for p in named if not exists(p))
    assert named and not missing, f"docs/design/architecture.md names modules that do not exist: {missing}"


def shared_parts() -> set[str]:
    """The parts any part may import, from the sentence that opens the import-direction table."""
    section = doc_section("Import directions")
    sentence = section[section.index("besides "): section.index(", which any part may import")]
    return set(ticked(sentence))


def allowed_imports() -> dict[str, set[str] | None]:
    """Part -> the parts its row of the import-direction table allows (``None``: any part)."""
    allowed: dict[str, set[str] | None] = {}
    for cells in table_rows(doc_section("Import directions")):
        targets = None if cells[1].startswith("any part") else set(ticked(cells[1]))
        for part in ticked(cells[0]):
            allowed[part.removesuffix(".*")] = targets
    return allowed


def part_imports() -> dict[str, set[str]]:
    """Part -> the other parts its modules import."""
    out: dict[str, set[str]] = {}
    for name, path in all_modules().items():
        own = part_of(name)
        for target, _ in imported_modules(name, path.read_text(), is_package=path.name == "__init__.py"):
            part = part_of(target)
            if part is not None and part != own and part in code_parts():
                out.setdefault(own, set()).add(part)
    return out


def test_every_part_has_a_row_in_the_import_table():
    shared, allowed = shared_parts(), allowed_imports()
    assert shared and allowed
    assert set(allowed) | shared == code_parts(), "parts without a row: " + str(sorted(code_parts() - set(allowed) - shared))
    assert not (set(allowed) & shared)


def test_parts_import_only_what_the_import_table_allows():
    shared, allowed = shared_parts(), allowed_imports()
    problems = []
    for part, targets in sorted(part_imports().items()):
        if part in shared:
            extra = targets - shared
            if extra:
                problems.append(f"{part} (imported by every part) imports {sorted(extra)}")
            continue
        ok = allowed[part]
        extra = set() if ok is None else targets - ok - shared
        if extra:
            problems.append(f"{part} imports {sorted(extra)}, which its row does not list")
    assert not problems, "docs/design/architecture.md's import table broken:\n" + "\n".join(problems)


def doc_forbidden() -> dict[str, frozenset[str]]:
    """The "never imports" bullets of the doc, as ``FORBIDDEN`` spells them."""
    import re

    section = doc_section("Import directions")
    rules = section[section.index("The rules the test enforces:"):]
    out: dict[str, frozenset[str]] = {}
    for clause in re.findall(r"`(\w+)` never imports? ([^;\n]*(?:\n  [^;\n-]*)*)", rules):
        part, rest = clause
        out[part] = frozenset(ticked(rest))
    return out


def test_forbidden_imports_are_the_docs_rules():
    assert doc_forbidden() == FORBIDDEN


# ---------------------------------------------------------------------------------------------------------
# Public names: every module lists them once, in a literal ``__all__``; packages re-export them (facade).
# ---------------------------------------------------------------------------------------------------------

# Packages that re-export nothing: the root (importing ``levanter`` must not import JAX) and the entry
# points (each defines ``main``).
NO_FACADE = frozenset({"levanter", "levanter.main"})


def literal_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = ast.literal_eval(node.value)
            assert all(isinstance(n, str) for n in value)
            return list(value)
    return None


def facade_call(tree: ast.Module) -> ast.Call | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if getattr(node.value.func, "id", None) == "facade":
                return node.value
    return None


def static_all(module: str, modules: dict[str, pathlib.Path]) -> set[str] | None:
    """The public names of ``module`` read from source: its literal ``__all__``, the union over the modules
    its ``facade(...)`` names."""
    tree = ast.parse(modules[module].read_text())
    names = literal_all(tree)
    if names is not None:
        return set(names)
    call = facade_call(tree)
    if call is not None:
        package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        out: set[str] = set()
        for sub in ast.literal_eval(call.args[2]):
            out |= static_all(f"{package}.{sub}", modules) or set()
        return out
    return None


def test_every_module_lists_its_public_names_in_a_literal_all():
    problems = []
    for name, path in all_modules().items():
        tree = ast.parse(path.read_text())
        if path.name == "__init__.py" and name not in NO_FACADE:
            continue  # packages: next test
        names = literal_all(tree)
        if names is None and facade_call(tree) is None:
            problems.append(f"{name}: no module-level __all__ = [...]")
        if names is not None and len(set(names)) != len(names):
            problems.append(f"{name}: a name listed twice in __all__")
    assert not problems, "\n".join(problems)


def test_every_package_builds_its_all_with_the_facade():
    modules = all_modules()
    problems = []
    for name, path in modules.items():
        if path.name != "__init__.py" or name in NO_FACADE:
            continue
        call = facade_call(ast.parse(path.read_text()))
        if call is None:
            problems.append(f"{name}: __all__ not built by levanter.utils.facade.facade(...)")
            continue
        for sub in ast.literal_eval(call.args[2]):
            if f"{name}.{sub}" not in modules:
                problems.append(f"{name}: facade names .{sub}, which is not a module of the package")
    assert not problems, "\n".join(problems)


def test_facades_offer_their_modules_names():
    import importlib

    for package in ("levanter.store", "levanter.ingest", "levanter.utils", "levanter.utils.fs", "levanter.data",
                    "levanter.models", "levanter.compat.hf_checkpoints", "levanter.compat", "levanter.training"):
        module = importlib.import_module(package)
        assert set(module.__all__) == static_all(package, all_modules())
        assert all(getattr(module, n) is not None for n in module.__all__)


def entry_point_import_violations(module: str, source: str, modules: dict[str, pathlib.Path]) -> list[str]:
    """Names of another part that entry point ``module`` takes without the ``__all__`` they come from
    listing them: imported (``from m import name``) or reached through a module imported by name
    (``from levanter.utils import fs`` then ``fs.name``). A private module is caught by ``violations``."""
    found = []
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> the module of another part it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and part_of(alias.name) not in (None, "main") and alias.name in modules:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and part_of(node.module or "") not in (None, "main"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            target = aliases[node.value.id]
            public = static_all(target, modules)
            if f"{target}.{node.attr}" not in modules and (public is None or node.attr not in public):
                found.append(f"{module}:{node.lineno} uses {node.value.id}.{node.attr}, "
                             f"which {target} does not list in __all__")
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            base = ".".join("levanter.main".split(".")[: 2 - (node.level - 1)] + ([base] if base else []))
        if part_of(base) in (None, "main") or base not in modules:
            continue
        public = static_all(base, modules)
        for alias in node.names:
            if f"{base}.{alias.name}" in modules:
                continue
            if public is None or alias.name not in public:
                found.append(f"{module}:{node.lineno} imports {alias.name} from {base}, "
                             f"which does not list it in __all__")
    return found


def test_entry_points_import_only_public_names():
    modules = all_modules()
    problems = []
    for name, path in modules.items():
        if name.startswith("levanter.main."):
            problems += entry_point_import_violations(name, path.read_text(), modules)
    assert not problems, "\n".join(problems)


def test_entry_point_checker_catches_a_name_outside_all():
    modules = all_modules()
    bad = ("from levanter.checkpoint.layout import _STEP_DIR\nfrom levanter.progress import logger\n"
           "from levanter.ingest import sources\nsources.FORMATS\n")
    found = entry_point_import_violations("levanter.main.train_lm", bad, modules)
    assert len(found) == 3, found
    good = ("from levanter.checkpoint import Checkpointer\nfrom levanter.utils import fs\nfrom ..progress import RunProgress\n"
            "fs.join('a', 'b')\n")
    assert entry_point_import_violations("levanter.main.train_lm", good, modules) == []


SCHEMES = ("gs://", "s3://", "memory://", "gs", "s3", "memory", "gcs")


def scheme_branches(module: str, source: str) -> list[str]:
    """Tests of a storage scheme in ``source``: ``url.startswith("gs://")``, ``"s3://" in url``,
    ``scheme == "gs"``, ``scheme in ("gs", "s3")``."""
    found = []

    def scheme_url(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(SCHEMES[:3])

    def scheme_name(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(scheme_name(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in SCHEMES

    for node in ast.walk(ast.parse(source)):
        hits = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            hits = [c for c in operands for c in ast.walk(c) if scheme_url(c)]
            equality = all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
            if equality and any(scheme_name(c) for c in node.comparators):
                hits.append(node.comparators[0])
            if all(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops) and scheme_name(node.left):
                hits.append(node.left)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("startswith", "removeprefix", "endswith"):
            hits = [c for a in node.args for c in ast.walk(a) if scheme_url(c)]
        if hits:
            found.append(f"{module}:{node.lineno} branches on a storage scheme: {ast.unparse(node)[:80]}")
    return found


def test_only_the_storage_modules_branch_on_a_url_scheme():
    problems = []
    for name, path in all_modules().items():
        if not name.startswith("levanter.utils."):
            problems += scheme_branches(name, path.read_text())
    assert not problems, "branch through levanter.utils.fs (is_object_store, url_scheme...) instead:\n" + "\n".join(problems)
    assert scheme_branches("m", "def f(p):\n    return p.startswith('gs://')\n")
    assert scheme_branches("m", "def f(p):\n    return scheme in ('gs', 's3')\n")
    assert scheme_branches("m", "def f(u):\n    return 's3://' in u or u == 'memory'\n")
    assert scheme_branches("m", "x = 'see gs://bucket'\nok = 'memory' in line.lower()\n") == []


def test_only_help_and_entry_points_import_the_help_generator():
    """Config dataclasses import ``refused_keys`` for the ``refused`` marker, never ``config_doc``: only the
    help (``config.help``) and entry points do."""
    problems = []
    for name, path in all_modules().items():
        if name in ("levanter.config_doc", "levanter.config.help") or name.startswith(("levanter.config_doc.", "levanter.main.")):
            continue
        for target, line in imported_modules(name, path.read_text(), is_package=path.name == "__init__.py"):
            if target == "levanter.config_doc" or target.startswith("levanter.config_doc."):
                problems.append(f"{name}:{line} imports {target}")
    assert not problems, "\n".join(problems)

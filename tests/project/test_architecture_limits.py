"""The house's size and coupling rules (docs/design/architecture.md, "Limits"), checked on every module under
``src/levanter``:

* no library file over ``MAX_FILE_LINES`` lines and no function over ``MAX_FUNCTION_LINES`` lines, except those
  the design doc lists under "Longer than the limits" with the reason (a listed one that fits is stale);
* no import circle between modules (imports inside functions count: a lazy import is still a dependency; a
  name imported from a package counts as an import of the module of that package that defines it);
* nothing from ``jax._src`` (JAX's private modules change without notice), but where ``JAX_PRIVATE_ALLOWED``
  says why;
* no ``getattr(obj, "name")`` with a literal name that one of the project's own classes declares: the type
  is ours, so say what it offers (a field, a ``Protocol``) instead of probing for it by string;
* every test file in the folder of the part it tests (``tests/<package>/``, or ``tests/project/`` for the
  project's own checks), so that a part's tests are found from its name.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from test_architecture import SRC, all_modules, imported_modules

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
DESIGN = SRC.parent / "docs" / "design" / "architecture.md"


def _exceptions() -> dict[str, str]:
    """``path`` or ``path:function`` -> why, from the design doc's table under "Longer than the limits"."""
    text = DESIGN.read_text()
    m = re.search(r"^#+ Longer than the limits\s*$(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    out = {}
    if m:
        for row in re.finditer(r"^\|\s*`([^`]+)`\s*\|\s*(.+?)\s*\|\s*$", m.group(1), re.M):
            out[row.group(1)] = row.group(2)
    return out


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    files, functions = {}, {}
    for path in sorted((SRC / "levanter").rglob("*.py")):
        rel = str(path.relative_to(SRC.parent))
        source = path.read_text()
        files[rel] = len(source.splitlines())
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[f"{rel}:{node.name}"] = max(functions.get(f"{rel}:{node.name}", 0),
                                                      node.end_lineno - node.lineno + 1)
    return files, functions


def test_no_file_or_function_is_longer_than_the_limits_unless_the_design_doc_says_why():
    files, functions = _sizes()
    allowed = _exceptions()
    long = {k: n for k, n in files.items() if n > MAX_FILE_LINES}
    long.update({k: n for k, n in functions.items() if n > MAX_FUNCTION_LINES})
    unexplained = [f"{k}: {n} lines" for k, n in sorted(long.items()) if k not in allowed]
    assert not unexplained, (f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function; split it "
                             "or list it with the reason in docs/design/architecture.md, 'Longer than the "
                             "limits':\n" + "\n".join(unexplained))
    stale = [k for k in allowed if k not in long]
    assert not stale, f"listed as longer than the limits but within them (drop the rows): {stale}"


def _defining_module(target: str, modules: dict[str, pathlib.Path], all_of: dict[str, set[str]]) -> str | None:
    """The module ``target`` (``a.b.name``) stands for: a module itself, or the module of a package that
    lists ``name`` in its ``__all__``; None for a package's own ``__init__`` or a name found nowhere."""
    if target in modules and modules[target].name != "__init__.py":
        return target
    holder, _, name = target.rpartition(".")
    if holder in modules and modules[holder].name != "__init__.py":
        return holder
    if holder in modules:  # a package: the submodule (at any depth) whose __all__ lists the name
        found = [m for m, names in all_of.items() if m.startswith(holder + ".") and name in names]
        if found:
            return min(found, key=len)
    return None


def _import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    all_of = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                try:
                    all_of[name] = set(ast.literal_eval(node.value))
                except ValueError:
                    pass
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if path.name == "__init__.py":
            continue
        edges = set()
        for target, _ in imported_modules(name, path.read_text(), is_package=False):
            if target.startswith("levanter."):
                dest = _defining_module(target, modules, all_of)
                if dest is not None and dest != name:
                    edges.add(dest)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles_between_modules():
    found = circles(_import_graph())
    assert not found, "modules that import each other (directly or around a circle):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_circle_finder_finds_a_circle_and_only_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


# The modules that must read JAX's private API, each with the reason (the design doc says the same).
JAX_PRIVATE_ALLOWED = {
    "levanter.distributed": "the coordinator's key-value store client: jax 0.10.2 has no public accessor "
                            "(jax.distributed offers initialize, is_initialized and shutdown only)",
}


def test_nothing_imports_jax_private_modules():
    found = []
    for name, path in all_modules().items():
        if name in JAX_PRIVATE_ALLOWED:
            continue
        for target, line in imported_modules(name, path.read_text(), is_package=path.name == "__init__.py"):
            if target == "jax._src" or target.startswith("jax._src."):
                found.append(f"{name}:{line} imports {target}")
    assert not found, "jax._src is JAX's private API; use a public one:\n" + "\n".join(found)


def _declared_names() -> set[str]:
    """Every attribute the project's classes declare: methods, class-level fields, ``self.x = ...``."""
    names = set()
    for path in (SRC / "levanter").rglob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                        isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return {n for n in names if not n.startswith("__")}


# getattr by a literal name that one of our classes declares too, where the object is not one of our types, or
# the attribute is optional by design. Each entry: (module, name) -> what the object is.
FOREIGN_GETATTR: dict[tuple[str, str], str] = {
    ("levanter.compat.hf_checkpoints.load", "shape"): "a safetensors entry or a NumPy array",
    ("levanter.compat.hf_checkpoints.weights", "sharding"): "a jax.Array or a NumPy array",
    ("levanter.config.explain", "OTHER_ENTRY_POINTS"): "an optional ClassVar a config class may declare",
    ("levanter.config.help", "name"): "a module's __spec__ (importlib)",
    ("levanter.config_doc.entry", "config_class"): "an entry point's main function, marked by its decorator",
    ("levanter.data._prp", "dtype"): "a JAX PRNG key or an integer seed",
    ("levanter.ingest.embedded", "id"): "an ast node",
    ("levanter.models.lm_model", "shape"): "a pytree leaf (array or not)",
    ("levanter.models.lm_model", "dtype"): "a pytree leaf (array or not)",
    ("levanter.optim.muon", "name"): "a JAX key-path entry",
    ("levanter.optim.muon", "key"): "a JAX key-path entry",
    ("levanter.utils.layer_select", "key"): "a JAX key-path entry",
    ("levanter.quantization.config", "lm_head"): "any model: only the Llama-style ones have an untied head layer, and "
                                          "quantization imports no model",
    ("levanter.tracker.tracker", "dtype"): "a logged value (array, NumPy scalar or Python number)",
    ("levanter.tracker.tracker", "shape"): "a logged value (array, NumPy scalar or Python number)",
    ("levanter.utils.flops", "device_kind"): "a jax Device",
}


def getattr_probes(module: str, source: str, declared: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
                isinstance(node.args[1].value, str):
            name = node.args[1].value
            if name in declared and (module, name) not in FOREIGN_GETATTR:
                found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_getattr_by_string_on_the_projects_own_types():
    declared = _declared_names()
    found = []
    for name, path in all_modules().items():
        found += getattr_probes(name, path.read_text(), declared)
    assert not found, ("a literal getattr/hasattr of a name the project's classes declare: type the object "
                       "(a field, a Protocol) instead, or list it in FOREIGN_GETATTR with what the object "
                       "is:\n" + "\n".join(found))


@pytest.mark.parametrize("source, hit", [
    ("def f(c):\n    return getattr(c, 'save_due', None)\n", True),
    ("def f(c):\n    return hasattr(c, 'save_due')\n", True),
    ("def f(c):\n    return getattr(c, 'no_class_declares_this_name')\n", False),
    ("def f(c, n):\n    return getattr(c, n)\n", False),
])
def test_the_getattr_checker(source, hit):
    assert bool(getattr_probes("levanter.x", source, {"save_due"})) == hit


TESTS = SRC.parent / "tests"


def test_every_test_file_is_in_the_folder_of_a_part():
    parts = {p.name for p in (SRC / "levanter").iterdir() if (p / "__init__.py").is_file()} | {"main", "project"}
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"test files outside a part's folder (move them to tests/<part>/): {loose}"
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert folders <= parts, f"test folders that name no package of src/levanter: {sorted(folders - parts)}"

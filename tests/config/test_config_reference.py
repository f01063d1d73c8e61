"""The config reference and ``--help``: ``docs/reference/config.md`` matches the dataclasses, every key has
a description and a default and is listed once, and every key is read by the code or refused when set.

Nothing here starts a JAX computation: the entry-point modules are imported, and their configs walked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import re
from collections import Counter
from pathlib import Path

import pytest

from levanter import config_doc, refused_keys

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "levanter"


def _generator():
    path = REPO / "scripts" / "gen_config_reference.py"
    spec = importlib.util.spec_from_file_location("gen_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _generator()


@pytest.fixture(scope="module")
def entries(gen):
    return gen.entry_points()


def test_the_reference_page_is_up_to_date(gen):
    page = REPO / "docs" / "reference" / "config.md"
    assert page.exists(), f"{page} is missing: run {gen.COMMAND}"
    assert page.read_text(encoding="utf-8") == gen.render(), f"{page} is out of date: run {gen.COMMAND}"


def test_every_command_is_documented(entries):
    modules = {e.module for e in entries}
    shipped = {f"levanter.main.{p.stem}" for p in (SRC / "main").glob("*.py") if p.stem != "__init__"}
    missing = sorted(shipped - modules)
    assert not missing, f"add {missing} to ENTRY_POINTS in scripts/gen_config_reference.py"


def test_every_key_has_a_description_and_a_default(entries):
    missing = []
    for e in entries:
        for s in config_doc.entry_sections(e):
            for r in s.fields:
                assert r.default, r.key
                if not r.description:
                    where = f"{r.owner.__module__}.{r.owner.__qualname__}" if r.owner else e.module
                    missing.append(f"{r.key} ({where}.{r.name})")
    assert not missing, "write a one-line comment above each field:\n" + "\n".join(sorted(set(missing)))


COMMANDS = sorted(p.stem for p in (SRC / "main").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", COMMANDS)
def test_help_lists_each_key_once_with_its_default(module):
    mod = importlib.import_module(f"levanter.main.{module}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        mod.cli(["--help"])
    assert e.value.code == 0
    text = out.getvalue()
    listed = Counter(re.findall(r"^  --(\S+) \(.*; default .*\)$", text, flags=re.M))
    assert listed
    # Refused keys are named together on one (wrapped) line per section.
    for block in re.findall(r"^  refused if set .*?:((?:.|\n)*?)(?=\n\S|\n  \S|\n\n|\Z)", text, flags=re.M):
        listed.update(re.findall(r"--([^\s,]+)", block))
    sections = config_doc.entry_sections(config_doc.entry_point(mod))
    where: dict = {}
    for s in sections:
        keys = [r.key for r in s.fields]
        assert len(keys) == len(set(keys)), s.title
        for k in keys:
            where.setdefault(k, []).append(s.title)
    for key, titles in where.items():
        assert listed[key] == len(titles), key  # printed once per section that has it, no more
        own = [t for t in titles if t != config_doc.FIRST_TITLE]  # the keys set most often are listed twice
        if len(own) > 1:  # only alternatives repeat a key: the types of a choice, the members of a union
            assert all(" with type: " in t or " as " in t for t in own), (key, titles)
    assert set(listed) == set(where)
    assert "(no description)" not in text


def test_train_lm_help_opens_with_the_keys_set_most_often():
    # Declaration order would open with z_loss_weight and bury trainer.num_train_steps some 230 lines down.
    from levanter.main import train_lm

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        train_lm.cli(["--help"])
    keys = re.findall(r"^  --(\S+) \(", out.getvalue(), flags=re.M)
    assert keys[:len(train_lm.HELP_FIRST)] == list(train_lm.HELP_FIRST)
    lines = out.getvalue().splitlines()
    assert next(i for i, line in enumerate(lines) if "--trainer.num_train_steps" in line) < 40
    assert re.search(r"^  --model\.type \(one of .*gpt2, llama.*; default llama\)$", out.getvalue(), flags=re.M)
    page = (REPO / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    first_table = page.split(f"### train_lm: {config_doc.FIRST_TITLE}", 1)[1].split("###", 1)[0]
    assert re.findall(r"^\| `([^`]+)` \|", first_table, flags=re.M) == list(train_lm.HELP_FIRST)


@dataclasses.dataclass(frozen=True)
class Inner:
    # a key this code does not implement
    later: int = refused_keys.refused("not built; remove it", default=0)


@dataclasses.dataclass(frozen=True)
class Outer:
    # the nested section
    inner: Inner = dataclasses.field(default_factory=Inner)
    # mapping of sections
    many: dict = dataclasses.field(default_factory=dict)


def test_refused_fields_are_marked_and_refused_when_set():
    refused_keys.check_refused(Outer())  # defaults pass
    with pytest.raises(ValueError, match=r"^x\.inner\.later=3 is not supported: not built; remove it$"):
        refused_keys.check_refused(Outer(inner=Inner(later=3)), "x")
    with pytest.raises(ValueError, match=r"many\.a\.later=1"):
        refused_keys.check_refused(Outer(many={"a": Inner(later=1)}))
    rows = config_doc.all_fields(config_doc.EntryPoint("m", "s", Outer))
    assert [(r.key, r.refused, r.description) for r in rows] == [
        ("many", None, "mapping of sections"),
        ("inner.later", "not built; remove it", "a key this code does not implement"),
    ]


# -- every key is read somewhere, or refused ----------------------------------------------------------------
@pytest.fixture(scope="module")
def names_read() -> set:
    """Every attribute name the library's code reads (``x.name``) and every identifier-like string constant
    outside docstrings (``getattr(c, "name")``, a tuple of key names): field declarations, comments and
    prose are not reads."""
    import ast

    found: set = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                found.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                if id(node) not in docstrings:
                    found.add(node.value)
    return found


def test_every_key_is_read_or_refused(entries, names_read):
    """A key that parses but that no code reads would be silently ignored. A field counts as read where the
    library's code reads its name as an attribute (``.name``) or names it in a string
    (``getattr(c, "name")``); a field marked with ``refused_keys.refused`` is refused by ``check_refused``
    when set."""
    unread = set()
    for e in entries:
        for r in config_doc.all_fields(e):
            if not r.refused and r.name not in names_read:
                unread.add(f"{r.owner.__module__}.{r.owner.__qualname__}.{r.name}")
    assert not unread, "read these fields where they take effect, or mark them refused_keys.refused(...):\n" + \
        "\n".join(sorted(unread))

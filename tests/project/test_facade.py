"""levanter.utils.facade: a package's names gathered from its modules' ``__all__``, eagerly or lazily."""

import importlib
import sys
import textwrap

import pytest

from levanter.utils.facade import literal_all


def make_package(tmp_path, monkeypatch, name, init, modules):
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text(textwrap.dedent(init))
    for module, text in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, key)


def test_literal_all_reads_the_list_with_comments_and_an_annotation():
    source = '"""doc"""\nimport os\n\n__all__: list[str] = [\n    "a",  # it\'s public\n    \'b\',\n]\nc = 1\n'
    assert literal_all(source, "m.py") == ["a", "b"]
    with pytest.raises(ImportError, match="m.py: no module-level __all__"):
        literal_all("x = 1\n", "m.py")


@pytest.mark.parametrize("lazy", [False, True])
def test_facade_reexports_every_listed_name_and_imports_lazily_on_first_use(tmp_path, monkeypatch, lazy):
    name = f"facadepkg_{'lazy' if lazy else 'eager'}"
    make_package(tmp_path, monkeypatch, name, f"""
        from levanter.utils.facade import facade

        __all__, __getattr__, __dir__ = facade(__name__, __package__, ("one", "two"), lazy={lazy})
        """, {
        "one": '__all__ = ["A", "f"]\nA = 1\n\ndef f():\n    return 2\n\n_hidden = 3\n',
        "two": '__all__ = ["B"]\nB = "b"\n',
    })
    package = importlib.import_module(name)
    assert package.__all__ == ["A", "B", "f"]
    assert (f"{name}.two" in sys.modules) is not lazy  # a lazy facade imports a module on first use only
    assert (package.A, package.B, package.f()) == (1, "b", 2)
    assert f"{name}.two" in sys.modules
    assert {"A", "B", "f"} <= set(dir(package))
    with pytest.raises(AttributeError):
        package._hidden


@pytest.mark.parametrize("lazy", [False, True])
def test_a_name_offered_by_two_modules_is_an_import_error(tmp_path, monkeypatch, lazy):
    name = f"facadeclash_{'lazy' if lazy else 'eager'}"
    make_package(tmp_path, monkeypatch, name, f"""
        from levanter.utils.facade import facade

        __all__, __getattr__, __dir__ = facade(__name__, __package__, ("one", "two"), lazy={lazy})
        """, {"one": '__all__ = ["A"]\nA = 1\n', "two": '__all__ = ["A"]\nA = 2\n'})
    with pytest.raises(ImportError, match=r"'A' is offered by both \.one and \.two"):
        importlib.import_module(name)


def test_an_eager_facade_accepts_a_name_one_module_reexports_from_another(tmp_path, monkeypatch):
    make_package(tmp_path, monkeypatch, "facadereexport", """
        from levanter.utils.facade import facade

        __all__, __getattr__, __dir__ = facade(__name__, __package__, ("one", "two"))
        """, {"one": '__all__ = ["A"]\nA = object()\n', "two": '__all__ = ["A", "B"]\nfrom .one import A\nB = 2\n'})
    package = importlib.import_module("facadereexport")
    assert package.__all__ == ["A", "B"] and package.A is importlib.import_module("facadereexport.one").A

"""Entry points, each run as ``python -m levanter.main.<name>``.

The one package that re-exports nothing: every entry point defines ``main`` and ``cli``, and importing
one must not import the others.
"""

__all__: list[str] = []

"""What each config key means: the one-line descriptions, defaults and types behind ``--help`` and
``docs/reference/config.md``, and the fields accepted from upstream configs but refused when set.

One place, read by both ``--help`` and the reference generator (``scripts/gen_config_reference.py``), so
the two never disagree. The package is split by concept:

* :mod:`~levanter.config_doc.comments`: a field's description, the comment above it in its dataclass;
* :mod:`~levanter.config_doc.fields`: a config class walked into sections of rows (key, type and default
  in YAML terms, description, refusal);
* :mod:`~levanter.config_doc.entry`: the documented commands (:class:`EntryPoint`) and their sections;
* :mod:`~levanter.config_doc.render`: ``--help`` text and the Markdown reference page.

Fields marked :func:`~levanter.refused_keys.refused` (upstream keys not built here, rejected by
:func:`~levanter.refused_keys.check_refused` when set) are listed as refused by ``--help`` and the
reference; the marker lives in :mod:`levanter.refused_keys`, so that config dataclasses do not import
this package.
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(__name__, __package__, ("comments", "fields", "entry", "render"))

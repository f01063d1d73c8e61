"""Configs: YAML files and dotted command-line overrides read into typed dataclasses (draccus).

The package is split by concept; the names below are its public surface:

* :mod:`~levanter.config.loading`: reading YAML (``!include``, duplicate keys refused, each key's origin)
  and :func:`parse_config`, which adds the command-line overrides and expands ``~`` in path keys;
* :mod:`~levanter.config.explain`: :class:`ConfigError` and :func:`describe_error`, one paragraph per
  draccus error, naming the file or override and the key;
* :mod:`~levanter.config.durations`: :func:`parse_timedelta` (``15m``, ``30s``), registered with draccus
  for every ``datetime.timedelta`` field when this package is imported;
* :mod:`~levanter.config.cli`: the :func:`main` decorator that makes a ``main(config)`` function an entry
  point and ``--config_path``;
* :mod:`~levanter.config.help`: ``--help`` (:func:`print_help`, :func:`print_help_for`), below both the
  decorator and :func:`parse_config`, which print it.

What each key means (``--help``, ``docs/reference/config.md``) is :mod:`levanter.config_doc`; the marker for
upstream keys refused when set is :mod:`levanter.refused_keys`.

Trade-off: importing any of these names imports the whole package (draccus, PyYAML, fsspec), since the
duration decoder must be registered before any config is parsed.
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(__name__, __package__, ("cli", "durations", "explain", "help", "loading"))

"""Configs: YAML files and dotted command-line overrides read into typed dataclasses (draccus).

The package is split by concept; the names below are its public surface:

* :mod:`~levanter.config.loading`: reading YAML (``!include``, duplicate keys refused, each key's origin)
  and :func:`parse_config`, which adds the command-line overrides and expands ``~`` in path keys;
* :mod:`~levanter.config.explain`: :class:`ConfigError` and :func:`describe_error`, one paragraph per
  draccus error, naming the file or override and the key;
* :mod:`~levanter.config.durations`: :func:`parse_timedelta` (``15m``, ``30s``), registered with draccus
  for every ``datetime.timedelta`` field when this package is imported;
* :mod:`~levanter.config.cli`: the :func:`main` decorator that makes a ``main(config)`` function an entry
  point, ``--config_path`` and ``--help``.

What each key means (``--help``, ``docs/reference/config.md``) is :mod:`levanter.config_doc`; the marker for
upstream keys refused when set is :mod:`levanter.refused_keys`.

Trade-off: importing any of these names imports the whole package (draccus, PyYAML, fsspec), since the
duration decoder must be registered before any config is parsed.
"""

from .cli import main, print_help, split_config_path
from .durations import parse_timedelta
from .explain import ConfigError, describe_error
from .loading import LOCAL_PATH_KEYS, expand_user_paths, load_yaml, load_yaml_origins, parse_config

__all__ = [
    "LOCAL_PATH_KEYS",
    "ConfigError",
    "describe_error",
    "expand_user_paths",
    "load_yaml",
    "load_yaml_origins",
    "main",
    "parse_config",
    "parse_timedelta",
    "print_help",
    "split_config_path",
]

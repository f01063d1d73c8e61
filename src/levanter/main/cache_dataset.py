"""Build token caches ahead of training: ``python -m levanter.main.cache_dataset --config_path X``.

``X`` may be a whole ``train_lm`` config (its ``data:`` section is used; the rest is not read) or a
data-only config. Both splits of every source are built (or resumed, or found finished), each with a
progress bar on a terminal (documents, tokens, tokens/s, shards, ETA; log lines every 10 s elsewhere) and
a summary line; every record, third-party libraries' included, goes to ``<data.cache_dir>/debug.log``
(``logs/cache_dataset/debug.log`` for a cache in a bucket), named on the first line. ``--backend ray`` (with ``--ray_address HOST:PORT`` to join a cluster) tokenizes on Ray:
shorthands for ``cache_options.backend`` and ``cache_options.ray_address``. Overrides such as
``--data.cache_dir /tmp/c`` (or, for a data-only config, ``--cache_dir /tmp/c``) work as in training.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

import draccus

from ..cli_args import join_dash_values, key_is_known, suggest_key
from ..config import ConfigError, describe_error, expand_user_paths, load_yaml_origins, split_config_path
from ..config_doc import EntryPoint, all_fields, format_help
from ..data.config import DataConfig, LMMixtureDatasetConfig
from ..errors import OUT_OF_SPACE_EXIT_CODE, OutOfSpaceError
from ..progress import open_command_debug_log, open_debug_log, setup_console_logging
from ..utils import fs

__all__ = ["load_data_config", "main", "cli"]

logger = logging.getLogger(__name__)


# ``--help`` and docs/reference/config.md: the data section's keys, at the top level of a data-only config.
CONFIG_DOC = EntryPoint(
    "levanter.main.cache_dataset",
    "Build token caches ahead of training.",
    DataConfig,
    note="The config is a data-only config (the keys below at the top level) or a whole train_lm config "
    "(the same keys under data:, overridden as --data.KEY; the other sections are not read).",
)


def _override_tree(args: Sequence[str], prefix: str) -> dict:
    """``--data.cache_dir x`` -> ``{"cache_dir": "x"}`` (values parsed as YAML scalars; the arguments are
    pairs, as :func:`_pairs` reads them)."""
    import yaml

    out: dict = {}
    for key, value in _pairs(args):
        if prefix:
            if not key.startswith(prefix + "."):
                continue
            key = key[len(prefix) + 1 :]
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(value)
    return out


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


# Command-line shorthands for keys of the data section: ``--backend ray`` is ``--data.cache_options.backend
# ray`` for a train_lm config and ``--cache_options.backend ray`` for a data-only one.
_SHORTHANDS = {"backend": "cache_options.backend", "ray_address": "cache_options.ray_address"}


def _expand_shorthands(args: Sequence[str], prefix: str) -> list[str]:
    out = []
    for a in args:
        key, eq, value = a[2:].partition("=") if a.startswith("--") else ("", "", "")
        if key in _SHORTHANDS:
            a = f"--{prefix + '.' if prefix else ''}{_SHORTHANDS[key]}{eq}{value}"
        out.append(a)
    return out


def _pairs(args: Sequence[str]) -> list[tuple[str, str]]:
    """``--key value`` / ``--key=value`` pairs (keys without ``--``); anything else is refused."""
    out, it = [], iter(args)
    for a in it:
        if not a.startswith("--"):
            raise ConfigError(f"command line: unexpected argument {a!r}: overrides are --KEY VALUE pairs")
        key, eq, value = a[2:].partition("=")
        if not eq:
            value = next(it, None)
            if value is None:
                raise ConfigError(f"command line: missing a value for --{key}")
        out.append((key, value))
    return out


def _check_keys(args: Sequence[str], config_path: str, whole: bool) -> None:
    """Refuse an override this command does not read, rather than build without it: a data key given
    without ``data.`` for a train_lm config (or with it for a data-only one), another section's key
    (``--trainer.*``), or no key at all; the message names the right spelling where one exists."""
    known = [f.key for f in all_fields(CONFIG_DOC)]
    bad, hints = [], []
    for given in _pairs(args):
        key = given[0]
        inner = key[len("data."):] if whole and key.startswith("data.") else None if whole else key
        if inner is not None and key_is_known(inner, known):
            continue
        bad.append(given)
        if whole and inner is None and key_is_known(key, known):
            hints.append(f"--data.{key}")
        elif not whole and key.startswith("data.") and key_is_known(key[len("data."):], known):
            hints.append(f"--{key[len('data.'):]}")
        else:
            close = suggest_key(inner if inner is not None else key, known)
            if close is not None:
                hints.append(f"--data.{close}" if whole else f"--{close}")
    if not bad:
        return
    given = " ".join(f"--{k} {v}" for k, v in bad)
    shape = (f"{config_path} is a train_lm config, whose data keys are overridden as --data.KEY (its other "
             "sections are not read)" if whole else f"{config_path} is a data-only config, whose keys are "
             "overridden as --KEY")
    hint = f"; did you mean {', '.join(hints)}?" if hints else ""
    raise ConfigError(f"command line: cache_dataset does not read {given}: {shape}{hint}")


def load_data_config(config_path: str, args: Sequence[str] = ()) -> DataConfig:
    raw, origins = load_yaml_origins(config_path)
    whole = "data" in raw
    args = _expand_shorthands(join_dash_values(args), "data" if whole else "")
    _check_keys(args, config_path, whole)
    section = raw.get("data") or {} if whole else raw
    section = _merge(dict(section), _override_tree(args, "data" if whole else ""))
    try:
        return expand_user_paths(draccus.decode(DataConfig, section))
    except draccus.utils.ParsingError as e:
        where = ("data",) if whole else ()
        message = describe_error(e, DataConfig, section, source=config_path, args=args, prefix=where,
                                 origins=origins)
        raise ConfigError(message) from None


def main(config: DataConfig) -> dict:
    """Build every cache ``config`` names; returns ``{(source, split): TokenCache}``."""
    config.check_inputs()  # every source's files and cache directory, before any tokenizing
    return _build_all(config)


def _debug_log(config: DataConfig) -> str | None:
    """Open the command's debug log where the caches are: ``<data.cache_dir>/debug.log`` (appended to by
    every build into that directory); under ``logs/cache_dataset/`` when the caches are in a bucket, which
    cannot be appended to. None when console logging was not set up (called from Python)."""
    cache_dir = config.cache_dir or "cache/"
    if fs.is_url(cache_dir):
        return open_command_debug_log("cache_dataset")
    return open_debug_log(cache_dir, key="data.cache_dir")


def _build_all(config: DataConfig) -> dict:
    t0 = time.perf_counter()
    out = {}
    for split in ("train", "validation"):
        caches = config.build_caches(split)
        if isinstance(config, LMMixtureDatasetConfig):
            out.update({(name, split): c for name, c in caches.items()})
        elif caches is not None:
            out[("", split)] = caches
    for (name, split), cache in out.items():
        print(
            f"{name or 'data'}/{split}: {cache.ledger.total_rows:,} documents, "
            f"{cache.ledger.total_tokens:,} tokens at {cache.cache_dir}"
        )
    seconds = time.perf_counter() - t0
    tokens = sum(c.ledger.total_tokens for c in out.values())
    print(f"{len(out)} caches, {tokens:,} tokens, ready in {seconds:.1f} s (each build logs its throughput)")
    return out


def cli(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        print(format_help(CONFIG_DOC), end="")
        raise SystemExit(0)
    try:
        path, rest = split_config_path(argv)
        if path is None:
            raise ConfigError("--config_path is required: give a train_lm or data-only config (YAML)")
        config = load_data_config(path, rest)
        config.check_inputs()  # before the debug log creates the cache directory
        debug_log = _debug_log(config)
        if debug_log is not None:
            print(f"debug log: {debug_log}", flush=True)  # said first, so a build that fails can be looked into
        _build_all(config)
    except OutOfSpaceError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(OUT_OF_SPACE_EXIT_CODE) from None
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {fs.redact(str(e))}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    setup_console_logging()  # levanter's INFO on the console; everything, third parties' too, in the debug log
    cli()

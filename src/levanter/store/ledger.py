"""The cache ledger: the one JSON file that says how much of a cache build is committed.

A build appends each input shard's rows to the stores, waits for the writes to land, then saves the
ledger. The ledger is therefore the authority on what is valid: on resume the stores are opened with
``num_rows=ledger.total_rows`` and anything they hold past that is overwritten. Saving is atomic
(locally: temporary file in the same directory, fsync, ``os.replace``, fsync of the directory; on an
object store: one PUT, which readers see whole or not at all), so a crash leaves either the old ledger or
the new one, never a torn one. The ledger write is the commit: rows a store holds past the ledger's count
are garbage, on local disk and in buckets alike.

The content is deterministic: keys are written sorted and nothing about the build's own timing is
recorded (the input files' modification times in ``metadata["inputs"]`` are the files', not the build's),
so a resumed build ends with the same ledger bytes as an uninterrupted one. The exception to sorting is
``shard_rows`` and ``shard_docs``, whose order is the shard order (rows of shard ``i`` precede those of
shard ``i + 1`` in the stores) and is kept as written.

A ledger that cannot be parsed or has wrong types is never guessed at: :meth:`CacheLedger.load` raises
:class:`CorruptLedgerError` naming the file and saying to delete the cache directory to rebuild.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..utils import fs

__all__ = ["CacheLedger", "CorruptLedgerError", "LEDGER_FILENAME", "LEDGER_FORMAT_VERSION"]

LEDGER_FILENAME = "shard_ledger.json"
LEDGER_FORMAT_VERSION = 1


class CorruptLedgerError(ValueError):
    """The ledger file exists but is not a valid ledger."""


def _sorted_json(value: Any) -> Any:
    """``value`` with every mapping's keys in sorted order (json's sort_keys, applied selectively)."""
    if isinstance(value, dict):
        return {k: _sorted_json(value[k]) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_sorted_json(v) for v in value]
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class CacheLedger:
    """What a cache build has committed. Field order of ``shard_rows``/``shard_docs`` is shard order."""

    shard_rows: dict[str, int] = field(default_factory=dict)
    """Rows committed to the stores, per input shard."""
    shard_docs: dict[str, int] = field(default_factory=dict)
    """Input documents consumed, per shard (a document may yield zero or several rows)."""
    finished_shards: list[str] = field(default_factory=list)
    total_rows: int = 0
    total_tokens: int = 0
    is_finished: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    """What the cache was built with (tokenizer fingerprint, format, text key...); JSON values only."""
    format_version: int = LEDGER_FORMAT_VERSION

    # -- (de)serialisation ---------------------------------------------------------------------------
    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        out = {}
        for k in sorted(d):
            out[k] = d[k] if k in ("shard_rows", "shard_docs") else _sorted_json(d[k])
        return json.dumps(out, indent=1, ensure_ascii=False, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> "CacheLedger":
        """Parse and validate; ``source`` names the file in error messages."""

        def fail(why: str) -> CorruptLedgerError:
            return CorruptLedgerError(
                f"cache ledger {source} is corrupt: {why}. Delete the cache directory containing it "
                "to rebuild the cache from scratch."
            )

        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise fail(f"not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise fail(f"expected a JSON object, got {type(raw).__name__}")

        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise fail(f"unknown keys {unknown}")
        missing = sorted(names - set(raw))
        if missing:
            raise fail(f"missing keys {missing}")

        version = raw["format_version"]
        if not _is_int(version):
            raise fail(f"format_version must be an int, got {version!r}")
        if version != LEDGER_FORMAT_VERSION:
            raise fail(f"format_version {version} is not the supported version {LEDGER_FORMAT_VERSION}")

        for key in ("shard_rows", "shard_docs"):
            m = raw[key]
            if not isinstance(m, dict):
                raise fail(f"{key} must be an object of shard name -> count, got {type(m).__name__}")
            for shard, n in m.items():
                if not _is_int(n) or n < 0:
                    raise fail(f"{key}[{shard!r}] must be a non-negative int, got {n!r}")
        finished = raw["finished_shards"]
        if not isinstance(finished, list) or not all(isinstance(s, str) for s in finished):
            raise fail(f"finished_shards must be a list of shard names, got {finished!r}")
        for key in ("total_rows", "total_tokens"):
            if not _is_int(raw[key]) or raw[key] < 0:
                raise fail(f"{key} must be a non-negative int, got {raw[key]!r}")
        if not isinstance(raw["is_finished"], bool):
            raise fail(f"is_finished must be true or false, got {raw['is_finished']!r}")
        if not isinstance(raw["metadata"], dict):
            raise fail(f"metadata must be an object, got {type(raw['metadata']).__name__}")
        return cls(**raw)

    # -- files ---------------------------------------------------------------------------------------
    @staticmethod
    def path_in(cache_dir: str | os.PathLike) -> str:
        return fs.join(os.fspath(cache_dir), LEDGER_FILENAME)

    def save(self, cache_dir: str | os.PathLike) -> str:
        """Atomically write ``<cache_dir>/shard_ledger.json`` (creating ``cache_dir``); returns its path."""
        cache_dir = os.fspath(cache_dir)
        fs.makedirs(cache_dir)
        target = self.path_in(cache_dir)
        fs.atomic_write_bytes(target, self.to_json().encode("utf-8"))
        return target

    @classmethod
    def load(cls, cache_dir: str | os.PathLike) -> "CacheLedger | None":
        """The ledger in ``cache_dir``, or None if there is none. Raises :class:`CorruptLedgerError`."""
        path = cls.path_in(cache_dir)
        try:
            raw = fs.read_bytes(path)
        except (FileNotFoundError, NotADirectoryError):  # no cache there (yet); writing it will say why not
            return None
        except Exception as e:
            if fs.is_url(path) and fs.is_permanent(e):  # access denied, refused credentials
                raise fs.access_error(path, None, e) from None
            raise
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptLedgerError(
                f"cache ledger {path} is corrupt: not UTF-8 ({e}). Delete the cache directory containing "
                "it to rebuild the cache from scratch."
            ) from e
        return cls.from_json(text, source=path)

"""Opening a finished token cache: the token ids of its documents and the ledger that describes them.

A cache directory holds ``input_ids/`` (a :class:`~levanter.store.jagged_array.JaggedArrayStore`, one
row per document) and ``shard_ledger.json`` (a :class:`~levanter.store.ledger.CacheLedger`). The ledger is
the authority on how many rows are committed, so the store is opened with its row count; a cache whose
ledger is not marked finished is refused (its build was interrupted), and so is one whose chunk files are
not where their recorded checksums say (:mod:`levanter.store.chunk_manifest`). Caches are written by
:mod:`levanter.ingest.build`.
"""

from __future__ import annotations

from ..utils import fs
from .jagged_array import JaggedArrayStore
from .ledger import CacheLedger

__all__ = ["TokenCache"]


class TokenCache:
    """A finished cache: ``store`` (token ids, one row per document), ``ledger`` and its metadata."""

    def __init__(self, cache_dir: str, store: JaggedArrayStore, ledger: CacheLedger):
        self.cache_dir = cache_dir
        self.store = store
        self.ledger = ledger

    @property
    def metadata(self) -> dict:
        return self.ledger.metadata

    @property
    def eos_id(self) -> int | None:
        return self.ledger.metadata.get("eos_id")

    @staticmethod
    def open(cache_dir: str) -> "TokenCache":
        ledger = CacheLedger.load(cache_dir)
        if ledger is None:
            raise FileNotFoundError(f"no token cache at {cache_dir!r} (missing shard_ledger.json)")
        if not ledger.is_finished:
            raise ValueError(
                f"the token cache at {cache_dir!r} is unfinished; rerun the build to complete it"
            )
        store = JaggedArrayStore.open(
            fs.join(cache_dir, "input_ids"), mode="r", num_rows=ledger.total_rows
        )
        # Each chunk's checksum must be the one recorded for its position: a swapped chunk passes its own.
        store.verify_chunk_positions()
        return TokenCache(cache_dir, store, ledger)

"""Opening a finished token cache: the token ids of its documents and the ledger that describes them.

A cache directory holds ``input_ids/`` (a :class:`~levanter.store.jagged_array.JaggedArrayStore`, one
row per document) and ``shard_ledger.json`` (a :class:`~levanter.store.ledger.CacheLedger`). The ledger is
the authority on how many rows are committed, so the store is opened with its row count; a cache whose
ledger is not marked finished is refused (its build was interrupted), and so is one whose chunk files are
not where their recorded checksums say (:mod:`levanter.store.chunk_manifest`). Caches are written by
:mod:`levanter.ingest.build`.

A chat cache (its ledger's metadata has ``"chat"``) also holds ``loss_mask/``: a second store of one ``uint8``
per token (1 on the tokens to train on), aligned row for row with ``input_ids/``, committed by the same ledger
and checked the same way; it is opened with the same row count and refused unless its length equals the
token store's.
"""

from __future__ import annotations

from ..utils import fs
from .jagged_array import JaggedArrayStore
from .ledger import CacheLedger

__all__ = ["LOSS_MASK_DIR", "TokenCache"]

# The directory of a chat cache's per-token mask store, beside input_ids/.
LOSS_MASK_DIR = "loss_mask"


class TokenCache:
    """A finished cache: ``store`` (token ids, one row per document), ``ledger`` and its metadata, and for a
    chat cache ``mask_store`` (the per-token assistant mask; None for text)."""

    def __init__(self, cache_dir: str, store: JaggedArrayStore, ledger: CacheLedger,
                 mask_store: JaggedArrayStore | None = None):
        self.cache_dir = cache_dir
        self.store = store
        self.ledger = ledger
        self.mask_store = mask_store

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
        mask_store = None
        if "chat" in ledger.metadata:
            mask_store = JaggedArrayStore.open(
                fs.join(cache_dir, LOSS_MASK_DIR), mode="r", num_rows=ledger.total_rows
            )
            mask_store.verify_chunk_positions()
            if mask_store.data_size != store.data_size:
                raise ValueError(
                    f"the token cache at {cache_dir!r} is damaged: {LOSS_MASK_DIR}/ holds {mask_store.data_size} "
                    f"values for {store.data_size} tokens; delete it to rebuild"
                )
        return TokenCache(cache_dir, store, ledger, mask_store)

"""Tensorstore-backed storage for the token cache: ragged row stores and the build ledger.

* :class:`JaggedArrayStore`: 1-D rows of one dtype (documents' token ids), append-only, batched reads.
* :class:`TreeStore`: several row-aligned jagged fields per example.
* :class:`CacheLedger`: the JSON record of what a build has committed; the authority on row counts.
"""

from .jagged_array import JaggedArrayStore
from .ledger import CacheLedger, CorruptLedgerError
from .tree_store import TreeStore

__all__ = ["JaggedArrayStore", "TreeStore", "CacheLedger", "CorruptLedgerError"]

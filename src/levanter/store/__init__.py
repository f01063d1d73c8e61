"""Storage for token caches: ragged row stores, batched reads, the build ledger, and opening a cache.

* :class:`JaggedArrayStore` (``jagged_array``): 1-D rows of one dtype (documents' token ids) in
  tensorstore, append-only, with batched reads of rows and of fixed-length windows over the flat token
  stream; its zarr3 arrays are opened, grown and checked by ``zarr_arrays``.
* ``batched_reads``: :func:`read_stacked` and :func:`read_blocks` read views of several stores in one
  operation, :func:`awaited` awaits a tensorstore future from asyncio.
* ``faults``: :func:`storage_fault` tells what a failed read says about the storage;
  :class:`DamagedStoreError` names the cache to delete.
* :class:`CacheLedger`: the JSON record of what a build has committed; the authority on row counts.
* :class:`TokenCache`: a finished cache opened for reading.

The store knows nothing of documents, tokenizers or training: caches are written by
:mod:`levanter.ingest` and read by :mod:`levanter.data`, both of which import this package, never the
other way round.
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    (
        "cache",
        "batched_reads",
        "faults",
        "jagged_array",
        "ledger",
    ),
)

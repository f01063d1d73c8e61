"""A ragged array of 1-D rows (documents' token ids) kept in two zarr3 arrays through tensorstore.

Layout under ``<path>``:

* ``data``: one flat 1-D array holding every row back to back;
* ``offsets``: 1-D int64, ``offsets[0] = 0`` and ``offsets[k + 1]`` = end of row ``k`` in ``data``.

The store is append-only and has one writer. Which rows are *committed* is not decided here but by
an external ledger (:class:`~levanter.store.ledger.CacheLedger`): the writer appends, waits for the
writes to land, then records the new row count in the ledger. Opening with ``num_rows=n`` declares
rows ``>= n`` garbage (a writer that crashed after writing but before its ledger update) and the next
append overwrites them. So the store never needs its own commit protocol, at the cost that a store
that was not finalized can only be read correctly with the ledger's row count at hand.

Determinism: a resumed build must end byte-identical to an uninterrupted one. Everything on disk is a
function of the committed content: capacity grows by a rule that depends only on the size needed,
:meth:`JaggedArrayStore.finalize` shrinks the arrays to their exact sizes (so ``zarr.json`` records
only content sizes), and reopening a crashed store zeroes the garbage in the last partial chunk and
deletes whole chunks past the committed end, leaving exactly what a clean build would have had.

Reads are batched: every read method issues one tensorstore operation per step (offsets, then data)
however many rows or windows it serves, so a 2000-row request costs a couple of I/O round trips, not
2000. Out-of-range requests raise ``IndexError`` naming the bad row or range and the store's size.

Integrity: a read never returns data that was not written. Arrays are opened with ``fill_missing_data_reads:
false``, so a chunk file that is missing (deleted, or not visible for a moment on object storage) is an
error instead of a run of fill values (token 0); and since a chunk that equals the fill value must then
exist on disk, every chunk is stored (``store_data_equal_to_fill_value``). Arrays created here end their
codec chain with zarr3's ``crc32c``, so a flipped bit is an error (``DATA_LOSS``), not a token; stores
written without it are read as they are (the codecs come from each array's ``zarr.json``). A checksum covers
a chunk's bytes, not its place, so :meth:`JaggedArrayStore.finalize` also records which checksum belongs at
which chunk (:mod:`levanter.store.chunk_manifest`), and a finished cache is checked against that record when
it is opened: swapped chunks fail like corrupt ones. Opening a store with a committed row count (to read or
to append) checks that every chunk the committed rows need is there (one directory listing per array on
local disk), so a damaged cache is refused before training starts, and a resumed build never writes into a
hole (a write into a missing chunk would fill the rest of it with zeros). :func:`storage_fault` reads
tensorstore's error text (status code, chunk file) for the loader, which retries what may pass and names the
damaged cache otherwise.

The parts live by concept: this module is the store (opening, appending, reading rows and windows);
:mod:`levanter.store.zarr_arrays` the arrays under it; :mod:`levanter.store.batched_reads` the reads of
views of many stores in one operation (:func:`read_stacked`, :func:`read_blocks`, :func:`awaited`);
:mod:`levanter.store.faults` what a failed read means (:func:`storage_fault`, :class:`DamagedStoreError`).
Their public names are re-exported by :mod:`levanter.store`, not here.

Trade-off: chunks are not compressed by default. A random window decodes a whole chunk, and on local
disk that costs more than the bytes saved (docs/bench/2026-12-03-cpu-levers.md). ``codec="zstd"`` is there for
remote storage.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from . import batched_reads, chunk_manifest
from .batched_reads import awaited, read_stacked
from .faults import DamagedStoreError, cache_root, damaged_error, note_store
from .zarr_arrays import (
    CONTEXT,
    array_kvstore,
    array_length,
    capacity,
    check_chunks,
    chunk_length,
    codec_chain,
    committed_size,
    create_array,
    open_array,
    refuse_missing_arrays,
    truncate,
)

__all__ = ["JaggedArrayStore", "DEFAULT_DATA_CHUNK", "DEFAULT_OFFSETS_CHUNK"]

# Chunk sizes, in elements. A zarr3 chunk without sharding is read whole, so a random window costs a
# whole-chunk read: smaller chunks mean less read amplification, larger ones fewer files. Chunk buffers
# are also what a prefetching loader holds, so with large chunks its memory grows with the number of
# distinct chunks, i.e. with the dataset. 2**14 (64 KiB) is the compromise: 1B tokens is ~61k chunk
# files (the measurements are in docs/bench/2026-12-03-cpu-levers.md).
DEFAULT_DATA_CHUNK = 2**14
# Offsets are read two per row at random rows, so their chunks are kept small too: 2**13 int64 is
# 64 KiB per chunk, and a million rows still fit in ~120 files.
DEFAULT_OFFSETS_CHUNK = 2**13


class JaggedArrayStore:
    """A ragged array of 1-D rows of one dtype; see the module docstring for layout and crash semantics.

    Create instances with :meth:`open`. Not safe for concurrent writers; readers in any thread or event
    loop are fine (the object holds no loop-bound state).
    """

    def __init__(
        self,
        path: str,
        data: ts.TensorStore,
        offsets: ts.TensorStore,
        *,
        num_rows: int,
        data_size: int,
        writable: bool,
    ):
        self.path = path
        note_store(path)  # a failed read of one of its chunks names the chunk by its full URL
        self._data = data
        self._offsets = offsets
        self._num_rows = int(num_rows)
        self._data_size = int(data_size)
        self._writable = writable
        self.dtype = np.dtype(data.dtype.numpy_dtype)

    # -- opening -------------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        mode: str,
        dtype: Any = None,
        num_rows: int | None = None,
        data_chunk: int = DEFAULT_DATA_CHUNK,
        offsets_chunk: int = DEFAULT_OFFSETS_CHUNK,
        codec: str | Mapping[str, Any] | None = None,
        checksum: bool = True,
    ) -> "JaggedArrayStore":
        """Open the store at ``path`` (a local path or a ``gs://``, ``s3://`` or ``memory://`` URL).

        ``mode``: ``"r"`` read only, the store must exist; ``"w"`` create afresh, deleting an existing
        store; ``"a"`` open for append, creating it if absent.

        ``dtype``: element type of ``data``; when creating, ``None`` means int32. When opening an existing
        store ``None`` accepts the stored dtype and anything else must match it.

        ``num_rows``: the committed row count, from the ledger. Rows past it are garbage that the next
        append overwrites. ``None`` trusts the arrays' shapes, which is only right for a finalized store;
        an unfinalized one is detected (its last offset disagrees with the data length) and refused.

        ``data_chunk``, ``offsets_chunk``, ``codec`` apply when creating; an existing store keeps its own.
        ``codec`` is ``None`` (raw little-endian), ``"zstd"``, ``"gzip"`` or a zarr3 codec JSON dict.
        ``checksum`` (when creating) ends the codec chain with ``crc32c``; ``False`` writes stores as they
        were before checksums (for comparisons; such stores stay readable).

        Read-only with ``num_rows`` (a cache's committed rows): a missing or unreadable array or chunk is a
        :class:`DamagedStoreError` naming the cache to delete.
        """
        if mode not in ("r", "w", "a"):
            raise ValueError(f"mode must be 'r', 'w' or 'a', got {mode!r}")
        if num_rows is not None and num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        path = os.fspath(path)
        want = None if dtype is None else np.dtype(dtype)

        if mode == "w":
            if num_rows not in (None, 0):
                raise ValueError(f"mode 'w' creates an empty store; num_rows={num_rows} makes no sense")
            return cls._create(path, want or np.dtype(np.int32), data_chunk, offsets_chunk, codec, checksum)
        # A read-only store with committed rows is a cache that must be whole: damage is reported as such.
        strict = mode == "r" and num_rows is not None
        store_path = path if strict else None
        data = open_array(array_kvstore(path, "data"), context=CONTEXT, store_path=store_path)
        offsets = open_array(array_kvstore(path, "offsets"), context=CONTEXT, store_path=store_path)
        half_created = data is None or offsets is None or array_length(offsets) < 1
        if mode == "a" and num_rows == 0 and half_created:
            # Nothing committed and a writer died while creating the arrays: start afresh.
            return cls._create(path, want or np.dtype(np.int32), data_chunk, offsets_chunk, codec, checksum)
        if data is None or offsets is None:
            refuse_missing_arrays(path, mode, num_rows, strict, data, offsets)
            return cls._create(path, want or np.dtype(np.int32), data_chunk, offsets_chunk, codec, checksum)

        stored = np.dtype(data.dtype.numpy_dtype)
        if want is not None and want != stored:
            raise TypeError(f"store at {path!r} holds {stored}, but dtype={want} was requested")
        if np.dtype(offsets.dtype.numpy_dtype) != np.int64:
            raise ValueError(f"store at {path!r}: offsets must be int64, found {offsets.dtype}")

        # Committed rows must have all their chunks: read-only, so a read never meets a hole; for append,
        # because a write into a missing chunk fills the rest of it with zeros, silently.
        whole = num_rows is not None
        num_rows, data_size = committed_size(path, data, offsets, num_rows, strict)
        if whole:
            check_chunks(path, "data", data, data_size)
        if mode == "a":
            # Reset the garbage past the committed end now, so the store is what a clean build of the
            # committed rows would be whatever the next appends write; the chunk record of a finished
            # store no longer holds once it is appended to (finalize writes it again).
            data = truncate(data, data_size)
            offsets = truncate(offsets, num_rows + 1)
            chunk_manifest.remove(path)
        return cls(path, data, offsets, num_rows=num_rows, data_size=data_size, writable=mode == "a")

    @classmethod
    def _create(cls, path, dtype, data_chunk, offsets_chunk, codec, checksum=True) -> "JaggedArrayStore":
        if data_chunk < 1 or offsets_chunk < 1:
            raise ValueError(
                f"chunk sizes must be >= 1, got data_chunk={data_chunk}, offsets_chunk={offsets_chunk}"
            )
        codecs = codec_chain(codec, checksum)
        chunk_manifest.remove(path)
        data = create_array(
            array_kvstore(path, "data"), dtype=dtype, chunk=data_chunk, codecs=codecs, context=CONTEXT
        )
        offsets = create_array(
            array_kvstore(path, "offsets"),
            dtype=np.dtype(np.int64),
            chunk=offsets_chunk,
            codecs=codecs,
            context=CONTEXT,
        )
        offsets = offsets.resize(exclusive_max=[1]).result()
        offsets[0:1].write(np.zeros(1, dtype=np.int64)).result()
        return cls(path, data, offsets, num_rows=0, data_size=0, writable=True)

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Committed rows (the ledger's count, plus rows appended through this object)."""
        return self._num_rows

    @property
    def data_size(self) -> int:
        """Elements in the committed rows, i.e. ``offsets[num_rows]``."""
        return self._data_size

    def __len__(self) -> int:
        return self._num_rows

    def __repr__(self) -> str:
        return (
            f"JaggedArrayStore({self.path!r}, rows={self._num_rows}, size={self._data_size}, "
            f"dtype={self.dtype})"
        )

    # -- writing -------------------------------------------------------------------------------------
    def _coerce(self, row: Any) -> np.ndarray:
        arr = np.asarray(row)
        if arr.ndim != 1:
            raise ValueError(f"rows must be 1-D, got shape {arr.shape}")
        if arr.dtype == self.dtype:
            return arr
        if arr.size == 0:
            return arr.astype(self.dtype)
        if not np.can_cast(arr.dtype, self.dtype, casting="same_kind"):
            raise TypeError(f"cannot store {arr.dtype} rows in a {self.dtype} store")
        if np.issubdtype(self.dtype, np.integer) and not np.can_cast(arr.dtype, self.dtype, casting="safe"):
            info = np.iinfo(self.dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise OverflowError(f"row values [{arr.min()}, {arr.max()}] do not fit in {self.dtype}")
        return arr.astype(self.dtype)

    def _prepare(self, rows: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Validate ``rows``: returns their concatenation and their lengths, touching nothing on disk."""
        if not self._writable:
            raise PermissionError(f"store at {self.path!r} was opened read-only")
        arrays = [self._coerce(r) for r in rows]
        lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
        if not arrays:
            return np.empty(0, dtype=self.dtype), lengths
        return (np.concatenate(arrays) if len(arrays) > 1 else arrays[0]), lengths

    def _issue(self, flat: np.ndarray, lengths: np.ndarray) -> tuple[list[ts.Future], int, int]:
        """Grow the arrays and issue the writes; returns (futures, new num_rows, new data_size).

        Counters are not touched: the caller commits them only once every write has landed, so a failed
        write leaves this object at its old size and the next append overwrites whatever did land.
        """
        if lengths.size == 0:
            return [], self._num_rows, self._data_size
        new_size = self._data_size + int(flat.shape[0])
        new_rows = self._num_rows + int(lengths.size)
        if new_size > array_length(self._data):
            self._data = self._data.resize(exclusive_max=[capacity(new_size, chunk_length(self._data))]).result()
        if new_rows + 1 > array_length(self._offsets):
            self._offsets = self._offsets.resize(
                exclusive_max=[capacity(new_rows + 1, chunk_length(self._offsets))]
            ).result()
        ends = self._data_size + np.cumsum(lengths)
        futures = [self._offsets[self._num_rows + 1 : new_rows + 1].write(ends)]
        if flat.shape[0]:
            futures.append(self._data[self._data_size : new_size].write(flat))
        return futures, new_rows, new_size

    def _commit(self, new_rows: int, new_size: int) -> None:
        self._num_rows = new_rows
        self._data_size = new_size

    def append(self, rows: Sequence[Any]) -> None:
        """Append ``rows`` (1-D arrays castable to ``dtype``); returns once the writes are on disk.

        The rows land at ``[data_size, data_size + total)`` of ``data``. Only after this returns may the
        caller record the new ``num_rows`` in its ledger.
        """
        futures, new_rows, new_size = self._issue(*self._prepare(rows))
        for f in futures:
            f.result()
        self._commit(new_rows, new_size)

    def append_flat(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Like :meth:`append` for rows given as one concatenated array plus per-row lengths (no
        per-row arrays are built)."""
        flat = np.asarray(flat)
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or (lengths < 0).any() or int(lengths.sum()) != flat.size:
            raise ValueError(
                f"append_flat: lengths (sum {int(lengths.sum())}) do not match {flat.size} values"
            )
        futures, new_rows, new_size = self._issue(flat.astype(self.dtype, copy=False).ravel(), lengths)
        for f in futures:
            f.result()
        self._commit(new_rows, new_size)

    def finalize(self) -> None:
        """Shrink both arrays to their committed sizes, so ``zarr.json`` depends only on the content."""
        if not self._writable:
            raise PermissionError(f"store at {self.path!r} was opened read-only")
        self._data = self._data.resize(exclusive_max=[self._data_size]).result()
        self._offsets = self._offsets.resize(exclusive_max=[self._num_rows + 1]).result()
        chunk_manifest.write(self.path, {"data": self._data, "offsets": self._offsets}, CONTEXT)

    def verify_chunk_positions(self, *, require: bool = True) -> None:
        """Refuse (:class:`DamagedStoreError`) a finalized store with a chunk file whose checksum belongs at
        another position (:mod:`levanter.store.chunk_manifest`); with ``require``, also one whose
        checksummed chunks were never recorded (finished by an older version)."""
        problem = chunk_manifest.check(self.path, {"data": self._data, "offsets": self._offsets}, CONTEXT)
        if problem == "unrecorded":
            if require:
                root = cache_root(self.path)
                raise DamagedStoreError(
                    f"the cache at {root} records no position of its chunk checksums (written by an older "
                    "version), so a chunk swapped with another would be read unnoticed; delete it to rebuild"
                )
        elif problem is not None:
            raise damaged_error(self.path, problem)

    # -- reading -------------------------------------------------------------------------------------
    def _check_rows(self, rows: Any) -> np.ndarray:
        idx = np.asarray(rows, dtype=np.int64)
        if idx.ndim != 1:
            raise ValueError(f"rows must be a 1-D sequence of ints, got shape {idx.shape}")
        if idx.size and (idx.min() < 0 or idx.max() >= self._num_rows):
            bad = int(idx[(idx < 0) | (idx >= self._num_rows)][0])
            raise IndexError(f"row {bad} out of range for store {self.path!r} with {self._num_rows} rows")
        return idx

    def _offsets_future(self, idx: np.ndarray) -> ts.Future:
        # Starts and ends of all rows in one index-array read.
        return batched_reads.read_view(self._offsets[np.concatenate([idx, idx + 1])])

    def _rows_future(self, bounds: np.ndarray) -> ts.Future | None:
        n = bounds.shape[0] // 2
        starts, ends = bounds[:n], bounds[n:]
        pieces = [self._data[int(s) : int(e)] for s, e in zip(starts, ends) if e > s]
        if not pieces:
            return None
        return batched_reads.read_view(ts.concat(pieces, axis=0) if len(pieces) > 1 else pieces[0])

    def _split(self, bounds: np.ndarray, flat: np.ndarray | None) -> list[np.ndarray]:
        n = bounds.shape[0] // 2
        lengths = bounds[n:] - bounds[:n]
        if flat is None:
            return [np.empty(0, dtype=self.dtype) for _ in range(n)]
        return np.split(flat, np.cumsum(lengths)[:-1])

    def read_rows_sync(self, rows: Sequence[int]) -> list[np.ndarray]:
        """The rows at ``rows`` (in that order, duplicates allowed), blocking: one offsets read, one data
        read. The returned arrays are views into one buffer."""
        idx = self._check_rows(rows)
        if idx.size == 0:
            return []
        bounds = self._offsets_future(idx).result()
        fut = self._rows_future(bounds)
        return self._split(bounds, None if fut is None else fut.result())

    def window_views(self, starts: Any, length: int) -> list[ts.TensorStore]:
        """Validated views ``data[start : start + length]``, unread (for :func:`read_stacked`).

        The views keep their store positions as their domains; :func:`read_stacked` lines them up.
        """
        s = np.asarray(starts, dtype=np.int64)
        if s.ndim != 1:
            raise ValueError(f"starts must be 1-D, got shape {s.shape}")
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        firsts = s.tolist()
        # Python's min/max over the list: a few windows per source and step, where numpy's reductions
        # cost more than the comparisons.
        if firsts and (min(firsts) < 0 or max(firsts) + length > self._data_size):
            bad = next(x for x in firsts if x < 0 or x + length > self._data_size)
            raise IndexError(
                f"window [{bad}, {bad + length}) out of range for store {self.path!r} with "
                f"{self._data_size} elements"
            )
        data = self._data
        # oindex with a plain slice is the same view as data[x : x + length], and cheaper to make.
        oindex = data.oindex
        return [oindex[x : x + length] for x in firsts]

    def window_block(self, starts: Any, length: int) -> ts.TensorStore:
        """One validated view of shape ``(len(starts), length)`` whose row ``i`` is
        ``data[starts[i] : starts[i] + length]`` (an index-array view), unread, for :func:`read_blocks`.

        Many short windows in one view instead of one view each (see ``BLOCK_MAX_SEQ_LEN`` in
        :mod:`levanter.data.text`: tensorstore walks the index array element by element, so long
        windows read faster as :meth:`window_views`).
        """
        s = np.asarray(starts, dtype=np.int64)
        if s.ndim != 1 or not s.size:
            raise ValueError(f"starts must be a non-empty 1-D array, got shape {s.shape}")
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        if s.min() < 0 or s.max() + length > self._data_size:
            bad = int(s[(s < 0) | (s + length > self._data_size)][0])
            raise IndexError(
                f"window [{bad}, {bad + length}) out of range for store {self.path!r} with "
                f"{self._data_size} elements"
            )
        return self._data[s[:, None] + np.arange(length, dtype=np.int64)]

    def _windows_future(self, starts: Any, length: int):
        views = self.window_views(starts, length)
        if not views or length == 0:
            return None, len(views)
        return read_stacked(views), len(views)

    async def read_windows(self, starts: Any, length: int) -> np.ndarray:
        """``data[start : start + length]`` for each start, as an array of shape ``(len(starts), length)``.

        Windows are over the flat token stream and may span row boundaries.
        """
        fut, n = self._windows_future(starts, length)
        if fut is None:
            return np.empty((n, length), dtype=self.dtype)
        return await awaited(fut)

    def read_windows_sync(self, starts: Any, length: int) -> np.ndarray:
        """Blocking :meth:`read_windows`."""
        fut, n = self._windows_future(starts, length)
        if fut is None:
            return np.empty((n, length), dtype=self.dtype)
        return fut.result()

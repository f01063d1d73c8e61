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

Trade-off: chunks are not compressed by default. A random window decodes a whole chunk, and on local
disk that costs more than the bytes saved (docs/performance.md). ``codec="zstd"`` is there for remote
storage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from ..utils import fs
from . import chunk_manifest

__all__ = [
    "JaggedArrayStore",
    "DEFAULT_DATA_CHUNK",
    "DEFAULT_OFFSETS_CHUNK",
    "DamagedStoreError",
    "StorageFault",
    "awaited",
    "cache_root",
    "read_blocks",
    "read_stacked",
    "storage_fault",
]

# Chunk sizes, in elements. A zarr3 chunk without sharding is read whole, so a random window costs a
# whole-chunk read: smaller chunks mean less read amplification, larger ones fewer files. Chunk buffers
# are also what a prefetching loader holds, so with large chunks its memory grows with the number of
# distinct chunks, i.e. with the dataset. 2**14 (64 KiB) is the compromise: 1B tokens is ~61k chunk
# files (the measurements are in docs/performance.md).
DEFAULT_DATA_CHUNK = 2**14
# Offsets are read two per row at random rows, so their chunks are kept small too: 2**13 int64 is
# 64 KiB per chunk, and a million rows still fit in ~120 files.
DEFAULT_OFFSETS_CHUNK = 2**13

# One context for every store in the process: "memory://" stores are visible across opens only within
# a shared context, and tensorstore's I/O thread pools are shared instead of multiplied per store.
# Its retry budgets let array reads and writes on object stores ride out throttling and 5xx answers.
_CONTEXT = ts.Context(fs.tensorstore_context_spec())

_SHORTHAND_CODECS: dict[str, dict[str, Any]] = {
    "zstd": {"name": "zstd", "configuration": {"level": 3, "checksum": False}},
    "gzip": {"name": "gzip", "configuration": {"level": 5}},
}


# Options of every array open. A missing chunk is an error, never fill values: a read must return what was
# written or fail. With that, a chunk equal to the fill value (all-zero tokens or offsets) must be written
# too, where tensorstore would by default delete it and rely on the fill value.
_ARRAY_OPTIONS: dict[str, Any] = {"fill_missing_data_reads": False, "store_data_equal_to_fill_value": True}

# The last codec of every array created here: a CRC-32C of each encoded chunk, checked on every read.
_CHECKSUM_CODEC: dict[str, Any] = {"name": "crc32c"}


class DamagedStoreError(ValueError):
    """A store (or the cache holding it) is missing files or holds unreadable ones: delete it to rebuild."""


def cache_root(store_path: str) -> str:
    """The directory to delete to rebuild the store at ``store_path``: the token cache holding it (the
    nearest directory up to two levels above with a ``shard_ledger.json``), else the store itself."""
    p = os.fspath(store_path).rstrip("/")
    up = p
    for _ in range(3):
        try:
            if fs.isfile(fs.join(up, "shard_ledger.json")):
                return up
        except Exception:  # an unreachable store: name the store itself
            return p
        up = fs.parent(up)
    return p


def _damaged(store_path: str, what: str) -> DamagedStoreError:
    root = cache_root(store_path)
    return DamagedStoreError(f"the cache at {root} is damaged ({what}); delete it to rebuild")


def _kvstore(path: str | os.PathLike, sub: str) -> dict[str, Any]:
    """Kvstore spec of ``<path>/<sub>/`` (``file``, ``memory``, ``s3`` or ``gcs``; see :mod:`levanter.utils.fs`)."""
    return fs.kvstore_spec(fs.join(os.fspath(path), sub))


def _capacity(needed: int, chunk: int) -> int:
    """Array length to hold ``needed`` elements: the next power of two, at least one chunk.

    A pure function of ``needed``, never of the append history or timing, so a resumed build resizes
    to the same shapes as a clean one. Over-allocation costs nothing on disk (zarr stores no chunks
    that were never written); growing by doubling keeps metadata rewrites to O(log n).
    """
    cap = max(chunk, 1)
    while cap < needed:
        cap *= 2
    return cap


def _codecs(codec: str | Mapping[str, Any] | None, checksum: bool = True) -> list[dict[str, Any]]:
    """The codec chain: ``bytes``, then the compression codec if any, then ``crc32c`` (zarr3 puts
    bytes-to-bytes codecs after ``bytes``; the checksum covers the chunk as stored, compressed or not)."""
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if isinstance(codec, str):
        if codec not in _SHORTHAND_CODECS:
            raise ValueError(
                f"unknown codec {codec!r}; use one of {sorted(_SHORTHAND_CODECS)} or a zarr3 codec dict"
            )
        codecs.append(dict(_SHORTHAND_CODECS[codec]))
    elif codec is not None:
        codecs.append(dict(codec))
    if checksum and not any(c.get("name") == _CHECKSUM_CODEC["name"] for c in codecs):
        codecs.append(dict(_CHECKSUM_CODEC))
    return codecs


def _is_not_found(err: Exception) -> bool:
    return "NOT_FOUND" in str(err)


def _open_array(kvstore, *, context: ts.Context, store_path: str | None = None) -> ts.TensorStore | None:
    """Open an existing zarr3 array, or None when there is none at ``kvstore``.

    With ``store_path`` (a store opened for reading) an unreadable ``zarr.json`` is reported as a damaged
    cache; otherwise tensorstore's error is passed on.
    """
    spec = {"driver": "zarr3", "kvstore": kvstore, **_ARRAY_OPTIONS}
    try:
        return ts.open(spec, open=True, context=context).result()
    except ValueError as e:
        if _is_not_found(e):
            return None
        if store_path is None:
            raise
        where = kvstore if isinstance(kvstore, str) else kvstore["path"]
        fault = storage_fault(e)
        reason = fault.detail if fault is not None else _status_text(e)
        raise _damaged(store_path, f"{where}zarr.json cannot be read: {reason}") from e


def _create_array(kvstore, *, dtype: np.dtype, chunk: int, codecs, context: ts.Context) -> ts.TensorStore:
    metadata = {
        "shape": [0],
        "data_type": dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [int(chunk)]}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": codecs,
        "fill_value": False if dtype == np.bool_ else 0,
    }
    spec = {"driver": "zarr3", "kvstore": kvstore, "metadata": metadata, **_ARRAY_OPTIONS}
    return ts.open(spec, create=True, delete_existing=True, context=context).result()


def _length(arr: ts.TensorStore) -> int:
    return int(arr.domain.exclusive_max[0])


def _chunk(arr: ts.TensorStore) -> int:
    return int(arr.chunk_layout.write_chunk.shape[0])


def _truncate(arr: ts.TensorStore, size: int) -> ts.TensorStore:
    """Cut ``arr`` to ``size`` elements leaving what a clean build of that size would have on disk.

    Resizing down deletes chunks wholly past ``size`` but keeps a partial last chunk as is, stale tail
    included (tensorstore would even show that tail again after growing). So the tail is zeroed (the
    fill value) first; the array is grown to the chunk boundary for that, which is metadata only.
    """
    length = _length(arr)
    if length <= size:
        return arr
    chunk = _chunk(arr)
    boundary = -(-size // chunk) * chunk
    if boundary > size:
        if boundary > length:
            arr = arr.resize(exclusive_max=[boundary]).result()
        arr[size:boundary].write(np.zeros(boundary - size, dtype=arr.dtype.numpy_dtype)).result()
    return arr.resize(exclusive_max=[size]).result()


def _join(path: str, sub: str) -> str:
    return fs.join(path, sub)


def _check_chunks(path: str, name: str, arr: ts.TensorStore, size: int) -> None:
    """Refuse a store whose array ``name`` lacks a chunk that its first ``size`` elements need.

    One listing of the array's ``c/`` prefix through its kvstore (a directory listing locally, a prefix
    listing on an object store, the same keys in ``memory://``); for other chunk key encodings nothing is
    checked here (a missing chunk is still an error when it is read).
    """
    if size <= 0:
        return
    meta = arr.spec().to_json().get("metadata", {})
    encoding = meta.get("chunk_key_encoding", {"name": "default"})
    if encoding.get("name") != "default" or encoding.get("configuration", {}).get("separator", "/") != "/":
        return
    chunk_dir = fs.join(path, name, "c")
    try:
        kv = ts.KvStore.open(fs.kvstore_spec(chunk_dir), context=_CONTEXT).result()
        present = {k.decode("utf-8", "replace").split("/", 1)[0] for k in kv.list().result()}
    except ValueError as e:
        if fs.is_transient(e):
            raise
        raise _damaged(path, f"{chunk_dir} cannot be listed: {_status_text(e)}") from e
    needed = -(-size // _chunk(arr))
    missing = [k for k in range(needed) if str(k) not in present]
    if missing:
        shown = ", ".join(fs.join(chunk_dir, str(k)) for k in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        plural = len(missing) > 1
        files, verb = ("chunk files", "are") if plural else ("chunk file", "is")
        raise _damaged(path, f"{files} {shown}{more} {verb} missing")


# -- storage errors ----------------------------------------------------------------------------------
# tensorstore's status codes that mean "the storage did not deliver this chunk", as opposed to a bad
# request (INVALID_ARGUMENT, OUT_OF_RANGE: a bug). On object storage every one of them may pass, so a
# reader retries them all; a chunk that stays missing or corrupt means the cache is damaged.
_MISSING = "NOT_FOUND"
_CORRUPT = ("DATA_LOSS", "FAILED_PRECONDITION")
_UNREADABLE = ("PERMISSION_DENIED",)
_UNAVAILABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "RESOURCE_EXHAUSTED", "CANCELLED", "UNKNOWN",
                "INTERNAL")
_STORAGE_CODES = (_MISSING, *_CORRUPT, *_UNREADABLE, *_UNAVAILABLE)
_STATUS = re.compile(r"^([A-Z][A-Z_]+): ")
_QUOTED = re.compile(r'"([^"]+)"')
_CHUNK_INDEX = re.compile(r"chunk \{([\d, ]+)\}")


_PAYLOAD = re.compile(r" \[[A-Za-z_ ]+='")


def _status_text(err: BaseException) -> str:
    """tensorstore's message without its trailing payloads (``[tensorstore_spec='...']``, source
    locations), which repeat the open spec in JSON."""
    return _PAYLOAD.split(str(err), 1)[0].strip()


@dataclasses.dataclass(frozen=True)
class StorageFault:
    """What a failed read says about the storage: see :func:`storage_fault`."""

    code: str  # tensorstore's status code ("NOT_FOUND", "DATA_LOSS", ...), or "OS_ERROR"
    chunk: str | None  # the chunk's file or key, when the message names it
    cache: str | None  # the directory to delete to rebuild (see :func:`cache_root`)
    detail: str  # the message

    @property
    def damaged(self) -> bool:
        """A missing or corrupt chunk: if it outlasts the retries, the cache must be rebuilt."""
        return self.code == _MISSING or self.code in _CORRUPT

    def what(self) -> str:
        """``chunk <file> is missing`` and the like, for a message."""
        chunk = f"chunk {self.chunk}" if self.chunk else "a chunk"
        if self.code == _MISSING:
            return f"{chunk} is missing"
        if "Digest mismatch" in self.detail:
            return f"{chunk} is corrupt (checksum mismatch)"
        if self.code in _CORRUPT:
            return f"{chunk} is corrupt ({self.detail})"
        if self.code in _UNREADABLE:
            return f"{chunk} cannot be read (permission denied)"
        return f"{chunk} cannot be read ({self.detail})"

    def advice(self) -> str:
        where = self.cache or "the cache"
        if self.damaged:
            return f"the cache is damaged: delete {where} to rebuild it"
        if self.code in _UNREADABLE:
            return f"give the run read access to {where}, or delete it to rebuild it"
        return "the storage did not answer; rerun once it does (the run resumes from its last checkpoint)"


def storage_fault(err: BaseException) -> StorageFault | None:
    """The storage failure behind ``err`` (a tensorstore ``ValueError`` or an ``OSError``), or None when
    ``err`` is not one (a bug or a bad request, which retrying cannot fix)."""
    if isinstance(err, OSError):
        name = getattr(err, "filename", None)
        chunk = os.fspath(name) if name else None
        code = {2: _MISSING, 13: "PERMISSION_DENIED"}.get(err.errno or 0, "UNAVAILABLE")
        return StorageFault(code, chunk, _cache_of(chunk), err.strerror or str(err))
    if not isinstance(err, ValueError):
        return None
    text = _status_text(err)
    m = _STATUS.match(text)
    if m is None or m.group(1) not in _STORAGE_CODES:
        return None
    code = m.group(1)
    raw = str(err)
    if code in ("UNKNOWN", "INTERNAL") and "os_error" not in raw and "OS error" not in raw:
        return None  # an internal failure without an OS error behind it: a bug, not the storage
    quoted = _QUOTED.search(text)
    chunk = quoted.group(1) if quoted else None
    if chunk is None:
        idx = _CHUNK_INDEX.search(text)
        chunk = f"{{{idx.group(1)}}}" if idx else None
    detail = text[m.end():]
    if quoted is not None and '": ' in detail:  # 'Error reading local file "...": <the reason>'
        detail = detail.rsplit('": ', 1)[-1]
    return StorageFault(code, chunk, _cache_of(chunk), detail)


def _cache_of(chunk: str | None) -> str | None:
    """The cache holding ``chunk`` (``<store>/<array>/c/<key>``), or None if it does not look like one."""
    if not chunk or "/c/" not in chunk:
        return None
    array_dir = chunk.rsplit("/c/", 1)[0]
    store = array_dir.rsplit("/", 1)[0] if "/" in array_dir else array_dir
    return cache_root(store)


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
        data = _open_array(_kvstore(path, "data"), context=_CONTEXT, store_path=store_path)
        offsets = _open_array(_kvstore(path, "offsets"), context=_CONTEXT, store_path=store_path)
        half_created = data is None or offsets is None or _length(offsets) < 1
        if mode == "a" and num_rows == 0 and half_created:
            # Nothing committed and a writer died while creating the arrays: start afresh.
            return cls._create(path, want or np.dtype(np.int32), data_chunk, offsets_chunk, codec, checksum)
        if data is None or offsets is None:
            if mode == "r" and (strict or data is not None or offsets is not None):
                missing = [n for n, a in (("data", data), ("offsets", offsets)) if a is None]
                what = " and ".join(f"{_join(path, n)}/zarr.json" for n in missing)
                raise _damaged(path, f"{what} {'is' if len(missing) == 1 else 'are'} missing")
            if mode == "r" or (data is not None or offsets is not None):
                missing = "data" if data is None else "offsets"
                raise FileNotFoundError(
                    f"no JaggedArrayStore at {path!r}: its '{missing}' array is missing"
                    + ("" if mode == "r" else "; delete the directory to start over")
                )
            if num_rows is not None:
                raise FileNotFoundError(
                    f"no JaggedArrayStore at {path!r}, but num_rows={num_rows} was expected"
                )
            return cls._create(path, want or np.dtype(np.int32), data_chunk, offsets_chunk, codec, checksum)

        stored = np.dtype(data.dtype.numpy_dtype)
        if want is not None and want != stored:
            raise TypeError(f"store at {path!r} holds {stored}, but dtype={want} was requested")
        if np.dtype(offsets.dtype.numpy_dtype) != np.int64:
            raise ValueError(f"store at {path!r}: offsets must be int64, found {offsets.dtype}")

        n_offsets = _length(offsets)
        if n_offsets < 1:
            raise ValueError(f"store at {path!r} is corrupt: its offsets array is empty")
        # Committed rows must have all their chunks: read-only, so a read never meets a hole; for append,
        # because a write into a missing chunk fills the rest of it with zeros, silently.
        whole = num_rows is not None
        if whole:
            _check_chunks(path, "offsets", offsets, min(num_rows + 1, n_offsets))
        if num_rows is None:
            num_rows = n_offsets - 1
            try:
                data_size = int(offsets[num_rows].read().result())
            except ValueError as e:
                # A store that was not finalized has capacity past its end, never written.
                fault = storage_fault(e)
                if fault is None or fault.code != _MISSING:
                    raise
                raise ValueError(
                    f"store at {path!r} was not finalized or is damaged ({fault.what()}); pass num_rows "
                    "from the cache ledger"
                ) from e
            if data_size != _length(data):
                raise ValueError(
                    f"store at {path!r} was not finalized (last offset {data_size}, data length "
                    f"{_length(data)}); pass num_rows from the cache ledger"
                )
        else:
            if num_rows + 1 > n_offsets:
                raise ValueError(
                    f"store at {path!r} holds at most {n_offsets - 1} rows but num_rows={num_rows} is "
                    "committed; the store is truncated or the ledger belongs to another cache"
                )
            try:
                data_size = int(offsets[num_rows].read().result())
            except ValueError as e:
                fault = storage_fault(e)
                if not strict or fault is None:
                    raise
                raise _damaged(path, fault.what()) from e
            if not 0 <= data_size <= _length(data):
                raise ValueError(
                    f"store at {path!r} is corrupt: row {num_rows} ends at {data_size}, outside the data "
                    f"array of length {_length(data)}"
                )
        if whole:
            _check_chunks(path, "data", data, data_size)
        if mode == "a":
            # Reset the garbage past the committed end now, so the store is what a clean build of the
            # committed rows would be whatever the next appends write; the chunk record of a finished
            # store no longer holds once it is appended to (finalize writes it again).
            data = _truncate(data, data_size)
            offsets = _truncate(offsets, num_rows + 1)
            chunk_manifest.remove(path)
        return cls(path, data, offsets, num_rows=num_rows, data_size=data_size, writable=mode == "a")

    @classmethod
    def _create(cls, path, dtype, data_chunk, offsets_chunk, codec, checksum=True) -> "JaggedArrayStore":
        if data_chunk < 1 or offsets_chunk < 1:
            raise ValueError(
                f"chunk sizes must be >= 1, got data_chunk={data_chunk}, offsets_chunk={offsets_chunk}"
            )
        codecs = _codecs(codec, checksum)
        chunk_manifest.remove(path)
        data = _create_array(
            _kvstore(path, "data"), dtype=dtype, chunk=data_chunk, codecs=codecs, context=_CONTEXT
        )
        offsets = _create_array(
            _kvstore(path, "offsets"),
            dtype=np.dtype(np.int64),
            chunk=offsets_chunk,
            codecs=codecs,
            context=_CONTEXT,
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
        if new_size > _length(self._data):
            self._data = self._data.resize(exclusive_max=[_capacity(new_size, _chunk(self._data))]).result()
        if new_rows + 1 > _length(self._offsets):
            self._offsets = self._offsets.resize(
                exclusive_max=[_capacity(new_rows + 1, _chunk(self._offsets))]
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
        chunk_manifest.write(self.path, {"data": self._data, "offsets": self._offsets}, _CONTEXT)

    def verify_chunk_positions(self, *, require: bool = True) -> None:
        """Refuse (:class:`DamagedStoreError`) a finalized store with a chunk file whose checksum belongs at
        another position (:mod:`levanter.store.chunk_manifest`); with ``require``, also one whose
        checksummed chunks were never recorded (finished by an older version)."""
        problem = chunk_manifest.check(self.path, {"data": self._data, "offsets": self._offsets}, _CONTEXT)
        if problem == "unrecorded":
            if require:
                root = cache_root(self.path)
                raise DamagedStoreError(
                    f"the cache at {root} records no position of its chunk checksums (written by an older "
                    "version), so a chunk swapped with another would be read unnoticed; delete it to rebuild"
                )
        elif problem is not None:
            raise _damaged(self.path, problem)

    # -- reading -------------------------------------------------------------------------------------
    def _read(self, view: ts.TensorStore) -> ts.Future:
        # Every read goes through here: one call per tensorstore operation (tests count them).
        return view.read()

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
        return self._read(self._offsets[np.concatenate([idx, idx + 1])])

    def _rows_future(self, bounds: np.ndarray) -> ts.Future | None:
        n = bounds.shape[0] // 2
        starts, ends = bounds[:n], bounds[n:]
        pieces = [self._data[int(s) : int(e)] for s, e in zip(starts, ends) if e > s]
        if not pieces:
            return None
        return self._read(ts.concat(pieces, axis=0) if len(pieces) > 1 else pieces[0])

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


# Futures handed to ``awaited`` whose done-callback has not run yet, by the id of the asyncio future
# waiting for each (one future may be awaited several times: a coalesced read). Holding them here means
# a future is never deallocated (which unregisters its callback, and waits for a running one) by a thread
# that holds the GIL while the callback waits for the GIL in a tensorstore thread: see ``awaited``.
_callbacks_pending: dict[int, Any] = {}


async def awaited(fut: ts.Future):
    """``await fut`` through our own bridge from tensorstore's thread to the event loop.

    tensorstore's own ``__await__`` wakes the loop from a tensorstore thread even after the loop has
    closed (a loader closed mid-read), which prints "Event loop is closed" tracebacks; this bridge drops
    the wake-up instead.

    A read whose awaiting task is cancelled is left to finish and its result dropped: it is never
    cancelled. ``Future.cancel()`` (and the deallocation of a future with a registered callback) waits,
    holding the GIL, for a callback that is running in a tensorstore thread -- which needs the GIL to
    finish: a deadlock that froze a loader closed mid-read about once in a few thousand closes under
    load. Only ``on_done`` drops the last reference we hold, from within the callback itself.
    """
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def on_done(f: Any) -> None:
        _callbacks_pending.pop(id(waiter), None)  # ``f`` is ``fut``: still referenced until we return
        try:
            loop.call_soon_threadsafe(_transfer, waiter, f)
        except RuntimeError:  # the loop has closed: nobody waits for this read any more
            pass

    _callbacks_pending[id(waiter)] = fut
    fut.add_done_callback(on_done)
    return await waiter


def _transfer(waiter: asyncio.Future, fut: ts.Future) -> None:
    if waiter.done():  # cancelled meanwhile
        return
    try:
        waiter.set_result(fut.result())
    except BaseException as e:  # noqa: BLE001 -- handed to the awaiting task
        waiter.set_exception(e)


def read_stacked(views: Sequence[ts.TensorStore]):
    """One read of equally shaped views, possibly of different stores: a future of ``array[len(views), ...]``.

    The mixture reads every source's windows of a step with this (see ``ReadPlan`` in
    :mod:`levanter.data.dataset`): one tensorstore operation and one completion per step. One-dimensional
    views (token windows) are concatenated and the result reshaped: a plain slice is the cheapest view
    to make (less Python per window than an origin-0 one), and ``ts.stack`` needs origin 0. Both are
    one read that fills the result directly -- faster than per-window reads stacked afterwards, and far
    faster than one index-array read, which walks an int64 index per element (docs/performance.md).
    """
    views = list(views)
    read = JaggedArrayStore._read
    if views and views[0].rank == 1:
        shape = (len(views), views[0].shape[0])
        return _Reshaped(read(None, ts.concat(views, axis=0)), shape)  # type: ignore[arg-type]
    return read(None, ts.stack([v.translate_to[0] for v in views], axis=0))  # type: ignore[arg-type]


def read_blocks(blocks: Sequence[ts.TensorStore]):
    """One read of 2-D views (:meth:`JaggedArrayStore.window_block`, possibly of different stores) with
    equal row shapes: a future of their rows, concatenated."""
    blocks = list(blocks)
    view = ts.concat(blocks, axis=0) if len(blocks) > 1 else blocks[0]
    return JaggedArrayStore._read(None, view)  # type: ignore[arg-type]


class _Reshaped:
    """A tensorstore future whose result is reshaped: what :func:`awaited` and callers of ``result()`` use."""

    __slots__ = ("_future", "_shape")

    def __init__(self, future: ts.Future, shape: tuple[int, ...]):
        self._future = future
        self._shape = shape

    def result(self) -> np.ndarray:
        flat = self._future.result()
        if flat.size != int(np.prod(self._shape)):
            raise ValueError(
                f"read_stacked: views of unequal lengths (read {flat.size} values for {self._shape})"
            )
        return flat.reshape(self._shape)

    def add_done_callback(self, callback) -> None:
        self._future.add_done_callback(lambda _: callback(self))

    def done(self) -> bool:
        return self._future.done()


"""The zarr3 arrays behind a :class:`~levanter.store.jagged_array.JaggedArrayStore`: opening, creating,
growing, truncating and checking them through tensorstore.

Every array is opened with ``fill_missing_data_reads: false`` (a missing chunk is an error, never fill
values) and ``store_data_equal_to_fill_value: true`` (so a chunk equal to the fill value exists on disk
too), and arrays created here end their codec chain with ``crc32c``. :func:`capacity` grows arrays by a
rule that depends only on the size needed and :func:`truncate` leaves exactly what a clean build of the
same size would have, so a resumed build ends byte-identical to an uninterrupted one.
:func:`check_chunks` lists an array's chunk keys once to refuse a store with holes before it is read or
appended to.

Trade-off: one process-wide tensorstore context (:data:`CONTEXT`) shares I/O thread pools and makes
``memory://`` stores visible across opens, at the cost that its retry budgets and cache limits are the
same for every store.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorstore as ts

from ..utils import fs
from .faults import MISSING, damaged_error, status_text, storage_fault

__all__ = [
    "array_kvstore",
    "capacity",
    "codec_chain",
    "open_array",
    "create_array",
    "array_length",
    "chunk_length",
    "truncate",
    "check_chunks",
    "refuse_missing_arrays",
    "committed_size",
    "CONTEXT",
]

# One context for every store in the process: "memory://" stores are visible across opens only within
# a shared context, and tensorstore's I/O thread pools are shared instead of multiplied per store.
# Its retry budgets let array reads and writes on object stores ride out throttling and 5xx answers.
CONTEXT = ts.Context(fs.tensorstore_context_spec())

SHORTHAND_CODECS: dict[str, dict[str, Any]] = {
    "zstd": {"name": "zstd", "configuration": {"level": 3, "checksum": False}},
    "gzip": {"name": "gzip", "configuration": {"level": 5}},
}


# Options of every array open. A missing chunk is an error, never fill values: a read must return what was
# written or fail. With that, a chunk equal to the fill value (all-zero tokens or offsets) must be written
# too, where tensorstore would by default delete it and rely on the fill value.
ARRAY_OPTIONS: dict[str, Any] = {"fill_missing_data_reads": False, "store_data_equal_to_fill_value": True}

# The last codec of every array created here: a CRC-32C of each encoded chunk, checked on every read.
CHECKSUM_CODEC: dict[str, Any] = {"name": "crc32c"}


def array_kvstore(path: str | os.PathLike, sub: str) -> dict[str, Any]:
    """Kvstore spec of ``<path>/<sub>/`` (``file``, ``memory``, ``s3`` or ``gcs``; see :mod:`levanter.utils.fs`)."""
    return fs.kvstore_spec(fs.join(os.fspath(path), sub))


def capacity(needed: int, chunk: int) -> int:
    """Array length to hold ``needed`` elements: the next power of two, at least one chunk.

    A pure function of ``needed``, never of the append history or timing, so a resumed build resizes
    to the same shapes as a clean one. Over-allocation costs nothing on disk (zarr stores no chunks
    that were never written); growing by doubling keeps metadata rewrites to O(log n).
    """
    cap = max(chunk, 1)
    while cap < needed:
        cap *= 2
    return cap


def codec_chain(codec: str | Mapping[str, Any] | None, checksum: bool = True) -> list[dict[str, Any]]:
    """The codec chain: ``bytes``, then the compression codec if any, then ``crc32c`` (zarr3 puts
    bytes-to-bytes codecs after ``bytes``; the checksum covers the chunk as stored, compressed or not)."""
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if isinstance(codec, str):
        if codec not in SHORTHAND_CODECS:
            raise ValueError(
                f"unknown codec {codec!r}; use one of {sorted(SHORTHAND_CODECS)} or a zarr3 codec dict"
            )
        codecs.append(dict(SHORTHAND_CODECS[codec]))
    elif codec is not None:
        codecs.append(dict(codec))
    if checksum and not any(c.get("name") == CHECKSUM_CODEC["name"] for c in codecs):
        codecs.append(dict(CHECKSUM_CODEC))
    return codecs


def _is_not_found(err: Exception) -> bool:
    return "NOT_FOUND" in str(err)


def open_array(kvstore, *, context: ts.Context, store_path: str | None = None) -> ts.TensorStore | None:
    """Open an existing zarr3 array, or None when there is none at ``kvstore``.

    With ``store_path`` (a store opened for reading) an unreadable ``zarr.json`` is reported as a damaged
    cache; otherwise tensorstore's error is passed on.
    """
    spec = {"driver": "zarr3", "kvstore": kvstore, **ARRAY_OPTIONS}
    try:
        return ts.open(spec, open=True, context=context).result()
    except ValueError as e:
        if _is_not_found(e):
            return None
        if store_path is None:
            raise
        where = kvstore if isinstance(kvstore, str) else kvstore["path"]
        fault = storage_fault(e)
        reason = fault.detail if fault is not None else status_text(e)
        raise damaged_error(store_path, f"{where}zarr.json cannot be read: {reason}") from e


def create_array(kvstore, *, dtype: np.dtype, chunk: int, codecs, context: ts.Context) -> ts.TensorStore:
    metadata = {
        "shape": [0],
        "data_type": dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [int(chunk)]}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": codecs,
        "fill_value": False if dtype == np.bool_ else 0,
    }
    spec = {"driver": "zarr3", "kvstore": kvstore, "metadata": metadata, **ARRAY_OPTIONS}
    return ts.open(spec, create=True, delete_existing=True, context=context).result()


def array_length(arr: ts.TensorStore) -> int:
    """The array's length (its exclusive upper bound)."""
    return int(arr.domain.exclusive_max[0])


def chunk_length(arr: ts.TensorStore) -> int:
    """Elements per chunk of the 1-D array ``arr``."""
    return int(arr.chunk_layout.write_chunk.shape[0])


def truncate(arr: ts.TensorStore, size: int) -> ts.TensorStore:
    """Cut ``arr`` to ``size`` elements leaving what a clean build of that size would have on disk.

    Resizing down deletes chunks wholly past ``size`` but keeps a partial last chunk as is, stale tail
    included (tensorstore would even show that tail again after growing). So the tail is zeroed (the
    fill value) first; the array is grown to the chunk boundary for that, which is metadata only.
    """
    current = array_length(arr)
    if current <= size:
        return arr
    chunk = chunk_length(arr)
    boundary = -(-size // chunk) * chunk
    if boundary > size:
        if boundary > current:
            arr = arr.resize(exclusive_max=[boundary]).result()
        arr[size:boundary].write(np.zeros(boundary - size, dtype=arr.dtype.numpy_dtype)).result()
    return arr.resize(exclusive_max=[size]).result()


def check_chunks(path: str, name: str, arr: ts.TensorStore, size: int) -> None:
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
        kv = ts.KvStore.open(fs.kvstore_spec(chunk_dir), context=CONTEXT).result()
        present = {k.decode("utf-8", "replace").split("/", 1)[0] for k in kv.list().result()}
    except ValueError as e:
        if fs.is_transient(e):
            raise
        raise damaged_error(path, f"{chunk_dir} cannot be listed: {status_text(e)}") from e
    needed = -(-size // chunk_length(arr))
    missing = [k for k in range(needed) if str(k) not in present]
    if missing:
        shown = ", ".join(fs.join(chunk_dir, str(k)) for k in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        plural = len(missing) > 1
        files, verb = ("chunk files", "are") if plural else ("chunk file", "is")
        raise damaged_error(path, f"{files} {shown}{more} {verb} missing")


def refuse_missing_arrays(path: str, mode: str, num_rows: int | None, strict: bool, data, offsets) -> None:
    """Raise unless a store whose arrays are absent may be created (``mode`` "a", nothing committed)."""
    if mode == "r" and (strict or data is not None or offsets is not None):
        missing = [n for n, a in (("data", data), ("offsets", offsets)) if a is None]
        what = " and ".join(f"{fs.join(path, n)}/zarr.json" for n in missing)
        raise damaged_error(path, f"{what} {'is' if len(missing) == 1 else 'are'} missing")
    if mode == "r" or (data is not None or offsets is not None):
        missing = "data" if data is None else "offsets"
        raise FileNotFoundError(
            f"no JaggedArrayStore at {path!r}: its '{missing}' array is missing"
            + ("" if mode == "r" else "; delete the directory to start over")
        )
    if num_rows is not None:
        raise FileNotFoundError(f"no JaggedArrayStore at {path!r}, but num_rows={num_rows} was expected")


def committed_size(path: str, data, offsets, num_rows: int | None, strict: bool) -> tuple[int, int]:
    """``(rows, tokens)`` committed in an existing store: ``num_rows`` from the ledger, checked against the
    arrays (their chunks too), or, with None, a finalized store's own count (an unfinalized one refused)."""
    n_offsets = array_length(offsets)
    if n_offsets < 1:
        raise ValueError(f"store at {path!r} is corrupt: its offsets array is empty")
    if num_rows is not None:
        check_chunks(path, "offsets", offsets, min(num_rows + 1, n_offsets))
    if num_rows is None:
        num_rows = n_offsets - 1
        try:
            data_size = int(offsets[num_rows].read().result())
        except ValueError as e:
            # A store that was not finalized has capacity past its end, never written.
            fault = storage_fault(e)
            if fault is None or fault.code != MISSING:
                raise
            raise ValueError(
                f"store at {path!r} was not finalized or is damaged ({fault.what()}); pass num_rows "
                "from the cache ledger"
            ) from e
        if data_size != array_length(data):
            raise ValueError(
                f"store at {path!r} was not finalized (last offset {data_size}, data length "
                f"{array_length(data)}); pass num_rows from the cache ledger"
            )
        return num_rows, data_size
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
        raise damaged_error(path, fault.what()) from e
    if not 0 <= data_size <= array_length(data):
        raise ValueError(
            f"store at {path!r} is corrupt: row {num_rows} ends at {data_size}, outside the data "
            f"array of length {array_length(data)}"
        )
    return num_rows, data_size

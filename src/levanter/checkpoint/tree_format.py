"""How a pytree maps onto TensorStore arrays, shared by saving and restoring a checkpoint.

* Leaf names: each array leaf is stored under its key path, percent-encoded (:func:`leaf_name`), an
  injective mapping, so two leaves never share a directory.
* Array specs: zarr3 with a ``crc32c`` codec, every chunk stored even when it equals the fill value
  (:func:`write_spec`), and a missing chunk read as an error rather than zeros (:func:`read_spec`);
  chunks are the per-device shard shape, split only above 2 GiB (:func:`chunk_shape`), so no two
  processes write the same chunk file.
* Running the asynchronous reads and writes from synchronous code (:func:`run_coroutine`), and letting
  every leaf's operation finish before an error is reported (:func:`finish_all`).
* Error text: one line for a storage error, credentials redacted (:func:`io_error_text`).

Trade-off: raw chunks with a checksum make a checkpoint bit-exact and corruption loud, at the cost of
disk space that compression would save (see :mod:`levanter.checkpoint.serialization`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any, Optional

import jax
import numpy as np
import tensorstore as ts
from jax.experimental.array_serialization import serialization as jax_serialization

from levanter.checkpoint.layout import METADATA_FILENAME
from levanter.utils import fs

__all__ = [
    "is_stored_leaf",
    "is_template_leaf",
    "is_key_dtype",
    "leaf_name",
    "shape_dtype",
    "run_coroutine",
    "chunk_shape",
    "ts_context",
    "url_context_spec",
    "write_spec",
    "read_spec",
    "finish_all",
    "one_line",
    "io_error_text",
    "summarise",
]

# Largest chunk file; shards above this are split so that a single file stays manageable.
_MAX_CHUNK_BYTES = 2 * 1024**3


# ---------------------------------------------------------------------------------------------------
# Leaves and their names
# ---------------------------------------------------------------------------------------------------


def is_stored_leaf(x: Any) -> bool:
    """An array leaf that a checkpoint stores (``jax.Array``, numpy array or scalar)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_template_leaf(x: Any) -> bool:
    """A template leaf that a restore replaces: a stored kind, or a ``jax.ShapeDtypeStruct``."""
    return is_stored_leaf(x) or isinstance(x, jax.ShapeDtypeStruct)


def is_key_dtype(dtype: Any) -> bool:
    """A typed PRNG key dtype (stored as its ``key_data``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_component(k: Any) -> str:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def _encode_component(s: str) -> str:
    # Percent-encoding with nothing "safe" is injective ('%' itself is encoded), so two different
    # keys can never share a directory. The special cases below produce strings quote() never does.
    if s == "":
        return "%"
    if s in (".", ".."):
        return s.replace(".", "%2E")
    return urllib.parse.quote(s, safe="")


def leaf_name(path: tuple) -> str:
    """The directory (relative to the checkpoint) of the leaf at key path ``path``."""
    if not path:
        return "root"  # the whole tree is one array, so nothing else can be called this
    parts = [_encode_component(_key_component(k)) for k in path]
    if len(parts) == 1 and parts[0] == METADATA_FILENAME:
        parts[0] = "metadata%2Ejson"
    return "/".join(parts)


def shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    """``(shape, dtype)`` of a leaf."""
    return tuple(int(d) for d in np.shape(x)), x.dtype


# ---------------------------------------------------------------------------------------------------
# Running the asynchronous reads and writes
# ---------------------------------------------------------------------------------------------------


def run_coroutine(coro):
    """``asyncio.run``, also from a thread that already runs an event loop (e.g. a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# ---------------------------------------------------------------------------------------------------
# TensorStore specs
# ---------------------------------------------------------------------------------------------------


def chunk_shape(shard_shape: Sequence[int], itemsize: int) -> list[int]:
    """The shard shape, halved (by smallest prime factors) until a chunk is at most _MAX_CHUNK_BYTES.

    Chunks always divide the shard, so each process writes whole chunks of its own shards only.
    """
    chunk = [max(1, int(d)) for d in shard_shape]
    while math.prod(chunk) * itemsize > _MAX_CHUNK_BYTES:
        best = None
        for axis, d in enumerate(chunk):
            if d == 1:
                continue
            p = next(f for f in range(2, d + 1) if d % f == 0)
            if best is None or d > chunk[best[0]]:
                best = (axis, p)
        if best is None:
            break
        chunk[best[0]] //= best[1]
    return chunk


_URL_CONTEXT: ts.Context | None = None


def ts_context(path: str) -> ts.Context:
    """The TensorStore context for arrays under ``path``: JAX's default for local disk; for URLs one
    process-wide context with the storage layer's request retries (one, because a ``memory://`` kvstore
    lives in its context: a second context would not see what the first wrote)."""
    global _URL_CONTEXT
    if not fs.is_url(path):
        return jax_serialization.TS_CONTEXT
    if _URL_CONTEXT is None:
        _URL_CONTEXT = ts.Context(url_context_spec())
    return _URL_CONTEXT


def url_context_spec() -> dict:
    """The spec of the TensorStore context for arrays on object stores (the storage layer's retries)."""
    return {"data_copy_concurrency": {"limit": 128}, **fs.tensorstore_context_spec()}


def write_spec(directory: str, shape: Sequence[int], dtype: Any, chunk: Sequence[int]) -> dict:
    """The zarr3 spec an array leaf is created with under ``directory``."""
    return {
        "driver": "zarr3",
        "kvstore": fs.kvstore_spec(directory),
        "metadata": {
            "shape": list(shape),
            "data_type": np.dtype(dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        },
        # Without this all-zero chunks (fresh Adam moments) are not written, and the read side could
        # not tell "all zeros" from "chunk file lost".
        "store_data_equal_to_fill_value": True,
    }


def read_spec(directory: str) -> dict:
    """The spec an array leaf is opened with for reading."""
    # A missing chunk file is an error, not a block of zeros.
    return {
        "driver": "zarr3",
        "kvstore": fs.kvstore_spec(directory),
        "fill_missing_data_reads": False,
    }


async def finish_all(tasks: list) -> list:
    """Results (or exceptions) of ``tasks`` in order, once *every* task has finished.

    A failed leaf must not cancel the others: a cancelled task leaves its TensorStore operation running,
    and when that finishes after the event loop has closed, its callback prints a traceback ("Event loop
    is closed") under the real error message. Only a cancellation from outside cancels them all.
    """
    try:
        return await asyncio.gather(*tasks, return_exceptions=True)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# Tensorstore appends its whole spec and source locations to an error; the first clause is the message.
_TS_NOISE = re.compile(r"\s*\[(?:tensorstore_spec|source locations)=.*$", re.S)
# The status codes TensorStore (absl) puts first in the message of a failed storage operation.
_TS_STORAGE_STATUS = re.compile(
    r"^(FAILED_PRECONDITION|UNAVAILABLE|PERMISSION_DENIED|UNAUTHENTICATED|NOT_FOUND|DEADLINE_EXCEEDED|"
    r"RESOURCE_EXHAUSTED|ABORTED|INTERNAL|UNKNOWN|DATA_LOSS): "
)


def one_line(text: str) -> str:
    """The first line of an error's text, without tensorstore's spec payload, redacted and shortened."""
    text = fs.redact(_TS_NOISE.sub("", text.strip().splitlines()[0] if text.strip() else text))
    return text if len(text) <= 300 else text[:297] + "..."


def io_error_text(e: BaseException) -> Optional[str]:
    """A one-line description of a storage error (credentials redacted), or None if ``e`` is not one."""
    if isinstance(e, fs.StorageAccessError):
        return one_line(str(e))
    if isinstance(e, OSError):
        return one_line(e.strerror or str(e))
    if isinstance(e, ValueError) and (
        "[OS error" in str(e) or "os_error_code=" in str(e) or _TS_STORAGE_STATUS.match(str(e))
    ):  # a tensorstore I/O error (local file or HTTP)
        return one_line(str(e))
    if isinstance(e, Exception) and fs.is_transient(e):  # retries exhausted
        return one_line(f"{type(e).__name__}: {e}")
    return None


def summarise(names: Sequence[str], limit: int = 8) -> str:
    """Up to ``limit`` of ``names``, sorted, and how many more, for a message."""
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more

"""Tree serialisation: write a training-state pytree to TensorStore so that it restores bit for bit.

Format. A checkpoint is a directory (a prefix on an object store) holding one TensorStore zarr3 array
per array leaf of the pytree (the leaf's key path, percent-encoded, is its sub-directory:
``model/layers/0/weight``, ``opt_state/0/mu/...``) and a ``metadata.json`` (see
:mod:`levanter.checkpoint.layout`). Only arrays are stored -- ``jax.Array``, numpy arrays and numpy
scalars; everything else (static fields, activation functions, Python numbers, the tree structure
itself) comes from the *template* passed to :func:`load_checkpoint`. A Python ``int`` step in the tree
is therefore *not* saved: keep the step as a jax/numpy scalar if it must round-trip (the step is also
recorded in ``metadata.json``). Typed PRNG key arrays are stored as their ``jax.random.key_data`` and
rewrapped on load with the recorded implementation.

Bit-exactness. Chunks are written raw (no compression, no dtype conversion) with a crc32c codec, so a
flipped or truncated chunk fails its checksum on load instead of silently restoring garbage; chunks
equal to the fill value are stored anyway and missing chunks are read as an error rather than as
zeros, so a deleted chunk file is caught too. The trade-off is disk space: zstd would shrink
optimizer moments a little, at a CPU cost on every save.

Storage. Arrays go through the TensorStore kvstore of the path (:func:`levanter.utils.fs.kvstore_spec`:
``file``, ``gcs``, ``s3`` or ``memory``) with the retrying context of :mod:`levanter.utils.fs`, so
transient HTTP errors of an object store are retried by TensorStore itself; ``metadata.json`` and the
listing and deletion of prefixes go through :mod:`levanter.utils.fs`, retried the same way. How a save
commits -- a temporary directory renamed into place on POSIX storage, ``metadata.json`` written last
under the final prefix on object stores -- is described in :mod:`levanter.checkpoint.layout`.

Finite values only. :func:`save_checkpoint` first checks every floating-point leaf (an all-finite
reduction on the devices, one small transfer back) and refuses a tree holding a NaN or an infinity,
writing nothing: a poisoned state must never become the checkpoint a rerun resumes from. A full disk
raises :class:`levanter.errors.OutOfSpaceError` (exit status 74 from the command line), other storage
errors (after the retries, for transient ones) :class:`CheckpointSaveError` naming the path or URL
(never credentials); either way the partial write is removed.

Multi-process. Leaves are written with ``jax.experimental.array_serialization``'s ``async_serialize``
and read with ``async_deserialize``. Each process writes only the shards it can address and only one
replica of each (``replica_id == 0``); zarr chunks are the per-device shard shape (split further only
above 2 GiB), so no two processes ever write the same chunk file. Array metadata (``zarr.json``) and
``metadata.json`` are written by process 0 only, which then commits the save (renaming its temporary
directory, or writing ``metadata.json`` under the final prefix once a barrier says every process has
written its shards). On an object store process 0 first removes what an earlier, uncommitted save of
the same step left, and a barrier keeps the others from writing before that is done. The caller hands
in its process index (``process_index``, by default ``jax.process_index()``). On load each process
reads only the slices its own devices need.

:func:`save_checkpoint` is synchronous: the caller waits for the data to reach storage. It is
:func:`prepare_save` (checks and collectives, on the calling thread) followed by
:meth:`PreparedSave.commit`; :class:`~levanter.checkpoint.Checkpointer` runs the commit in the background
after :meth:`PreparedSave.copy_to_host` (:mod:`levanter.checkpoint.async_writer`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import logging
import math
import operator
import os
import re
import secrets
import shutil
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np
import tensorstore as ts
from jax.experimental.array_serialization import serialization as jax_serialization

from levanter.checkpoint.errors import CheckpointMismatchError, CheckpointSaveError, CorruptCheckpointError
from levanter.checkpoint.host_copy import HostShards, host_copies, write_host_shards
from levanter.checkpoint.layout import (
    CHECKPOINT_FORMAT_VERSION,
    METADATA_FILENAME,
    TMP_PREFIX,
    atomic_write_json,
    commits_by_rename,
    is_complete,
    read_checkpoint_metadata,
    remove_dir,
    resolve_path,
)
from levanter.errors import is_out_of_space, out_of_space_error
from levanter.utils import fs
from levanter.utils.fault import fault_point

__all__ = ["Barrier", "PreparedSave", "io_error_text", "load_checkpoint", "prepare_save", "save_checkpoint",
           "write_leaf"]

logger = logging.getLogger(__name__)

# Largest chunk file; shards above this are split so that a single file stays manageable.
_MAX_CHUNK_BYTES = 2 * 1024**3
# Host memory one process may hold for reads in flight while loading (a soft cap, see _ByteLimiter).
_READ_BYTES_IN_FLIGHT = 16 * 1024**3

Barrier = Callable[[str], None]


def _no_barrier(name: str) -> None:
    return None


# ---------------------------------------------------------------------------------------------------
# Leaves and their names
# ---------------------------------------------------------------------------------------------------


def _is_stored_leaf(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _is_template_leaf(x: Any) -> bool:
    return _is_stored_leaf(x) or isinstance(x, jax.ShapeDtypeStruct)


def _is_key_dtype(dtype: Any) -> bool:
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


def _leaf_name(path: tuple) -> str:
    """The directory (relative to the checkpoint) of the leaf at key path ``path``."""
    if not path:
        return "root"  # the whole tree is one array, so nothing else can be called this
    parts = [_encode_component(_key_component(k)) for k in path]
    if len(parts) == 1 and parts[0] == METADATA_FILENAME:
        parts[0] = "metadata%2Ejson"
    return "/".join(parts)


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    return tuple(int(d) for d in np.shape(x)), x.dtype


# ---------------------------------------------------------------------------------------------------
# Running the asynchronous reads and writes
# ---------------------------------------------------------------------------------------------------


def _shared_token() -> str:
    """A random token, the same on every process (the temporary directory name must agree)."""
    value = secrets.randbits(31)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        value = int(multihost_utils.broadcast_one_to_all(np.int32(value)))
    return f"{value:08x}"


def _run(coro):
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


def _chunk_shape(shard_shape: Sequence[int], itemsize: int) -> list[int]:
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


def _ts_context(path: str) -> ts.Context:
    """The TensorStore context for arrays under ``path``: JAX's default for local disk; for URLs one
    process-wide context with the storage layer's request retries (one, because a ``memory://`` kvstore
    lives in its context: a second context would not see what the first wrote)."""
    global _URL_CONTEXT
    if not fs.is_url(path):
        return jax_serialization.TS_CONTEXT
    if _URL_CONTEXT is None:
        _URL_CONTEXT = ts.Context({"data_copy_concurrency": {"limit": 128}, **fs.tensorstore_context_spec()})
    return _URL_CONTEXT


def _write_spec(directory: str, shape: Sequence[int], dtype: Any, chunk: Sequence[int]) -> dict:
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


def _read_spec(directory: str) -> dict:
    # A missing chunk file is an error, not a block of zeros.
    return {
        "driver": "zarr3",
        "kvstore": fs.kvstore_spec(directory),
        "fill_missing_data_reads": False,
    }


class _ByteLimiter:
    """Caps host bytes held by reads in flight (the interface ``async_deserialize`` expects)."""

    def __init__(self, limit: int):
        self._limit = limit
        self._available = limit
        self._cv = asyncio.Condition()

    async def wait_for_bytes(self, n: int) -> None:
        async with self._cv:
            # A single read larger than the cap waits for everything else to finish, then proceeds.
            await self._cv.wait_for(lambda: self._available >= min(n, self._limit))
            self._available -= n

    async def release_bytes(self, n: int) -> None:
        async with self._cv:
            self._available += n
            self._cv.notify_all()


# ---------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------


@dataclass
class _ToWrite:
    record: dict
    value: Any  # what goes on disk: the array, or a typed key array's key_data


def _prepare_leaves(tree: Any) -> list[_ToWrite]:
    out = []
    seen: set[str] = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not _is_stored_leaf(leaf):
            continue
        name = _leaf_name(path)
        if name in seen:  # cannot happen with injective names; a guard against silent overwrites
            raise ValueError(f"two leaves map to the same checkpoint entry {name!r}")
        seen.add(name)
        shape, dtype = _shape_dtype(leaf)
        record: dict[str, Any] = {
            "name": name,
            "keypath": jax.tree_util.keystr(path),
            "shape": list(shape),
            "dtype": str(dtype),
            "kind": "numpy" if not isinstance(leaf, jax.Array) else "jax",
        }
        value = leaf
        if isinstance(leaf, jax.Array) and _is_key_dtype(dtype):
            value = jax.random.key_data(leaf)
            record["key_impl"] = str(jax.random.key_impl(leaf))
        elif isinstance(leaf, np.generic):
            value = np.asarray(leaf)
        record["stored_shape"] = [int(d) for d in value.shape]
        record["stored_dtype"] = np.dtype(value.dtype).name
        out.append(_ToWrite(record, value))
    return out


async def write_leaf(root: str, item: _ToWrite, process_index: int) -> None:
    """Write one leaf under ``root``: this process's replica-0 shards, or a host value (process 0 only)."""
    directory = fs.join(root, item.record["name"])
    context = _ts_context(root)
    value = item.value
    multi = jax.process_count() > 1
    if isinstance(value, HostShards):  # a device array copied to the host before a background save
        chunk = _chunk_shape(value.shard_shape, value.dtype.itemsize)
        spec = _write_spec(directory, value.shape, value.dtype, chunk)
        await write_host_shards(value, spec, context, creates_metadata=jax.process_index() == 0)
        return
    if isinstance(value, jax.Array) and not (multi and value.is_fully_addressable):
        shard_shape = value.sharding.shard_shape(value.shape)
        chunk = _chunk_shape(shard_shape, value.dtype.itemsize)
        spec = _write_spec(directory, value.shape, value.dtype, chunk)
        # primary_host=0: only process 0 creates zarr.json; every process writes its own replica-0 shards.
        await jax_serialization.async_serialize(value, spec, primary_host=0, context=context)
        return
    # A host value (numpy leaf, or a process-local jax array in a multi-process job): each process
    # may hold its own copy, so process 0's is the one written.
    if process_index != 0:
        return
    host = np.asarray(value)
    spec = _write_spec(directory, host.shape, host.dtype, _chunk_shape(host.shape, host.dtype.itemsize))
    store = await ts.open(spec, create=True, open=True, context=context)
    await store.write(host)


async def _finish_all(tasks: list) -> list:
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


async def _write_all(root: str, items: list[_ToWrite], process_index: int) -> None:
    tasks = [asyncio.ensure_future(write_leaf(root, it, process_index)) for it in items]
    try:
        for i, done in enumerate(asyncio.as_completed(tasks)):
            await done
            if i < len(tasks) - 1:
                fault_point("checkpoint_mid_write")
    except Exception:
        await _finish_all(tasks)  # let the other writes settle, then report this failure
        raise
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@jax.jit
def _all_finite_flags(xs: list) -> jax.Array:
    return jax.numpy.stack([jax.numpy.all(jax.numpy.isfinite(x)) for x in xs])


def _non_finite_leaves(items: list[_ToWrite]) -> list[str]:
    """Key paths of the floating-point leaves that hold a NaN or an infinity.

    Device arrays are reduced on their devices (one compiled all-finite reduction per group of leaves on
    the same devices, one small transfer back); host values on the host.
    """
    multi = jax.process_count() > 1
    bad: list[str] = []
    groups: dict[Any, list[_ToWrite]] = {}
    for it in items:
        if not jax.dtypes.issubdtype(it.value.dtype, np.inexact):
            continue
        value = it.value
        if isinstance(value, jax.Array) and not (multi and value.is_fully_addressable):
            groups.setdefault(frozenset(value.sharding.device_set), []).append(it)
        elif not np.all(np.isfinite(np.asarray(value))):
            bad.append(it.record["keypath"] or it.record["name"])
    for group in groups.values():
        flags = _all_finite_flags([it.value for it in group])
        flags = np.asarray(flags.addressable_data(0))
        bad += [it.record["keypath"] or it.record["name"] for it, ok in zip(group, flags) if not ok]
    return bad


# Tensorstore appends its whole spec and source locations to an error; the first clause is the message.
_TS_NOISE = re.compile(r"\s*\[(?:tensorstore_spec|source locations)=.*$", re.S)
# The status codes TensorStore (absl) puts first in the message of a failed storage operation.
_TS_STORAGE_STATUS = re.compile(
    r"^(FAILED_PRECONDITION|UNAVAILABLE|PERMISSION_DENIED|UNAUTHENTICATED|NOT_FOUND|DEADLINE_EXCEEDED|"
    r"RESOURCE_EXHAUSTED|ABORTED|INTERNAL|UNKNOWN|DATA_LOSS): "
)


def _one_line(text: str) -> str:
    text = fs.redact(_TS_NOISE.sub("", text.strip().splitlines()[0] if text.strip() else text))
    return text if len(text) <= 300 else text[:297] + "..."


def io_error_text(e: BaseException) -> Optional[str]:
    """A one-line description of a storage error (credentials redacted), or None if ``e`` is not one."""
    if isinstance(e, fs.StorageAccessError):
        return _one_line(str(e))
    if isinstance(e, OSError):
        return _one_line(e.strerror or str(e))
    if isinstance(e, ValueError) and (
        "[OS error" in str(e) or "os_error_code=" in str(e) or _TS_STORAGE_STATUS.match(str(e))
    ):  # a tensorstore I/O error (local file or HTTP)
        return _one_line(str(e))
    if isinstance(e, Exception) and fs.is_transient(e):  # retries exhausted
        return _one_line(f"{type(e).__name__}: {e}")
    return None


def _metadata_doc(step: int, is_temporary: bool, user_metadata: dict, items: list[_ToWrite]) -> dict:
    return {
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "step": step,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "is_temporary": bool(is_temporary),
        "metadata": user_metadata,
        "leaves": [it.record for it in items],
    }


def _commit_by_rename(final: str, items: list[_ToWrite], doc: Callable[[], dict], barrier: Barrier,
                      token: str, process_index: int) -> None:
    """POSIX storage: write into ``.tmp-<name>-<token>``, then rename it to ``final``."""
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{token}")
    is_leader = process_index == 0
    try:
        if is_leader:
            os.makedirs(tmp, exist_ok=True)
        _run(_write_all(tmp, items, process_index))
        barrier(f"levanter_checkpoint_written_{name}_{token}")
        if is_leader:
            atomic_write_json(os.path.join(tmp, METADATA_FILENAME), doc())
            fault_point("checkpoint_before_rename")
            if os.path.lexists(final):
                # Not complete (checked by the caller): debris from something other than save_checkpoint.
                logger.warning("replacing incomplete directory %s (no %s)", final, METADATA_FILENAME)
                remove_dir(final)
            os.rename(tmp, final)
            fs.fsync_dir(parent)
    except BaseException:
        if is_leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit_by_record(final: str, items: list[_ToWrite], doc: Callable[[], dict], barrier: Barrier,
                      token: str, process_index: int) -> None:
    """Object stores: write the arrays under ``final`` itself, then ``metadata.json`` (the commit record)."""
    name = fs.basename(final)
    is_leader = process_index == 0
    try:
        if is_leader and fs.retry_transient(fs.isdir, final, what=f"looking for {final}"):
            # Not complete (checked by the caller): an earlier save of this step that never committed.
            logger.warning("removing the uncommitted save %s (no %s) before saving again", final,
                           METADATA_FILENAME)
            fs.retry_transient(fs.remove_tree, final, what=f"deleting {final}")
        barrier(f"levanter_checkpoint_cleared_{name}_{token}")
        _run(_write_all(final, items, process_index))
        barrier(f"levanter_checkpoint_written_{name}_{token}")
        if is_leader:
            fault_point("checkpoint_before_record")
            atomic_write_json(fs.join(final, METADATA_FILENAME), doc())
    except BaseException:
        if is_leader:
            try:  # best effort: what stays behind is uncommitted and removed by the next save or start-up
                remove_dir(final)
            except Exception as cleanup:  # noqa: BLE001 -- the original error is the one to report
                logger.warning("could not remove the partial save %s: %s", final,
                               io_error_text(cleanup) or cleanup)
        raise


def save_checkpoint(
    tree: Any,
    step: int,
    checkpoint_path: str,
    *,
    metadata: dict | None = None,
    is_temporary: bool = False,
    barrier: Barrier | None = None,
    process_index: int | None = None,
) -> str:
    """Write the arrays of ``tree`` to ``checkpoint_path`` atomically; returns the absolute path (or URL).

    ``checkpoint_path`` is a local path or an object-store URL (``gs://``, ``s3://``, ``memory://``).
    ``step`` is recorded in ``metadata.json`` (conventionally: the number of completed updates).
    ``metadata`` is extra JSON-serialisable information stored alongside. ``barrier(name)`` must block
    until every process has called it with the same name; pass
    ``jax.experimental.multihost_utils.sync_global_devices`` in multi-process jobs (every process must
    call ``save_checkpoint`` with the same arguments). Raises ``FileExistsError`` if a complete
    checkpoint is already at ``checkpoint_path`` (an incomplete directory there is replaced).
    ``process_index`` is this process's index (default ``jax.process_index()``): process 0 writes the
    host values and the metadata and commits the save.
    """
    return prepare_save(tree, step, checkpoint_path, metadata=metadata, is_temporary=is_temporary,
                        barrier=barrier, process_index=process_index).commit()


def prepare_save(
    tree: Any,
    step: int,
    checkpoint_path: str,
    *,
    metadata: dict | None = None,
    is_temporary: bool = False,
    barrier: Barrier | None = None,
    process_index: int | None = None,
) -> "PreparedSave":
    """The checks of :func:`save_checkpoint` (same arguments and errors), writing nothing: returns the
    save, whose :meth:`PreparedSave.commit` writes it. Every collective a save needs besides ``barrier``
    (the finite check, the shared token) runs here, on the calling thread."""
    process_index = jax.process_index() if process_index is None else process_index
    final = resolve_path(checkpoint_path)
    if isinstance(step, bool):
        raise TypeError("step must be an int, got a bool")
    try:
        step = operator.index(step)  # ints, numpy ints and integer jax scalars
    except TypeError:
        raise TypeError(f"step must be an int, got {type(step).__name__}") from None
    user_metadata = dict(metadata or {})
    try:  # fail before writing gigabytes, not after
        json.dumps(user_metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint metadata must be JSON-serialisable: {e}") from e
    if is_complete(final):
        raise FileExistsError(f"a complete checkpoint already exists at {final}")

    items = _prepare_leaves(tree)
    bad = _non_finite_leaves(items)
    if bad:
        raise CheckpointSaveError(
            f"not saving the checkpoint of step {step} to {final}: {_summarise(bad, 3)} "
            f"{'holds' if len(bad) == 1 else 'hold'} NaN or infinite values. Nothing was written; the latest "
            "complete checkpoint is unchanged. Resume from it with a fixed config (learning rate, epsilon)."
        )
    return PreparedSave(final, step, items, is_temporary, user_metadata, barrier or _no_barrier,
                        _shared_token(), process_index)


@dataclass
class PreparedSave:
    """A checked save, not yet written (:func:`prepare_save`)."""

    path: str
    step: int
    items: list[_ToWrite]
    is_temporary: bool
    user_metadata: dict
    barrier: Barrier
    token: str
    process_index: int

    def copy_to_host(self) -> int:
        """Replace the arrays to write by host copies (:mod:`levanter.checkpoint.host_copy`), so that the
        caller may donate or change the tree's buffers before :meth:`commit`; returns the bytes copied."""
        values = host_copies([it.value for it in self.items])
        for it, value in zip(self.items, values):
            it.value = value
        return sum(v.nbytes for v in values)

    def commit(self) -> str:
        """Write the arrays, then commit (see :mod:`levanter.checkpoint.layout`); returns the path. Storage
        errors are :class:`CheckpointSaveError` (a full disk :class:`~levanter.errors.OutOfSpaceError`)."""
        final, step, started = self.path, self.step, time.perf_counter()
        commit = _commit_by_rename if commits_by_rename(final) else _commit_by_record
        try:
            doc = lambda: _metadata_doc(step, self.is_temporary, self.user_metadata, self.items)  # noqa: E731
            commit(final, self.items, doc, self.barrier, self.token, self.process_index)
        except Exception as e:
            if is_out_of_space(e):
                raise out_of_space_error(f"saving the checkpoint of step {step}", final) from e
            what = io_error_text(e)
            if what is not None:
                raise CheckpointSaveError(
                    f"could not save the checkpoint of step {step} to {final}: {what}. Nothing was committed "
                    f"(the partial write was removed); free space or fix {fs.parent(final)}, then rerun to "
                    "resume from the latest complete checkpoint."
                ) from e
            raise
        self.barrier(f"levanter_checkpoint_committed_{fs.basename(final)}_{self.token}")
        logger.info("saved checkpoint for step %d to %s (%d arrays, %.2fs)", step, final, len(self.items),
                    time.perf_counter() - started)
        return final


# ---------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------


def _key_data_sharding(
    sharding: jax.sharding.Sharding, ndim: int, extra: int
) -> jax.sharding.Sharding | None:
    """The sharding of ``key_data`` for a key array placed with ``sharding`` (trailing dims replicated)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec, *([None] * extra)))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None


@dataclass
class _ToRead:
    record: dict
    keypath: str
    sharding: jax.sharding.Sharding | None  # None: return a numpy array
    numpy_scalar: bool


def _target_sharding(leaf: Any, explicit: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    if explicit is not None:
        return explicit
    if isinstance(leaf, jax.Array):
        return leaf.sharding
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf.sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return None  # numpy template leaf: restore on the host


async def _read_leaf(root: str, item: _ToRead, limiter: _ByteLimiter) -> Any:
    rec = item.record
    directory = fs.join(root, rec["name"])
    context = _ts_context(root)

    def fail(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {root}: leaf {item.keypath} ({rec['name']}) {why}")

    spec = _read_spec(directory)
    try:
        store = await ts.open(spec, open=True, context=context)
    except ValueError as e:
        # Asked only on failure: one existence check per leaf would cost a request each on object stores.
        zarr_json = fs.join(directory, "zarr.json")
        if not fs.retry_transient(fs.isfile, zarr_json, what=f"looking for {zarr_json}"):
            raise fail(f"is missing: there is no array at {directory}") from None
        raise fail(f"cannot be opened: {_one_line(str(e))}") from e
    stored_shape = tuple(rec["stored_shape"])
    stored_dtype = np.dtype(rec["stored_dtype"])
    if tuple(store.shape) != stored_shape or store.dtype.numpy_dtype != stored_dtype:
        raise fail(
            f"holds {tuple(store.shape)} {store.dtype.numpy_dtype} but {METADATA_FILENAME} says "
            f"{stored_shape} {stored_dtype}"
        )
    try:
        if item.sharding is None:
            host = await store.read()
            return host[()] if item.numpy_scalar else host
        key_impl = rec.get("key_impl")
        if key_impl is None:
            return await jax_serialization.async_deserialize(
                item.sharding, spec, global_shape=stored_shape, dtype=stored_dtype, byte_limiter=limiter,
                context=context,
            )
        ndim = len(rec["shape"])
        data_sharding = _key_data_sharding(item.sharding, ndim, len(stored_shape) - ndim)
        if data_sharding is None:  # an exotic sharding: load on one device, then move the keys
            data_sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        data = await jax_serialization.async_deserialize(
            data_sharding, spec, global_shape=stored_shape, dtype=stored_dtype, byte_limiter=limiter,
            context=context,
        )
        keys = jax.random.wrap_key_data(data, impl=key_impl)
        if keys.sharding != item.sharding:
            keys = jax.device_put(keys, item.sharding)
        return keys
    except ValueError as e:  # tensorstore reports DATA_LOSS / NOT_FOUND chunk errors as ValueError
        raise fail(f"cannot be read (truncated or damaged chunk?): {_one_line(str(e))}") from e


async def _read_all(root: str, items: list[_ToRead]) -> list[Any]:
    limiter = _ByteLimiter(_READ_BYTES_IN_FLIGHT)
    tasks = [asyncio.ensure_future(_read_leaf(root, it, limiter)) for it in items]
    results = await _finish_all(tasks)
    for r in results:
        if isinstance(r, BaseException):
            raise r  # the first failing leaf in tree order
    return results


def _sharding_lookup(shardings: Any) -> Callable[[str], jax.sharding.Sharding | None]:
    if shardings is None:
        return lambda name: None
    if isinstance(shardings, jax.sharding.Sharding):
        return lambda name: shardings
    by_name = {
        _leaf_name(path): s
        for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]
        if isinstance(s, jax.sharding.Sharding)
    }
    return by_name.get


def _summarise(names: Sequence[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_checkpoint(template_tree: Any, checkpoint_path: str, *, shardings: Any = None,
                    subpath: str | None = None) -> Any:
    """Restore a checkpoint into the structure of ``template_tree``.

    Array leaves of the template (``jax.Array``, numpy arrays/scalars, ``jax.ShapeDtypeStruct``) are
    replaced by the saved values; every other leaf and the tree structure are the template's. Each
    restored ``jax.Array`` gets the template leaf's sharding (a ``ShapeDtypeStruct`` without one: the
    first local device), unless ``shardings`` -- one ``Sharding`` for all leaves, or a pytree shaped
    like the template with ``Sharding`` leaves -- says otherwise. Numpy template leaves come back as
    numpy. Shapes and dtypes must match the template exactly (:class:`CheckpointMismatchError`);
    missing, truncated or damaged files raise :class:`CorruptCheckpointError`.

    ``subpath`` (upstream's name): restore only the subtree saved under that key (``"model"`` of a
    saved training state) into ``template_tree``; the checkpoint's other leaves are left alone.
    """
    root = resolve_path(checkpoint_path)
    doc = read_checkpoint_metadata(root)
    prefix = f"{subpath}/" if subpath else ""
    saved = {rec["name"][len(prefix):]: rec for rec in doc["leaves"] if rec["name"].startswith(prefix)}
    sharding_for = _sharding_lookup(shardings)

    flat, treedef = jax.tree_util.tree_flatten_with_path(template_tree)
    wanted: list[tuple[int, _ToRead]] = []
    names = []
    for i, (path, leaf) in enumerate(flat):
        if not _is_template_leaf(leaf):
            continue
        name = _leaf_name(path)
        names.append(name)
        if name not in saved:
            continue  # reported below, together with any others
        rec = saved[name]
        keypath = (subpath or "") + jax.tree_util.keystr(path)
        shape, dtype = _shape_dtype(leaf)
        if list(shape) != rec["shape"] or str(dtype) != rec["dtype"]:
            raise CheckpointMismatchError(
                f"checkpoint {root}: leaf {keypath} is {tuple(rec['shape'])} {rec['dtype']} in the "
                f"checkpoint but {shape} {dtype} in the template"
            )
        target = _target_sharding(leaf, sharding_for(name))
        wanted.append((i, _ToRead(rec, keypath, target, isinstance(leaf, np.generic))))
    missing = sorted(set(names) - set(saved))
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {root} has no entry for template leaves {_summarise([prefix + m for m in missing])} "
            "(was it saved from a different model or optimizer?)"
        )
    unexpected = sorted(set(saved) - set(names))
    if unexpected:
        raise CheckpointMismatchError(
            f"checkpoint {root} holds leaves {_summarise([prefix + u for u in unexpected])} that the template "
            "does not have"
        )

    values = _run(_read_all(root, [item for _, item in wanted]))
    leaves = [leaf for _, leaf in flat]
    for (i, _), value in zip(wanted, values):
        leaves[i] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


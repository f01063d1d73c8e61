"""Checkpoints: save a training-state pytree so that it restores bit for bit, and decide when to save.

Format. A checkpoint is a directory holding one TensorStore zarr3 array per array leaf of the pytree
(the leaf's key path, percent-encoded, is its sub-directory: ``model/layers/0/weight``,
``opt_state/0/mu/...``) and a ``metadata.json`` (step, timestamp, is_temporary, user metadata, format
version, and every leaf's path, shape and dtype). Only arrays are stored -- ``jax.Array``, numpy arrays
and numpy scalars; everything else (static fields, activation functions, Python numbers, the tree
structure itself) comes from the *template* passed to :func:`load_checkpoint`. A Python ``int`` step
in the tree is therefore *not* saved: keep the step as a jax/numpy scalar if it must round-trip (the
step is also recorded in ``metadata.json``). Typed PRNG key arrays are stored as their
``jax.random.key_data`` and rewrapped on load with the recorded implementation.

Bit-exactness. Chunks are written raw (no compression, no dtype conversion) with a crc32c codec, so a
flipped or truncated chunk fails its checksum on load instead of silently restoring garbage; chunks
equal to the fill value are stored anyway and missing chunks are read as an error rather than as
zeros, so a deleted chunk file is caught too. The trade-off is disk space: zstd would shrink
optimizer moments a little, at a CPU cost on every save.

Finite values only. :func:`save_checkpoint` first checks every floating-point leaf (an all-finite
reduction on the devices, one small transfer back) and refuses a tree holding a NaN or an infinity,
writing nothing: a poisoned state must never become the checkpoint a rerun resumes from. A full disk
raises :class:`levanter.errors.OutOfSpaceError` (exit status 74 from the command line), other storage
errors :class:`CheckpointSaveError`; either way the partial write is removed.

Multi-process. Leaves are written with ``jax.experimental.array_serialization``'s ``async_serialize``
and read with ``async_deserialize``. Each process writes only the shards it can address and only one
replica of each (``replica_id == 0``); zarr chunks are the per-device shard shape (split further only
above 2 GiB), so no two processes ever write the same chunk file. Array metadata (``zarr.json``) and
``metadata.json`` are written by process 0 only. On load each process reads only the slices its own
devices need.

Atomicity. Everything is written into ``<parent>/.tmp-<name>-<random>/``; ``metadata.json`` is written
last, and only then does process 0 rename the directory to its final name. A checkpoint directory is
complete iff it contains ``metadata.json``; ``.tmp-*`` directories are leftovers of interrupted saves
(or deletions) and are ignored by :func:`discover_latest_checkpoint` and removed by
:func:`delete_stale_temporaries`. Deleting a checkpoint renames it to a ``.tmp-`` name first, so a crash
mid-delete never leaves a half-deleted directory that still looks complete. The rename needs a POSIX
filesystem (local disk, NFS, a FUSE mount); object stores (``gs://``, ``s3://``) have no atomic
rename and are refused with a clear error.

Saving is synchronous: the caller waits for the data to reach disk. That keeps the multi-process
story simple (barriers run on the main thread) at the price of a training pause per checkpoint;
:meth:`Checkpointer.wait_until_finished` exists so that an asynchronous version can be swapped in
without changing callers.

Policy (:class:`Checkpointer`): permanent checkpoints at the steps the ``keep`` intervals name, plus a
temporary one whenever ``save_interval`` of wall time has passed since the last save. A temporary
checkpoint is deleted once a newer checkpoint is complete; permanent ones are never deleted.
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
from dataclasses import dataclass, field
from typing import Any, Optional

import draccus
import jax
import numpy as np
import tensorstore as ts
from draccus.utils import DecodingError
from jax.experimental.array_serialization import serialization as jax_serialization

from levanter.errors import is_out_of_space, out_of_space_error
from levanter.utils.fault import fault_point
from levanter.utils.fs import atomic_write_bytes, fsync_dir, remove_stale_temporaries

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "METADATA_FILENAME",
    "CheckpointInterval",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "Checkpointer",
    "CheckpointerConfig",
    "CorruptCheckpointError",
    "delete_stale_temporaries",
    "discover_latest_checkpoint",
    "load_checkpoint",
    "parse_timedelta",
    "read_checkpoint_metadata",
    "save_checkpoint",
    "unreadable_checkpoints",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION = 1
METADATA_FILENAME = "metadata.json"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Largest chunk file; shards above this are split so that a single file stays manageable.
_MAX_CHUNK_BYTES = 2 * 1024**3
# Host memory one process may hold for reads in flight while loading (a soft cap, see _ByteLimiter).
_READ_BYTES_IN_FLIGHT = 16 * 1024**3

Barrier = Callable[[str], None]


class CorruptCheckpointError(ValueError):
    """A checkpoint directory exists but cannot be restored (incomplete, truncated, missing files)."""


class CheckpointMismatchError(ValueError):
    """The checkpoint is intact but does not fit the template (leaf set, shape or dtype differ)."""


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (non-finite values, permissions, I/O error); nothing was committed."""


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
# Paths and small filesystem helpers
# ---------------------------------------------------------------------------------------------------


def _local_path(path: str | os.PathLike, what: str = "checkpoint path") -> str:
    path = os.fspath(path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    elif "://" in path:
        raise ValueError(
            f"{what} {path!r}: only POSIX filesystem paths are supported (checkpoints are committed by an "
            "atomic directory rename, which object stores such as gs:// and s3:// do not have). Use a local "
            "or mounted path."
        )
    return os.path.abspath(path)


def _atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode())


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILENAME))


def _remove_dir(path: str) -> None:
    """Delete a directory so that a crash part-way never leaves something that looks complete."""
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f"{TMP_PREFIX}delete-{name}-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    fsync_dir(parent)
    shutil.rmtree(doomed)


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


def _write_spec(directory: str, shape: Sequence[int], dtype: Any, chunk: Sequence[int]) -> dict:
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": directory},
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
        "kvstore": {"driver": "file", "path": directory},
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


async def _write_leaf(root: str, item: _ToWrite) -> None:
    directory = os.path.join(root, item.record["name"])
    value = item.value
    multi = jax.process_count() > 1
    if isinstance(value, jax.Array) and not (multi and value.is_fully_addressable):
        shard_shape = value.sharding.shard_shape(value.shape)
        chunk = _chunk_shape(shard_shape, value.dtype.itemsize)
        spec = _write_spec(directory, value.shape, value.dtype, chunk)
        # primary_host=0: only process 0 creates zarr.json; every process writes its own replica-0 shards.
        await jax_serialization.async_serialize(value, spec, primary_host=0)
        return
    # A host value (numpy leaf, or a process-local jax array in a multi-process job): each process
    # may hold its own copy, so process 0's is the one written.
    if jax.process_index() != 0:
        return
    host = np.asarray(value)
    spec = _write_spec(directory, host.shape, host.dtype, _chunk_shape(host.shape, host.dtype.itemsize))
    store = await ts.open(spec, create=True, open=True)
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


async def _write_all(root: str, items: list[_ToWrite]) -> None:
    tasks = [asyncio.ensure_future(_write_leaf(root, it)) for it in items]
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


def _io_error_text(e: BaseException) -> Optional[str]:
    """A one-line description of a storage error, or None if ``e`` is not one."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if isinstance(e, ValueError) and ("[OS error" in str(e) or "os_error_code=" in str(e)):  # tensorstore I/O
        text = _TS_NOISE.sub("", str(e).splitlines()[0])
        return text if len(text) <= 300 else text[:297] + "..."
    return None


def save_checkpoint(
    tree: Any,
    step: int,
    checkpoint_path: str,
    *,
    metadata: dict | None = None,
    is_temporary: bool = False,
    barrier: Barrier | None = None,
) -> str:
    """Write the arrays of ``tree`` to ``checkpoint_path`` atomically; returns the absolute path.

    ``step`` is recorded in ``metadata.json`` (conventionally: the number of completed updates).
    ``metadata`` is extra JSON-serialisable information stored alongside. ``barrier(name)`` must block
    until every process has called it with the same name; pass
    ``jax.experimental.multihost_utils.sync_global_devices`` in multi-process jobs (every process must
    call ``save_checkpoint`` with the same arguments). Raises ``FileExistsError`` if a complete
    checkpoint is already at ``checkpoint_path`` (an incomplete directory there is replaced).
    """
    barrier = barrier or _no_barrier
    final = _local_path(checkpoint_path)
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
    if _is_complete(final):
        raise FileExistsError(f"a complete checkpoint already exists at {final}")

    items = _prepare_leaves(tree)
    bad = _non_finite_leaves(items)
    if bad:
        raise CheckpointSaveError(
            f"not saving the checkpoint of step {step} to {final}: {_summarise(bad, 3)} "
            f"{'holds' if len(bad) == 1 else 'hold'} NaN or infinite values. Nothing was written; the latest "
            "complete checkpoint is unchanged. Resume from it with a fixed config (learning rate, epsilon)."
        )
    parent, name = os.path.split(final)
    token = _shared_token()
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{token}")
    is_leader = jax.process_index() == 0
    started = time.perf_counter()
    try:
        if is_leader:
            os.makedirs(tmp, exist_ok=True)
        _run(_write_all(tmp, items))
        barrier(f"levanter_checkpoint_written_{name}_{token}")
        if is_leader:
            doc = {
                "format_version": CHECKPOINT_FORMAT_VERSION,
                "step": step,
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "is_temporary": bool(is_temporary),
                "metadata": user_metadata,
                "leaves": [it.record for it in items],
            }
            _atomic_write_json(os.path.join(tmp, METADATA_FILENAME), doc)
            fault_point("checkpoint_before_rename")
            if os.path.lexists(final):
                # Not complete (checked above): debris from something other than save_checkpoint.
                logger.warning("replacing incomplete directory %s (no %s)", final, METADATA_FILENAME)
                _remove_dir(final)
            os.rename(tmp, final)
            fsync_dir(parent)
    except BaseException as e:
        if is_leader:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and is_out_of_space(e):
            raise out_of_space_error(f"saving the checkpoint of step {step}", final) from e
        what = _io_error_text(e) if isinstance(e, Exception) else None
        if what is not None:
            raise CheckpointSaveError(
                f"could not save the checkpoint of step {step} to {final}: {what}. Nothing was committed "
                f"(the partial write was removed); free space or fix {parent}, then rerun to resume from "
                "the latest complete checkpoint."
            ) from e
        raise
    barrier(f"levanter_checkpoint_committed_{name}_{token}")
    logger.info(
        "saved checkpoint for step %d to %s (%d arrays, %.2fs)",
        step,
        final,
        len(items),
        time.perf_counter() - started,
    )
    return final


# ---------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------


def read_checkpoint_metadata(checkpoint_path: str) -> dict:
    """The parsed ``metadata.json`` of a checkpoint (validated). Raises if absent or malformed."""
    path = _local_path(checkpoint_path)
    meta_path = os.path.join(path, METADATA_FILENAME)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path}")

    def fail(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {path} is corrupt or incomplete: {why}")

    try:
        with open(meta_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise fail(f"no {METADATA_FILENAME} (the save was interrupted before it committed)") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"{METADATA_FILENAME} is not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise fail(f"{METADATA_FILENAME} is not a JSON object")
    version = doc.get("format_version")
    if version != CHECKPOINT_FORMAT_VERSION:
        raise fail(f"format_version {version!r} is not the supported version {CHECKPOINT_FORMAT_VERSION}")
    for key, typ in (("step", int), ("is_temporary", bool), ("leaves", list), ("metadata", dict)):
        if not isinstance(doc.get(key), typ):
            raise fail(f"{METADATA_FILENAME} field {key!r} is missing or not a {typ.__name__}")
    for rec in doc["leaves"]:
        if not (
            isinstance(rec, dict)
            and isinstance(rec.get("name"), str)
            and all(isinstance(rec.get(k), list) for k in ("shape", "stored_shape"))
            and all(isinstance(rec.get(k), str) for k in ("dtype", "stored_dtype"))
        ):
            raise fail(f"malformed leaf entry {rec!r} in {METADATA_FILENAME}")
    return doc


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
    directory = os.path.join(root, rec["name"])

    def fail(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {root}: leaf {item.keypath} ({rec['name']}) {why}")

    if not os.path.isfile(os.path.join(directory, "zarr.json")):
        raise fail(f"is missing: there is no array at {directory}")
    spec = _read_spec(directory)
    try:
        store = await ts.open(spec, open=True)
    except ValueError as e:
        raise fail(f"cannot be opened: {e}") from e
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
                item.sharding, spec, global_shape=stored_shape, dtype=stored_dtype, byte_limiter=limiter
            )
        ndim = len(rec["shape"])
        data_sharding = _key_data_sharding(item.sharding, ndim, len(stored_shape) - ndim)
        if data_sharding is None:  # an exotic sharding: load on one device, then move the keys
            data_sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        data = await jax_serialization.async_deserialize(
            data_sharding, spec, global_shape=stored_shape, dtype=stored_dtype, byte_limiter=limiter
        )
        keys = jax.random.wrap_key_data(data, impl=key_impl)
        if keys.sharding != item.sharding:
            keys = jax.device_put(keys, item.sharding)
        return keys
    except ValueError as e:  # tensorstore reports DATA_LOSS / NOT_FOUND chunk errors as ValueError
        raise fail(f"cannot be read (truncated or damaged chunk?): {e}") from e


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


def load_checkpoint(template_tree: Any, checkpoint_path: str, *, shardings: Any = None) -> Any:
    """Restore a checkpoint into the structure of ``template_tree``.

    Array leaves of the template (``jax.Array``, numpy arrays/scalars, ``jax.ShapeDtypeStruct``) are
    replaced by the saved values; every other leaf and the tree structure are the template's. Each
    restored ``jax.Array`` gets the template leaf's sharding (a ``ShapeDtypeStruct`` without one: the
    first local device), unless ``shardings`` -- one ``Sharding`` for all leaves, or a pytree shaped
    like the template with ``Sharding`` leaves -- says otherwise. Numpy template leaves come back as
    numpy. Shapes and dtypes must match the template exactly (:class:`CheckpointMismatchError`);
    missing, truncated or damaged files raise :class:`CorruptCheckpointError`.
    """
    root = _local_path(checkpoint_path)
    doc = read_checkpoint_metadata(root)
    saved = {rec["name"]: rec for rec in doc["leaves"]}
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
        keypath = jax.tree_util.keystr(path)
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
            f"checkpoint {root} has no entry for template leaves {_summarise(missing)} (was it saved from a "
            "different model or optimizer?)"
        )
    unexpected = sorted(set(saved) - set(names))
    if unexpected:
        raise CheckpointMismatchError(
            f"checkpoint {root} holds leaves {_summarise(unexpected)} that the template does not have"
        )

    values = _run(_read_all(root, [item for _, item in wanted]))
    leaves = [leaf for _, leaf in flat]
    for (i, _), value in zip(wanted, values):
        leaves[i] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ---------------------------------------------------------------------------------------------------
# Discovery and cleanup
# ---------------------------------------------------------------------------------------------------


def _step_dirs(base: str) -> list[tuple[int, str]]:
    try:
        entries = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for entry in entries:
        m = _STEP_DIR.match(entry)
        path = os.path.join(base, entry)
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path))
    return sorted(out)


def discover_latest_checkpoint(base_path: str) -> str | None:
    """The complete ``step-N`` checkpoint with the highest N under ``base_path``, or None.

    ``.tmp-*`` directories are skipped silently; ``step-N`` directories without ``metadata.json`` are
    skipped with a warning. If ``base_path`` is itself a complete checkpoint it is returned.
    """
    base = _local_path(base_path, "checkpoint base path")
    if _is_complete(base):
        return base
    best = None
    for step, path in _step_dirs(base):
        if _is_complete(path):
            best = path
        else:
            logger.warning("ignoring incomplete checkpoint %s (no %s)", path, METADATA_FILENAME)
    return best


def unreadable_checkpoints(base_path: str) -> list[str]:
    """The ``step-N`` directories under ``base_path`` that hold files but no ``metadata.json``.

    A save never leaves one (it writes into a ``.tmp-`` directory and renames it when complete, and a
    deletion renames it to a ``.tmp-`` name first), so such a directory is a checkpoint damaged after
    it was committed: its arrays may be intact, and a run that ignored it would overwrite them.
    """
    base = _local_path(base_path, "checkpoint base path")
    out = []
    for _, path in _step_dirs(base):
        if not _is_complete(path):
            try:
                if os.listdir(path):
                    out.append(path)
            except OSError:
                out.append(path)
    return out


def delete_stale_temporaries(base_path: str) -> list[str]:
    """Remove ``.tmp-*`` directories (interrupted saves or deletions) under ``base_path``.

    Only safe while nothing is saving into ``base_path``: call it at startup, from one process.
    """
    base = _local_path(base_path, "checkpoint base path")
    try:
        entries = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for entry in sorted(entries):
        path = os.path.join(base, entry)
        if entry.startswith(TMP_PREFIX) and os.path.isdir(path) and not os.path.islink(path):
            logger.info("removing leftover temporary checkpoint directory %s", path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------------------
# Configuration: durations
# ---------------------------------------------------------------------------------------------------

_UNITS = {
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hrs": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_timedelta(value: Any) -> datetime.timedelta:
    """A duration from a config value: ``"15m"``, ``"30s"``, ``"1h"``, ``"2d"``, ``"10min"``, ``"1h30m"``,
    or a plain number (seconds). Raises ValueError for anything else, or a negative duration."""
    if isinstance(value, datetime.timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as '15m' or '30s', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"a duration must be a non-negative number of seconds, got {value!r}")
        return datetime.timedelta(seconds=value)
    if isinstance(value, str):
        text = value.strip()
        seconds, pos = 0.0, 0
        while pos < len(text):
            m = _DURATION_PART.match(text, pos)
            if m is None or m.end() == pos or m.group(2).lower() not in _UNITS:
                break
            if m.group(2) == "" and m.end() != len(text):
                break  # a unit-less number is only allowed alone or last ("1h 30" is not a duration)
            seconds += float(m.group(1)) * _UNITS[m.group(2).lower()]
            pos = m.end()
        else:
            if text:
                return datetime.timedelta(seconds=seconds)
    raise ValueError(
        f"cannot parse {value!r} as a duration: use a number of seconds or a number with a unit "
        "(s, m/min, h, d), e.g. '30s', '15m', '1h', '1h30m'"
    )


def _format_timedelta(td: datetime.timedelta) -> str:
    seconds = td.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _decode_timedelta(raw_value: Any, path: Sequence[str] = ()) -> datetime.timedelta:
    try:
        return parse_timedelta(raw_value)
    except ValueError as e:
        raise DecodingError(path, str(e)) from None


draccus.decode.register(datetime.timedelta, _decode_timedelta)
draccus.encode.register(datetime.timedelta, lambda td, *_: _format_timedelta(td))


# ---------------------------------------------------------------------------------------------------
# Configuration and policy
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInterval:
    """Keep a permanent checkpoint every ``every`` steps, for steps below ``until`` (None: forever).

    Intervals apply in order: interval ``i`` covers steps from the previous interval's ``until`` up to
    its own ``until``.
    """

    every: int
    until: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"trainer.checkpointer.keep: every must be a positive int, got {self.every!r}")
        if self.until is not None and (isinstance(self.until, bool) or not isinstance(self.until, int)):
            raise ValueError(f"trainer.checkpointer.keep: until must be an int or null, got {self.until!r}")


def _validate_keep(keep: Sequence[CheckpointInterval]) -> list[CheckpointInterval]:
    keep = list(keep)
    previous = 0
    for i, iv in enumerate(keep):
        if iv.until is None:
            if i != len(keep) - 1:
                raise ValueError(
                    "trainer.checkpointer.keep: only the last interval may have until: null "
                    f"(interval {i} of {len(keep)} has none)"
                )
        elif iv.until <= previous:
            raise ValueError(
                f"trainer.checkpointer.keep: until values must increase (interval {i} has until={iv.until} "
                f"after {previous})"
            )
        else:
            previous = iv.until
    return keep


def _is_permanent_step(keep: Sequence[CheckpointInterval], step: int) -> bool:
    if step <= 0:
        return False  # the initial state is reproducible from the config; never worth a checkpoint
    for iv in keep:
        if iv.until is None or step < iv.until:
            return step % iv.every == 0
    return False


@dataclass
class CheckpointerConfig:
    """``trainer.checkpointer`` in the config (upstream Levanter's field names)."""

    base_path: str = "checkpoints/"
    save_interval: datetime.timedelta = datetime.timedelta(minutes=15)
    """Wall time between temporary checkpoints (YAML: ``15m``, ``30s``, ``1h``, or seconds)."""
    keep: list[CheckpointInterval] = field(default_factory=lambda: [CheckpointInterval(every=10000)])
    """Which steps get permanent checkpoints."""
    append_run_id_to_base_path: bool = True
    delete_old_temp_checkpoints: bool = True
    """On startup, schedule temporary checkpoints left by earlier attempts of this run for deletion
    (they are deleted once a newer checkpoint is complete)."""

    def __post_init__(self):
        self.save_interval = parse_timedelta(self.save_interval)
        if self.save_interval.total_seconds() <= 0:
            raise ValueError(f"trainer.checkpointer.save_interval must be positive, got {self.save_interval}")
        self.keep = _validate_keep(self.keep)

    def expanded_path(self, run_id: str) -> str:
        """Where this run's checkpoints go: ``<base_path>/<run_id>`` (or ``base_path`` alone)."""
        if self.append_run_id_to_base_path:
            return os.path.join(self.base_path, run_id)
        return self.base_path

    def validate_writable(self, run_id: str) -> str:
        """Create the run's checkpoint directory and write/delete a probe file there; returns the path.

        Meant to run before training starts, so a bad path fails in seconds, not at the first save.
        """
        local = _local_path(self.expanded_path(run_id), "trainer.checkpointer.base_path")
        probe = os.path.join(local, f".write-probe-{secrets.token_hex(4)}")
        try:
            os.makedirs(local, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.unlink(probe)
        except OSError as e:
            raise ValueError(
                f"trainer.checkpointer.base_path={self.base_path!r}: cannot write checkpoints to {local} "
                f"({e.strerror or e}). Choose a writable directory."
            ) from None
        return local

    def create(
        self,
        run_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        barrier: Barrier | None = None,
        metadata: dict | None = None,
    ) -> "Checkpointer":
        return Checkpointer(
            self.expanded_path(run_id),
            save_interval=self.save_interval,
            keep=self.keep,
            delete_old_temp_checkpoints=self.delete_old_temp_checkpoints,
            clock=clock,
            barrier=barrier,
            metadata=metadata,
        )


class Checkpointer:
    """Decides when to save and cleans up temporary checkpoints. Every process must call it alike.

    ``clock`` returns seconds (monotonic); tests inject a fake one. ``barrier`` is passed to
    :func:`save_checkpoint` (``multihost_utils.sync_global_devices`` in multi-process jobs). In a
    multi-process job the time-based decision is taken by process 0 and broadcast, since host clocks
    disagree and every process must join the same saves.
    """

    def __init__(
        self,
        base_path: str,
        *,
        save_interval: datetime.timedelta | None = datetime.timedelta(minutes=15),
        keep: Sequence[CheckpointInterval] = (CheckpointInterval(every=10000),),
        delete_old_temp_checkpoints: bool = True,
        clock: Callable[[], float] = time.monotonic,
        barrier: Barrier | None = None,
        metadata: dict | None = None,
    ):
        self.base_path = _local_path(base_path, "trainer.checkpointer.base_path")
        # Stored in every checkpoint's metadata.json (e.g. the data-schedule record checked on resume).
        self.metadata = dict(metadata or {})
        self.save_interval = save_interval
        self.keep = _validate_keep(keep)
        self._clock = clock
        self._barrier = barrier
        self._last_save_time = clock()
        self._last_saved_step: int | None = None
        # Temporary checkpoints to delete once a newer checkpoint is complete.
        self._retire: list[str] = []
        if jax.process_index() == 0:
            delete_stale_temporaries(self.base_path)
            for _, path in _step_dirs(self.base_path):
                # A kill inside _make_permanent's metadata rewrite leaves a temporary file in the checkpoint.
                remove_stale_temporaries(path, METADATA_FILENAME)
        if delete_old_temp_checkpoints:
            for _, path in _step_dirs(self.base_path):
                if _is_complete(path) and self._is_temporary(path):
                    self._retire.append(path)

    # -- queries -------------------------------------------------------------------------------------
    def path_for_step(self, step: int) -> str:
        return os.path.join(self.base_path, f"step-{int(step)}")

    def latest_checkpoint(self) -> str | None:
        return discover_latest_checkpoint(self.base_path)

    @staticmethod
    def _is_temporary(path: str) -> bool:
        try:
            return bool(read_checkpoint_metadata(path)["is_temporary"])
        except (OSError, ValueError):
            return False  # unreadable: not ours to delete

    # -- policy --------------------------------------------------------------------------------------
    def _agree(self, flag: bool) -> bool:
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))

    def on_step(self, tree: Any, step: int, *, force: bool = False) -> bool:
        """Save ``tree`` (the state after ``step`` updates) if the policy says so; True if saved.

        Permanent at the ``keep`` steps and when ``force`` is set; temporary when ``save_interval`` has
        passed since the last save. A step already saved is not saved again.
        """
        step = int(step)
        permanent = force or _is_permanent_step(self.keep, step)
        if step == self._last_saved_step:
            if permanent:
                self._make_permanent(self.path_for_step(step))
            return False
        due = False
        if not permanent and self.save_interval is not None:
            due = self._clock() - self._last_save_time >= self.save_interval.total_seconds()
            due = self._agree(due)
        if not (permanent or due):
            return False
        self.save(tree, step, is_temporary=not permanent)
        return True

    def save(self, tree: Any, step: int, *, is_temporary: bool = False) -> str:
        """Save now, then delete the temporary checkpoints this one supersedes."""
        path = self.path_for_step(step)
        if _is_complete(path):
            # Typically the checkpoint this attempt resumed from. Rewriting it would change nothing.
            logger.info("checkpoint %s already exists; not saving step %d again", path, step)
            if path in self._retire:
                self._retire.remove(path)
            if not is_temporary:
                self._make_permanent(path)
            is_temporary = self._is_temporary(path)
        else:
            save_checkpoint(tree, step, path, is_temporary=is_temporary, barrier=self._barrier, metadata=self.metadata)
        self._last_save_time = self._clock()
        self._last_saved_step = step
        if jax.process_index() == 0:
            for old in self._retire:
                if old != path and os.path.isdir(old):
                    logger.info("deleting superseded temporary checkpoint %s", old)
                    _remove_dir(old)
        self._retire = [path] if is_temporary else []
        return path

    def _make_permanent(self, path: str) -> None:
        if path in self._retire:
            self._retire.remove(path)
        if jax.process_index() != 0 or not self._is_temporary(path):
            return
        doc = read_checkpoint_metadata(path)
        doc["is_temporary"] = False
        try:
            _atomic_write_json(os.path.join(path, METADATA_FILENAME), doc)
        except OSError as e:  # the old metadata.json is intact: the checkpoint stays a temporary one
            if is_out_of_space(e):
                raise out_of_space_error("marking the checkpoint permanent", path) from e
            raise CheckpointSaveError(f"could not mark the checkpoint {path} permanent: {e.strerror or e}") from e

    def wait_until_finished(self) -> None:
        """Block until pending saves are on disk. Saves are synchronous, so there is nothing to wait for."""
        return None

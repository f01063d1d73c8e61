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
a read-only filesystem :class:`levanter.errors.ReadOnlyStorageError` naming the directory (74 as well), other
storage errors (after the retries, for transient ones) :class:`CheckpointSaveError` naming the path or URL
(never credentials); either way the partial write is removed (where the storage still allows it).

Multi-process. Leaves are written with ``jax.experimental.array_serialization``'s ``async_serialize``
and read with ``async_deserialize``. Each process writes only the shards it can address and only one
replica of each (``replica_id == 0``); zarr chunks are the per-device shard shape (split further only
above 2 GiB), so no two processes ever write the same chunk file. Array metadata (``zarr.json``) and
``metadata.json`` are written by process 0 only, which then commits the save (renaming its temporary
directory, or writing ``metadata.json`` under the final prefix) once every process has written its
shards. On an object store process 0 first removes what an earlier, uncommitted save of the same step
left, and the others do not write before that is done. The processes agree on these moments through
``barrier`` (a synchronous save: device barriers on the training thread) or, for a background save,
through the runtime's key-value store (``store``; :class:`_KeyValueSync`): every process records that
its shards are written or why not, process 0 commits only if all say written and records the outcome,
which the others wait for. The caller hands in its process index (``process_index``, by default
``jax.process_index()``). On load each process reads only the slices its own devices need.

:func:`save_checkpoint` is synchronous: the caller waits for the data to reach storage. It is
:func:`prepare_save` (checks and collectives, on the calling thread) followed by
:meth:`PreparedSave.commit`; :class:`~levanter.checkpoint.Checkpointer` runs the commit in the background
after :meth:`PreparedSave.snapshot` (:mod:`levanter.checkpoint.async_writer`).

This module is the save side. What save and load share (leaf names, array specs and chunking, running the
asynchronous I/O, storage error text) is :mod:`levanter.checkpoint.tree_format`; the load side is
:mod:`levanter.checkpoint.restore`.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import operator
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.experimental.array_serialization import serialization as jax_serialization

from levanter.checkpoint.errors import CheckpointSaveError
from levanter.checkpoint.host_copy import HostShards, device_snapshot, host_copies, write_host_shards
from levanter.checkpoint.layout import (
    CHECKPOINT_FORMAT_VERSION,
    METADATA_FILENAME,
    TMP_PREFIX,
    atomic_write_json,
    commits_by_rename,
    is_complete,
    remove_dir,
    resolve_path,
)
from levanter.checkpoint.tree_format import (
    chunk_shape,
    finish_all,
    io_error_text,
    is_key_dtype,
    is_stored_leaf,
    leaf_name,
    run_coroutine,
    shape_dtype,
    summarise,
    ts_context,
    write_spec,
)
from levanter.distributed import KeyValueStore
from levanter.errors import (
    OutOfSpaceError,
    ReadOnlyStorageError,
    is_out_of_space,
    is_read_only_storage,
    out_of_space_error,
    read_only_storage_error,
)
from levanter.utils import fs
from levanter.utils.fault import fault_point

__all__ = ["Barrier", "PreparedSave", "prepare_save", "save_checkpoint",
           "write_leaf"]

logger = logging.getLogger(__name__)

Barrier = Callable[[str], None]


def _no_barrier(name: str) -> None:
    return None


def _shared_token() -> str:
    """A random token, the same on every process (the temporary directory name must agree)."""
    value = secrets.randbits(31)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        value = int(multihost_utils.broadcast_one_to_all(np.int32(value)))
    return f"{value:08x}"


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
        if not is_stored_leaf(leaf):
            continue
        name = leaf_name(path)
        if name in seen:  # cannot happen with injective names; a guard against silent overwrites
            raise ValueError(f"two leaves map to the same checkpoint entry {name!r}")
        seen.add(name)
        shape, dtype = shape_dtype(leaf)
        record: dict[str, Any] = {
            "name": name,
            "keypath": jax.tree_util.keystr(path),
            "shape": list(shape),
            "dtype": str(dtype),
            "kind": "numpy" if not isinstance(leaf, jax.Array) else "jax",
        }
        value = leaf
        if isinstance(leaf, jax.Array) and is_key_dtype(dtype):
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
    context = ts_context(root)
    value = item.value
    multi = jax.process_count() > 1
    if isinstance(value, HostShards):  # a device array copied to the host before a background save
        chunk = chunk_shape(value.shard_shape, value.dtype.itemsize)
        spec = write_spec(directory, value.shape, value.dtype, chunk)
        await write_host_shards(value, spec, context, creates_metadata=jax.process_index() == 0)
        return
    if isinstance(value, jax.Array) and not (multi and value.is_fully_addressable):
        shard_shape = value.sharding.shard_shape(value.shape)
        chunk = chunk_shape(shard_shape, value.dtype.itemsize)
        spec = write_spec(directory, value.shape, value.dtype, chunk)
        # primary_host=0: only process 0 creates zarr.json; every process writes its own replica-0 shards.
        await jax_serialization.async_serialize(value, spec, primary_host=0, context=context)
        return
    # A host value (numpy leaf, or a process-local jax array in a multi-process job): each process
    # may hold its own copy, so process 0's is the one written.
    if process_index != 0:
        return
    host = np.asarray(value)
    spec = write_spec(directory, host.shape, host.dtype, chunk_shape(host.shape, host.dtype.itemsize))
    store = await ts.open(spec, create=True, open=True, context=context)
    await store.write(host)


async def _write_all(root: str, items: list[_ToWrite], process_index: int) -> None:
    tasks = [asyncio.ensure_future(write_leaf(root, it, process_index)) for it in items]
    try:
        for i, done in enumerate(asyncio.as_completed(tasks)):
            await done
            if i < len(tasks) - 1:
                fault_point("checkpoint_mid_write")
    except Exception:
        await finish_all(tasks)  # let the other writes settle, then report this failure
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


def _metadata_doc(step: int, is_temporary: bool, user_metadata: dict, items: list[_ToWrite]) -> dict:
    return {
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "step": step,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "is_temporary": bool(is_temporary),
        "metadata": user_metadata,
        "leaves": [it.record for it in items],
    }


class _BarrierSync:
    """Multi-process agreement of a save through ``barrier`` (a device collective in a synchronous save,
    on the training thread; nothing in a single-process save)."""

    def __init__(self, barrier: Barrier, name: str, token: str):
        self.barrier, self.name, self.token = barrier, name, token

    def cleared(self, error: Exception | None) -> None:
        if error is not None:
            raise error
        self.barrier(f"levanter_checkpoint_cleared_{self.name}_{self.token}")

    def written(self, error: Exception | None) -> None:
        if error is not None:
            raise error
        self.barrier(f"levanter_checkpoint_written_{self.name}_{self.token}")

    def failed(self, error: BaseException) -> None:
        pass

    def committed(self) -> None:
        self.barrier(f"levanter_checkpoint_committed_{self.name}_{self.token}")


# What a failed save's record says about the error, so that every process raises the same kind of error.
_KINDS = {"no-space": OutOfSpaceError, "read-only": ReadOnlyStorageError}


class _KeyValueSync:
    """Multi-process agreement of a background save through the runtime's key-value store, from the writer
    threads (:mod:`levanter.checkpoint.async_writer`), never a device collective.

    Every process but 0 records under ``<prefix>written/<process>`` that its shards are written (an empty
    value) or why they are not; process 0 reads every record before it commits, and commits only if all
    of them are empty and its own write succeeded. It then records the outcome under
    ``<prefix>committed``, which the other processes wait for: a save is finished on every process only
    once it is committed (or known to have failed, each process raising the error). A process killed
    mid-write never records anything, so process 0 never commits that save: the previous checkpoint stays
    the latest.
    """

    def __init__(self, store: KeyValueStore, name: str, token: str, process_index: int, timeout_s: float):
        self.store, self.process_index, self.timeout_s = store, process_index, timeout_s
        self.prefix = f"levanter/checkpoint/{name}/{token}/"

    def cleared(self, error: Exception | None) -> None:
        """Object stores: process 0 has removed an earlier uncommitted save of the step (or failed to)."""
        key = f"{self.prefix}cleared"
        if self.process_index == 0:
            self.store.set(key, "" if error is None else (io_error_text(error) or str(error) or "failed"))
            if error is not None:
                raise error
            return
        why = self.store.get(key, self.timeout_s)
        if why:
            raise CheckpointSaveError(f"process 0 could not clear the way for the save ({why})")

    def written(self, error: Exception | None) -> None:
        if self.process_index != 0:
            why = "" if error is None else (io_error_text(error) or f"{type(error).__name__}: {error}" or "failed")
            self.store.set(f"{self.prefix}written/{self.process_index}", why)
            if error is not None:
                raise error
            return
        failures = []
        for p in range(1, jax.process_count()):  # every process has stopped writing into the save by now
            why = self.store.get(f"{self.prefix}written/{p}", self.timeout_s)
            if why:
                failures.append(f"process {p}: {why}")
        if error is not None:
            raise error
        if failures:
            raise CheckpointSaveError(f"{len(failures)} of {jax.process_count()} processes could not write "
                                      f"their shards ({'; '.join(failures)})")

    def failed(self, error: BaseException) -> None:
        if self.process_index != 0:
            return
        kind = next((k for k, t in _KINDS.items() if isinstance(error, t)), "error")
        try:
            self.store.set(f"{self.prefix}committed", f"{kind}:{str(error) or type(error).__name__}")
        except Exception as e:  # noqa: BLE001 -- the save's own error is the one to raise
            logger.warning("could not tell the other processes that the save failed: %s", e)

    def committed(self) -> None:
        if self.process_index == 0:
            self.store.set(f"{self.prefix}committed", "")
            return
        outcome = self.store.get(f"{self.prefix}committed", self.timeout_s)
        if outcome:
            kind, _, message = outcome.partition(":")
            raise _KINDS.get(kind, CheckpointSaveError)(message)


def _write_then_agree(root: str, items: list[_ToWrite], process_index: int, sync) -> None:
    """Write this process's part under ``root``, then report it (``sync.written``), whether it failed or not:
    process 0 learns of every failure before it cleans up or commits."""
    error = None
    try:
        run_coroutine(_write_all(root, items, process_index))
    except Exception as e:  # noqa: BLE001 -- reported to process 0, then raised
        error = e
    sync.written(error)


def _commit_by_rename(final: str, items: list[_ToWrite], doc: Callable[[], dict], sync, token: str,
                      process_index: int) -> None:
    """POSIX storage: write into ``.tmp-<name>-<token>``, then rename it to ``final``."""
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{token}")
    is_leader = process_index == 0
    try:
        if is_leader:
            os.makedirs(tmp, exist_ok=True)
        _write_then_agree(tmp, items, process_index, sync)
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


def _commit_by_record(final: str, items: list[_ToWrite], doc: Callable[[], dict], sync, token: str,
                      process_index: int) -> None:
    """Object stores: write the arrays under ``final`` itself, then ``metadata.json`` (the commit record)."""
    is_leader = process_index == 0
    try:
        error = None
        if is_leader:
            try:
                _clear_uncommitted(final)
            except Exception as e:  # noqa: BLE001 -- told to the others, then raised
                error = e
        sync.cleared(error)  # no process writes before what an earlier save left is gone
        _write_then_agree(final, items, process_index, sync)
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


def _clear_uncommitted(final: str) -> None:
    """Object stores: remove an earlier save of this step that never committed (its chunks would mix with
    this save's). Process 0 only, before the others may write."""
    if commits_by_rename(final) or not fs.retry_transient(fs.isdir, final, what=f"looking for {final}"):
        return
    logger.warning("removing the uncommitted save %s (no %s) before saving again", final, METADATA_FILENAME)
    fs.retry_transient(fs.remove_tree, final, what=f"deleting {final}")


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
    store: KeyValueStore | None = None,
    store_timeout_s: float = 3600.0,
) -> "PreparedSave":
    """The checks of :func:`save_checkpoint` (same arguments and errors), writing nothing: returns the
    save, whose :meth:`PreparedSave.commit` writes it. Every collective a save needs besides ``barrier``
    (the finite check, the shared token) runs here, on the calling thread.

    ``store`` (a multi-process background save): the processes agree on the commit through this key-value
    store instead of ``barrier`` (:class:`_KeyValueSync`), so that :meth:`PreparedSave.commit` may run on
    any thread; ``store_timeout_s`` bounds each wait for another process's record."""
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
            f"not saving the checkpoint of step {step} to {final}: {summarise(bad, 3)} "
            f"{'holds' if len(bad) == 1 else 'hold'} NaN or infinite values. Nothing was written; the latest "
            "complete checkpoint is unchanged. Resume from it with a fixed config (learning rate, epsilon)."
        )
    token = _shared_token()
    name = fs.basename(final)
    if store is not None and jax.process_count() > 1:
        sync = _KeyValueSync(store, name, token, process_index, store_timeout_s)
    else:
        sync = _BarrierSync(barrier or _no_barrier, name, token)
    return PreparedSave(final, step, items, is_temporary, user_metadata, sync, token, process_index)


def _save_error(e: Exception, step: int, final: str) -> Exception:
    """The error to raise for a save of ``step`` to ``final`` that failed with ``e`` (``e`` itself if it is
    none of the storage errors the save names)."""
    if is_out_of_space(e):
        return out_of_space_error(f"saving the checkpoint of step {step}", final)
    if is_read_only_storage(e):
        return read_only_storage_error(f"saving the checkpoint of step {step}", final, fs.parent(final))
    what = io_error_text(e) if not isinstance(e, CheckpointSaveError) else str(e)
    if what is None:
        return e
    return CheckpointSaveError(
        f"could not save the checkpoint of step {step} to {final}: {what}. Nothing was committed (the partial "
        f"write was removed); free space or fix {fs.parent(final)}, then rerun to resume from the latest "
        "complete checkpoint."
    )


@dataclass
class PreparedSave:
    """A checked save, not yet written (:func:`prepare_save`)."""

    path: str
    step: int
    items: list[_ToWrite]
    is_temporary: bool
    user_metadata: dict
    sync: Any  # _BarrierSync or _KeyValueSync: how the processes agree that every part is written
    token: str
    process_index: int
    # The values to write are a device snapshot this save owns (snapshot): copied to host memory, then freed.
    on_device: bool = False

    def snapshot(self) -> str:
        """Make the save independent of the tree's buffers, so that the caller may donate or change them
        before :meth:`commit`: a copy on the devices where they have room (dispatched, not waited for;
        :meth:`commit` or :meth:`copy_to_host` moves it to host memory), else the host copy, waited for.
        Returns ``"device"`` or ``"host"`` (see :mod:`levanter.checkpoint.host_copy`)."""
        values = device_snapshot([it.value for it in self.items])
        if values is None:
            self.copy_to_host()
            return "host"
        for it, value in zip(self.items, values):
            it.value = value
        self.on_device = True
        return "device"

    def copy_to_host(self) -> int:
        """Replace the arrays to write by host copies (:mod:`levanter.checkpoint.host_copy`), so that the
        caller may donate or change the tree's buffers before :meth:`commit`; returns the bytes copied. A
        device snapshot (:meth:`snapshot`) is deleted once copied, freeing its device memory."""
        owned, self.on_device = self.on_device, False
        old = [it.value for it in self.items]
        values = host_copies(old, private=not owned)
        for it, value in zip(self.items, values):
            it.value = value
        if owned:
            for v in old:
                if isinstance(v, jax.Array):
                    v.delete()
        return sum(v.nbytes for v in values)

    def commit(self) -> str:
        """Write the arrays, then commit (see :mod:`levanter.checkpoint.layout`); returns the path. Storage
        errors are :class:`CheckpointSaveError` (a full disk :class:`~levanter.errors.OutOfSpaceError`)."""
        final, step, started = self.path, self.step, time.perf_counter()
        if self.on_device:
            self.copy_to_host()  # a device snapshot: to host memory first, off the training thread
        commit = _commit_by_rename if commits_by_rename(final) else _commit_by_record
        try:
            doc = lambda: _metadata_doc(step, self.is_temporary, self.user_metadata, self.items)  # noqa: E731
            commit(final, self.items, doc, self.sync, self.token, self.process_index)
        except Exception as e:
            error = _save_error(e, step, final)
            self.sync.failed(error)
            if error is e:
                raise
            raise error from e
        except BaseException as e:
            self.sync.failed(e)
            raise
        self.sync.committed()
        logger.info("saved checkpoint for step %d to %s (%d arrays, %.2fs)", step, final, len(self.items),
                    time.perf_counter() - started)
        return final

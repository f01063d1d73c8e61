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
through the runtime's key-value store (``store``; :class:`~levanter.checkpoint.process_sync.KeyValueSync`): every process records that
its shards are written or why not, process 0 commits only if all say written and records the outcome,
which the others wait for. The caller hands in its process index (``process_index``, by default
``jax.process_index()``). On load each process reads only the slices its own devices need.

:func:`save_checkpoint` is synchronous: the caller waits for the data to reach storage. It is
:func:`prepare_save` (checks and collectives, on the calling thread) followed by
:meth:`PreparedSave.commit`; :class:`~levanter.checkpoint.Checkpointer` runs the commit in the background
after :meth:`PreparedSave.snapshot` (:mod:`levanter.checkpoint.async_writer`).

This module is the save side: its checks and its commit. What it writes (the stored leaves, their finite
check) is :mod:`levanter.checkpoint.leaf_writes`; how the processes agree on its moments is
:mod:`levanter.checkpoint.process_sync`. What save and load share (leaf names, array specs and chunking,
running the asynchronous I/O, storage error text) is :mod:`levanter.checkpoint.tree_format`; the load side
is :mod:`levanter.checkpoint.restore`.
"""

from __future__ import annotations

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

from levanter.checkpoint.errors import CheckpointSaveError
from levanter.checkpoint.host_copy import PendingShards, finish_snapshot, host_copies, take_snapshot
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
from levanter.checkpoint import write_process
from levanter.checkpoint.leaf_writes import LeafToWrite, non_finite_leaves, prepare_leaves, write_all
from levanter.checkpoint.process_sync import Barrier, BarrierSync, KeyValueSync, no_barrier
from levanter.checkpoint.tree_format import io_error_text, run_coroutine, summarise
from levanter.distributed import KeyValueStore
from levanter.errors import is_out_of_space, is_read_only_storage, out_of_space_error, read_only_storage_error
from levanter.utils import fs
from levanter.utils.fault import fault_point

__all__ = ["PreparedSave", "prepare_save", "save_checkpoint"]

logger = logging.getLogger(__name__)


def _shared_token() -> str:
    """A random token, the same on every process (the temporary directory name must agree)."""
    value = secrets.randbits(31)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        value = int(multihost_utils.broadcast_one_to_all(np.int32(value)))
    return f"{value:08x}"


def _metadata_doc(step: int, is_temporary: bool, user_metadata: dict, items: list[LeafToWrite]) -> dict:
    return {
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "step": step,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "is_temporary": bool(is_temporary),
        "metadata": user_metadata,
        "leaves": [it.record for it in items],
    }


def _write_then_agree(root: str, items: list[LeafToWrite], process_index: int, sync,
                      background: bool = False) -> None:
    """Write this process's part under ``root``, then report it (``sync.written``), whether it failed or not:
    process 0 learns of every failure before it cleans up or commits. ``background``: a background save's
    host copies, written by the writer process where it applies (:mod:`levanter.checkpoint.write_process`)."""
    error = None
    try:
        if background and write_process.applies(root, items):
            write_process.write_in_process_of_its_own(root, items, process_index)
        else:
            run_coroutine(write_all(root, items, process_index))
    except Exception as e:  # noqa: BLE001 -- reported to process 0, then raised
        error = e
    sync.written(error)


def _commit_by_rename(final: str, items: list[LeafToWrite], doc: Callable[[], dict], sync, token: str,
                      process_index: int, background: bool = False) -> None:
    """POSIX storage: write into ``.tmp-<name>-<token>``, then rename it to ``final``."""
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{token}")
    is_leader = process_index == 0
    try:
        if is_leader:
            os.makedirs(tmp, exist_ok=True)
        _write_then_agree(tmp, items, process_index, sync, background)
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


def _commit_by_record(final: str, items: list[LeafToWrite], doc: Callable[[], dict], sync, token: str,
                      process_index: int, background: bool = False) -> None:
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
        _write_then_agree(final, items, process_index, sync, background)
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
    store instead of ``barrier`` (:class:`KeyValueSync`), so that :meth:`PreparedSave.commit` may run on
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

    items = prepare_leaves(tree)
    bad = non_finite_leaves(items)
    if bad:
        raise CheckpointSaveError(
            f"not saving the checkpoint of step {step} to {final}: {summarise(bad, 3)} "
            f"{'holds' if len(bad) == 1 else 'hold'} NaN or infinite values. Nothing was written; the latest "
            "complete checkpoint is unchanged. Resume from it with a fixed config (learning rate, epsilon)."
        )
    token = _shared_token()
    name = fs.basename(final)
    if store is not None and jax.process_count() > 1:
        sync = KeyValueSync(store, name, token, process_index, store_timeout_s)
    else:
        sync = BarrierSync(barrier or no_barrier, name, token)
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
    items: list[LeafToWrite]
    is_temporary: bool
    user_metadata: dict
    sync: Any  # BarrierSync or KeyValueSync: how the processes agree that every part is written
    token: str
    process_index: int
    # Some values to write are copies still on their way to host memory (snapshot): finished by commit.
    pending: bool = False
    # A background save (snapshot taken): its host copies are written by the writer process.
    background: bool = False

    def snapshot(self, policy: str = "auto") -> str:
        """Make the save independent of the tree's buffers, so that the caller may donate or change them
        before :meth:`commit`: by default copies on the devices where they have room (milliseconds) and the
        rest copied to host memory (``policy``: see :func:`~levanter.checkpoint.host_copy.take_snapshot`);
        :meth:`commit` or :meth:`copy_to_host` brings the copies into numpy arrays. Returns how, as
        ``take_snapshot`` does (``"device"``, ``"host"``, ``"device+host"``, ...)."""
        values, how = take_snapshot([it.value for it in self.items], policy=policy)
        for it, value in zip(self.items, values):
            it.value = value
        self.background = True
        self.pending = any(isinstance(v, PendingShards) for v in values)
        return how

    def copy_to_host(self) -> int:
        """Replace the arrays to write by host copies (:mod:`levanter.checkpoint.host_copy`), so that the
        caller may donate or change the tree's buffers before :meth:`commit`; returns the bytes copied. After
        :meth:`snapshot`, waits for its transfers instead and frees its device copies."""
        old = [it.value for it in self.items]
        values = finish_snapshot(old) if self.pending else host_copies(old)
        self.pending = False
        for it, value in zip(self.items, values):
            it.value = value
        return sum(v.nbytes for v in values)

    def commit(self) -> str:
        """Write the arrays, then commit (see :mod:`levanter.checkpoint.layout`); returns the path. Storage
        errors are :class:`CheckpointSaveError` (a full disk :class:`~levanter.errors.OutOfSpaceError`)."""
        final, step, started = self.path, self.step, time.perf_counter()
        if self.pending:
            self.copy_to_host()  # the snapshot's copies: to host memory first, off the training thread
        commit = _commit_by_rename if commits_by_rename(final) else _commit_by_record
        try:
            doc = lambda: _metadata_doc(step, self.is_temporary, self.user_metadata, self.items)  # noqa: E731
            commit(final, self.items, doc, self.sync, self.token, self.process_index, self.background)
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

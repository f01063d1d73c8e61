"""When to save: the keep/save_interval policy, its config (``trainer.checkpointer``) and the
:class:`Checkpointer` that applies it.

Permanent checkpoints are taken at the steps the ``keep`` intervals name, plus a temporary one whenever
``save_interval`` of wall time has passed since the last save. A temporary checkpoint is deleted once a
newer checkpoint is complete; permanent ones are never deleted. The base path may be a local directory
or an object-store URL (``gs://``, ``s3://``); :mod:`levanter.checkpoint.layout` says how saves commit
and deletions proceed on each. Saves run in the background by default, on one process or many:
``on_step`` returns once the state is copied (on the devices where they have room, else to host memory),
the write and commit follow on a worker thread
(:mod:`levanter.checkpoint.async_writer`), and :meth:`Checkpointer.wait_until_finished` waits for them.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import numpy as np

from levanter.checkpoint.async_writer import BackgroundWriter
from levanter.checkpoint.errors import CheckpointSaveError
from levanter.checkpoint.layout import (
    METADATA_FILENAME,
    atomic_write_json,
    commits_by_rename,
    delete_stale_temporaries,
    discover_latest_checkpoint,
    is_complete,
    read_checkpoint_metadata,
    remove_dir,
    resolve_path,
    step_dirs,
)
from levanter.checkpoint.process_sync import Barrier
from levanter.checkpoint.serialization import prepare_save
from levanter.checkpoint.tree_format import io_error_text
from levanter.config import parse_timedelta
from levanter.distributed import key_value_store, read_process_sum, start_process_sum
from levanter.errors import is_out_of_space, is_read_only_storage, out_of_space_error, read_only_storage_error
from levanter.utils import fs

__all__ = ["CheckpointInterval", "Checkpointer", "CheckpointerConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInterval:
    """Keep a permanent checkpoint every ``every`` steps, for steps below ``until`` (None: forever).

    Intervals apply in order: interval ``i`` covers steps from the previous interval's ``until`` up to
    its own ``until``.
    """

    # Keep the checkpoint of every step that is a multiple of this.
    every: int
    # ... for steps below this one; null: for every later step (only the last interval may say so).
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
    """A local directory, or ``gs://bucket/...`` / ``s3://bucket/...`` (see docs/guides/storage.md)."""
    save_interval: datetime.timedelta = datetime.timedelta(minutes=15)
    """Wall time between temporary checkpoints (YAML: ``15m``, ``30s``, ``1h``, or seconds)."""
    keep: list[CheckpointInterval] = field(default_factory=lambda: [CheckpointInterval(every=10000)])
    """Which steps get permanent checkpoints."""
    # Checkpoints go to <base_path>/<run id>/step-N; false: to <base_path>/step-N.
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
            return fs.join(self.base_path, run_id)
        return self.base_path

    def validate_writable(self, run_id: str) -> str:
        """Create the run's checkpoint directory and write/delete a probe file there; returns the path
        (absolute, or the URL).

        Meant to run before training starts, so a bad path fails in seconds, not at the first save.
        """
        path = resolve_path(self.expanded_path(run_id))
        try:
            fs.retry_transient(fs.probe_writable, path, what=f"writing to {path}")
        except Exception as e:
            why = io_error_text(e)
            if why is None:
                raise
            raise ValueError(
                f"trainer.checkpointer.base_path={fs.redact(self.base_path)!r}: cannot write checkpoints to "
                f"{path} ({why}). Choose a writable directory."
            ) from None
        return path

    def create(
        self,
        run_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        barrier: Barrier | None = None,
        metadata: dict | None = None,
        process_index: int | None = None,
    ) -> "Checkpointer":
        return Checkpointer(
            self.expanded_path(run_id),
            save_interval=self.save_interval,
            keep=self.keep,
            delete_old_temp_checkpoints=self.delete_old_temp_checkpoints,
            clock=clock,
            barrier=barrier,
            metadata=metadata,
            process_index=process_index,
        )


class Checkpointer:
    """Decides when to save and cleans up temporary checkpoints. Every process must call it alike.

    ``clock`` returns seconds (monotonic); tests inject a fake one. ``barrier`` is passed to
    :func:`save_checkpoint` (``multihost_utils.sync_global_devices`` in multi-process jobs). In a
    multi-process job the time-based decision is taken by process 0 and broadcast, since host clocks
    disagree and every process must join the same saves; each step's broadcast is started at the step
    before, so that reading it never waits for the step the trainer has queued since (:meth:`_agreed_due`).
    ``process_index`` is this process's index (default ``jax.process_index()``); process 0 removes leftovers
    and superseded temporary checkpoints.

    ``asynchronous`` (the default): a save returns once the state is copied (``snapshot_policy``) and writes
    in the background (:mod:`levanter.checkpoint.async_writer`); a failed write is raised by the next
    ``on_step``/``save``/``wait_until_finished`` (multi-process: the next ``save`` or
    ``wait_until_finished``, see :meth:`_raise_if_failed`). ``False``: a save returns once it is committed.
    In a multi-process job each process writes its own shards on its writer thread and the processes agree
    on the commit through the runtime's key-value store, not a device collective
    (:func:`levanter.distributed.key_value_store`; the protocol is ``process_sync.KeyValueSync``);
    a synchronous multi-process save agrees through ``barrier``.
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
        process_index: int | None = None,
        before_save: Callable[[], None] | None = None,
        asynchronous: bool = True,
    ):
        self.base_path = resolve_path(base_path)
        # Called before every save (train_lm flushes its trackers, so that a run resumed from a checkpoint
        # finds the metrics of every step before it, also where a tracker buffers its file).
        self.before_save = before_save
        # A bucket that does not exist or cannot be read fails here, naming it, not at the first save (where
        # tensorstore's S3 driver may wait on it instead of failing). Free for local paths.
        fs.check_access(self.base_path, "trainer.checkpointer.base_path")
        # Stored in every checkpoint's metadata.json (e.g. the data-schedule record checked on resume).
        self.metadata = dict(metadata or {})
        self.save_interval = save_interval
        self.keep = _validate_keep(keep)
        self._clock = clock
        self._barrier = barrier
        self.process_index = jax.process_index() if process_index is None else process_index
        self._last_save_time = clock()
        self._last_saved_step: int | None = None
        self._decided: tuple[int, bool] | None = None  # (step, whether save_interval had passed)
        # Multi-process: (step, process 0's answer for it, dispatched and not yet read); see _agreed_due.
        self._ahead: tuple[int, Any] | None = None
        # Temporary checkpoints to delete once a newer checkpoint is complete.
        self._retire: list[str] = []
        self.asynchronous = asynchronous
        # Multi-process background saves agree on their commit through the runtime's key-value store.
        self._store = key_value_store() if asynchronous and jax.process_count() > 1 else None
        self._writer = BackgroundWriter()
        # What the last save cost the caller and the whole save (the benchmark reads them).
        self.last_blocked_s = 0.0
        self.last_save_s = 0.0
        # How a background save copies the state before on_step returns (host_copy.take_snapshot): "auto"
        # (on the devices where they have room, else the copy to host memory), "pinned" (all transferred into
        # pinned host memory), "pinned-async" (the same, not waited for) or "host" (all copied to host); not a
        # config key: scripts/bench/checkpoint_loop.py compares them.
        self.snapshot_policy = "auto"
        # How the last background save copied the state: "device", "host", "device+host", "pinned" or
        # "pinned-async" (host_copy.take_snapshot).
        self.last_copy = ""
        self.last_waited_s = 0.0  # of last_blocked_s: the wait for the previous save's write to finish
        if self.process_index == 0:
            delete_stale_temporaries(self.base_path)
            if commits_by_rename(self.base_path):
                for _, path in step_dirs(self.base_path):
                    # A kill inside _make_permanent's metadata rewrite leaves a temporary file there.
                    fs.remove_stale_temporaries(path, METADATA_FILENAME)
        if delete_old_temp_checkpoints:
            for _, path in step_dirs(self.base_path):
                if is_complete(path) and self._is_temporary(path):
                    self._retire.append(path)

    # -- queries -------------------------------------------------------------------------------------
    def path_for_step(self, step: int) -> str:
        return fs.join(self.base_path, f"step-{int(step)}")

    @property
    def writing(self) -> bool:
        """Whether a background save is in flight."""
        return self._writer.busy

    def latest_checkpoint(self) -> str | None:
        """The latest complete checkpoint, counting the save in flight (waited for)."""
        self._writer.wait()
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

    def _agreed_due(self, step: int, interval: float) -> bool:
        """Multi-process: whether ``save_interval`` has passed, as process 0's clock says, for ``step``.

        The answer is a device collective, and reading it waits for everything queued before it: asked for
        when the trainer has already dispatched the next step, a broadcast started then would make the host
        wait for that step, and the host's work before the following dispatch would leave the accelerator
        idle at every step. So each answer is started one step ahead: the one for ``step`` was dispatched
        when ``step - 1`` was asked about (behind the step queued then, which has finished by now), and this
        call starts the one for ``step + 1``, from process 0's clock now (restarted if ``step`` saves). A
        call for another step than the one started (the first, or after a step that saved without asking)
        agrees at once. Every process makes the same calls in the same order, so all join each collective.
        """
        ahead, self._ahead = self._ahead, None
        now = self._clock()
        if ahead is not None and ahead[0] == step:
            due = read_process_sum(ahead[1]) > 0
        else:
            due = self._agree(now - self._last_save_time >= interval)
        since = 0.0 if due else now - self._last_save_time
        self._ahead = (step + 1, start_process_sum(int(since >= interval and self.process_index == 0)))
        return due

    def _time_due(self, step: int, *, remember: bool = False) -> bool:
        """Whether ``save_interval`` has passed since the last save. The answer :meth:`save_due` gave
        (``remember``) is the one the same step's next :meth:`on_step` acts on: one clock reading and one
        broadcast, and the state the trainer kept for a save is the state saved."""
        decided, self._decided = self._decided, None
        if decided is not None and decided[0] == step:
            return decided[1]
        due = False
        if self.save_interval is not None:
            interval = self.save_interval.total_seconds()
            if jax.process_count() == 1:
                due = self._clock() - self._last_save_time >= interval
            else:
                due = self._agreed_due(step, interval)
        if remember:
            self._decided = (step, due)
        return due

    def save_due(self, step: int, *, force: bool = False) -> bool:
        """Whether ``on_step(tree, step, force=force)`` will do anything with ``tree`` (save it or mark its
        checkpoint permanent). The trainer asks before it dispatches the next step, which may reuse the
        buffers of the state after ``step``: where this says False the state is never needed. First raises
        the error of a background save that failed since the last call (single-process; see
        :meth:`_raise_if_failed`)."""
        self._raise_if_failed()
        step = int(step)
        permanent = force or _is_permanent_step(self.keep, step)
        if step == self._last_saved_step:
            return permanent
        return permanent or self._time_due(step, remember=True)

    def on_step(self, tree: Any, step: int, *, force: bool = False) -> bool:
        """Save ``tree`` (the state after ``step`` updates) if the policy says so; True if saved.

        Permanent at the ``keep`` steps and when ``force`` is set; temporary when ``save_interval`` has
        passed since the last save (as :meth:`save_due` decided it, if asked about this step). A step
        already saved is not saved again. First raises the error of a background save that failed since
        the last call (single-process; see :meth:`_raise_if_failed`).
        """
        self._raise_if_failed()
        step = int(step)
        permanent = force or _is_permanent_step(self.keep, step)
        if step == self._last_saved_step:
            if permanent:
                self._make_permanent(self.path_for_step(step))
            return False
        due = not permanent and self._time_due(step)
        if not (permanent or due):
            return False
        self.save(tree, step, is_temporary=not permanent)
        return True

    def save(self, tree: Any, step: int, *, is_temporary: bool = False) -> str:
        """Save now, then delete the temporary checkpoints this one supersedes; returns the path.

        Asynchronous: returns once the arrays are copied to host memory (after the save in flight, if
        any, has finished); the write, the commit and the deletions follow in the background.
        """
        started = time.perf_counter()
        self._writer.wait()  # one save in flight at a time: one extra copy of the state, saves in order
        self.last_waited_s = time.perf_counter() - started
        if self.before_save is not None:
            self.before_save()
        path = self.path_for_step(step)
        prepared = None
        if is_complete(path):
            # Typically the checkpoint this attempt resumed from. Rewriting it would change nothing.
            logger.info("checkpoint %s already exists; not saving step %d again", path, step)
            if path in self._retire:
                self._retire.remove(path)
            if not is_temporary:
                self._make_permanent(path)
            is_temporary = self._is_temporary(path)
        else:
            prepared = prepare_save(tree, step, path, is_temporary=is_temporary, barrier=self._barrier,
                                    metadata=self.metadata, process_index=self.process_index, store=self._store)
        self._last_save_time = self._clock()
        self._last_saved_step = step
        superseded = [old for old in self._retire if old != path] if self.process_index == 0 else []
        self._retire = [path] if is_temporary else []

        def write() -> None:
            if prepared is not None:
                prepared.commit()
            for old in superseded:  # only once the new checkpoint is complete
                if fs.isdir(old):
                    logger.info("deleting superseded temporary checkpoint %s", old)
                    try:
                        remove_dir(old)
                    except OSError as e:
                        if is_read_only_storage(e):
                            raise read_only_storage_error("deleting a superseded temporary checkpoint", old,
                                                          self.base_path) from e
                        raise
            self.last_save_s = time.perf_counter() - started

        if self.asynchronous and prepared is not None:
            # Copies the next step cannot touch: on the devices where they have room (milliseconds), the rest
            # in host memory; the writer brings the device copies to the host.
            self.last_copy = prepared.snapshot(self.snapshot_policy)
            self._writer.submit(write, f"save of the checkpoint of step {step} to {path}")
        else:
            write()
        self.last_blocked_s = time.perf_counter() - started
        return path

    def _raise_if_failed(self) -> None:
        """Raise the error of a background save that has failed. Multi-process: nothing here -- each process
        learns of a failure at its own moment, and a process that stopped at one step while the others
        trained on would leave them waiting in the next step's collectives -- the error is raised by the next
        save (which waits for the write in flight) or by :meth:`wait_until_finished`, which every process
        reaches at the same step."""
        if jax.process_count() == 1:
            self._writer.raise_if_failed()

    def _make_permanent(self, path: str) -> None:
        self._writer.wait()  # the save of ``path`` may still be in flight
        if path in self._retire:
            self._retire.remove(path)
        if self.process_index != 0 or not self._is_temporary(path):
            return
        doc = read_checkpoint_metadata(path)
        doc["is_temporary"] = False
        try:
            atomic_write_json(fs.join(path, METADATA_FILENAME), doc)
        except Exception as e:  # the old metadata.json is intact: the checkpoint stays a temporary one
            if is_out_of_space(e):
                raise out_of_space_error("marking the checkpoint permanent", path) from e
            if is_read_only_storage(e):
                raise read_only_storage_error("marking the checkpoint permanent", path, self.base_path) from e
            why = io_error_text(e)
            if why is None:
                raise
            raise CheckpointSaveError(f"could not mark the checkpoint {path} permanent: {why}") from e

    def wait_until_finished(self) -> None:
        """Block until the save in flight is committed; raise its error if it failed."""
        self._writer.wait()

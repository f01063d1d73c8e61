"""Checkpoint writes in the background: the training loop waits for the checks and a copy of the state only.

:class:`BackgroundWriter` runs one write at a time on a worker thread. The protocol a
:class:`~levanter.checkpoint.Checkpointer` follows with it:

1. On the calling (training) thread: wait for the write in flight to finish (so at most one extra copy
   of the state exists), run the save's checks and collectives
   (:func:`~levanter.checkpoint.serialization.prepare_save`), then take a copy that the next step, which
   donates the state's device buffers, cannot touch: on the devices where they have room (milliseconds),
   else the copy to host memory (:mod:`levanter.checkpoint.host_copy`; transfers into pinned host memory
   where ``Checkpointer.snapshot_policy`` asks for them).
2. On the worker thread: wait for the transfers or move the device copies to host memory, write the
   arrays and commit exactly as a synchronous save does (the renamed ``.tmp-`` directory on local disk,
   ``metadata.json`` last on object stores; with several processes, process 0 commits once every process
   has recorded in the runtime's key-value store that its shards are written), then delete the temporary
   checkpoints the new one supersedes. A kill at any moment therefore leaves either the new checkpoint
   complete or nothing of it that discovery would take for one.
3. A failed write is kept and raised on the training thread at the next call into the writer -- the
   checkpointer's next ``on_step``, i.e. the next step boundary at the latest (with several processes:
   the next save, which every process reaches at the same step), or ``wait`` -- so a run never trains on
   past a save that did not happen.

The worker is not a daemon thread: an interpreter that exits (an error elsewhere, ``sys.exit``) first
lets the write in flight finish, and the checkpoint it commits is a complete one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Optional

__all__ = ["BackgroundWriter"]

logger = logging.getLogger(__name__)


class BackgroundWriter:
    """Runs jobs one at a time on a worker thread; a job's exception is raised by the next call."""

    def __init__(self, name: str = "levanter-checkpoint-writer"):
        self._name = name
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._description = ""
        # Seconds the calling thread spent waiting for a previous write (the cost of saves closer together
        # than one write takes).
        self.waited_s = 0.0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None], description: str) -> None:
        """Run ``job`` on the worker thread after the job in flight (raising that one's failure first)."""
        self.wait()
        self._description = description
        self._thread = threading.Thread(target=self._run, args=(job,), name=self._name, daemon=False)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # noqa: BLE001 -- handed to the training thread by raise_if_failed
            # Not an error line: the caller raises it, and the entry point prints the one error paragraph.
            logger.info("background %s failed: %s", self._description, e)
            self._error = e

    def wait(self) -> None:
        """Block until the job in flight is done; raise its exception if it failed."""
        thread = self._thread
        if thread is not None:
            if thread.is_alive():
                started = time.perf_counter()
                thread.join()
                self.waited_s += time.perf_counter() - started
            self._thread = None
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise the exception of a finished job that failed (once); return at once otherwise."""
        thread = self._thread
        if thread is not None and not thread.is_alive():
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

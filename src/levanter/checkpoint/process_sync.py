"""How the processes of a multi-process checkpoint save agree on its moments: the way cleared of an earlier
uncommitted save, every process's shards written, the save committed (or failed).

Two implementations of the same four calls (``cleared``, ``written``, ``failed``, ``committed``):
:class:`BarrierSync`, through ``barrier`` (a device collective, for a synchronous save on the training
thread; nothing in a single-process save), and :class:`KeyValueSync`, through the runtime's key-value
store (:func:`levanter.distributed.key_value_store`), for a background save whose commit runs on a writer
thread, where a device collective would have to be ordered with the train steps.

Trade-off: the key-value store's waits are bounded by a timeout (``store_timeout_s``) rather than by a
device barrier's failure detection, so a process that hangs mid-write stalls the others up to that bound.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax

from levanter.checkpoint.errors import CheckpointSaveError
from levanter.checkpoint.tree_format import io_error_text
from levanter.distributed import KeyValueStore
from levanter.errors import OutOfSpaceError, ReadOnlyStorageError

__all__ = ["Barrier", "BarrierSync", "KeyValueSync", "no_barrier"]

logger = logging.getLogger(__name__)

# ``barrier(name)`` blocks until every process has called it with the same name.
Barrier = Callable[[str], None]


def no_barrier(name: str) -> None:
    """The barrier of a single-process save: nothing to wait for."""
    return None


class BarrierSync:
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


class KeyValueSync:
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

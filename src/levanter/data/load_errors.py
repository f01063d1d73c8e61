"""Failed reads: which errors are worth retrying, the retry loop, and the one error that ends loading.

A storage failure that may pass (a chunk missing, corrupt or unreadable for a moment, an unavailable or
slow store: :func:`~levanter.store.faults.storage_fault` reads tensorstore's status, ``OSError`` s
count too) is retried with exponential backoff, the same indices for the same step, so a retry never
changes the data. One that outlasts the retries, or any other error (a bug, a bad request), becomes one
:class:`DataLoadError` that names the step, and for a storage failure the chunk, the cache and what to
do. A read never returns fill values for missing data (the stores refuse to), so a failure never turns
into a batch of token 0.

Trade-off: a read that fails for good is reported only after its retries (up to ``retries`` attempts,
backoff doubling to 30 s): the price of riding out a flaky object store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ..store.faults import StorageFault, storage_fault
from .read_plan import DatasetExhausted

__all__ = ["TransientDataError", "TRANSIENT_ERRORS", "is_transient", "DataLoadError", "read_with_retries"]

logger = logging.getLogger(__name__)


class TransientDataError(OSError):
    """Raise (or subclass) this from a dataset for a failure worth retrying (a flaky read)."""


# Failures of storage and networks: worth retrying. Anything else is a bug or bad data: not retried.
# tensorstore reports storage failures as ``ValueError`` with a status code: see ``is_transient``.
TRANSIENT_ERRORS = (TransientDataError, TimeoutError, ConnectionError, OSError)


def is_transient(err: BaseException) -> bool:
    """Whether retrying the read that raised ``err`` may succeed: an error of :data:`TRANSIENT_ERRORS`, or
    a tensorstore storage status (missing, corrupt or unreadable chunk, unavailable store). On object
    storage even a missing chunk or a checksum mismatch can be a read that raced a write or a replica
    that lagged; what stays wrong is reported once the retries are spent."""
    if isinstance(err, TRANSIENT_ERRORS):
        return True
    return isinstance(err, ValueError) and storage_fault(err) is not None


def _describe_indices(indices: np.ndarray) -> str:
    idx = np.asarray(indices)
    if idx.size and (np.diff(idx) == 1).all():
        return f"global indices {int(idx[0])}..{int(idx[-1])} ({idx.size} rows)"
    shown = ", ".join(map(str, idx[:8].tolist())) + (", ..." if idx.size > 8 else "")
    return f"global indices [{shown}] ({idx.size} rows)"


class DataLoadError(RuntimeError):
    """Reading a step's batch failed for good: names the step and the indices, and for a storage failure
    (:attr:`fault`) the chunk, the cache it belongs to and what to do."""

    def __init__(
        self, step: int, indices: np.ndarray, cause: BaseException, *, attempts: int, seconds: float = 0.0
    ):
        self.step = step
        self.indices = np.asarray(indices)
        self.seconds = seconds
        fault = storage_fault(cause) if is_transient(cause) else None
        if fault is not None and fault.chunk is None and not isinstance(cause, ValueError):
            fault = None  # an OSError that names no file: its own text says more than a guess would
        self.fault: StorageFault | None = fault
        tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
        if self.fault is not None:
            f = self.fault
            chunk = f"chunk {f.chunk}" if f.chunk else "a chunk"
            if f.cache and not f.gone_bucket:  # a gone bucket holds no cache to name
                chunk += f" of the cache at {f.cache}"
            what = f.what().replace(f"chunk {f.chunk}" if f.chunk else "a chunk", chunk, 1)
            message = (
                f"data loading failed at step {step} for {_describe_indices(indices)}: {what}, still after "
                f"{tries} over {seconds:.1f} s. {f.advice()[0].upper()}{f.advice()[1:]}."
            )
        else:
            message = (
                f"data loading failed at step {step} for {_describe_indices(indices)} after {tries}: "
                f"{type(cause).__name__}: {cause}"
            )
        super().__init__(message)



async def read_with_retries(
    read: Callable[[int], Awaitable[Any]], step: int, indices: np.ndarray, *, retries: int, backoff: float,
    log: logging.Logger = logger,
) -> Any:
    """``await read(attempt)`` for attempts ``0, 1, ...``: a transient failure is retried (exponential
    backoff from ``backoff`` seconds, up to ``retries`` times, each retry a warning on ``log``: the
    loader passes its own logger, so its warnings keep its name); what is not transient, or outlasts the
    retries, becomes a :class:`DataLoadError` naming ``step`` and ``indices``. ``DatasetExhausted`` (the
    end of the data) passes through."""
    delay = backoff
    t0 = time.monotonic()
    for attempt in range(retries + 1):
        try:
            return await read(attempt)
        except DatasetExhausted:
            raise
        except Exception as e:  # noqa: BLE001 -- classified: retried, or one error naming the step
            if not is_transient(e) or attempt == retries:
                raise DataLoadError(step, indices, e, attempts=attempt + 1, seconds=time.monotonic() - t0) from e
            log.warning("transient error reading step %d (attempt %d of %d): %s; retrying in %.2f s", step,
                           attempt + 1, retries + 1, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

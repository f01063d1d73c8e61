"""The data loader: step-ordered batches, fetched ahead concurrently, yielded strictly in order.

For step ``s`` the loader asks the dataset for exactly this process's rows of
``[offset(s), offset(s) + B(s))`` (offsets from the :class:`~levanter.schedule.BatchSchedule`), ascending,
in one ``get_batch(s, indices)`` call, and builds a pytree of global ``jax.Array`` s whose leading
(batch) axis is sharded over the mesh's data axes. Each yielded :class:`Batch` carries its step, so the
trainer can check it against its own.

Index spaces: **step**; **global index** (``offset(s) + row``); **row** -- a position within the step's
global batch, ``0 <= row < B(s)``. A process's rows are the union of the rows its addressable devices
hold (model-parallel replicas that share rows are read once).

The loader's parts, one concept each: this module (rows, assembly into global arrays, iteration in
order); :mod:`.prefetch` (``prefetch_depth = d > 0``: a background thread keeps up to ``d`` steps in
flight, handed out in order; ``d = 0`` fetches each step on demand in the caller's thread);
:mod:`.read_ahead` (upcoming steps of any dataset that plans its reads, read in groups ahead of need);
:mod:`.load_errors` (retries of transient storage failures, and the one :class:`DataLoadError` that
names the step). Everything the background work needs (mesh, sharding, process index) is captured
explicitly at construction; nothing reads thread-local context.

Provenance (``provenance=True``): each batch says where every row of the global batch comes from, from
the index-math pass of the step's own read (its one-step plan, or the read-ahead group's plan):
there is no second pass per step.

End of data: for a finite dataset the last step is the last one whose whole range fits in
``async_len()`` (the same on every process); a trailing partial batch is not yielded. A dataset that
raises :class:`~levanter.data.dataset.DatasetExhausted` ends the iteration at that step too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..schedule import BatchSchedule, as_int
from .dataset import AsyncDataset, read_planned
from .load_errors import DataLoadError, read_with_retries
from .prefetch import Prefetcher
from .read_ahead import MISS, ReadAhead
from .read_plan import DatasetExhausted, StackedBatch

__all__ = [
    "PREFETCH_SWITCH_INTERVAL",
    "use_prefetch_switch_interval",
    "Batch",
    "rows_for_process",
    "process_rows",
    "StepRequest",
    "DataLoader",
    "DataLoaderIterator",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


# The interpreter's GIL switch interval that a process running a prefetching loader should use. The
# prefetch thread is busy with short Python steps while tensorstore's threads wait for the GIL to hand
# back finished reads; at CPython's default 5 ms a finished read can wait that long. Shorter intervals
# bring the reads back sooner until switching itself costs more (docs/bench/2026-12-03-cpu-levers.md).
# Applications set it (``train_lm`` does, through :func:`use_prefetch_switch_interval`); the loader itself
# never changes process-wide interpreter settings.
PREFETCH_SWITCH_INTERVAL = 0.001


def use_prefetch_switch_interval() -> float:
    """Set ``sys.setswitchinterval`` to :data:`PREFETCH_SWITCH_INTERVAL`; returns the previous value."""
    import sys

    previous = sys.getswitchinterval()
    sys.setswitchinterval(PREFETCH_SWITCH_INTERVAL)
    return previous


try:  # jaxlib's host -> device transfer of per-device pieces: what make_array_from_callback ends in
    from jaxlib.xla_client import batched_device_put as _batched_device_put
except ImportError:  # another jaxlib: every array goes through make_array_from_callback (same arrays, slower)
    _batched_device_put = None


@dataclasses.dataclass(frozen=True)
class Batch(Generic[T]):
    """One step's global batch.

    ``data`` is a pytree of ``jax.Array`` with leading axis ``batch_size``; ``global_offset`` is the
    first global index; ``wait_seconds`` is how long the consumer blocked waiting for it.
    ``provenance`` (from a loader built with ``provenance=True``) says where each row of the *global*
    batch comes from: ``global_index`` and, for a mixture, ``source`` (id) and ``source_index`` -- what
    :func:`~levanter.data.fingerprint.batch_fingerprint` hashes. It is computed with the step's reads, on
    the loader's side, and is the same on every process whatever rows it holds.
    """

    step: int
    global_offset: int
    batch_size: int
    data: Any
    wait_seconds: float = 0.0
    provenance: Mapping[str, np.ndarray] | None = None

    def source_counts(self, num_sources: int) -> np.ndarray:
        """Rows of the global batch drawn from each source (a mixture's batch with provenance)."""
        if self.provenance is None or "source" not in self.provenance:
            raise ValueError(f"step {self.step}'s batch carries no per-row sources")
        return np.bincount(self.provenance["source"], minlength=num_sources)


@dataclasses.dataclass(frozen=True)
class StepRequest:
    """What this process asks the dataset for at one step, worked out once per step: the global batch
    ``[first, first + batch_size)``, this process's ``rows`` of it and their global ``indices``
    (ascending), and ``where``, the global indices whose provenance the batch carries (the whole batch)."""

    step: int
    first: int
    batch_size: int
    rows: np.ndarray
    indices: np.ndarray

    @property
    def where(self) -> np.ndarray:
        if self.rows.size == self.batch_size:  # this process reads the whole batch
            return self.indices
        return np.arange(self.first, self.first + self.batch_size, dtype=np.int64)


def rows_for_process(
    device_processes: np.ndarray, axis_names: Sequence[str], data_axes: Sequence[str], batch_size: int, process_index: int
) -> np.ndarray:
    """Rows of a ``batch_size`` global batch held by process ``process_index`` -- a pure index map.

    ``device_processes`` is the mesh's device array with each device replaced by its process index (any
    shape, axes named ``axis_names``). The batch axis is split over ``data_axes`` into contiguous shards,
    numbered row-major over those axes (as ``NamedSharding(mesh, P(data_axes))`` lays them out); a process
    holds the shards of all its devices. Model-parallel replicas of a shard share its rows.
    """
    device_processes = np.asarray(device_processes)
    data_dims = [list(axis_names).index(a) for a in data_axes]
    other = [d for d in range(device_processes.ndim) if d not in data_dims]
    # Data axes first (in data_axes order), then the rest: shard id = row-major index over the data axes.
    grid = np.transpose(device_processes, data_dims + other)
    num_shards = int(np.prod([device_processes.shape[d] for d in data_dims]))
    grid = grid.reshape(num_shards, -1)
    shards = np.flatnonzero((grid == process_index).any(axis=1))
    per = batch_size // num_shards
    return (shards[:, None] * per + np.arange(per)[None, :]).reshape(-1).astype(np.int64)


def process_rows(mesh: Mesh, data_axes: tuple[str, ...], batch_size: int, process_index: int) -> np.ndarray:
    """Sorted rows of a ``batch_size`` global batch held by devices of process ``process_index``."""
    procs = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(mesh.devices)
    return rows_for_process(procs, mesh.axis_names, data_axes, batch_size, process_index)


def _stack(examples) -> Any:
    if isinstance(examples, StackedBatch):
        return examples.tree
    if isinstance(examples, np.ndarray):
        return examples
    if len(examples) == 0:
        raise ValueError("cannot stack an empty batch")
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *examples)


# Steps whose requests a loader keeps (the steps in flight and read ahead: a few hundred at most).
_REQUESTS_KEPT = 1024


class DataLoader(Generic[T]):
    """Step-ordered loader over an :class:`AsyncDataset`.

    Args:
        dataset: the dataset, read with ``get_batch(step, indices)``.
        batch_size: an int or the run's :class:`BatchSchedule`.
        mesh: the device mesh; ``None`` means the first local device.
        data_axis: mesh axis name(s) the batch axis is sharded over; other mesh axes replicate it.
        prefetch_depth: steps fetched ahead (0: fetch on demand, no background thread).
        process_index: this process's index (defaults to ``jax.process_index()``), passed explicitly
            so that the background thread never consults global state.
        provenance: attach each batch's :attr:`Batch.provenance` (the dataset's provenance of the whole
            global batch, from the pass of the step's own read).
    """

    def __init__(
        self,
        dataset: AsyncDataset[T],
        batch_size: int | BatchSchedule,
        *,
        mesh: Mesh | None = None,
        data_axis: str | Sequence[str] = "data",
        prefetch_depth: int = 8,
        process_index: int | None = None,
        retries: int = 5,
        retry_backoff: float = 0.1,
        provenance: bool = False,
    ):
        self.dataset = dataset
        self.provenance = provenance
        self.schedule = batch_size if isinstance(batch_size, BatchSchedule) else BatchSchedule(batch_size)
        if mesh is None:
            mesh = Mesh(np.asarray(jax.local_devices()[:1]), ("data",))
            data_axis = "data"
        self.mesh = mesh
        self.data_axes: tuple[str, ...] = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
        for ax in self.data_axes:
            if ax not in mesh.axis_names:
                raise ValueError(f"data axis {ax!r} is not an axis of the mesh {dict(mesh.shape)}")
        prefetch_depth = as_int(prefetch_depth, what="prefetch_depth")
        if prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
        self.prefetch_depth = prefetch_depth
        if retries < 0 or retry_backoff < 0:
            raise ValueError(f"retries and retry_backoff must be >= 0, got {retries}, {retry_backoff}")
        self.retries = retries
        self.retry_backoff = retry_backoff
        if process_index is not None:
            process_index = as_int(process_index, what="process_index")
        self.process_index = jax.process_index() if process_index is None else process_index
        processes = sorted({d.process_index for d in mesh.devices.flat})
        if self.process_index not in processes:
            # Checked here: a process holding no device of the mesh would fail at its first step, in jax.
            raise ValueError(
                f"process_index {self.process_index} holds no device of the mesh (its devices belong to "
                f"processes {processes})"
            )
        self.data_parallel_size = int(np.prod([mesh.shape[a] for a in self.data_axes]))
        for seg in self.schedule.segments:
            if seg.value % self.data_parallel_size:
                raise ValueError(
                    f"trainer.train_batch_size: batch size {seg.value} (from step {seg.start}) is not divisible "
                    f"by the data-parallel size {self.data_parallel_size} (mesh axes {self.data_axes} of "
                    f"{dict(mesh.shape)})"
                )
        self.sharding = NamedSharding(mesh, PartitionSpec(self.data_axes))
        self._rows_cache: dict[int, np.ndarray] = {}
        self._requests: dict[int, StepRequest] = {}
        self._fast_put: dict[tuple, tuple] = {}  # (shape, dtype) -> (aval, devices, local row slices)
        self._end_step: int | None = None
        self._end_known = False

    # -- index maps ----------------------------------------------------------------------------------
    def local_rows(self, batch_size: int) -> np.ndarray:
        """Rows of a ``batch_size`` global batch this process reads (ascending)."""
        rows = self._rows_cache.get(batch_size)
        if rows is None:
            rows = self._rows_cache[batch_size] = process_rows(
                self.mesh, self.data_axes, batch_size, self.process_index
            )
        return rows

    def request(self, step: int) -> StepRequest:
        """This process's request at ``step`` (kept for the steps in flight: the fetch, the read-ahead's
        grouping and planning all ask for it; a pure function of the step, so a lost entry is recomputed)."""
        req = self._requests.get(step)
        if req is None:
            first = self.schedule.global_data_offset_by_step(step)
            bs = self.schedule.batch_size_at_step(step)
            rows = self.local_rows(bs)
            req = StepRequest(step, first, bs, rows, first + rows)
            if len(self._requests) >= _REQUESTS_KEPT:
                self._requests.clear()
            self._requests[step] = req
        return req

    def indices_for_step(self, step: int) -> np.ndarray:
        """The global indices this process requests for ``step``, ascending."""
        return self.request(step).indices

    async def end_step(self) -> int | None:
        """One past the last step whose whole batch lies inside a finite dataset; None if infinite."""
        if not self._end_known:
            if self.dataset.is_finite():
                n = await self.dataset.async_len()
                self._end_step = self.schedule.find_step_containing_offset(n)
            self._end_known = True
        return self._end_step

    # -- fetching ------------------------------------------------------------------------------------
    def where_for_step(self, step: int) -> np.ndarray:
        """The global indices whose provenance ``step``'s batch carries: the whole global batch (where this
        process reads all of it, the indices it reads)."""
        return self.request(step).where

    def read_ahead(self, start: int, bound: int | None) -> ReadAhead:
        """Read-ahead for an iterator over steps ``[start, bound)`` (see :mod:`levanter.data.read_ahead`);
        the steps of a dataset that plans no group are each read on their own."""
        where = self.where_for_step if self.provenance else None
        return ReadAhead(self.dataset, self.indices_for_step, start, bound, where)

    async def fetch(self, step: int, read_ahead: ReadAhead | None = None) -> Batch[T]:
        """Read and assemble one step's batch (no ordering guarantees; used by the iterators).

        The first attempt takes the step's rows from ``read_ahead`` where it holds them; otherwise, and on
        a retry (:func:`~levanter.data.load_errors.read_with_retries`: the same indices for the same step,
        so retries never change the data), the dataset is read for the step -- through its one-step plan
        where the batch carries provenance, so that both come from one pass."""
        req = self.request(step)
        indices, bs = req.indices, req.batch_size
        where = req.where if self.provenance else None

        async def read(attempt: int):
            if read_ahead is not None and attempt == 0:
                got = await read_ahead.read(step)
                if got is not MISS:
                    return got
            if where is None:
                return await self.dataset.get_batch(step, indices), None
            return await read_planned(self.dataset, step, indices, where)

        examples, extra = await read_with_retries(
            read, step, indices, retries=self.retries, backoff=self.retry_backoff, log=logger
        )
        if len(examples) != len(req.rows):
            raise ValueError(f"dataset returned {len(examples)} examples for {len(req.rows)} indices at step {step}")
        # Inline, not in a worker thread: building the arrays costs less than a thread hop and back
        # (docs/bench/2026-12-03-cpu-levers.md); the loop is blocked only that long.
        data = self._assemble(examples, req.rows, bs)
        provenance = None
        if where is not None:
            provenance = {"global_index": np.arange(req.first, req.first + bs, dtype=np.int64), **extra}
        return Batch(step=step, global_offset=req.first, batch_size=bs, data=data, provenance=provenance)

    def _assemble(self, examples, rows: np.ndarray, batch_size: int):
        local = _stack(examples)
        return jax.tree.map(lambda leaf: self._to_global(np.asarray(leaf), rows, batch_size), local)

    def _to_global(self, leaf: np.ndarray, rows: np.ndarray, batch_size: int) -> jax.Array:
        """A global array of shape ``(batch_size, ...)`` from this process's ``rows`` of it (``leaf``)."""
        shape = (batch_size,) + leaf.shape[1:]
        key = (shape, leaf.dtype)
        fast = self._fast_put.get(key)
        if fast is not None:
            aval, devices, slices = fast
            # The same call jax.make_array_from_callback ends in, without its per-call validation and
            # sharding bookkeeping (a large share of a small batch's cost:
            # docs/bench/2026-12-03-cpu-levers.md);
            # aval, devices and slices come from a first make_array_from_callback of this shape.
            return _batched_device_put(aval, self.sharding, [leaf[sl] for sl in slices], devices, True)

        def cb(index):
            sl = index[0] if index else slice(None)
            start, stop, _ = sl.indices(batch_size)
            lo = int(np.searchsorted(rows, start))
            return leaf[lo : lo + (stop - start)]

        out = jax.make_array_from_callback(shape, self.sharding, cb)
        # Only where jax keeps the dtype (without x64 it narrows int64/float64; the fast path would not).
        if _batched_device_put is not None and out.dtype == leaf.dtype:
            index_map = self.sharding.addressable_devices_indices_map(shape)
            devices = list(index_map)
            slices = []
            for d in devices:
                sl = index_map[d][0] if index_map[d] else slice(None)
                start, stop, _ = sl.indices(batch_size)
                lo = int(np.searchsorted(rows, start))
                slices.append(slice(lo, lo + (stop - start)))
            self._fast_put[key] = (out.aval, devices, slices)
        return out

    def iter_from_step(self, step: int = 0, end_step: int | None = None) -> "DataLoaderIterator[T]":
        """Batches for steps ``step, step+1, ...`` (up to ``end_step``, exclusive, if given). Steps may be
        any integral type (numpy integers included); floats and bools are refused."""
        step = as_int(step)
        end_step = None if end_step is None else as_int(end_step, what="end_step")
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        return DataLoaderIterator(self, step, end_step)

    def __iter__(self) -> Iterator[Batch[T]]:
        return self.iter_from_step(0)



def _close_loop(loop: asyncio.AbstractEventLoop, read_ahead: list) -> None:
    """Close an on-demand iterator's loop, after cancelling the reads its read-ahead still has pending."""
    pending = read_ahead[0].close() if read_ahead and read_ahead[0] is not None else []
    if pending and not loop.is_closed() and not loop.is_running():
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


class DataLoaderIterator(Iterator[Batch[T]]):
    """Yields ``Batch`` objects strictly in step order; see the module docstring.

    A load error is raised (as ``RuntimeError`` naming the step, chained to the dataset's exception) at
    the step it belongs to, and again on every later ``next()``: the iterator is dead after it.
    """

    def __init__(self, loader: DataLoader[T], start: int, end: int | None):
        self.loader = loader
        self.next_step = start
        self._limit = end
        self.wait_seconds: dict[int, float] = {}
        self._finished = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prefetcher: Prefetcher | None = None
        # The on-demand iterator's read-ahead, made at the first step (once the end is known); in a list
        # that the finalizer holds, so that it does not hold the iterator.
        self._read_ahead: list[ReadAhead | None] = []
        if loader.prefetch_depth > 0:
            self._prefetcher = Prefetcher(
                loader.fetch, loader.end_step, loader.read_ahead, loader.prefetch_depth, start, end
            )
            self._finalizer = weakref.finalize(self, self._prefetcher.close)
        else:
            self._loop = asyncio.new_event_loop()
            self._finalizer = weakref.finalize(self, _close_loop, self._loop, self._read_ahead)

    def _fail(self, step: int, exc: BaseException) -> RuntimeError:
        if isinstance(exc, DataLoadError):
            err: RuntimeError = exc
        else:
            err = RuntimeError(f"data loading failed at step {step}: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
        self._error = err
        return err

    def _next_sync(self) -> tuple[Batch[T] | None, float]:
        t0 = time.perf_counter()
        step = self.next_step
        try:
            end = self._loop.run_until_complete(self.loader.end_step())
            bound = self._limit if end is None else (end if self._limit is None else min(end, self._limit))
            if bound is not None and step >= bound:
                return None, 0.0
            if not self._read_ahead:
                self._read_ahead.append(self.loader.read_ahead(step, bound))
            batch = self._loop.run_until_complete(self.loader.fetch(step, self._read_ahead[0]))
        except DatasetExhausted:
            return None, 0.0
        except Exception as e:  # noqa: BLE001 -- re-raised with the step
            raise self._fail(step, e)
        return batch, time.perf_counter() - t0

    def _next_prefetched(self) -> tuple[Batch[T] | None, float]:
        step = self.next_step
        t0 = time.perf_counter()
        kind, value = self._prefetcher.take(step)
        waited = time.perf_counter() - t0
        if kind == "end":
            return None, waited
        if kind == "error":
            raise self._fail(step, value)
        return value, waited

    def __next__(self) -> Batch[T]:
        if self._error is not None:
            raise self._error
        if self._finished:
            raise StopIteration
        batch, waited = self._next_sync() if self._prefetcher is None else self._next_prefetched()
        if batch is None:
            self._finished = True
            self.close()
            raise StopIteration
        if batch.step != self.next_step:  # the reorder buffer's invariant; never expected to fire
            raise AssertionError(f"loader produced step {batch.step} where {self.next_step} was due")
        self.wait_seconds[batch.step] = waited
        self.next_step += 1
        return dataclasses.replace(batch, wait_seconds=waited)

    def close(self) -> None:
        """Stop background work; safe to call more than once. Later ``next()`` calls stop iteration."""
        self._finished = True
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

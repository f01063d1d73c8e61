"""The data loader: step-ordered batches, fetched ahead concurrently, yielded strictly in order.

For step ``s`` the loader asks the dataset for exactly this process's rows of
``[offset(s), offset(s) + B(s))`` (offsets from the :class:`~levanter.schedule.BatchSchedule`), ascending,
in one ``get_batch(s, indices)`` call, and builds a pytree of global ``jax.Array`` s whose leading
(batch) axis is sharded over the mesh's data axes. Each yielded :class:`Batch` carries its step, so the
trainer can check it against its own.

Index spaces: **step**; **global index** (``offset(s) + row``); **row** -- a position within the step's
global batch, ``0 <= row < B(s)``. A process's rows are the union of the rows its addressable devices
hold (model-parallel replicas that share rows are read once).

Prefetch: with ``prefetch_depth = d > 0`` a background thread runs an asyncio loop that keeps up to
``d`` steps in flight or waiting to be consumed, so at most ``d`` batches are held at once whatever the
dataset size or step. Fetches run concurrently and may finish in any order; a reorder buffer hands
them out as ``s, s+1, s+2, ...``. ``d = 0`` fetches each step on demand in the caller's thread.
Everything the background work needs (mesh, sharding, process index) is captured explicitly at
construction; nothing reads thread-local context.

End of data: for a finite dataset the last step is the last one whose whole range fits in
``async_len()`` (the same on every process); a trailing partial batch is not yielded. A dataset that
raises :class:`~levanter.data.dataset.DatasetExhausted` ends the iteration at that step too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..schedule import BatchSchedule
from .dataset import AsyncDataset, DatasetExhausted, StackedBatch

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Batch(Generic[T]):
    """One step's global batch.

    ``data`` is a pytree of ``jax.Array`` with leading axis ``batch_size``; ``global_offset`` is the
    first global index; ``wait_seconds`` is how long the consumer blocked waiting for it.
    """

    step: int
    global_offset: int
    batch_size: int
    data: Any
    wait_seconds: float = 0.0


def process_rows(mesh: Mesh, data_axes: tuple[str, ...], batch_size: int, process_index: int) -> np.ndarray:
    """Sorted rows of a ``batch_size`` global batch held by devices of process ``process_index``."""
    sharding = NamedSharding(mesh, PartitionSpec(data_axes))
    rows = set()
    for device, index in sharding.devices_indices_map((batch_size,)).items():
        if device.process_index == process_index:
            sl = index[0]
            rows.update(range(*sl.indices(batch_size)))
    return np.asarray(sorted(rows), dtype=np.int64)


def _stack(examples) -> Any:
    if isinstance(examples, StackedBatch):
        return examples.tree
    if isinstance(examples, np.ndarray):
        return examples
    if len(examples) == 0:
        raise ValueError("cannot stack an empty batch")
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *examples)


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
    ):
        self.dataset = dataset
        self.schedule = batch_size if isinstance(batch_size, BatchSchedule) else BatchSchedule(batch_size)
        if mesh is None:
            mesh = Mesh(np.asarray(jax.local_devices()[:1]), ("data",))
            data_axis = "data"
        self.mesh = mesh
        self.data_axes: tuple[str, ...] = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
        for ax in self.data_axes:
            if ax not in mesh.axis_names:
                raise ValueError(f"data axis {ax!r} is not an axis of the mesh {dict(mesh.shape)}")
        if prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
        self.prefetch_depth = prefetch_depth
        self.process_index = jax.process_index() if process_index is None else process_index
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

    def indices_for_step(self, step: int) -> np.ndarray:
        """The global indices this process requests for ``step``, ascending."""
        first = self.schedule.global_data_offset_by_step(step)
        return first + self.local_rows(self.schedule.batch_size_at_step(step))

    async def end_step(self) -> int | None:
        """One past the last step whose whole batch lies inside a finite dataset; None if infinite."""
        if not self._end_known:
            if self.dataset.is_finite():
                n = await self.dataset.async_len()
                self._end_step = self.schedule.find_step_containing_offset(n)
            self._end_known = True
        return self._end_step

    # -- fetching ------------------------------------------------------------------------------------
    async def fetch(self, step: int) -> Batch[T]:
        """Read and assemble one step's batch (no ordering guarantees; used by the iterators)."""
        bs = self.schedule.batch_size_at_step(step)
        first = self.schedule.global_data_offset_by_step(step)
        rows = self.local_rows(bs)
        examples = await self.dataset.get_batch(step, first + rows)
        if len(examples) != len(rows):
            raise ValueError(f"dataset returned {len(examples)} examples for {len(rows)} indices at step {step}")
        data = await asyncio.to_thread(self._assemble, examples, rows, bs)
        return Batch(step=step, global_offset=first, batch_size=bs, data=data)

    def _assemble(self, examples, rows: np.ndarray, batch_size: int):
        local = _stack(examples)

        def to_global(leaf):
            leaf = np.asarray(leaf)
            shape = (batch_size,) + leaf.shape[1:]

            def cb(index):
                sl = index[0] if index else slice(None)
                start, stop, _ = sl.indices(batch_size)
                lo = int(np.searchsorted(rows, start))
                return leaf[lo : lo + (stop - start)]

            return jax.make_array_from_callback(shape, self.sharding, cb)

        return jax.tree.map(to_global, local)

    def iter_from_step(self, step: int = 0, end_step: int | None = None) -> "DataLoaderIterator[T]":
        """Batches for steps ``step, step+1, ...`` (up to ``end_step``, exclusive, if given)."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        return DataLoaderIterator(self, step, end_step)

    def __iter__(self) -> Iterator[Batch[T]]:
        return self.iter_from_step(0)


_END = object()


class DataLoaderIterator(Iterator[Batch[T]]):
    """Yields ``Batch`` objects strictly in step order; see the module docstring."""

    def __init__(self, loader: DataLoader[T], start: int, end: int | None):
        self.loader = loader
        self.next_step = start
        self._limit = end
        self.wait_seconds: dict[int, float] = {}
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._finished = False
        if loader.prefetch_depth > 0:
            self._cond = threading.Condition()
            self._ready: dict[int, tuple[str, Any]] = {}
            self._taken = start
            self._wake: asyncio.Event | None = None
            self._thread = threading.Thread(target=self._run, name="levanter-data-prefetch", daemon=True)
            self._thread.start()

    # -- synchronous mode ----------------------------------------------------------------------------
    def _bound(self, end_step: int | None) -> int | None:
        if end_step is None:
            return self._limit
        return end_step if self._limit is None else min(end_step, self._limit)

    def _next_sync(self) -> Batch[T]:
        t0 = time.perf_counter()
        bound = self._bound(self._loop.run_until_complete(self.loader.end_step()))
        if bound is not None and self.next_step >= bound:
            raise StopIteration
        try:
            batch = self._loop.run_until_complete(self.loader.fetch(self.next_step))
        except DatasetExhausted:
            raise StopIteration from None
        return self._deliver(batch, time.perf_counter() - t0)

    # -- prefetch mode -------------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._produce())
        finally:
            self._loop.close()

    def _post(self, step: int, kind: str, value: Any) -> None:
        with self._cond:
            self._ready[step] = (kind, value)
            self._cond.notify_all()

    async def _produce(self) -> None:
        self._wake = asyncio.Event()
        depth = self.loader.prefetch_depth
        tasks: dict[int, asyncio.Task] = {}
        launch = deliver = self.next_step
        try:
            bound = self._bound(await self.loader.end_step())
            while not self._closed:
                while (bound is None or launch < bound) and launch - self._taken < depth:
                    tasks[launch] = asyncio.create_task(self.loader.fetch(launch))
                    launch += 1
                if deliver not in tasks:
                    if bound is not None and deliver >= bound:
                        self._post(deliver, "end", None)
                        return
                    # Everything launched was delivered: wait for the consumer to free a slot. Clear
                    # before re-checking so a wake-up between the two is not lost.
                    self._wake.clear()
                    if launch - self._taken >= depth and not self._closed:
                        await self._wake.wait()
                    continue
                task = tasks[deliver]
                if not task.done():
                    # Wake on this step finishing or on the consumer freeing a slot (to launch more).
                    self._wake.clear()
                    waiter = asyncio.ensure_future(self._wake.wait())
                    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    continue
                del tasks[deliver]
                exc = task.exception()
                if isinstance(exc, DatasetExhausted):
                    self._post(deliver, "end", None)
                    return
                if exc is not None:
                    self._post(deliver, "error", exc)
                    return
                self._post(deliver, "ok", task.result())
                deliver += 1
        except BaseException as e:  # noqa: BLE001 -- surfaced to the consumer
            self._post(deliver, "error", e)
        finally:
            for t in tasks.values():
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks.values(), return_exceptions=True)

    def _next_prefetched(self) -> Batch[T]:
        step = self.next_step
        t0 = time.perf_counter()
        with self._cond:
            while step not in self._ready:
                self._cond.wait()
            kind, value = self._ready.pop(step)
        waited = time.perf_counter() - t0
        if kind == "end":
            raise StopIteration
        if kind == "error":
            raise RuntimeError(f"data loading failed at step {step}: {value}") from value
        self._taken = step + 1
        if self._wake is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # loop already closed
                pass
        return self._deliver(value, waited)

    # -- common --------------------------------------------------------------------------------------
    def _deliver(self, batch: Batch[T], waited: float) -> Batch[T]:
        if batch.step != self.next_step:  # the reorder buffer's invariant; never expected to fire
            raise AssertionError(f"loader produced step {batch.step} where {self.next_step} was due")
        self.wait_seconds[batch.step] = waited
        self.next_step += 1
        return dataclasses.replace(batch, wait_seconds=waited)

    def __next__(self) -> Batch[T]:
        if self._closed or self._finished:
            raise StopIteration
        try:
            if self.loader.prefetch_depth == 0:
                return self._next_sync()
            return self._next_prefetched()
        except StopIteration:
            self._finished = True
            raise

    def close(self) -> None:
        """Stop background work; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self.loader.prefetch_depth > 0:
            if self._wake is not None and not self._loop.is_closed():
                try:
                    self._loop.call_soon_threadsafe(self._wake.set)
                except RuntimeError:
                    pass
            self._thread.join(timeout=10)
        elif not self._loop.is_closed():
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass

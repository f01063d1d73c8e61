"""Reads of views of one or many stores as single tensorstore operations, and awaiting them from asyncio.

Every read of a store goes through :func:`read_view`: one call, one tensorstore operation. The store's own
row and window reads use it, and so do :func:`read_stacked` and :func:`read_blocks`, which read views of
several stores (every source of a mixture step) in one operation and one completion. Tests count reads
by wrapping :func:`read_view`.

:func:`awaited` bridges a tensorstore future to the running event loop without tensorstore's own
``__await__``, which wakes a closed loop from a tensorstore thread, and without ever cancelling a read
(see its docstring for the deadlock that avoids).

Trade-off: one-dimensional views are concatenated into one flat read and reshaped afterwards
(:class:`_Reshaped`), which needs equal lengths, checked only when the result arrives; that is the
cheapest view to build per window, and one read that fills the result directly is faster than per-window
reads stacked afterwards (docs/bench/2026-12-03-cpu-levers.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

__all__ = ["read_view", "awaited", "read_stacked", "read_blocks"]


def read_view(view: ts.TensorStore) -> ts.Future:
    """Start reading ``view``: the one place a store's data is read, one call per tensorstore operation."""
    return view.read()


# Futures handed to ``awaited`` whose done-callback has not run yet, by the id of the asyncio future
# waiting for each (one future may be awaited several times: a coalesced read). Holding them here means
# a future is never deallocated (which unregisters its callback, and waits for a running one) by a thread
# that holds the GIL while the callback waits for the GIL in a tensorstore thread: see ``awaited``.
_callbacks_pending: dict[int, Any] = {}


async def awaited(fut: ts.Future):
    """``await fut`` through our own bridge from tensorstore's thread to the event loop.

    tensorstore's own ``__await__`` wakes the loop from a tensorstore thread even after the loop has
    closed (a loader closed mid-read), which prints "Event loop is closed" tracebacks; this bridge drops
    the wake-up instead.

    A read whose awaiting task is cancelled is left to finish and its result dropped: it is never
    cancelled. ``Future.cancel()`` (and the deallocation of a future with a registered callback) waits,
    holding the GIL, for a callback that is running in a tensorstore thread -- which needs the GIL to
    finish: a deadlock that froze a loader closed mid-read about once in a few thousand closes under
    load. Only ``on_done`` drops the last reference we hold, from within the callback itself.
    """
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def on_done(f: Any) -> None:
        _callbacks_pending.pop(id(waiter), None)  # ``f`` is ``fut``: still referenced until we return
        try:
            loop.call_soon_threadsafe(_transfer, waiter, f)
        except RuntimeError:  # the loop has closed: nobody waits for this read any more
            pass

    _callbacks_pending[id(waiter)] = fut
    fut.add_done_callback(on_done)
    return await waiter


def _transfer(waiter: asyncio.Future, fut: ts.Future) -> None:
    if waiter.done():  # cancelled meanwhile
        return
    try:
        waiter.set_result(fut.result())
    except BaseException as e:  # noqa: BLE001 -- handed to the awaiting task
        waiter.set_exception(e)


def read_stacked(views: Sequence[ts.TensorStore]):
    """One read of equally shaped views, possibly of different stores: a future of ``array[len(views), ...]``.

    The mixture reads every source's windows of a step with this (see ``ReadPlan`` in
    :mod:`levanter.data.dataset`): one tensorstore operation and one completion per step. One-dimensional
    views (token windows) are concatenated and the result reshaped: a plain slice is the cheapest view
    to make (less Python per window than an origin-0 one), and ``ts.stack`` needs origin 0. Both are
    one read that fills the result directly -- faster than per-window reads stacked afterwards, and far
    faster than one index-array read, which walks an int64 index per element
    (docs/bench/2026-12-03-cpu-levers.md).
    """
    views = list(views)
    if views and views[0].rank == 1:
        shape = (len(views), views[0].shape[0])
        return _Reshaped(read_view(ts.concat(views, axis=0)), shape)
    return read_view(ts.stack([v.translate_to[0] for v in views], axis=0))


def read_blocks(blocks: Sequence[ts.TensorStore]):
    """One read of 2-D views (:meth:`JaggedArrayStore.window_block`, possibly of different stores) with
    equal row shapes: a future of their rows, concatenated."""
    blocks = list(blocks)
    view = ts.concat(blocks, axis=0) if len(blocks) > 1 else blocks[0]
    return read_view(view)


class _Reshaped:
    """A tensorstore future whose result is reshaped: what :func:`awaited` and callers of ``result()`` use."""

    __slots__ = ("_future", "_shape")

    def __init__(self, future: ts.Future, shape: tuple[int, ...]):
        self._future = future
        self._shape = shape

    def result(self) -> np.ndarray:
        flat = self._future.result()
        if flat.size != int(np.prod(self._shape)):
            raise ValueError(
                f"read_stacked: views of unequal lengths (read {flat.size} values for {self._shape})"
            )
        return flat.reshape(self._shape)

    def add_done_callback(self, callback) -> None:
        self._future.add_done_callback(lambda _: callback(self))

    def done(self) -> bool:
        return self._future.done()

"""The prefetching half of a data loader's iterator: a background thread that reads steps ahead.

With ``prefetch_depth = d > 0`` a background thread runs an asyncio loop that keeps up to ``d`` steps in
flight or waiting to be consumed, so at most ``d`` batches are held at once whatever the dataset size or
step. Fetches run concurrently and may finish in any order; a reorder buffer hands them out as ``s, s+1,
s+2, ...``. Slots freed by the consumer are refilled in halves; the producer looks for them itself, and
``next()`` wakes it only when few steps are left ahead (a wake-up costs the consumer the GIL while the
producer works).

Trade-off: refilling in halves keeps the cross-thread wake-ups to one per ``d / 2`` steps, at the price
of a producer that polls (at most some 60 times a second when idle) instead of being told of every slot.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from .read_ahead import ReadAhead
from .read_plan import DatasetExhausted

__all__ = ["Prefetcher"]


class Prefetcher:
    """The background half of a prefetching iterator: a thread running an asyncio loop that keeps up
    to ``depth`` steps in flight or waiting, and posts results by step into ``ready``.

    It is handed what it runs, not the loader: ``fetch(step, read_ahead)`` (one step's batch),
    ``end_step()`` (one past the data's last step, or None) and ``read_ahead(start, bound)`` (the
    iterator's read-ahead). It holds no reference to the iterator, so an iterator dropped without
    ``close()`` is collected and its finalizer stops this thread.
    """

    def __init__(
        self,
        fetch: Callable[[int, ReadAhead | None], Awaitable[Any]],
        end_step: Callable[[], Awaitable[int | None]],
        read_ahead: Callable[[int, int | None], ReadAhead | None],
        depth: int,
        start: int,
        limit: int | None,
    ):
        self._fetch, self._end_step, self._read_ahead = fetch, end_step, read_ahead
        self.depth = depth
        self.limit = limit
        self.cond = threading.Condition()
        self.ready: dict[int, tuple[str, Any]] = {}
        self.taken = start  # the next step the consumer will take; written by the consumer only
        self.closed = False
        self.loop = asyncio.new_event_loop()
        self.wake: asyncio.Event | None = None
        self.waiting = False  # the producer is (about to be) blocked on ``wake``
        self.launched = start  # one past the last step launched; written by the producer only
        self.poll = _ROOM_POLL_SECONDS[0]  # the producer's next look for room, if nothing wakes it first
        self._start = start
        self.thread = threading.Thread(target=self._run, name="levanter-data-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._produce())
        finally:
            self.loop.close()

    def _post(self, step: int, kind: str, value: Any) -> None:
        self._post_many([(step, (kind, value))])

    def _post_many(self, items: list[tuple[int, tuple[str, Any]]]) -> None:
        # One lock and one wake-up of the consumer for all the steps that are ready: a wake-up is a
        # syscall and a thread switch, paid per step when every step was posted alone.
        with self.cond:
            self.ready.update(items)
            self.cond.notify_all()

    async def _produce(self) -> None:
        wake = self.wake = asyncio.Event()
        tasks: dict[int, asyncio.Task] = {}
        launch = deliver = self._start
        read_ahead = None
        try:
            end = await self._end_step()
            bound = self.limit if end is None else (end if self.limit is None else min(end, self.limit))
            # Fed by this window: the steps launched are the steps the read-ahead groups and reads.
            read_ahead = self._read_ahead(self._start, bound)
            while not self.closed:
                # The first step is fetched alone so that it does not compete with the read-ahead: time
                # to first batch is one fetch, whatever the depth.
                window = 1 if deliver == self._start else self.depth
                while (bound is None or launch < bound) and launch - self.taken < window:
                    task = tasks[launch] = asyncio.create_task(self._fetch(launch, read_ahead))
                    task.add_done_callback(_set_event(wake))
                    launch += 1
                    self.poll = _ROOM_POLL_SECONDS[0]
                self.launched = launch
                # Clear before re-checking so that a wake-up between the check and the wait is kept.
                wake.clear()
                if deliver not in tasks:
                    if bound is not None and deliver >= bound:
                        self._post(deliver, "end", None)
                        return
                    # Everything launched was delivered: wait until the consumer has freed half the slots.
                    await self._wait_unless(wake, lambda: self._room(launch, self.depth))
                    continue
                task = tasks[deliver]
                if not task.done():
                    # Wake on any fetch finishing, or on the consumer freeing half the slots (launch more).
                    await self._wait_unless(
                        wake, lambda: (bound is None or launch < bound) and self._room(launch, window)
                    )
                    continue
                # Hand over every step finished in order so far, together.
                ready: list[tuple[int, tuple[str, Any]]] = []
                last: tuple[str, Any] | None = None
                while task is not None and task.done():
                    del tasks[deliver]
                    exc = task.exception()
                    if isinstance(exc, DatasetExhausted):
                        last = ("end", None)
                    elif exc is not None:
                        last = ("error", exc)
                    if last is not None:
                        ready.append((deliver, last))
                        break
                    ready.append((deliver, ("ok", task.result())))
                    deliver += 1
                    task = tasks.get(deliver)
                self._post_many(ready)
                if last is not None:
                    return
        except BaseException as e:  # noqa: BLE001 -- surfaced to the consumer
            self._post(deliver, "error", e)
        finally:
            for t in tasks.values():
                t.cancel()
            pending = list(tasks.values()) + (read_ahead.close() if read_ahead is not None else [])
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    def _room(self, launch: int, window: int) -> bool:
        """Whether the producer should launch more: half of ``window`` is free. Launching (and waking the
        producer) per freed slot costs a cross-thread wake-up per step -- the largest cost left in a
        small batch's step once its reads are coalesced; in halves, one per ``window / 2`` steps, while
        the other half stays fetched ahead."""
        return launch - self.taken <= window // 2

    async def _wait_unless(self, wake: asyncio.Event, can_go_on: Callable[[], bool]) -> None:
        """Wait for ``wake``, or at most ``self.poll`` (doubled after each wait, down to the least of
        ``_ROOM_POLL_SECONDS`` after each launch), unless ``can_go_on()`` (re-checked after announcing the
        wait, so a consumer that leaves few steps ahead in between either is seen here or sees
        ``waiting`` and nudges)."""
        self.waiting = True
        try:
            if not can_go_on() and not self.closed:
                timer = self.loop.call_later(self.poll, wake.set)
                self.poll = min(2 * self.poll, _ROOM_POLL_SECONDS[1])
                try:
                    await wake.wait()
                finally:
                    timer.cancel()
        finally:
            self.waiting = False

    def take(self, step: int) -> tuple[str, Any]:
        with self.cond:
            while step not in self.ready:
                self.cond.wait()
            item = self.ready.pop(step)
        self.taken = step + 1
        # Wake the producer only if it waits and few steps are left ahead (``launched`` read after
        # ``waiting``, both published before the producer re-checks ``taken``); with room for half the
        # window it finds out by itself (``_ROOM_POLL_SECONDS``). A wake-up from here is a syscall
        # after which this thread needs the GIL back while the producer, just woken, fetches a burst of
        # steps: that wait was the tail of the consumer's data wait (docs/bench/2026-12-03-cpu-levers.md).
        if self.waiting and self.launched - self.taken <= self.depth // 4:
            self._nudge()
        return item

    def _nudge(self) -> None:
        if self.wake is not None:
            try:
                self.loop.call_soon_threadsafe(self.wake.set)
            except RuntimeError:  # the loop has already closed
                pass

    def close(self) -> None:
        self.closed = True
        self._nudge()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)


# How often a waiting producer looks for room by itself (the consumer wakes it only when few steps are
# left ahead; see ``Prefetcher.take``): 1 ms after a launch, then twice as long after each look, up to
# 16 ms. A look costs a loop iteration: an idle producer beside slow steps looks some 60 times a
# second, not 1,000; and room is seen at most about as late as it has been waited for so far, while a
# quarter of the window is still fetched ahead.
_ROOM_POLL_SECONDS = (0.001, 0.016)


def _set_event(event: asyncio.Event) -> Callable[[Any], None]:
    return lambda _: event.set()

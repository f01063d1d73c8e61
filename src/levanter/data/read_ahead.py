"""The loader's read-ahead: a sequential reader's upcoming steps read together, in groups, ahead of need.

The loader knows which steps it will ask for (``s, s+1, ...`` from where its iterator started, each for
this process's rows), so it -- not the dataset -- reads ahead. Steps after the iterator's first are cut
into consecutive *groups* (up to :data:`COALESCE_ROWS` rows and :data:`COALESCE_MAX_STEPS` steps of one
batch size). A group is read in one tensorstore operation, planned by the dataset's stateless
``plan`` (one plan per group; the index math of the groups of up to :data:`PLAN_INDICES`
indices and :data:`PLAN_MAX_STEPS` steps in one pass), and
finished once; each step then takes its share of the rows -- and, for a loader that records provenance,
its share of the plan's provenance, computed by the same pass. Any dataset that
:meth:`~levanter.data.dataset.AsyncDataset.plan` answers with plans is read ahead: one source as much as a
mixture; the steps of a group it cannot plan are read one by one. When a step is asked for, its group and the
:data:`GROUPS_AHEAD` groups after it are being read, so a group is read while the ones before it are
served.

Why (figures in ``docs/bench/2026-12-03-cpu-levers.md``): a tensorstore operation costs several times the
reading of a short window, so small batches read alone pay mostly for operations; 128 rows coalesce batches of
up to 64 rows, and 16 steps of 8 rows. The index math costs mostly per pass, not per index, so 128 steps are
planned in one pass. A group read only when due stalled the loader once per group: hence groups in
flight ahead. Memory stays bounded by ``(GROUPS_AHEAD + 1) * COALESCE_ROWS`` rows whatever the dataset
or step.

What is read never changes: a group's rows are, step by step, what ``get_batch(step, indices)`` returns
(the plans' contract). A step is served from its group once; a retry (after a failed group read) and
any step the read-ahead does not cover are read with ``get_batch``. The first step of an iterator is
always read alone, so the time to the first batch is one step's read.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..schedule import as_int
from .dataset import AsyncDataset
from .read_plan import StackedBatch

__all__ = [
    "COALESCE_ROWS",
    "COALESCE_MAX_STEPS",
    "GROUPS_AHEAD",
    "PLAN_INDICES",
    "PLAN_MAX_STEPS",
    "TRIM_GROUPS",
    "MISS",
    "ReadAhead",
]

COALESCE_ROWS = 128
COALESCE_MAX_STEPS = 16
GROUPS_AHEAD = 2
# A planning pass covers whole groups: up to this many indices and this many steps.
PLAN_INDICES = 2048
PLAN_MAX_STEPS = 128

# Bookkeeping of forgotten groups is dropped this many at a time.
TRIM_GROUPS = 256

# What :meth:`ReadAhead.read` returns for a step it does not serve: the caller reads it with get_batch.
MISS = object()


def _retrieve(task: asyncio.Task) -> None:
    # A group read that fails after every step it held was served or dropped: not an unhandled error.
    if not task.cancelled():
        task.exception()


def _rows(whole: Any, lo: int, hi: int):
    if isinstance(whole, StackedBatch):
        tree = whole.tree
        if isinstance(tree, dict):
            return StackedBatch({k: v[lo:hi] for k, v in tree.items()})
        return StackedBatch(jax.tree.map(lambda leaf: leaf[lo:hi], tree))
    return whole[lo:hi]


class ReadAhead:
    """Read-ahead for one iterator's steps from ``start`` (exclusive: it is read alone) up to ``bound``.

    Args:
        dataset: the dataset (read through its :meth:`~levanter.data.dataset.AsyncDataset.plan`).
        indices_for_step: the global indices the iterator asks for at a step (this process's rows).
        start: the iterator's first step.
        bound: one past the last step the iterator will ask for, or None.
        where_for_step: the global indices whose provenance a step needs (its whole batch), or None
            when no provenance is wanted.

    Lives on the event loop that reads: its state is touched from that loop's thread only.
    """

    def __init__(self, dataset: AsyncDataset, indices_for_step: Callable[[int], np.ndarray], start: int,
                 bound: int | None, where_for_step: Callable[[int], np.ndarray] | None = None):
        self.dataset = dataset
        self.indices_for_step = indices_for_step
        self.where_for_step = where_for_step
        self.start = as_int(start, what="start")
        self.bound = None if bound is None else as_int(bound, what="bound")
        start = self.start
        # Groups, consecutive from start + 1, numbered from 0: group g is ``_groups[g - _g0]`` = (first
        # step, end step); a one-step group is not read ahead. Groups before ``_g0`` are forgotten, so
        # what is held stays bounded however long the run (see _forget_before).
        self._g0 = 0
        self._groups: list[tuple[int, int]] = []
        self._group_starts: list[int] = []
        self._pass_of: list[int] = []  # planning pass of each group from _g0 that has one
        self._next_first = start + 1
        self._ended = False
        self._plans: dict[int, asyncio.Task] = {}  # planning pass number -> task of its groups' plans
        self._pass_starts: dict[int, int] = {}  # planning pass number -> its first group
        self._num_passes = 0
        self._reads: dict[int, asyncio.Task] = {}  # group number -> task of its finished rows (or None)
        self._taken: set[int] = set()  # steps served from a group: a second request reads afresh

    # -- groups --------------------------------------------------------------------------------------
    def _num_groups(self) -> int:
        return self._g0 + len(self._groups)

    def _group(self, g: int) -> tuple[int, int]:
        return self._groups[g - self._g0]

    def _extend(self) -> bool:
        """Cut the next group; False once the iterator's steps are all grouped."""
        first = self._next_first
        if self._ended or (self.bound is not None and first >= self.bound):
            self._ended = True
            return False
        n = self.indices_for_step(first).size
        end, rows = first + 1, n
        if n and 2 * n <= COALESCE_ROWS:
            while end - first < COALESCE_MAX_STEPS and rows + n <= COALESCE_ROWS:
                if (self.bound is not None and end >= self.bound) or self.indices_for_step(end).size != n:
                    break
                rows += n
                end += 1
        self._groups.append((first, end))
        self._group_starts.append(first)
        self._next_first = end
        return True

    def _group_of(self, step: int) -> int | None:
        """The group holding ``step``; None past the iterator's steps or before the groups still held."""
        while self._next_first <= step:
            if not self._extend():
                return None
        i = bisect.bisect_right(self._group_starts, step) - 1
        return self._g0 + i if i >= 0 else None

    # -- reads ---------------------------------------------------------------------------------------
    async def read(self, step: int):
        """``(rows, provenance)`` of ``step`` from its group's read (provenance None unless asked for at
        construction), or :data:`MISS`: read it with ``get_batch``."""
        if step <= self.start or step in self._taken:
            return MISS
        g = self._group_of(step)
        if g is None:
            return MISS
        if self._pass_of_group(g) not in self._pass_starts:
            return MISS  # a group of a planning pass already forgotten (asked for late)
        first, end = self._group(g)
        if end - first == 1:
            self._forget_before(g)
            return MISS
        self._taken.add(step)
        task = self._reads.get(g)
        if task is None:
            task = self._start(g)
        for ahead in range(g + 1, g + 1 + GROUPS_AHEAD):
            if ahead >= self._num_groups() and not self._extend():
                break
            if ahead not in self._reads:
                self._start(ahead)
        self._forget_before(g)
        result = await task
        if result is None:
            return MISS
        whole, n, provenance, w = result
        lo = (step - first) * n
        if provenance is not None:
            provenance = {k: v[(step - first) * w : (step - first + 1) * w] for k, v in provenance.items()}
        return _rows(whole, lo, lo + n), provenance

    def _start(self, g: int) -> asyncio.Task:
        # Everything the read needs from the bookkeeping is taken now, while group g is surely held: the
        # task runs later, when earlier groups may have been forgotten.
        p = self._pass_of_group(g)
        plans = self._plan_pass(p)
        at = g - self._pass_starts[p]
        first = self._group(g)[0]
        rows_per_step = self.indices_for_step(first).size
        where_per_step = 0 if self.where_for_step is None else self.where_for_step(first).size
        task = self._reads[g] = asyncio.ensure_future(self._read_group(plans, at, rows_per_step, where_per_step))
        task.add_done_callback(_retrieve)
        return task

    def _forget_before(self, g: int) -> None:
        """Drop the reads (and served steps) of groups before ``g``, and the bookkeeping of the groups
        and planning passes no read can need any more. The loader asks for its steps in order (each fetch
        asks as soon as its task first runs), so every step of an earlier group has already taken its
        group's read; a step asked for later is read afresh, never wrongly."""
        for old in [k for k in self._reads if k < g]:
            first, end = self._group(old)
            del self._reads[old]
            self._taken.difference_update(range(first, end))
        current = self._pass_of_group(g)
        for old in [k for k in self._plans if k < current]:
            del self._plans[old]
        for old in [k for k in self._pass_starts if k < current]:
            del self._pass_starts[old]
        # Groups before both g and the current pass are never looked up again; trimmed in batches, so
        # the cost per step stays constant.
        keep = min(g, self._pass_starts[current]) if current >= 0 else g
        drop = keep - self._g0
        if drop >= TRIM_GROUPS:
            del self._groups[:drop], self._group_starts[:drop], self._pass_of[:drop]
            self._g0 = keep

    def steps_held(self) -> list[int]:
        """The steps whose group is being read or held, ascending (what the read-ahead costs in memory)."""
        return [s for g in sorted(self._reads) for s in range(*self._group(g))]

    def groups_held(self) -> int:
        """How many groups' bookkeeping is held (bounded whatever the step: a test checks it)."""
        return len(self._groups)

    async def _read_group(self, plans_task: asyncio.Task, at: int, rows_per_step: int, where_per_step: int):
        """``(finished rows of a group's steps back to back, rows per step, provenance of the steps back to
        back or None, provenance rows per step)``, or None where the dataset cannot plan the group (its
        steps are then read one by one). ``at``: the group's place among the groups planned by
        ``plans_task``."""
        plans = await plans_task
        plan = plans[at] if at < len(plans) else None
        if plan is None or (self.where_for_step is not None and plan.provenance is None):
            return None
        return await plan.read(), rows_per_step, plan.provenance, where_per_step

    def _pass_of_group(self, g: int) -> int:
        """The planning pass of group ``g``: passes are cut in order, each from the first group without
        one, taking whole groups while they fit in ``PLAN_INDICES`` indices and ``PLAN_MAX_STEPS`` steps."""
        while self._g0 + len(self._pass_of) <= g:
            first = self._g0 + len(self._pass_of)
            p = self._num_passes
            steps = indices = 0
            k = first
            while k < self._num_groups() or self._extend():
                a, b = self._group(k)
                n = (b - a) * self.indices_for_step(a).size
                if k > first and (steps + b - a > PLAN_MAX_STEPS or indices + n > PLAN_INDICES):
                    break
                steps, indices = steps + b - a, indices + n
                self._pass_of.append(p)
                k += 1
            if k == first:  # no group left to plan: the steps have ended
                return -1
            self._pass_starts[p] = first
            self._num_passes += 1
        return self._pass_of[g - self._g0]

    def _plan_pass(self, p: int) -> asyncio.Task:
        task = self._plans.get(p)
        if task is None:
            # The pass's groups are taken now (the task runs later, when older groups may be forgotten).
            first = self._pass_starts[p]
            end = self._pass_starts.get(p + 1, self._g0 + len(self._pass_of))
            groups = self._groups[first - self._g0 : end - self._g0]
            task = self._plans[p] = asyncio.ensure_future(self._plan(groups))
            task.add_done_callback(_retrieve)
        return task

    async def _plan(self, groups: list[tuple[int, int]]) -> list:
        """Plans of ``groups`` (one planning pass; None for a one-step group), with their index math in
        one pass. A group the dataset cannot plan (past its end, say) gets None."""
        steps = [s for first, end in groups for s in range(first, end)]
        if not steps:
            return []
        try:
            where = None if self.where_for_step is None else [self.where_for_step(s) for s in steps]
            plans = await self.dataset.plan(
                steps, [self.indices_for_step(s) for s in steps], [end - first for first, end in groups], where
            )
        except Exception:  # noqa: BLE001 -- e.g. the end of the data: each step's get_batch says so itself
            return [None] * len(groups)
        return [None if end - first == 1 else plan for (first, end), plan in zip(groups, plans)]

    def close(self) -> list[asyncio.Task]:
        """Cancel the reads and plans still pending; returns them (to be awaited by the loop's owner)."""
        pending = [t for t in (*self._reads.values(), *self._plans.values()) if not t.done()]
        for t in pending:
            t.cancel()
        self._reads, self._plans = {}, {}
        return pending

"""How a mixture reads what its layout drew: the plans of a group of steps, and one step's merged read.

The mixture (:mod:`levanter.data.mixture`) works out, for every step asked for, which source fills each
row and at which index (a :class:`StepDraws` per step, in one index-math pass). This module turns those
draws into one :class:`~levanter.data.read_plan.ReadPlan`:

* a group of steps whose sources all plan token windows that finish alike (one ``row_key``): each present
  source plans its rows of all the steps at once; the views (or index-array blocks) of all sources are
  read in one tensorstore operation, put in batch order by one gather and finished once (:func:`group_plan`);
* otherwise, for one step, a plan whose ``fetch`` reads each source's rows -- all sources' views in one
  operation where they agree in shape and dtype, each finished by its own plan, or each source's
  ``get_batch`` -- and merges them into the batch (:func:`merged_plan`). Several steps of such sources
  are not planned together: each is read on its own.

Both return, row for row, what reading every source's rows with ``get_batch`` and merging them would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .dataset import AsyncDataset
from .read_plan import ReadPlan, StackedBatch

__all__ = ["StepDraws", "group_plan", "merged_plan"]


@dataclasses.dataclass(frozen=True)
class StepDraws:
    """The reads behind one ``get_batch(step, indices)`` of a mixture."""

    step: int
    indices: np.ndarray  # the global indices asked for
    sources: list  # present source ids, ascending
    selections: list  # per present source: positions in ``indices`` it fills, ascending
    datasets: list  # per present source: the dataset read (below the source's shuffle)
    inner: list  # per present source: indices into that dataset
    provenance: dict | None = None  # ``source`` and ``source_index`` of the ``where`` indices, if asked


def _gather_rows(gather: np.ndarray, finish: Callable, rows: np.ndarray):
    """``finish`` of ``rows`` put in the order ``gather`` (row-wise finishes: the same as gathering after)."""
    return finish(rows[gather])


def _view_kinds(plans: list) -> set:
    """``(shape, dtype)`` of the plans' views (a plan's views share them: one view per plan is enough)."""
    return {(tuple(p.views[0].shape), p.views[0].dtype) for p in plans if p.views}


async def group_plan(group: Sequence[StepDraws]) -> ReadPlan | None:
    """One plan for the rows of every step of ``group``, back to back, or None where a source cannot plan
    its rows or the sources' plans do not finish alike (a shared ``row_key``) or read alike."""
    by_source: dict[int, tuple] = {}
    first_row = 0
    for d in group:
        for src, sel, dataset, idx in zip(d.sources, d.selections, d.datasets, d.inner):
            entry = by_source.get(src)
            if entry is None:
                entry = by_source[src] = (dataset, [], [], [])
            entry[1].append(d.step)
            entry[2].append(idx)
            entry[3].append(sel + first_row)
        first_row += d.indices.size
    if not by_source:
        return None
    plans, group_rows = [], []
    for src in sorted(by_source):
        dataset, steps, indices, rows = by_source[src]
        (plan,) = await dataset.plan(steps, indices)
        if plan is None or not plan.reads_windows or plan.row_key is None or (
            plans and plan.row_key != plans[0].row_key
        ):
            return None
        n = sum(i.size for i in indices)
        if plan.num_rows != n:
            raise ValueError(f"a read plan has {plan.num_rows} rows for {n} indices")
        plans.append(plan)
        group_rows.extend(rows)
    order = np.concatenate(group_rows)  # the read's row i is the group's row order[i]
    gather = np.empty_like(order)
    gather[order] = np.arange(order.size, dtype=order.dtype)
    finish = functools.partial(_gather_rows, gather, plans[0].finish)
    blocks = [p.block for p in plans]
    if all(b is not None for b in blocks) and len({(tuple(b.shape[1:]), b.dtype) for b in blocks}) == 1:
        import tensorstore as ts

        block = ts.concat(blocks, axis=0) if len(blocks) > 1 else blocks[0]
        return ReadPlan([], finish, None, block)
    if all(b is None for b in blocks) and len(_view_kinds(plans)) == 1:
        return ReadPlan([v for p in plans for v in p.views], finish, None)
    return None


def merged_plan(draws: StepDraws) -> ReadPlan:
    """A plan for one step whose rows are each present source's examples, merged into batch order."""
    return ReadPlan([], _identity, fetch=functools.partial(_read_merged, draws), fetch_rows=int(draws.indices.size))


def _identity(x: Any) -> Any:
    return x


async def _read_merged(draws: StepDraws) -> Sequence:
    results = await _read_sources(draws)
    selections, n = draws.selections, len(draws.indices)
    if results and all(isinstance(r, StackedBatch) for r in results):

        def merge(*leaves):
            out = np.empty((n,) + leaves[0].shape[1:], dtype=leaves[0].dtype)
            for sel, leaf in zip(selections, leaves):
                out[sel] = leaf
            return out

        return StackedBatch(jax.tree.map(merge, *[r.tree for r in results]))
    if results and all(isinstance(r, np.ndarray) for r in results):
        out = np.empty((n,) + results[0].shape[1:], dtype=results[0].dtype)
        for sel, r in zip(selections, results):
            out[sel] = r
        return out
    out_list: list = [None] * n
    for sel, r in zip(selections, results):
        for pos, ex in zip(sel.tolist(), r):
            out_list[pos] = ex
    return out_list


async def _read_sources(draws: StepDraws) -> list:
    """Each present source's examples. When every source plans its read as views (or index-array blocks)
    that agree in shape and dtype, all of them are read in one tensorstore operation and each finished by
    its own plan; otherwise each source is read with ``get_batch``, concurrently."""
    datasets: list[AsyncDataset] = draws.datasets
    step = draws.step
    # Planning does no I/O: awaited in turn, not as tasks (three tasks per step cost more than the plans).
    plans = [(await d.plan([step], [idx]))[0] for d, idx in zip(datasets, draws.inner)]
    fut = _one_read(plans) if plans and all(p is not None and p.reads_windows for p in plans) else None
    if fut is None:
        return list(await asyncio.gather(*[d.get_batch(step, idx) for d, idx in zip(datasets, draws.inner)]))
    from ..store.batched_reads import awaited

    rows = await awaited(fut)
    out, start = [], 0
    for p in plans:
        out.append(p.finish(rows[start : start + p.num_rows]))
        start += p.num_rows
    return out


def _one_read(plans: list):
    """One tensorstore read of all the plans' rows, back to back, or None where they do not read alike."""
    from ..store.batched_reads import read_blocks, read_stacked

    blocks = [p.block for p in plans]
    if all(b is not None for b in blocks) and len({(tuple(b.shape[1:]), b.dtype) for b in blocks}) == 1:
        return read_blocks(blocks)
    # A plan's views share shape and dtype (ReadPlan's contract): one view per plan is compared.
    if all(b is None for b in blocks) and len(_view_kinds(plans)) == 1:
        return read_stacked([v for p in plans for v in p.views])
    return None

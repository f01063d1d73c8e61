"""A mixture of named sources whose stage is chosen by the training step it is told.

Index spaces:

* **step** -- the training step passed to ``get_batch``; it alone selects the *stage*.
* **global index** -- the mixture's own index (training order); step ``s`` owns
  ``[offset(s), offset(s) + B(s))`` under the run's :class:`~levanter.schedule.BatchSchedule`.
* **stage position** -- ``global index - offset(stage start step)``.
* **block / position in block** -- stage positions cut into blocks of ``block_size`` (or one block per
  step when ``block_size`` is None).
* **source index** -- an index into one source (before its stop strategy wraps it).

Layout. Stage ``j`` (weights ``w_j``, from step ``t_j``) starts a fresh sequence of blocks at global
index ``offset(t_j)``, so a stage may start at *any* step whatever the batch and block sizes. A block of
``K`` positions holds exactly ``LR(w_j, K)`` examples of each source (largest-remainder rounding, ties
to the earlier source), at positions fixed by a Feistel permutation keyed on ``(key, j, block)``.
Within a block a source's examples take consecutive source indices in position order. The last block
of a stage is laid out as if whole and cut where the next stage starts: nothing before a switch depends
on where the switch is, and the cut block's per-source counts are counted exactly.

Source indices continue across stages with neither gap nor repeat: ``consumed_before_stage[j]`` are
prefix sums over stages, and within a stage the count before a block is ``block * LR(w_j, K)``
(``block_size=None``: a sum over the schedule's constant-batch segments). A lookup is O(#stages +
#schedule segments), independent of the step.

Stop strategies (for finite sources):

* ``restart`` -- a finite source wraps (source index mod its length); the mixture is infinite.
* ``first_exhausted`` -- the mixture ends at the first global index whose source has no example left.
* ``all_exhausted`` -- the mixture ends after the global index that draws the last example of the
  last source to run out; sources that ran out earlier wrap meanwhile. If some drawn source is never
  drawn to its end (its weight falls to zero first), the end is never reached.

Reading past the end raises :class:`~levanter.data.dataset.DatasetExhausted`.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import functools
import math
import numbers
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, TypeVar

import jax
import numpy as np

from ..schedule import BatchSchedule
from ._prp import FeistelPermutation, derive_seed, permute_many, seed_from_key
from .dataset import AsyncDataset, DatasetExhausted, PermutationDataset, StackedBatch, as_index_array

T = TypeVar("T")

STOP_STRATEGIES = ("restart", "first_exhausted", "all_exhausted")


def largest_remainder_counts(fractions: Sequence[Fraction], total: int) -> np.ndarray:
    """Integer counts summing to ``total``, each ``floor(f*total)`` or one more (ties: earlier first)."""
    quotas = [f * total for f in fractions]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return np.asarray(counts, dtype=np.int64)


def _normalize_stages(weights, names: Sequence[str]) -> list[tuple[int, list[Fraction]]]:
    """Validate ``weights`` (a mapping, or ``[(start_step, mapping), ...]``) into normalised stages."""
    if isinstance(weights, Mapping):
        raw_stages = [(0, weights)]
    elif isinstance(weights, Sequence) and not isinstance(weights, str):
        raw_stages = []
        for k, entry in enumerate(weights):
            if not (isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) == 2):
                raise ValueError(f"weights stage {k}: expected [start_step, {{source: weight}}], got {entry!r}")
            raw_stages.append((entry[0], entry[1]))
    else:
        raise ValueError(f"weights: expected a mapping or a list of [start_step, mapping], got {weights!r}")
    if not raw_stages:
        raise ValueError("weights: no stages given")

    stages = []
    for k, (start, mapping) in enumerate(raw_stages):
        if not isinstance(start, numbers.Integral) or isinstance(start, bool):
            raise ValueError(f"weights stage {k}: start step must be an integer, got {start!r}")
        if not isinstance(mapping, Mapping):
            raise ValueError(f"weights stage {k} (step {start}): expected a mapping of source -> weight")
        unknown = [n for n in mapping if n not in names]
        if unknown:
            raise ValueError(
                f"weights stage {k} (step {start}): unknown source {unknown[0]!r}; known sources: {list(names)}"
            )
        fr = []
        for n in names:
            w = mapping.get(n, 0)
            if not isinstance(w, numbers.Real) or isinstance(w, bool) or not math.isfinite(w):
                raise ValueError(f"weights stage {k} (step {start}): weight of {n!r} must be a finite number, got {w!r}")
            if w < 0:
                raise ValueError(f"weights stage {k} (step {start}): weight of {n!r} is negative ({w})")
            fr.append(Fraction(w))
        total = sum(fr)
        if total == 0:
            raise ValueError(f"weights stage {k} (step {start}): all weights are zero")
        stages.append((int(start), [f / total for f in fr]))

    if stages[0][0] != 0:
        raise ValueError(f"weights: the first stage must start at step 0, got step {stages[0][0]}")
    for (a, _), (b, _) in zip(stages, stages[1:]):
        if b <= a:
            raise ValueError(f"weights: stage start steps must be strictly increasing, got {a} then {b}")
    return stages


class _BlockLayout:
    """Which source, and which rank within that source, sits at each position of one block."""

    __slots__ = ("source", "rank")

    def __init__(self, counts: np.ndarray, seed: int):
        size = int(counts.sum())
        slots = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        self.source = slots[FeistelPermutation(size, seed)(np.arange(size, dtype=np.int64))]
        order = np.argsort(self.source, kind="stable")
        group_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.rank = np.empty(size, dtype=np.int64)
        self.rank[order] = np.arange(size, dtype=np.int64) - group_start[self.source[order]]


# How far a sequential reader's steps are planned at once (see MixtureDataset._draws): about this many
# indices, at most this many steps. A plan's cost is mostly per pass, not per index (~1.9 ms for 64 steps
# of 8 rows): 128 steps of 8 rows measured ~1.1x the loader's throughput at 8x64 over 32 steps.
_PLAN_AHEAD_INDICES = 2048
_PLAN_AHEAD_MAX_STEPS = 128
# A sequential reader's steps planned ahead are read together, up to this many rows in one tensorstore
# operation (``_CoalescedRead``). An operation costs ~0.45 ms on top of ~20 us per window of 1024 tokens
# (2 cores, measured): a batch of 8 paid the first 4x over. 128 rows: batches of <= 64 rows coalesce;
# batches of 8 coalesce 16 steps (8 steps measured ~0.85x the throughput at 8x64).
_COALESCE_ROWS = 128
_COALESCE_MAX_STEPS = 16
# Groups of steps whose coalesced reads are in flight ahead of the group being served (see
# ``MixtureDataset._read_next_group``).
_GROUPS_AHEAD = 2
# Rows read ahead are kept for steps at most this far past the one being served.
_READS_KEPT_STEPS = _PLAN_AHEAD_MAX_STEPS + (_GROUPS_AHEAD + 1) * _COALESCE_MAX_STEPS


@dataclasses.dataclass(frozen=True)
class _StepDraws:
    """The reads behind one ``get_batch(step, indices)`` of a mixture."""

    indices: np.ndarray  # the global indices asked for
    sources: list  # present source ids, ascending
    selections: list  # per present source: positions in ``indices`` it fills, ascending
    datasets: list  # per present source: the dataset read (a shuffle's inner one: see ``inner``)
    inner: list  # per present source: indices into that dataset


class _CoalescedRead:
    """One read of the rows of consecutive steps ``[first_step, end_step)`` (each step's in batch order,
    steps in order once finished), finished once when first needed; each step takes its rows
    ``[lo, hi)``. Only plans with a common ``row_key`` are coalesced, so finishing the rows together
    equals finishing each step's alone."""

    __slots__ = ("future", "finish", "finished", "first_step", "end_step")

    def __init__(self, future, finish, first_step: int, end_step: int):
        self.future = future
        self.finish = finish
        self.finished = None
        self.first_step = first_step
        self.end_step = end_step

    async def rows(self, lo: int, hi: int):
        from ..store.jagged_array import awaited

        if self.finished is None:
            read = await awaited(self.future)
            if self.finished is None:  # another step's task may have finished it meanwhile
                self.finished = self.finish(read)
        whole = self.finished
        if isinstance(whole, StackedBatch):
            tree = whole.tree
            if isinstance(tree, dict):
                return StackedBatch({k: v[lo:hi] for k, v in tree.items()})
            return StackedBatch(jax.tree.map(lambda leaf: leaf[lo:hi], tree))
        return whole[lo:hi]


def _gather_rows(gather: np.ndarray, finish: Callable, rows: np.ndarray):
    """``finish`` of ``rows`` put in the order ``gather`` (row-wise finishes: the same as gathering after)."""
    return finish(rows[gather])


def _view_kinds(plans: list) -> set:
    """``(shape, dtype)`` of the plans' views (a plan's views share them: one view per plan is enough)."""
    return {(tuple(p.views[0].shape), p.views[0].dtype) for p in plans if p.views}


def _in_batch_order(draws: _StepDraws, plans: list) -> list:
    """The views of a step's per-source plans, in the order of the rows they fill."""
    ordered: list = [None] * draws.indices.size
    for sel, p in zip(draws.selections, plans):
        if len(p.views) != len(sel):
            raise ValueError(f"a read plan has {len(p.views)} views for {len(sel)} indices")
        for pos, view in zip(sel.tolist(), p.views):
            ordered[pos] = view
    return ordered


class MixtureDataset(AsyncDataset[T]):
    """Draws from ``datasets`` with per-stage ``weights``; the stage comes from the ``step`` argument.

    Args:
        datasets: name -> source. Source order (for tie-breaking and ids) is the mapping's order.
        weights: ``{name: weight}`` (one stage), or ``[(start_step, {name: weight}), ...]`` with start
            steps in **training steps**, the first at 0, strictly increasing. Missing names weigh 0.
        batch_schedule: the run's batch schedule (or a constant batch size).
        block_size: positions per block; ``None`` means one block per step (every batch's composition
            exact).
        key: seed (int or jax PRNG key); required.
        stop_strategy: one of ``restart``, ``first_exhausted``, ``all_exhausted`` (module docstring).
    """

    def __init__(
        self,
        datasets: Mapping[str, AsyncDataset[T]],
        weights,
        *,
        batch_schedule: BatchSchedule | int,
        block_size: int | None = None,
        key,
        stop_strategy: str = "restart",
    ):
        if not datasets:
            raise ValueError("MixtureDataset: no datasets given")
        self.names: tuple[str, ...] = tuple(datasets)
        self.datasets = [datasets[n] for n in self.names]
        self.seed = seed_from_key(key)
        if stop_strategy not in STOP_STRATEGIES:
            raise ValueError(f"stop_strategy: unknown value {stop_strategy!r}; expected one of {STOP_STRATEGIES}")
        self.stop_strategy = stop_strategy
        if block_size is not None and (not isinstance(block_size, numbers.Integral) or block_size < 1):
            raise ValueError(f"block_size must be a positive integer or None, got {block_size!r}")
        self.block_size = None if block_size is None else int(block_size)
        self.schedule = batch_schedule if isinstance(batch_schedule, BatchSchedule) else BatchSchedule(batch_schedule)

        stages = _normalize_stages(weights, self.names)
        self.stage_start_steps: list[int] = [s for s, _ in stages]
        self.stage_fractions: list[list[Fraction]] = [f for _, f in stages]
        self.stage_start_offsets: list[int] = [self.schedule.global_data_offset_by_step(s) for s in self.stage_start_steps]
        self._layouts: OrderedDict[tuple[int, int, int], _BlockLayout] = OrderedDict()
        self._lr_cache: dict[tuple[int, int], np.ndarray] = {}
        # Examples of each source drawn in each whole stage (the last stage is unbounded).
        per_stage = [self._drawn_in_stage(j, self.stage_start_steps[j + 1]) for j in range(len(stages) - 1)]
        self.consumed_before_stage: list[np.ndarray] = [np.zeros(len(self.names), dtype=object)]
        for drawn in per_stage:
            self.consumed_before_stage.append(self.consumed_before_stage[-1] + drawn.astype(object))
        self._lengths: list[int | None] | None = None
        self._planned: dict[int, _StepDraws] = {}  # step -> draws, planned ahead for a sequential reader
        # step -> (its draws, the coalesced read holding its rows, lo, hi): reads started ahead.
        self._reads: dict[int, tuple[_StepDraws, _CoalescedRead, int, int]] = {}
        self._last_step: int | None = None
        self._ungrouped: set[frozenset] = set()  # sets of sources whose rows cannot be planned as a group

    # -- pure index maps ----------------------------------------------------------------------------
    def stage_at_step(self, step: int) -> int:
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        return bisect.bisect_right(self.stage_start_steps, step) - 1

    def counts_per_block(self, stage: int, block_len: int) -> np.ndarray:
        key = (stage, block_len)
        if key not in self._lr_cache:
            self._lr_cache[key] = largest_remainder_counts(self.stage_fractions[stage], block_len)
        return self._lr_cache[key]

    def _layout(self, stage: int, block: int, block_len: int) -> _BlockLayout:
        k = (stage, block, block_len)
        lay = self._layouts.get(k)
        if lay is None:
            lay = _BlockLayout(self.counts_per_block(stage, block_len), derive_seed(self.seed, stage, block))
            self._layouts[k] = lay
            if len(self._layouts) > 64:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(k)
        return lay

    def _drawn_in_stage(self, stage: int, until_step: int) -> np.ndarray:
        """Examples of each source drawn by stage ``stage`` in steps ``[start, until_step)`` (exact)."""
        start = self.stage_start_steps[stage]
        if self.block_size is None:
            total = np.zeros(len(self.names), dtype=object)
            for lo, hi, bs in self.schedule.constant_segments(start, until_step):
                total += (hi - lo) * self.counts_per_block(stage, bs).astype(object)
            return total
        k = self.block_size
        positions = self.schedule.global_data_offset_by_step(until_step) - self.stage_start_offsets[stage]
        full, cut = divmod(positions, k)
        total = full * self.counts_per_block(stage, k).astype(object)
        if cut:
            src = self._layout(stage, full, k).source[:cut]
            total = total + np.bincount(src, minlength=len(self.names)).astype(object)
        return total

    def check_indices_belong_to_step(self, step: int, idx: np.ndarray) -> None:
        first, end = self.schedule.step_range(step)
        if idx.size and (idx.min() < first or idx.max() >= end):
            bad = int(idx[(idx < first) | (idx >= end)][0])
            raise ValueError(
                f"MixtureDataset: global index {bad} does not belong to step {step}, which reads "
                f"[{first}, {end}) under {self.schedule!r}. A wrapper or loader above the mixture has "
                "changed the step->index mapping."
            )

    def unwrapped_source_indices(self, step: int, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(source_id, source_index)`` for each global index of ``step``, before any stop strategy."""
        idx = as_index_array(indices)
        self.check_indices_belong_to_step(step, idx)
        stage = self.stage_at_step(step)
        source = np.empty_like(idx)
        src_index = np.empty_like(idx)
        base = self.consumed_before_stage[stage]
        if self.block_size is None:
            first = self.schedule.global_data_offset_by_step(step)
            bs = self.schedule.batch_size_at_step(step)
            block = step - self.stage_start_steps[stage]
            lay = self._layout(stage, block, bs)
            pos = idx - first
            source[:] = lay.source[pos]
            before = base + self._drawn_in_stage(stage, step)
            src_index[:] = np.asarray(before, dtype=np.int64)[source] + lay.rank[pos]
            return source, src_index
        return self._block_source_indices(stage, idx)

    def _block_source_indices(self, stage: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``unwrapped_source_indices`` for global indices of stage ``stage`` (any number of its steps),
        when ``block_size`` is set: the layout depends on the stage and the block, not on the step."""
        source = np.empty_like(idx)
        src_index = np.empty_like(idx)
        k = self.block_size
        block, pos = np.divmod(idx - self.stage_start_offsets[stage], k)
        counts = self.counts_per_block(stage, k)
        base64 = np.asarray(self.consumed_before_stage[stage], dtype=np.int64)
        for b in np.unique(block).tolist():
            sel = block == b
            lay = self._layout(stage, b, k)
            s = lay.source[pos[sel]]
            source[sel] = s
            src_index[sel] = base64[s] + b * counts[s] + lay.rank[pos[sel]]
        return source, src_index

    def global_index_of_draw(self, source: int, n: int) -> int | None:
        """The global index at which ``source`` draws its ``n``-th example (0-based, unwrapped), or
        None if it never does (its weight falls to zero first)."""
        for stage in range(len(self.stage_start_steps)):
            last = stage + 1 == len(self.stage_start_steps)
            if not last and n >= self.consumed_before_stage[stage + 1][source]:
                continue
            r = n - int(self.consumed_before_stage[stage][source])
            if self.block_size is not None:
                c = int(self.counts_per_block(stage, self.block_size)[source])
                if c == 0:
                    return None
                block, rr = divmod(r, c)
                lay = self._layout(stage, block, self.block_size)
                p = int(np.flatnonzero((lay.source == source) & (lay.rank == rr))[0])
                return self.stage_start_offsets[stage] + block * self.block_size + p
            end = None if last else self.stage_start_steps[stage + 1]
            for lo, hi, bs in self.schedule.constant_segments(self.stage_start_steps[stage], end):
                c = int(self.counts_per_block(stage, bs)[source])
                if c == 0:
                    continue
                if hi is not None and r >= (hi - lo) * c:
                    r -= (hi - lo) * c
                    continue
                step = lo + r // c
                lay = self._layout(stage, step - self.stage_start_steps[stage], bs)
                p = int(np.flatnonzero((lay.source == source) & (lay.rank == r % c))[0])
                return self.schedule.global_data_offset_by_step(step) + p
            return None
        return None

    # -- lengths and stop strategies -----------------------------------------------------------------
    async def _source_lengths(self) -> list[int | None]:
        if self._lengths is None:
            finite = [d.is_finite() for d in self.datasets]
            lens = await asyncio.gather(*[d.async_len() for d, f in zip(self.datasets, finite) if f])
            it = iter(lens)
            lengths = [next(it) if f else None for f in finite]
            for name, n in zip(self.names, lengths):
                if n == 0:
                    raise ValueError(f"MixtureDataset: source {name!r} is empty")
            self._lengths = lengths
        return self._lengths

    async def _end_index(self) -> int | None:
        """First global index past the end, or None if the mixture never ends."""
        if self.stop_strategy == "restart":
            return None
        lengths = await self._source_lengths()
        ends = []
        for s, n in enumerate(lengths):
            if n is None:
                if self.stop_strategy == "all_exhausted" and self._ever_drawn(s):
                    return None
                continue
            if self.stop_strategy == "first_exhausted":
                g = self.global_index_of_draw(s, n)
                if g is not None:
                    ends.append(g)
            elif self._ever_drawn(s):
                g = self.global_index_of_draw(s, n - 1)
                if g is None:
                    return None
                ends.append(g + 1)
        if not ends:
            return None
        return min(ends) if self.stop_strategy == "first_exhausted" else max(ends)

    def _ever_drawn(self, source: int) -> bool:
        return any(f[source] > 0 for f in self.stage_fractions)

    def is_finite(self) -> bool:
        """Whether the stop strategy can end the mixture (its exact end depends on source lengths)."""
        drawn = [d.is_finite() for s, d in enumerate(self.datasets) if self._ever_drawn(s)]
        if self.stop_strategy == "first_exhausted":
            return any(drawn)
        if self.stop_strategy == "all_exhausted":
            return all(drawn)
        return False

    async def async_len(self) -> int:
        end = await self._end_index()
        if end is None:
            raise ValueError(f"MixtureDataset with stop_strategy={self.stop_strategy!r} never ends")
        return end

    async def _read_sources(self, step: int, draws: "_StepDraws"):
        """``(whole batch, None)`` or ``(None, each present source's examples)``. A sequential reader's
        step is read together with the next planned steps (``_read_ahead``). Otherwise, when every source
        can plan its read (token windows of a store, see ``ReadPlan``) and the windows agree in shape and
        dtype, all of them are read in one tensorstore operation -- and if the plans share a row-wise
        ``finish``, in batch order and finished once, giving the whole batch; otherwise each source is
        read with ``get_batch``, concurrently."""
        coalesced = await self._read_ahead(step, draws, served=True, lower=step)
        if coalesced is not None:
            await self._read_next_group(step, draws, coalesced)
            return await coalesced.rows(0, draws.indices.size), None
        datasets, inner = draws.datasets, draws.inner
        # Planning does no I/O: awaited in turn, not as tasks (three tasks per step cost more than the plans).
        plans = [await d.plan_read(step, idx) for d, idx in zip(datasets, inner)]
        if plans and all(p is not None for p in plans):
            # A plan's views share shape and dtype (ReadPlan's contract): compare one view per plan.
            if len(_view_kinds(plans)) == 1:
                from ..store.jagged_array import awaited, read_stacked

                if plans[0].row_key is not None and all(p.row_key == plans[0].row_key for p in plans):
                    # Same row-wise finish everywhere: read the views in batch order, finish once.
                    ordered = _in_batch_order(draws, plans)
                    return plans[0].finish(await awaited(read_stacked(ordered))), None
                rows = await awaited(read_stacked([v for p in plans for v in p.views]))
                out, start = [], 0
                for p in plans:
                    out.append(p.finish(rows[start : start + len(p.views)]))
                    start += len(p.views)
                return None, out
        return None, await asyncio.gather(*[d.get_batch(step, idx) for d, idx in zip(datasets, inner)])

    async def _read_ahead(
        self, step: int, draws: "_StepDraws", *, served: bool, lower: int
    ) -> "_CoalescedRead | None":
        """One read of ``step``'s rows and of the following planned steps' (a sequential reader's), as many
        as fit in ``_COALESCE_ROWS`` rows. ``served``: the caller takes ``step``'s rows from the result
        itself, and None is returned if no following step is planned; otherwise every step's rows are kept
        for its own ``get_batch``. None too where the sources cannot plan the rows (``_group_read``). Rows
        kept for steps ``<= lower`` (the step being served) are dropped."""
        n_rows = draws.indices.size
        if not n_rows or 2 * n_rows > _COALESCE_ROWS:
            return None
        group = [(step, draws)]
        ahead = step + 1
        while n_rows < _COALESCE_ROWS and len(group) < _COALESCE_MAX_STEPS:
            later = self._planned.get(ahead)
            if later is None or n_rows + later.indices.size > _COALESCE_ROWS or ahead in self._reads:
                break
            group.append((ahead, later))
            n_rows += later.indices.size
            ahead += 1
        if served and len(group) == 1:
            return None
        read = await self._group_read(group)
        if read is None:
            return None
        coalesced = _CoalescedRead(read[0], read[1], step, ahead)
        # Kept only for steps still ahead of the one served (a reader that moved elsewhere leaves nothing).
        reads = {s: r for s, r in self._reads.items() if lower < s < lower + _READS_KEPT_STEPS}
        lo = draws.indices.size if served else 0
        for s, step_draws in group[1:] if served else group:
            reads[s] = (step_draws, coalesced, lo, lo + step_draws.indices.size)
            lo += step_draws.indices.size
        self._reads = reads  # replaced, never mutated: other tasks may be reading the old one
        return coalesced

    async def _group_read(self, group: list) -> "tuple[Any, Callable] | None":
        """``(future, finish)``: one read of the rows of ``group`` (``[(step, draws), ...]``, consecutive),
        finished into the steps' batches back to back, each in batch order.

        Each present source plans its rows of all the group's steps at once (``plan_reads``: one plan,
        one set of views or one index-array view, instead of one plan per source and step); the rows come
        back source by source and are put in batch order by one gather before the (row-wise) finish. None
        where a source cannot plan or the plans do not finish alike: such a set of sources is remembered
        and not planned as a group again.
        """
        from ..store.jagged_array import read_blocks, read_stacked

        by_source: dict[int, tuple] = {}
        first_row = 0
        for s, d in group:
            for src, sel, dataset, idx in zip(d.sources, d.selections, d.datasets, d.inner):
                entry = by_source.get(src)
                if entry is None:
                    entry = by_source[src] = (dataset, [], [], [])
                entry[1].append(s)
                entry[2].append(idx)
                entry[3].append(sel + first_row)
            first_row += d.indices.size
        present = frozenset(by_source)
        if present in self._ungrouped:
            return None
        plans, group_rows = [], []
        for src in sorted(by_source):
            dataset, steps, indices, rows = by_source[src]
            plan = await dataset.plan_reads(steps, indices)
            if plan is None or plan.row_key is None or (plans and plan.row_key != plans[0].row_key):
                self._ungrouped.add(present)
                return None
            n = sum(i.size for i in indices)
            if plan.num_rows != n:
                raise ValueError(f"a read plan has {plan.num_rows} rows for {n} indices")
            plans.append(plan)
            group_rows.extend(rows)
        blocks = [p.block for p in plans]
        if all(b is not None for b in blocks) and len({(tuple(b.shape[1:]), b.dtype) for b in blocks}) == 1:
            future = read_blocks(blocks)
        elif all(b is None for b in blocks) and len(_view_kinds(plans)) == 1:
            future = read_stacked([v for p in plans for v in p.views])
        else:
            self._ungrouped.add(present)
            return None
        order = np.concatenate(group_rows)  # the read's row i is the group's row order[i]
        gather = np.empty_like(order)
        gather[order] = np.arange(order.size, dtype=order.dtype)
        return future, functools.partial(_gather_rows, gather, plans[0].finish)

    async def _read_next_group(self, step: int, draws: "_StepDraws", group: "_CoalescedRead") -> None:
        """Make sure the ``_GROUPS_AHEAD`` groups of steps after ``group`` are being read, as its first step
        (``step``, read as ``draws``) is served.

        A sequential reader then finds each group of steps read ahead of need instead of asking for it
        when it is due: a read of 64 short windows takes ~2 ms (2 cores), which stalled the loader once
        per group when the prefetch window (8 steps, half of them refilled at a time) was shorter than
        the read. Memory stays bounded by ``(_GROUPS_AHEAD + 1) * _COALESCE_ROWS`` rows, whatever the
        dataset or step.
        """
        first = group.end_step
        for _ in range(_GROUPS_AHEAD):
            started = self._reads.get(first)
            if started is None:
                started = await self._start_group(step, draws, first)
                if started is None:
                    return
            else:
                started = started[1]
            first = started.end_step

    async def _start_group(self, step: int, draws: "_StepDraws", first: int) -> "_CoalescedRead | None":
        """Start the read of the group of steps from ``first`` (their rows kept for their ``get_batch``)
        for a reader that reads at ``step`` as ``draws``; None if the steps cannot be read ahead."""
        next_draws = self._planned.get(first)
        if next_draws is None:
            next_draws = await self._plan_next(step, draws.indices, first)
            if next_draws is None:
                return None
        return await self._read_ahead(first, next_draws, served=False, lower=step)

    async def _plan_next(self, step: int, indices: np.ndarray, first: int) -> "_StepDraws | None":
        """Draws of ``first`` (and the steps planned with it) for a reader that reads the same rows of
        each batch as it read at ``step``; None where that prediction does not hold (the batch size
        changes, or the mixture ends)."""
        bs = self.schedule.batch_size_at_step(step)
        if not indices.size or self.schedule.batch_size_at_step(first) != bs:
            return None
        rows = indices - self.schedule.global_data_offset_by_step(step)
        predicted = self.schedule.global_data_offset_by_step(first) + rows
        end = await self._end_index()
        if end is not None and predicted.max() >= end:
            return None
        return await self._plan_from(first, predicted, end, ahead=True, lower=step)

    async def source_indices(self, step: int, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(source_id, source_index)`` actually read for each global index of ``step``, after the stop
        strategy (wrapping). Raises :class:`DatasetExhausted` past the end."""
        source, src_index = self.unwrapped_source_indices(step, indices)
        if self.stop_strategy != "restart":
            end = await self._end_index()
            idx = as_index_array(indices)
            if end is not None and idx.size and idx.max() >= end:
                raise DatasetExhausted(
                    f"MixtureDataset ({self.stop_strategy}): step {step} needs global index {int(idx.max())}, "
                    f"but the mixture ends at {end}"
                )
        lengths = await self._source_lengths()
        for s, n in enumerate(lengths):
            if n is not None:
                sel = source == s
                src_index[sel] %= n
        return source, src_index

    # -- planning ahead -------------------------------------------------------------------------------
    async def _draws(self, step: int, indices: Sequence[int]) -> "_StepDraws":
        """What ``get_batch(step, indices)`` reads: each present source, the positions it fills and the
        indices to read from it (a shuffled source's permutation already applied).

        A prefetching loader asks for steps ``s, s+1, ...`` in order, each for the same rows of its batch.
        The index math (layout lookups, stop strategy, permutations) costs ~30 numpy calls per step
        whatever the batch size -- most of a small batch's CPU -- so on a step not yet planned, right after
        a request for the step before it, the draws of the next steps (same rows, same batch size, up to
        ``_PLAN_AHEAD_INDICES`` indices) are computed in one vectorised pass and kept. A request whose
        indices differ from the prediction is planned on its own. Draws are a pure function of ``(step,
        indices)``: what is kept never changes what is read.
        """
        idx = as_index_array(indices)
        sequential = self._last_step == step - 1
        self._last_step = step
        kept = self._planned.get(step)
        if kept is not None and np.array_equal(kept.indices, idx):
            return kept
        self.check_indices_belong_to_step(step, idx)
        end = await self._end_index()
        if end is not None and idx.size and idx.max() >= end:
            raise DatasetExhausted(
                f"MixtureDataset ({self.stop_strategy}): step {step} needs global index {int(idx.max())}, "
                f"but the mixture ends at {end}"
            )
        return await self._plan_from(step, idx, end, ahead=sequential, lower=step)

    async def _plan_from(
        self, step: int, idx: np.ndarray, end: int | None, *, ahead: bool, lower: int
    ) -> "_StepDraws":
        """Draws of ``step`` for ``idx`` (checked) and, if ``ahead``, of the next steps for the same rows
        of their batches (same batch size, before ``end``, up to ``_PLAN_AHEAD_INDICES`` indices), all in
        one pass; kept in ``_planned`` with those of steps in ``(lower, step + _PLAN_AHEAD_MAX_STEPS)``."""
        steps, requests = [step], [idx]
        if ahead and idx.size:
            bs = self.schedule.batch_size_at_step(step)
            rows = idx - self.schedule.global_data_offset_by_step(step)
            for later in range(step + 1, step + min(_PLAN_AHEAD_MAX_STEPS, _PLAN_AHEAD_INDICES // idx.size)):
                if self.schedule.batch_size_at_step(later) != bs:
                    break
                predicted = self.schedule.global_data_offset_by_step(later) + rows
                if end is not None and predicted.max() >= end:
                    break
                steps.append(later)
                requests.append(predicted)
        draws = await self._plan(steps, requests)
        planned = {s: d for s, d in self._planned.items() if lower < s < steps[0] + _PLAN_AHEAD_MAX_STEPS}
        planned.update(zip(steps, draws))
        self._planned = planned  # replaced, never mutated: other tasks may be reading the old one
        return draws[0]

    async def _plan(self, steps: list[int], requests: list[np.ndarray]) -> list["_StepDraws"]:
        """:class:`_StepDraws` of consecutive ``steps`` (already checked), computed together."""
        sizes = [r.size for r in requests]
        flat = np.concatenate(requests)
        source = np.empty_like(flat)
        src_index = np.empty_like(flat)
        starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        i = 0
        while i < len(steps):  # runs of steps in one stage: one pass each when the layout is per block
            stage = self.stage_at_step(steps[i])
            j = i + 1
            while j < len(steps) and self.stage_at_step(steps[j]) == stage:
                j += 1
            if self.block_size is not None:
                a, b = starts[i], starts[j]
                source[a:b], src_index[a:b] = self._block_source_indices(stage, flat[a:b])
            else:
                for k in range(i, j):
                    a, b = starts[k], starts[k + 1]
                    source[a:b], src_index[a:b] = self.unwrapped_source_indices(steps[k], requests[k])
            i = j
        lengths = await self._source_lengths()
        for s, n in enumerate(lengths):  # stop strategies wrap finite sources
            if n is not None:
                sel = source == s
                src_index[sel] %= n
        # Shuffled sources (the config's default): their permutations are evaluated here, all in one
        # vectorised pass, and their inner datasets are read -- what each PermutationDataset would do.
        inner = src_index
        read_from = list(self.datasets)
        perm_requests, perm_positions = [], []
        for s, d in enumerate(self.datasets):
            if type(d) is PermutationDataset:
                read_from[s] = d.dataset
                at = np.flatnonzero(source == s)
                if at.size:
                    perm_requests.append(await d.permutation_request(src_index[at]))
                    perm_positions.append(at)
        if perm_requests:
            inner = src_index.copy()
            for at, mapped in zip(perm_positions, permute_many(perm_requests)):
                inner[at] = mapped
        # Split by (step, source): one stable sort keeps each source's positions ascending within a step.
        n_sources = len(self.datasets)
        key = np.repeat(np.arange(len(steps), dtype=np.int64), sizes) * n_sources + source
        order = np.argsort(key, kind="stable")
        cuts = np.searchsorted(key[order], np.arange(len(steps) * n_sources + 1)).tolist()
        position = (np.arange(flat.size) - np.repeat(starts[:-1], sizes))[order]
        inner = inner[order]
        out = []
        for k, request in enumerate(requests):
            present, selections, datasets, indices = [], [], [], []
            for s in range(n_sources):
                lo, hi = cuts[k * n_sources + s], cuts[k * n_sources + s + 1]
                if hi > lo:
                    present.append(s)
                    selections.append(position[lo:hi])
                    datasets.append(read_from[s])
                    indices.append(inner[lo:hi])
            out.append(_StepDraws(request, present, selections, datasets, indices))
        return out

    async def get_batch(self, step: int, indices: Sequence[int]) -> Sequence[T]:
        draws = await self._draws(step, indices)
        ahead = self._reads.get(step)
        if ahead is not None:
            reads = dict(self._reads)  # replaced, never mutated (see _read_ahead)
            del reads[step]  # taken once: a retry rereads
            self._reads = reads
            if ahead[0] is draws:  # the very draws the read was planned from, so the same indices
                group = ahead[1]
                if group.first_step == step:
                    await self._read_next_group(step, draws, group)
                return await group.rows(ahead[2], ahead[3])
        selections = draws.selections
        whole, results = await self._read_sources(step, draws)
        if whole is not None:
            return whole
        source = draws.indices
        if results and all(isinstance(r, StackedBatch) for r in results):
            n = len(source)

            def merge(*leaves):
                out = np.empty((n,) + leaves[0].shape[1:], dtype=leaves[0].dtype)
                for sel, leaf in zip(selections, leaves):
                    out[sel] = leaf
                return out

            return StackedBatch(jax.tree.map(merge, *[r.tree for r in results]))
        if results and all(isinstance(r, np.ndarray) for r in results):
            out = np.empty((len(source),) + results[0].shape[1:], dtype=results[0].dtype)
            for sel, r in zip(selections, results):
                out[sel] = r
            return out
        out_list: list = [None] * len(source)
        for sel, r in zip(selections, results):
            for pos, ex in zip(sel.tolist(), r):
                out_list[pos] = ex
        return out_list

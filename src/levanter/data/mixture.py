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

A mixture keeps no state about its callers: ``get_batch(step, indices)`` and ``plan(steps,
indices)`` are functions of their arguments and the sources alone, so any number of readers, on any
threads, get the same answers. The index math lives in :mod:`levanter.data.mixture_layout`, the checking of
weights and stop strategies in :mod:`levanter.data.mixture_weights`; reading a
sequential reader's steps ahead, in groups, is the loader's business (:mod:`levanter.data.read_ahead`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import TypeVar

import numpy as np

from ..schedule import BatchSchedule, StepSchedule, as_int
from ._prp import seed_from_key
from .dataset import AsyncDataset, WrapperDataset, apply_index_maps
from .mixture_reads import StepDraws, group_plan, merged_plan
from .read_plan import DatasetExhausted, ReadPlan, as_index_array, group_sizes_of
from .mixture_layout import MixtureLayout
from .mixture_weights import STOP_STRATEGIES, stage_schedule

__all__ = ["MixtureDataset"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

def _refuse_nested_mixture(name: str, dataset: AsyncDataset) -> None:
    """Refuse a source that is (or wraps) a mixture: a mixture's indices are training-order global
    indices tied to steps, which a source index never is, so a nested one could not read any step."""
    d = dataset
    while True:
        if isinstance(d, MixtureDataset):
            raise ValueError(
                f"MixtureDataset: source {name!r} is itself a mixture{'' if d is dataset else ' (wrapped)'}; "
                "mixtures do not nest. List its sources in this mixture, with their weights multiplied by "
                f"{name!r}'s weight."
            )
        if not isinstance(d, WrapperDataset):
            return
        d = d.dataset


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
        for name, d in zip(self.names, self.datasets):
            _refuse_nested_mixture(name, d)
        self.seed = seed_from_key(key)
        if stop_strategy not in STOP_STRATEGIES:
            raise ValueError(f"stop_strategy: unknown value {stop_strategy!r}; expected one of {STOP_STRATEGIES}")
        self.stop_strategy = stop_strategy
        if block_size is not None:
            block_size = as_int(block_size, what="block_size")
            if block_size < 1:
                raise ValueError(f"block_size must be a positive integer or None, got {block_size!r}")
        self.block_size = block_size
        self.schedule = batch_schedule if isinstance(batch_schedule, BatchSchedule) else BatchSchedule(batch_schedule)

        self.stages: StepSchedule[list[Fraction]] = stage_schedule(weights, self.names)
        self.layout = MixtureLayout(len(self.names), self.stages, self.schedule, self.block_size, self.seed)
        self.stage_start_steps: list[int] = list(self.layout.stage_start_steps)
        self.stage_fractions: list[list[Fraction]] = [list(f) for f in self.layout.stage_fractions]
        self.stage_start_offsets: list[int] = list(self.layout.stage_start_offsets)
        self.consumed_before_stage: list[np.ndarray] = list(self.layout.consumed_before_stage)
        # Facts about the sources, not the callers: computed once (any racing computations agree) and
        # replaced whole, never mutated.
        self._lengths: list[int | None] | None = None
        self._chains: list[tuple[AsyncDataset, list]] | None = None
        self._warn_never_drawn()

    def _warn_never_drawn(self) -> None:
        """Warn about a source whose weight is positive in a stage but rounds to zero examples in every
        block of it (a small weight against a small batch with one block per step): it is never drawn there."""
        for j, (start, fractions) in enumerate(self.stages):
            if self.block_size is not None:
                sizes = {self.block_size}
            else:
                sizes = {bs for _, _, bs in self.schedule.constant_segments(start, self.stages.end_of(j))}
            for s, f in enumerate(fractions):
                if f > 0 and all(self.layout.counts_per_block(j, k)[s] == 0 for k in sizes):
                    per = "block_size" if self.block_size is not None else "batch size"
                    logger.warning(
                        "mixture: source %r has weight %.4g (of all weights summing to 1) from step %d, but "
                        "rounds to 0 examples in every block (%s %s), so it is never drawn there; raise its "
                        "weight, or use a block size (mixture_block_size) in which it gets at least one example",
                        self.names[s], float(f), start, per, "/".join(str(k) for k in sorted(sizes)),
                    )

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

    def _lengths_now(self) -> list[int | None]:
        """The sources' lengths from synchronous code (``is_finite``): read once with ``asyncio.run``, in a
        worker thread when the caller is inside an event loop (datasets hold no loop-bound state), and kept."""
        if self._lengths is None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return asyncio.run(self._source_lengths())
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                return pool.submit(asyncio.run, self._source_lengths()).result()
        return self._lengths

    async def _end_index(self) -> int | None:
        """First global index past the end, or None if the mixture never ends."""
        if self.stop_strategy == "restart":
            return None
        return self._end_from_lengths(await self._source_lengths())

    def _end_from_lengths(self, lengths: list[int | None]) -> int | None:
        ends = []
        for s, n in enumerate(lengths):
            if n is None:
                if self.stop_strategy == "all_exhausted" and self._ever_drawn(s):
                    return None
                continue
            if self.stop_strategy == "first_exhausted":
                g = self.layout.global_index_of_draw(s, n)
                if g is not None:
                    ends.append(g)
            elif self._ever_drawn(s):
                g = self.layout.global_index_of_draw(s, n - 1)
                if g is None:
                    return None
                ends.append(g + 1)
        if not ends:
            return None
        return min(ends) if self.stop_strategy == "first_exhausted" else max(ends)

    def _ever_drawn(self, source: int) -> bool:
        return any(f[source] > 0 for f in self.stage_fractions)

    def _drawn_forever(self, source: int) -> bool:
        """Whether the last stage (which never ends) draws ``source`` in every block, so a finite one runs out."""
        last = len(self.stage_fractions) - 1
        if self.block_size is not None:
            k = self.block_size
        else:  # one block per step: the batch size from the last stage's final segment on
            k = self.schedule.constant_segments(self.stage_start_steps[last], None)[-1][2]
        return bool(self.layout.counts_per_block(last, k)[source] > 0)

    def is_finite(self) -> bool:
        """Whether the mixture ends, i.e. whether :meth:`async_len` is defined.

        The weights settle it in the common cases: ``first_exhausted`` ends if the last stage draws a
        finite source, ``all_exhausted`` if it draws every drawn source and all are finite. When a finite
        source's weight falls to zero in a later stage, whether it runs out first depends on its length:
        then the sources' lengths are read (once) and the end is computed. A mixture none of whose finite
        sources runs out never ends: it is infinite, and a loader reads it for as many steps as asked.
        """
        if self.stop_strategy == "restart":
            return False
        drawn = [s for s in range(len(self.datasets)) if self._ever_drawn(s)]
        finite = [s for s in drawn if self.datasets[s].is_finite()]
        if self.stop_strategy == "first_exhausted":
            if not finite:
                return False
            if any(self._drawn_forever(s) for s in finite):
                return True
        else:
            if len(finite) < len(drawn):
                return False
            if all(self._drawn_forever(s) for s in drawn):
                return True
        return self._end_from_lengths(self._lengths_now()) is not None

    async def async_len(self) -> int:
        end = await self._end_index()
        if end is None:
            raise ValueError(f"MixtureDataset with stop_strategy={self.stop_strategy!r} never ends")
        return end

    async def _check_end(self, step: int, idx: np.ndarray) -> None:
        if self.stop_strategy == "restart" or not idx.size:
            return
        end = await self._end_index()
        if end is not None and idx.max() >= end:
            raise DatasetExhausted(
                f"MixtureDataset ({self.stop_strategy}): step {step} needs global index {int(idx.max())}, "
                f"but the mixture ends at {end}"
            )

    async def source_indices(self, step: int, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(source_id, source_index)`` actually read for each global index of ``step``, after the stop
        strategy (wrapping): a query for tools (the data planner); a read computes the same in its own
        pass (``plan(..., where=...)``). Raises :class:`DatasetExhausted` past the end."""
        step = as_int(step)
        return await self._locate([step], [as_index_array(indices)])

    async def _locate(self, steps: list[int], requests: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``(source, source_index)`` of every index of ``requests`` (one array per step of ``steps``),
        concatenated: the layout's lookups, then the stop strategy's wrap, in one pass. Raises past the
        end, as ``get_batch`` does."""
        for step, idx in zip(steps, requests):
            self.layout.check_indices_belong_to_step(step, idx)
            await self._check_end(step, idx)
        sizes = [r.size for r in requests]
        flat = np.concatenate(requests) if requests else np.zeros(0, dtype=np.int64)
        source = np.empty_like(flat)
        src_index = np.empty_like(flat)
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        i = 0
        while i < len(steps):  # runs of steps in one stage: one pass each when the layout is per block
            stage = self.layout.stage_at_step(steps[i])
            j = i + 1
            while j < len(steps) and self.layout.stage_at_step(steps[j]) == stage:
                j += 1
            if self.block_size is not None:
                a, b = starts[i], starts[j]
                source[a:b], src_index[a:b] = self.layout.block_source_indices(stage, flat[a:b])
            else:
                for k in range(i, j):
                    a, b = starts[k], starts[k + 1]
                    source[a:b], src_index[a:b] = self.layout.step_source_indices(stage, steps[k], requests[k])
            i = j
        lengths = await self._source_lengths()
        for s, n in enumerate(lengths):  # stop strategies wrap finite sources
            if n is not None:
                sel = source == s
                src_index[sel] %= n
        return source, src_index

    async def _read_maps(self) -> list[tuple[AsyncDataset, list]]:
        """Per source: the dataset actually read and the index maps that lead to it -- the source's
        wrappers that pass examples through unchanged (its shuffle), followed down by their public
        :meth:`~levanter.data.dataset.AsyncDataset.index_map`. The mixture evaluates those maps itself,
        all sources at once (one Feistel pass per level), and reads the dataset below them."""
        if self._chains is None:
            chains = []
            for d in self.datasets:
                maps = []
                m = await d.index_map()
                while m is not None and not m.rewrites:
                    maps.append(m)
                    d = m.inner
                    m = await d.index_map()
                chains.append((d, maps))
            self._chains = chains
        return self._chains

    # -- draws: what a request reads -------------------------------------------------------------------
    async def _draws(
        self, steps: Sequence[int], requests: Sequence[np.ndarray], wheres: Sequence[np.ndarray] | None = None
    ) -> list[StepDraws]:
        """What ``get_batch(steps[k], requests[k])`` reads, for each ``k``, computed in one pass: each
        present source, the positions it fills and the indices to read from it (the source's index maps
        -- its shuffle -- already applied). The index math (layout lookups, stop strategy, permutations)
        costs ~30 numpy calls per pass whatever the number of indices -- most of a small batch's CPU -- so a
        reader that plans many steps at once pays it once. With ``wheres`` (per step, ascending, holding
        the step's request) the pass covers them, and each step's draws carry their provenance. Raises
        past the end, as ``get_batch`` does. ``steps`` are checked integers (:meth:`plan` checks them)."""
        located = requests if wheres is None else [as_index_array(w) for w in wheres]
        source, src_index = await self._locate(steps, located)
        sizes = [r.size for r in requests]
        provenance: list = [None] * len(steps)
        if wheres is not None:
            cuts = np.cumsum([w.size for w in located])[:-1]
            src_w, idx_w = np.split(source, cuts), np.split(src_index, cuts)
            provenance = [{"source": a, "source_index": b} for a, b in zip(src_w, idx_w)]
            same = all(w is r for w, r in zip(located, requests)) or (
                sum(w.size for w in located) == sum(sizes)
                and np.array_equal(np.concatenate(located), np.concatenate(requests))
            )  # one comparison for all the steps: a process that reads its steps' whole batches
            if not same:  # the requests: a part of each step's batch
                picks = []
                for w, r in zip(located, requests):
                    pos = np.searchsorted(w, r)
                    if pos.size and (pos.max() >= w.size or not np.array_equal(w[pos], r)):
                        raise ValueError("MixtureDataset.plan: the indices read are not among those of `where`")
                    picks.append(pos)
                source = np.concatenate([a[p] for a, p in zip(src_w, picks)]) if picks else source[:0]
                src_index = np.concatenate([a[p] for a, p in zip(idx_w, picks)]) if picks else src_index[:0]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        # The sources' own index maps (their shuffles, the config's default), evaluated here level by
        # level, all sources at once: what each wrapper would do, in one vectorised pass.
        chains = await self._read_maps()
        inner = src_index
        depth = max((len(maps) for _, maps in chains), default=0)
        if depth:
            inner = src_index.copy()
        for level in range(depth):
            maps, at = [], []
            for s, (_, chain) in enumerate(chains):
                if level < len(chain):
                    sel = np.flatnonzero(source == s)
                    if sel.size:
                        maps.append(chain[level])
                        at.append(sel)
            for sel, mapped in zip(at, apply_index_maps(maps, [inner[sel] for sel in at])):
                inner[sel] = mapped
        # Split by (step, source): one stable sort keeps each source's positions ascending within a step.
        n_sources = len(self.datasets)
        flat_size = int(sum(sizes))
        key = np.repeat(np.arange(len(steps), dtype=np.int64), sizes) * n_sources + source
        order = np.argsort(key, kind="stable")
        cuts = np.searchsorted(key[order], np.arange(len(steps) * n_sources + 1)).tolist()
        position = (np.arange(flat_size) - np.repeat(starts[:-1], sizes))[order]
        inner = inner[order]
        out = []
        for k, request in enumerate(requests):
            present, selections, datasets, indices = [], [], [], []
            for s in range(n_sources):
                lo, hi = cuts[k * n_sources + s], cuts[k * n_sources + s + 1]
                if hi > lo:
                    present.append(s)
                    selections.append(position[lo:hi])
                    datasets.append(chains[s][0])
                    indices.append(inner[lo:hi])
            out.append(StepDraws(steps[k], request, present, selections, datasets, indices, provenance[k]))
        return out

    # -- plans and reads ------------------------------------------------------------------------------
    async def plan(self, steps, indices, group_sizes=None, where=None) -> list[ReadPlan | None]:
        """One plan per group of ``steps``, with the index math of all of them (and of ``where``'s
        provenance) done in one pass: a plan's cost is mostly per pass, not per index. A group whose
        sources all plan token windows that finish alike is one tensorstore read
        (:func:`~levanter.data.mixture_reads.group_plan`); a one-step group of other sources reads each
        source and merges them (:func:`~levanter.data.mixture_reads.merged_plan`); a group of several
        steps of such sources, or one that reaches past the end of the mixture, gets None (its steps'
        ``get_batch`` reads them, or says where the mixture ends)."""
        steps = [as_int(s) for s in steps]
        requests = [as_index_array(i) for i in indices]
        wheres = None if where is None else [as_index_array(w) for w in where]
        located = requests if wheres is None else wheres
        end = await self._end_index()
        groups, at = [], 0
        for size in group_sizes_of(steps, group_sizes):
            inside = end is None or all(not r.size or r.max() < end for r in located[at : at + size])
            groups.append((at, size, inside))
            at += size
        kept = [k for at, size, inside in groups if inside for k in range(at, at + size)]
        draws = dict(zip(kept, await self._draws(
            [steps[k] for k in kept], [requests[k] for k in kept],
            None if wheres is None else [wheres[k] for k in kept],
        )))
        plans = []
        for at, size, inside in groups:
            group = [draws[k] for k in range(at, at + size)] if inside else []
            plan = await group_plan(group) if group else None
            if plan is None and size == 1 and inside:
                plan = merged_plan(group[0])
            if plan is not None and wheres is not None:
                plan.provenance = {
                    key: np.concatenate([draws[k].provenance[key] for k in range(at, at + size)])
                    for key in ("source", "source_index")
                }
            plans.append(plan)
        return plans

    async def get_batch(self, step: int, indices: Sequence[int]) -> Sequence[T]:
        (plan,) = await self.plan([step], [indices])
        if plan is None:  # past the end (plan checked the step): the draws say so
            await self._draws([step], [as_index_array(indices)])
        return await plan.read()

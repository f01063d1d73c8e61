"""The index math of a :class:`~levanter.data.mixture.MixtureDataset`: pure functions of its
configuration, safe to call from any number of threads at once.

A :class:`MixtureLayout` is immutable once built. What it caches (largest-remainder counts and block
layouts) is cached by ``functools.lru_cache`` on pure module-level functions, keyed on everything the
result depends on: ``lru_cache`` is thread-safe, and a result is the same whoever computes it first.
The arrays it hands out are read-only, so no caller can change what another one sees.

See :mod:`levanter.data.mixture` for the index spaces (step, global index, stage position, block,
source index) and the layout itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from ..schedule import BatchSchedule, StepSchedule, as_int
from ._prp import FeistelPermutation, derive_seed
from .read_plan import as_index_array

__all__ = ["largest_remainder_counts", "BlockLayout", "MixtureLayout"]


def largest_remainder_counts(fractions: Sequence[Fraction], total: int) -> np.ndarray:
    """Integer counts summing to ``total``, each ``floor(f*total)`` or one more (ties: earlier first)."""
    quotas = [f * total for f in fractions]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return np.asarray(counts, dtype=np.int64)


@functools.lru_cache(maxsize=1024)
def _counts(fractions: tuple[Fraction, ...], total: int) -> np.ndarray:
    counts = largest_remainder_counts(fractions, total)
    counts.flags.writeable = False
    return counts


class BlockLayout:
    """Which source, and which rank within that source, sits at each position of one block (read-only)."""

    __slots__ = ("source", "rank")

    def __init__(self, counts: np.ndarray, seed: int):
        size = int(counts.sum())
        slots = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        source = slots[FeistelPermutation(size, seed)(np.arange(size, dtype=np.int64))]
        order = np.argsort(source, kind="stable")
        group_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rank = np.empty(size, dtype=np.int64)
        rank[order] = np.arange(size, dtype=np.int64) - group_start[source[order]]
        source.flags.writeable = False
        rank.flags.writeable = False
        self.source = source
        self.rank = rank


# Enough for the blocks a loader's read-ahead and a second reader touch at once (a block is one step's
# batch, or ``block_size`` positions).
@functools.lru_cache(maxsize=256)
def _block_layout(counts: tuple[int, ...], seed: int) -> BlockLayout:
    return BlockLayout(np.asarray(counts, dtype=np.int64), seed)


class MixtureLayout:
    """Where each global index of a mixture draws from: ``(source id, unwrapped source index)``.

    Args:
        num_sources: the number of sources (ids ``0..num_sources-1``).
        stages: per stage (from its start step), each source's share (summing to 1).
        schedule: the run's batch schedule.
        block_size: positions per block, or None for one block per step.
        seed: the mixture's seed.
    """

    def __init__(
        self,
        num_sources: int,
        stages: StepSchedule,
        schedule: BatchSchedule,
        block_size: int | None,
        seed: int,
    ):
        self.num_sources = num_sources
        self.stages = stages
        self.stage_start_steps: tuple[int, ...] = tuple(stages.starts)
        self.stage_fractions: tuple[tuple[Fraction, ...], ...] = tuple(tuple(f) for f in stages.values)
        self.schedule = schedule
        self.block_size = block_size
        self.seed = seed
        self.stage_start_offsets: tuple[int, ...] = tuple(
            schedule.global_data_offset_by_step(s) for s in self.stage_start_steps
        )
        # Examples of each source drawn in each whole stage (the last stage is unbounded).
        consumed = [np.zeros(num_sources, dtype=object)]
        for j in range(len(self.stage_start_steps) - 1):
            consumed.append(consumed[-1] + self.drawn_in_stage(j, self.stage_start_steps[j + 1]).astype(object))
        self.consumed_before_stage: tuple[np.ndarray, ...] = tuple(consumed)
        self._consumed64 = tuple(np.asarray(c, dtype=np.int64) for c in consumed)

    def stage_at_step(self, step: int) -> int:
        return self.stages.index_at(step)

    def counts_per_block(self, stage: int, block_len: int) -> np.ndarray:
        """Examples of each source in a block of ``block_len`` positions of ``stage`` (read-only)."""
        return _counts(self.stage_fractions[stage], block_len)

    def block_layout(self, stage: int, block: int, block_len: int) -> BlockLayout:
        """The layout of block ``block`` (of ``block_len`` positions) of stage ``stage``."""
        counts = self.counts_per_block(stage, block_len)
        return _block_layout(tuple(counts.tolist()), derive_seed(self.seed, stage, block))

    def drawn_in_stage(self, stage: int, until_step: int) -> np.ndarray:
        """Examples of each source drawn by stage ``stage`` in steps ``[start, until_step)`` (exact)."""
        start = self.stage_start_steps[stage]
        if self.block_size is None:
            total = np.zeros(self.num_sources, dtype=object)
            for lo, hi, bs in self.schedule.constant_segments(start, until_step):
                total += (hi - lo) * self.counts_per_block(stage, bs).astype(object)
            return total
        k = self.block_size
        positions = self.schedule.global_data_offset_by_step(until_step) - self.stage_start_offsets[stage]
        full, cut = divmod(positions, k)
        total = full * self.counts_per_block(stage, k).astype(object)
        if cut:
            src = self.block_layout(stage, full, k).source[:cut]
            total = total + np.bincount(src, minlength=self.num_sources).astype(object)
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
        step = as_int(step)
        idx = as_index_array(indices)
        self.check_indices_belong_to_step(step, idx)
        stage = self.stage_at_step(step)
        if self.block_size is None:
            return self.step_source_indices(stage, step, idx)
        return self.block_source_indices(stage, idx)

    def step_source_indices(self, stage: int, step: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``unwrapped_source_indices`` of ``step`` (in ``stage``, checked) for one block per step."""
        first = self.schedule.global_data_offset_by_step(step)
        bs = self.schedule.batch_size_at_step(step)
        lay = self.block_layout(stage, step - self.stage_start_steps[stage], bs)
        pos = idx - first
        source = lay.source[pos]
        before = self.consumed_before_stage[stage] + self.drawn_in_stage(stage, step)
        src_index = np.asarray(before, dtype=np.int64)[source] + lay.rank[pos]
        return source, src_index

    def block_source_indices(self, stage: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``unwrapped_source_indices`` for global indices of stage ``stage`` (any number of its steps),
        when ``block_size`` is set: the layout depends on the stage and the block, not on the step."""
        source = np.empty_like(idx)
        src_index = np.empty_like(idx)
        k = self.block_size
        block, pos = np.divmod(idx - self.stage_start_offsets[stage], k)
        counts = self.counts_per_block(stage, k)
        base64 = self._consumed64[stage]
        for b in np.unique(block).tolist():
            sel = block == b
            lay = self.block_layout(stage, b, k)
            s = lay.source[pos[sel]]
            source[sel] = s
            src_index[sel] = base64[s] + b * counts[s] + lay.rank[pos[sel]]
        return source, src_index

    def global_index_of_draw(self, source: int, n: int) -> int | None:
        """The global index at which ``source`` draws its ``n``-th example (0-based, unwrapped), or
        None if it never does (its weight falls to zero first)."""
        n = as_int(n, what="n")
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
                lay = self.block_layout(stage, block, self.block_size)
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
                lay = self.block_layout(stage, step - self.stage_start_steps[stage], bs)
                p = int(np.flatnonzero((lay.source == source) & (lay.rank == r % c))[0])
                return self.schedule.global_data_offset_by_step(step) + p
            return None
        return None

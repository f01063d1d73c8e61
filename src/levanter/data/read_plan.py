"""What a read is made of: a batch stored column-wise, the end of a finite dataset, and read plans.

A :class:`ReadPlan` says where the rows of one or more steps' ``get_batch`` are read -- tensorstore views
of a store (or one index-array view of many short windows), or, for a mixture whose sources read
otherwise, an async read -- and how the rows read become the examples (``finish``). Every dataset's one
planning method (:meth:`levanter.data.dataset.AsyncDataset.plan`) answers with these; the loader's
read-ahead and a mixture's ``get_batch`` read them. Kept apart from the protocol so that the store side of
a read (views, blocks, the finishing function) is read in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "StackedBatch",
    "DatasetExhausted",
    "as_index_array",
    "ReadPlan",
    "group_sizes_of",
    "with_provenance",
    "check_range",
]


class StackedBatch(Sequence):
    """A batch stored column-wise: a pytree of numpy arrays sharing a leading (example) axis.

    It is a ``Sequence`` of per-example pytrees (so it honours the ``get_batch`` contract), but the
    loader and the mixture use :attr:`tree` directly and never touch examples one by one.
    """

    def __init__(self, tree: Any):
        leaves = jax.tree.leaves(tree)
        if not leaves:
            raise ValueError("StackedBatch needs at least one array")
        n = len(leaves[0])
        if any(len(x) != n for x in leaves):
            raise ValueError(f"StackedBatch leaves disagree on the batch length: {[len(x) for x in leaves]}")
        self.tree = tree
        self._len = n

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return StackedBatch(jax.tree.map(lambda x: x[i], self.tree))
        return jax.tree.map(lambda x: x[i], self.tree)

    def take(self, positions: np.ndarray) -> "StackedBatch":
        return StackedBatch(jax.tree.map(lambda x: x[positions], self.tree))


class DatasetExhausted(IndexError):
    """Raised when an index lies past the end of a finite dataset (the loader turns it into the end)."""


def as_index_array(indices: Sequence[int]) -> np.ndarray:
    arr = np.asarray(indices, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {arr.shape}")
    return arr


# Not frozen: a frozen dataclass's __init__ costs more, and one is made per source and step.
@dataclasses.dataclass(slots=True)
class ReadPlan:
    """A deferred read: ``views`` (tensorstore views of equal shape and dtype, one per example) and
    ``finish``, mapping the stacked rows read (``array[len(views), ...]``) to the dataset's examples.

    ``row_key``, when not None, promises that ``finish`` works row by row (``finish`` of stacked rows is
    the stack of ``finish`` of each row) and equals the ``finish`` of every plan with an equal key. A
    mixture whose sources' plans share a key reads their views in batch order and finishes the whole
    batch once, instead of finishing each source and merging the columns
    (docs/bench/2026-12-03-cpu-levers.md).

    ``block``, when not None, stands for ``views`` (then empty): one view of shape ``(n, ...)`` whose
    rows are the n examples in order (an index-array view; see ``TokenSeqDataset.plan``).

    ``fetch``, when not None, stands for the tensorstore read: an async function returning what
    ``finish`` takes (a mixture whose sources do not all read token windows of one kind reads them with
    their own plans or ``get_batch``). Such a plan is read whole, never merged into another.
    """

    views: list
    finish: Callable[[Any], Any]
    row_key: Any = None
    block: Any = None
    # From ``plan(..., where=...)``: per-row arrays over the steps' ``where`` indices, back to back ({} for
    # a dataset that adds nothing to the global index); None when not asked for.
    provenance: Any = None
    fetch: Callable[[], Awaitable[Any]] | None = None
    # The number of rows where ``fetch`` reads them.
    fetch_rows: int = 0

    @property
    def num_rows(self) -> int:
        if self.fetch is not None:
            return self.fetch_rows
        return len(self.views) if self.block is None else int(self.block.shape[0])

    @property
    def reads_windows(self) -> bool:
        """Whether the rows are read from tensorstore views (so another plan's views may join them)."""
        return self.fetch is None

    def then(self, fn: Callable[[Any], Any], row_key: Any = None) -> "ReadPlan":
        """The same reads, with ``fn`` applied to this plan's result. Pass ``row_key`` (hashable, equal
        for equal functions) only if ``fn`` is row-wise too; the result keeps a key only if both have one."""
        inner = self.finish
        key = None if row_key is None or self.row_key is None else (self.row_key, row_key)
        return ReadPlan(self.views, lambda rows: fn(inner(rows)), key, self.block, self.provenance, self.fetch,
                        self.fetch_rows)

    def start(self):
        """The tensorstore read of the rows (a future of ``array[num_rows, ...]``); not for a ``fetch`` plan."""
        from ..store.batched_reads import read_blocks, read_stacked

        return read_blocks([self.block]) if self.block is not None else read_stacked(self.views)

    async def read(self) -> Any:
        """The examples: the rows read, finished."""
        if self.fetch is not None:
            return self.finish(await self.fetch())
        from ..store.batched_reads import awaited

        return self.finish(await awaited(self.start()))


def group_sizes_of(steps: Sequence[int], group_sizes: Sequence[int] | None) -> list[int]:
    """``group_sizes`` of a :meth:`AsyncDataset.plan` call (None: one group of all ``steps``)."""
    return [len(steps)] if group_sizes is None else list(group_sizes)


def with_provenance(plans: list, where: Sequence | None) -> list:
    """``plans``, each carrying an empty provenance when one was asked for (a dataset whose rows are
    named by their global index alone)."""
    if where is not None:
        for p in plans:
            if p is not None and p.provenance is None:
                p.provenance = {}
    return plans


def check_range(idx: np.ndarray, length: int, what: str) -> None:
    """Raise :class:`DatasetExhausted` (naming ``what``) if an index of ``idx`` lies outside ``[0, length)``."""
    if not idx.size:
        return
    if idx.size <= 64:  # a few indices per source and step: Python's min/max beat numpy's reductions
        values = idx.tolist()
        lo, hi = min(values), max(values)
    else:
        lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= length:
        bad = int(idx[(idx < 0) | (idx >= length)][0])
        raise DatasetExhausted(f"{what}: index {bad} out of range [0, {length})")

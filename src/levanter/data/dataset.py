"""The dataset protocol: every read says which training step it serves.

``AsyncDataset[T].get_batch(step, indices)`` returns the examples at ``indices`` *for* training step
``step``. The contract: every index passed belongs to ``step`` (for the top-level dataset, indices lie
in ``[offset(step), offset(step) + batch_size(step))`` of the run's :class:`~levanter.schedule.BatchSchedule`).
Wrappers translate indices into their inner dataset's index space and pass ``step`` on unchanged, so
a dataset deep in the stack (a mixture, a curriculum) chooses its behaviour from the step it is
told, never by inferring it from an index.

Index spaces used in this module's docstrings:

* *this dataset's index*: what a caller passes to ``get_batch``;
* *inner index*: what a wrapper passes to the dataset it wraps.

Index maps are vectorised over numpy int64 arrays; results keep the order of ``indices`` (duplicates
allowed). Datasets hold no event-loop-bound state, so the loader may drive them from any thread.

Trade-off: ``get_batch`` returns a ``Sequence`` of examples (a list, or a numpy array whose rows are
the examples). Per-example Python objects cost time at large batches; datasets that can read whole
batches at once (stores) return arrays.

Read plans: ``plan_read(step, indices)`` is an optional second way in. A dataset backed by token
windows of a store answers with a :class:`ReadPlan` -- the store views to read and the function that
turns the rows read into what ``get_batch`` would have returned -- instead of reading; index-mapping
wrappers pass it through. A mixture asks each source for a plan and reads all sources' windows in
*one* tensorstore operation per step, where separate reads would cost a future, a callback on a
tensorstore thread and an event-loop wake-up each (docs/bench/2026-12-03-cpu-levers.md). Datasets that cannot
plan return None and are read with ``get_batch``; both ways return the same data. ``plan_reads(steps,
indices)`` plans several steps' reads at once: the loader reads a group of upcoming steps ahead with
one plan (:mod:`levanter.data.read_ahead`), and a mixture asks each source once for all of them.
``plan_read_groups`` plans several consecutive groups of steps with the index math of all of them in one
pass; any dataset that :meth:`~AsyncDataset.can_plan_reads` is read ahead by the loader, a single source
as much as a mixture.

Provenance: ``read_with_provenance(step, indices, where)`` is ``get_batch`` that also says where the rows
at ``where`` (the step's whole global batch; ``indices`` are among them) come from -- a mixture answers
``source`` and ``source_index`` -- from the same index-math pass as the read; ``plan_read_groups(...,
where=...)`` attaches the same to each plan (:attr:`ReadPlan.provenance`). A dataset that adds nothing
answers ``{}``; wrappers forward both.

Index maps: a wrapper tells which rows of another dataset it reads (:meth:`AsyncDataset.index_map`, an
:class:`IndexMap`), so a reader holding several wrapped sources (a mixture) or walking a source down to
its store (the data planner) uses each wrapper's own map without knowing its type.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from ._prp import FeistelPermutation, derive_seed, permute_many, seed_from_key

__all__ = [
    "StackedBatch",
    "DatasetExhausted",
    "as_index_array",
    "ReadPlan",
    "check_range",
    "IndexMap",
    "apply_index_maps",
    "AsyncDataset",
    "ListAsyncDataset",
    "MappedAsyncDataset",
    "BatchMappedAsyncDataset",
    "SlicedAsyncDataset",
    "EpochDataset",
    "PermutationDataset",
    "BlockShufflingDataset",
]

T = TypeVar("T")
U = TypeVar("U")


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
    rows are the n examples in order (an index-array view; see ``TokenSeqDataset.plan_reads``).
    """

    views: list
    finish: Callable[[np.ndarray], Any]
    row_key: Any = None
    block: Any = None
    # From ``plan_read_groups(..., where=...)``: per-row arrays over the steps' ``where`` indices, back to
    # back ({} for a dataset that adds nothing to the global index); None when not asked for.
    provenance: Any = None

    @property
    def num_rows(self) -> int:
        return len(self.views) if self.block is None else int(self.block.shape[0])

    def then(self, fn: Callable[[Any], Any], row_key: Any = None) -> "ReadPlan":
        """The same reads, with ``fn`` applied to this plan's result. Pass ``row_key`` (hashable, equal
        for equal functions) only if ``fn`` is row-wise too; the result keeps a key only if both have one."""
        inner = self.finish
        key = None if row_key is None or self.row_key is None else (self.row_key, row_key)
        return ReadPlan(self.views, lambda rows: fn(inner(rows)), key, self.block, self.provenance)


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


@dataclasses.dataclass(frozen=True)
class IndexMap:
    """Which rows of another dataset a wrapper reads: this dataset's index ``i`` is index ``fn(i)`` of
    ``inner``, read for the same step.

    ``fn`` is pure and vectorised (an int64 array in, an int64 array out, order kept; None: the identity);
    indices outside ``[0, length)`` raise :class:`DatasetExhausted` naming ``what`` (with ``length`` None,
    a negative index raises ``IndexError``). ``rewrites`` says whether the examples change on the way (``map``, causal-LM columns)
    or are ``inner``'s as they are (shuffles, slices, epochs): only in the second case may a reader read
    ``inner`` at ``fn(i)`` itself, as a mixture does to evaluate all its sources' maps in one pass.
    """

    inner: "AsyncDataset"
    fn: Callable[[np.ndarray], np.ndarray] | None = None
    length: int | None = None
    what: str = ""
    rewrites: bool = False

    def check(self, idx: np.ndarray) -> None:
        if self.length is not None:
            check_range(idx, self.length, self.what)
        elif idx.size and idx.min() < 0:
            raise IndexError(f"{self.what}: negative index {int(idx.min())}")

    def __call__(self, indices: Sequence[int]) -> np.ndarray:
        idx = as_index_array(indices)
        self.check(idx)
        return idx if self.fn is None else self.fn(idx)


def apply_index_maps(maps: Sequence[IndexMap], indices: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``[m(i) for m, i in zip(maps, indices)]``, the Feistel permutations among them evaluated in one
    vectorised pass (:func:`~levanter.data._prp.permute_many`): what a mixture pays per step is then one
    pass whatever the number of shuffled sources."""
    arrays = [as_index_array(i) for i in indices]
    for m, a in zip(maps, arrays):
        m.check(a)
    return permute_many([(m.fn, a) for m, a in zip(maps, arrays)])


class AsyncDataset(abc.ABC, Generic[T]):
    """A random-access dataset read in batches, one call per training step.

    Implementations define :meth:`get_batch`, :meth:`async_len` and :meth:`is_finite`.
    """

    @abc.abstractmethod
    async def get_batch(self, step: int, indices: Sequence[int]) -> Sequence[T]:
        """The examples at ``indices`` (this dataset's index space), read for training step ``step``."""

    @abc.abstractmethod
    async def async_len(self) -> int:
        """The number of examples. Raises ``ValueError`` for infinite datasets."""

    @abc.abstractmethod
    def is_finite(self) -> bool:
        """Whether :meth:`async_len` is defined."""

    async def plan_read(self, step: int, indices: Sequence[int]) -> ReadPlan | None:
        """A :class:`ReadPlan` for ``get_batch(step, indices)``, or None (the default): read it instead."""
        return None

    async def plan_reads(self, steps: Sequence[int], indices: Sequence[Sequence[int]]) -> ReadPlan | None:
        """One :class:`ReadPlan` for several steps' reads: its rows are those of ``get_batch(steps[k],
        indices[k])`` for each ``k``, in that order; or None: plan (or read) each step on its own.

        The default joins each step's :meth:`plan_read` where all of them finish alike, row by row (one
        ``row_key``). Datasets that plan many steps at once for the price of one override it: a mixture
        asks each source once for a group of consecutive steps.
        """
        plans = [await self.plan_read(s, i) for s, i in zip(steps, indices)]
        key = plans[0].row_key if plans and plans[0] is not None else None
        if key is None or any(p is None or p.block is not None or p.row_key != key for p in plans):
            return None
        return ReadPlan([v for p in plans for v in p.views], plans[0].finish, plans[0].row_key)

    def can_plan_reads(self) -> bool:
        """Whether :meth:`plan_read_groups` may answer with plans (token windows of a store, through any
        wrappers that pass plans on): the loader reads such a dataset ahead (:mod:`.read_ahead`). The
        default: no."""
        return False

    async def plan_read_groups(
        self,
        steps: Sequence[int],
        indices: Sequence[Sequence[int]],
        group_sizes: Sequence[int],
        where: Sequence[np.ndarray] | None = None,
    ) -> list[ReadPlan | None]:
        """:meth:`plan_reads` of consecutive groups of ``steps`` (``group_sizes[g]`` steps each), one plan
        (or None) per group. With ``where`` (per step: the indices whose provenance is wanted, ``indices``
        among them), each plan carries :attr:`ReadPlan.provenance` over them, from the same pass.

        The default plans each group on its own and adds no provenance (``{}``). Index-mapping wrappers
        map all the groups' indices in one pass and pass the call on; a mixture does all its index math
        for all the groups in one pass.
        """
        plans, at = [], 0
        for size in group_sizes:
            plan = await self.plan_reads(steps[at : at + size], indices[at : at + size])
            if plan is not None and where is not None:
                plan.provenance = {}
            plans.append(plan)
            at += size
        return plans

    async def read_with_provenance(
        self, step: int, indices: Sequence[int], where: np.ndarray
    ) -> tuple[Sequence[T], dict[str, np.ndarray]]:
        """``get_batch(step, indices)`` and where the rows at ``where`` (this dataset's indices of ``step``,
        ``indices`` among them) come from, per row, from the same pass: ``{}`` by default (the global
        index says it all); a mixture adds ``source`` and ``source_index``; wrappers forward."""
        return await self.get_batch(step, indices), {}

    async def index_map(self) -> IndexMap | None:
        """The rows of another dataset this one reads (an :class:`IndexMap`), or None: a dataset that reads
        its own rows (a store, a list, a mixture)."""
        return None

    # -- combinators ---------------------------------------------------------------------------------
    def map(self, fn: Callable[[T], U]) -> "MappedAsyncDataset[T, U]":
        return MappedAsyncDataset(self, fn)

    def map_batches(self, fn: Callable[[Sequence[T]], Sequence[U]]) -> "BatchMappedAsyncDataset[T, U]":
        return BatchMappedAsyncDataset(self, fn)

    def slice_dataset(self, start: int = 0, end: int | None = None) -> "SlicedAsyncDataset[T]":
        return SlicedAsyncDataset(self, start, end)

    def shuffle(self, key) -> "PermutationDataset[T]":
        return PermutationDataset(self, key=key)

    def block_shuffle(self, block_size: int, key, *, shuffle_blocks: bool = True) -> "BlockShufflingDataset[T]":
        return BlockShufflingDataset(self, block_size, key=key, shuffle_blocks=shuffle_blocks)

    def era_shuffle(self, era_length: int, key) -> "BlockShufflingDataset[T]":
        """Upstream's era shuffle: permute within consecutive eras, keep era order."""
        return BlockShufflingDataset(self, era_length, key=key, shuffle_blocks=False)

    def epochs(self, max_epochs: int | None = None) -> "EpochDataset[T]":
        return EpochDataset(self, max_epochs=max_epochs)


class ListAsyncDataset(AsyncDataset[T]):
    """An in-memory finite dataset (tests, small sources). A numpy array is served row-wise."""

    def __init__(self, data: Sequence[T]):
        self._data = data

    async def get_batch(self, step: int, indices: Sequence[int]) -> Sequence[T]:
        idx = as_index_array(indices)
        check_range(idx, len(self._data), "ListAsyncDataset")
        if isinstance(self._data, np.ndarray):
            return self._data[idx]
        return [self._data[i] for i in idx.tolist()]

    async def async_len(self) -> int:
        return len(self._data)

    def is_finite(self) -> bool:
        return True


class _Wrapper(AsyncDataset[T]):
    """A dataset over ``dataset`` that changes its examples, row for row (``map``, ``map_batches``):
    provenance passes through, and its :meth:`index_map` is the identity, rewriting."""

    def __init__(self, dataset: AsyncDataset):
        self.dataset = dataset

    async def async_len(self) -> int:
        return await self.dataset.async_len()

    def is_finite(self) -> bool:
        return self.dataset.is_finite()

    async def index_map(self) -> IndexMap | None:
        return IndexMap(self.dataset, rewrites=True)

    def _rewrite(self, examples: Sequence, n: int) -> Sequence:
        raise NotImplementedError

    async def get_batch(self, step: int, indices: Sequence[int]) -> Sequence[U]:
        return self._rewrite(await self.dataset.get_batch(step, indices), len(indices))

    async def read_with_provenance(self, step: int, indices: Sequence[int], where: np.ndarray):
        examples, provenance = await self.dataset.read_with_provenance(step, indices, where)
        return self._rewrite(examples, len(indices)), provenance


def _split_like(flat: np.ndarray, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return np.split(flat, np.cumsum([a.size for a in arrays])[:-1])


class _IndexMapWrapper(_Wrapper[T]):
    """A wrapper that only translates indices (its :class:`IndexMap`, built once by
    :meth:`_build_index_map`): reads, plans and provenance pass through to the inner dataset."""

    def __init__(self, dataset: AsyncDataset):
        super().__init__(dataset)
        # A fact about the inner dataset, built on first use; racing builds agree, and it is replaced
        # whole, never mutated.
        self._map: IndexMap | None = None

    async def _build_index_map(self) -> IndexMap:
        raise NotImplementedError

    async def index_map(self) -> IndexMap:
        if self._map is None:
            self._map = await self._build_index_map()
        return self._map

    async def get_batch(self, step: int, indices: Sequence[int]) -> Sequence[T]:
        return await self.dataset.get_batch(step, (await self.index_map())(indices))

    async def read_with_provenance(self, step: int, indices: Sequence[int], where: np.ndarray):
        m = await self.index_map()
        return await self.dataset.read_with_provenance(step, m(indices), m(where))

    async def plan_read(self, step: int, indices: Sequence[int]) -> ReadPlan | None:
        return await self.dataset.plan_read(step, (await self.index_map())(indices))

    async def plan_reads(self, steps: Sequence[int], indices: Sequence[Sequence[int]]) -> ReadPlan | None:
        # An index map does not depend on the step: all the steps' indices are mapped in one pass.
        arrays = [as_index_array(i) for i in indices]
        if not arrays:
            return None
        inner = (await self.index_map())(np.concatenate(arrays))
        return await self.dataset.plan_reads(steps, _split_like(inner, arrays))

    def can_plan_reads(self) -> bool:
        return self.dataset.can_plan_reads()

    async def plan_read_groups(self, steps, indices, group_sizes, where=None) -> list[ReadPlan | None]:
        # All the groups' indices (and the provenance's) mapped in one pass.
        m = await self.index_map()
        arrays = [as_index_array(i) for i in indices]
        if not arrays:
            return []
        inner = _split_like(m(np.concatenate(arrays)), arrays)
        if where is not None:
            wheres = [as_index_array(w) for w in where]
            where = _split_like(m(np.concatenate(wheres)), wheres)
        return await self.dataset.plan_read_groups(steps, inner, group_sizes, where)


class MappedAsyncDataset(_Wrapper[U], Generic[T, U]):
    """Applies ``fn`` to each example. Indices and ``step`` pass through unchanged."""

    def __init__(self, dataset: AsyncDataset[T], fn: Callable[[T], U]):
        super().__init__(dataset)
        self.fn = fn

    def _rewrite(self, examples: Sequence[T], n: int) -> Sequence[U]:
        return [self.fn(x) for x in examples]


class BatchMappedAsyncDataset(_Wrapper[U], Generic[T, U]):
    """Applies ``fn`` to each whole batch (``fn(examples) -> examples`` of the same length), so the
    work can be vectorised. Indices and ``step`` pass through unchanged."""

    def __init__(self, dataset: AsyncDataset[T], fn: Callable[[Sequence[T]], Sequence[U]]):
        super().__init__(dataset)
        self.fn = fn

    def _rewrite(self, examples: Sequence[T], n: int) -> Sequence[U]:
        out = self.fn(examples)
        if len(out) != n:
            raise ValueError(f"batch map returned {len(out)} examples for {n} indices")
        return out


class SlicedAsyncDataset(_IndexMapWrapper[T]):
    """Rows ``[start, end)`` of the inner dataset: this index ``i`` is inner index ``start + i``."""

    def __init__(self, dataset: AsyncDataset[T], start: int = 0, end: int | None = None):
        super().__init__(dataset)
        if start < 0 or (end is not None and end < start):
            raise ValueError(f"invalid slice [{start}, {end})")
        self.start, self.end = start, end

    async def _build_index_map(self) -> IndexMap:
        length = None if self.end is None else self.end - self.start
        return IndexMap(self.dataset, functools.partial(np.add, self.start), length, "SlicedAsyncDataset")

    async def async_len(self) -> int:
        inner = await self.dataset.async_len()
        end = inner if self.end is None else min(self.end, inner)
        return max(0, end - self.start)

    def is_finite(self) -> bool:
        return self.end is not None or self.dataset.is_finite()


class EpochDataset(_IndexMapWrapper[T]):
    """Repeats a finite dataset: this index ``i`` is inner index ``i mod len``.

    With ``max_epochs`` the dataset has ``max_epochs * len`` examples and raises
    :class:`DatasetExhausted` past them; without it, it is infinite.
    """

    def __init__(self, dataset: AsyncDataset[T], max_epochs: int | None = None):
        super().__init__(dataset)
        if not dataset.is_finite():
            raise ValueError("EpochDataset needs a finite inner dataset")
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1, got {max_epochs}")
        self.max_epochs = max_epochs

    async def index_map(self) -> IndexMap:
        # Not kept: an empty inner dataset must fail every read, and its length is read each time.
        n = await self.dataset.async_len()
        if n == 0:
            raise DatasetExhausted("EpochDataset: the inner dataset is empty")
        length = None if self.max_epochs is None else n * self.max_epochs
        return IndexMap(self.dataset, functools.partial(_mod, n=n), length, "EpochDataset")

    async def async_len(self) -> int:
        if self.max_epochs is None:
            raise ValueError("EpochDataset without max_epochs is infinite")
        return self.max_epochs * await self.dataset.async_len()

    def is_finite(self) -> bool:
        return self.max_epochs is not None


class PermutationDataset(_IndexMapWrapper[T]):
    """A full pseudo-random permutation of a finite dataset: this index ``i`` is inner index
    ``perm(i)``, with ``perm`` a stateless Feistel bijection on ``[0, len)`` keyed by ``key``.

    ``key`` (an int or a jax PRNG key) is required.
    """

    def __init__(self, dataset: AsyncDataset[T], *, key):
        super().__init__(dataset)
        if not dataset.is_finite():
            raise ValueError("PermutationDataset needs a finite inner dataset")
        self.seed = seed_from_key(key)
        self._perm: FeistelPermutation | None = None

    async def permutation(self) -> FeistelPermutation:
        if self._perm is None:
            self._perm = FeistelPermutation(await self.dataset.async_len(), self.seed)
        return self._perm

    async def _build_index_map(self) -> IndexMap:
        # The permutation itself is the map, so a caller holding several sources evaluates all their
        # permutations in one pass (apply_index_maps).
        perm = await self.permutation()
        return IndexMap(self.dataset, perm, perm.n, "PermutationDataset")


class BlockShufflingDataset(_IndexMapWrapper[T]):
    """Shuffles within fixed-size blocks of the inner dataset and, optionally, the order of blocks.

    This index ``i`` lies in this block ``b = i // block_size`` at offset ``o = i % block_size``. The
    inner index is ``B * block_size + perm_B(o)`` with ``B = block_perm(b)`` (identity when
    ``shuffle_blocks`` is False: upstream's era shuffle) and ``perm_B`` keyed by ``(key, B)``. A final
    partial block is shuffled within itself and stays last, so the map is a bijection on ``[0, len)``.
    Reads touch few blocks, which keeps storage access local; the trade-off is weaker mixing than a
    full permutation.
    """

    def __init__(self, dataset: AsyncDataset[T], block_size: int, *, key, shuffle_blocks: bool = True):
        super().__init__(dataset)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not dataset.is_finite():
            raise ValueError("BlockShufflingDataset needs a finite inner dataset")
        self.block_size = block_size
        self.shuffle_blocks = shuffle_blocks
        self.seed = seed_from_key(key)

    async def _build_index_map(self) -> IndexMap:
        n = await self.dataset.async_len()
        return IndexMap(self.dataset, functools.partial(self.inner_indices, n=n), n, "BlockShufflingDataset")

    def inner_indices(self, idx: np.ndarray, n: int) -> np.ndarray:
        k = self.block_size
        full_blocks = n // k
        block, within = np.divmod(idx, k)
        inner_block = block.copy()
        in_full = block < full_blocks
        if self.shuffle_blocks and full_blocks > 1 and in_full.any():
            inner_block[in_full] = FeistelPermutation(full_blocks, derive_seed(self.seed, 0))(block[in_full])
        out = np.empty_like(idx)
        for b in np.unique(inner_block).tolist():
            sel = inner_block == b
            size = k if b < full_blocks else n - full_blocks * k
            perm = FeistelPermutation(size, derive_seed(self.seed, 1, b))
            out[sel] = b * k + perm(within[sel])
        return out


def _mod(idx: np.ndarray, n: int) -> np.ndarray:
    return idx % n

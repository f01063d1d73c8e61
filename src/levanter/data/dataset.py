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

Read plans: ``plan(steps, indices, group_sizes=None, where=None)`` is the one planning method. It says
where the rows of ``get_batch(steps[k], indices[k])`` are read, as one :class:`ReadPlan` per group of
consecutive steps -- the store views to read (or, for a mixture whose sources read otherwise, the reads to
await) and the function that turns the rows read into what ``get_batch`` returns -- or None where a
dataset cannot say (then it is read with ``get_batch``; both ways return the same data). Token windows of
a store answer with views, index-mapping wrappers map all the groups' indices in one pass and pass the
call on, and a mixture does its layout, stop strategy and permutations for every step at once and reads
all its sources' windows in *one* tensorstore operation, where separate reads would cost a future, a
callback on a tensorstore thread and an event-loop wake-up each
(docs/bench/2026-12-03-cpu-levers.md). The loader reads
upcoming steps ahead in groups through it (:mod:`levanter.data.read_ahead`); a mixture's ``get_batch`` is
its one-step plan, read (:func:`read_planned`).

Provenance: with ``where`` (per step: the step's whole global batch; ``indices`` are among it) each plan
also says where those rows come from (:attr:`ReadPlan.provenance`) -- a mixture answers ``source`` and
``source_index`` -- from the same index-math pass as the read. A dataset that adds nothing answers ``{}``;
wrappers forward it. :func:`read_planned` reads one step with its provenance.

Index maps: a wrapper tells which rows of another dataset it reads (:meth:`AsyncDataset.index_map`, an
:class:`IndexMap`), so a reader holding several wrapped sources (a mixture) or walking a source down to
its store (the data planner) uses each wrapper's own map without knowing its type.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np

from ._prp import FeistelPermutation, derive_seed, permute_many, seed_from_key
from .read_plan import DatasetExhausted, ReadPlan, as_index_array, check_range, group_sizes_of

__all__ = [
    "read_planned",
    "IndexMap",
    "apply_index_maps",
    "AsyncDataset",
    "ListAsyncDataset",
    "WrapperDataset",
    "MappedAsyncDataset",
    "BatchMappedAsyncDataset",
    "SlicedAsyncDataset",
    "EpochDataset",
    "PermutationDataset",
    "BlockShufflingDataset",
]

T = TypeVar("T")
U = TypeVar("U")


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


async def read_planned(dataset: "AsyncDataset", step: int, indices: Sequence[int], where: np.ndarray | None = None):
    """``(get_batch(step, indices), provenance)`` read through ``dataset``'s one-step plan, so the
    provenance of ``where`` (None: not asked for) comes from the read's own pass; a dataset that cannot
    plan the step is read with ``get_batch`` and adds no provenance (``{}``)."""
    (plan,) = await dataset.plan([step], [indices], None, None if where is None else [where])
    if plan is None:
        return await dataset.get_batch(step, indices), (None if where is None else {})
    return await plan.read(), (None if where is None else plan.provenance)


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

    async def plan(
        self,
        steps: Sequence[int],
        indices: Sequence[Sequence[int]],
        group_sizes: Sequence[int] | None = None,
        where: Sequence[np.ndarray] | None = None,
    ) -> list[ReadPlan | None]:
        """Where the rows of ``get_batch(steps[k], indices[k])`` are read, for every ``k``: one
        :class:`ReadPlan` per consecutive group of ``steps`` (``group_sizes[g]`` steps each; None: one
        group of all of them), its rows the group's steps' rows back to back, or None for a group this
        dataset cannot plan (its steps are read with :meth:`get_batch`).

        With ``where`` (per step, ascending: the indices whose provenance is wanted, ``indices`` among
        them) each plan carries :attr:`ReadPlan.provenance` over them, from the same pass (``{}`` where the
        global index says it all). This is the one planning method: a wrapper maps all the groups'
        indices at once and passes the call on; a mixture does all its index math in one pass. The
        default: no plan.
        """
        return [None] * len(group_sizes_of(steps, group_sizes))

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


class WrapperDataset(AsyncDataset[T]):
    """A dataset over ``dataset`` that changes its examples on the way (``map``, ``map_batches``,
    causal-LM columns): its :meth:`index_map` is the identity, rewriting, and its plans are the inner
    dataset's with :meth:`_rewrite_plan` applied (provenance passes through). A subclass says how it
    rewrites a batch (:meth:`_rewrite`) and, where that is row-wise, a plan."""

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

    def _rewrite_plan(self, plan: ReadPlan, steps: int) -> ReadPlan | None:
        """``plan`` (of ``steps`` steps' rows) with this wrapper's rewrite applied, or None where the
        rewrite cannot apply to several steps' rows at once. The default: a per-example rewrite."""
        return plan.then(functools.partial(_rewrite_all, self._rewrite))

    async def get_batch(self, step: int, indices: Sequence[int]) -> Sequence[U]:
        return self._rewrite(await self.dataset.get_batch(step, indices), len(indices))

    async def plan(self, steps, indices, group_sizes=None, where=None) -> list[ReadPlan | None]:
        plans = await self.dataset.plan(steps, indices, group_sizes, where)
        sizes = group_sizes_of(steps, group_sizes)
        return [None if p is None else self._rewrite_plan(p, n) for p, n in zip(plans, sizes)]


def _rewrite_all(rewrite: Callable, examples: Sequence) -> Sequence:
    return rewrite(examples, len(examples))


def _split_like(flat: np.ndarray, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return np.split(flat, np.cumsum([a.size for a in arrays])[:-1])


class _IndexMapWrapper(WrapperDataset[T]):
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

    async def plan(self, steps, indices, group_sizes=None, where=None) -> list[ReadPlan | None]:
        # An index map does not depend on the step: all the steps' indices (and the provenance's) are
        # mapped in one pass.
        m = await self.index_map()
        arrays = [as_index_array(i) for i in indices]
        if not arrays:
            return [None] * len(group_sizes_of(steps, group_sizes))
        inner = _split_like(m(np.concatenate(arrays)), arrays)
        if where is not None:
            wheres = [as_index_array(w) for w in where]
            where = _split_like(m(np.concatenate(wheres)), wheres)
        return await self.dataset.plan(steps, inner, group_sizes, where)


class MappedAsyncDataset(WrapperDataset[U], Generic[T, U]):
    """Applies ``fn`` to each example. Indices and ``step`` pass through unchanged."""

    def __init__(self, dataset: AsyncDataset[T], fn: Callable[[T], U]):
        super().__init__(dataset)
        self.fn = fn

    def _rewrite(self, examples: Sequence[T], n: int) -> Sequence[U]:
        return [self.fn(x) for x in examples]


class BatchMappedAsyncDataset(WrapperDataset[U], Generic[T, U]):
    """Applies ``fn`` to each whole batch (``fn(examples) -> examples`` of the same length), so the
    work can be vectorised. Indices and ``step`` pass through unchanged; ``fn`` always sees one step's
    batch (a plan of several steps' rows is not rewritten: those steps are read one by one)."""

    def __init__(self, dataset: AsyncDataset[T], fn: Callable[[Sequence[T]], Sequence[U]]):
        super().__init__(dataset)
        self.fn = fn

    def _rewrite(self, examples: Sequence[T], n: int) -> Sequence[U]:
        out = self.fn(examples)
        if len(out) != n:
            raise ValueError(f"batch map returned {len(out)} examples for {n} indices")
        return out

    def _rewrite_plan(self, plan: ReadPlan, steps: int) -> ReadPlan | None:
        return super()._rewrite_plan(plan, steps) if steps == 1 else None


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

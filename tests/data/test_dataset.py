"""Wrappers forward `step` unchanged and map indices as documented."""

import asyncio

import numpy as np
import pytest

from levanter.data.dataset import (
    AsyncDataset,
    BlockShufflingDataset,
    EpochDataset,
    ListAsyncDataset,
    PermutationDataset,
)
from levanter.data.read_plan import DatasetExhausted


class StepRecorder(AsyncDataset):
    """Serves index i as i and records (step, indices) of every call."""

    def __init__(self, n):
        self.n = n
        self.calls = []

    async def get_batch(self, step, indices):
        self.calls.append((step, list(indices)))
        return np.asarray(indices)

    async def async_len(self):
        return self.n

    def is_finite(self):
        return True


def read(ds, step, indices):
    return list(np.asarray(asyncio.run(ds.get_batch(step, indices))))


WRAPPERS = {
    "map": lambda d: d.map(lambda x: x * 10),
    "slice": lambda d: d.slice_dataset(5, 50),
    "epochs": lambda d: d.epochs(),
    "shuffle": lambda d: d.shuffle(key=3),
    "block_shuffle": lambda d: d.block_shuffle(7, key=3),
    "era_shuffle": lambda d: d.era_shuffle(7, key=3),
}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_every_wrapper_forwards_step(name):
    inner = StepRecorder(100)
    ds = WRAPPERS[name](inner)
    read(ds, 41, [0, 1, 2])
    assert [c[0] for c in inner.calls] == [41]


def test_nested_wrappers_forward_step():
    inner = StepRecorder(100)
    ds = inner.shuffle(key=1).slice_dataset(10, 60).map(int).epochs(max_epochs=2).block_shuffle(8, key=2)
    read(ds, 12345, list(range(20)))
    assert {c[0] for c in inner.calls} == {12345}


def test_slice_and_map():
    base = ListAsyncDataset(list(range(100)))
    assert read(base.slice_dataset(10, 20), 0, [0, 9]) == [10, 19]
    assert asyncio.run(base.slice_dataset(10, 20).async_len()) == 10
    assert asyncio.run(base.slice_dataset(90).async_len()) == 10
    assert read(base.map(lambda x: -x), 0, [3]) == [-3]
    with pytest.raises(DatasetExhausted):
        read(base.slice_dataset(10, 20), 0, [10])


def test_epochs_wrap_and_end():
    base = ListAsyncDataset(list(range(5)))
    assert read(EpochDataset(base), 0, [0, 4, 5, 12]) == [0, 4, 0, 2]
    bounded = EpochDataset(base, max_epochs=2)
    assert asyncio.run(bounded.async_len()) == 10
    assert not EpochDataset(base).is_finite() and bounded.is_finite()
    with pytest.raises(DatasetExhausted):
        read(bounded, 0, [10])


@pytest.mark.parametrize("n", [1, 2, 7, 64, 101])
def test_permutation_is_a_bijection(n):
    ds = PermutationDataset(ListAsyncDataset(list(range(n))), key=0)
    out = read(ds, 0, list(range(n)))
    assert sorted(out) == list(range(n))
    if n > 10:
        assert out != list(range(n))


@pytest.mark.parametrize("n, k", [(1, 4), (10, 4), (64, 8), (101, 7), (100, 100), (30, 50)])
@pytest.mark.parametrize("shuffle_blocks", [True, False])
def test_block_shuffle_is_a_bijection_within_blocks(n, k, shuffle_blocks):
    ds = BlockShufflingDataset(ListAsyncDataset(list(range(n))), k, key=5, shuffle_blocks=shuffle_blocks)
    out = read(ds, 0, list(range(n)))
    assert sorted(out) == list(range(n))
    full = n // k
    for b in range(-(-n // k)):
        chunk = out[b * k : (b + 1) * k]
        inner_blocks = {x // k for x in chunk}
        assert len(inner_blocks) == 1  # a block maps onto one inner block, whole
        if not shuffle_blocks or b >= full:
            assert inner_blocks == {b}


def test_shuffles_require_a_seed():
    base = ListAsyncDataset(list(range(10)))
    with pytest.raises(ValueError, match="seed is required"):
        base.shuffle(key=None)
    with pytest.raises(ValueError, match="seed is required"):
        base.block_shuffle(4, key=None)


def test_shuffles_are_deterministic_and_seeded():
    base = ListAsyncDataset(list(range(1000)))
    a = read(base.shuffle(key=1), 0, list(range(1000)))
    assert a == read(base.shuffle(key=1), 0, list(range(1000)))
    assert a != read(base.shuffle(key=2), 0, list(range(1000)))


def test_stacked_batches_flow_through_mixture_in_position_order():
    from levanter.data.read_plan import StackedBatch
    from levanter.data.mixture import MixtureDataset

    class Columnar(ListAsyncDataset):
        async def get_batch(self, step, indices):
            rows = np.asarray(await super().get_batch(step, indices))
            return StackedBatch({"x": rows, "twice": np.stack([rows, rows], axis=1)})

    mix = MixtureDataset(
        {"a": Columnar(np.arange(100)), "b": Columnar(np.arange(100) + 1000)}, {"a": 1, "b": 1}, batch_schedule=8, key=0
    )
    plain = MixtureDataset(
        {"a": ListAsyncDataset(np.arange(100)), "b": ListAsyncDataset(np.arange(100) + 1000)},
        {"a": 1, "b": 1},
        batch_schedule=8,
        key=0,
    )
    got = asyncio.run(mix.get_batch(1, list(range(8, 16))))
    want = np.asarray(asyncio.run(plain.get_batch(1, list(range(8, 16)))))
    assert isinstance(got, StackedBatch) and len(got) == 8
    np.testing.assert_array_equal(got.tree["x"], want)
    np.testing.assert_array_equal(got.tree["twice"][:, 1], want)
    assert got[3]["x"] == want[3]


def test_map_batches_is_vectorised_and_length_checked():
    base = ListAsyncDataset(np.arange(10))
    assert read(base.map_batches(lambda xs: np.asarray(xs) * 2), 0, [1, 2]) == [2, 4]
    with pytest.raises(ValueError, match="returned 1 examples"):
        read(base.map_batches(lambda xs: xs[:1]), 0, [1, 2])


def test_every_wrapper_exposes_the_index_map_it_reads_through():
    """Each wrapper's public ``index_map`` says which rows of which dataset it reads: reading the inner
    dataset at the mapped indices gives the wrapper's own rows (for every index of a small domain, and
    chained through several wrappers); shuffles, slices and epochs pass examples through (``rewrites``
    False), ``map`` rewrites them; a leaf has no map; an index past the end fails as a read does."""
    base = ListAsyncDataset(np.arange(30) * 7)
    wrappers = {
        "shuffle": base.shuffle(key=3),
        "block_shuffle": base.block_shuffle(4, key=5),
        "era_shuffle": base.era_shuffle(8, key=6),
        "slice": base.slice_dataset(4, 25),
        "epochs": base.slice_dataset(3, 14).epochs(max_epochs=3),
        "chain": base.shuffle(key=1).slice_dataset(2, 20).block_shuffle(5, key=2),
        "map": base.map(lambda x: x + 1),
    }

    async def check():
        assert await base.index_map() is None
        for name, ds in wrappers.items():
            n = await ds.async_len()
            idx = np.arange(n)
            d, mapped, rewrote = ds, idx, False
            while (m := await d.index_map()) is not None:
                d, mapped, rewrote = m.inner, m(mapped), rewrote or m.rewrites
            assert d is base, name
            assert rewrote == (name == "map"), name
            own = np.asarray(await ds.get_batch(0, idx))
            through = np.asarray(await base.get_batch(0, mapped))
            np.testing.assert_array_equal(own, through + (1 if name == "map" else 0), err_msg=name)
            if name != "map":
                with pytest.raises(DatasetExhausted):
                    (await ds.index_map())(np.array([n]))

    asyncio.run(check())


class _WindowsOnly:
    """A token store that reads windows but cannot hand out views of them (not a WindowStore)."""

    def __init__(self, tokens):
        self.tokens, self.path, self.data_size = tokens, "memory://windows-only", tokens.size

    async def read_windows(self, starts, length):
        return np.stack([self.tokens[s : s + length] for s in np.asarray(starts).tolist()])


def test_a_store_without_views_is_read_with_get_batch_and_a_mixture_still_gives_provenance():
    """``TokenSeqDataset`` plans only over a ``WindowStore``; over any other token store its ``plan`` says
    None and its rows come from ``get_batch``. A mixture of such sources still answers a one-step plan
    (each source read, merged), so the loader's batches carry their provenance from the read's own pass,
    and they equal the sources' own rows."""
    from levanter.data.loader import DataLoader
    from levanter.data.mixture import MixtureDataset
    from levanter.data.text import TokenSeqDataset, TokenStore, WindowStore
    from levanter.schedule import BatchSchedule

    stores = [_WindowsOnly(np.arange(400, dtype=np.int32) + 1000 * k) for k in range(2)]
    assert isinstance(stores[0], TokenStore) and not isinstance(stores[0], WindowStore)
    sources = {f"s{k}": TokenSeqDataset(s, 4).shuffle(key=k) for k, s in enumerate(stores)}
    assert asyncio.run(sources["s0"].plan([0, 1], [[0, 1], [2]], [1, 1])) == [None, None]
    schedule = BatchSchedule(4)
    mix = MixtureDataset(sources, {"s0": 0.5, "s1": 0.5}, batch_schedule=schedule, key=1)
    with DataLoader(mix, schedule, prefetch_depth=2, provenance=True).iter_from_step(0, 12) as it:
        batches = list(it)
    assert [b.step for b in batches] == list(range(12))
    for b in batches:
        got = np.asarray(b.data)
        for row, (s, i) in enumerate(zip(b.provenance["source"], b.provenance["source_index"])):
            want = asyncio.run(sources[f"s{s}"].get_batch(b.step, [i]))[0]
            np.testing.assert_array_equal(got[row], want, err_msg=f"step {b.step} row {row}")

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# Tests for the step-ordered DataLoader (levanter.data.loader).
#
# Expectations are computed independently of BatchSchedule: expected_steps() walks the steps one at a
# time from the raw (start, size) spec and sums batch sizes, so a wrong offset in the schedule or the
# loader shows up as a mismatch rather than being reproduced by the test.

import asyncio  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from levanter.data.dataset import AsyncDataset, ListAsyncDataset  # noqa: E402
from levanter.data.read_plan import DatasetExhausted  # noqa: E402
from levanter.data.loader import Batch, DataLoader, process_rows  # noqa: E402
from levanter.data.mixture import MixtureDataset  # noqa: E402
from levanter.schedule import BatchSchedule, ScheduleStep  # noqa: E402

# The run described in the brief: 8 per step, 16 from step 10, 4 from step 25.
SPEC_3SEG = [(0, 8), (10, 16), (25, 4)]
# A schedule with one change at step 10 (for the restore sweep and the latency test).
SPEC_2SEG = [(0, 8), (10, 16)]


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def schedule_of(spec) -> BatchSchedule:
    return BatchSchedule([ScheduleStep(s, v) for s, v in spec])


def expected_steps(spec, n_steps: int) -> list[tuple[int, int]]:
    """``(global_offset, batch_size)`` for steps ``0..n_steps-1``, by walking steps one at a time."""
    out = []
    offset = 0
    for step in range(n_steps):
        size = [v for start, v in spec if start <= step][-1]
        out.append((offset, size))
        offset += size
    return out


class RecordingDataset(AsyncDataset):
    """Records ``(step, list(indices))`` for every ``get_batch`` call, then delegates."""

    def __init__(self, inner: AsyncDataset):
        self.inner = inner
        self.calls: list[tuple[int, list[int]]] = []
        self.completed: list[int] = []  # steps in the order their reads finished
        self._lock = threading.Lock()

    async def get_batch(self, step, indices):
        with self._lock:
            self.calls.append((int(step), [int(i) for i in indices]))
        out = await self.inner.get_batch(step, indices)
        with self._lock:
            self.completed.append(int(step))
        return out

    async def async_len(self):
        return await self.inner.async_len()

    def is_finite(self):
        return self.inner.is_finite()


class LatencyDataset(AsyncDataset):
    """Sleeps a seeded pseudo-random 0-20 ms before each read (deterministic per (seed, step))."""

    def __init__(self, inner: AsyncDataset, seed: int, max_seconds: float = 0.020):
        self.inner = inner
        self.seed = seed
        self.max_seconds = max_seconds

    async def get_batch(self, step, indices):
        rng = np.random.default_rng([self.seed, int(step)])
        await asyncio.sleep(float(rng.uniform(0.0, self.max_seconds)))
        return await self.inner.get_batch(step, indices)

    async def async_len(self):
        return await self.inner.async_len()

    def is_finite(self):
        return self.inner.is_finite()


class FailingDataset(AsyncDataset):
    """Raises ``ExpectedFailure`` when asked for step ``bad_step``."""

    def __init__(self, inner: AsyncDataset, bad_step: int):
        self.inner = inner
        self.bad_step = bad_step

    async def get_batch(self, step, indices):
        if step == self.bad_step:
            raise ExpectedFailure(f"injected failure for step {step}")
        return await self.inner.get_batch(step, indices)

    async def async_len(self):
        return await self.inner.async_len()

    def is_finite(self):
        return self.inner.is_finite()


class ExpectedFailure(Exception):
    pass


class SlowDataset(AsyncDataset):
    """Sleeps a fixed time before each read."""

    def __init__(self, inner: AsyncDataset, seconds: float):
        self.inner = inner
        self.seconds = seconds

    async def get_batch(self, step, indices):
        await asyncio.sleep(self.seconds)
        return await self.inner.get_batch(step, indices)

    async def async_len(self):
        return await self.inner.async_len()

    def is_finite(self):
        return self.inner.is_finite()


class ClaimsInfinite(AsyncDataset):
    """Reports itself infinite, so the loader cannot know the end ahead and must rely on
    :class:`DatasetExhausted` raised by the inner (finite) dataset."""

    def __init__(self, inner: AsyncDataset):
        self.inner = inner

    async def get_batch(self, step, indices):
        return await self.inner.get_batch(step, indices)

    async def async_len(self):
        raise ValueError("infinite")

    def is_finite(self):
        return False


def identity_dataset(n: int = 10_000) -> AsyncDataset:
    """Example ``i`` is the integer ``i``; infinite (wraps mod ``n``)."""
    return ListAsyncDataset(np.arange(n, dtype=np.int64)).epochs()


def make_mixture(spec, *, block_size=None, latency: bool = False, stage_switch: int = 13, seed: int = 0):
    """A 3-source, 2-stage mixture; source ``k`` holds ``k * 100_000 + i`` so values name their source."""
    sources = {}
    for k, (name, n) in enumerate([("a", 301), ("b", 517), ("c", 89)]):
        ds: AsyncDataset = ListAsyncDataset(np.arange(n, dtype=np.int64) + k * 100_000).shuffle(key=seed + k)
        if latency:
            ds = LatencyDataset(ds, seed=1000 * seed + k)
        sources[name] = ds
    weights = [(0, {"a": 0.5, "b": 0.3, "c": 0.2}), (stage_switch, {"a": 0.1, "b": 0.2, "c": 0.7})]
    return MixtureDataset(
        sources,
        weights,
        batch_schedule=schedule_of(spec),
        block_size=block_size,
        key=seed,
        stop_strategy="restart",
    )


def to_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(x), tree)


def assert_batches_equal(got: list[Batch], want: list[Batch]):
    assert [b.step for b in got] == [b.step for b in want]
    assert [b.global_offset for b in got] == [b.global_offset for b in want]
    assert [b.batch_size for b in got] == [b.batch_size for b in want]
    for g, w in zip(got, want):
        g_leaves, g_def = jax.tree.flatten(to_numpy(g.data))
        w_leaves, w_def = jax.tree.flatten(to_numpy(w.data))
        assert g_def == w_def, f"step {g.step}: tree structure differs"
        for gl, wl in zip(g_leaves, w_leaves):
            np.testing.assert_array_equal(gl, wl, err_msg=f"step {g.step}")


def take(it, n: int) -> list[Batch]:
    out = []
    for _ in range(n):
        out.append(next(it))
    return out


def drain(it) -> list[Batch]:
    try:
        return list(it)
    finally:
        it.close()


def prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "levanter-data-prefetch"}


def devices8():
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()} (set XLA_FLAGS before importing jax)")
    return np.asarray(jax.devices()[:8])


# ---------------------------------------------------------------------------------------------------
# exactly the right indices, once per step
# ---------------------------------------------------------------------------------------------------
N_STEPS_3SEG = 40


def _expected_calls(spec, n_steps):
    return [(s, list(range(off, off + bs))) for s, (off, bs) in enumerate(expected_steps(spec, n_steps))]


def test_sync_loader_requests_exactly_each_steps_range_once_in_order():
    rec = RecordingDataset(identity_dataset())
    loader = DataLoader(rec, schedule_of(SPEC_3SEG), prefetch_depth=0)
    batches = drain(loader.iter_from_step(0, N_STEPS_3SEG))

    expected = _expected_calls(SPEC_3SEG, N_STEPS_3SEG)
    assert rec.calls == expected  # one call per step, in step order, exact index lists
    assert [b.step for b in batches] == list(range(N_STEPS_3SEG))
    for b, (off, bs) in zip(batches, expected_steps(SPEC_3SEG, N_STEPS_3SEG)):
        assert (b.global_offset, b.batch_size) == (off, bs)
        np.testing.assert_array_equal(np.asarray(b.data), np.arange(off, off + bs))


def test_prefetch_loader_requests_each_step_once_and_yields_in_order():
    rec = RecordingDataset(LatencyDataset(identity_dataset(), seed=3, max_seconds=0.005))
    loader = DataLoader(rec, schedule_of(SPEC_3SEG), prefetch_depth=8)
    batches = drain(loader.iter_from_step(0, N_STEPS_3SEG))

    expected = _expected_calls(SPEC_3SEG, N_STEPS_3SEG)
    assert Counter(s for s, _ in rec.calls) == Counter(range(N_STEPS_3SEG)), "each step read exactly once"
    assert sorted(rec.calls) == expected
    assert [b.step for b in batches] == list(range(N_STEPS_3SEG))
    for b, (off, bs) in zip(batches, expected_steps(SPEC_3SEG, N_STEPS_3SEG)):
        assert (b.global_offset, b.batch_size) == (off, bs)
        np.testing.assert_array_equal(np.asarray(b.data), np.arange(off, off + bs))


@pytest.mark.parametrize("prefetch_depth", [0, 8])
@pytest.mark.parametrize("block_size", [None, 12])
def test_loader_over_mixture_requests_each_steps_range_once(prefetch_depth, block_size):
    mix = make_mixture(SPEC_3SEG, block_size=block_size, stage_switch=13)
    rec = RecordingDataset(mix)
    loader = DataLoader(rec, schedule_of(SPEC_3SEG), prefetch_depth=prefetch_depth)
    batches = drain(loader.iter_from_step(0, N_STEPS_3SEG))

    expected = _expected_calls(SPEC_3SEG, N_STEPS_3SEG)
    if prefetch_depth == 0:
        assert rec.calls == expected
    else:
        assert Counter(s for s, _ in rec.calls) == Counter(range(N_STEPS_3SEG))
        assert sorted(rec.calls) == expected
    assert [b.step for b in batches] == list(range(N_STEPS_3SEG))
    assert [b.global_offset for b in batches] == [off for off, _ in expected_steps(SPEC_3SEG, N_STEPS_3SEG)]

    # Values: what the mixture returns when asked directly (a fresh one, no shared caches).
    direct = make_mixture(SPEC_3SEG, block_size=block_size, stage_switch=13)
    for b, (step, idx) in zip(batches, expected):
        want = asyncio.run(direct.get_batch(step, idx))
        np.testing.assert_array_equal(np.asarray(b.data), np.asarray(want), err_msg=f"step {step}")


def test_prefetch_never_runs_more_than_depth_steps_ahead():
    depth = 4
    rec = RecordingDataset(identity_dataset())
    loader = DataLoader(rec, 8, prefetch_depth=depth)
    it = loader.iter_from_step(0)
    try:
        for consumed in range(1, 30):
            batch = next(it)
            assert batch.step == consumed - 1
            time.sleep(0.002)  # let the producer run ahead as far as it is allowed to
            with rec._lock:
                furthest = max(s for s, _ in rec.calls)
            # After `consumed` batches were taken, at most `depth` more steps may be launched.
            assert furthest < consumed + depth, f"read step {furthest} after consuming {consumed}"
        assert furthest >= consumed, "the loader should prefetch ahead of the consumer"
    finally:
        it.close()


def test_a_slow_consumer_is_refilled_without_waking_the_producer(monkeypatch):
    """A consumer slower than the producer never has to wake it up (a wake-up from ``next()`` costs the
    consumer the GIL while the producer fetches): the producer finds the room by itself and the consumer
    keeps finding its steps ready, in order."""
    from levanter.data.prefetch import Prefetcher

    woken = []
    real_nudge = Prefetcher._nudge
    monkeypatch.setattr(Prefetcher, "_nudge", lambda self: woken.append(1) or real_nudge(self))
    loader = DataLoader(RecordingDataset(identity_dataset()), 8, prefetch_depth=8)
    with loader.iter_from_step(0) as it:
        steps = []
        for _ in range(25):
            steps.append(next(it).step)
            time.sleep(0.03)  # twice the producer's longest wait between looks for room
        from_next = len(woken)
    assert steps == list(range(25))
    assert from_next <= 2, from_next  # (the first steps may find the producer not yet ahead)
    assert woken, "close() wakes the producer up"


# ---------------------------------------------------------------------------------------------------
# concurrency does not change the data
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [8, 3, 2, 1])
def test_random_latency_with_prefetch_gives_same_batches_as_sync(depth):
    """Reads that finish out of order are yielded in order, at every depth (the producer relaunches when
    half its window is free: depths 1-3 are the edge cases of that rule, and must never stall)."""
    n_steps = 40
    sync = drain(DataLoader(make_mixture(SPEC_2SEG, latency=True), schedule_of(SPEC_2SEG), prefetch_depth=0)
                 .iter_from_step(0, n_steps))

    rec = RecordingDataset(make_mixture(SPEC_2SEG, latency=True))
    loader = DataLoader(rec, schedule_of(SPEC_2SEG), prefetch_depth=depth)
    prefetched = drain(loader.iter_from_step(0, n_steps))

    assert [b.step for b in prefetched] == list(range(n_steps))
    assert_batches_equal(prefetched, sync)
    # The test only means something if reads really finished out of order.
    assert sorted(rec.completed) == list(range(n_steps))
    if depth > 1:
        assert rec.completed != list(range(n_steps)), "reads completed in order; latency did not reorder them"


# ---------------------------------------------------------------------------------------------------
# restore from any step
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [None, 12])
def test_iter_from_every_step_equals_tail_of_uninterrupted_run(block_size):
    end = 36
    reference = drain(
        DataLoader(make_mixture(SPEC_2SEG, block_size=block_size), schedule_of(SPEC_2SEG), prefetch_depth=0)
        .iter_from_step(0, end)
    )
    assert [b.step for b in reference] == list(range(end))
    assert [b.global_offset for b in reference] == [off for off, _ in expected_steps(SPEC_2SEG, end)]

    for k in range(0, 31):
        # Fresh dataset and loader objects: nothing cached from the earlier run may matter.
        mixture = make_mixture(SPEC_2SEG, block_size=block_size)
        loader = DataLoader(mixture, schedule_of(SPEC_2SEG), prefetch_depth=8)
        resumed = drain(loader.iter_from_step(k, end))
        assert_batches_equal(resumed, reference[k:])


# ---------------------------------------------------------------------------------------------------
# meshes and sharding
# ---------------------------------------------------------------------------------------------------
def pytree_dataset(n: int = 4096) -> AsyncDataset:
    examples = [{"tokens": np.arange(4, dtype=np.int32) + 4 * i, "id": np.int32(i)} for i in range(n)]
    return ListAsyncDataset(examples).epochs()


SPEC_MESH = [(0, 16), (3, 8), (5, 32)]
N_STEPS_MESH = 7


def _check_shards(arr: jax.Array, full: np.ndarray, mesh: Mesh):
    """Every device of ``mesh`` holds exactly its contiguous rows of ``full``, replicated over the
    non-data axes."""
    devs = mesh.devices
    n_data = mesh.shape["data"]
    rows_per = full.shape[0] // n_data
    assert rows_per * n_data == full.shape[0]
    shards = arr.addressable_shards
    assert sorted(s.device.id for s in shards) == sorted(d.id for d in devs.flat)
    rows_by_data_coord: dict[int, list[np.ndarray]] = {}
    for shard in shards:
        pos = tuple(int(c) for c in np.argwhere(devs == shard.device)[0])
        data_coord = pos[mesh.axis_names.index("data")]
        lo, hi = data_coord * rows_per, (data_coord + 1) * rows_per
        sl = shard.index[0]
        assert (sl.start or 0, sl.stop if sl.stop is not None else full.shape[0]) == (lo, hi), (
            f"device at {pos} holds rows {sl}, expected [{lo}, {hi})"
        )
        assert all(s == slice(None) or s == slice(0, n) for s, n in zip(shard.index[1:], full.shape[1:]))
        data = np.asarray(shard.data)
        assert data.shape == (rows_per,) + full.shape[1:]
        np.testing.assert_array_equal(data, full[lo:hi])
        rows_by_data_coord.setdefault(data_coord, []).append(data)
    assert sorted(rows_by_data_coord) == list(range(n_data))
    for replicas in rows_by_data_coord.values():
        assert len(replicas) == devs.size // n_data
        for r in replicas[1:]:
            np.testing.assert_array_equal(r, replicas[0])


@pytest.mark.parametrize("prefetch_depth", [0, 8])
def test_meshes_give_same_global_batches_and_each_device_holds_its_slice(prefetch_depth):
    devices = devices8()
    meshes = {
        "data8": Mesh(devices.reshape(8), ("data",)),
        "data4_model2": Mesh(devices.reshape(4, 2), ("data", "model")),
    }
    schedule = schedule_of(SPEC_MESH)
    default_loader = DataLoader(pytree_dataset(), schedule, mesh=None, prefetch_depth=0)
    reference = drain(default_loader.iter_from_step(0, N_STEPS_MESH))

    # The reference itself is right: rows are the global indices of each step.
    for b, (off, bs) in zip(reference, expected_steps(SPEC_MESH, N_STEPS_MESH)):
        data = to_numpy(b.data)
        np.testing.assert_array_equal(data["id"], np.arange(off, off + bs))
        np.testing.assert_array_equal(data["tokens"], 4 * np.arange(off, off + bs)[:, None] + np.arange(4))

    for name, mesh in meshes.items():
        batches = drain(DataLoader(pytree_dataset(), schedule, mesh=mesh, prefetch_depth=prefetch_depth)
                        .iter_from_step(0, N_STEPS_MESH))
        assert_batches_equal(batches, reference)
        for b in batches:
            for key, leaf in b.data.items():
                assert leaf.shape[0] == b.batch_size, (name, key)
                _check_shards(leaf, np.asarray(leaf), mesh)
                np.testing.assert_array_equal(np.asarray(leaf), to_numpy(reference[b.step].data)[key])


@pytest.mark.parametrize("layout", ["one_device", "data8", "data4_model2", "data_and_model_as_data_axes"])
def test_global_arrays_of_the_fast_path_equal_make_array_from_callback(layout):
    """The loader builds a shape's first array with jax.make_array_from_callback and later ones with the
    transfer that function ends in; both give the same values, sharding and per-device shards."""
    devices = devices8()
    mesh, axes = {
        "one_device": (Mesh(devices[:1], ("data",)), "data"),
        "data8": (Mesh(devices, ("data",)), "data"),
        "data4_model2": (Mesh(devices.reshape(4, 2), ("data", "model")), "data"),
        "data_and_model_as_data_axes": (Mesh(devices.reshape(2, 4), ("data", "model")), ("data", "model")),
    }[layout]
    loader = DataLoader(ListAsyncDataset([0]), 16, mesh=mesh, data_axis=axes, prefetch_depth=0)
    rows = loader.local_rows(16)
    rng = np.random.default_rng(0)
    for dtype in (np.int32, np.bool_, np.float32, np.int64):
        for attempt in range(3):
            leaf = rng.integers(0, 50, (16, 5, 3)).astype(dtype)
            got = loader._to_global(leaf, rows, 16)
            ref = jax.make_array_from_callback(leaf.shape, loader.sharding, lambda idx: leaf[idx])
            assert got.dtype == ref.dtype and got.shape == ref.shape and got.sharding == ref.sharding
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
            ref_shards = {s.device: np.asarray(s.data) for s in ref.addressable_shards}
            for shard in got.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), ref_shards[shard.device])
        # Every dtype jax keeps takes the fast path after its first array; int64 (narrowed without x64) never.
        fast = ((16, 5, 3), np.dtype(dtype)) in loader._fast_put
        assert fast == (dtype != np.int64 or jax.config.jax_enable_x64)


def test_process_rows_single_process_has_all_rows():
    devices = devices8()
    for mesh in (Mesh(devices.reshape(8), ("data",)), Mesh(devices.reshape(4, 2), ("data", "model"))):
        rows = process_rows(mesh, ("data",), 16, 0)
        np.testing.assert_array_equal(rows, np.arange(16))
        assert process_rows(mesh, ("data",), 16, 1).size == 0  # no devices of a second process


def test_batch_not_divisible_by_data_axis_raises():
    devices = devices8()
    mesh8 = Mesh(devices.reshape(8), ("data",))
    with pytest.raises(ValueError, match="train_batch_size"):
        DataLoader(identity_dataset(), 12, mesh=mesh8)
    # A later segment of the schedule that does not divide is caught up front, too.
    with pytest.raises(ValueError, match="train_batch_size") as info:
        DataLoader(identity_dataset(), schedule_of([(0, 16), (5, 12)]), mesh=mesh8)
    assert "12" in str(info.value)
    # Only the data axes count: 12 divides the 4-way data axis of a 4x2 mesh.
    mesh42 = Mesh(devices.reshape(4, 2), ("data", "model"))
    loader = DataLoader(identity_dataset(), 12, mesh=mesh42, prefetch_depth=0)
    batch = drain(loader.iter_from_step(0, 1))[0]
    np.testing.assert_array_equal(np.asarray(batch.data), np.arange(12))


# ---------------------------------------------------------------------------------------------------
# end of data
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch_depth", [0, 8])
def test_finite_dataset_stops_before_partial_batch(prefetch_depth):
    n = 100
    rec = RecordingDataset(ListAsyncDataset(np.arange(n)))
    loader = DataLoader(rec, 8, prefetch_depth=prefetch_depth)
    batches = drain(loader.iter_from_step(0))
    n_full = n // 8
    assert [b.step for b in batches] == list(range(n_full))
    # The end is known from the length: the partial step is never even requested.
    assert sorted(s for s, _ in rec.calls) == list(range(n_full))
    for b in batches:
        np.testing.assert_array_equal(np.asarray(b.data), np.arange(8 * b.step, 8 * b.step + 8))

    # end_step bounds the iteration, and the dataset end bounds it when end_step lies beyond.
    assert [b.step for b in drain(loader.iter_from_step(3, 7))] == [3, 4, 5, 6]
    assert [b.step for b in drain(loader.iter_from_step(10, 50))] == [10, 11]
    assert drain(loader.iter_from_step(n_full)) == []
    assert drain(loader.iter_from_step(5, 5)) == []


@pytest.mark.parametrize("prefetch_depth", [0, 8])
def test_finite_dataset_end_with_changing_batch_size(prefetch_depth):
    n = 100
    spec = [(0, 8), (5, 16)]
    steps = expected_steps(spec, 50)
    n_full = max(s for s, (off, bs) in enumerate(steps) if off + bs <= n) + 1
    rec = RecordingDataset(ListAsyncDataset(np.arange(n)))
    batches = drain(DataLoader(rec, schedule_of(spec), prefetch_depth=prefetch_depth).iter_from_step(0))
    assert [b.step for b in batches] == list(range(n_full))
    assert sorted(s for s, _ in rec.calls) == list(range(n_full))
    for b in batches:
        off, bs = steps[b.step]
        np.testing.assert_array_equal(np.asarray(b.data), np.arange(off, off + bs))


@pytest.mark.parametrize("prefetch_depth", [0, 8])
def test_dataset_exhausted_ends_iteration(prefetch_depth):
    # The loader cannot see the end ahead; the read of step 12 (indices 96..103) raises DatasetExhausted.
    ds = ClaimsInfinite(ListAsyncDataset(np.arange(100)))
    assert not ds.is_finite()
    batches = drain(DataLoader(ds, 8, prefetch_depth=prefetch_depth).iter_from_step(0))
    assert [b.step for b in batches] == list(range(12))
    with pytest.raises(DatasetExhausted):
        asyncio.run(ds.get_batch(12, np.arange(96, 104)))


# ---------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------
def test_dataset_error_surfaces_at_its_step_with_prefetch():
    loader = DataLoader(FailingDataset(identity_dataset(), bad_step=5), 8, prefetch_depth=8)
    it = loader.iter_from_step(0)
    try:
        got = take(it, 5)
        assert [b.step for b in got] == [0, 1, 2, 3, 4]
        with pytest.raises(RuntimeError, match=r"\bstep 5\b") as info:
            next(it)
        assert isinstance(info.value.__cause__, ExpectedFailure)
    finally:
        it.close()


def test_dataset_error_surfaces_at_its_step_sync():
    loader = DataLoader(FailingDataset(identity_dataset(), bad_step=5), 8, prefetch_depth=0)
    it = loader.iter_from_step(0)
    try:
        assert [b.step for b in take(it, 5)] == [0, 1, 2, 3, 4]
        with pytest.raises(Exception) as info:
            next(it)
        err = info.value
        assert isinstance(err, ExpectedFailure) or isinstance(err.__cause__, ExpectedFailure)
        assert "step 5" in str(err)
    finally:
        it.close()


def test_next_after_error_does_not_hang():
    it = DataLoader(FailingDataset(identity_dataset(), bad_step=1), 8, prefetch_depth=4).iter_from_step(0)
    next(it)
    with pytest.raises(RuntimeError):
        next(it)
    outcome = []

    def again():
        try:
            next(it)
            outcome.append("batch")
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    t = threading.Thread(target=again, daemon=True)
    t.start()
    t.join(timeout=2.0)
    it.close()
    assert not t.is_alive(), "second next() after an error is still blocked"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)  # the iterator stays dead and says why
    assert "step 1" in str(outcome[0]) and "global indices 8..15" in str(outcome[0])


# ---------------------------------------------------------------------------------------------------
# wait times and shutdown
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch_depth", [0, 8])
def test_wait_seconds_recorded_per_step(prefetch_depth):
    delay = 0.02
    loader = DataLoader(SlowDataset(identity_dataset(), delay), 8, prefetch_depth=prefetch_depth)
    created = time.perf_counter()
    it = loader.iter_from_step(3)
    try:
        head_start = time.perf_counter() - created  # read-ahead may start its first read before next()
        batches = take(it, 6)
    finally:
        it.close()
    assert sorted(it.wait_seconds) == [b.step for b in batches] == list(range(3, 9))
    for b in batches:
        assert b.wait_seconds >= 0
        assert b.wait_seconds == it.wait_seconds[b.step]
    # The first batch cannot arrive before its read finishes, so the consumer really waited for it (all of
    # the read but what ran before the first next()).
    assert batches[0].wait_seconds >= delay * 0.9 - head_start
    if prefetch_depth == 0:
        assert all(b.wait_seconds >= delay * 0.9 for b in batches)


def test_close_stops_background_thread():
    before = prefetch_threads()
    it = DataLoader(identity_dataset(), 8, prefetch_depth=8).iter_from_step(0)
    mine = prefetch_threads() - before
    assert len(mine) == 1
    (thread,) = mine
    next(it)
    assert thread.is_alive()
    it.close()
    assert not thread.is_alive()
    it.close()  # idempotent
    with pytest.raises(StopIteration):
        next(it)


def test_close_while_reads_are_in_flight_and_context_manager():
    before = prefetch_threads()
    loader = DataLoader(SlowDataset(identity_dataset(), 0.05), 8, prefetch_depth=8)
    with loader.iter_from_step(0) as it:
        (thread,) = prefetch_threads() - before
        time.sleep(0.01)  # reads launched, none finished
    thread.join(timeout=60)
    assert not thread.is_alive()  # closing stopped it: it did not run its remaining reads to the end
    with pytest.raises(StopIteration):
        next(it)


def test_close_before_first_next_and_after_end():
    before = prefetch_threads()
    it = DataLoader(identity_dataset(), 8, prefetch_depth=8).iter_from_step(0)
    (thread,) = prefetch_threads() - before
    it.close()
    assert not thread.is_alive()

    # A short finite dataset: the thread may finish on its own before we look (it posts the end and
    # returns), so check that nothing of this iterator is left after close, not that we caught it alive.
    before = prefetch_threads()
    it = DataLoader(ListAsyncDataset(np.arange(20)), 8, prefetch_depth=8).iter_from_step(0)
    threads = prefetch_threads() - before
    assert [b.step for b in it] == [0, 1]
    it.close()
    assert not any(t.is_alive() for t in threads)
    assert not (prefetch_threads() - before)


def test_abandoned_iterator_releases_its_thread():
    import gc

    before = prefetch_threads()
    it = DataLoader(identity_dataset(), 8, prefetch_depth=4).iter_from_step(0)
    (thread,) = prefetch_threads() - before
    next(it)
    del it
    gc.collect()
    thread.join(timeout=2.0)
    assert not thread.is_alive()


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_closing_mid_read_leaves_no_stray_errors(tmp_path, capfd):
    """Closing a prefetching iterator while tensorstore reads are in flight cancels them cleanly: nothing
    is printed later from a tensorstore thread about a closed event loop, and reading again works."""
    import gc

    from levanter.data.text import CausalLmDataset, TokenSeqDataset
    from levanter.store.jagged_array import JaggedArrayStore

    store = JaggedArrayStore.open(tmp_path / "s", mode="w", data_chunk=256)
    store.append_flat(np.arange(64 * 2000, dtype=np.int32) % 97, np.array([64 * 2000]))
    store.finalize()
    ds = CausalLmDataset(TokenSeqDataset(store, 64), eos_id=96).shuffle(key=0)
    loader = DataLoader(ds, 16, prefetch_depth=8)
    for _ in range(50):
        it = loader.iter_from_step(0)
        next(it)
        it.close()
    del it
    gc.collect()
    time.sleep(0.5)
    err = capfd.readouterr().err
    assert "Event loop is closed" not in err and "Traceback" not in err, err
    with loader.iter_from_step(3, 5) as it2:
        assert [b.step for b in it2] == [3, 4]


def test_cancelling_a_read_leaves_the_tensorstore_future_alone():
    """The bridge never cancels (or lets go of) a tensorstore future whose callback may be running: both
    wait, holding the GIL, for a callback that needs the GIL -- a deadlock that froze CI in
    ``test_closing_mid_read_leaves_no_stray_errors``. A cancelled task's read finishes unobserved and is
    released only by its own callback; a read that completes is handed over as before."""
    import tensorstore as ts

    from levanter.store import batched_reads

    def held(f) -> bool:
        return any(v is f for v in batched_reads._callbacks_pending.values())

    async def scenario():
        promise, fut = ts.Promise.new()
        task = asyncio.create_task(batched_reads.awaited(fut))
        await asyncio.sleep(0)
        assert held(fut)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not fut.cancelled() and not fut.done()
        assert held(fut)  # still held: only its callback lets it go
        promise.set_result(np.arange(3))
        for _ in range(100):
            if not held(fut):
                break
            await asyncio.sleep(0.01)
        assert not held(fut)

        promise2, fut2 = ts.Promise.new()
        task2 = asyncio.create_task(batched_reads.awaited(fut2))
        await asyncio.sleep(0)
        promise2.set_result(np.arange(4))
        np.testing.assert_array_equal(await task2, np.arange(4))
        assert not held(fut2)

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------------
# the loader's read-ahead over a store-backed mixture, and a second reader beside it
# ---------------------------------------------------------------------------------------------------
def _store_mixture(tmp_path, schedule, block_size=5):
    """A two-stage mixture of token windows on real stores (shuffled, block-shuffled, epoch-wrapped), the
    sources train_lm builds: every group of steps can be planned, so the loader reads ahead."""
    from levanter.data.text import CausalLmDataset, TokenSeqDataset
    from levanter.store.jagged_array import JaggedArrayStore

    rng = np.random.default_rng(0)
    inner = []
    for k, n in enumerate((700, 450, 300)):
        path = tmp_path / f"s{k}"
        if not path.exists():
            flat = rng.integers(0, 50, n * 8).astype(np.int32)
            store = JaggedArrayStore.open(path, mode="w", data_chunk=64)
            store.append_flat(flat, np.array([flat.size]))
            store.finalize()
        inner.append(CausalLmDataset(TokenSeqDataset(JaggedArrayStore.open(path, mode="r"), 8), eos_id=49,
                                     tokens_only=True))
    srcs = {"a": inner[0].shuffle(key=1), "b": inner[1].block_shuffle(16, key=2),
            "c": inner[2].slice_dataset(5, 290).epochs()}
    weights = [(0, {"a": 0.5, "b": 0.3, "c": 0.2}), (70, {"a": 0.1, "b": 0.2, "c": 0.7})]
    return MixtureDataset(srcs, weights, batch_schedule=schedule, block_size=block_size, key=4)


def test_loader_and_a_second_reader_of_one_mixture_from_two_threads(tmp_path):
    """The loader (prefetching, reading ahead in groups) and a second reader asking for random steps and
    rows read the same mixture at once, from two threads, for a few hundred steps: every batch, every
    provenance and every answer equals what a fresh mixture returns for that single request."""
    schedule = schedule_of([(0, 8), (90, 12)])
    mix = _store_mixture(tmp_path, schedule)
    n_steps = 300
    loader = DataLoader(mix, schedule, prefetch_depth=8, provenance=True)
    loaded, answers, errors = [], [], []

    def load():
        try:
            with loader.iter_from_step(0, n_steps) as it:
                for b in it:
                    loaded.append((b.step, np.asarray(b.data["tokens"]), b.provenance))
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    def second_reader():
        rng = np.random.default_rng(1)
        loop = asyncio.new_event_loop()
        try:
            for _ in range(n_steps):
                step = int(rng.integers(0, n_steps))
                first, end = schedule.step_range(step)
                idx = np.sort(rng.choice(np.arange(first, end), int(rng.integers(1, end - first + 1)), replace=False))
                answers.append((step, idx, loop.run_until_complete(mix.get_batch(step, idx)).tree["tokens"]))
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)
        finally:
            loop.close()

    threads = [threading.Thread(target=load), threading.Thread(target=second_reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [s for s, _, _ in loaded] == list(range(n_steps)) and len(answers) == n_steps

    async def fresh(step, idx):
        return (await _store_mixture(tmp_path, schedule).get_batch(step, idx)).tree["tokens"]

    for step, tokens, prov in loaded:
        first, end = schedule.step_range(step)
        idx = np.arange(first, end)
        np.testing.assert_array_equal(tokens, asyncio.run(fresh(step, idx)), err_msg=f"loader, step {step}")
        source, src_index = asyncio.run(_store_mixture(tmp_path, schedule).source_indices(step, idx))
        np.testing.assert_array_equal(prov["global_index"], idx)
        np.testing.assert_array_equal(prov["source"], source)
        np.testing.assert_array_equal(prov["source_index"], src_index)
    for step, idx, tokens in answers:
        np.testing.assert_array_equal(tokens, asyncio.run(fresh(step, idx)), err_msg=f"reader, {step} {idx}")


@pytest.mark.parametrize("prefetch_depth", [0, 8])
def test_read_ahead_from_any_step_equals_the_uninterrupted_run(tmp_path, monkeypatch, prefetch_depth):
    """A loader started at any step (a resume) reads, with its groups cut from there, exactly the tail of
    an uninterrupted run over a store-backed mixture, across a batch-size change and a stage switch; the
    groups are read together (fewer tensorstore reads than steps)."""
    from levanter.store import batched_reads

    schedule = schedule_of([(0, 8), (40, 12)])
    mix = _store_mixture(tmp_path, schedule, block_size=None)
    whole = [np.asarray(b.data["tokens"]) for b in DataLoader(mix, schedule, prefetch_depth=prefetch_depth)
             .iter_from_step(0, 100)]
    reads = []
    real_read = batched_reads.read_view
    monkeypatch.setattr(batched_reads, "read_view", lambda v: reads.append(1) or real_read(v))
    for start in (1, 13, 39, 40, 69, 70, 71, 99):
        before = len(reads)
        with DataLoader(mix, schedule, prefetch_depth=prefetch_depth).iter_from_step(start, 100) as it:
            tail = [np.asarray(b.data["tokens"]) for b in it]
        assert len(tail) == 100 - start
        for k, tokens in enumerate(tail):
            np.testing.assert_array_equal(tokens, whole[start + k], err_msg=f"from {start}, step {start + k}")
        if 100 - start > 20:
            assert len(reads) - before < (100 - start) / 4


# ---------------------------------------------------------------------------------------------------
# a single source (no mixture above it) is read ahead too
# ---------------------------------------------------------------------------------------------------
def _store_source(tmp_path):
    """One shuffled source of token windows on a real store: ``train_lm``'s single-source data."""
    from levanter.data.text import CausalLmDataset, TokenSeqDataset
    from levanter.store.jagged_array import JaggedArrayStore

    path = tmp_path / "single"
    if not path.exists():
        flat = np.random.default_rng(7).integers(0, 50, 700 * 8).astype(np.int32)
        store = JaggedArrayStore.open(path, mode="w", data_chunk=64)
        store.append_flat(flat, np.array([flat.size]))
        store.finalize()
    tokens = TokenSeqDataset(JaggedArrayStore.open(path, mode="r"), 8)
    return CausalLmDataset(tokens, eos_id=49, tokens_only=True).shuffle(key=3)


@pytest.mark.parametrize("prefetch_depth", [0, 8])
def test_a_single_source_is_read_ahead(tmp_path, monkeypatch, prefetch_depth):
    """One source alone, no mixture: the loader plans its upcoming steps in groups and reads each group in
    one tensorstore operation (far fewer reads than steps, nearly every step served by the read-ahead),
    across a batch-size change; every batch equals the source's own ``get_batch`` of the step, and its
    provenance (from the read's own pass) is the step's global indices."""
    from levanter.data.read_ahead import MISS, ReadAhead
    from levanter.store import batched_reads

    src = _store_source(tmp_path)
    schedule = schedule_of([(0, 4), (30, 8)])
    reads, served = [], []
    real_read = batched_reads.read_view
    monkeypatch.setattr(batched_reads, "read_view", lambda v: reads.append(1) or real_read(v))
    real_ahead = ReadAhead.read

    async def counting(self, step):
        got = await real_ahead(self, step)
        if got is not MISS:
            served.append(step)
        return got

    monkeypatch.setattr(ReadAhead, "read", counting)
    loader = DataLoader(src, schedule, prefetch_depth=prefetch_depth, provenance=True)
    with loader.iter_from_step(0, 60) as it:
        batches = list(it)
    assert [b.step for b in batches] == list(range(60))
    assert len(reads) < 60 / 4, len(reads)  # groups of up to 16 steps, one read each
    assert len(served) >= 50 and 0 not in served  # the first step is read alone
    for b in batches:
        first, end = schedule.step_range(b.step)
        expect = asyncio.run(src.get_batch(b.step, np.arange(first, end))).tree["tokens"]
        np.testing.assert_array_equal(np.asarray(b.data["tokens"]), expect, err_msg=f"step {b.step}")
        assert set(b.provenance) == {"global_index"}
        np.testing.assert_array_equal(b.provenance["global_index"], np.arange(first, end))
    # A per-example map passes its source's plans on, mapped: read ahead too, into the same batches.
    served.clear()
    with DataLoader(src.map(lambda x: x), schedule, prefetch_depth=prefetch_depth).iter_from_step(0, 20) as it:
        for a, b in zip(batches, it):
            np.testing.assert_array_equal(np.asarray(b.data["tokens"]), np.asarray(a.data["tokens"]))
    assert len(served) >= 15

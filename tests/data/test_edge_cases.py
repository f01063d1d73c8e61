"""Edge cases of the data core that a careful outside user hits: steps, batch sizes and block sizes of
other integral types (numpy) or of wrong types (floats, bools); mixtures whose finite source stops being
drawn before it runs out; stage starts and block sizes in the data config; a loader told a process that
holds no device; adjacent equal batch-size segments; nested mixtures; a weight too small to be drawn.

Pure Python and numpy (and one small loader on the first CPU device): no model, no token cache.
"""

from __future__ import annotations

import asyncio
import logging
import random

import numpy as np
import pytest

from levanter.data.config import LMMixtureDatasetConfig
from levanter.data.source_config import LMDatasetSourceConfig
from levanter.data.dataset import ListAsyncDataset
from levanter.data.loader import DataLoader
from levanter.data.mixture import MixtureDataset
from levanter.data.read_ahead import ReadAhead
from levanter.schedule import BatchSchedule, ScheduleStep, StepSchedule

STRIDE = 1_000_000


def finite(n: int, source: int = 0) -> ListAsyncDataset:
    return ListAsyncDataset(np.arange(n) + source * STRIDE)


def infinite(source: int) -> object:
    return finite(1000, source).epochs()


def read(mix, schedule, step):
    first, end = schedule.step_range(int(step))
    return np.asarray(asyncio.run(mix.get_batch(step, list(range(first, end)))))


def loader_steps(dataset, schedule, start, end):
    it = DataLoader(dataset, schedule, prefetch_depth=0).iter_from_step(start, end)
    try:
        return [np.asarray(b.data) for b in it]
    finally:
        it.close()


# -- integral steps of any type; floats and bools refused ----------------------------------------------
def test_numpy_integer_steps_are_exact():
    schedule = BatchSchedule(1024)
    for step in (np.int32(2**22), np.int64(2**22), np.uint32(2**22)):
        assert schedule.global_data_offset_by_step(step) == 2**32
        assert schedule.step_range(step) == (2**32, 2**32 + 1024)
        assert type(schedule.global_data_offset_by_step(step)) is int
    assert schedule.find_step_containing_offset(np.int64(2**32 + 5)) == 2**22
    ramp = BatchSchedule([ScheduleStep(np.int64(0), np.int32(8)), ScheduleStep(np.int64(10), np.int32(16))])
    assert ramp.global_data_offset_by_step(np.int32(12)) == 80 + 32


@pytest.mark.parametrize("block_size", [None, 6])
def test_mixture_and_loader_take_numpy_steps(block_size):
    schedule = BatchSchedule(4)
    mix = MixtureDataset({"a": finite(10**4, 0), "b": finite(10**4, 1)}, {"a": 0.5, "b": 0.5},
                         batch_schedule=schedule, block_size=block_size, key=3)
    for step in (0, 3, 7):
        np.testing.assert_array_equal(read(mix, schedule, np.int64(step)), read(mix, schedule, step))
        np.testing.assert_array_equal(read(mix, schedule, np.int32(step)), read(mix, schedule, step))
    with_np = loader_steps(mix, schedule, np.int64(2), np.int64(5))
    with_int = loader_steps(mix, schedule, 2, 5)
    assert len(with_np) == 3
    for x, y in zip(with_np, with_int):
        np.testing.assert_array_equal(x, y)


def _mixture(**kw):
    args = dict(batch_schedule=4, block_size=None, key=0)
    args.update(kw)
    return MixtureDataset({"a": finite(100, 0), "b": finite(100, 1)}, {"a": 1, "b": 1}, **args)


REFUSED = {
    "BatchSchedule(True)": lambda v: BatchSchedule(True),
    "BatchSchedule(8.0)": lambda v: BatchSchedule(8.0),
    "offset_by_step": lambda v: BatchSchedule(8).global_data_offset_by_step(v),
    "batch_size_at_step": lambda v: BatchSchedule(8).batch_size_at_step(v),
    "step_range": lambda v: BatchSchedule(8).step_range(v),
    "constant_segments": lambda v: BatchSchedule(8).constant_segments(v, None),
    "find_step_containing_offset": lambda v: BatchSchedule(8).find_step_containing_offset(v),
    "StepSchedule start": lambda v: StepSchedule([(0, "x"), (v, "y")], name="weights"),
    "mixture block_size": lambda v: _mixture(block_size=v),
    "mixture stage start": lambda v: MixtureDataset({"a": finite(9)}, [(0, {"a": 1}), (v, {"a": 1})],
                                                    batch_schedule=4, key=0),
    "mixture get_batch": lambda v: asyncio.run(_mixture().get_batch(v, [4, 5, 6, 7])),
    "loader iter_from_step": lambda v: DataLoader(finite(100), 4, prefetch_depth=0).iter_from_step(v),
    "loader end_step": lambda v: DataLoader(finite(100), 4, prefetch_depth=0).iter_from_step(0, v),
    "loader prefetch_depth": lambda v: DataLoader(finite(100), 4, prefetch_depth=v),
    "loader process_index": lambda v: DataLoader(finite(100), 4, process_index=v),
    "read_ahead start": lambda v: ReadAhead(finite(100), lambda s: np.arange(4), v, None),
}


@pytest.mark.parametrize("value", [1.0, 2.5, np.float32(1.0), True, np.True_], ids=repr)
@pytest.mark.parametrize("where", sorted(REFUSED))
def test_floats_and_bools_are_refused_by_name(where, value):
    if where.startswith("BatchSchedule("):
        value = None  # the value is in the call
    with pytest.raises(ValueError, match="integer|expected an int"):
        REFUSED[where](value)


def test_numpy_float_weights_are_read_like_floats():
    schedule = BatchSchedule(8)
    srcs = {"a": finite(10**4, 0), "b": finite(10**4, 1)}
    as_np = MixtureDataset(srcs, {"a": np.float32(0.25), "b": np.float32(0.75)}, batch_schedule=schedule, key=1)
    as_py = MixtureDataset(srcs, {"a": 0.25, "b": 0.75}, batch_schedule=schedule, key=1)
    for step in range(4):
        np.testing.assert_array_equal(read(as_np, schedule, step), read(as_py, schedule, step))


# -- stop strategies: is_finite() agrees with async_len() -------------------------------------------
@pytest.mark.parametrize("strategy", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("block_size", [None, 4])
def test_a_finite_source_dropped_before_it_runs_out_leaves_the_mixture_infinite(strategy, block_size):
    schedule = BatchSchedule(4)
    b = infinite(1) if strategy == "first_exhausted" else finite(10**6, 1)
    mix = MixtureDataset({"a": finite(100, 0), "b": b}, [(0, {"a": 1, "b": 1}), (2, {"b": 1})],
                         batch_schedule=schedule, block_size=block_size, key=0, stop_strategy=strategy)
    assert not mix.is_finite()
    batches = loader_steps(mix, schedule, 0, 8)
    assert len(batches) == 8
    drawn_a = np.concatenate(batches)
    assert ((drawn_a // STRIDE) == 0).sum() == 4  # two steps of half a batch of 4, then none


@pytest.mark.parametrize("strategy", ["first_exhausted", "all_exhausted"])
def test_random_curricula_is_finite_agrees_with_async_len(strategy):
    rng = random.Random(21)
    for trial in range(20):
        lengths = [rng.choice([3, 10, 40, None]) for _ in range(3)]
        stages, start = [], 0
        for j in range(rng.randint(1, 3)):
            w = {n: rng.choice([0, 0, 1, 2]) for n in "abc"}
            w["abc"[j % 3]] = 1
            stages.append((start, w))
            start += rng.randint(1, 5)
        srcs = {n: (infinite(s) if L is None else finite(L, s)) for s, (n, L) in enumerate(zip("abc", lengths))}
        schedule = BatchSchedule(rng.choice([2, 4, 6]))
        mix = MixtureDataset(srcs, stages, batch_schedule=schedule, block_size=rng.choice([None, 5]), key=trial,
                             stop_strategy=strategy)
        if mix.is_finite():
            end = asyncio.run(mix.async_len())
            last = schedule.find_step_containing_offset(end)
            assert len(loader_steps(mix, schedule, 0, last + 3)) == last, (trial, lengths, stages)
        else:
            with pytest.raises(ValueError, match="never ends"):
                asyncio.run(mix.async_len())
            assert len(loader_steps(mix, schedule, 0, 12)) == 12, (trial, lengths, stages)


# -- the data config ---------------------------------------------------------------------------------
def _mix_config(**kw) -> LMMixtureDatasetConfig:
    src = LMDatasetSourceConfig(train_urls=["embedded://python-docs/validation"])
    args = dict(tokenizer="byte", configs={"prose": src, "code": src},
                train_weights=[(0, {"prose": 1.0}), (2, {"prose": 0.5, "code": 0.5})])
    args.update(kw)
    return LMMixtureDatasetConfig(**args)


def test_config_refuses_a_non_integral_stage_start():
    _mix_config().validate(num_train_steps=10)
    with pytest.raises(ValueError, match=r"data\.train_weights.*2\.5"):
        bad = _mix_config(train_weights=[(0, {"prose": 1.0}), (2.5, {"prose": 0.5, "code": 0.5})])
        bad.validate(num_train_steps=10)
    stages = _mix_config(train_weights=[(0, {"prose": 1.0}), (np.int64(2), {"code": 1.0})]).stages()
    assert [s for s, _ in stages] == [0, 2] and type(stages[1][0]) is int


@pytest.mark.parametrize("bad", [0, -3, True, 2.0])
def test_config_refuses_a_block_size_that_is_not_a_positive_integer(bad):
    with pytest.raises(ValueError, match=r"data\.mixture_block_size"):
        _mix_config(mixture_block_size=bad).validate(num_train_steps=10)


# -- the loader's process index ----------------------------------------------------------------------
@pytest.mark.parametrize("index", [-1, 1, 7])
def test_loader_refuses_a_process_that_holds_no_device_at_construction(index):
    with pytest.raises(ValueError, match=f"process_index {index} holds no device"):
        DataLoader(finite(100), 4, process_index=index)
    DataLoader(finite(100), 4, process_index=np.int64(0))  # the process that holds the mesh's device


# -- constant segments, nested mixtures, a weight never drawn ----------------------------------------
def test_constant_segments_merges_adjacent_equal_sizes():
    schedule = BatchSchedule([(0, 8), (10, 8), (20, 4), (30, 4), (40, 8)])
    assert schedule.constant_segments(0, None) == [(0, 20, 8), (20, 40, 4), (40, None, 8)]
    assert schedule.constant_segments(5, 35) == [(5, 20, 8), (20, 35, 4)]
    assert schedule.constant_segments(12, 18) == [(12, 18, 8)]
    # The merged segments still count exactly what the schedule reads.
    for lo, hi in ((0, 45), (3, 41), (19, 21)):
        counted = sum((h - l) * bs for l, h, bs in schedule.constant_segments(lo, hi))
        assert counted == schedule.global_data_offset_by_step(hi) - schedule.global_data_offset_by_step(lo)


@pytest.mark.parametrize("wrap", [lambda m: m, lambda m: m.map(lambda x: x), lambda m: m.slice_dataset(0, 50)])
def test_nested_mixtures_are_refused_at_construction(wrap):
    inner = MixtureDataset({"x": finite(100, 0), "y": finite(100, 1)}, {"x": 1, "y": 1}, batch_schedule=4, key=0)
    with pytest.raises(ValueError, match="source 'web' is itself a mixture.*do not nest"):
        MixtureDataset({"web": wrap(inner), "z": finite(100, 2)}, {"web": 1, "z": 1}, batch_schedule=4, key=0)


def test_a_weight_that_rounds_to_zero_in_every_batch_is_warned_about(caplog):
    srcs = {"big": finite(10**4, 0), "tiny": finite(10**4, 1)}
    schedule = BatchSchedule(4)
    with caplog.at_level(logging.WARNING, logger="levanter.data.mixture"):
        mix = MixtureDataset(srcs, {"big": 0.99, "tiny": 0.01}, batch_schedule=schedule, block_size=None, key=0)
    warned = [r.getMessage() for r in caplog.records if "never drawn" in r.getMessage()]
    assert len(warned) == 1 and "'tiny'" in warned[0] and "0.01" in warned[0] and "batch size 4" in warned[0]
    # What it warns about is true: the source is not drawn in any batch.
    assert all(not (read(mix, schedule, s) // STRIDE == 1).any() for s in range(20))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="levanter.data.mixture"):
        MixtureDataset(srcs, {"big": 0.99, "tiny": 0.01}, batch_schedule=BatchSchedule(128), block_size=None, key=0)
        MixtureDataset(srcs, {"big": 0.99, "tiny": 0.01}, batch_schedule=schedule, block_size=2048, key=0)
    assert not [r for r in caplog.records if "never drawn" in r.getMessage()]

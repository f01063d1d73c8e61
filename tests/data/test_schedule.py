"""StepSchedule and BatchSchedule against naive step-by-step references, exhaustively over small schedules."""

import itertools

import pytest

from levanter.schedule import BatchSchedule, ScheduleStep, StepSchedule


def naive_ranges(segments, num_steps):
    """Walk steps one by one: (first, size) for each step."""
    out, offset = [], 0
    for s in range(num_steps):
        size = [v for start, v in segments if start <= s][-1]
        out.append((offset, size))
        offset += size
    return out


SCHEDULES = [
    [(0, 8)],
    [(0, 8), (10, 16), (25, 4)],
    [(0, 1), (1, 2), (2, 3)],
    [(0, 64), (64, 128), (256, 64), (1024, 256)],
    [(0, 3), (7, 5)],
]


@pytest.mark.parametrize("segments", SCHEDULES)
def test_matches_naive_walk(segments):
    sched = BatchSchedule([ScheduleStep(s, v) for s, v in segments])
    num_steps = segments[-1][0] + 20
    ref = naive_ranges(segments, num_steps)
    for step, (first, size) in enumerate(ref):
        assert sched.batch_size_at_step(step) == size
        assert sched.global_data_offset_by_step(step) == first
        assert sched.step_range(step) == (first, first + size)
        for offset in range(first, first + size):
            assert sched.find_step_containing_offset(offset) == step


def test_constant_int_and_yaml_forms_agree():
    assert BatchSchedule(32) == BatchSchedule([{"start": 0, "value": 32}]) == BatchSchedule([(0, 32)])
    assert BatchSchedule(32).global_data_offset_by_step(7) == 7 * 32


def test_exact_for_huge_steps():
    sched = BatchSchedule([ScheduleStep(0, 3), ScheduleStep(2**40, 7)])
    step = 2**62 + 5
    expected = 3 * 2**40 + 7 * (step - 2**40)
    assert sched.global_data_offset_by_step(step) == expected
    assert sched.find_step_containing_offset(expected) == step
    assert sched.find_step_containing_offset(expected - 1) == step - 1


def test_constant_segments_cover_range_exactly():
    sched = BatchSchedule([ScheduleStep(0, 8), ScheduleStep(10, 16), ScheduleStep(25, 4)])
    for lo, hi in itertools.combinations(range(0, 40, 3), 2):
        segs = sched.constant_segments(lo, hi)
        steps = [s for a, b, _ in segs for s in range(a, b)]
        assert steps == list(range(lo, hi))
        for a, b, size in segs:
            assert all(sched.batch_size_at_step(s) == size for s in range(a, b))
    open_ended = sched.constant_segments(12, None)
    assert open_ended == [(12, 25, 16), (25, None, 4)]


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ([ScheduleStep(1, 8)], "start at step 0"),
        ([ScheduleStep(0, 8), ScheduleStep(0, 4)], "strictly increasing"),
        ([ScheduleStep(0, 8), ScheduleStep(10, 4), ScheduleStep(5, 2)], "strictly increasing"),
        ([ScheduleStep(0, 0)], "positive"),
        (-4, "positive"),
        ([], "empty"),
        ([{"start": 0, "size": 3}], "start"),
        ("32", "expected an int"),
    ],
)
def test_bad_schedules_name_the_config_key(spec, fragment):
    with pytest.raises(ValueError, match="train_batch_size") as e:
        BatchSchedule(spec)
    assert fragment in str(e.value)


def test_negative_step_or_offset_rejected():
    sched = BatchSchedule(4)
    with pytest.raises(ValueError):
        sched.batch_size_at_step(-1)
    with pytest.raises(ValueError):
        sched.find_step_containing_offset(-1)


@pytest.mark.parametrize("segments", SCHEDULES)
def test_step_schedule_lookup_matches_naive_walk(segments):
    sched = StepSchedule([(s, f"v{s}") for s, _ in segments], name="k")
    for step in range(segments[-1][0] + 20):
        index = max(i for i, (start, _) in enumerate(segments) if start <= step)
        assert sched.index_at(step) == index
        assert sched.value_at(step) == f"v{segments[index][0]}"
        assert sched.entry_at(step) == (segments[index][0], f"v{segments[index][0]}")
    assert list(sched) == [(s, f"v{s}") for s, _ in segments]
    assert sched.end_of(len(segments) - 1) is None
    assert [sched.end_of(i) for i in range(len(segments) - 1)] == [s for s, _ in segments[1:]]


@pytest.mark.parametrize(
    "starts, message",
    [
        ([3], "key: the first entry must start at step 0, got start=3"),
        ([0, 5, 5], "key: starts must be strictly increasing, got 5 then 5"),
        ([0, 9, 4], "key: starts must be strictly increasing, got 9 then 4"),
        ([], "key: the schedule is empty"),
    ],
)
def test_step_schedule_validation_messages(starts, message):
    with pytest.raises(ValueError) as e:
        StepSchedule([(s, None) for s in starts], name="key")
    assert str(e.value) == message


def test_step_schedule_callers_keep_their_own_wording():
    with pytest.raises(ValueError) as e:
        StepSchedule([(1, "a")], name="weights", first_error="{name}: first stage at {start}")
    assert str(e.value) == "weights: first stage at 1"
    with pytest.raises(ValueError) as e:
        StepSchedule([(0, "a"), (2, "b"), (1, "c")], name="w", order_error="{name}: {prev} > {cur}")
    assert str(e.value) == "w: 2 > 1"
    with pytest.raises(ValueError, match="non-negative"):
        StepSchedule([(0, "a")], name="k").index_at(-1)


def test_batch_schedule_is_a_step_schedule_of_sizes():
    sched = BatchSchedule([ScheduleStep(0, 8), ScheduleStep(10, 16)])
    assert sched.step_schedule == StepSchedule([(0, 8), (10, 16)], name="trainer.train_batch_size")

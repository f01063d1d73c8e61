"""BatchSchedule against a naive step-by-step reference, exhaustively over small schedules."""

import itertools

import pytest

from levanter.schedule import BatchSchedule, ScheduleStep


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

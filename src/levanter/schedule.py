"""The one place where training steps become data offsets.

Index spaces (see ``docs/design/data-order.md``):

* **step** -- a training step, 0-based. Step ``s`` consumes one global batch.
* **global index** (also "data offset") -- a position in training order. Step ``s`` reads exactly
  ``[global_data_offset_by_step(s), global_data_offset_by_step(s) + batch_size_at_step(s))``.

A :class:`BatchSchedule` is a piecewise-constant batch size: a list of segments
``(start_step, batch_size)``. At construction it records each segment's first global index, so
every query is a binary search over segments (O(log #segments)) followed by one multiply. All
arithmetic is on Python ints, so it is exact for any step (2**62 and beyond).

Nothing else in the project multiplies steps by batch sizes: the mixture, the loader and the
trainer all ask this module.

Both the batch size and the mixture's stages are *step schedules*: a value that holds from one start
step until the next, starting at step 0. :class:`StepSchedule` is that shape, validated and looked up in
one place; the batch schedule, the mixture's stages and the data-schedule record are built on it.
"""

from __future__ import annotations

import bisect
import dataclasses
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Generic, TypeVar, Union

__all__ = ["as_int", "StepSchedule", "ScheduleStep", "BatchSchedule"]

T = TypeVar("T")

def as_int(value, *, what: str = "step") -> int:
    """``value`` as a Python int: any integral type (Python or numpy integers, via ``operator.index``).

    Floats (even integral ones such as 2.0) and bools are refused with a ``ValueError`` naming ``what``:
    a float step would give a float offset, a truncated one would silently move a switch, and ``True``
    is never meant as 1. Converting up front also keeps the arithmetic on Python ints, which never
    wrap (an ``np.int32`` step times a batch size would).
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise ValueError(f"{what} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r} ({type(value).__name__})") from None


FIRST_START_ERROR = "{name}: the first entry must start at step 0, got start={start}"
ORDER_ERROR = "{name}: starts must be strictly increasing, got {prev} then {cur}"


class StepSchedule(Generic[T]):
    """A value per training step that is constant from each start step until the next.

    ``StepSchedule([(0, a), (10, b)])`` is ``a`` for steps 0-9 and ``b`` from step 10 on. Starts must
    begin at 0 and strictly increase; otherwise ``ValueError`` is raised with ``first_error`` or
    ``order_error``, formatted with ``name`` (the config key the schedule comes from) and the offending
    starts (``start``; ``prev`` and ``cur``), so each caller keeps the wording its users see. Values are
    not inspected. Lookups are a binary search over the starts (O(log #entries)); the object is
    immutable, so it can be shared between threads.
    """

    __slots__ = ("name", "starts", "values")

    def __init__(
        self,
        entries: Iterable[tuple[int, T]],
        *,
        name: str,
        first_error: str = FIRST_START_ERROR,
        order_error: str = ORDER_ERROR,
    ):
        pairs = [(start, value) for start, value in entries]
        if not pairs:
            raise ValueError(f"{name}: the schedule is empty")
        starts = tuple(as_int(start, what=f"{name}: a start step") for start, _ in pairs)
        if starts[0] != 0:
            raise ValueError(first_error.format(name=name, start=starts[0]))
        for prev, cur in zip(starts, starts[1:]):
            if cur <= prev:
                raise ValueError(order_error.format(name=name, prev=prev, cur=cur))
        self.name = name
        self.starts: tuple[int, ...] = starts
        self.values: tuple[T, ...] = tuple(value for _, value in pairs)

    def index_at(self, step: int) -> int:
        """Index of the entry in force at ``step``."""
        step = as_int(step)
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        return bisect.bisect_right(self.starts, step) - 1

    def value_at(self, step: int) -> T:
        """The value in force at ``step``."""
        return self.values[self.index_at(step)]

    def entry_at(self, step: int) -> tuple[int, T]:
        """``(start, value)`` of the entry in force at ``step``."""
        i = self.index_at(step)
        return self.starts[i], self.values[i]

    def end_of(self, index: int) -> int | None:
        """First step after entry ``index`` (None for the last entry, which never ends)."""
        return self.starts[index + 1] if index + 1 < len(self.starts) else None

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self):
        return iter(zip(self.starts, self.values))

    def __eq__(self, other) -> bool:
        return isinstance(other, StepSchedule) and self.starts == other.starts and self.values == other.values

    def __hash__(self) -> int:
        return hash((self.starts, self.values))

    def __repr__(self) -> str:
        return f"StepSchedule({list(self)!r}, name={self.name!r})"


@dataclasses.dataclass(frozen=True)
class ScheduleStep:
    """From training step ``start`` on (inclusive), the schedule's value is ``value``."""

    # The first step (inclusive) this value applies to.
    start: int
    # The value from that step on (a batch size, in sequences).
    value: int


BatchSizeSpec = Union[int, Sequence[Union[ScheduleStep, Mapping[str, int], Sequence[int]]]]


def _as_schedule_step(entry, *, what: str) -> ScheduleStep:
    if isinstance(entry, ScheduleStep):
        return entry
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"start", "value"}
        if unknown or "start" not in entry or "value" not in entry:
            raise ValueError(
                f"{what}: each entry needs exactly the keys 'start' and 'value', got {dict(entry)!r}"
            )
        return ScheduleStep(entry["start"], entry["value"])
    if isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) == 2:
        return ScheduleStep(entry[0], entry[1])
    raise ValueError(f"{what}: cannot read schedule entry {entry!r}; expected {{start: N, value: M}}")


def _is_int(x) -> bool:
    # bool is an Integral but never a meaningful step or size; numpy integers are accepted.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class BatchSchedule:
    """A piecewise-constant batch size over training steps.

    ``BatchSchedule(32)`` is a constant batch of 32. ``BatchSchedule([ScheduleStep(0, 8),
    ScheduleStep(10, 16)])`` is 8 for steps 0-9 and 16 from step 10 on. Entries may also be given as
    ``{"start": s, "value": v}`` mappings (the YAML form) or ``(start, value)`` pairs.

    Raises ``ValueError`` (naming ``trainer.train_batch_size``, the config key it comes from) when the
    first entry does not start at 0, starts are not strictly increasing, or a size is not positive.
    """

    def __init__(self, schedule: BatchSizeSpec, *, name: str = "trainer.train_batch_size"):
        if _is_int(schedule):
            steps = [ScheduleStep(0, int(schedule))]
        elif isinstance(schedule, Sequence) and not isinstance(schedule, str):
            steps = [_as_schedule_step(e, what=name) for e in schedule]
        else:
            raise ValueError(f"{name}: expected an int or a list of {{start, value}}, got {schedule!r}")
        if not steps:
            raise ValueError(f"{name}: the batch schedule is empty")
        for s in steps:
            if not (_is_int(s.start) and _is_int(s.value)):
                raise ValueError(f"{name}: start and value must be integers, got {s!r}")
            if s.value <= 0:
                raise ValueError(f"{name}: batch size must be positive, got {s.value} at step {s.start}")
        self._schedule: StepSchedule[int] = StepSchedule(((s.start, int(s.value)) for s in steps), name=name)
        self._starts = self._schedule.starts
        self._sizes = self._schedule.values
        # First global index of each segment.
        self._offsets: list[int] = [0]
        for i in range(1, len(steps)):
            run = self._starts[i] - self._starts[i - 1]
            self._offsets.append(self._offsets[-1] + run * self._sizes[i - 1])

    # -- queries ------------------------------------------------------------------------------------
    @property
    def segments(self) -> tuple[ScheduleStep, ...]:
        """The schedule as ``ScheduleStep`` entries, one per constant-size segment."""
        return tuple(ScheduleStep(s, v) for s, v in zip(self._starts, self._sizes))

    @property
    def distinct_batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(set(self._sizes)))

    @property
    def step_schedule(self) -> StepSchedule[int]:
        """The batch size as a :class:`StepSchedule`."""
        return self._schedule

    def _segment_of_step(self, step: int) -> int:
        return self._schedule.index_at(step)

    def batch_size_at_step(self, step: int) -> int:
        """Number of examples (global indices) step ``step`` reads."""
        step = as_int(step)
        return self._sizes[self._segment_of_step(step)]

    def global_data_offset_by_step(self, step: int) -> int:
        """First global index read by step ``step``; equals the number of examples before it."""
        step = as_int(step)
        seg = self._segment_of_step(step)
        return self._offsets[seg] + (step - self._starts[seg]) * self._sizes[seg]

    def step_range(self, step: int) -> tuple[int, int]:
        """``(first, end)``: step ``step`` reads global indices ``first <= i < end``."""
        step = as_int(step)
        seg = self._segment_of_step(step)
        first = self._offsets[seg] + (step - self._starts[seg]) * self._sizes[seg]
        return first, first + self._sizes[seg]

    def find_step_containing_offset(self, offset: int) -> int:
        """The step whose batch contains global index ``offset``."""
        offset = as_int(offset, what="offset")
        if offset < 0:
            raise ValueError(f"offset must be non-negative, got {offset}")
        seg = bisect.bisect_right(self._offsets, offset) - 1
        return self._starts[seg] + (offset - self._offsets[seg]) // self._sizes[seg]

    def constant_segments(self, start_step: int, end_step: int | None) -> list[tuple[int, int, int]]:
        """Split ``[start_step, end_step)`` into maximal runs of equal batch size.

        Returns ``(first_step, end_step, batch_size)`` triples; ``end_step`` None means unbounded and
        the last triple then has end ``None``. Used for closed-form counting (O(#segments)).
        """
        start_step = as_int(start_step, what="start_step")
        if end_step is not None:
            end_step = as_int(end_step, what="end_step")
            if end_step <= start_step:
                return []
        out: list[tuple[int, int, int]] = []
        seg = self._segment_of_step(start_step)
        lo = start_step
        while True:
            nxt = self._schedule.end_of(seg)
            hi = nxt if end_step is None else (end_step if nxt is None else min(nxt, end_step))
            if out and out[-1][2] == self._sizes[seg]:  # a schedule may list the same size twice in a row
                lo = out.pop()[0]
            out.append((lo, hi, self._sizes[seg]))
            if hi is None or hi == end_step:
                return out
            lo = hi
            seg += 1

    def __eq__(self, other) -> bool:
        return isinstance(other, BatchSchedule) and self.segments == other.segments

    def __hash__(self) -> int:
        return hash(self.segments)

    def __repr__(self) -> str:
        if len(self._sizes) == 1:
            return f"BatchSchedule({self._sizes[0]})"
        return f"BatchSchedule({list(self.segments)!r})"

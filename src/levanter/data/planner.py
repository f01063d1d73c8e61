"""The data plan of a run, in closed form: what each stage draws from each source, and when.

Given the training set a run builds (``config.data.train_set(...)``) and its batch schedule, this module
answers, without reading any data and without iterating batches:

* per stage and source: the stage's first and last step, the sequences and tokens drawn, the target
  fraction (the stage's normalised weight) against the achieved one, and how many epochs of the source
  that is (in the stage, and cumulative);
* per source: the step at which it first wraps (``restart``, and sources that run out early under
  ``all_exhausted``) or is exhausted (``first_exhausted``, ``all_exhausted``, a single finite source),
  and the step at which the data ends if it ends before ``num_steps``;
* per-step composition by source over constant-count segments (for plots);
* and, for a range of steps, every position's global index, source, source index and *store row* (the
  token window of the source's cache that is actually read) -- :func:`dump_rows`.

Everything is computed from the index maps the datasets themselves use: the mixture layout's per-stage
counts (``drawn_in_stage``), ``global_index_of_draw`` and the mixture's ``source_indices``; the
schedule's ``find_step_containing_offset``; and each wrapper's own public index map
(:meth:`~levanter.data.dataset.AsyncDataset.index_map`: a shuffle's permutation, a causal-LM wrapper's
identity), whatever the wrapper's type. Nothing is re-derived here, so the plan cannot drift from what
training reads. The summary costs O(#stages x #schedule segments x #sources) whatever
the number of steps (a million steps plan in milliseconds); a dump costs O(rows dumped).

Trade-offs:

* With ``mixture_block_size`` set, a step's composition varies from block to block (only each whole
  block is exact). The per-stage counts stay exact (cut blocks are counted), but the per-step
  composition returned by :func:`composition_segments` is then the block average ``B(s) * LR(w, K) / K``
  rather than each step's exact counts: exact per-step counts would need a pass over every step.
* The end of finite data follows the loader's rule: the last step is the last whose whole batch fits,
  so a trailing partial batch (and with ``all_exhausted``, possibly the last source's last example) is
  not trained on.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from fractions import Fraction
from typing import Optional

import numpy as np

from ..schedule import BatchSchedule
from .dataset import AsyncDataset, EpochDataset
from .mixture import MixtureDataset
from .text import TokenSeqDataset

__all__ = [
    "SINGLE_SOURCE_NAME",
    "StageSource",
    "StagePlan",
    "SourcePlan",
    "DataPlan",
    "plan_data",
    "composition_segments",
    "store_rows",
    "token_dataset",
    "dump_rows",
]

# The name a single-source config's one source gets in plans and dumps (as ``cache_dataset`` prints it).
SINGLE_SOURCE_NAME = "data"


@dataclasses.dataclass(frozen=True)
class StageSource:
    """What stage ``stage`` draws from ``source`` within the planned steps."""

    stage: int
    source: str
    first_step: int
    last_step: Optional[int]  # None: the stage is not reached within the planned steps
    sequences: int
    tokens: int
    target_fraction: float
    achieved_fraction: Optional[float]  # None when the stage draws nothing
    epochs: Optional[float]  # sequences / source length; None for an infinite source
    cumulative_epochs: Optional[float]  # including every earlier stage


@dataclasses.dataclass(frozen=True)
class StagePlan:
    index: int
    first_step: int
    last_step: Optional[int]
    steps: int
    sequences: int
    tokens: int
    sources: tuple[StageSource, ...]


@dataclasses.dataclass(frozen=True)
class SourcePlan:
    """A source over the whole plan.

    ``wrap_step``: the step that first reads one of the source's sequences a second time (``restart``,
    or ``all_exhausted`` before the mixture ends). ``exhausted_step``: under ``first_exhausted`` (and for
    a single finite source) the step that would need a sequence the source no longer has -- the data
    ends before it; under ``all_exhausted`` the step that draws the source's last unseen sequence. Both
    are None when that does not happen within the planned steps.
    """

    name: str
    length: Optional[int]  # sequences (token windows); None if infinite
    tokens_available: Optional[int]
    sequences: int  # drawn within the planned steps, repeats included
    tokens: int
    epochs: Optional[float]
    wrap_step: Optional[int]
    exhausted_step: Optional[int]


@dataclasses.dataclass(frozen=True)
class DataPlan:
    num_steps: int  # steps asked for (trainer.num_train_steps or --steps)
    steps: int  # steps the data lasts: num_steps, or fewer if a finite dataset ends first
    end_step: Optional[int]  # the first step the data cannot fill, if it is < num_steps
    ended_by: Optional[str]  # the source whose exhaustion ends the data, if it ends
    seq_len: int
    is_mixture: bool
    stop_strategy: Optional[str]
    block_size: Optional[int]
    batch_segments: tuple[tuple[int, int, int], ...]  # (first_step, end_step, batch_size) in num_steps
    stages: tuple[StagePlan, ...]
    sources: tuple[SourcePlan, ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- helpers ------------------------------------------------------------------------------------------
def _run(coro):
    # The planner is synchronous (a CLI and tests); each call gets its own short-lived event loop.
    return asyncio.run(coro)


async def _length(ds: AsyncDataset) -> Optional[int]:
    return await ds.async_len() if ds.is_finite() else None


def _source_datasets(train_set: AsyncDataset) -> tuple[list[str], list[AsyncDataset]]:
    if isinstance(train_set, MixtureDataset):
        return list(train_set.names), list(train_set.datasets)
    if isinstance(train_set, EpochDataset):  # train_lm's epoch: the source is what repeats
        return [SINGLE_SOURCE_NAME], [train_set.dataset]
    return [SINGLE_SOURCE_NAME], [train_set]


def _step_of(schedule: BatchSchedule, index: Optional[int]) -> Optional[int]:
    return None if index is None else schedule.find_step_containing_offset(index)


def _data_end_index(train_set: AsyncDataset) -> Optional[int]:
    """First global index past the end of the data, or None if it never ends (async_len's rule)."""
    if not train_set.is_finite():
        return None
    try:
        return _run(train_set.async_len())
    except ValueError:
        # e.g. all_exhausted where some source's weight drops to zero before it is used up.
        return None


# -- the plan -----------------------------------------------------------------------------------------
def plan_data(train_set: AsyncDataset, schedule: BatchSchedule, num_steps: int, *, seq_len: int) -> DataPlan:
    """The closed-form plan of ``train_set`` under ``schedule`` for steps ``[0, num_steps)``."""
    if num_steps < 1:
        raise ValueError(f"the number of steps must be >= 1, got {num_steps}")
    names, datasets = _source_datasets(train_set)
    lengths = [_run(_length(d)) for d in datasets]
    mixture = train_set if isinstance(train_set, MixtureDataset) else None

    # Where the data ends, by the loader's rule: steps whose whole batch lies below the end index.
    end_index = _data_end_index(train_set)
    end_step = None
    if end_index is not None:
        loader_end = schedule.find_step_containing_offset(end_index)
        if loader_end < num_steps:
            end_step = loader_end
    steps = num_steps if end_step is None else end_step

    stage_plans, cumulative = _stage_plans(mixture, names, lengths, schedule, steps, seq_len)
    stop = mixture.stop_strategy if mixture is not None else None
    ended_by = None
    source_plans = []
    for s, name in enumerate(names):
        n = lengths[s]
        wrap = exhausted = None
        if n is not None:
            wrap_index, exhausted_index = _wrap_and_exhaustion(train_set, mixture, s, n)
            wrap = _event_step(schedule, wrap_index, end_index, steps, inclusive=False)
            # Under first_exhausted (and for a single source) the exhausting draw is the end itself.
            inclusive = stop in (None, "first_exhausted")
            exhausted = _event_step(
                schedule, exhausted_index, end_index, steps, inclusive=inclusive and end_step is not None
            )
            if end_step is not None and exhausted_index is not None:
                # The data ends at the exhausting draw (first_exhausted) or just after it (all_exhausted).
                if exhausted_index + (0 if inclusive else 1) == end_index:
                    ended_by = name
        source_plans.append(
            SourcePlan(
                name=name,
                length=n,
                tokens_available=None if n is None else n * seq_len,
                sequences=cumulative[s],
                tokens=cumulative[s] * seq_len,
                epochs=cumulative[s] / n if n else None,
                wrap_step=wrap,
                exhausted_step=exhausted,
            )
        )

    return DataPlan(
        num_steps=num_steps,
        steps=steps,
        end_step=end_step,
        ended_by=ended_by,
        seq_len=seq_len,
        is_mixture=mixture is not None,
        stop_strategy=stop,
        block_size=mixture.block_size if mixture is not None else None,
        batch_segments=tuple(schedule.constant_segments(0, num_steps)),
        stages=tuple(stage_plans),
        sources=tuple(source_plans),
    )


def _stage_plans(mixture, names: list, lengths: list, schedule: BatchSchedule, steps: int, seq_len: int):
    """``(the stages' plans over steps [0, steps), each source's sequences drawn in all of them)``."""
    if mixture is not None:
        starts = list(mixture.stage_start_steps)
        fractions = [[float(f) for f in fr] for fr in mixture.stage_fractions]
    else:
        starts, fractions = [0], [[1.0]]
    stage_plans = []
    cumulative = [0] * len(names)
    for j, first in enumerate(starts):
        nxt = starts[j + 1] if j + 1 < len(starts) else None
        hi = steps if nxt is None else min(nxt, steps)
        if first >= hi:
            drawn = [0] * len(names)
            last = None
        elif mixture is not None:
            drawn = [int(x) for x in mixture.layout.drawn_in_stage(j, hi)]
            last = hi - 1
        else:
            drawn = [schedule.global_data_offset_by_step(hi)]
            last = hi - 1
        total = sum(drawn)
        per_source = []
        for s, name in enumerate(names):
            cumulative[s] += drawn[s]
            n = lengths[s]
            per_source.append(
                StageSource(
                    stage=j,
                    source=name,
                    first_step=first,
                    last_step=last,
                    sequences=drawn[s],
                    tokens=drawn[s] * seq_len,
                    target_fraction=fractions[j][s],
                    achieved_fraction=drawn[s] / total if total else None,
                    epochs=drawn[s] / n if n else None,
                    cumulative_epochs=cumulative[s] / n if n else None,
                )
            )
        stage_plans.append(
            StagePlan(
                index=j,
                first_step=first,
                last_step=last,
                steps=0 if last is None else hi - first,
                sequences=total,
                tokens=total * seq_len,
                sources=tuple(per_source),
            )
        )
    return stage_plans, cumulative


def _wrap_and_exhaustion(train_set: AsyncDataset, mixture, source: int, n: int) -> tuple[int | None, int | None]:
    """The global indices at which source ``source`` (of ``n`` examples) first wraps and at which it is
    exhausted (None: never)."""
    if mixture is None and isinstance(train_set, EpochDataset):
        # train_lm's epoch: the source wraps after each pass and the data ends after the last.
        wrap_index = n if (train_set.max_epochs or 2) > 1 else None
        return wrap_index, None if train_set.max_epochs is None else n * train_set.max_epochs
    if mixture is None:
        # A single source is not wrapped: the data ends when it runs out.
        return None, n
    past_end = mixture.layout.global_index_of_draw(source, n)  # draws its (n+1)-th example
    if mixture.stop_strategy == "restart":
        return past_end, None
    if mixture.stop_strategy == "first_exhausted":
        return None, past_end
    # all_exhausted: wraps meanwhile; exhausted when its last example is drawn
    return past_end, mixture.layout.global_index_of_draw(source, n - 1)


def _event_step(
    schedule: BatchSchedule, index: Optional[int], end_index: Optional[int], steps: int, *, inclusive: bool
) -> Optional[int]:
    """The step of global index ``index`` if it is trained on (``< steps``); ``inclusive`` also admits
    the draw at which the data ends (the exhausting draw of ``first_exhausted``), whose step is the
    first one the data cannot fill."""
    if index is None:
        return None
    step = _step_of(schedule, index)
    if inclusive and index == end_index and step == steps:
        return step
    return step if step < steps else None


# -- per-step composition (plots) -----------------------------------------------------------------------
def composition_segments(
    train_set: AsyncDataset, schedule: BatchSchedule, steps: int
) -> list[tuple[int, int, dict[str, float]]]:
    """``(first_step, end_step, {source: sequences per step})`` over ``[0, steps)``, one triple per run
    of steps with one stage and one batch size (exact with ``block_size=None``; the block average
    otherwise -- see the module docstring)."""
    names, _ = _source_datasets(train_set)
    if not isinstance(train_set, MixtureDataset):
        return [(lo, hi, {names[0]: float(bs)}) for lo, hi, bs in schedule.constant_segments(0, steps)]
    m = train_set
    out = []
    starts = list(m.stage_start_steps) + [None]
    for j in range(len(m.stage_start_steps)):
        lo_stage = starts[j]
        hi_stage = steps if starts[j + 1] is None else min(starts[j + 1], steps)
        if lo_stage >= hi_stage:
            break
        for lo, hi, bs in schedule.constant_segments(lo_stage, hi_stage):
            if m.block_size is None:
                counts = [float(c) for c in m.layout.counts_per_block(j, bs)]
            else:
                k = m.block_size
                counts = [bs * float(Fraction(int(c), k)) for c in m.layout.counts_per_block(j, k)]
            out.append((lo, hi, dict(zip(names, counts))))
    return out


# -- store rows and dumps -----------------------------------------------------------------------------
async def _store_rows(dataset: AsyncDataset, indices: np.ndarray) -> tuple[TokenSeqDataset, np.ndarray]:
    """Walk ``dataset``'s wrapper chain down to its :class:`TokenSeqDataset`, mapping ``indices`` with
    each wrapper's own public index map (no data is read)."""
    ds, idx = dataset, np.asarray(indices, dtype=np.int64)
    while not isinstance(ds, TokenSeqDataset):
        m = await ds.index_map()
        if m is None:
            raise TypeError(
                f"cannot map indices through {type(ds).__name__}: it reads no token windows of a store "
                "through index maps"
            )
        ds, idx = m.inner, m(idx)
    return ds, idx


def store_rows(dataset: AsyncDataset, indices) -> tuple[TokenSeqDataset, np.ndarray]:
    """``(token_dataset, rows)``: window ``rows[i]`` of ``token_dataset`` is what ``dataset[indices[i]]``
    reads."""
    return _run(_store_rows(dataset, indices))


def token_dataset(dataset: AsyncDataset) -> TokenSeqDataset:
    """The :class:`TokenSeqDataset` at the bottom of a source's wrapper chain."""
    return store_rows(dataset, np.zeros(0, dtype=np.int64))[0]


def dump_rows(train_set: AsyncDataset, schedule: BatchSchedule, start: int, end: int) -> Iterator[dict]:
    """One dict per step in ``[start, end)`` and position in its batch: ``step``, ``position``,
    ``global_index``, ``source``, ``source_index`` (after the stop strategy's wrap) and ``store_row``
    (the source cache's token window, after the source's shuffle).

    Raises :class:`~levanter.data.dataset.DatasetExhausted` for a step past the end of finite data.
    """
    if start < 0 or end < start:
        raise ValueError(f"invalid step range [{start}, {end})")
    names, datasets = _source_datasets(train_set)
    # One loop for the whole dump: the wrappers' lazily built permutations are reused across steps.
    loop = asyncio.new_event_loop()
    try:
        for step in range(start, end):
            first, stop = schedule.step_range(step)
            idx = np.arange(first, stop, dtype=np.int64)
            if isinstance(train_set, MixtureDataset):
                src, src_index = loop.run_until_complete(train_set.source_indices(step, idx))
            else:
                n = loop.run_until_complete(train_set.async_len())
                if stop > n:
                    from .read_plan import DatasetExhausted

                    raise DatasetExhausted(f"step {step} needs global index {stop - 1}, but the data has {n}")
                src, src_index = np.zeros_like(idx), idx
                if isinstance(train_set, EpochDataset):  # the source's index after the epoch's wrap
                    src_index = loop.run_until_complete(train_set.index_map())(idx)
            rows = np.empty_like(src_index)
            for s in np.unique(src).tolist():
                sel = src == s
                rows[sel] = loop.run_until_complete(_store_rows(datasets[s], src_index[sel]))[1]
            for p in range(len(idx)):
                yield {
                    "step": step,
                    "position": p,
                    "global_index": int(idx[p]),
                    "source": names[int(src[p])],
                    "source_index": int(src_index[p]),
                    "store_row": int(rows[p]),
                }
    finally:
        loop.close()

"""MixtureDataset: stages switch exactly at their step, compositions are exact, sources are consumed
in order across stages, stop strategies end where they say, bad input is refused by name."""

import asyncio
import contextlib
from fractions import Fraction

import numpy as np
import pytest

from levanter.data.dataset import ListAsyncDataset, read_planned
from levanter.data.read_plan import DatasetExhausted, StackedBatch
from levanter.data.mixture import MixtureDataset
from levanter.data.mixture_layout import largest_remainder_counts
from levanter.schedule import BatchSchedule, ScheduleStep

SOURCE_STRIDE = 1_000_000
NAMES = ("a", "b", "c")


def sources(lengths=(10**5, 10**5, 10**5)):
    """Source s serves s * SOURCE_STRIDE + i at its index i."""
    return {n: ListAsyncDataset(np.arange(L) + s * SOURCE_STRIDE) for s, (n, L) in enumerate(zip(NAMES, lengths))}


def batches(mix, schedule, steps):
    out = []
    for step in steps:
        first, end = schedule.step_range(step)
        out.append(np.asarray(asyncio.run(mix.get_batch(step, list(range(first, end))))))
    return out


def decode(values):
    return values // SOURCE_STRIDE, values % SOURCE_STRIDE


SCHEDULES = {
    "constant8": BatchSchedule(8),
    "ramped": BatchSchedule([ScheduleStep(0, 8), ScheduleStep(10, 16), ScheduleStep(25, 4)]),
}


def two_stage(switch, **kw):
    return [(0, {"a": 0.5, "b": 0.5}), (switch, {"a": 0.1, "b": 0.1, "c": 0.8})]


@pytest.mark.parametrize("sched_name", sorted(SCHEDULES))
@pytest.mark.parametrize("block_size", [None, 2048, 5])
@pytest.mark.parametrize("s1, s2", [(13, 37), (37, 38), (1, 13)])
def test_switch_happens_exactly_at_the_stage_step(sched_name, block_size, s1, s2):
    schedule = SCHEDULES[sched_name]
    steps = range(0, s2 + 5)
    runs = {}
    for switch in (s1, s2):
        mix = MixtureDataset(sources(), two_stage(switch), batch_schedule=schedule, block_size=block_size, key=0)
        runs[switch] = batches(mix, schedule, steps)
        with_c = [s for s, b in zip(steps, runs[switch]) if (decode(b)[0] == 2).any()]
        assert with_c[0] == switch, f"first stage-2 batch at {with_c[0]}, expected {switch}"
        assert all(s >= switch for s in with_c)
    # Nothing before the earlier switch depends on where the switch is.
    for step in range(s1):
        np.testing.assert_array_equal(runs[s1][step], runs[s2][step])
    assert not np.array_equal(runs[s1][s1], runs[s2][s1])


@pytest.mark.parametrize("sched_name", sorted(SCHEDULES))
def test_block_none_makes_every_batch_exact(sched_name):
    schedule = SCHEDULES[sched_name]
    weights = [(0, {"a": 0.7, "b": 0.2, "c": 0.1}), (13, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}), (37, {"c": 1.0})]
    mix = MixtureDataset(sources(), weights, batch_schedule=schedule, block_size=None, key=1)
    stage_totals = {}
    for step, b in zip(range(45), batches(mix, schedule, range(45))):
        stage = mix.layout.stage_at_step(step)
        src, _ = decode(b)
        got = np.bincount(src, minlength=3)
        fr = [Fraction(weights[stage][1].get(n, 0)) for n in NAMES]
        fr = [f / sum(fr) for f in fr]
        np.testing.assert_array_equal(got, largest_remainder_counts(fr, len(b)))
        tot = stage_totals.setdefault(stage, np.zeros(3, dtype=int))
        tot += got
    for stage, tot in stage_totals.items():
        fr = np.array([float(weights[stage][1].get(n, 0)) for n in NAMES])
        fr /= fr.sum()
        block = min(schedule.batch_size_at_step(s) for s in range(45) if mix.layout.stage_at_step(s) == stage)
        assert np.all(np.abs(tot / tot.sum() - fr) <= 1 / block)


@pytest.mark.parametrize("block_size", [16, 100])
def test_fixed_blocks_hold_exact_counts(block_size):
    schedule = BatchSchedule(8)
    weights = {"a": 0.6, "b": 0.3, "c": 0.1}
    mix = MixtureDataset(sources(), weights, batch_schedule=schedule, block_size=block_size, key=2)
    n_steps = 4 * block_size // 8
    flat = np.concatenate(batches(mix, schedule, range(n_steps)))
    src, _ = decode(flat)
    expected = largest_remainder_counts([Fraction(w) / 1 for w in (0.6, 0.3, 0.1)], block_size)
    for blk in range(4):
        got = np.bincount(src[blk * block_size : (blk + 1) * block_size], minlength=3)
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("sched_name", sorted(SCHEDULES))
@pytest.mark.parametrize("block_size", [None, 7, 2048])
def test_sources_are_consumed_in_order_without_gap_or_repeat(sched_name, block_size):
    schedule = SCHEDULES[sched_name]
    weights = [(0, {"a": 0.5, "b": 0.5}), (13, {"a": 0.2, "c": 0.8}), (20, {"b": 1.0}), (37, {"a": 1, "b": 1, "c": 1})]
    mix = MixtureDataset(sources(), weights, batch_schedule=schedule, block_size=block_size, key=3)
    flat = np.concatenate(batches(mix, schedule, range(50)))
    src, idx = decode(flat)
    for s in range(3):
        seq = idx[src == s]
        np.testing.assert_array_equal(seq, np.arange(len(seq)))
    # The closed-form inverse agrees with the walk.
    for s in range(3):
        positions = np.flatnonzero(src == s)
        for n in range(0, len(positions), max(1, len(positions) // 25)):
            assert mix.layout.global_index_of_draw(s, n) == positions[n]


def test_restart_wraps_finite_sources():
    schedule = BatchSchedule(8)
    mix = MixtureDataset(sources((5, 7, 10**5)), {"a": 0.5, "b": 0.5}, batch_schedule=schedule, key=4)
    flat = np.concatenate(batches(mix, schedule, range(10)))
    src, idx = decode(flat)
    for s, n in ((0, 5), (1, 7)):
        seq = idx[src == s]
        np.testing.assert_array_equal(seq, np.arange(len(seq)) % n)
    assert not mix.is_finite()


def brute_force_unwrapped(mix, schedule, n_steps):
    src, idx = [], []
    for step in range(n_steps):
        first, end = schedule.step_range(step)
        s, i = mix.layout.unwrapped_source_indices(step, list(range(first, end)))
        src.append(s)
        idx.append(i)
    return np.concatenate(src), np.concatenate(idx)


@pytest.mark.parametrize("block_size", [None, 6])
def test_first_exhausted_ends_at_the_first_source_running_out(block_size):
    schedule = BatchSchedule([ScheduleStep(0, 4), ScheduleStep(5, 8)])
    lengths = (30, 12, 500)
    weights = [(0, {"a": 0.5, "b": 0.5}), (6, {"a": 0.3, "b": 0.2, "c": 0.5})]
    mix = MixtureDataset(sources(lengths), weights, batch_schedule=schedule, block_size=block_size, key=5,
                         stop_strategy="first_exhausted")
    assert mix.is_finite()
    src, idx = brute_force_unwrapped(mix, schedule, 40)
    overrun = np.flatnonzero(idx >= np.asarray(lengths)[src])
    end = int(overrun[0])
    assert asyncio.run(mix.async_len()) == end
    last_step = schedule.find_step_containing_offset(end)
    ok = batches(mix, schedule, range(last_step))  # every step before the end reads fine
    assert len(ok) == last_step
    with pytest.raises(DatasetExhausted):
        batches(mix, schedule, [last_step])


@pytest.mark.parametrize("block_size", [None, 6])
def test_all_exhausted_ends_after_the_last_source_runs_out(block_size):
    schedule = BatchSchedule(4)
    lengths = (30, 12, 50)
    weights = [(0, {"a": 0.5, "b": 0.5}), (6, {"a": 0.3, "b": 0.2, "c": 0.5})]
    mix = MixtureDataset(sources(lengths), weights, batch_schedule=schedule, block_size=block_size, key=6,
                         stop_strategy="all_exhausted")
    assert mix.is_finite()
    src, idx = brute_force_unwrapped(mix, schedule, 200)
    done_at = [int(np.flatnonzero((src == s) & (idx == lengths[s] - 1))[0]) + 1 for s in range(3)]
    end = max(done_at)
    assert asyncio.run(mix.async_len()) == end
    last_step = schedule.find_step_containing_offset(end)
    values = np.concatenate(batches(mix, schedule, range(last_step)))
    s, i = decode(values)
    np.testing.assert_array_equal(s, src[: len(values)])
    np.testing.assert_array_equal(i, idx[: len(values)] % np.asarray(lengths)[s])  # early finishers wrap
    with pytest.raises(DatasetExhausted):
        batches(mix, schedule, [last_step])


def test_all_exhausted_never_ends_if_a_source_stops_being_drawn():
    mix = MixtureDataset(sources((10**4, 10, 10)), [(0, {"a": 1.0}), (2, {"b": 1.0})], batch_schedule=4, key=0,
                         stop_strategy="all_exhausted")
    with pytest.raises(ValueError, match="never ends"):
        asyncio.run(mix.async_len())


def test_index_not_belonging_to_step_is_a_loud_error():
    mix = MixtureDataset(sources(), {"a": 1, "b": 1}, batch_schedule=8, key=0)
    with pytest.raises(ValueError, match="does not belong to step 2"):
        asyncio.run(mix.get_batch(2, [15, 16]))
    with pytest.raises(ValueError, match="does not belong to step 2"):
        asyncio.run(mix.get_batch(2, [24]))


def test_stage_start_need_not_align_with_blocks_or_batches():
    # Upstream requires stage starts at multiples of a 2048-sequence block; here any step works.
    schedule = BatchSchedule([ScheduleStep(0, 24), ScheduleStep(3, 40)])
    mix = MixtureDataset(sources(), [(0, {"a": 1}), (7, {"b": 1})], batch_schedule=schedule, block_size=2048, key=0)
    got = [set(decode(b)[0].tolist()) for b in batches(mix, schedule, range(10))]
    assert got == [{0}] * 7 + [{1}] * 3


def test_key_changes_layout_but_not_counts():
    schedule = BatchSchedule(16)
    a = batches(MixtureDataset(sources(), {"a": 1, "b": 3}, batch_schedule=schedule, key=0), schedule, range(3))
    b = batches(MixtureDataset(sources(), {"a": 1, "b": 3}, batch_schedule=schedule, key=1), schedule, range(3))
    assert any(not np.array_equal(x, y) for x, y in zip(a, b))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.bincount(decode(x)[0]), np.bincount(decode(y)[0]))


@pytest.mark.parametrize(
    "weights, kwargs, fragment",
    [
        ({"a": -1, "b": 2}, {}, "'a' is negative"),
        ({"a": 0, "b": 0}, {}, "all weights are zero"),
        ({"a": 1, "zz": 1}, {}, "unknown source 'zz'"),
        ([(0, {"a": 1}), (10, {"nope": 1})], {}, "unknown source 'nope'"),
        ([(5, {"a": 1})], {}, "first stage must start at step 0"),
        ([(0, {"a": 1}), (10, {"b": 1}), (10, {"a": 1})], {}, "strictly increasing"),
        ([(0, {"a": 1}), (10, {"b": 1}), (4, {"a": 1})], {}, "strictly increasing"),
        ({"a": float("nan")}, {}, "finite number"),
        ({"a": 1}, {"key": None}, "seed is required"),
        ({"a": 1}, {"stop_strategy": "sometimes"}, "stop_strategy"),
        ({"a": 1}, {"block_size": 0}, "block_size"),
    ],
)
def test_bad_input_names_the_culprit(weights, kwargs, fragment):
    args = dict(batch_schedule=8, key=0)
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        MixtureDataset(sources(), weights, **args)
    assert fragment in str(e.value)


def test_largest_remainder_rounding():
    thirds = [Fraction(1, 3)] * 3
    assert largest_remainder_counts(thirds, 8).tolist() == [3, 3, 2]
    assert largest_remainder_counts([Fraction(7, 10), Fraction(2, 10), Fraction(1, 10)], 8).tolist() == [6, 1, 1]
    for total in range(1, 50):
        c = largest_remainder_counts([Fraction(1, 7), Fraction(2, 7), Fraction(4, 7)], total)
        assert c.sum() == total
        assert all(abs(c[i] - f * total) < 1 for i, f in enumerate([Fraction(1, 7), Fraction(2, 7), Fraction(4, 7)]))


# -- one combined read per step (ReadPlan) ---------------------------------------------------------------


def _token_sources(tmp_path, tokens_only=False):
    """Three token-window sources on real stores, behind different index-mapping wrappers, and a fourth
    behind a wrapper that cannot plan (a per-example map), which forces the per-source path."""
    from levanter.data.text import CausalLmDataset, TokenSeqDataset
    from levanter.store.jagged_array import JaggedArrayStore

    rng = np.random.default_rng(0)
    out = {}
    for k, n in enumerate((700, 450, 300, 260)):
        flat = rng.integers(0, 50, n * 8).astype(np.int32)
        flat[rng.random(flat.size) < 0.05] = 99  # EOS
        path = tmp_path / f"s{k}"
        if not path.exists():
            store = JaggedArrayStore.open(path, mode="w", data_chunk=64)
            store.append_flat(flat, np.array([flat.size]))
            store.finalize()
        store = JaggedArrayStore.open(path, mode="r")
        out[k] = CausalLmDataset(TokenSeqDataset(store, 8), eos_id=99, tokens_only=tokens_only)
    return {
        "shuffled": out[0].shuffle(key=1),
        "shuffled2": out[2].shuffle(key=5),  # with "shuffled": permutations evaluated in one pass
        "blocks": out[1].block_shuffle(16, key=2),
        "epochs": out[2].slice_dataset(5, 290).epochs(),
        "mapped": out[3].map(lambda x: x),
        # Plans that can share a read but not a finish (another EOS id): finished per source, then merged.
        "other_eos": CausalLmDataset(out[1].dataset, eos_id=49, tokens_only=tokens_only).shuffle(key=7),
    }


@pytest.mark.parametrize(
    "names",
    [("shuffled", "blocks", "epochs"), ("shuffled", "shuffled2", "blocks"), ("shuffled", "blocks", "mapped"),
     ("shuffled", "shuffled2", "mapped"), ("shuffled", "blocks", "other_eos")],
)
def test_combined_read_equals_reading_each_source(tmp_path, monkeypatch, names):
    """Every step of two stages: the mixture's batch (one tensorstore read per step when every source can
    plan, else per-source reads; one causal-LM finish of the whole batch when the plans share it) equals
    each source's own get_batch of the rows the mixture drew."""
    from levanter.store import batched_reads

    import levanter.data.dataset as dataset_module
    import levanter.data.text as text_module

    finishes = []
    real_columns = text_module.causal_lm_columns
    monkeypatch.setattr(
        text_module, "causal_lm_columns", lambda t, e: finishes.append(len(t)) or real_columns(t, e)
    )

    reads = []
    real_read = batched_reads.read_view
    monkeypatch.setattr(batched_reads, "read_view", lambda view: reads.append(1) or real_read(view))
    from levanter.data import FeistelPermutation

    # Passes that evaluate permutations (a slice's or epochs' map below a shuffle is a second level: not one).
    permuted = []
    real_many = dataset_module.permute_many

    def counting(reqs):
        if any(isinstance(p, FeistelPermutation) for p, _ in reqs):
            permuted.append(sum(len(i) for _, i in reqs))
        return real_many(reqs)

    monkeypatch.setattr(dataset_module, "permute_many", counting)

    def columns(batch):
        if isinstance(batch, StackedBatch):
            return batch.tree
        return {k: np.stack([np.asarray(ex[k]) for ex in batch]) for k in batch[0]}

    srcs = _token_sources(tmp_path)
    sources = {n: srcs[n] for n in names}
    schedule = BatchSchedule(48)
    weights = [(0, {names[0]: 0.5, names[1]: 0.3, names[2]: 0.2}), (9, {names[0]: 0.1, names[1]: 0.2, names[2]: 0.7})]
    mix = MixtureDataset(sources, weights, batch_schedule=schedule, block_size=None, key=3)

    mixture_reads, mixture_finishes = [], []

    async def check():
        planned = 0
        for step in range(20):
            idx = np.arange(schedule.global_data_offset_by_step(step), schedule.global_data_offset_by_step(step + 1))
            before, finished_before = len(reads), len(finishes)
            got = columns(await mix.get_batch(step, idx))
            mixture_reads.append(len(reads) - before)
            mixture_finishes.append(finishes[finished_before:])
            source, src_index = await mix.source_indices(step, idx)
            expect = {k: np.empty((idx.size, 8), v.dtype) for k, v in got.items()}
            for s in np.unique(source).tolist():
                sel = np.flatnonzero(source == s)
                rows = columns(await mix.datasets[s].get_batch(step, src_index[sel]))
                for k in expect:
                    expect[k][sel] = rows[k]
            for k in expect:
                np.testing.assert_array_equal(got[k], expect[k], err_msg=f"step {step} column {k}")
            plans = [(await d.plan([step], [np.array([0])]))[0] for d in mix.datasets]
            planned += all(p is not None for p in plans)
        return planned

    planned = asyncio.run(check())
    assert len(permuted) == 20  # the shuffled sources' permutations: one pass per step
    # Every source plans (a per-example map too: its plan is its source's, mapped): one read per step.
    assert planned == 20 and mixture_reads == [1] * 20
    if "mapped" in names or "other_eos" in names:  # a finish per source present in the step
        assert max(len(f) for f in mixture_finishes) > 1
    else:  # the plans share their finish: each step finished once, whole
        assert all(f == [48] for f in mixture_finishes)

    # A plan of several steps: their index math in one pass (the permutations vectorised: more than
    # SMALL indices), and a plan wherever every source plans and the plans finish alike.
    steps = list(range(20))
    idxs = [np.arange(schedule.global_data_offset_by_step(s), schedule.global_data_offset_by_step(s + 1))
            for s in steps]
    before = len(permuted)
    (plan,) = asyncio.run(mix.plan(steps, idxs))
    assert len(permuted) == before + 1 and permuted[-1] > FeistelPermutation.SMALL
    assert (plan is None) == ("mapped" in names or "other_eos" in names)


def test_tokens_only_mixture_reads_the_tokens_of_the_full_one(tmp_path, monkeypatch):
    """``tokens_only`` sources (what train_lm reads): every step's batch is ``{tokens}``, equal to the
    full mixture's tokens; sources with other EOS ids now share a read plan and its coalesced reads."""
    from levanter.store import batched_reads

    names = ("shuffled", "blocks", "other_eos")
    full, only = _token_sources(tmp_path), _token_sources(tmp_path, tokens_only=True)
    schedule = BatchSchedule(8)
    weights = [(0, {"shuffled": 0.5, "blocks": 0.3, "other_eos": 0.2}),
               (9, {"shuffled": 0.1, "blocks": 0.2, "other_eos": 0.7})]
    full_mix, only_mix = (MixtureDataset({n: srcs[n] for n in names}, weights, batch_schedule=schedule, key=3)
                          for srcs in (full, only))
    reads = []
    real_read = batched_reads.read_view
    monkeypatch.setattr(batched_reads, "read_view", lambda v: reads.append(1) or real_read(v))
    only_reads = []
    for step in range(20):
        idx = np.arange(step * 8, step * 8 + 8)
        want = asyncio.run(full_mix.get_batch(step, idx)).tree
        before = len(reads)
        got = asyncio.run(only_mix.get_batch(step, idx)).tree
        only_reads.append(len(reads) - before)
        assert set(got) == {"tokens"} and got["tokens"].dtype == np.int32
        np.testing.assert_array_equal(got["tokens"], want["tokens"], err_msg=f"step {step}")
    # The sources' plans share one read (and one finish) although their EOS ids differ.
    assert only_reads == [1] * 20


# -- one mixture answers every request as a fresh one would ------------------------------------------------


# The request mix both "never changes what is read" tests replay: a batch-size change at step 9, a stage
# switch at step 7, and every way a reader can leave the sequential path.
PLAN_SCHEDULE = BatchSchedule([ScheduleStep(0, 8), ScheduleStep(9, 12)])
PLAN_WEIGHTS = [(0, {"a": 0.5, "b": 0.3, "c": 0.2}), (7, {"a": 0.1, "b": 0.2, "c": 0.7})]


def _plan_rows(step, rows=None):
    first, end = PLAN_SCHEDULE.step_range(step)
    idx = np.arange(first, end)
    return idx if rows is None else idx[rows]


def _mixed_requests(far: range, restarts: bool = False) -> list:
    """``(step, indices)``: whole batches across the stage and size changes, one process's rows in order,
    out-of-order and repeated steps and other rows, (a reader that stops and starts again,) then ``far``."""
    r = _plan_rows
    requests = [(s, r(s)) for s in range(30)]
    requests += [(s, r(s, slice(2, 6))) for s in range(3, 25)]
    requests += [(12, r(12)), (11, r(11, [0, 5])), (13, r(13, [1])), (14, r(14)), (14, r(14)), (40, r(40)),
                 (41, r(41, [3, 2, 3]))]
    if restarts:
        requests += [(s, r(s)) for s in range(44, 48)] + [(s, r(s)) for s in range(45, 50)]
    return requests + [(s, r(s)) for s in far]


@pytest.mark.parametrize("block_size", [None, 5, 2048])
@pytest.mark.parametrize("stop_strategy", ["restart", "first_exhausted"])
def test_a_mixture_keeps_no_state_about_its_callers(block_size, stop_strategy):
    """Every answer of one mixture -- sequential runs over the whole batch and over a process's rows, a
    batch-size change, a stage switch, out-of-order and repeated steps, other rows, the end of a finite
    mixture -- equals what a fresh mixture returns for that single request; and answering changes nothing
    in the mixture but the facts it learns about its sources (their lengths)."""
    lengths = (400, 90, 10**5)

    def make():
        srcs = sources(lengths)
        srcs["a"] = srcs["a"].shuffle(key=1)
        srcs["c"] = srcs["c"].shuffle(key=2)
        return MixtureDataset(srcs, PLAN_WEIGHTS, batch_schedule=PLAN_SCHEDULE, block_size=block_size, key=4,
                              stop_strategy=stop_strategy)

    requests = _mixed_requests(far=range(60, 120))  # far on: a finite mixture ends meanwhile
    mix = make()
    asyncio.run(mix.get_batch(0, _plan_rows(0)))
    state = dict(vars(mix))
    ended = 0
    for step, idx in requests:
        try:
            expect = np.asarray(asyncio.run(make().get_batch(step, idx)))
        except DatasetExhausted:
            with pytest.raises(DatasetExhausted):
                asyncio.run(mix.get_batch(step, idx))
            ended += 1
            continue
        got = np.asarray(asyncio.run(mix.get_batch(step, idx)))
        np.testing.assert_array_equal(got, expect, err_msg=f"step {step}, indices {idx.tolist()}")
    assert (ended > 0) == (stop_strategy == "first_exhausted")  # the end was reached where there is one
    assert vars(mix).keys() == state.keys() and all(vars(mix)[k] is v for k, v in state.items())


def _runs(requests: list) -> list:
    """``requests`` cut into runs a loader's iterator would make: consecutive steps, each for the same rows
    of its batch (a run of one request is a reader that asks for a step out of order)."""
    runs: list = []
    for step, idx in requests:
        last = runs[-1][-1] if runs else None
        rows = idx - PLAN_SCHEDULE.global_data_offset_by_step(step)
        if (last is not None and last[0] == step - 1 and PLAN_SCHEDULE.batch_size_at_step(step) ==
                PLAN_SCHEDULE.batch_size_at_step(last[0])
                and np.array_equal(rows, last[1] - PLAN_SCHEDULE.global_data_offset_by_step(last[0]))):
            runs[-1].append((step, idx))
        else:
            runs.append([(step, idx)])
    return runs


@pytest.mark.parametrize("block_size", [None, 5])
@pytest.mark.parametrize("stop_strategy", ["restart", "first_exhausted"])
@pytest.mark.parametrize("index_array_blocks", [True, False])
def test_coalesced_reads_never_change_what_is_read(tmp_path, monkeypatch, block_size, stop_strategy,
                                                    index_array_blocks):
    """Store-backed sources read through the loader's read-ahead: a run of consecutive steps is read in
    groups (one tensorstore operation per group, of one index-array block or one view per window from each
    source). Every answer -- sequential whole batches and one process's rows, a batch-size change, a stage
    switch, out-of-order and repeated steps, other rows, the end of a finite mixture, a reader that stops
    and starts again -- equals what a fresh mixture returns for that single request; and there are fewer
    reads than requests."""
    from levanter.data.read_ahead import TRIM_GROUPS, GROUPS_AHEAD, MISS, PLAN_MAX_STEPS, ReadAhead
    from levanter.store import batched_reads

    import levanter.data.read_ahead as read_ahead_module
    import levanter.data.text as text_module

    monkeypatch.setattr(text_module, "BLOCK_MAX_SEQ_LEN", 8 if index_array_blocks else 7)  # windows of 8

    # Small enough that batches of 8 and 12 rows coalesce 2-3 steps, and batch-size changes cut groups.
    monkeypatch.setattr(read_ahead_module, "COALESCE_ROWS", 24)
    reads = []
    real_read = batched_reads.read_view
    monkeypatch.setattr(batched_reads, "read_view", lambda v: reads.append(1) or real_read(v))
    srcs = _token_sources(tmp_path)

    def make():
        return MixtureDataset({"a": srcs["shuffled"], "b": srcs["blocks"], "c": srcs["epochs"]}, PLAN_WEIGHTS,
                              batch_schedule=PLAN_SCHEDULE, block_size=block_size, key=4,
                              stop_strategy=stop_strategy)

    requests = _mixed_requests(far=range(100, 260), restarts=True)  # far on: a finite mixture ends meanwhile
    mix = make()
    ended = mix_reads = served = 0

    async def run():
        nonlocal ended, mix_reads, served
        for run_requests in _runs(requests):
            first_step, first_idx = run_requests[0]
            rows = first_idx - PLAN_SCHEDULE.global_data_offset_by_step(first_step)
            ahead = ReadAhead(mix, lambda s: PLAN_SCHEDULE.global_data_offset_by_step(s) + rows, first_step,
                              run_requests[-1][0] + 1)
            for step, idx in run_requests:
                try:
                    expect = await make().get_batch(step, idx)
                except DatasetExhausted:
                    with pytest.raises(DatasetExhausted):
                        got = await ahead.read(step)
                        if got is MISS:
                            await mix.get_batch(step, idx)
                    ended += 1
                    continue
                before = len(reads)
                got = await ahead.read(step)
                if got is MISS:
                    got = await mix.get_batch(step, idx)
                else:
                    got, provenance = got
                    assert provenance is None  # not asked for
                    served += 1
                mix_reads += len(reads) - before
                assert isinstance(got, StackedBatch) and isinstance(expect, StackedBatch)
                assert set(got.tree) == set(expect.tree)
                for k in expect.tree:
                    where = f"step {step}, {idx.tolist()}, {k}"
                    np.testing.assert_array_equal(got.tree[k], expect.tree[k], err_msg=where)
            for t in ahead.close():
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    asyncio.run(run())
    assert (ended > 0) == (stop_strategy == "first_exhausted")
    answered = len(requests) - ended
    assert served > answered // 2
    assert mix_reads < 0.7 * answered, (mix_reads, answered)  # steps were read together


def test_groups_read_ahead_stay_bounded_and_a_failed_one_is_read_again(tmp_path, monkeypatch):
    """A sequential reader's groups of steps are read ahead of need (beyond the group being served), but
    never more than ``GROUPS_AHEAD`` groups past it; a read ahead that fails fails only the steps it
    holds, once each, and asking again reads them afresh -- every answer equals a fresh mixture's."""
    from levanter.data.read_ahead import COALESCE_MAX_STEPS, GROUPS_AHEAD, MISS, ReadAhead
    from levanter.store import batched_reads

    srcs = _token_sources(tmp_path, tokens_only=True)
    weights = [(0, {"shuffled": 0.5, "blocks": 0.3, "epochs": 0.2}), (40, {"shuffled": 0.1, "blocks": 0.9})]

    def make():
        return MixtureDataset({n: srcs[n] for n in ("shuffled", "blocks", "epochs")}, weights,
                              batch_schedule=BatchSchedule(4), key=6)

    class FailedRead:  # a tensorstore future that has already failed
        def add_done_callback(self, callback):
            callback(self)

        def done(self):
            return True

        def result(self):
            raise OSError("injected read failure")

    async def expected():  # each step asked of a fresh mixture, before any read fails
        return [(await make().get_batch(s, np.arange(s * 4, s * 4 + 4))).tree["tokens"] for s in range(90)]

    expect = asyncio.run(expected())
    reads = []
    real_read = batched_reads.read_view

    def read(view):
        reads.append(1)
        return FailedRead() if len(reads) == 6 else real_read(view)

    monkeypatch.setattr(batched_reads, "read_view", read)
    mix = make()
    group_steps = COALESCE_MAX_STEPS  # 4 rows a step: groups are cut by steps, not rows
    failed, furthest = [], 0

    async def run():
        nonlocal furthest
        ahead = ReadAhead(mix, lambda s: np.arange(s * 4, s * 4 + 4), 0, None)
        for step in range(90):
            idx = np.arange(step * 4, step * 4 + 4)
            try:
                got = await ahead.read(step)
                got = await mix.get_batch(step, idx) if got is MISS else got[0]
            except OSError:
                failed.append(step)
                assert await ahead.read(step) is MISS  # what the loader's retry does: read afresh
                got = await mix.get_batch(step, idx)
            np.testing.assert_array_equal(got.tree["tokens"], expect[step], err_msg=f"step {step}")
            held = [s - step for s in ahead.steps_held()]
            bound = (1 + GROUPS_AHEAD) * group_steps
            assert all(-group_steps <= a <= bound for a in held), (step, held)
            furthest = max([furthest, *held])
        ahead.close()

    asyncio.run(run())
    assert furthest > group_steps  # read beyond the group being served
    # The sixth read was a group read ahead: each of its steps failed once, then was read afresh.
    assert len(failed) == group_steps and failed == list(range(failed[0], failed[0] + group_steps)), failed
    assert len(reads) < 90 // 2


def _columns_of(batch) -> dict:
    if isinstance(batch, StackedBatch):
        return batch.tree
    return {k: np.stack([np.asarray(ex[k]) for ex in batch]) for k in batch[0]}


@pytest.mark.parametrize("index_array_blocks", [True, False])
def test_a_plan_of_several_steps_reads_each_steps_batch(tmp_path, monkeypatch, index_array_blocks):
    """``plan(steps, indices)`` through every wrapper a source config builds: its rows, read and
    finished, are each step's ``get_batch`` back to back (a per-example map's examples too)."""
    import levanter.data.text as text_module
    from levanter.store.batched_reads import read_blocks, read_stacked

    monkeypatch.setattr(text_module, "BLOCK_MAX_SEQ_LEN", 8 if index_array_blocks else 7)  # windows of 8
    rng = np.random.default_rng(3)
    for name, source in _token_sources(tmp_path).items():
        n = asyncio.run(source.async_len()) if source.is_finite() else 1000
        steps = [4, 5, 6]
        indices = [rng.integers(0, n, size) for size in (3, 1, 5)]
        (plan,) = asyncio.run(source.plan(steps, indices))
        assert plan.num_rows == 9 and (plan.block is not None) == index_array_blocks, name
        rows = (read_blocks([plan.block]) if plan.block is not None else read_stacked(plan.views)).result()
        got = _columns_of(plan.finish(rows))
        want = [_columns_of(asyncio.run(source.get_batch(s, i))) for s, i in zip(steps, indices)]
        for k in want[0]:
            np.testing.assert_array_equal(got[k], np.concatenate([w[k] for w in want]), err_msg=f"{name} {k}")


@pytest.mark.parametrize("rows, steps", [(8, 8000), (65, 3000)])
def test_read_ahead_bookkeeping_stays_bounded_over_a_long_run(rows, steps):
    """However many steps an iterator reads, the read-ahead holds the bookkeeping of a bounded number of
    groups (groups of many steps at 8 rows a step, one-step groups at 65), and every step is served."""
    from levanter.data.read_ahead import TRIM_GROUPS, GROUPS_AHEAD, MISS, PLAN_MAX_STEPS, ReadAhead

    sources = {"a": ListAsyncDataset(np.arange(10**6)), "b": ListAsyncDataset(np.arange(10**6) + 10**7)}
    mix = MixtureDataset(sources, {"a": 0.5, "b": 0.5}, batch_schedule=BatchSchedule(rows), key=1)

    def indices(s):
        return np.arange(s * rows, (s + 1) * rows)

    async def run():
        ahead = ReadAhead(mix, indices, 0, None)
        most = 0
        for step in range(1, steps + 1):
            got = await ahead.read(step)
            got = await mix.get_batch(step, indices(step)) if got is MISS else got[0]
            assert len(got) == rows
            most = max(most, ahead.groups_held())
        ahead.close()
        return most

    # What is held: up to TRIM_GROUPS forgotten groups awaiting a trim, the current planning pass, the
    # groups read ahead; fewer than the run cuts (500 and 3000 groups), so a leak cannot pass.
    bound = TRIM_GROUPS + PLAN_MAX_STEPS + GROUPS_AHEAD + 1
    assert bound < steps // (16 if rows == 8 else 1)
    assert asyncio.run(run()) <= bound


# -- provenance from the read's own pass ------------------------------------------------------------------


def _old_second_pass(mix, lengths, step, indices):
    """What the loader used to compute for every batch in a second pass over the index math: the
    layout's unwrapped ``(source, source_index)``, the end of the data, then the stop strategy's wrap."""
    source, src_index = mix.layout.unwrapped_source_indices(step, indices)
    if mix.stop_strategy != "restart":
        end = mix._end_from_lengths(lengths)
        if end is not None and int(np.max(indices)) >= end:
            raise DatasetExhausted(f"step {step} past the end {end}")
    src_index = src_index.copy()
    for s, n in enumerate(lengths):
        if n is not None:  # an infinite source is never wrapped
            src_index[source == s] %= n
    return source, src_index


@pytest.mark.parametrize("stop_strategy", ["restart", "first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("block_size", [None, 2, 5])
def test_provenance_from_the_read_equals_the_old_second_pass(stop_strategy, block_size):
    """Exhaustively over a small domain -- every step of a two-stage, two-batch-size run until the data
    ends, every non-empty subset of each step's rows read (a process reading part of the batch) -- the
    provenance ``read_planned`` returns with the read (the one-step plan) equals the old second pass, value and dtype,
    the rows read equal ``get_batch``'s, and a step past the end fails alike."""
    lengths = [9, 12, 8]
    sources = {
        "a": ListAsyncDataset(np.arange(9) * 10).shuffle(key=1),
        "b": ListAsyncDataset(np.arange(12) * 10 + 1).block_shuffle(5, key=2),
        "c": ListAsyncDataset(np.arange(9) * 10 + 2).slice_dataset(1),  # 8 rows
    }
    schedule = BatchSchedule([ScheduleStep(0, 3), ScheduleStep(4, 4)])
    weights = [(0, {"a": 0.5, "b": 0.3, "c": 0.2}), (3, {"a": 0.2, "b": 0.3, "c": 0.5})]
    mix = MixtureDataset(sources, weights, batch_schedule=schedule, block_size=block_size, key=9,
                         stop_strategy=stop_strategy)
    checked = ended = 0

    async def run():
        nonlocal checked, ended
        for step in range(40):
            first, end = schedule.step_range(step)
            where = np.arange(first, end)
            try:
                source, src_index = _old_second_pass(mix, lengths, step, where)
            except DatasetExhausted:
                with pytest.raises(DatasetExhausted):
                    await read_planned(mix, step, where, where)
                ended += 1
                continue
            for mask in range(1, 2**where.size):
                idx = where[[k for k in range(where.size) if mask >> k & 1]]
                rows, prov = await read_planned(mix, step, idx, where)
                assert set(prov) == {"source", "source_index"}
                for key, expect in (("source", source), ("source_index", src_index)):
                    assert prov[key].dtype == expect.dtype
                    np.testing.assert_array_equal(prov[key], expect, err_msg=f"step {step} rows {idx} {key}")
                np.testing.assert_array_equal(np.asarray(rows), np.asarray(await mix.get_batch(step, idx)))
                checked += 1

    asyncio.run(run())
    assert checked >= 5 * 7  # at least five steps, with all their subsets
    assert (ended > 0) == mix.is_finite()  # restart never ends, nor all_exhausted with a source left undrawn


@pytest.mark.parametrize("block_size", [None, 3])
def test_planned_provenance_equals_the_old_second_pass(tmp_path, block_size):
    """The read-ahead's way in: ``plan(..., where=...)`` over store-backed sources attaches to
    each group's plan the provenance of its steps' whole batches, back to back -- for every step of the
    run, in groups of every size up to 5, reading the whole batch or its second half -- equal to the old
    second pass."""
    srcs = _token_sources(tmp_path)
    sources = {n: srcs[n] for n in ("shuffled", "blocks", "epochs")}
    weights = [(0, {"shuffled": 0.5, "blocks": 0.3, "epochs": 0.2}), (9, {"shuffled": 0.1, "blocks": 0.2, "epochs": 0.7})]
    mix = MixtureDataset(sources, weights, batch_schedule=PLAN_SCHEDULE, block_size=block_size, key=3)
    lengths = [asyncio.run(d.async_len()) if d.is_finite() else None for d in mix.datasets]
    steps = list(range(24))
    wheres = [np.arange(*PLAN_SCHEDULE.step_range(s)) for s in steps]
    expect = [_old_second_pass(mix, lengths, s, w) for s, w in zip(steps, wheres)]

    async def run():
        for size in range(1, 6):
            groups = [size] * (len(steps) // size) + ([len(steps) % size] if len(steps) % size else [])
            for part in ("whole", "half"):
                idxs = wheres if part == "whole" else [w[w.size // 2:] for w in wheres]
                plans = await mix.plan(steps, idxs, groups, wheres)
                at = 0
                for g, plan in zip(groups, plans):
                    assert plan is not None and set(plan.provenance) == {"source", "source_index"}
                    for k, key in enumerate(("source", "source_index")):
                        want = np.concatenate([expect[s][k] for s in range(at, at + g)])
                        np.testing.assert_array_equal(plan.provenance[key], want, err_msg=f"group {at} {key}")
                        assert plan.provenance[key].dtype == want.dtype
                    assert plan.num_rows == sum(idxs[s].size for s in range(at, at + g))
                    at += g

    asyncio.run(run())

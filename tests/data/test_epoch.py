"""``epoch`` (train_lm's top-level key, upstream's meaning): the training data repeats, in the same order, up
to that many epochs. The repeat is a pure index map (``EpochDataset``: index i reads i mod len), so every
step's batch is a function of the step alone: checked exhaustively over small domains through the loader
(restarting at every step gives the rest of the stream), through the read-ahead path over a real store,
and end to end by a train_lm run that covers more than one epoch; a run needing more epochs than ``epoch``
allows is refused before training, with the figures."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest

from levanter.data.dataset import EpochDataset, ListAsyncDataset
from levanter.data.read_plan import DatasetExhausted
from levanter.data.loader import DataLoader
from levanter.schedule import BatchSchedule, ScheduleStep


def _schedule(spec):
    return BatchSchedule([ScheduleStep(start=s, value=v) for s, v in spec])


def _stream(loader, start):
    with loader.iter_from_step(start) as it:
        return [(b.step, b.global_offset, np.asarray(b.data).tolist()) for b in it]


@pytest.mark.parametrize("spec", [[(0, 2)], [(0, 3), (2, 2)]])
def test_every_small_domain_repeats_and_resumes_from_every_step(spec):
    """For every length n <= 6 and epoch count E <= 3, shuffled: the stream from step 0 is the shuffled
    order repeated E times, cut at the last whole batch; started at any step, the loader yields exactly
    the rest of that stream."""
    schedule = _schedule(spec)
    for n in range(1, 7):
        base = ListAsyncDataset(np.arange(n, dtype=np.int64) * 10).shuffle(key=n)
        order = list(np.asarray(asyncio.run(base.get_batch(0, np.arange(n)))))
        for epochs in (1, 2, 3):
            ds = EpochDataset(base, max_epochs=epochs)
            assert asyncio.run(ds.async_len()) == n * epochs
            full = _stream(DataLoader(ds, schedule, prefetch_depth=2), 0)
            steps = schedule.find_step_containing_offset(n * epochs)
            assert [s for s, _, _ in full] == list(range(steps))
            flat = [v for _, _, vals in full for v in vals]
            assert flat == (order * epochs)[: len(flat)]
            assert len(flat) == schedule.global_data_offset_by_step(steps)
            for start in range(steps + 1):
                assert _stream(DataLoader(ds, schedule, prefetch_depth=2), start) == full[start:], (n, epochs, start)
            with pytest.raises(DatasetExhausted):
                asyncio.run(ds.get_batch(0, [n * epochs]))


def test_epochs_through_read_ahead_over_a_store(tmp_path):
    """train_lm's single source as it builds it (token windows of a store, shuffled, then repeated): the
    loader reads it ahead in planned groups; every step's tokens are the windows perm(i mod n) of the
    store, from step 0 and from every restart."""
    from levanter.data.text import CausalLmDataset, TokenSeqDataset
    from levanter.store.jagged_array import JaggedArrayStore

    n, seq = 37, 8
    flat = np.random.default_rng(0).integers(0, 50, n * seq).astype(np.int32)
    store = JaggedArrayStore.open(tmp_path / "s", mode="w", data_chunk=64)
    store.append_flat(flat, np.array([flat.size]))
    store.finalize()
    tokens = TokenSeqDataset(JaggedArrayStore.open(tmp_path / "s", mode="r"), seq)
    shuffled = CausalLmDataset(tokens, eos_id=49, tokens_only=True).shuffle(key=7)
    ds = shuffled.epochs(max_epochs=3)
    assert (asyncio.run(ds.plan([0], [[0]])))[0] is not None  # planned through the epochs and the shuffle
    perm = asyncio.run(shuffled.index_map())
    schedule = _schedule([(0, 5), (6, 7)])
    steps = schedule.find_step_containing_offset(3 * n)

    def run(start):
        with DataLoader(ds, schedule, prefetch_depth=6, provenance=True).iter_from_step(start) as it:
            return [(b.step, np.asarray(b.data["tokens"])) for b in it]

    full = run(0)
    assert [s for s, _ in full] == list(range(steps))
    assert schedule.global_data_offset_by_step(steps) > 2 * n  # well into the third epoch
    windows = flat.reshape(n, seq)
    for step, got in full:
        first, end = schedule.step_range(step)
        np.testing.assert_array_equal(got, windows[perm(np.arange(first, end) % n)])
    for start in range(0, steps, 3):
        rest = run(start)
        assert [s for s, _ in rest] == [s for s, _ in full[start:]]
        for (_, a), (_, b) in zip(rest, full[start:]):
            np.testing.assert_array_equal(a, b)


def _text_config(tmp_path, *, steps, epoch, batch=8):
    """A tiny train_lm run on a local file of 61 sequences of 32 bytes (about 8 steps of 8 per epoch)."""
    from test_train_lm import tiny_config

    path = tmp_path / "train.jsonl"
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(20):
            f.write(json.dumps({"text": "".join(rng.choice(list("abcdefgh "), 97))}) + "\n")
    cfg = tiny_config(tmp_path, steps=steps, batch=batch, steps_per_eval=1000)
    data = dataclasses.replace(cfg.data, train_urls=[str(path)])
    return dataclasses.replace(cfg, data=data, epoch=epoch)


def _epoch_length(cfg) -> int:
    from levanter.main import train_lm

    train = cfg.data.train_set(32, cfg.trainer.batch_schedule, key=train_lm.data_key(cfg), epochs=cfg.epoch)
    assert isinstance(train, EpochDataset)
    return asyncio.run(train.dataset.async_len())


def test_train_lm_refuses_too_few_epochs_before_training(tmp_path):
    from levanter.main import train_lm

    cfg = _text_config(tmp_path, steps=12, epoch=2)
    n = _epoch_length(cfg)
    assert 8 * 12 > n >= 8 * 6  # the 12 steps read into the second epoch
    # Too few epochs: refused before training, with the figures and the epoch that would do.
    for epoch, fix in ((1, "raise epoch to 2"), (0, "set epoch")):
        with pytest.raises(ValueError, match=fix) as e:
            train_lm.main(dataclasses.replace(cfg, epoch=epoch))
        assert f"holds {n:,} sequences" in str(e.value) and "trainer.num_train_steps is 12" in str(e.value)
    assert not list((tmp_path / "ckpt").glob("*/step-*"))


@pytest.mark.slow
def test_train_lm_trains_past_one_epoch(tmp_path, capsys):
    from levanter.main import data_schedule, train_lm

    cfg = _text_config(tmp_path, steps=12, epoch=2)
    n = _epoch_length(cfg)
    out = train_lm.main(cfg)
    assert out["final_step"] == 12
    # The data plan says so: the source wraps at the step holding index n and is read 96 / n times.
    plan = data_schedule.main(cfg)
    (source,) = plan["sources"]
    assert source["length"] == n and source["sequences"] == 96
    assert source["wrap_step"] == n // 8 and source["epochs"] == pytest.approx(96 / n)
    assert "first wrap" in capsys.readouterr().out


def test_epoch_is_checked_before_any_work(tmp_path):
    from levanter.data.config import LMMixtureDatasetConfig
    from levanter.data.source_config import LMDatasetSourceConfig
    from levanter.lm_config import validate

    from test_train_lm import tiny_config

    cfg = tiny_config(tmp_path)
    with pytest.raises(ValueError, match=r"epoch must be a whole number of epochs >= 0.*got -1"):
        validate(dataclasses.replace(cfg, epoch=-1))
    mixture = LMMixtureDatasetConfig(configs={"a": LMDatasetSourceConfig(train_urls=["embedded://python-docs/validation"])},
                                     train_weights={"a": 1.0}, tokenizer="byte", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"epoch=2 applies to a single source .* data.stop_strategy"):
        validate(dataclasses.replace(cfg, data=mixture, epoch=2))


def test_the_data_plan_reports_an_epoch_wrapped_source():
    """The planner sees through the repeat: the source's own length, the step it first wraps at, the epochs
    read, and the end of the data after the last epoch (the loader's rule: the last whole batch)."""
    from levanter.data.planner import plan_data

    ds = ListAsyncDataset(np.arange(20, dtype=np.int64)).shuffle(key=1).epochs(max_epochs=3)
    plan = plan_data(ds, BatchSchedule(8), 10, seq_len=4)
    (source,) = plan.sources
    assert plan.end_step == plan.steps == 7  # 60 sequences: 7 whole batches of 8
    assert source.length == 20 and source.sequences == 56 and source.epochs == pytest.approx(2.8)
    assert source.wrap_step == 2 and source.exhausted_step == 7  # index 20 is in step 2; index 60 ends it
    assert plan_data(ds, BatchSchedule(8), 5, seq_len=4).end_step is None  # 40 sequences: within 3 epochs

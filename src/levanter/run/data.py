"""The data phase of a run: the token caches built (or found), the training and validation sets over them,
and the checks that they cover the run, before the model exists.

Everything here is a function of the config and the data key, so every process (and every resume) builds
the same sets; what the run reads at step *s* is then the loader's business (:mod:`levanter.data.loader`).
The lengths are checked here rather than in :func:`levanter.lm_config.validate` because they need the
caches: a run that the data cannot cover fails before any compile, not at the step where the data ends.
"""

from __future__ import annotations

__all__ = ["RunData", "build_data", "check_data_covers_run"]

import asyncio
import dataclasses
from typing import Dict, Optional

import jax

from levanter.data import seed_from_key
from levanter.data.dataset import AsyncDataset, EpochDataset
from levanter.data.mixture import MixtureDataset
from levanter.data.schedule_record import data_schedule_record
from levanter.distributed import barrier
from levanter.training import check_eval_set_sizes
from levanter.lm_config import TrainLmConfig


@dataclasses.dataclass(frozen=True)
class RunData:
    """A run's data, built: what the loader, the evaluator and the checkpoints' records take."""

    # The training set (a mixture, an epoch-repeated source or one source), indexed by global row.
    train_set: AsyncDataset
    # The validation sets by source name (empty: the run does not evaluate).
    eval_sets: Dict[str, AsyncDataset]
    # The data schedule a checkpoint records (levanter.data.schedule_record), checked on resume.
    record: dict
    # The loader ships tokens alone, and the step derives the loss mask and segment ids from this EOS id;
    # None: the loader ships all three columns.
    eos_id: Optional[int]

    @property
    def mixture(self) -> Optional[MixtureDataset]:
        """The training set if it is a mixture (its sources' counts are logged per step), else None."""
        return self.train_set if isinstance(self.train_set, MixtureDataset) else None

    @property
    def stage_starts(self) -> set:
        """The steps where a mixture's later stages start: the model is evaluated as it stands before the first
        update of each, so that two runs' eval curves part exactly at a switch (periodic evals joined by lines
        make them seem to part early)."""
        mixture = self.mixture
        return set(mixture.stage_start_steps[1:]) if mixture is not None else set()


def build_data(config: TrainLmConfig, schedule, key: jax.Array) -> RunData:
    """The caches built (or found) and the sets over them for ``config``'s data, ``schedule`` its batch
    schedule and ``key`` its data key (:func:`levanter.lm_config.data_key`); refuses training data that ends
    before ``trainer.num_train_steps`` and validation sets smaller than one eval batch."""
    if jax.process_index() == 0:
        # One process builds the caches first; the others then find them finished (on a shared
        # filesystem) or build identical ones of their own (builds are deterministic).
        config.data.build_caches("train")
        config.data.build_caches("validation")
    barrier("levanter-caches-built")
    # The loader ships tokens alone and the step derives loss mask and segment ids on the device (fewer
    # host arrays and transfers per step), which takes one EOS id for every source; caches built with
    # different ones (different tokenizers) keep the three host columns.
    # Chat-format sources ship their own loss masks (only the assistant tokens are trained on).
    eos_ids = config.data.train_eos_ids()
    tokens_only = len(eos_ids) == 1 and not config.data.has_chat_sources()
    train_set = config.data.train_set(config.model.seq_len, schedule, key=key, tokens_only=tokens_only,
                                      epochs=config.epoch)
    eval_sets = config.data.validation_sets(config.model.seq_len)
    check_data_covers_run(config, train_set, schedule)
    check_eval_set_sizes(eval_sets, config.trainer, config.model.seq_len)
    record = data_schedule_record(config.data, schedule, seq_len=config.model.seq_len, data_seed=seed_from_key(key))
    eos_id = next(iter(eos_ids)) if tokens_only else None
    return RunData(train_set, eval_sets, record, eos_id)


def check_data_covers_run(config: TrainLmConfig, train_set: AsyncDataset, schedule) -> None:
    """Refuse a run whose finite training data ends before ``trainer.num_train_steps``: the loader would
    stop early, and the run would end short of what the config asks (a trailing partial batch is never
    trained on, so the data must hold every step's whole batch)."""
    if not train_set.is_finite():
        return
    n = asyncio.run(train_set.async_len())
    steps = config.trainer.num_train_steps
    end = schedule.find_step_containing_offset(n)
    if end >= steps:
        return
    need = schedule.global_data_offset_by_step(steps)
    if isinstance(train_set, MixtureDataset):
        what = f"data.stop_strategy={train_set.stop_strategy}: the mixture ends after {n:,} sequences"
        repeat = "or set data.stop_strategy: restart to wrap sources that run out"
    elif isinstance(train_set, EpochDataset):
        once = asyncio.run(train_set.dataset.async_len())
        epochs = train_set.max_epochs
        needed = -(-need // once)  # ceil: the epochs the run reads into
        what = (f"epoch={epochs}: the training data holds {once:,} sequences of model.seq_len="
                f"{config.model.seq_len} tokens per epoch, {n:,} in {epochs} epochs")
        repeat = f"or raise epoch to {needed} ({need / once:.2f} epochs of the data)"
    else:
        what = f"data: the training data holds {n:,} sequences of model.seq_len={config.model.seq_len} tokens"
        repeat = ("or repeat it: set epoch (the epochs to read), or make it the one source of a mixture "
                  "(data.configs + data.train_weights), whose default stop_strategy restart wraps it")
    raise ValueError(
        f"{what}, enough for {end} steps, but trainer.num_train_steps is {steps} ({need:,} sequences). Add "
        f"training data, lower trainer.num_train_steps to {end}, {repeat}."
    )

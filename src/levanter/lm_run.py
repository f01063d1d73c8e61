"""Running a language-model training from a :class:`~levanter.lm_config.TrainLmConfig`: what ``python -m
levanter.main.train_lm`` and ``python -m levanter.main.sft`` (which maps upstream's fine-tuning config onto
a ``TrainLmConfig``) both run, so that neither entry point imports the other.

``main(config)`` is a plain function (tests call it directly). It validates the whole config before any
expensive work, builds (or finds) the token caches, initialises or restores the state, and hands the
loader's batches (tagged with their step) to :meth:`levanter.training.Trainer.train`, which checks the
tags and checkpoints; the hooks given to it log the metrics and evaluate. Re-running the same command
with the same ``trainer.id`` resumes from the latest complete checkpoint and reproduces the same data and
losses; re-running a run that already reached ``trainer.num_train_steps`` says so and exits 0. A run
without ``trainer.id`` prints the id it generated, with the command that resumes it. A run whose checkpoint
directory is not the one that wrote the metrics in its log directory (another run that used the id) is
refused before any work (:mod:`levanter.tracker.lineage`), and so are ``hf_save_path`` exports that would
replace anything but earlier exports (:mod:`levanter.compat.export_guard`).

What it prints (:mod:`levanter.progress`, docs/guides/trackers.md): a bar on a terminal, else a line
every ``trainer.progress_interval``; every evaluation's losses and an end-of-run summary on stdout; the
details in ``<trainer.log_dir>/<run id>/debug.log``. Ctrl-C (SIGINT) or SIGTERM checkpoints the current
step and exits with status 75; a second Ctrl-C exits at once with 130.

A run either does what its config asks or fails: besides the values themselves, it refuses up front a
model whose training state cannot fit in memory (estimated from shapes), a train step whose compiled
memory exceeds the device's (:mod:`levanter.memory_fit`, where the device's memory is known; that
compile is the run's step), log directories it cannot
write, training data too short for ``trainer.num_train_steps`` and validation sets smaller than one eval
batch; at run time, the state after a step whose loss, gradient norm or update is not finite is never
saved or evaluated, and data that still ends early is an error (exit 1), not a short run that exits 0.

Per step it logs ``train/loss`` (for a mixture of experts, with the weighted router loss, which is also
logged alone as ``train/router_aux_loss``), ``train/learning_rate``, ``train/grad_norm``,
``throughput/tokens_per_second``, ``throughput/step_seconds``, ``throughput/mfu`` (when the device's peak
FLOP/s is known), ``data/wait_seconds``, at a process's first step ``throughput/time_to_first_step_seconds``
(from the process's start: imports, caches, compiles or loads from the persistent compilation cache
(:mod:`levanter.utils.compile_cache`), the step itself) and, for mixtures, ``data/source_counts/<source>``; every
``steps_per_eval`` steps, before the first step of each mixture stage and at the end, for the validation
sources (:mod:`levanter.training.eval`): ``eval/<source>/loss`` and ``eval/<source>/bpb`` (bits per byte), the
micro averages ``eval/loss`` and ``eval/bpb``, the macro averages ``eval/macro_loss`` and
``eval/macro_bpb``, and per tag ``eval/<tag>/loss`` and ``eval/<tag>/bpb`` (plus ``macro_loss`` and
``macro_bpb`` for a tag on several sources). With ``trainer.model_averaging`` the averaged weights are
evaluated too, right after, under ``eval/ema/...`` (upstream's names), and ``hf_save_path`` exports them.

With ``eval_harness`` (:mod:`levanter.eval_harness`, the ``eval`` extra) the lm-evaluation-harness tasks run every
``eval_harness_steps`` steps, before the first step of each mixture stage and at the end: ``lm_eval/<task>/<metric>``
to the trackers, the report as JSON in the run's log directory; their tasks load before any other work.

With ``epoch: N`` a single source's training data repeats up to N times (the same order each time); a run
that needs more is refused with the other data-length checks, before the first step.

:func:`cli_errors` is the entry points' mapping of failures to exit statuses (see ``docs/reference/errors.md``).
"""

from __future__ import annotations

__all__ = [
    "LoraRun",
    "check_data_covers_run",
    "check_data_schedule",
    "check_update_moves",
    "cli_errors",
    "harness_evaluator",
    "make_evaluator",
    "main",
    "run_config_command",
    "say_finished",
    "start_command",
]

import asyncio
import dataclasses
import logging
import os
import contextlib
import sys
from typing import Callable, Dict, Optional

import equinox as eqx
import haliax as hax
import jax
import numpy as np

from levanter.checkpoint import (
    CheckpointSaveError,
    ResumePoint,
    hold_run_lock,
    initialize_from,
    read_checkpoint_metadata,
    restore,
)
from levanter.config import parse_timedelta
from levanter.data.dataset import AsyncDataset, EpochDataset
from levanter.data.load_errors import DataLoadError
from levanter.data.loader import DataLoader, use_prefetch_switch_interval
from levanter.data import seed_from_key
from levanter.data.fingerprint import batch_fingerprint
from levanter.data.mixture import MixtureDataset
from levanter.data.schedule_record import data_schedule_record, first_difference
from levanter.training import Evaluator, check_eval_set_sizes
from levanter.training import make_evaluator as evaluator_for
from levanter.eval_harness.run import results_path
from levanter.errors import OUT_OF_SPACE_EXIT_CODE, OutOfSpaceError, ReadOnlyStorageError
from levanter.distributed import DistributedStartupError, barrier, check_same_config_everywhere
from levanter.tracker import NoopTracker, check_trackers_writable, init_trackers
from levanter.lm_config import TrainLmConfig, data_key, validate
from levanter.lm_config import BranchOrigin, branch_origin, check_branch_model
from levanter.lm_config import check_hf_save_path, hf_exporter, hf_init_path, model_record, model_vocab_size
from levanter.lm_config import check_export_path, export_base
from levanter.lm_config import check_resume_optimizer, optimizer_record
from levanter.lora import LoraConfig, check_checkpoint_lora, join_adapters, loraize, lora_trainable, merge_lora
from levanter.lora import split_adapters
from levanter.lm_config import with_hf_model
from levanter.memory_fit import RECORD_KEY, StepCompiler, fit_trainer, recorded_pick
from levanter.tracker.lineage import check_log_lineage, record_log_lineage
from levanter.training import lm_loss_fn
from levanter.memory_plan import check_memory
from levanter.training import StepProfiler
from levanter.quantization import check_checkpoint_fp8, with_fp8
from levanter.progress import RunProgress, open_debug_log
from levanter.tracker import JsonConfig, TrackerError, metrics_destinations
from levanter.utils import compile_cache, fs
from levanter.utils.flops import peak_flops_per_device
from levanter.training import (
    DataEndedError,
    StepReport,
    StepTally,
    Trainer,
    TrainerConfig,
    TrainHooks,
    check_resume_averaging,
    named_batch,
)

logger = logging.getLogger(__name__)

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


def check_data_schedule(point: ResumePoint, record: dict, *, allow: bool) -> None:
    """Refuse to resume from ``point`` if the data schedule changed before its step (unless ``allow``)."""
    checkpoint_path, start_step = point.path, point.step
    old = point.records.get("data_schedule")
    if old is None:
        logger.warning("checkpoint %s records no data schedule; cannot check the resumed data", checkpoint_path)
        return
    diff = first_difference(old, record)
    if diff is None:
        return
    step, what = diff
    if step < start_step and not allow:
        raise ValueError(
            f"the data schedule changed at step {step} ({what}), before the checkpoint at step {start_step} "
            f"({checkpoint_path}): the resumed run would disagree with the data the checkpointed model was trained "
            "on. Undo the edit, start a new run (another trainer.id), or set allow_data_schedule_change: true "
            "if you mean it."
        )
    logger.warning("data schedule edited from step %d: %s (checkpoint at step %d)", step, what, start_step)


def harness_evaluator(config: TrainLmConfig):
    """The run's ``eval_harness`` tasks (:class:`levanter.eval_harness.HarnessEvaluator`), loaded now so that a
    task that cannot load fails before any other work; None without ``eval_harness``."""
    if config.eval_harness is None:
        return None
    from levanter.eval_harness import HarnessEvaluator

    return HarnessEvaluator(config.eval_harness)


def make_evaluator(config: TrainLmConfig, trainer: Trainer, eval_sets: Dict[str, AsyncDataset], tokenizer,
                   vocab_size: int) -> Evaluator:
    """The evaluator of the run's validation sources (:func:`levanter.training.eval.make_evaluator`)."""
    return evaluator_for(trainer, config.data, eval_sets, tokenizer, vocab_size, config.model.Pos)


@dataclasses.dataclass(frozen=True)
class LoraRun:
    """What a LoRA run (``python -m levanter.main.lora_lm``) adds to its :class:`TrainLmConfig`: the adapters
    (:mod:`levanter.lora`) put on the model built from ``initialize_from_hf``, which alone train, and where
    their exports go."""

    # The adapters: which layers, their rank and scale.
    lora: LoraConfig
    # The base model as the config names it (adapter_config.json's base_model_name_or_path).
    base_model: Optional[str] = None
    # PEFT exports of the adapters: <peft_save_path>/<run id>/step-N.
    peft_save_path: Optional[str] = None
    # Exports of the model with the adapters merged into its weights: <merged_hf_save_path>/<run id>/step-N.
    merged_hf_save_path: Optional[str] = None
    # Steps between both exports (and one at the end).
    save_steps: int = 1000

    def adapt(self, model, key):
        """``model`` with its adapters (drawn from a key of their own)."""
        return loraize(model, self.lora, key=jax.random.fold_in(key, _LORA_KEY))

    def check_model(self, config: TrainLmConfig, vocab_size: int) -> None:
        """Before any work: the adapters can be put on the model (``lora.target_modules`` selects a layer, none
        of them quantized); traced with ``jax.eval_shape``, nothing is allocated."""
        vocab = hax.Axis("vocab", vocab_size)
        jax.eval_shape(lambda k: self.adapt(config.model.build(vocab, key=k), k), jax.random.PRNGKey(0))

    def check_paths(self, config: TrainLmConfig, run_id: str) -> None:
        """Before any work: both exports may replace only earlier exports (:func:`check_export_path`)."""
        for key, path in (("peft_save_path", self.peft_save_path), ("merged_hf_save_path", self.merged_hf_save_path)):
            if path:
                check_export_path(config, run_id, path, key, self.save_steps)

    def exporters(self, config: TrainLmConfig, run_id: str) -> list:
        """The exporters of ``peft_save_path`` and ``merged_hf_save_path`` that are set."""
        from levanter.compat import HfExporter, PeftExporter

        last = config.trainer.num_train_steps
        out = []
        if self.peft_save_path:
            out.append(PeftExporter(export_base(config, self.peft_save_path, run_id), every=self.save_steps,
                                    last_step=last, lora=self.lora, base_model_name_or_path=self.base_model,
                                    tokenizer=config.data.tokenizer))
        if self.merged_hf_save_path:
            out.append(HfExporter(export_base(config, self.merged_hf_save_path, run_id), every=self.save_steps,
                                  last_step=last, config=config.model, tokenizer=config.data.tokenizer,
                                  prepare=merge_lora, key="merged_hf_save_path", exported_by="lora_lm"))
        return out


_LORA_KEY = 1  # folded into the model's key for the adapters' initialisation


def main(config: TrainLmConfig, *, fresh_model: Optional[Callable] = None, lora: Optional[LoraRun] = None) -> dict:
    """Train; returns a summary ``{"run_id", "final_step", "final_loss"}``. ``fresh_model(model, key)``, if
    given, rewrites the model of a run that starts at step 0 (after any initialisation from a checkpoint),
    never that of a resumed one: ``sft``'s ``reinit_tokens``. ``lora``: a LoRA run (``lora_lm``): the
    adapters are built into the model, the Hugging Face weights loaded beneath them, and only they train."""
    config.trainer.distributed.initialize()  # before anything asks JAX about devices
    config.trainer.apply_jax_config()
    use_prefetch_switch_interval()  # the data loader's read-ahead thread hands reads back sooner
    config = with_hf_model(config)  # initialize_from_hf: the model's shape from the checkpoint's config.json
    tokenizer = validate(config)
    if lora is not None:  # the layers lora.target_modules selects, from shapes alone
        lora.check_model(config, model_vocab_size(config, tokenizer))
    check_same_config_everywhere(_config_dict(config))
    tcfg = config.trainer
    run_id = tcfg.run_id()
    if jax.process_count() > 1 and tcfg.id is None:
        raise ValueError("trainer.id must be set in multi-process runs, so that every process names the same run")
    if tcfg.id is None and jax.process_index() == 0:  # else nobody could name the run to resume it
        print(f"run id: {run_id} (generated: trainer.id is not set); rerun with --trainer.id {run_id} to resume it",
              flush=True)
    run_dir = tcfg.checkpointer.validate_writable(run_id)
    tcfg.use_compilation_cache()  # before the run compiles its programs; by default beside the checkpoints
    if jax.process_index() == 0:
        check_trackers_writable(tcfg.trackers(), run_id, tcfg.log_dir)
        # Another run's metrics under this id, and exports over anything but earlier exports: refused before
        # anything is written.
        check_log_lineage(_json_log_dirs(tcfg, run_id), tcfg.checkpointer.expanded_path(run_id), run_id)
        check_hf_save_path(config, run_id)
        if lora is not None:
            lora.check_paths(config, run_id)
        debug_log = open_debug_log(fs.join(tcfg.log_dir, run_id))
        if debug_log is not None:
            logger.debug("debug log of run %s: %s", run_id, debug_log)
    check_memory(config, model_vocab_size(config, tokenizer), adapt=lora.adapt if lora is not None else None,
                 is_trainable=lora_trainable if lora is not None else None)
    # The branch's origin resolved once: the shapes checked here are those of the checkpoint loaded below, even
    # if the origin run writes a newer one meanwhile.
    branch = branch_origin(config)
    check_branch_model(config, model_vocab_size(config, tokenizer), branch)  # a branch's shapes, before any work
    # One writer per run: taken before anything of the run is built, restored, deleted or logged, and
    # released however the run ends (a SIGKILLed run's lock is recognised as stale on its host).
    lock = hold_run_lock(run_dir, run_id, process_index=jax.process_index())
    try:
        # Where the run starts: its checkpoint resolved and its metadata read once (levanter.checkpoint.resume).
        point = tcfg.resume_point(run_id)
        if point is not None and point.finished(tcfg.num_train_steps):
            # before the caches, the model and the trackers: nothing is touched
            say_finished(tcfg, run_id, point.step, point.path)
            return {"run_id": run_id, "final_step": point.step, "final_loss": None}
        check_resume_averaging(point, tcfg)  # trainer.model_averaging as the checkpoint was written
        if point is not None:  # and trainer.quantization's fp8 state, and the LoRA adapters
            where = f"the checkpoint {point.path} (step {point.step})"
            check_checkpoint_fp8(point.records, tcfg.quantization, where)
            check_checkpoint_lora(point.records, lora.lora if lora is not None else None, where)
        check_resume_optimizer(config, point)  # optimizer.skip_bad_steps as the checkpoint was written
        return _main_locked(config, tokenizer, run_id, point, branch, fresh_model, lora)
    finally:
        lock.release()


def say_finished(tcfg: TrainerConfig, run_id: str, step: int, path: Optional[str]) -> None:
    """Print (on the first process) that there is nothing to train, and what to do instead; the run's
    metrics and checkpoints stay as they are, and the command exits 0."""
    if jax.process_index() == 0:
        print(
            f"run {run_id} already reached step {step} >= trainer.num_train_steps={tcfg.num_train_steps} "
            f"(checkpoint {path}); nothing to train. To train it further, raise trainer.num_train_steps; to "
            "start another run, give a new trainer.id.",
            flush=True,
        )


def _main_locked(config: TrainLmConfig, tokenizer, run_id: str, point: Optional[ResumePoint],
                 branch: Optional[BranchOrigin], fresh_model: Optional[Callable] = None,
                 lora: Optional[LoraRun] = None) -> dict:
    """The run itself, under its lock: caches, state (initial, restored from ``point``, or a branch's start
    from ``branch``, its origin as resolved before the lock), the step loop."""
    tcfg = config.trainer
    schedule = tcfg.batch_schedule
    Pos = config.model.Pos
    Vocab = hax.Axis("vocab", model_vocab_size(config, tokenizer))

    key = jax.random.PRNGKey(tcfg.seed)
    model_key = jax.random.split(key, 4)[2]  # (data, loader, model, training), upstream's order
    dkey = data_key(config)

    harness = harness_evaluator(config)  # eval_harness's tasks, loaded before any other work
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
    train_set = config.data.train_set(config.model.seq_len, schedule, key=dkey, tokens_only=tokens_only,
                                      epochs=config.epoch)
    eval_sets = config.data.validation_sets(config.model.seq_len)
    check_data_covers_run(config, train_set, schedule)
    check_eval_set_sizes(eval_sets, tcfg, config.model.seq_len)
    mixture = train_set if isinstance(train_set, MixtureDataset) else None
    # Evaluate the model as it stands before the first update of each new stage, so that two runs'
    # eval curves part exactly at a switch (periodic evals joined by lines make them seem to part early).
    stage_starts = set(mixture.stage_start_steps[1:]) if mixture is not None else set()
    record = data_schedule_record(config.data, schedule, seq_len=config.model.seq_len, data_seed=seed_from_key(dkey))

    optimizer = config.optimizer.build(tcfg.num_train_steps)
    lr_schedule = config.optimizer.host_lr_scheduler(tcfg.num_train_steps)  # no device sync per step
    eos_id = next(iter(eos_ids)) if tokens_only else None
    # The step for the largest batch, compiled ahead of time and checked against the device's memory (it is
    # the run's step then); per_device_parallelism: auto resolved (levanter.memory_fit).
    adapt = lora.adapt if lora is not None else None  # a LoRA run: the adapters, which alone train
    compiler = StepCompiler(config.model, tcfg, optimizer,
                            lm_loss_fn(config.z_loss_weight, eos_id, tcfg.quantization), Vocab.size,
                            adapt=adapt, is_trainable=lora_trainable if lora is not None else None)
    trainer = fit_trainer(compiler, recorded=recorded_pick(tcfg, point))
    picked = {RECORD_KEY: trainer.config.per_device_parallelism} if tcfg.per_device_parallelism == "auto" else {}
    evaluator = make_evaluator(config, trainer, eval_sets, tokenizer, Vocab.size)
    # trainer.quantization.fp8: the layers' scales and histories are part of the model from the start.
    def build(k):
        model = with_fp8(config.model.build(Vocab, key=k), tcfg.quantization)
        return adapt(model, k) if adapt is not None else model

    state = trainer.initial_state(build, key=jax.random.fold_in(model_key, 0))
    state = restore(state, point)
    start_step = int(state.step)
    # A branch (trainer.initialize_from / initialize_from_checkpoint_path) starts from another run's checkpoint
    # at step 0, once: rerun, it resumes from its own checkpoints, which carry the record of its origin. Its
    # data schedule is its own, so the origin's is not checked against it.
    origin = None
    if point is not None:
        check_data_schedule(point, record, allow=config.allow_data_schedule_change)
        origin = point.records.get("initialized_from")
    else:
        if branch is not None:
            state = initialize_from(state, branch.path, optimizer_state=branch.optimizer_state, key=branch.key)
            origin = {"path": branch.path, "step": int(read_checkpoint_metadata(branch.path)["step"]),
                      "optimizer_state": branch.optimizer_state}
        elif hf_init_path(config) is not None:  # weights from a Hugging Face checkpoint; the optimizer's are fresh
            from levanter.compat import load_hf_weights

            if lora is None:
                model = load_hf_weights(state.model, hf_init_path(config))
            else:  # the checkpoint's tensors go beneath the adapters, which are new
                adapters, base = split_adapters(state.model)
                model = join_adapters(load_hf_weights(base, hf_init_path(config)), adapters)
            state = eqx.tree_at(lambda s: s.model, state, model)
            logger.info("loaded the weights of Hugging Face checkpoint %s (the optimizer starts fresh)",
                        hf_init_path(config))
            origin = {"hf_checkpoint": hf_init_path(config)}
        if fresh_model is not None:
            state = eqx.tree_at(lambda s: s.model, state, fresh_model(state.model, jax.random.fold_in(model_key, 1)))
        if origin is not None:  # trainer.model_averaging: averaged from the weights the branch starts from
            state = trainer.restart_average(state)

    # The run that wrote the checkpoint evaluated its state at this step (its last step, say, which a run
    # raising num_train_steps resumes from): the trackers drop that eval with the records of the steps the
    # resumed run redoes, so it is redone, as the trainer redoes one at a resumed step this run evaluates at.
    redo_eval_at = start_step if point is not None and _evaluated_at(point, start_step, stage_starts) else None
    if jax.process_index() == 0:
        record_log_lineage(_json_log_dirs(tcfg, run_id), tcfg.checkpointer.expanded_path(run_id))
        # resume_step=0 on a fresh start too: lines an earlier attempt logged without checkpointing are dropped.
        tracker = init_trackers(tcfg.trackers(), run_id, tcfg.log_dir, resume_step=start_step)
    else:
        tracker = NoopTracker()  # one writer: every process computes the same (global) metrics
    tracker.log_hyperparameters({**_config_dict(config), **({"initialized_from": origin} if origin else {})})
    checkpointer = tcfg.checkpointer.create(
        run_id,
        metadata={"data_schedule": record, **model_record(config, Vocab.size, lora.lora if lora else None),
                  **optimizer_record(config), **picked, **_eval_record(tcfg, eval_sets),
                  **({"initialized_from": origin} if origin else {})},
        barrier=barrier if jax.process_count() > 1 else None,
        process_index=jax.process_index(),
    )
    # A run resumed from a checkpoint finds the metrics of every step before it, also where the tracker
    # buffers (the JSON tracker on an object store uploads its file at a flush, not per line).
    checkpointer.before_save = tracker.flush
    exporter = hf_exporter(config, run_id)  # hf_save_path: step-N exports beside the checkpoints
    if exporter is not None:
        checkpointer = exporter.wrap(checkpointer)
    if lora is not None:  # peft_save_path and merged_hf_save_path
        for extra in lora.exporters(config, run_id):
            checkpointer = extra.wrap(checkpointer)
        _log_trainable(trainer, state.model, tracker)
    loader = DataLoader(train_set, schedule, mesh=trainer.mesh, data_axis="data", prefetch_depth=config.prefetch_depth,
                        provenance=True)
    flops_per_token = config.model.flops_per_token(Vocab.size)
    peak = peak_flops_per_device(jax.devices()[0])
    profiler = StepProfiler(tcfg, run_id)  # trainer.profiler: a jax.profiler trace of a window of steps
    progress = RunProgress(tcfg.num_train_steps, start_step,
                           interval_s=parse_timedelta(tcfg.progress_interval).total_seconds(),
                           enabled=jax.process_index() == 0)
    last_loss = None
    skipping_spikes = bool(config.optimizer.skip_bad_steps)
    tally = StepTally()  # skipped steps and updates too small to count, for the summary

    class Hooks(TrainHooks):
        def on_step(self, r: StepReport) -> None:
            nonlocal last_loss
            step, batch, dt = r.step, r.batch, r.seconds
            if r.skipped and skipping_spikes and np.isfinite(r.loss) and np.isfinite(r.grad_norm):
                logger.warning("step %d: loss %.4g or gradient norm %.4g is a spike against the recent steps: "
                               "the update was skipped (optimizer.skip_bad_steps)", step, r.loss, r.grad_norm)
            check_update_moves(r, lr_schedule(step), config.optimizer)
            tally.add(r)
            tokens = batch.batch_size * Pos.size
            log = {
                "train/loss": r.loss,
                "train/learning_rate": lr_schedule(step),
                "train/grad_norm": r.grad_norm,
                "train/skipped_step": int(r.skipped),
                "throughput/step_seconds": dt,
                "throughput/tokens_per_second": tokens / dt,
                "throughput/examples_per_second": batch.batch_size / dt,
                "data/wait_seconds": batch.wait_seconds,
            }
            for name, value in r.extra.items():  # e.g. train/router_aux_loss
                log[f"train/{name}"] = value
            if peak is not None:
                log["throughput/mfu"] = flops_per_token * tokens / dt / (peak * jax.device_count())
            # The step's provenance (which source and row each sequence came from), read by the loader.
            prov = batch.provenance
            content = None
            if config.fingerprint_tokens and batch.data["tokens"].is_fully_addressable:
                content = np.asarray(batch.data["tokens"])
            log["data/fingerprint"] = batch_fingerprint(prov, content)
            if mixture is not None:
                counts = batch.source_counts(len(mixture.names))
                for name, c in zip(mixture.names, counts.tolist()):
                    log[f"data/source_counts/{name}"] = c
            last_loss = r.loss
            progress.step(step, r.loss, tokens, dt, batch.wait_seconds)
            if progress.steps_done == 1:  # this process's first step: how long start-up and compiling took
                log["throughput/time_to_first_step_seconds"] = progress.time_to_first_step
            tracker.log(log, step=step)
            profiler.after_step(step)

        def validation_due(self, done: int) -> bool:
            return bool(eval_sets) and (
                done % tcfg.steps_per_eval == 0 or done == tcfg.num_train_steps or done in stage_starts
                or done == redo_eval_at
            )

        def harness_due(self, done: int) -> bool:
            return harness is not None and (
                done % config.eval_harness_steps == 0 or done == tcfg.num_train_steps or done in stage_starts
            )

        def is_eval_step(self, done: int) -> bool:
            return self.validation_due(done) or self.harness_due(done)

        def evaluate(self, model, done: int) -> None:
            if self.validation_due(done):
                losses = evaluator.evaluate(model).metrics()  # the eval/... metrics (levanter.training.eval)
                tracker.log(losses, step=done)
                progress.eval(done, losses)
            if self.harness_due(done) and tcfg.model_averaging is None:
                self.run_harness(model, done)

        def evaluate_averaged(self, model, done: int) -> None:
            # trainer.model_averaging: the averaged weights, as upstream logs them (eval/ema/...).
            if self.validation_due(done):
                losses = evaluator.evaluate(model).metrics(prefix="eval/ema")
                tracker.log(losses, step=done)
                progress.eval(done, losses)
            if self.harness_due(done):  # upstream runs the harness on the averaged weights where there are any
                self.run_harness(model, done)

        def run_harness(self, model, done: int) -> None:
            # lm_eval/<task>/<metric>, and the report as JSON; rows of max_eval_length (else model.seq_len)
            # positions, batches of trainer.eval_batch_size rows.
            report = harness.evaluate(model, trainer, tokenizer, batch_size=tcfg.eval_batch_size,
                                      length=config.eval_harness.max_eval_length or config.model.seq_len)
            path = results_path(tcfg.log_dir, run_id, done) if jax.process_index() == 0 else None
            harness.log(report, tracker, done, path)

        def on_preempt(self) -> None:
            tracker.finish()

    def to_named(data):
        return named_batch(data, Pos, tcfg.batch_axis)

    try:
        profiler.before_step(start_step)
        with progress.logging_around_bar(), loader.iter_from_step(start_step, tcfg.num_train_steps) as it:
            state = trainer.train(state, it, to_named=to_named, checkpointer=checkpointer, hooks=Hooks())
        final_step = int(state.step)
        skips = {"skipped_steps/non_finite": tally.non_finite, "skipped_steps/spikes": tally.spikes}
        tracker.log_summary({"final_step": final_step, **({"train/loss": last_loss} if last_loss is not None else {}),
                             **({"time_to_first_step_seconds": progress.time_to_first_step}
                                if progress.time_to_first_step is not None else {}),
                             **{k: v for k, v in skips.items() if v}})
        warnings = tally.warnings()
        for w in warnings:  # printed in the summary; recorded in the debug log
            logger.debug("run summary warning: %s", w)
        progress.summary(final_step=final_step, where=_where(tcfg, run_id, checkpointer), warnings=warnings)
        failure = tally.failure()
        if failure is not None:  # most steps skipped as non-finite: the run did not train (exit 1)
            raise FloatingPointError(failure)
    finally:
        profiler.stop()
        progress.close()
        tracker.finish()
    return {"run_id": run_id, "final_step": int(state.step), "final_loss": last_loss}


def _eval_record(tcfg: TrainerConfig, eval_sets: Dict[str, AsyncDataset]) -> dict:
    """What a checkpoint records of when its run evaluated (every ``steps_per_eval`` steps, at
    ``num_train_steps`` and at the mixture's stage starts, which the data schedule records): a resumed run
    redoes the eval of the step it resumes at where the run that wrote it evaluated there."""
    if not eval_sets:
        return {}
    return {"evals": {"steps_per_eval": tcfg.steps_per_eval, "num_train_steps": tcfg.num_train_steps}}


def _evaluated_at(point: ResumePoint, step: int, stage_starts) -> bool:
    """Whether the run that wrote ``point`` evaluated the state after ``step`` updates (from its record; a
    checkpoint without one says nothing, and its run's evals at this step are redone only where this run
    evaluates anyway)."""
    evals = point.records.get("evals")
    if not isinstance(evals, dict):
        return False
    every, last = evals.get("steps_per_eval"), evals.get("num_train_steps")
    return step == last or step in stage_starts or (isinstance(every, int) and every > 0 and step % every == 0)


def check_update_moves(r: StepReport, lr: float, optimizer) -> None:
    """Stop the run at a step whose update was applied but is too small to change the parameters (below
    :data:`levanter.training.VANISHING_UPDATE_RATIO` of their norm) although the step had a gradient and the
    schedule's learning rate ``lr`` was not near its warmup's start or decay's end: the settings make every
    update vanish (a huge ``optimizer.epsilon``, a learning rate of 0 or 1e-20), and the run would train
    nothing and exit 0. ValueError (exit 2) naming the key; the state after the step is not saved."""
    peak = float(optimizer.learning_rate)
    if not r.update_vanished or r.non_finite or not r.grad_norm > 0:
        return
    if peak > 0 and lr < 1e-3 * peak:  # the start of the warmup, the end of a decay: small by design
        return
    eps = getattr(optimizer, "epsilon", None)
    if eps is not None and eps >= 1:
        fix = (f"optimizer.epsilon={eps:g} drowns the gradient (Adam's update is m / (sqrt(v) + epsilon)): use a "
               "small epsilon, 1e-8 is usual")
    elif peak == 0:
        fix = "optimizer.learning_rate is 0: set a positive learning rate"
    else:
        fix = (f"raise optimizer.learning_rate={peak:g}" + (f" or lower optimizer.epsilon={eps:g}" if eps else ""))
    raise ValueError(
        f"the update at step {r.step} is {r.update_ratio:.1e} of the parameters' norm (update norm "
        f"{r.update_norm:.3g}, parameters {r.param_norm:.3g}, train/grad_norm {r.grad_norm:.3g}, learning rate "
        f"{lr:.3g}): too small to change float32 parameters, so the run would train nothing; training stopped "
        f"and the state after this step was not saved. {fix}."
    )


def _log_trainable(trainer: Trainer, model, tracker) -> None:
    """The parameter counts of a run that trains part of its model (upstream's summary names)."""
    total = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    trained = sum(x.size for x in jax.tree.leaves(trainer.trained(model)))
    tracker.log_summary({"parameter_count": total, "trainable_parameter_count": trained,
                         "fraction_trainable": trained / max(total, 1)})
    logger.info("parameters: %d, of which %d train (%.3e)", total, trained, trained / max(total, 1))


def _where(tcfg: TrainerConfig, run_id: str, checkpointer) -> list:
    """Lines of the run summary saying where its metrics, checkpoints and debug log went."""
    out = metrics_destinations(tcfg.trackers(), run_id, tcfg.log_dir)
    out.append(f"checkpoints: {getattr(checkpointer, 'base_path', tcfg.checkpointer.expanded_path(run_id))}")
    log = fs.join(tcfg.log_dir, run_id, "debug.log")
    if not fs.is_url(log) and os.path.exists(log):
        out.append(f"debug log: {log}")
    cache = compile_cache.cache_stats().summary()  # trainer.jax_compilation_cache_dir: what it held for this run
    if cache is not None:
        out.append(cache)
    return out


def _json_log_dirs(tcfg: TrainerConfig, run_id: str) -> list:
    """``(config key, directory)`` of each JSON tracker's metrics: the log directories a resume rewrites."""
    return [d for c in tcfg.trackers() if isinstance(c, JsonConfig) for d in c.local_dirs(run_id, tcfg.log_dir)]


def _config_dict(config) -> dict:
    import draccus

    try:
        return draccus.encode(config)
    except Exception:  # noqa: BLE001 -- hyperparameters are best effort, never a reason to fail
        return {}


@contextlib.contextmanager
def cli_errors(interrupted: str = "interrupted before training started: nothing was saved"):
    """Around an entry point's work: user errors (bad config values, missing or damaged files) print one
    ``error:`` paragraph and exit with status 2; a full disk or a read-only filesystem exits with 74; run
    failures (a coordinator that never answered, unreadable data, a NaN loss, a failed save) exit with 1;
    Ctrl-C before the step loop prints ``interrupted`` and exits with 130. None prints a traceback (``docs/reference/errors.md``)."""
    from levanter.memory_fit import device_oom_as_error

    try:
        with device_oom_as_error():  # a device out of memory the up-front check did not foresee: exit 2
            yield
    except (OutOfSpaceError, ReadOnlyStorageError) as e:  # a full disk or read-only storage: fix it and rerun
        print(f"error: {e}", file=sys.stderr)
        sys.exit(OUT_OF_SPACE_EXIT_CODE)
    except (ValueError, FileNotFoundError) as e:  # bad config or input: fix it and rerun
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before the step loop (which checkpoints on it) or while it cleans up
        print(interrupted, file=sys.stderr)
        sys.exit(130)
    except (DistributedStartupError, DataLoadError, DataEndedError, FloatingPointError,
            CheckpointSaveError, TrackerError) as e:
        # the run failed (a coordinator that never answered, unreadable data, a NaN loss, a failed save)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def run_config_command(module_name: str, cli_main: Callable, argv=None) -> None:
    """The command line of an entry point whose work is ``cli_main`` (a :func:`levanter.config.main`
    function): ``--help`` (or ``-h``) prints the keys of the config of ``module_name``'s ``cli_main`` and
    exits 0; anything else is parsed and run under :func:`cli_errors`."""
    import levanter.config

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        levanter.config.print_help(sys.modules[module_name])
        sys.exit(0)
    with cli_errors():
        cli_main(argv=argv)


def start_command(cli: Callable[[], None]) -> None:
    """What ``python -m levanter.main.<entry>`` does once imported: console logging (levanter's INFO on the
    console, every record in the run's debug log), a debug line when the process re-executed itself for
    huge-page malloc (:mod:`levanter.utils.malloc`), then ``cli()``."""
    from levanter.progress import setup_console_logging
    from levanter.utils.malloc import MARKER

    setup_console_logging()
    if os.environ.get(MARKER) == "1":
        logger.debug("re-executed with GLIBC_TUNABLES=%s (levanter/utils/malloc.py; LEVANTER_MALLOC_HUGETLB=0 "
                     "turns this off)", os.environ.get("GLIBC_TUNABLES"))
    cli()

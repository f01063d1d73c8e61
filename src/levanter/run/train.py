"""The run builder: :func:`main` checks the whole config before any expensive work, takes the run lock,
finds where the run starts, then builds the run in phases -- its data (:mod:`levanter.run.data`), its
trainer and starting state (:mod:`levanter.run.state`), its trackers, checkpointer, exports, profiler and
hooks (:mod:`levanter.run.hooks`, :mod:`levanter.run.tracking`, :mod:`levanter.run.exports`) -- and runs the
step loop (:meth:`levanter.training.Trainer.train`), then the end-of-run summary.

The phases run in a fixed order, and each takes only what the ones before it built, so that every
refusal that needs no data comes before the caches, every one that needs no compile before the first
compile, and nothing of the run is written before every check has passed.
"""

from __future__ import annotations

__all__ = ["main", "say_finished"]

import logging
from typing import Callable, Optional

import haliax as hax
import jax

from levanter.checkpoint import ResumePoint, hold_run_lock
from levanter.config import parse_timedelta
from levanter.data.loader import DataLoader, use_prefetch_switch_interval
from levanter.distributed import barrier, check_same_config_everywhere
from levanter.lm_config import BranchOrigin, TrainLmConfig, branch_origin, check_branch_model, data_key
from levanter.lm_config import model_vocab_size, validate, with_hf_model
from levanter.lora import lora_trainable
from levanter.memory import check_memory
from levanter.training import StepProfiler
from levanter.progress import RunProgress, open_debug_log
from levanter.run.data import build_data
from levanter.run.exports import check_hf_save_path, hf_exporter, with_exporters
from levanter.run.hooks import RunHooks, harness_evaluator, make_evaluator
from levanter.run.lora import LoraRun
from levanter.run.records import check_data_schedule, check_resume, eval_record, evaluated_at, model_record
from levanter.run.records import optimizer_record
from levanter.run.state import fit_run_trainer, start_state
from levanter.run.tracking import check_log_dirs, config_dict, open_tracker, summary_lines
from levanter.training import TrainerConfig, named_batch
from levanter.utils import fs

logger = logging.getLogger(__name__)


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
    check_same_config_everywhere(config_dict(config))
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
        _check_outputs(config, run_id, lora)
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
        # trainer.model_averaging, fp8, the LoRA adapters, optimizer.skip_bad_steps: as the checkpoint was written
        check_resume(config, point, lora.lora if lora is not None else None)
        return _main_locked(config, tokenizer, run_id, point, branch, fresh_model, lora)
    finally:
        lock.release()


def _check_outputs(config: TrainLmConfig, run_id: str, lora: Optional[LoraRun]) -> None:
    """On the first process, before any work: the trackers can write; another run's metrics under this id, and
    exports over anything but earlier exports, are refused before anything is written; the debug log opens."""
    tcfg = config.trainer
    check_log_dirs(tcfg, run_id)
    check_hf_save_path(config, run_id)
    if lora is not None:
        lora.check_paths(config, run_id)
    debug_log = open_debug_log(fs.join(tcfg.log_dir, run_id))
    if debug_log is not None:
        logger.debug("debug log of run %s: %s", run_id, debug_log)


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
    """The run itself, under its lock: its data, its state (initial, restored from ``point``, or a branch's
    start from ``branch``, its origin as resolved before the lock), its outputs, the step loop."""
    tcfg = config.trainer
    schedule = tcfg.batch_schedule
    Vocab = hax.Axis("vocab", model_vocab_size(config, tokenizer))
    # The seed's keys are (data, loader, model, training), in upstream's order.
    model_key = jax.random.split(jax.random.PRNGKey(tcfg.seed), 4)[2]
    harness = harness_evaluator(config)  # eval_harness's tasks, loaded before any other work
    data = build_data(config, schedule, data_key(config))
    trainer, picked = fit_run_trainer(config, Vocab.size, data.eos_id, point, lora)
    evaluator = make_evaluator(config, trainer, data.eval_sets, tokenizer, Vocab.size)
    state, origin = start_state(config, trainer, Vocab, model_key, point, branch, fresh_model, lora)
    if point is not None:
        check_data_schedule(point, data.record, allow=config.allow_data_schedule_change)
    start_step = int(state.step)
    # The run that wrote the checkpoint evaluated its state at this step (its last step, say, which a run
    # raising num_train_steps resumes from): the trackers drop that eval with the records of the steps the
    # resumed run redoes, so it is redone, as the trainer redoes one at a resumed step this run evaluates at.
    redo_eval_at = start_step if point is not None and evaluated_at(point, start_step, data.stage_starts) else None
    tracker = open_tracker(config, run_id, start_step, origin)
    checkpointer = tcfg.checkpointer.create(
        run_id,
        metadata={"data_schedule": data.record, **model_record(config, Vocab.size, lora.lora if lora else None),
                  **optimizer_record(config), **picked, **eval_record(tcfg, data.eval_sets),
                  **({"initialized_from": origin} if origin else {})},
        barrier=barrier if jax.process_count() > 1 else None,
        process_index=jax.process_index(),
    )
    # A run resumed from a checkpoint finds the metrics of every step before it, also where the tracker
    # buffers (the JSON tracker on an object store uploads its file at a flush, not per line).
    checkpointer.before_save = tracker.flush
    checkpoint_path = checkpointer.base_path
    exporter = hf_exporter(config, run_id)  # hf_save_path: step-N exports beside the checkpoints
    # and a LoRA run's peft_save_path and merged_hf_save_path
    checkpointer = with_exporters(checkpointer, ([exporter] if exporter is not None else [])
                                  + (lora.exporters(config, run_id) if lora is not None else []))
    if lora is not None:
        lora.log_trainable(trainer, state.model, tracker)
    loader = DataLoader(data.train_set, schedule, mesh=trainer.mesh, data_axis="data",
                        prefetch_depth=config.prefetch_depth, provenance=True)
    profiler = StepProfiler(tcfg, run_id)  # trainer.profiler: a jax.profiler trace of a window of steps
    progress = RunProgress(tcfg.num_train_steps, start_step,
                           interval_s=parse_timedelta(tcfg.progress_interval).total_seconds(),
                           enabled=jax.process_index() == 0)
    hooks = RunHooks(config, run_id, trainer, tokenizer, data, evaluator, harness, tracker, progress, profiler,
                     vocab_size=Vocab.size, redo_eval_at=redo_eval_at)
    final_step = _train(config, run_id, state, loader, checkpointer, hooks, checkpoint_path)
    return {"run_id": run_id, "final_step": final_step, "final_loss": hooks.last_loss}


def _train(config: TrainLmConfig, run_id: str, state, loader: DataLoader, checkpointer, hooks: RunHooks,
           checkpoint_path: str) -> int:
    """The step loop from ``state``'s step to ``trainer.num_train_steps``, then the summary (to the trackers and
    the console; a run that skipped most steps as non-finite fails here, exit 1); returns the final step.
    The profiler, the progress bar and the trackers are closed however the loop ends."""
    tcfg, progress, tracker, tally = config.trainer, hooks.progress, hooks.tracker, hooks.tally
    Pos, start_step = config.model.Pos, int(state.step)

    def to_named(data):
        return named_batch(data, Pos, tcfg.batch_axis)

    try:
        hooks.profiler.before_step(start_step)
        with progress.logging_around_bar(), loader.iter_from_step(start_step, tcfg.num_train_steps) as it:
            state = hooks.trainer.train(state, it, to_named=to_named, checkpointer=checkpointer, hooks=hooks)
        final_step = int(state.step)
        skips = {"skipped_steps/non_finite": tally.non_finite, "skipped_steps/spikes": tally.spikes}
        last_loss = hooks.last_loss
        tracker.log_summary({"final_step": final_step, **({"train/loss": last_loss} if last_loss is not None else {}),
                             **({"time_to_first_step_seconds": progress.time_to_first_step}
                                if progress.time_to_first_step is not None else {}),
                             **{k: v for k, v in skips.items() if v}})
        warnings = tally.warnings()
        for w in warnings:  # printed in the summary; recorded in the debug log
            logger.debug("run summary warning: %s", w)
        where = summary_lines(tcfg, run_id, checkpoint_path)
        progress.summary(final_step=final_step, where=where, warnings=warnings)
        failure = tally.failure()
        if failure is not None:  # most steps skipped as non-finite: the run did not train (exit 1)
            raise FloatingPointError(failure)
    finally:
        hooks.profiler.stop()
        progress.close()
        tracker.finish()
    return final_step

"""What a run does around each step of :meth:`levanter.training.Trainer.train`: the step's metrics, the
evaluations on the validation sources and the lm-evaluation-harness tasks, the progress lines.

:class:`RunHooks` is the run's :class:`levanter.training.TrainHooks`; the trainer decides when a step ends,
the hooks what is logged and evaluated then. It also stops a run whose updates are too small to change the
parameters (:func:`check_update_moves`), which the trainer cannot judge without the config's learning rate
and epsilon.
"""

from __future__ import annotations

__all__ = ["RunHooks", "check_update_moves", "harness_evaluator", "make_evaluator"]

import logging
from typing import Dict, Optional, Protocol, runtime_checkable

import jax
import numpy as np

from levanter.data.dataset import AsyncDataset
from levanter.data.fingerprint import batch_fingerprint
from levanter.training import Evaluator
from levanter.training import make_evaluator as evaluator_for
from levanter.eval_harness.run import results_path
from levanter.lm_config import TrainLmConfig
from levanter.run.data import RunData
from levanter.training import StepReport, StepTally, Trainer, TrainHooks
from levanter.utils.flops import peak_flops_per_device

logger = logging.getLogger(__name__)


def harness_evaluator(config: TrainLmConfig):
    """The run's ``eval_harness`` tasks (:class:`levanter.eval_harness.HarnessEvaluator`), loaded now so that a
    task that cannot load fails before any other work; None without ``eval_harness``."""
    if config.eval_harness is None:
        return None
    from levanter.eval_harness import HarnessEvaluator

    return HarnessEvaluator(config.eval_harness)


def make_evaluator(config: TrainLmConfig, trainer: Trainer, eval_sets: Dict[str, AsyncDataset], tokenizer,
                   vocab_size: int) -> Evaluator:
    """The evaluator of the run's validation sources (:func:`levanter.training.make_evaluator`)."""
    return evaluator_for(trainer, config.data, eval_sets, tokenizer, vocab_size, config.model.Pos)


@runtime_checkable
class _HasEpsilon(Protocol):
    """An optimizer config whose update divides by ``sqrt(v) + epsilon`` (Adam, Muon's AdamW group)."""

    epsilon: float


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
    eps = optimizer.epsilon if isinstance(optimizer, _HasEpsilon) else None
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


class RunHooks(TrainHooks):
    """The run's hooks: per step ``train/*``, ``throughput/*`` and ``data/*`` metrics to the tracker and the
    progress line; evaluations every ``trainer.steps_per_eval`` steps, at the end, at each mixture stage's
    start and at ``redo_eval_at`` (a resumed step whose evaluation the checkpoint's run made); the harness's
    tasks every ``eval_harness_steps`` steps. :attr:`last_loss` and :attr:`tally` are what the run's summary
    reports."""

    def __init__(self, config: TrainLmConfig, run_id: str, trainer: Trainer, tokenizer, data: RunData,
                 evaluator: Evaluator, harness, tracker, progress, profiler, *, vocab_size: int,
                 redo_eval_at: Optional[int]):
        self.config, self.tcfg, self.run_id = config, config.trainer, run_id
        self.trainer, self.tokenizer, self.positions = trainer, tokenizer, config.model.Pos.size
        self.data, self.evaluator, self.harness = data, evaluator, harness
        self.tracker, self.progress, self.profiler = tracker, progress, profiler
        self.redo_eval_at, self.stage_starts, self.mixture = redo_eval_at, data.stage_starts, data.mixture
        self.lr_schedule = config.optimizer.host_lr_scheduler(self.tcfg.num_train_steps)  # no device sync per step
        self.flops_per_token = config.model.flops_per_token(vocab_size)
        self.peak = peak_flops_per_device(jax.devices()[0])
        self.skipping_spikes = bool(config.optimizer.skip_bad_steps)
        self.tally = StepTally()  # skipped steps and updates too small to count, for the summary
        self.last_loss: Optional[float] = None

    def on_step(self, r: StepReport) -> None:
        step, batch, dt = r.step, r.batch, r.seconds
        if r.skipped and self.skipping_spikes and np.isfinite(r.loss) and np.isfinite(r.grad_norm):
            logger.warning("step %d: loss %.4g or gradient norm %.4g is a spike against the recent steps: "
                           "the update was skipped (optimizer.skip_bad_steps)", step, r.loss, r.grad_norm)
        check_update_moves(r, self.lr_schedule(step), self.config.optimizer)
        self.tally.add(r)
        tokens = batch.batch_size * self.positions
        log = {
            "train/loss": r.loss,
            "train/learning_rate": self.lr_schedule(step),
            "train/grad_norm": r.grad_norm,
            "train/skipped_step": int(r.skipped),
            "throughput/step_seconds": dt,
            "throughput/tokens_per_second": tokens / dt,
            "throughput/examples_per_second": batch.batch_size / dt,
            "data/wait_seconds": batch.wait_seconds,
        }
        for name, value in r.extra.items():  # e.g. train/router_aux_loss
            log[f"train/{name}"] = value
        if self.peak is not None:
            log["throughput/mfu"] = self.flops_per_token * tokens / dt / (self.peak * jax.device_count())
        log.update(self.data_metrics(batch))
        self.last_loss = r.loss
        self.progress.step(step, r.loss, tokens, dt, batch.wait_seconds)
        if self.progress.steps_done == 1:  # this process's first step: how long start-up and compiling took
            log["throughput/time_to_first_step_seconds"] = self.progress.time_to_first_step
        self.tracker.log(log, step=step)
        self.profiler.after_step(step)

    def data_metrics(self, batch) -> dict:
        """``data/fingerprint`` and, for a mixture, ``data/source_counts/<source>``: from the step's provenance
        (which source and row each sequence came from), read by the loader."""
        prov = batch.provenance
        content = None
        if self.config.fingerprint_tokens and batch.data["tokens"].is_fully_addressable:
            content = np.asarray(batch.data["tokens"])
        log = {"data/fingerprint": batch_fingerprint(prov, content)}
        if self.mixture is not None:
            counts = batch.source_counts(len(self.mixture.names))
            for name, c in zip(self.mixture.names, counts.tolist()):
                log[f"data/source_counts/{name}"] = c
        return log

    def validation_due(self, done: int) -> bool:
        tcfg = self.tcfg
        return bool(self.data.eval_sets) and (
            done % tcfg.steps_per_eval == 0 or done == tcfg.num_train_steps or done in self.stage_starts
            or done == self.redo_eval_at
        )

    def harness_due(self, done: int) -> bool:
        return self.harness is not None and (
            done % self.config.eval_harness_steps == 0 or done == self.tcfg.num_train_steps
            or done in self.stage_starts
        )

    def is_eval_step(self, done: int) -> bool:
        return self.validation_due(done) or self.harness_due(done)

    def evaluate(self, model, done: int) -> None:
        if self.validation_due(done):
            losses = self.evaluator.evaluate(model).metrics()  # the eval/... metrics (levanter.training.eval)
            self.tracker.log(losses, step=done)
            self.progress.eval(done, losses)
        if self.harness_due(done) and self.tcfg.model_averaging is None:
            self.run_harness(model, done)

    def evaluate_averaged(self, model, done: int) -> None:
        # trainer.model_averaging: the averaged weights, as upstream logs them (eval/ema/...).
        if self.validation_due(done):
            losses = self.evaluator.evaluate(model).metrics(prefix="eval/ema")
            self.tracker.log(losses, step=done)
            self.progress.eval(done, losses)
        if self.harness_due(done):  # upstream runs the harness on the averaged weights where there are any
            self.run_harness(model, done)

    def run_harness(self, model, done: int) -> None:
        # lm_eval/<task>/<metric>, and the report as JSON; rows of max_eval_length (else model.seq_len)
        # positions, batches of trainer.eval_batch_size rows.
        tcfg, config = self.tcfg, self.config
        report = self.harness.evaluate(model, self.trainer, self.tokenizer, batch_size=tcfg.eval_batch_size,
                                       length=config.eval_harness.max_eval_length or config.model.seq_len)
        path = results_path(tcfg.log_dir, self.run_id, done) if jax.process_index() == 0 else None
        self.harness.log(report, self.tracker, done, path)

    def on_preempt(self) -> None:
        self.tracker.finish()

"""The step loop (:meth:`levanter.training.Trainer.train` runs it): batches in step order through the
compiled step, and around each step the checks, the hooks, the evaluations, the checkpoints and the exits.

The loop is where the fork's promise is enforced: the data loader yields batches tagged with their step,
and the loop refuses (loudly, :func:`check_step`) a batch whose step differs from the number of updates
made. It reads each step's metrics after dispatching the next step, so that the device never waits on the
host's per-step work (see :class:`StepLoop` for where it does not, and why nothing observable changes).

What it needs of the others is declared, not guessed: of the trainer, its compiled steps and how many
executables they hold (:class:`CompiledSteps`); of a checkpointer, :class:`Checkpointing`, and where one
says before a step whether it will save after it, :class:`ScheduledCheckpointing` (``save_due``; one
without it counts as saving after every step).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, Optional, Protocol, Tuple, runtime_checkable

import jax

from ..data.loader import Batch
from ..utils.fault import fault_point
from .config import TrainerConfig
from .report import StepReport, check_finite
from .signals import PREEMPTED_EXIT_CODE, StopAgreement, StopSignals
from .state import TrainerState

logger = logging.getLogger(__name__)


class Checkpointing(Protocol):
    """What the loop needs of a checkpointer (:class:`levanter.checkpoint.Checkpointer` is one)."""

    def on_step(self, state: TrainerState, step: int, *, force: bool = False) -> Any:
        """After ``step`` updates: save ``state`` if the policy (or ``force``) says so."""

    def wait_until_finished(self) -> None:
        """Wait for the save in flight; raise its error if it failed."""


@runtime_checkable
class ScheduledCheckpointing(Checkpointing, Protocol):
    """A checkpointer that says, before a step is dispatched, whether it will save after it (the loop then
    finishes that step before dispatching the next, whose dispatch donates the state), and where it writes."""

    base_path: str

    def save_due(self, step: int, *, force: bool = False) -> bool:
        """Whether :meth:`on_step` will save after ``step`` updates (a failed background write is raised here)."""


class CompiledSteps(Protocol):
    """What the loop needs of the trainer: the compiled step, and how many executables it holds."""

    def train_step(self, state: TrainerState, batch: Any, batch_size: int) -> tuple[TrainerState, Any]:
        """Dispatch one step of ``batch_size`` sequences."""

    def compile_count(self) -> int:
        """Compiled executables of the train step so far."""


class StepMismatchError(RuntimeError):
    """The loader handed the trainer a batch for a step other than the state's."""


class DataEndedError(RuntimeError):
    """The training data ran out before ``trainer.num_train_steps``: the run did not do what was asked."""


def check_step(batch: Batch, state_step: int) -> None:
    if batch.step != state_step:
        raise StepMismatchError(
            f"the data loader yielded the batch of step {batch.step} but the trainer is at step {state_step}: "
            "data and updates are out of step"
        )


class TrainHooks:
    """What a run does around :meth:`Trainer.train`'s steps (logging, evaluation); no-ops by default."""

    def on_step(self, report: StepReport) -> None:
        """After each step's checks, before its evaluation and checkpoint; usually while the next step
        runs (:meth:`Trainer.train` reads metrics one step late)."""

    def is_eval_step(self, step: int) -> bool:
        """Whether to evaluate the model after ``step`` updates."""
        return False

    def evaluate(self, model, step: int) -> None:
        """Evaluate ``model`` as it stands after ``step`` updates."""

    def evaluate_averaged(self, model, step: int) -> None:
        """With ``trainer.model_averaging``: evaluate the averaged weights after ``step`` updates (called
        right after :meth:`evaluate` of the trained ones)."""

    def on_preempt(self) -> None:
        """Before the process exits on SIGTERM (the state is already checkpointed)."""


def _evaluate(hooks: TrainHooks, state: TrainerState, step: int) -> None:
    """The hooks' evaluation of ``state`` after ``step`` updates: the trained weights, then the averaged ones."""
    hooks.evaluate(state.model, step)
    if state.averaged_model is not None:
        hooks.evaluate_averaged(state.eval_model, step)


class StepLoop:
    """One run of the loop over ``batches`` (see :meth:`levanter.training.Trainer.train` for the contract).

    Metrics are read one step late. Reading a step's loss waits for the step to finish, and the host work
    before the next step (the next batch, ``to_named``, the hooks, the logging) would leave the device idle
    for as long as it takes. So step N+1 is dispatched first and step N's metrics are read (and checked,
    and reported) while it runs. The report is the same, only later; a non-finite step N still stops the
    run naming step N, and the state after it is never saved (step N+1's result is dropped with it).
    ``StepReport.seconds`` is the time between the reads of consecutive steps' metrics, i.e. between their
    completions as the host sees them.

    The state after step N cannot be read once step N+1 is dispatched (the step donates its input buffers),
    so where anything needs it the loop finishes step N first: an evaluation step, a save (asked of a
    :class:`ScheduledCheckpointing` before dispatching), the last step, and a stop requested by a signal.
    """

    def __init__(self, steps: CompiledSteps, config: TrainerConfig, *, to_named: Callable[[Any], Any],
                 checkpointer: Checkpointing, hooks: TrainHooks, signals: StopSignals):
        self.steps, self.config, self.to_named = steps, config, to_named
        self.checkpointer, self.hooks, self.signals = checkpointer, hooks, signals
        self.num_steps = config.num_train_steps
        self.scheduled = checkpointer if isinstance(checkpointer, ScheduledCheckpointing) else None
        # Multi-process: a signal reaches each process at its own moment, but all must stop at the same step
        # (the save and the exit are collective), so the stop is agreed one step ahead (StopAgreement).
        self.agree_stop = StopAgreement() if jax.process_count() > 1 else None
        self.stopping = False
        self.seen_sizes: set[int] = set()
        self.t_prev = time.perf_counter()
        self.last_applied: Optional[Tuple[int, float]] = None  # (step, update ratio) of the last step applied
        self.pending = None  # (step, batch, metrics): dispatched, its report not made yet (its state is gone)

    def run(self, state: TrainerState, batches: Iterable[Batch]) -> TrainerState:
        try:
            return self._finish(self._steps(state, batches))
        except Exception:
            # A failure after a step was dispatched but before its report (unreadable data for the next
            # step, a failed background write) reports that step first, as a loop without the lag would
            # have: its metrics are logged, and a non-finite step is the error raised.
            try:
                self._report_pending()
            finally:
                # A run that fails (a non-finite loss, unreadable data) still commits the checkpoint whose
                # background write is in flight: the last good state is there to resume from. A failed
                # write is logged, not raised, so that the run's own error is the one reported.
                try:
                    self.checkpointer.wait_until_finished()
                except Exception as e:  # noqa: BLE001
                    logger.error("the checkpoint being written when the run failed was not saved: %s", e)
            raise

    def _steps(self, state: TrainerState, batches: Iterable[Batch]) -> TrainerState:
        start_step = int(state.step)
        if start_step > 0 and self.hooks.is_eval_step(start_step):
            # The earlier attempt's eval at this step was dropped with its other records of steps >= start.
            _evaluate(self.hooks, state, start_step)
            self.t_prev = time.perf_counter()
        step = start_step  # updates dispatched; counted here, since reading state.step would wait
        for batch in batches:
            check_step(batch, step)
            self.seen_sizes.add(batch.batch_size)
            state, metrics = self.steps.train_step(state, self.to_named(batch.data), batch.batch_size)
            if self.pending is not None:  # the previous step's report, now that this one is queued
                self._report_pending()
                fault_point("train_after_step")
            self._check_compiles(step)
            done = step + 1
            self.pending = (step, batch, metrics)
            step = done
            if not self._needs_state(done):
                continue  # reported after the next step is dispatched
            self._report_pending()
            self._with_state(state, done)
        return state

    def _check_compiles(self, step: int) -> None:
        count = self.steps.compile_count()
        if count > len(self.seen_sizes):
            raise RuntimeError(
                f"the train step recompiled at step {step} ({count} compiles for "
                f"{len(self.seen_sizes)} batch sizes): an input changed shape or type unexpectedly"
            )

    def _needs_state(self, done: int) -> bool:
        """Whether the state after ``done`` updates is needed (so the step must finish before the next)."""
        force = done == self.num_steps
        # The checkpointer is asked first and at every step: in a multi-process job its time-based answer
        # is a broadcast that every process must join, whatever else this process knows; so is the stop
        # agreement.
        saving = self.scheduled is None or self.scheduled.save_due(done, force=force)
        requested = self.signals.requested
        self.stopping = requested if self.agree_stop is None else self.agree_stop(done, requested)
        return saving or force or self.stopping or self.hooks.is_eval_step(done)

    def _with_state(self, state: TrainerState, done: int) -> None:
        """After step ``done - 1`` finished, its state readable: evaluate, checkpoint, stop on a signal."""
        if self.hooks.is_eval_step(done):
            _evaluate(self.hooks, state, done)
            self.t_prev = time.perf_counter()  # the evaluation is not the next step's time
        self.checkpointer.on_step(state, done, force=done == self.num_steps)
        fault_point("train_after_step")
        if self.stopping and done < self.num_steps:
            self.checkpointer.on_step(state, done, force=True)
            self.checkpointer.wait_until_finished()
            self.hooks.on_preempt()
            where = self.scheduled.base_path if self.scheduled is not None else "the checkpoint directory"
            logger.warning(
                "%s: checkpointed step %d in %s; exiting with status %d. Rerun the same command to resume.",
                self.signals.name, done, where, PREEMPTED_EXIT_CODE,
            )
            sys.exit(PREEMPTED_EXIT_CODE)

    def _finish(self, state: TrainerState) -> TrainerState:
        if self.pending is not None:  # the batches ended after a step that needed no state
            self._report_pending()
            fault_point("train_after_step")
        self.checkpointer.wait_until_finished()
        final_step = int(state.step)
        if final_step < self.num_steps:
            # Runs check up front that their data covers every step, which makes this rare; a run that ends
            # short of what the config asks must not exit 0, or every rerun "succeeds" again at the same step.
            self.checkpointer.on_step(state, final_step, force=True)
            self.checkpointer.wait_until_finished()
            raise DataEndedError(
                f"the training data ended at step {final_step} of trainer.num_train_steps="
                f"{self.num_steps}: the loader had no batch for step {final_step} (the state after "
                f"step {final_step - 1} was checkpointed). Add training data or lower "
                "trainer.num_train_steps, then rerun."
            )
        return state

    def _report_pending(self) -> None:
        """Read the pending step's metrics (waiting for it to finish), check them, tell the hooks."""
        if self.pending is None:
            return
        (step, batch, metrics), self.pending = self.pending, None
        host = jax.device_get(metrics)  # the step's scalars, fetched together
        loss = float(host["loss"])
        grad_norm = float(host["grad_norm"])
        update_finite = bool(host["update_finite"])
        check_finite(loss, step, self.config, grad_norm=grad_norm, update_finite=update_finite,
                     previous=self.last_applied)
        now = time.perf_counter()
        dt, self.t_prev = now - self.t_prev, now
        extra = {k: float(v) for k, v in host["extra"].items()}
        non_finite = not (math.isfinite(loss) and math.isfinite(grad_norm) and update_finite)
        r = StepReport(step, batch, loss, grad_norm, bool(host["skipped"]), dt, extra,
                       update_norm=float(host["update_norm"]), param_norm=float(host["param_norm"]),
                       non_finite=non_finite)
        if not r.skipped:
            self.last_applied = (step, r.update_ratio)
        self.hooks.on_step(r)


__all__ = [
    "Checkpointing",
    "CompiledSteps",
    "DataEndedError",
    "ScheduledCheckpointing",
    "StepLoop",
    "StepMismatchError",
    "TrainHooks",
    "check_step",
]

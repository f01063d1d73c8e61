"""What a step's metrics say, read on the host: one step as the loop saw it (:class:`StepReport`), whether a
non-finite loss, gradient or update stops the run (:func:`check_finite`), and what a run's steps did, for
its end-of-run summary (:class:`StepTally`).

Each step reports its update's global norm against the parameters' (:attr:`StepReport.update_ratio`): an
update too small to change float32 parameters means a run that trains nothing, and one larger than the
parameters a learning rate that throws them out of range, which a later non-finite loss's error names.
:class:`StepTally` counts what a run's steps did (skipped as non-finite or as spikes, updates that vanished)
so that a run that skipped steps says how many, and one that trained nothing says so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Dict, Optional, Tuple

from ..data.loader import Batch
from .config import TrainerConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One step as the loop saw it: the batch trained on, its (global) loss and gradient norm, whether
    the update was skipped (non-finite and allowed to go on), and the seconds since the previous step's
    report (between the two steps' completions as the host sees them; an evaluation between them is not
    counted)."""

    step: int
    batch: Batch
    loss: float
    grad_norm: float
    skipped: bool
    seconds: float
    # The loss function's extra metrics (e.g. a mixture of experts' router_aux_loss), means over the step.
    extra: Dict[str, float] = dataclasses.field(default_factory=dict)
    # Global L2 norms of the step's update (what the optimizer returned, zero for a spike it skipped) and of
    # the parameters it applies to, before the step.
    update_norm: float = math.nan
    param_norm: float = math.nan
    # Whether the loss, gradient norm or update was not finite (the step was skipped for that, not as a spike).
    non_finite: bool = False

    @property
    def update_ratio(self) -> float:
        """The update's norm over the parameters' (inf for an update of parameters that are all zero)."""
        if self.param_norm > 0:
            return self.update_norm / self.param_norm
        return 0.0 if self.update_norm == 0 else math.inf

    @property
    def update_vanished(self) -> bool:
        """Whether the update was applied but too small to change float32 parameters (see
        :data:`VANISHING_UPDATE_RATIO`)."""
        return not self.skipped and self.update_ratio < VANISHING_UPDATE_RATIO


# An update below this fraction of the parameters' norm changes (almost) none of them: float32 rounds
# x + u back to x when |u| is under half a unit in the last place, 2^-24 (6e-8) of |x|. A sane step moves
# the parameters by 1e-5 to 1e-2 of their norm.
VANISHING_UPDATE_RATIO = 1e-9


class StepTally:
    """What a run's steps did, counted from their :class:`StepReport`s, for the end-of-run summary: a run
    that skipped steps says how many, and one that trained nothing says so (:meth:`failure`) rather than end
    like one that trained."""

    def __init__(self) -> None:
        self.steps = 0
        # skipped because the loss, gradient or update was not finite (trainer.crash_on_nan / crash_on_inf false)
        self.non_finite = 0
        self.spikes = 0  # skipped as spikes (optimizer.skip_bad_steps)
        # applied steps whose update was too small to change the parameters (StepReport.update_vanished)
        self.vanished = 0
        self.streak = 0  # non-finite steps in a row, up to the last step seen
        self.streak_start: Optional[int] = None
        self._last_applied: Optional[Tuple[int, float]] = None  # (step, update ratio)
        self.before_streak: Optional[Tuple[int, float]] = None  # the last applied step before the streak

    def add(self, r: StepReport) -> None:
        self.steps += 1
        if r.non_finite:
            self.non_finite += 1
            if self.streak == 0:
                self.streak_start, self.before_streak = r.step, self._last_applied
            self.streak += 1
            return
        self.streak = 0
        if r.skipped:
            self.spikes += 1
            return
        self._last_applied = (r.step, r.update_ratio)
        if r.update_vanished:
            self.vanished += 1

    def warnings(self) -> list:
        """Lines for the run summary (none for a run whose steps all applied an update that counted)."""
        out = []
        if self.non_finite:
            tail = f", the last {self.streak} in a row (from step {self.streak_start})" if self.streak > 1 else ""
            out.append(f"{self.non_finite} of {self.steps} steps were skipped: their loss, gradient or update was "
                       f"not finite (trainer.crash_on_nan / crash_on_inf: false){tail}")
        if self.spikes:
            out.append(f"{self.spikes} of {self.steps} steps were skipped as spikes (optimizer.skip_bad_steps)")
        if self.steps and self.vanished == self.steps:
            out.append(f"the parameters did not change: the update of every step ({self.steps}) was below "
                       f"{VANISHING_UPDATE_RATIO:g} of their norm (a learning rate of 0 at every step?)")
        return out

    def failure(self) -> Optional[str]:
        """The error of a run that did not train: at least half its steps skipped as non-finite (every one of
        them after a learning rate that threw the weights out of range, typically); None otherwise. A rare
        bad batch skipped is what ``crash_on_nan: false`` is for, and only counts in :meth:`warnings`."""
        if not self.non_finite or 2 * self.non_finite < self.steps:
            return None
        cause = "lower optimizer.learning_rate or check the data"
        if self.before_streak is not None and self.before_streak[1] >= DIVERGED_UPDATE_RATIO:
            p, ratio = self.before_streak
            cause = (f"step {p}'s update was {_times(ratio)} the parameters' norm, so optimizer.learning_rate is "
                     f"far too large: lower it and {_start_again(p)}")
        return (f"{self.non_finite} of the run's {self.steps} steps were skipped because their loss, gradient or "
                f"update was not finite (trainer.crash_on_nan / crash_on_inf: false); the run did not train. "
                f"The last series of skipped steps began at step {self.streak_start}: {cause}.")


def check_finite(
    loss: float, step: int, config: TrainerConfig, *, grad_norm: float = 0.0, update_finite: bool = True,
    previous: Optional[Tuple[int, float]] = None,
) -> None:
    """Stop on a NaN / infinite loss, gradient norm or update (the state after that step is never saved or
    evaluated), unless configured to skip such steps (then their update is not applied). A
    non-finite update after a finite loss and gradient (a zero epsilon, a learning rate beyond float32's
    range) counts as NaN: it is almost always 0/0 or inf - inf.

    The message says which value was not finite first, in the order the step computes them (the loss, the
    gradient from it, the update from that), and the likely key: ``previous`` is ``(step, update ratio)`` of
    the last step applied before this one (:attr:`StepReport.update_ratio`); an update larger than the
    parameters themselves there means the learning rate threw the weights out of range, which skipping
    later steps cannot undo."""
    stopped = "training stopped and the state after this step was not saved"
    if math.isfinite(loss) and not math.isfinite(grad_norm):
        what = "NaN" if math.isnan(grad_norm) else "infinite"
        flag = "crash_on_nan" if math.isnan(grad_norm) else "crash_on_inf"
        if _stops(config, flag):
            raise FloatingPointError(
                f"train/grad_norm is {what} at step {step} (the loss was finite); {stopped}. The gradient was the "
                f"first value not finite. {_likely_cause(previous, flag)}"
            )
        logger.warning("train/grad_norm is %s at step %d: the update was skipped", grad_norm, step)
        return
    if math.isfinite(loss) and not update_finite:
        if config.crash_on_nan:
            raise FloatingPointError(
                f"the update at step {step} is not finite (loss and gradient norm were finite: train/grad_norm "
                f"{grad_norm:.3g}); {stopped}. Check optimizer.learning_rate and optimizer.epsilon, or set "
                "trainer.crash_on_nan: false to skip such steps instead."
            )
        logger.warning("the update at step %d is not finite: it was skipped", step)
        return
    for bad, flag, what in ((math.isnan(loss), "crash_on_nan", "NaN"), (math.isinf(loss), "crash_on_inf", "infinite")):
        if bad and _stops(config, flag):
            raise FloatingPointError(
                f"train/loss is {what} at step {step}; {stopped}. The loss was the first value not finite "
                f"(train/grad_norm {grad_norm:.3g}). {_likely_cause(previous, flag)}"
            )
    if not math.isfinite(loss):
        logger.warning("train/loss is %s at step %d: the update was skipped", loss, step)


def _stops(config: TrainerConfig, flag: str) -> bool:
    """Whether ``trainer.<flag>`` (``crash_on_nan`` or ``crash_on_inf``) stops the run."""
    return config.crash_on_nan if flag == "crash_on_nan" else config.crash_on_inf


DIVERGED_UPDATE_RATIO = 1.0  # an update larger than the parameters it changes: the weights were thrown away


def _times(ratio: float) -> str:
    """An update's ratio to the parameters' norm, in words (its norm overflows float32 past ~1e19 a value)."""
    return f"{ratio:.1e} times" if math.isfinite(ratio) else "too large for float32 to measure against"


def _start_again(p: int) -> str:
    """Where a run whose update at step ``p`` threw the weights away starts again: the checkpoints after it
    (``step-{p+1}`` on) hold those weights."""
    if p == 0:
        return "start again under a new trainer.id (or delete the run's checkpoints)"
    return f"start again from checkpoint step-{p} or earlier (trainer.initialize_from) under a new trainer.id"


def _likely_cause(previous: Optional[Tuple[int, float]], flag: str) -> str:
    """The sentence after a non-finite value's message: what probably caused it, and the fix."""
    if previous is not None and previous[1] >= DIVERGED_UPDATE_RATIO:
        p, ratio = previous
        return (f"Step {p}'s update was {_times(ratio)} the parameters' norm: optimizer.learning_rate is far too "
                f"large (or the gradient needs optimizer.max_grad_norm). Lower it and {_start_again(p)}; "
                f"trainer.{flag}: false would skip every later step too, as each starts from the same weights.")
    last = "" if previous is None else f" (step {previous[0]}'s update was {previous[1]:.1e} of the parameters' norm)"
    return (f"If it is a rare bad batch, set trainer.{flag}: false to skip such steps instead{last}; if it recurs, "
            "lower optimizer.learning_rate.")


__all__ = [
    "DIVERGED_UPDATE_RATIO",
    "StepReport",
    "StepTally",
    "VANISHING_UPDATE_RATIO",
    "check_finite",
]

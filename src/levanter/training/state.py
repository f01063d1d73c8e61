"""The training state: what a checkpoint holds, and the averaged copy of the weights inside it.

:class:`TrainerState` is the one pytree the step takes and returns, and the one a checkpoint writes; with
``trainer.model_averaging`` it carries the averaged weights (``averaged_model``), started from the weights a
run or a branch begins with (:func:`average_start`) and updated after every step from the weights the step
kept (:func:`updated_average`). Whether a checkpoint holds an average is part of its identity: a resume that
disagrees with the config is refused (:func:`check_resume_averaging`) rather than starting a new average at a
resumed step, which would make the run's average differ from an uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from ..optim.model_averaging import ModelAveragingConfig
from .config import TrainerConfig

AVERAGED_LEAVES = "averaged_model"  # where a checkpoint holds the averaged copy (TrainerState.averaged_model)


class TrainerState(eqx.Module):
    """Everything a checkpoint holds: ``step`` updates done, the model, the optimizer state, a key and, with
    ``trainer.model_averaging``, the averaged copy of the weights (``averaged_model``: the model's float
    arrays that train, None elsewhere; None without averaging, so such a state and its checkpoints have no
    such leaves)."""

    step: jax.Array
    model: Any
    opt_state: Any
    training_key: jax.Array
    averaged_model: Any = None

    @property
    def eval_model(self) -> Any:
        """The weights evaluation and the Hugging Face exports see: the averaged copy, with the model's other
        leaves, when there is one (upstream's ``eval_model``); else the trained model."""
        if self.averaged_model is None:
            return self.model
        return eqx.combine(self.averaged_model, self.model)  # the averaged weights where there are some


def average_start(averaging: Optional[ModelAveragingConfig], params: Any) -> Any:
    """The average at the start of a run or a branch: a copy of ``params`` (the trained float arrays), or None
    without averaging."""
    if averaging is None:
        return None
    # A copy, not the same arrays: the step donates both the model and the average.
    return jax.tree.map(jnp.copy, params)


def updated_average(averaging: Optional[ModelAveragingConfig], averaged: Any, new_params: Any,
                    keep: Callable[[Any, Any], Any]) -> Any:
    """The average after a step whose kept parameters are ``new_params`` (inside the compiled step).

    ``keep(new, old)`` is the step's non-finite guard: a step whose update was not applied leaves the average
    as it was too."""
    if averaging is None:
        return averaged
    return jax.tree.map(keep, averaging.update(averaged, new_params), averaged)


def check_resume_averaging(point, config: TrainerConfig) -> None:
    """Refuse to resume from ``point`` (a :class:`levanter.checkpoint.ResumePoint`) when it and
    ``trainer.model_averaging`` disagree on whether there is an averaged copy of the weights. Starting an
    average at a resumed step would make the run's average differ from an uninterrupted run's (resume is
    a pure function of the step), and dropping a saved one would lose it unasked; a branch
    (``trainer.initialize_from``) is the way to add or drop averaging from a checkpoint on."""
    if point is None:
        return
    holds = point.holds(AVERAGED_LEAVES)
    wanted = config.model_averaging is not None
    if wanted and not holds:
        raise ValueError(
            f"trainer.model_averaging is set but the checkpoint {point.path} (step {point.step}) holds no averaged "
            "copy of the weights (the run that wrote it kept none): starting the average at that step would not "
            "be the average of an uninterrupted run. Remove trainer.model_averaging to resume as the run was, or "
            f"start a new run (another trainer.id) with trainer.initialize_from: {point.path}, whose average "
            "starts from those weights."
        )
    if holds and not wanted:
        raise ValueError(
            f"the checkpoint {point.path} (step {point.step}) holds an averaged copy of the weights "
            "(trainer.model_averaging was set in the run that wrote it) but trainer.model_averaging is not set: "
            "set it as that run did to resume, or start a new run (another trainer.id) with "
            f"trainer.initialize_from: {point.path} to go on without the average."
        )


__all__ = ["AVERAGED_LEAVES", "TrainerState", "average_start", "check_resume_averaging", "updated_average"]

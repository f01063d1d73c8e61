"""``trainer.model_averaging``: an averaged copy of the weights kept beside the trained ones (upstream's key).

Upstream Levanter's section and names: ``type: ema`` with ``beta`` (default 0.999) keeps an exponential
moving average of the trainable parameters, ``avg <- beta * avg + (1 - beta) * params``, updated after every
optimizer step and starting from the initial weights. This module holds the config registry and the update
rule; the trainer keeps the copy in its state (``TrainerState.averaged_model``), so it is updated inside
the compiled step, saved in every checkpoint and restored with the rest of the state (resume stays a pure
function of the step).

Trade-offs: the copy has the parameters' dtype and sharding (one more copy of the parameters per device,
which the memory plan counts); the update is computed in float32 and cast back, but with bfloat16
parameters (``trainer.mp: p=bfloat16``) a ``beta`` close to 1 moves the stored average in steps too small
for bfloat16 to hold, so keep parameters in float32 when averaging. Upstream's other averaging kind
(``ema_decay_sqrt``) is not built here: draccus refuses the type, listing ``ema``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Optional

import draccus
import jax
import jax.numpy as jnp

__all__ = ["ModelAveragingConfig", "EmaModelAveragingConfig"]


@dataclasses.dataclass(frozen=True)
class ModelAveragingConfig(draccus.ChoiceRegistry, abc.ABC):
    """An averaged copy of the weights, updated after every optimizer step (levanter.optim.model_averaging)."""

    @classmethod
    def default_choice_name(cls) -> Optional[str]:
        return "ema"

    @abc.abstractmethod
    def check(self) -> None:
        """Raise ``ValueError`` naming the key if a value is out of range."""

    @abc.abstractmethod
    def update(self, averaged: Any, params: Any) -> Any:
        """The average after one more step whose parameters are ``params`` (a tree shaped like ``averaged``);
        traced inside the train step."""


@ModelAveragingConfig.register_subclass("ema")
@dataclasses.dataclass(frozen=True)
class EmaModelAveragingConfig(ModelAveragingConfig):
    """Exponential moving average of the parameters: avg <- beta * avg + (1 - beta) * params each step."""

    # Weight of the previous average at each step, in [0, 1): 0.999 averages over about 1000 steps.
    beta: float = 0.999

    def check(self) -> None:
        beta = self.beta
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) \
                or not 0 <= beta < 1:
            raise ValueError(
                f"trainer.model_averaging.beta must be a number in [0, 1), got {beta!r}: the average moves "
                "(1 - beta) of the way to the new weights each step (0.999 averages over about 1000 steps; 1 "
                "would never move from the initial weights)"
            )

    def update(self, averaged: Any, params: Any) -> Any:
        beta = float(self.beta)

        def one(avg, new):
            out = beta * avg.astype(jnp.float32) + (1.0 - beta) * new.astype(jnp.float32)
            return out.astype(avg.dtype)

        return jax.tree.map(one, averaged, params)

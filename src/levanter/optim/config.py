"""Optimizer configs (upstream field names) and learning-rate schedules.

``OptimizerConfig`` is a draccus choice registry: ``optimizer: {type: adam, learning_rate: 3e-4, ...}``
(``type`` defaults to ``adam``). ``build(num_train_steps)`` returns an optax transformation whose learning
rate follows the configured schedule.

Schedules (``lr_schedule``), after ``warmup`` (a fraction of ``num_train_steps`` if < 1, else steps) of
linear warm-up from 0:

* ``constant`` -- the peak rate throughout;
* ``linear`` / ``cosine`` -- decay to ``min_lr_ratio * learning_rate`` over ``decay`` (fraction or steps;
  default: all remaining steps), then hold;
* ``wsd`` (warmup-stable-decay) -- hold the peak, then decay linearly to the minimum over the last
  ``decay`` of training (default 20%).

Weight decay applies to matrices (arrays with two or more dimensions), not to biases, norm scales or
other vectors.

Every numeric field is checked when the config is made: a NaN or infinite value (YAML ``.nan`` /
``.inf``) or one outside its range is refused naming the key, since such a value makes every update
non-finite (or silently does nothing) rather than failing.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Dict, Optional, Union

import draccus
import equinox as eqx
import jax
import optax

from ..refused_keys import check_refused, refused

SCHEDULES = ("constant", "linear", "cosine", "wsd", "warmup-stable-decay")


def _steps(value: float | int | None, num_train_steps: int, default: int, name: str) -> int:
    if value is None:
        return default
    if value < 0:
        raise ValueError(f"optimizer.{name} must be non-negative, got {value}")
    return int(round(value * num_train_steps)) if value < 1 else int(value)


def lr_schedule_fn(
    *,
    learning_rate: float,
    num_train_steps: int,
    warmup: float = 0.0,
    decay: float | None = None,
    min_lr_ratio: float = 0.0,
    lr_schedule: str = "cosine",
):
    """The learning rate as a function of the update count (an optax schedule)."""
    if lr_schedule not in SCHEDULES:
        raise ValueError(f"optimizer.lr_schedule: expected one of {SCHEDULES}, got {lr_schedule!r}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"optimizer.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    warm = _steps(warmup, num_train_steps, 0, "warmup")
    lo = learning_rate * min_lr_ratio
    rest = max(num_train_steps - warm, 1)
    if lr_schedule in ("wsd", "warmup-stable-decay"):
        d = max(1, _steps(decay, num_train_steps, int(round(0.2 * num_train_steps)), "decay"))
        stable = max(num_train_steps - warm - d, 0)
        main = optax.join_schedules(
            [optax.constant_schedule(learning_rate), optax.linear_schedule(learning_rate, lo, d)], [stable]
        )
    elif lr_schedule == "constant":
        main = optax.constant_schedule(learning_rate)
    else:
        d = max(1, _steps(decay, num_train_steps, rest, "decay"))
        if lr_schedule == "linear":
            main = optax.linear_schedule(learning_rate, lo, d)
        else:
            main = optax.cosine_decay_schedule(learning_rate, d, alpha=min_lr_ratio)
    if warm == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warm), main], [warm])


def decay_mask(params):
    """True for matrices (weight decay applies), False for vectors and scalars."""
    import haliax as hax

    def is_matrix(x):
        if isinstance(x, hax.NamedArray):
            return x.array.ndim >= 2
        return eqx.is_array(x) and x.ndim >= 2

    return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, hax.NamedArray))


def _check_numbers(config) -> None:
    """Every int or float field is a finite number (draccus lets ``.nan``, ``.inf`` and ``1e999`` through)."""
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not math.isfinite(v):
            raise ValueError(f"optimizer.{f.name} must be a finite number, got {v}")


def _check_range(config, name: str, lo: float | None, hi: float | None) -> None:
    v = getattr(config, name)
    if v is None:
        return
    if lo is not None and v < lo or hi is not None and v > hi:
        want = f"in [{lo}, {hi}]" if hi is not None else ("non-negative" if lo == 0 else f">= {lo}")
        raise ValueError(f"optimizer.{name} must be {want}, got {v}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(draccus.ChoiceRegistry, abc.ABC):
    # Peak learning rate (reached at the end of the warmup).
    learning_rate: float = 6e-4
    # Decoupled weight decay, applied to matrices only (not to biases, norms' scales or other vectors).
    weight_decay: float = 0.1
    # The learning rate decays to learning_rate x this (in [0, 1]).
    min_lr_ratio: float = 0.1
    # Warmup from 0 to learning_rate: a fraction of num_train_steps if below 1, else a number of steps.
    warmup: float = 0.01
    # Steps of the decay (fraction if below 1); null: all steps after warmup (wsd: the last 20 %).
    decay: Optional[float] = None
    # Shape after warmup: constant, linear, cosine, or wsd / warmup-stable-decay (constant, then linear).
    lr_schedule: str = "cosine"
    # Upstream skips a step whose loss or gradient norm lies over the mean + 6 standard deviations of the
    # last steps (true, a window length, or {rolling_interval_length, sigma_factor}); refused if set.
    skip_bad_steps: Union[bool, int, Dict[str, float]] = refused(
        "steps are not skipped for outlying finite losses or gradient norms here; remove the key. A "
        "non-finite loss, gradient or update is never applied: set trainer.crash_on_nan: false and "
        "trainer.crash_on_inf: false to skip such steps and go on instead of stopping",
        default=False,
    )

    def __post_init__(self):
        check_refused(self, "optimizer")
        _check_numbers(self)
        _check_range(self, "learning_rate", 0, None)
        _check_range(self, "weight_decay", 0, None)
        _check_range(self, "warmup", 0, None)
        _check_range(self, "decay", 0, None)
        _check_range(self, "min_lr_ratio", 0, 1)

    @classmethod
    def default_choice_name(cls) -> Optional[str]:
        return "adam"

    def lr_scheduler(self, num_train_steps: int):
        return lr_schedule_fn(
            learning_rate=self.learning_rate,
            num_train_steps=num_train_steps,
            warmup=self.warmup,
            decay=self.decay,
            min_lr_ratio=self.min_lr_ratio,
            lr_schedule=self.lr_schedule,
        )

    @abc.abstractmethod
    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        ...


@OptimizerConfig.register_subclass("adam")
@dataclasses.dataclass(frozen=True)
class AdamConfig(OptimizerConfig):
    """AdamW with global-norm gradient clipping."""

    # Decay of Adam's first-moment (mean) estimate, in [0, 1).
    beta1: float = 0.9
    # Decay of Adam's second-moment (squared gradient) estimate, in [0, 1).
    beta2: float = 0.95
    # Added to the square root of the second moment before dividing (must be positive).
    epsilon: float = 1e-8
    # Clip the gradient to this global L2 norm before the update; null: no clipping.
    max_grad_norm: Optional[float] = 1.0

    def __post_init__(self):
        super().__post_init__()
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {v}")
        # The update is m / (sqrt(v) + epsilon): with epsilon 0 a parameter whose gradient is 0 (an unused
        # embedding row, say) gets 0 / 0 = NaN.
        if self.epsilon <= 0:
            raise ValueError(
                f"optimizer.epsilon must be positive, got {self.epsilon}: Adam divides by sqrt(v) + epsilon, "
                "and with 0 every parameter whose gradient is 0 gets 0/0 = NaN (1e-8 is usual)"
            )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"optimizer.max_grad_norm must be positive or null, got {self.max_grad_norm}")

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        schedule = self.lr_scheduler(num_train_steps)
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(optax.scale_by_adam(b1=self.beta1, b2=self.beta2, eps=self.epsilon))
        if self.weight_decay > 0:
            parts.append(optax.add_decayed_weights(self.weight_decay, mask=decay_mask))
        parts.append(optax.scale_by_learning_rate(schedule))
        return optax.chain(*parts)



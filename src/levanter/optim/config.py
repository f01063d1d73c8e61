"""Optimizer configs (upstream field names) and learning-rate schedules.

``OptimizerConfig`` is a draccus choice registry: ``optimizer: {type: adam, learning_rate: 3e-4, ...}``
(``type`` defaults to ``adam``; ``sophia-h`` is :mod:`.sophia`, ``muon`` :mod:`.muon`, registered when this
module is imported). ``build(num_train_steps)`` returns an optax transformation whose learning rate follows
the configured schedule.

Schedules (``lr_schedule``), after ``warmup`` (a fraction of ``num_train_steps`` if < 1, else steps) of
linear warm-up from 0:

* ``constant`` -- the peak rate throughout;
* ``linear`` / ``cosine`` -- decay to ``min_lr_ratio * learning_rate`` over the last ``decay`` steps of the
  run (fraction or steps; default: all steps after the warmup), holding the peak before them, as upstream's
  schedules do;
* ``inv`` -- upstream's inverse decay ``learning_rate / (1 + k t)`` over the last ``decay`` steps (default:
  all steps after the warmup), ``k`` chosen so that it reaches ``min_lr_ratio * learning_rate`` at the end;
  it needs ``min_lr_ratio > 0``;
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
import importlib
import math
from typing import Dict, List, Optional, Union

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ..refused_keys import check_refused, refused
from .skip_steps import resolve as resolve_skip_bad_steps
from .skip_steps import skip_bad_steps

__all__ = ["lr_schedule_fn", "host_schedule", "decay_mask", "check_betas", "OptimizerConfig", "AdamConfig"]

SCHEDULES = ("constant", "linear", "cosine", "inv", "wsd", "warmup-stable-decay")


def _steps(value: float | int | None, num_train_steps: int, default: int, name: str) -> int:
    if value is None:
        return default
    if value < 0:
        raise ValueError(f"optimizer.{name} must be non-negative, got {value}")
    return int(round(value * num_train_steps)) if value < 1 else int(value)


def check_betas(config, names=("beta1", "beta2")) -> None:
    """Refuse a moment-decay rate outside [0, 1), naming its ``optimizer.`` key."""
    for name in names:
        v = getattr(config, name)
        if not 0 <= v < 1:
            raise ValueError(f"optimizer.{name} must be in [0, 1), got {v}")


def host_schedule(schedule):
    """``step -> float``: ``schedule`` (an optax schedule) evaluated on the host's CPU backend.

    The trainer logs the learning rate of each step while the next step runs on the accelerator. Evaluated
    on the default device, the schedule's dozen small operations would queue behind that step, and reading
    the value would wait for the step to finish: the host's logging, the next batch and the next dispatch
    would then happen while the accelerator idles. On the CPU backend they run at once. Where JAX has no
    CPU backend (``JAX_PLATFORMS`` without ``cpu``) the schedule runs on the default device as before."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        cpu = None

    def at(step: int) -> float:
        if cpu is None:
            return float(schedule(step))
        with jax.default_device(cpu):
            return float(schedule(step))

    return at


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
        # The decay ends the run; before it the rate holds at its peak (none of that without a decay given).
        d = max(1, _steps(decay, num_train_steps, rest, "decay"))
        stable = max(rest - d, 0)
        if lr_schedule == "linear":
            main = optax.linear_schedule(learning_rate, lo, d)
        elif lr_schedule == "inv":
            if min_lr_ratio <= 0:
                raise ValueError(
                    "optimizer.lr_schedule: inv decays as learning_rate / (1 + k t) towards the minimum "
                    "min_lr_ratio x learning_rate, so it needs optimizer.min_lr_ratio > 0 (got 0); use linear or "
                    "cosine to decay to 0"
                )
            main = _inverse_decay(learning_rate, lo, (1.0 / min_lr_ratio - 1.0) / d)
        else:
            main = optax.cosine_decay_schedule(learning_rate, d, alpha=min_lr_ratio)
        if stable > 0:
            main = optax.join_schedules([optax.constant_schedule(learning_rate), main], [stable])
    if warm == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warm), main], [warm])


def _inverse_decay(peak: float, floor: float, k: float):
    def schedule(count):
        # optax.join_schedules also evaluates it before its start (negative counts): clamp those to 0.
        return jnp.maximum(peak / (1.0 + k * jnp.maximum(jnp.asarray(count, jnp.float32), 0.0)), floor)

    return schedule


def decay_mask(params):
    """True for matrices (weight decay applies), False for vectors and scalars (and for the empty places of
    leaves that do not train: a named array without its array)."""
    import haliax as hax

    def is_matrix(x):
        if isinstance(x, hax.NamedArray):
            return x.array is not None and x.array.ndim >= 2
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


_NO_CYCLES = "cyclic learning-rate schedules are not built here: one warmup and one decay span the run"
_MATRICES_DECAY = (
    "weight decay applies to every matrix (arrays of two or more dimensions) and to nothing else here; "
    "remove the key"
)


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
    # Steps of the decay, which ends the run (fraction if below 1); null: all steps after warmup (wsd: the
    # last 20 %).
    decay: Optional[float] = None
    # Shape after warmup: constant, linear, cosine, inv (1 / (1 + k t), down to the minimum), or wsd /
    # warmup-stable-decay (constant, then linear).
    lr_schedule: str = "cosine"
    # Skip an update whose loss or gradient norm exceeds the mean + sigma_factor standard deviations of the
    # last steps (levanter.optim.skip_steps): true (128 steps, 6 sigma), a window length, or
    # {rolling_interval_length, sigma_factor}; false: apply every finite update.
    skip_bad_steps: Union[bool, int, Dict[str, float]] = False
    # Upstream's cycle length (steps, or a fraction of the run); accepted when one cycle spans the whole run
    # (null, 1.0 or >= num_train_steps), refused otherwise: cyclic schedules are not built here.
    cycle_length: Optional[Union[int, float, List[int]]] = None
    # Upstream's number of cycles (or their end steps); refused if set: cyclic schedules are not built here.
    cycles: Optional[Union[int, List[int]]] = refused(_NO_CYCLES)
    # Upstream's re-warmup at each new cycle; refused unless 0 (there is one cycle).
    rewarmup: float = refused(_NO_CYCLES, default=0.0)
    # Upstream's deprecated cycle end steps; refused if set.
    haps: Optional[List[int]] = refused(_NO_CYCLES)
    # Upstream's deprecated final cooldown; refused if set (use decay).
    cooldown: Optional[float] = refused("use decay (steps or a fraction of the run) and min_lr_ratio instead")
    # Upstream's regex or names of the parameters weight decay applies to; refused if set.
    weight_decay_modules: Optional[Union[List[str], str]] = refused(_MATRICES_DECAY)
    # Upstream's switch for its default weight-decay mask; refused if set.
    default_weight_decay_mask: Optional[bool] = refused(_MATRICES_DECAY)

    def __post_init__(self):
        check_refused(self, "optimizer")
        resolve_skip_bad_steps(self.skip_bad_steps)
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
        self._check_one_cycle(num_train_steps)
        return lr_schedule_fn(
            learning_rate=self.learning_rate,
            num_train_steps=num_train_steps,
            warmup=self.warmup,
            decay=self.decay,
            min_lr_ratio=self.min_lr_ratio,
            lr_schedule=self.lr_schedule,
        )

    def host_lr_scheduler(self, num_train_steps: int):
        """:meth:`lr_scheduler` as ``step -> float`` evaluated on the host (:func:`host_schedule`), for logging
        each step's learning rate without waiting for the step queued on the accelerator."""
        return host_schedule(self.lr_scheduler(num_train_steps))

    def _check_one_cycle(self, num_train_steps: int) -> None:
        c = self.cycle_length
        if c is None or (not isinstance(c, list) and (c == 1.0 or c >= num_train_steps)):
            return
        raise ValueError(
            f"optimizer.cycle_length={c!r} is not supported: {_NO_CYCLES}. Remove the key, or give a cycle "
            f"covering the whole run (1.0, or >= trainer.num_train_steps={num_train_steps})"
        )

    @abc.abstractmethod
    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        ...

    def with_step_skipping(self, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
        """``optimizer`` wrapped per ``skip_bad_steps`` (unchanged when it is off)."""
        cfg = resolve_skip_bad_steps(self.skip_bad_steps)
        return optimizer if cfg is None else skip_bad_steps(optimizer, cfg)


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
        check_betas(self)
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
        return self.with_step_skipping(optax.chain(*parts))


# Registered here so that parsing an `optimizer:` section knows every type; they import this module.
for _module in ("sophia", "muon"):
    importlib.import_module(f"{__package__}.{_module}")

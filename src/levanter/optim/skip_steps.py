"""``optimizer.skip_bad_steps``: skip an update whose loss or gradient norm is a spike.

Upstream Levanter's option, with its meaning: the optimizer keeps the losses and gradient norms of the
last ``rolling_interval_length`` steps, and once it holds at least half that many (and at least two), a
step whose loss or gradient norm exceeds the window's mean plus ``sigma_factor`` standard deviations is
not applied: the parameters and the wrapped optimizer's state (Adam's moments, its step count) stay as
they were. The step's values still enter the window, so a lasting shift in the loss level stops being a
spike after a while instead of freezing training. ``true`` is a window of 128 steps and 6 sigma; an
integer is the window length; a mapping gives both.

A non-finite loss, gradient or update is a different case, handled by the trainer whatever this says
(``trainer.crash_on_nan`` / ``crash_on_inf`` decide whether the run stops there or skips it): a skipped
step is reverted whole, the window included, so a NaN never enters the statistics.

The wrapper is an ``optax.GradientTransformationExtraArgs``: its ``update`` needs the step's mean loss
as ``loss=``, which the trainer passes to every optimizer that takes extra arguments.
:func:`spike_skipped` reads from the new optimizer state whether this step was skipped, for the
``train/skipped_step`` metric. The window lives in the optimizer state, so it is checkpointed and a
resumed run makes the same decisions; the flip side is that a checkpoint written without
``skip_bad_steps`` does not restore into a run with it (nor the reverse, nor one with another window).
Checkpoints record the setting (:func:`skip_record`), and :func:`check_checkpoint_skip_bad_steps` refuses such
a resume before any work, naming the key and the two ways on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

DEFAULT_WINDOW = 128
DEFAULT_SIGMA = 6.0
_KEYS = ("rolling_interval_length", "sigma_factor")


@dataclasses.dataclass(frozen=True)
class SkipBadSteps:
    """The resolved ``optimizer.skip_bad_steps`` setting (see the module docstring)."""

    rolling_interval_length: int = DEFAULT_WINDOW
    sigma_factor: float = DEFAULT_SIGMA

    @property
    def min_history(self) -> int:
        """Steps of history needed before any step can be skipped."""
        return max(2, self.rolling_interval_length // 2)


def resolve(value: Union[bool, int, Dict[str, Any], None]) -> Optional[SkipBadSteps]:
    """``optimizer.skip_bad_steps`` as given (false/null, true, a window length, or a mapping of
    ``rolling_interval_length`` and ``sigma_factor``) as a :class:`SkipBadSteps`, or None when off.
    Raises ValueError naming the key for anything else."""
    key = "optimizer.skip_bad_steps"
    if value is None or value is False:
        return None
    if value is True:
        return SkipBadSteps()
    if isinstance(value, int):
        return _checked(SkipBadSteps(rolling_interval_length=value), key)
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"{key}: unknown key(s) {', '.join(unknown)}; it takes {' and '.join(_KEYS)}")
        window = value.get("rolling_interval_length", DEFAULT_WINDOW)
        if isinstance(window, float) and window.is_integer():
            window = int(window)  # the Dict[str, float] field reads 64 as 64.0
        if isinstance(window, bool) or not isinstance(window, int):
            raise ValueError(f"{key}.rolling_interval_length must be a whole number of steps, got {window!r}")
        sigma = value.get("sigma_factor", DEFAULT_SIGMA)
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)):
            raise ValueError(f"{key}.sigma_factor must be a number, got {sigma!r}")
        return _checked(SkipBadSteps(rolling_interval_length=window, sigma_factor=float(sigma)), key)
    raise ValueError(
        f"{key} must be true/false, a window length (steps) or {{rolling_interval_length, sigma_factor}}, "
        f"got {value!r}"
    )


def _checked(cfg: SkipBadSteps, key: str) -> SkipBadSteps:
    if cfg.rolling_interval_length < 2:
        raise ValueError(
            f"{key}: the window (rolling_interval_length) must be at least 2 steps, got "
            f"{cfg.rolling_interval_length}: a spike is judged against the mean and spread of earlier steps"
        )
    if not (math.isfinite(cfg.sigma_factor) and cfg.sigma_factor > 0):
        raise ValueError(f"{key}.sigma_factor must be a positive finite number, got {cfg.sigma_factor}")
    return cfg


class SkipBadStepsState(NamedTuple):
    """The wrapped optimizer's state plus the window (a circular buffer) and the last step's decision."""

    inner: Any
    losses: jax.Array  # [window] float32
    grad_norms: jax.Array  # [window] float32
    filled: jax.Array  # [window] bool: which entries hold a step
    next_index: jax.Array  # int32: where the next step's values go
    skipped: jax.Array  # bool: whether the update that produced this state was skipped as a spike


def _mean_std(values: jax.Array, filled: jax.Array) -> tuple[jax.Array, jax.Array]:
    n = jnp.maximum(jnp.sum(filled), 1)
    mean = jnp.sum(jnp.where(filled, values, 0.0)) / n
    var = jnp.sum(jnp.where(filled, (values - mean) ** 2, 0.0)) / n
    # A floor on the spread: with a perfectly flat history any rise at all would otherwise be a spike.
    return mean, jnp.maximum(jnp.sqrt(var), 1e-6)


def skip_bad_steps(inner: optax.GradientTransformation, cfg: SkipBadSteps) -> optax.GradientTransformationExtraArgs:
    """``inner`` with spike skipping (module docstring); its ``update`` needs ``loss=`` (the step's mean loss)."""
    window = cfg.rolling_interval_length

    def init(params):
        return SkipBadStepsState(
            inner=inner.init(params),
            losses=jnp.zeros((window,), jnp.float32),
            grad_norms=jnp.zeros((window,), jnp.float32),
            filled=jnp.zeros((window,), jnp.bool_),
            next_index=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.bool_),
        )

    def update(grads, state: SkipBadStepsState, params=None, *, loss=None, **extra):
        if loss is None:
            raise ValueError("optimizer.skip_bad_steps needs the step's loss: call update(..., loss=...)")
        loss = jnp.asarray(loss, jnp.float32)
        grad_norm = optax.tree.norm(grads).astype(jnp.float32)
        loss_mean, loss_std = _mean_std(state.losses, state.filled)
        norm_mean, norm_std = _mean_std(state.grad_norms, state.filled)
        spike = (loss > loss_mean + cfg.sigma_factor * loss_std) | (
            grad_norm > norm_mean + cfg.sigma_factor * norm_std
        )
        skip = spike & (jnp.sum(state.filled) >= cfg.min_history)
        # The inner update runs either way (one compiled step, no branch); a skipped one is discarded.
        updates, new_inner = inner.update(grads, state.inner, params, **extra)
        updates = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), updates)
        new_inner = jax.tree.map(lambda new, old: jnp.where(skip, old, new), new_inner, state.inner)
        i = state.next_index
        return updates, SkipBadStepsState(
            inner=new_inner,
            losses=state.losses.at[i].set(loss),
            grad_norms=state.grad_norms.at[i].set(grad_norm),
            filled=state.filled.at[i].set(True),
            next_index=(i + 1) % window,
            skipped=skip,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def spike_skipped(opt_state) -> jax.Array:
    """Whether the update that produced ``opt_state`` was skipped by :func:`skip_bad_steps` (False when
    the optimizer has no such wrapper)."""
    found = [s.skipped for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SkipBadStepsState))
             if isinstance(s, SkipBadStepsState)]
    return jnp.any(jnp.stack(found)) if found else jnp.zeros((), jnp.bool_)


# A leaf of the window in a checkpoint's optimizer state (the wrapper is the optimizer's outermost part):
# how a checkpoint written before the setting was recorded shows that it kept one.
WINDOW_LEAF = "opt_state/grad_norms"


def skip_record(value) -> dict:
    """What a checkpoint records of ``optimizer.skip_bad_steps`` (``{"skip_bad_steps": {...}}``, nothing when
    off): the window's length shapes the optimizer state it holds."""
    cfg = resolve(value)
    if cfg is None:
        return {}
    return {"skip_bad_steps": {"rolling_interval_length": cfg.rolling_interval_length,
                               "sigma_factor": cfg.sigma_factor}}


def check_checkpoint_skip_bad_steps(record: dict, holds_window: bool, value, path: str, step: int) -> None:
    """Before any work: ValueError naming ``optimizer.skip_bad_steps`` when the checkpoint at ``path`` (whose
    metadata is ``record``; ``holds_window``: whether its optimizer state holds a window, for checkpoints that
    do not record the setting) was written with the setting off and this run has it on, the reverse, or
    another window length: its optimizer state could not be restored into this run's."""
    mine = resolve(value)
    theirs = record.get("skip_bad_steps")
    had = theirs is not None or holds_window
    their_window = theirs.get("rolling_interval_length") if theirs else None
    if had == (mine is not None) and (mine is None or their_window in (None, mine.rolling_interval_length)):
        return

    def say(window, on):
        if not on:
            return "off"
        return "on" + (f" (a window of {window} steps)" if window is not None else "")

    if had and mine is not None:
        why = "its window of recent losses and gradient norms has another length"
    elif had:
        why = "it holds the window of recent losses and gradient norms that skip_bad_steps keeps"
    else:
        why = "it lacks the window of recent losses and gradient norms that skip_bad_steps keeps"
    if not had:
        as_written = "false"
    else:
        as_written = str(their_window) if their_window is not None else "true (with the window that run used)"
    raise ValueError(
        f"the checkpoint {path} (step {step}) was written with optimizer.skip_bad_steps {say(their_window, had)}, "
        f"but this run has {say(mine.rolling_interval_length if mine else None, mine is not None)}: the "
        f"checkpoint's optimizer state cannot be restored into this run: {why}. To resume, set "
        f"optimizer.skip_bad_steps: {as_written} as the run that wrote it did; to change it, start a new run "
        f"(another trainer.id) with initialize_from_checkpoint_path: {path} (its weights, a fresh optimizer state)."
    )


__all__ = ["SkipBadSteps", "SkipBadStepsState", "WINDOW_LEAF", "check_checkpoint_skip_bad_steps", "resolve",
           "skip_bad_steps", "skip_record", "spike_skipped"]

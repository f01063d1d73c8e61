"""The train step, traced once per batch size: gradients, the optimizer's update, the non-finite guard and
the averaged weights, as one function of ``(state, batch) -> (state, metrics)``.

Its parts live apart: the gradients summed over microbatches (:mod:`.microbatch`), fp8's state that the
backward pass overwrites (:mod:`.fp8`), the averaged copy of the weights (:mod:`.state`), and here the
optimizer's update with its extra arguments and the guard that keeps a non-finite update from ever being
applied or checkpointed.

An optimizer that takes extra arguments (``optax.GradientTransformationExtraArgs``) gets two: ``loss``, the
step's mean loss, and ``obj_fn``, ``params -> mean loss`` of the step's first microbatch (Sophia-H
differentiates it twice for its Hessian estimate); a transformation that does not read one never traces it,
so Adam's compiled step is the same with or without them.

Each step also reports its update's global norm against the parameters' (``update_norm``, ``param_norm``;
:attr:`levanter.training.StepReport.update_ratio`), two global norms fused into reads the step makes anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ..optim.skip_steps import spike_skipped
from .config import TrainerConfig
from .fp8 import apply_update, fp8_state, optimized_params
from .microbatch import Gradients, summed_gradients
from .state import TrainerState, updated_average


def _loss_parts(out) -> tuple:
    """``(sum, count, extra metric sums)`` of a loss function's result, with or without the metrics."""
    if len(out) == 3:
        return out
    total, count = out
    return total, count, {}


def all_finite(tree: Any) -> jax.Array:
    """Whether every float array of ``tree`` is finite (one read of each)."""
    floats = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in floats]))


def non_finite_guard(finite: jax.Array, skips_non_finite: bool) -> Callable[[Any, Any], Any]:
    """``keep(new, old)``: the value a leaf of the state takes after the step.

    The state after a non-finite loss, gradient or update is never evaluated or saved: where the config skips
    such steps (crash_on_nan or crash_on_inf false) the old state is kept, else the host stops the run when
    it reads the step's metrics. Every leaf keeps its dtype: with bfloat16 parameters (mp: bfloat16) the
    float32 updates would otherwise promote the parameters and moments to float32 after the first step, and
    the step would compile again."""
    if skips_non_finite:
        return lambda new, old: jnp.where(finite, new, old).astype(old.dtype)
    # A run that stops at every non-finite step (crash_on_nan and crash_on_inf, the default) never evaluates
    # or saves the state after one, nor keeps anything computed from it: the host raises when it reads the
    # step's metrics, before any of that. Keeping the old state there would cost a select over every
    # parameter and moment (a read of both states and a write, each step).
    return lambda new, old: new.astype(old.dtype)


def _optimizer_update(optimizer, sum_loss: Callable, params: Any, static: Any, opt_state: Any, g: Gradients):
    """``(updates, new optimizer state, the step's mean loss, the mean gradient's global norm)``."""
    denom = jnp.maximum(g.count, 1.0)
    grads = jax.tree.map(lambda x: x / denom, g.grads)
    grad_norm = optax.tree.norm(grads)
    # For optimizers that take extra arguments: the step's mean loss (optimizer.skip_bad_steps) and the
    # objective itself, params -> mean loss of one microbatch, for those that differentiate it again
    # (Sophia-H's Hessian-vector products). A transformation that does not read obj_fn never traces it.
    held = fp8_state(params)  # which the optimizer does not see

    def objective(p):
        t, (c, _) = sum_loss(eqx.combine(p, held), static, g.first_batch)
        return t / jnp.maximum(c, 1.0)

    opt_args = (
        {"loss": g.total / denom, "obj_fn": objective}
        if isinstance(optimizer, optax.GradientTransformationExtraArgs)
        else {}
    )
    updates, new_opt_state = optimizer.update(grads, opt_state, optimized_params(params), **opt_args)
    return updates, new_opt_state, denom, grad_norm


def train_step_fn(*, loss_fn: Callable, optimizer, mp, split_trained: Callable, config: TrainerConfig,
                  n_micro: int, compute_mapping) -> Callable[[TrainerState, Any], tuple]:
    """The step ``(state, batch) -> (state after it, metrics)`` for batches of ``n_micro`` microbatches.

    ``loss_fn(model, batch)`` returns a sum, its token count and optionally a dict of metric sums;
    ``split_trained(model)`` is ``(trained float arrays, the rest)``; ``mp`` the mixed-precision policy."""
    averaging = config.model_averaging
    skips_non_finite = not (config.crash_on_nan and config.crash_on_inf)

    def sum_loss(params, static, micro):
        model = mp.cast_to_compute(eqx.combine(params, static))
        total, count, extra = _loss_parts(loss_fn(model, micro))
        return total.astype(jnp.float32), (count, extra)

    def step(state: TrainerState, batch):
        params, static = split_trained(state.model)
        g = summed_gradients(sum_loss, params, static, batch, n_micro=n_micro, batch_axis=config.batch_axis,
                             compute_mapping=compute_mapping)
        updates, opt_state, denom, grad_norm = _optimizer_update(optimizer, sum_loss, params, static,
                                                                 state.opt_state, g)
        spike = spike_skipped(opt_state)  # skipped as an outlier (optimizer.skip_bad_steps); applies zero
        param_norm = optax.tree.norm(optimized_params(params))
        new_params = apply_update(params, updates, g.overwrites)
        # The change the step applies, read from the new and the old parameters (both held anyway) rather
        # than from ``updates``, which a second reader keeps whole in memory (the 7B plan's figures:
        # docs/guides/planning-a-slice.md).
        update_norm = optax.tree.norm(jax.tree.map(jnp.subtract, optimized_params(new_params),
                                                   optimized_params(params)))
        # A finite loss and gradient can still give a non-finite update (a zero epsilon's 0/0, a learning
        # rate beyond float32's range): the new parameters and optimizer state are checked too, so that no
        # non-finite value is ever applied or checkpointed. One read of the state the step writes anyway, a
        # small share of the step (docs/performance.md).
        update_finite = all_finite((new_params, opt_state))
        finite = jnp.isfinite(g.total) & jnp.isfinite(grad_norm) & update_finite
        keep = non_finite_guard(finite, skips_non_finite)
        new_params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, opt_state, state.opt_state)
        # After the step's update, from the parameters as kept: a step whose update was not applied
        # (non-finite) leaves the average as it was too.
        averaged = updated_average(averaging, state.averaged_model, new_params, keep)
        new_state = TrainerState(state.step + 1, eqx.combine(new_params, static), opt_state, state.training_key,
                                 averaged)
        metrics = {"loss": g.total / denom, "loss_tokens": g.count, "grad_norm": grad_norm,
                   "update_finite": update_finite, "skipped": jnp.logical_not(finite) | spike,
                   "update_norm": update_norm, "param_norm": param_norm,
                   "extra": {k: v.astype(jnp.float32) / denom for k, v in g.extra.items()}}
        return new_state, metrics

    return step


__all__ = ["all_finite", "non_finite_guard", "train_step_fn"]

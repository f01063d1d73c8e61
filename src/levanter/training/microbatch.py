"""Gradient accumulation: a step's batch split into microbatches inside the compiled step.

``trainer.per_device_parallelism`` sets the sequences per device per microbatch; a step of batch size ``B``
then runs ``B / (per_device_parallelism x data-parallel size)`` microbatches (:func:`num_microbatches`) in a
``lax.scan`` and sums their losses, token counts, metric sums and gradients. It never changes which indices
a step reads, and since the loss is a sum with its token count, the step's mean over the whole batch is the
same up to float reduction order. Microbatch ``m`` takes rows ``m, m + n, ...`` of the batch, so each device
keeps contributing its own rows (no data moves between devices to form a microbatch).

fp8's new scales and histories are values, not gradients: across microbatches they are combined by an
elementwise maximum (:func:`levanter.training.fp8.merge_overwrites`), not summed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp

from .config import TrainerConfig
from .fp8 import merge_overwrites, no_overwrites_yet, split_overwrites


def num_microbatches(config: TrainerConfig, batch_size: int) -> int:
    """Microbatches in a step of ``batch_size`` sequences under ``config`` (1 without gradient accumulation)."""
    micro = config.microbatch_size
    if micro is None:
        return 1
    return batch_size // (micro * config.data_axis_size)


class Gradients(NamedTuple):
    """A step's sums over its microbatches: the loss, the loss tokens, the loss's extra metric sums, the
    gradients of the optimized parameters (all but fp8's state), fp8's new state, and the batch the
    objective a second-order optimizer differentiates again is evaluated on (the first microbatch)."""

    total: jax.Array
    count: jax.Array
    extra: dict
    grads: Any
    overwrites: Any
    first_batch: Any


def _is_named(x) -> bool:
    return isinstance(x, hax.NamedArray)


def split_microbatches(batch: Any, n_micro: int, batch_axis: str) -> Any:
    """``batch`` with its batch axis split into ``(batch / n_micro, microbatch)``: microbatch ``m`` is rows
    ``m, m + n_micro, ...``."""

    def split(x):
        if isinstance(x, hax.NamedArray):
            Batch = x.resolve_axis(batch_axis)
            Micro = hax.Axis("microbatch", n_micro)
            return x.unflatten_axis(Batch, (Batch.resize(Batch.size // n_micro), Micro))
        return x

    return jax.tree.map(split, batch, is_leaf=_is_named)


def summed_gradients(sum_loss: Callable, params: Any, static: Any, batch: Any, *, n_micro: int, batch_axis: str,
                     compute_mapping) -> Gradients:
    """The loss ``sum_loss(params, static, batch) -> (sum, (count, extra))`` and its gradient with respect to
    ``params``, summed over ``n_micro`` microbatches of ``batch`` (one pass when ``n_micro`` is 1)."""
    grad_fn = eqx.filter_value_and_grad(sum_loss, has_aux=True)
    if n_micro == 1:
        (total, (count, extra)), grads = grad_fn(params, static, batch)
        overwrites, grads = split_overwrites(grads)
        return Gradients(total, count, extra, grads, overwrites, batch)
    stacked = split_microbatches(batch, n_micro, batch_axis)

    def body(carry, m):
        acc_total, acc_count, acc_extra, acc_grads, acc_ow = carry
        micro = jax.tree.map(lambda x: hax.shard(x["microbatch", m], compute_mapping) if _is_named(x) else x,
                             stacked, is_leaf=_is_named)
        (t, (c, e)), g = grad_fn(params, static, micro)
        ow, g = split_overwrites(g)
        return (acc_total + t, acc_count + c, jax.tree.map(jnp.add, acc_extra, e),
                jax.tree.map(jnp.add, acc_grads, g), merge_overwrites(acc_ow, ow)), None

    overwrites0, optimized0 = split_overwrites(params)
    overwrites0 = no_overwrites_yet(overwrites0)
    zeros = jax.tree.map(jnp.zeros_like, optimized0)
    first = jax.tree.map(lambda x: x["microbatch", 0] if _is_named(x) else x, stacked, is_leaf=_is_named)
    # The extra metrics' structure (traced, not run) for the accumulator's zeros.
    extra_zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, jnp.float32),
        jax.eval_shape(lambda p, b: sum_loss(p, static, b)[1][1], params, first),
    )
    (total, count, extra, grads, overwrites), _ = jax.lax.scan(
        body,
        (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), extra_zeros, zeros, overwrites0),
        jnp.arange(n_micro),
    )
    return Gradients(total, count, extra, grads, overwrites, first)


__all__ = ["Gradients", "num_microbatches", "split_microbatches", "summed_gradients"]

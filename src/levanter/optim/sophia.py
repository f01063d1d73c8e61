"""Sophia-H (``optimizer: {type: sophia-h}``): a clipped, diagonal-Hessian-preconditioned momentum method.

Sophia (Liu et al. 2023, arXiv:2305.14342) keeps Adam's first moment ``m`` but divides it by an exponential
moving average ``h`` of the *Hessian's diagonal* instead of by the root of squared gradients, and clips the
ratio elementwise::

    u = clip(m_hat / max(gamma * h, epsilon), -clip_threshold, clip_threshold)
    theta <- theta - lr * (u + weight_decay * theta)        (decay on matrices only, as AdamW here)

Sophia-H estimates the diagonal with Hutchinson's estimator: for a random probe ``z`` with independent
+/-1 entries (Rademacher), ``E[z * (H z)] = diag(H)``, and ``H z`` is one Hessian-vector product of the
training loss (forward-over-reverse differentiation, about the cost of two gradients). The estimate is
refreshed every ``update_interval`` steps (on steps 0, k, 2k, ...: the step's own estimate preconditions
that step's update, as in the paper's algorithm) and folded into ``h`` with decay ``beta2``; between
refreshes ``h`` is reused. ``h`` carries no bias correction (as upstream and the paper), so the first
updates are mostly clipped, i.e. sign-like, which is why Sophia wants a warmup.

The optimizer needs the loss itself, not only its gradient: its update takes ``obj_fn=`` (an optax
extra argument), a function ``params -> mean loss``. The trainer passes one built on the step's batch;
with gradient accumulation (``trainer.per_device_parallelism`` below the batch) the Hessian-vector product
uses the *first microbatch only*, so a refresh costs one microbatch's HVP, not the whole batch's.

Trade-offs and differences from upstream Levanter's implementation:

* probes are Rademacher, not Gaussian: both are unbiased; Rademacher has the lower variance;
* the probe key is derived from ``rng_seed`` and the number of estimates made so far, not carried in the
  state, so a resumed run draws the probes an uninterrupted one would;
* upstream makes its first estimate after ``update_interval`` steps (its ``h`` is zero until then); here the
  first step makes one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from .config import OptimizerConfig, check_betas, decay_mask

__all__ = ["SophiaHConfig", "SophiaState", "scale_by_sophia_h", "hutchinson_diagonal"]


def hutchinson_diagonal(obj_fn: Callable[[Any], jax.Array], params, key: jax.Array):
    """One Hutchinson estimate ``z * (H z)`` of the diagonal of ``obj_fn``'s Hessian at ``params``, with ``z``
    a Rademacher (+/-1) probe shaped like ``params``; unbiased: its mean over probes is ``diag(H)``."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, max(len(leaves), 1))
    probe = jax.tree.unflatten(
        treedef, [jax.random.rademacher(k, x.shape, jnp.float32).astype(x.dtype) for k, x in zip(keys, leaves)]
    )
    _, hz = jax.jvp(jax.grad(obj_fn), (params,), (probe,))
    return jax.tree.map(lambda z, v: (z * v).astype(z.dtype), probe, hz)


class SophiaState(NamedTuple):
    """``count`` updates made, ``hessian_count`` estimates made, the first moment ``mu`` and the Hessian-diagonal
    average ``h`` (both shaped like the parameters)."""

    count: jax.Array
    hessian_count: jax.Array
    mu: optax.Updates
    h: optax.Updates


def scale_by_sophia_h(
    *,
    beta1: float,
    beta2: float,
    epsilon: float,
    gamma: float,
    clip_threshold: Optional[float],
    update_interval: int,
    rng_seed: int,
) -> optax.GradientTransformationExtraArgs:
    """Sophia-H's preconditioned, clipped direction (no learning rate or weight decay); its update needs
    ``params`` and ``obj_fn`` (``params -> mean loss``) and ignores other extra arguments."""
    base_key = jax.random.PRNGKey(rng_seed)

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return SophiaState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), zeros, zeros)

    def update(grads, state: SophiaState, params=None, *, obj_fn=None, **_extra):
        if params is None or obj_fn is None:
            raise ValueError("Sophia-H's update needs the parameters and obj_fn= (params -> mean loss) for its "
                             "Hessian estimate; the trainer passes both")

        def refresh(h_and_n):
            h, n = h_and_n
            est = hutchinson_diagonal(obj_fn, params, jax.random.fold_in(base_key, n))
            return jax.tree.map(lambda old, new: beta2 * old + (1 - beta2) * new.astype(old.dtype), h, est), n + 1

        h, hessian_count = jax.lax.cond(
            state.count % update_interval == 0, refresh, lambda hn: hn, (state.h, state.hessian_count)
        )
        mu = jax.tree.map(lambda m, g: beta1 * m + (1 - beta1) * g.astype(m.dtype), state.mu, grads)
        correction = 1 - beta1 ** (state.count + 1).astype(jnp.float32)

        def direction(m, hd):
            u = (m / correction.astype(m.dtype)) / jnp.maximum(gamma * hd, epsilon)
            return u if clip_threshold is None else jnp.clip(u, -clip_threshold, clip_threshold)

        updates = jax.tree.map(direction, mu, h)
        return updates, SophiaState(state.count + 1, hessian_count, mu, h)

    return optax.GradientTransformationExtraArgs(init, update)


@OptimizerConfig.register_subclass("sophia-h")
@dataclasses.dataclass(frozen=True)
class SophiaHConfig(OptimizerConfig):
    """Sophia-H: momentum divided by a Hutchinson estimate of the Hessian's diagonal, clipped elementwise
    (levanter.optim.sophia)."""

    # Decay of the first-moment (gradient mean) estimate, in [0, 1).
    beta1: float = 0.96
    # Decay of the Hessian-diagonal average, in [0, 1) (applied once per estimate, every update_interval steps).
    beta2: float = 0.99
    # Floor of the denominator gamma x h (must be positive: h starts at 0).
    epsilon: float = 1e-12
    # Scale of the Hessian in the denominator: the update is m / max(gamma x h, epsilon); must be positive.
    gamma: float = 0.01
    # Clip each element of the preconditioned update to [-clip_threshold, clip_threshold] (positive);
    # null: no clipping.
    clip_threshold: Optional[float] = 1.0
    # Seed of the Hessian estimate's random probes.
    rng_seed: int = 0
    # Steps between Hessian estimates (one Hessian-vector product on one microbatch each); at least 1.
    update_interval: int = 10

    def __post_init__(self):
        super().__post_init__()
        check_betas(self)
        if self.epsilon <= 0:
            raise ValueError(
                f"optimizer.epsilon must be positive, got {self.epsilon}: the Hessian average starts at 0, so "
                "Sophia divides by epsilon until the first estimate, and 0 gives 0/0 = NaN (1e-12 is usual)"
            )
        if self.gamma <= 0:
            raise ValueError(f"optimizer.gamma must be positive, got {self.gamma} (0.01 is usual for Sophia-H)")
        if self.clip_threshold is not None and self.clip_threshold <= 0:
            raise ValueError(f"optimizer.clip_threshold must be positive or null, got {self.clip_threshold}")
        if isinstance(self.update_interval, bool) or not isinstance(self.update_interval, int) \
                or self.update_interval < 1:
            raise ValueError(f"optimizer.update_interval must be a whole number of steps >= 1, got "
                             f"{self.update_interval!r}")

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        schedule = self.lr_scheduler(num_train_steps)
        parts: list = [
            scale_by_sophia_h(
                beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon, gamma=self.gamma,
                clip_threshold=self.clip_threshold, update_interval=self.update_interval, rng_seed=self.rng_seed,
            )
        ]
        # Decay after the clip (it is not clipped), as upstream and the paper's algorithm.
        if self.weight_decay > 0:
            parts.append(optax.add_decayed_weights(self.weight_decay, mask=decay_mask))
        parts.append(optax.scale_by_learning_rate(schedule))
        return self.with_step_skipping(optax.chain(*parts))

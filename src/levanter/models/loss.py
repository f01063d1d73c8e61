"""The softmax normaliser of an output projection, computed over vocabulary blocks.

A language model's loss needs, per token, ``logsumexp_v(h . w_v)`` over the whole vocabulary. Computed
directly, that materialises the ``[tokens, vocab]`` logits (and, for the gradient, a second tensor of the
same size): 4,096 tokens x 128,256 vocabulary entries is 2.1 GB in float32. :func:`blockwise_logsumexp`
instead walks the vocabulary in blocks of ``block_size`` rows of the projection: the forward pass keeps a
running maximum and a running sum of exponentials per token (an online logsumexp), and a ``custom_vjp``
backward pass recomputes each block's logits and softmax to accumulate the gradients of the hidden states
and of the projection block by block. No tensor larger than ``[tokens, block_size]`` is ever live.

Trade-offs: the backward pass recomputes the block logits (one extra ``tokens x vocab x hidden`` matmul,
a third more matmul work than the full loss's forward + backward), and the blocks run one after another
(a ``lax.scan``), so small blocks underuse a wide accelerator; a few thousand entries per block keeps the
matmuls large. The logits are accumulated in float32 whatever the input dtype.

The correct-class logit is not computed here: it is a gather of the target rows of the projection and a
dot with the hidden state (``levanter.models.lm_model``), which autodiff handles without any
``[tokens, vocab]`` tensor.

A vocabulary that is not a multiple of the block size needs no padding (which would copy the projection):
the last block is read at ``vocab - block_size`` and the entries it shares with the previous block are
masked out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["blockwise_logsumexp"]


def blockwise_logsumexp(hidden: jax.Array, weight: jax.Array, block_size: int) -> jax.Array:
    """``logsumexp(hidden @ weight.T, axis=-1)`` in float32, computed over blocks of ``weight``'s rows.

    Args:
        hidden: ``[tokens, hidden]``.
        weight: ``[vocab, hidden]``, the output projection (the unembedding).
        block_size: vocabulary entries per block (clipped to ``vocab``); must be positive.

    Returns:
        ``[tokens]`` float32. Differentiable in ``hidden`` and ``weight``.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [tokens, d] and weight [vocab, d], got {hidden.shape} and {weight.shape}"
        )
    return _lse(hidden, weight, min(block_size, weight.shape[0]))


def _num_blocks(vocab: int, block: int) -> int:
    return -(-vocab // block)


def _block_logits(hidden, weight, b, block: int):
    """Logits of block ``b`` ``[tokens, block]`` (float32), which of its columns are new to this block,
    the first row it read and the rows themselves."""
    vocab = weight.shape[0]
    nominal = b * block
    start = jnp.minimum(nominal, vocab - block)  # the last block ends at the vocabulary's end
    rows = jax.lax.dynamic_slice_in_dim(weight, start, block, axis=0)
    logits = jnp.dot(hidden, rows.T, preferred_element_type=jnp.float32)
    new = (start + jnp.arange(block)) >= nominal  # columns an earlier block did not already count
    return logits, new, start, rows


def _forward(hidden, weight, block: int):
    tokens = hidden.shape[0]

    def body(carry, b):
        running_max, running_sum = carry
        logits, new, _, _ = _block_logits(hidden, weight, b, block)
        logits = jnp.where(new[None, :], logits, -jnp.inf)
        block_max = jnp.max(logits, axis=-1)
        new_max = jnp.maximum(running_max, block_max)
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(
            jnp.exp(logits - new_max[:, None]), axis=-1
        )
        return (new_max, running_sum), None

    init = (jnp.full((tokens,), -jnp.inf, jnp.float32), jnp.zeros((tokens,), jnp.float32))
    (running_max, running_sum), _ = jax.lax.scan(body, init, jnp.arange(_num_blocks(weight.shape[0], block)))
    return running_max + jnp.log(running_sum)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lse(hidden, weight, block: int):
    return _forward(hidden, weight, block)


def _lse_fwd(hidden, weight, block: int):
    log_z = _forward(hidden, weight, block)
    return log_z, (hidden, weight, log_z)


def _lse_bwd(block: int, residuals, g):
    hidden, weight, log_z = residuals
    g = g.astype(jnp.float32)

    def body(carry, b):
        d_hidden, d_weight = carry
        logits, new, start, rows = _block_logits(hidden, weight, b, block)
        # d logsumexp / d logits = softmax; scaled by the cotangent of each token's log_z.
        d_logits = jnp.where(new[None, :], g[:, None] * jnp.exp(logits - log_z[:, None]), 0.0)
        d_hidden = d_hidden + jnp.dot(d_logits, rows, preferred_element_type=jnp.float32)
        d_rows = jnp.dot(d_logits.T, hidden, preferred_element_type=jnp.float32)
        # Added, not written: the last block overlaps the one before it (its shared columns add zeros).
        old = jax.lax.dynamic_slice_in_dim(d_weight, start, block, axis=0)
        d_weight = jax.lax.dynamic_update_slice_in_dim(d_weight, old + d_rows, start, axis=0)
        return (d_hidden, d_weight), None

    init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(weight.shape, jnp.float32))
    (d_hidden, d_weight), _ = jax.lax.scan(body, init, jnp.arange(_num_blocks(weight.shape[0], block)))
    return d_hidden.astype(hidden.dtype), d_weight.astype(weight.dtype)


_lse.defvjp(_lse_fwd, _lse_bwd)

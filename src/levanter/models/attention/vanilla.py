"""The materialised-scores attention kernel (the ``vanilla`` backend): ``O(seq_len**2)`` memory per head,
the fastest on CPU at short sequences, and the only kernel with attention-probability dropout.

Its backward pass is written out (:func:`softmax_attention`, a ``jax.custom_vjp``) in the
flash-attention form, which makes fewer passes over the scores than JAX's derivative. The mask is the
boolean ``[..., position, key_position]`` of :func:`levanter.models.attention.mask.causal_segment_mask`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import haliax as hax
from haliax import Axis, NamedArray

from .mask import HEAD_SIZE, HEADS, KEY_POS, KV_HEADS, POS, Q_PER_GROUP

__all__ = ["causal_attention", "softmax_attention"]

# Large enough to vanish under softmax in float32, small enough not to overflow when added to.
_MASKED_SCORE = -1e9


def causal_attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    mask: NamedArray,
    *,
    scale: float | NamedArray | None = None,
    upcast: bool = True,
    dropout: float = 0.0,
    key=None,
) -> NamedArray:
    """Masked softmax attention; returns ``[..., position, heads, head_size]`` in ``v``'s dtype.

    Args:
        q, k, v: see the module docstring for axes. k and v share their axes.
        mask: boolean, broadcastable to ``[..., position, key_position]`` (from
            :func:`causal_segment_mask`).
        scale: multiplier on the scores; default ``1/sqrt(head_size)``. May be traced (e.g. a
            per-layer factor inside a scan).
        upcast: compute ``q . k`` in float32 (the softmax is float32 regardless).
        dropout: attention-probability dropout, applied only when ``key`` is given.
    """
    if mask.dtype != jnp.bool_:
        raise TypeError(f"attention mask must be boolean, got {mask.dtype}")
    out_dtype = v.dtype
    HeadSize = q.resolve_axis(HEAD_SIZE)
    Heads = q.resolve_axis(HEADS)
    if scale is None:
        scale = 1.0 / (HeadSize.size**0.5)

    k = k.rename({POS: KEY_POS})
    v = v.rename({POS: KEY_POS})

    grouped = k.has_axis(KV_HEADS)
    if grouped:
        KVHeads = k.resolve_axis(KV_HEADS)
        if Heads.size % KVHeads.size != 0:
            raise ValueError(f"{Heads.size} query heads are not divisible into {KVHeads.size} kv heads")
        # kv_heads-major split: query heads [g*G, (g+1)*G) share kv head g.
        q = q.unflatten_axis(HEADS, (KVHeads, Axis(Q_PER_GROUP, Heads.size // KVHeads.size)))

    if upcast:
        q = q.astype(jnp.float32)
        k = k.astype(jnp.float32)
    # Heads ahead of positions, so that both products are plain batched matmuls over
    # [..., heads, position, head_size] and the scores are [..., heads, position, key_position] with the
    # softmax axis innermost. Left in the projections' [..., position, heads, ...] order, XLA on CPU
    # transposes the (seq_len x seq_len per head) scores around the mask and softmax instead, in the
    # forward and the backward pass (docs/bench/2026-12-03-cpu-levers.md). Only the small q/k/v/output tensors are
    # transposed here.
    head_axes = (KV_HEADS, Q_PER_GROUP) if grouped else (HEADS,)
    if dropout > 0.0 and key is not None:
        return _attention_with_dropout(q, k, v, mask, scale, head_axes, dropout, key, out_dtype)

    # The scale goes on q ([..., position, head_size]), not on the seq_len x seq_len scores.
    q = q * scale
    lead = tuple(ax for ax in q.axes if ax.name not in (*head_axes, POS, HEAD_SIZE))
    q = q.rearrange((*lead, *head_axes, POS, HEAD_SIZE))
    k = k.rearrange((*lead, head_axes[0], KEY_POS, HEAD_SIZE))
    v = v.rearrange((*lead, head_axes[0], KEY_POS, HEAD_SIZE))
    Pos, KeyPos = q.resolve_axis(POS), k.resolve_axis(KEY_POS)
    mask_arr = hax.broadcast_to(mask, (*lead, Pos, KeyPos)).array[..., None, :, :]  # [..., 1, q, k]
    q_arr = q.array
    if grouped:
        # A kv head's query group joins the query positions: [..., kv, group * position, head_size].
        group = q.resolve_axis(Q_PER_GROUP).size
        q_arr = q_arr.reshape(*q_arr.shape[:-4], q_arr.shape[-4], group * Pos.size, q_arr.shape[-1])
        grouped_shape = (*mask_arr.shape[:-2], group, Pos.size, KeyPos.size)
        mask_arr = jnp.broadcast_to(mask_arr[..., None, :, :], grouped_shape)
        mask_arr = mask_arr.reshape(*mask_arr.shape[:-3], group * Pos.size, KeyPos.size)
    out_arr = softmax_attention(q_arr, k.array, v.array, mask_arr)
    out = hax.named(out_arr.reshape(q.array.shape[:-1] + (v.array.shape[-1],)), q.axes)
    if grouped:
        out = out.flatten_axes((KV_HEADS, Q_PER_GROUP), HEADS)
    return out.rearrange((..., POS, HEADS, HEAD_SIZE)).astype(out_dtype)


def _attention_with_dropout(q, k, v, mask, scale, head_axes, dropout, key, out_dtype):
    """The differentiated-by-JAX path, for attention-probability dropout (training with a key)."""
    q = q.rearrange((..., *head_axes, POS, HEAD_SIZE))
    k = k.rearrange((..., *head_axes[:1], KEY_POS, HEAD_SIZE))
    v = v.rearrange((..., *head_axes[:1], KEY_POS, HEAD_SIZE))
    scores = hax.dot(q, k, axis=HEAD_SIZE, preferred_element_type=jnp.float32).astype(jnp.float32)
    scores = scores.rearrange((..., *head_axes, POS, KEY_POS)) * scale
    scores = hax.where(mask, scores, _MASKED_SCORE).rearrange((..., *head_axes, POS, KEY_POS))
    weights = hax.nn.softmax(scores, axis=KEY_POS)
    weights = hax.nn.dropout(weights, dropout, inference=False, key=key)
    out = hax.dot(weights.astype(out_dtype), v, axis=KEY_POS).rearrange((..., *head_axes, POS, HEAD_SIZE))
    if len(head_axes) == 2:
        out = out.flatten_axes(head_axes, HEADS)
    return out.rearrange((..., POS, HEADS, HEAD_SIZE)).astype(out_dtype)


def _probabilities(q, k, mask):
    scores = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores, _MASKED_SCORE)
    unnormalised = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    return unnormalised / jnp.sum(unnormalised, axis=-1, keepdims=True)


@jax.custom_vjp
def softmax_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """``softmax(where(mask, q . k, -1e9)) . v`` over arrays ``q [..., Q, D]``, ``k [..., K, D]``,
    ``v [..., K, Dv]`` and a boolean ``mask`` broadcastable to ``[..., Q, K]`` (no scale applied).

    The probabilities are float32. The backward pass is written out (the flash-attention form) rather
    than derived by JAX: the softmax's row sums ``sum_k dP * P`` equal ``sum_d dO * O``, a product over
    the small output instead of another pass over the ``Q x K`` scores, and a masked entry has
    probability exactly 0, so the mask needs no pass of its own either. On CPU, where these passes over
    memory dominate a small model's attention, this is faster than JAX's derivative of the same forward
    (docs/bench/2026-12-03-cpu-levers.md); the gradients agree to float32 rounding (tests/models/test_models.py).
    """
    return _attention_fwd(q, k, v, mask)[0]


def _attention_fwd(q, k, v, mask):
    p = _probabilities(q, k, mask)
    out = jnp.einsum("...qk,...kd->...qd", p.astype(v.dtype), v)
    return out, (q, k, v, p, out)


def _attention_bwd(residuals, d_out):
    q, k, v, p, out = residuals
    d_v = jnp.einsum("...qk,...qd->...kd", p.astype(d_out.dtype), d_out, preferred_element_type=jnp.float32)
    d_p = jnp.einsum("...qd,...kd->...qk", d_out, v, preferred_element_type=jnp.float32)
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    d_scores = p * (d_p - row)
    d_q = jnp.einsum("...qk,...kd->...qd", d_scores, k, preferred_element_type=jnp.float32)
    d_k = jnp.einsum("...qk,...qd->...kd", d_scores, q, preferred_element_type=jnp.float32)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


softmax_attention.defvjp(_attention_fwd, _attention_bwd)

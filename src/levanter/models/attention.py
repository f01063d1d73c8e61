"""Causal dot-product attention with packed-sequence (segment id) masking and grouped-query heads.

Position ``q`` may attend to key position ``k`` iff ``k <= q`` and, when segment ids are given,
``segment_ids[q] == segment_ids[k]``. The mask is built once per forward pass
(:func:`causal_segment_mask`, boolean ``[..., position, key_position]``) and shared by every layer.

Trade-offs: this is the plain materialised-scores implementation (``O(seq_len**2)`` memory per head),
chosen for correctness and portability; there is no flash/splash kernel. It is fully traceable (no
Python control flow on values), so it works under jit, scan-over-layers and remat. Scores are
masked with a large finite negative number, not ``-inf``: every query can see at least itself, but
a finite value also keeps fully masked rows (which cannot occur here) NaN-free. The softmax always
runs in float32; ``upcast`` additionally computes the ``q . k`` product in float32.

Axis names: queries ``[..., position, heads, head_size]``; keys/values either
``[..., position, heads, head_size]`` (multi-head) or ``[..., position, kv_heads, head_size]``
(grouped-query: ``heads`` is split into ``kv_heads x q_heads_per_group``, so query head ``h`` uses
key/value head ``h // (heads // kv_heads)``, the Hugging Face ``repeat_kv`` convention).
"""

from __future__ import annotations

import jax.numpy as jnp

import haliax as hax
from haliax import Axis, NamedArray

POS = "position"
KEY_POS = "key_position"
HEADS = "heads"
KV_HEADS = "kv_heads"
Q_PER_GROUP = "q_heads_per_group"
HEAD_SIZE = "head_size"

# Large enough to vanish under softmax in float32, small enough not to overflow when added to.
_MASKED_SCORE = -1e9


def causal_segment_mask(Pos: Axis, segment_ids: NamedArray | None = None) -> NamedArray:
    """Boolean ``[..., position, key_position]``: true where attention is allowed."""
    KeyPos = Axis(KEY_POS, Pos.size)
    # haliax only broadcasts when one operand's axes contain the other's, so add axes explicitly.
    mask = hax.arange(Pos).broadcast_axis(KeyPos) >= hax.arange(KeyPos)
    if segment_ids is not None:
        same_segment = segment_ids.broadcast_axis(KeyPos) == segment_ids.rename({POS: KEY_POS})
        mask = mask & same_segment
    return mask.rearrange((..., POS, KEY_POS))


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
    scores = hax.dot(q, k, axis=HEAD_SIZE, preferred_element_type=jnp.float32).astype(jnp.float32)
    scores = scores * scale
    scores = hax.where(mask, scores, _MASKED_SCORE)
    weights = hax.nn.softmax(scores, axis=KEY_POS)
    if dropout > 0.0 and key is not None:
        weights = hax.nn.dropout(weights, dropout, inference=False, key=key)

    out = hax.dot(weights.astype(out_dtype), v, axis=KEY_POS)
    if grouped:
        out = out.flatten_axes((KV_HEADS, Q_PER_GROUP), HEADS)
    return out.rearrange((..., POS, HEADS, HEAD_SIZE)).astype(out_dtype)

"""Blockwise ("flash") causal attention in pure JAX: online softmax over key blocks, recomputed per block
in the backward pass, so no ``[position, key_position]`` tensor larger than one block pair exists.

:func:`blockwise_attention` works on plain arrays laid out ``q [batch, kv_heads, group, position,
head_size]``, ``k``/``v [batch, kv_heads, key_position, head_size]`` (grouped-query heads share a kv head
across ``group`` query heads; multi-head attention is ``group = 1``) and optional integer
``segment_ids [batch, position]`` (packed documents: attention stays within a segment). The scores are
not scaled here; callers scale ``q``. An optional sliding ``window`` limits each query to its own and the
``window - 1`` preceding positions; key blocks wholly outside it are skipped in both passes, so the work
grows with ``position * window`` rather than ``position ** 2``.

How it works. The sequence is cut into blocks of ``block_size`` positions (padded up to a multiple; the
padding is sliced off again). For query block ``i`` the forward pass visits key blocks ``0..i`` only
(blocks above the diagonal are fully masked by causality and skipped, about half the work at long
sequences), keeping per query row a running maximum, a running normaliser and an unnormalised output
(the online softmax). It saves the output and the row's log-normaliser (``O(position)``), never the
probabilities. The backward pass (a ``jax.custom_vjp``) visits each key block ``j`` once, and within it
the query blocks ``j..last``: it recomputes the block's probabilities from the saved log-normaliser and
accumulates ``dk``/``dv`` for the key block and ``dq`` for the query block (one recomputation of the
scores, the FlashAttention-2 order).

Trade-offs. Peak temporaries are a few ``[batch, heads, block, block]`` float32 arrays instead of
``[batch, heads, position, key_position]``; the price is a sequential loop over block pairs (XLA cannot
fuse across iterations) and recomputing the scores in the backward pass. On CPU at short sequences the
materialised kernel (``levanter.models.attention.vanilla``) is faster; at 4,096 positions blockwise is
close in time with a fraction of the memory (docs/bench/2026-12-03-attention-and-loss.md). Scores and the
softmax are float32 whatever the input dtype; masked scores are a large finite negative number (as in the
materialised kernel), so a row whose earlier key blocks are all masked stays NaN-free and is corrected by
the first visible key. Attention-probability dropout is not supported (the materialised kernel has it).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["blockwise_attention"]

_MASKED_SCORE = -1e9


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    block_size: int,
    window: int | None = None,
) -> jax.Array:
    """Causal ``softmax(q . k + mask) . v`` computed block by block; returns ``[batch, kv_heads, group,
    position, head_size]`` in ``v``'s dtype. See the module docstring for layouts."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if q.ndim != 5 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected q [b, kv, g, L, d] and k/v [b, kv, L, d], got {q.shape}, {k.shape}, {v.shape}")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"window must be a positive integer, got {window!r}")
    block = min(block_size, q.shape[3])
    return _blockwise(q, k, v, segment_ids, block, window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blockwise(q, k, v, segment_ids, block, window):
    return _forward(q, k, v, segment_ids, block, window)[0]


def _num_blocks(length: int, block: int) -> int:
    return math.ceil(length / block)


def _to_blocks(x: jax.Array, axis: int, block: int, fill=0) -> jax.Array:
    """Pad ``axis`` up to a multiple of ``block`` and split it into ``[num_blocks, ..., block, ...]``
    with the block index leading (so a loop picks block ``i`` with one dynamic index)."""
    length = x.shape[axis]
    nb = _num_blocks(length, block)
    pad = nb * block - length
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths, constant_values=fill)
    x = x.reshape(x.shape[:axis] + (nb, block) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _from_blocks(x: jax.Array, axis: int, length: int) -> jax.Array:
    """Inverse of :func:`_to_blocks`: ``[num_blocks, ...]`` back to ``axis`` of ``length`` positions."""
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])
    return lax.slice_in_dim(x, 0, length, axis=axis)


def _first_key_block(i, block, window):
    """The first key block that query block ``i`` can see (0 without a window)."""
    if window is None:
        return 0
    return jnp.maximum(0, (i * block - (window - 1)) // block)


def _query_block_end(j, block, window, nb):
    """One past the last query block that sees key block ``j`` (all blocks without a window)."""
    if window is None:
        return nb
    return jnp.minimum(nb, ((j + 1) * block - 1 + window - 1) // block + 1)


def _block_scores(qi, kj, i, j, block, seg_q, seg_k, window):
    """float32 masked scores ``[b, kv, g, block, block]`` of query block ``i`` against key block ``j``."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kj, preferred_element_type=jnp.float32)
    q_pos = i * block + jnp.arange(block)
    k_pos = j * block + jnp.arange(block)
    distance = q_pos[:, None] - k_pos[None, :]
    mask = distance >= 0  # [block, block]; all true below the diagonal
    if window is not None:
        mask = mask & (distance < window)
    if seg_q is not None:
        same = seg_q[:, :, None] == seg_k[:, None, :]  # [b, block, block]
        mask = mask[None] & same
        mask = mask[:, None, None]
    return jnp.where(mask, s, _MASKED_SCORE)


def _forward(q, k, v, segment_ids, block, window):
    length = q.shape[3]
    nb = _num_blocks(length, block)
    qb = _to_blocks(q, 3, block)  # [nb, b, kv, g, block, d]
    kb = _to_blocks(k, 2, block)  # [nb, b, kv, block, d]
    vb = _to_blocks(v, 2, block)
    # Padded positions get segment -1: they see each other (no empty rows) and, lying after every real
    # position, are invisible to real queries by causality.
    segb = None if segment_ids is None else _to_blocks(segment_ids, 1, block, fill=-1)  # [nb, b, block]
    row_shape = qb.shape[1:-1]  # [b, kv, g, block]

    def query_block(i):
        qi = qb[i]
        seg_q = None if segb is None else segb[i]

        def key_block(j, carry):
            m, l, acc = carry
            seg_k = None if segb is None else segb[j]
            s = _block_scores(qi, kb[j], i, j, block, seg_q, seg_k, window)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            l = l * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), vb[j], preferred_element_type=jnp.float32)
            return m_new, l, acc * alpha[..., None] + pv

        init = (
            jnp.full(row_shape, -jnp.inf, jnp.float32),
            jnp.zeros(row_shape, jnp.float32),
            jnp.zeros(row_shape + (v.shape[-1],), jnp.float32),
        )
        # Key blocks after i are fully masked by causality: the loop stops at the diagonal (and, with a
        # window, starts at the first block the window reaches).
        m, l, acc = lax.fori_loop(_first_key_block(i, block, window), i + 1, key_block, init)
        return (acc / l[..., None]).astype(v.dtype), m + jnp.log(l)

    out_b, lse_b = lax.map(query_block, jnp.arange(nb))
    out = _from_blocks(out_b, 3, length)
    lse = _from_blocks(lse_b, 3, length)
    return out, (q, k, v, segment_ids, out, lse)


def _forward_rule(q, k, v, segment_ids, block, window):
    return _forward(q, k, v, segment_ids, block, window)


def _backward_rule(block, window, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    length = q.shape[3]
    nb = _num_blocks(length, block)
    # sum_k dP * P per row equals sum_d dO * O: a product over the small output, not the scores.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    qb = _to_blocks(q, 3, block)
    dob = _to_blocks(d_out, 3, block)
    lseb = _to_blocks(lse, 3, block)
    deltab = _to_blocks(delta, 3, block)
    kb = _to_blocks(k, 2, block)
    vb = _to_blocks(v, 2, block)
    segb = None if segment_ids is None else _to_blocks(segment_ids, 1, block, fill=-1)

    def key_block(dq, j):
        kj, vj = kb[j], vb[j]
        seg_k = None if segb is None else segb[j]

        def query_block(i, carry):
            dq, dk, dv = carry
            qi, doi = qb[i], dob[i]
            seg_q = None if segb is None else segb[i]
            s = _block_scores(qi, kj, i, j, block, seg_q, seg_k, window)
            p = jnp.exp(s - lseb[i][..., None])  # masked entries are exactly 0
            dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - deltab[i][..., None])
            dq = dq.at[i].add(jnp.einsum("bhgqk,bhkd->bhgqd", ds, kj, preferred_element_type=jnp.float32))
            dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds, qi, preferred_element_type=jnp.float32)
            return dq, dk, dv

        zeros_k = jnp.zeros(kj.shape, jnp.float32)
        zeros_v = jnp.zeros(vj.shape, jnp.float32)
        # Query blocks before j see none of key block j (causality): the loop starts at the diagonal (and,
        # with a window, stops after the last block the window reaches back from).
        dq, dk, dv = lax.fori_loop(j, _query_block_end(j, block, window, nb), query_block, (dq, zeros_k, zeros_v))
        return dq, (dk, dv)

    dq0 = jnp.zeros(qb.shape, jnp.float32)
    dq_b, (dk_b, dv_b) = lax.scan(key_block, dq0, jnp.arange(nb))
    d_q = _from_blocks(dq_b, 3, length).astype(q.dtype)
    d_k = _from_blocks(dk_b, 2, length).astype(k.dtype)
    d_v = _from_blocks(dv_b, 2, length).astype(v.dtype)
    return d_q, d_k, d_v, None


_blockwise.defvjp(_forward_rule, _backward_rule)

"""Causal attention through cuDNN's fused kernel (``jax.nn.dot_product_attention(implementation="cudnn")``),
on NVIDIA GPUs only: the ``cudnn`` backend.

cuDNN takes bfloat16/float16 queries, keys and values and head sizes up to 128 that are a multiple of 8
(:func:`cudnn_shapes_ok`, which ``default`` asks before choosing it). Packed segments reach it as a
boolean mask; cuDNN's own fused kernel still never materialises the scores. The arrays are laid out as
:func:`levanter.models.attention.jax_flash.blockwise_attention` takes them (``q`` already scaled).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["cudnn_shapes_ok", "cudnn_attention"]


def cudnn_shapes_ok(dtype, head_size: Optional[int]) -> bool:
    """Whether cuDNN's kernel takes activations of ``dtype`` and heads of ``head_size`` (None: not known yet)."""
    dtype_ok = dtype is None or jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return dtype_ok and (head_size is None or (head_size <= 128 and head_size % 8 == 0))


def cudnn_attention(q, k, v, segment_ids=None, window: Optional[int] = None) -> jax.Array:
    """Causal attention through cuDNN's fused kernel (``jax.nn.dot_product_attention``); same layouts;
    ``window`` becomes cuDNN's local window (the query and the ``window - 1`` positions before it)."""
    b, kv_heads, group, seq_len, head_size = q.shape
    if not cudnn_shapes_ok(q.dtype, head_size) or q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(
            f"model.attn_backend 'cudnn' needs bfloat16 or float16 q/k/v (got {q.dtype}/{k.dtype}/{v.dtype}; "
            f"set model.upcast_attn: false and a half-precision trainer.mp) and a head size <= 128 that is a "
            f"multiple of 8 (got {head_size}); use jax_flash otherwise"
        )
    # [b, position, heads, head_size]; kv-major head order matches jax's grouped-query convention.
    q_t = q.reshape(b, kv_heads * group, seq_len, head_size).transpose(0, 2, 1, 3)
    k_t, v_t = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [b, 1, q, k]
    out = jax.nn.dot_product_attention(
        q_t, k_t, v_t, mask=mask, scale=1.0, is_causal=True, implementation="cudnn",
        local_window_size=None if window is None else (window - 1, 0),
    )
    return out.transpose(0, 2, 1, 3).reshape(b, kv_heads, group, seq_len, -1)

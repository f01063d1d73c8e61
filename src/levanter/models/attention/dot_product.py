"""The entry point every model calls, :func:`dot_product_attention`: causal attention through the backend an
:class:`~levanter.models.attention.mask.AttentionMask` names.

``vanilla`` works on the named arrays; the array kernels (``jax_flash``, ``splash``, ``cudnn``) take plain
arrays laid out ``q [b, kv_heads, group, position, head_size]``, ``k``/``v [b, kv_heads, position,
head_size]`` with ``b`` the flattened leading axes and ``q`` already scaled, which :func:`_head_arrays`
builds once and turns back into named output.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

import haliax as hax
from haliax import NamedArray

from .backends import ATTN_BACKENDS, attention_platform, check_backend_platform
from .cudnn import cudnn_attention
from .jax_flash import blockwise_attention
from .mask import HEAD_SIZE, HEADS, KV_HEADS, POS, AttentionMask, causal_segment_mask
from .splash import current_mesh, splash_attention
from .vanilla import causal_attention

__all__ = ["dot_product_attention"]


def dot_product_attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    mask: AttentionMask,
    *,
    scale: float | NamedArray | None = None,
    upcast: bool = True,
    dropout: float = 0.0,
    key=None,
) -> NamedArray:
    """Causal attention through ``mask.backend``; returns ``[..., position, heads, head_size]`` in
    ``v``'s dtype. Arguments as :func:`causal_attention`. Dropout needs the ``vanilla`` backend."""
    backend = mask.backend
    if backend == "vanilla":
        full = mask.materialized
        if full is None:
            full = causal_segment_mask(q.resolve_axis(POS), mask.segment_ids, mask.window)
        return causal_attention(q, k, v, full, scale=scale, upcast=upcast, dropout=dropout, key=key)
    if dropout > 0.0 and key is not None:
        raise ValueError(
            f"model.attn_backend {backend!r} has no attention dropout; set model.attn_pdrop: 0 or use vanilla"
        )
    platform = attention_platform()
    check_backend_platform(backend, platform)
    q5, k4, v4, seg, rebuild = _head_arrays(q, k, v, mask.segment_ids, scale, upcast)
    if backend == "jax_flash":
        out = blockwise_attention(q5, k4, v4, seg, block_size=mask.block_size, window=mask.window)
    elif backend == "splash":
        batch_axes, head_axis = _shard_specs(q, k)
        out = splash_attention(q5, k4, v4, seg, block_size=mask.block_size, block_sizes=mask.splash_block_sizes,
                               interpret=platform != "tpu", window=mask.window, batch_axes=batch_axes,
                               head_axis=head_axis)
    elif backend == "cudnn":
        out = cudnn_attention(q5, k4, v4, seg, window=mask.window)
    else:
        raise ValueError(f"model.attn_backend {backend!r} is not one of {list(ATTN_BACKENDS)}")
    return rebuild(out.astype(v.dtype))


def _shard_specs(q: NamedArray, k: NamedArray) -> tuple[Optional[object], Optional[str]]:
    """The mesh axes (haliax's current mapping) that the kernel's flattened batch dimension and its key/value
    head dimension are sharded over, each None where it is not (or cannot be) sharded. The batch is the
    leading axes flattened: their mesh axes in order, where the sharded ones come first (a flattened
    dimension is sharded block-wise only then); heads where the key/value heads divide over their axis."""
    mapping = hax.partitioning.current_thread_local_mapping() or {}
    mesh = current_mesh()
    if mesh is None:
        return None, None
    lead = [ax for ax in q.axes if ax.name not in (HEADS, POS, HEAD_SIZE)]
    physical = []
    for i, ax in enumerate(lead):
        name = mapping.get(ax.name)
        names = () if name is None else ((name,) if isinstance(name, str) else tuple(name))
        if names and any(mapping.get(a.name) is None for a in lead[:i]):
            physical = []  # sharded behind an unsharded axis: not a block of the flattened dimension
            break
        physical.extend(names)
    batch = tuple(physical) if len(physical) > 1 else (physical[0] if physical else None)
    kv_name = KV_HEADS if k.has_axis(KV_HEADS) else HEADS
    heads = mapping.get(kv_name)
    if isinstance(heads, str) and k.resolve_axis(kv_name).size % mesh.shape[heads] == 0:
        return batch, heads
    return batch, None


def _head_arrays(q, k, v, segment_ids, scale, upcast):
    """Plain arrays ``q [b, kv_heads, group, position, head_size]``, ``k``/``v [b, kv_heads, position,
    head_size]`` and ``segment_ids [b, position]`` (or None), with ``b`` the flattened leading axes, and
    the function that turns ``[b, kv_heads, group, position, head_size]`` back into a named output."""
    HeadSize, Heads, Pos = q.resolve_axis(HEAD_SIZE), q.resolve_axis(HEADS), q.resolve_axis(POS)
    if scale is None:
        scale = 1.0 / (HeadSize.size**0.5)
    grouped = k.has_axis(KV_HEADS)
    kv_name = KV_HEADS if grouped else HEADS
    kv_heads = k.resolve_axis(kv_name).size
    if Heads.size % kv_heads != 0:
        raise ValueError(f"{Heads.size} query heads are not divisible into {kv_heads} kv heads")
    if upcast:
        q = q.astype(jnp.float32)
        k = k.astype(jnp.float32)
    q = q * scale
    lead = tuple(ax for ax in q.axes if ax.name not in (HEADS, POS, HEAD_SIZE))
    b = math.prod(ax.size for ax in lead)
    group = Heads.size // kv_heads
    q_arr = q.rearrange((*lead, HEADS, POS, HEAD_SIZE)).array.reshape(b, kv_heads, group, Pos.size, HeadSize.size)

    def with_lead(x):
        missing = tuple(ax for ax in lead if not x.has_axis(ax.name))
        return x.broadcast_axis(missing) if missing else x

    k_arr = with_lead(k).rearrange((*lead, kv_name, POS, HEAD_SIZE)).array
    v_named = with_lead(v).rearrange((*lead, kv_name, POS, HEAD_SIZE))
    k_arr = k_arr.reshape(b, kv_heads, Pos.size, k_arr.shape[-1])
    v_arr = v_named.array.reshape(b, kv_heads, Pos.size, v_named.array.shape[-1])
    seg = None
    if segment_ids is not None:
        seg = with_lead(segment_ids).rearrange((*lead, POS)).array.reshape(b, Pos.size).astype(jnp.int32)
    VHead = v_named.resolve_axis(HEAD_SIZE)

    def rebuild(out: jax.Array) -> NamedArray:
        arr = out.reshape(*(ax.size for ax in lead), Heads.size, Pos.size, VHead.size)
        return hax.named(arr, (*lead, Heads, Pos, VHead)).rearrange((..., POS, HEADS, HEAD_SIZE))

    return q_arr, k_arr, v_arr, seg, rebuild

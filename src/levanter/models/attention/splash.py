"""Causal attention through JAX's Pallas splash kernel (the ``splash`` backend, on TPU) and the kernel's
tiles (``model.splash_block_sizes``).

The tiles are ``model.flash_attention_block_size`` in every dimension unless ``model.splash_block_sizes``
(:class:`SplashBlockSizes`) sets the forward and backward kernels' tiles one by one: a speed knob only (the
same attention up to float rounding). :func:`resolve_splash_block_sizes` checks them against the sequence
length (the model config runs it at load, naming the key at fault). Off TPU the kernel runs only in
Pallas's slow interpret mode, which the tests use.

The kernel is one custom call that XLA cannot partition (JAX refuses to lower it on a mesh of several
devices), so on such a mesh it runs per shard under ``shard_map``: over the batch and the key/value heads,
along which attention needs no communication. On one device it is called as it is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from .backends import DEFAULT_FLASH_BLOCK_SIZE

__all__ = ["SplashBlockSizes", "current_mesh", "resolve_splash_block_sizes", "splash_attention", "splash_kernel"]


@dataclasses.dataclass(frozen=True)
class SplashBlockSizes:
    """The splash kernel's tiles, forward and backward, one by one (a speed knob: the attention is the
    same up to float rounding). A null field takes model.flash_attention_block_size's block (a *_compute
    one its parent's); a value over the sequence length is cut to it. Each must divide the sequence and be
    a multiple of 128 (the TPU's lane width) unless it is the whole sequence; a *_compute tile must divide
    its parent."""

    # Query positions per block of the forward kernel.
    block_q: Optional[int] = None
    # Key/value positions per block the forward kernel loads.
    block_kv: Optional[int] = None
    # Key/value positions per inner step of the forward kernel (divides block_kv; null: block_kv).
    block_kv_compute: Optional[int] = None
    # Query positions per block of the fused backward kernel (dq, dk and dv).
    block_q_dkv: Optional[int] = None
    # Key/value positions per block of the fused backward kernel.
    block_kv_dkv: Optional[int] = None
    # Key/value positions per inner step of the backward kernel (divides block_kv_dkv; null: block_kv_dkv).
    block_kv_dkv_compute: Optional[int] = None


# The fields in splash's BlockSizes order; a *_compute tile's parent is the block it steps through.
_SPLASH_FIELDS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute")
_SPLASH_COMPUTE_PARENT = {"block_kv_compute": "block_kv", "block_kv_dkv_compute": "block_kv_dkv"}
_SPLASH_LANES = 128


def _splash_choices(seq_len: int) -> str:
    """The tiles a sequence of ``seq_len`` positions admits (multiples of 128 dividing it, or itself), for errors."""
    ok = [b for b in range(_SPLASH_LANES, seq_len + 1, _SPLASH_LANES) if seq_len % b == 0] or [seq_len]
    return ", ".join(map(str, ok[:6])) + (", ..." if len(ok) > 6 else "")


def resolve_splash_block_sizes(seq_len: int, block_size: Optional[int], sizes: Optional[SplashBlockSizes]) -> dict:
    """The six splash tiles for a sequence of ``seq_len`` positions: ``sizes``'s fields where set (cut to
    ``seq_len``), else the largest divisor of ``seq_len`` up to ``block_size`` (today's one block) or, for
    a ``*_compute`` field, its parent's. Refuses a value that is not a positive integer, does not divide
    the sequence, is not a multiple of 128 (unless the whole sequence) or, for a ``*_compute`` field, does
    not divide its parent, naming the key ``model.splash_block_sizes.<field>``."""
    shared = _splash_block(seq_len, block_size if block_size is not None else DEFAULT_FLASH_BLOCK_SIZE)
    out = {}
    for name in _SPLASH_FIELDS:
        value = getattr(sizes, name) if sizes is not None else None
        parent = _SPLASH_COMPUTE_PARENT.get(name)
        if value is None:
            out[name] = out[parent] if parent is not None else shared
            continue
        key = f"model.splash_block_sizes.{name}"
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{key} must be a positive number of positions, or null for the default, got {value!r}")
        block = min(value, seq_len)
        if seq_len % block:
            raise ValueError(
                f"{key}={value} does not divide the sequence length {seq_len} (the splash kernel tiles the "
                f"sequence into whole blocks); use one of {_splash_choices(seq_len)}, or null"
            )
        if block % _SPLASH_LANES and block != seq_len:
            raise ValueError(
                f"{key}={value} is not a multiple of {_SPLASH_LANES} (the TPU's lane width, which the splash "
                f"kernel's tiles must be); use one of {_splash_choices(seq_len)}, or null"
            )
        if parent is not None and out[parent] % block:
            raise ValueError(
                f"{key}={value} does not divide model.splash_block_sizes.{parent} ({out[parent]}): the kernel "
                f"steps through each {parent} block in whole {name} steps; use a divisor of it, or null"
            )
        out[name] = block
    return out


def _splash_block(seq_len: int, block_size: int) -> int:
    """The largest block up to ``block_size`` that divides ``seq_len`` (the splash kernel needs one)."""
    block = min(block_size, seq_len)
    while seq_len % block:
        block -= 1
    return block


def current_mesh():
    """The mesh a step is traced for (JAX's abstract mesh: ``jax.set_mesh``, as the trainer enters it, or
    ``jax.sharding.use_abstract_mesh``); None without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def splash_attention(
    q, k, v, segment_ids=None, *, block_size: int, block_sizes: Optional[SplashBlockSizes] = None,
    interpret: bool = False, window: Optional[int] = None, batch_axes=None, head_axis: Optional[str] = None,
) -> jax.Array:
    """Causal attention through JAX's Pallas splash kernel (see :func:`splash_kernel`), per shard on a mesh
    of several devices (:func:`current_mesh`): ``batch_axes`` are the mesh axes (a name or a tuple of
    names) ``q``'s first dimension is sharded over, ``head_axis`` the one its key/value heads are; None
    where an axis is whole on each device. Attention is independent per sequence and per key/value head,
    so the shards need no communication."""
    kernel = functools.partial(splash_kernel, block_size=block_size, block_sizes=block_sizes, interpret=interpret,
                               window=window)
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return kernel(q, k, v, segment_ids)
    spec5 = PartitionSpec(batch_axes, head_axis, None, None, None)
    spec4 = PartitionSpec(batch_axes, head_axis, None, None)
    if segment_ids is None:
        return jax.shard_map(lambda a, b, c: kernel(a, b, c, None), mesh=mesh, in_specs=(spec5, spec4, spec4),
                             out_specs=spec5, check_vma=False)(q, k, v)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(spec5, spec4, spec4, PartitionSpec(batch_axes, None)),
                         out_specs=spec5, check_vma=False)(q, k, v, segment_ids)


def splash_kernel(
    q, k, v, segment_ids=None, *, block_size: int, block_sizes: Optional[SplashBlockSizes] = None,
    interpret: bool = False, window: Optional[int] = None,
) -> jax.Array:
    """Causal attention through JAX's Pallas splash kernel, on the array layout of
    :func:`levanter.models.attention.jax_flash.blockwise_attention` (``q`` already scaled). The kernel's
    tiles: ``block_sizes``'s where set, else ``block_size`` (:func:`resolve_splash_block_sizes`).
    ``interpret`` runs the kernel in Pallas's interpreter (any platform; slow, for tests). ``window``:
    each query sees only its own and the ``window - 1`` positions before it (splash's local mask).

    The backward pass is splash's fused kernel (dq, dk and dv from one pass over the score blocks, where
    the separate kernels compute the scores twice). Grouped-query heads go to splash's multi-query kernel,
    one call per key/value head over its group of query heads, so keys and values are never repeated per
    query head. The kernel's residuals are marked ``context`` for the named remat policies
    (``levanter.models.layers.SAVED_NAMES``)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, kv_heads, group, seq_len, head_size = q.shape
    sizes = sk.BlockSizes(**resolve_splash_block_sizes(seq_len, block_size, block_sizes), use_fused_bwd_kernel=True)
    dtype = q.dtype
    k, v = k.astype(dtype), v.astype(dtype)

    def head_mask():
        if window is None:
            return sm.CausalMask((seq_len, seq_len))
        return sm.LocalMask((seq_len, seq_len), window_size=(window - 1, 0), offset=0)

    if group > 1:  # [group, position, head_size] queries over one [position, head_size] key/value head
        mask = sm.MultiHeadMask([head_mask() for _ in range(group)])
        kernel = sk.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    residual_checkpoint_name="context", interpret=interpret)
        per_seq = jax.vmap(kernel, in_axes=(0, 0, 0, None))  # over the kv heads of one sequence
        q_in, k_in, v_in = q, k, v
    else:  # one head per key/value head: plain multi-head attention over [heads, position, head_size]
        mask = sm.MultiHeadMask([head_mask() for _ in range(kv_heads)])
        per_seq = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                     residual_checkpoint_name="context", interpret=interpret)
        q_in, k_in, v_in = q.reshape(b, kv_heads, seq_len, head_size), k, v
    # The kernel's inputs, in its layout, carry the projections' names: a policy that saves "query_proj" (and
    # the others) then keeps these, and the backward pass feeds them to the kernel as they are, instead of
    # redoing the rotary encoding, the scaling and the transposes from the projections' outputs (which the
    # backward never needs: those steps are linear).
    q_in = checkpoint_name(q_in, "query_proj")
    k_in = checkpoint_name(k_in, "key_proj")
    v_in = checkpoint_name(v_in, "value_proj")
    if segment_ids is None:
        out = jax.vmap(lambda q1, k1, v1: per_seq(q1, k1, v1, None))(q_in, k_in, v_in)
    else:
        out = jax.vmap(lambda q1, k1, v1, s1: per_seq(q1, k1, v1, sk.SegmentIds(q=s1, kv=s1)))(
            q_in, k_in, v_in, segment_ids
        )
    return out.reshape(b, kv_heads, group, seq_len, -1)

"""What a model's forward pass hands every attention layer: the axis names attention reads, the boolean
causal (and segment, and sliding-window) mask, and :class:`AttentionMask`, built once per pass for the
backend that will run (:func:`plan_attention`).

Only the ``vanilla`` kernel reads a materialised ``[..., position, key_position]`` mask; the others take
the segment ids and the window and mask block by block, so :func:`attention_mask` builds the full mask
for ``vanilla`` alone.
"""

from __future__ import annotations

from typing import Optional

import equinox as eqx

import haliax as hax
from haliax import Axis, NamedArray

from .backends import ATTN_BACKENDS, DEFAULT_FLASH_BLOCK_SIZE, attention_platform, resolve_attn_backend
from .splash import SplashBlockSizes

__all__ = [
    "POS",
    "KEY_POS",
    "HEADS",
    "KV_HEADS",
    "Q_PER_GROUP",
    "HEAD_SIZE",
    "causal_segment_mask",
    "AttentionMask",
    "attention_mask",
    "plan_attention",
]

POS = "position"
KEY_POS = "key_position"
HEADS = "heads"
KV_HEADS = "kv_heads"
Q_PER_GROUP = "q_heads_per_group"
HEAD_SIZE = "head_size"


def causal_segment_mask(Pos: Axis, segment_ids: NamedArray | None = None, window: Optional[int] = None) -> NamedArray:
    """Boolean ``[..., position, key_position]``: true where attention is allowed (within ``window``
    positions back, counting the query's own, when given)."""
    KeyPos = Axis(KEY_POS, Pos.size)
    # haliax only broadcasts when one operand's axes contain the other's, so add axes explicitly.
    distance = hax.arange(Pos).broadcast_axis(KeyPos) - hax.arange(KeyPos)
    mask = distance >= 0
    if window is not None:
        mask = mask & (distance < window)
    if segment_ids is not None:
        same_segment = segment_ids.broadcast_axis(KeyPos) == segment_ids.rename({POS: KEY_POS})
        mask = mask & same_segment
    return mask.rearrange((..., POS, KEY_POS))


class AttentionMask(eqx.Module):
    """What every layer needs to mask its attention, and which kernel runs it: causal always, plus
    optional ``segment_ids [..., position]``; ``materialized`` is the boolean ``[..., position,
    key_position]`` mask, built only for the ``vanilla`` kernel (the others never see a full mask).
    ``backend`` is a concrete backend name (see :func:`resolve_attn_backend`); ``window`` the sliding
    window in positions (None: the whole causal prefix)."""

    segment_ids: Optional[NamedArray] = None
    materialized: Optional[NamedArray] = None
    backend: str = eqx.field(static=True, default="vanilla")
    block_size: int = eqx.field(static=True, default=DEFAULT_FLASH_BLOCK_SIZE)
    window: Optional[int] = eqx.field(static=True, default=None)
    # model.splash_block_sizes (the splash backend's tiles one by one); None: block_size everywhere.
    splash_block_sizes: Optional[SplashBlockSizes] = eqx.field(static=True, default=None)


def attention_mask(
    Pos: Axis,
    segment_ids: NamedArray | None,
    backend: str = "vanilla",
    block_size: Optional[int] = None,
    window: Optional[int] = None,
    splash_block_sizes: Optional[SplashBlockSizes] = None,
) -> AttentionMask:
    """The :class:`AttentionMask` a model builds once per forward pass for the concrete ``backend``; a
    ``window`` at least as long as the sequence excludes nothing and is dropped (the plain causal kernels
    run)."""
    if backend not in ATTN_BACKENDS or backend == "default":
        raise ValueError(f"attention_mask needs a concrete backend, got {backend!r} (see resolve_attn_backend)")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"an attention window must be a positive number of positions, got {window!r}")
    if window is not None and window >= Pos.size:
        window = None
    block = block_size if block_size is not None else DEFAULT_FLASH_BLOCK_SIZE
    full = causal_segment_mask(Pos, segment_ids, window) if backend == "vanilla" else None
    return AttentionMask(segment_ids, full, backend, block, window, splash_block_sizes)


def plan_attention(
    requested: str,
    Pos: Axis,
    segment_ids: NamedArray | None,
    *,
    block_size: Optional[int],
    dtype,
    head_size: int,
    dropout: float = 0.0,
    window: Optional[int] = None,
    splash_block_sizes: Optional[SplashBlockSizes] = None,
) -> AttentionMask:
    """The :class:`AttentionMask` for one forward pass of a model configured with backend ``requested``:
    resolves it for the platform compiled for (:func:`attention_platform`), sequence, activation ``dtype`` (as the scores' inputs will have it)
    and active ``dropout``, and materialises the full mask only for ``vanilla``. ``window``: a sliding
    window of that many positions."""
    backend = resolve_attn_backend(
        requested, platform=attention_platform(), seq_len=Pos.size, dropout=dropout, dtype=dtype, head_size=head_size
    )
    return attention_mask(Pos, segment_ids, backend, block_size, window, splash_block_sizes)

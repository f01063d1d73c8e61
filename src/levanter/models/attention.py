"""Causal dot-product attention with packed-sequence (segment id) masking and grouped-query heads,
behind one entry point (:func:`dot_product_attention`) with interchangeable backends.

Position ``q`` may attend to key position ``k`` iff ``k <= q`` and, when segment ids are given,
``segment_ids[q] == segment_ids[k]``, and, when a sliding window of ``w`` positions is given (Mistral's
``sliding_window``), ``q - k < w`` (the query's own position and the ``w - 1`` before it, transformers'
convention). Every backend applies the window: ``vanilla`` in its materialised mask, ``jax_flash`` per
block pair (skipping key blocks wholly outside the window), ``splash`` through its local mask (whose
block-sparsity skips them too) and ``cudnn`` through its local window. A model describes this once per forward pass with an
:class:`AttentionMask` (the segment ids, plus the materialised boolean ``[..., position,
key_position]`` mask only for the backend that reads one) and passes it to every layer.

Backends (``model.attn_backend``; upstream Levanter's names where upstream has them):

* ``vanilla``: the materialised-scores kernel below (:func:`causal_attention`): ``O(seq_len**2)``
  memory per head, the fastest on CPU at short sequences, and the only one with attention-probability
  dropout. Its backward pass is written out (:func:`softmax_attention`, a ``jax.custom_vjp``) in the
  flash-attention form, which makes fewer passes over the scores than JAX's derivative.
* ``jax_flash``: blockwise attention in pure JAX (:mod:`levanter.models.flash_attention`): online
  softmax over key blocks of ``model.flash_attention_block_size`` positions, recomputed per block in
  the backward pass; memory ``O(seq_len * block)``; runs everywhere.
* ``splash``: JAX's Pallas splash-attention kernel, on TPU only (elsewhere it runs only in Pallas's
  slow interpret mode, which the tests use). Its tiles are ``model.flash_attention_block_size`` in every
  dimension unless ``model.splash_block_sizes`` (:class:`SplashBlockSizes`) sets the forward and
  backward kernels' tiles one by one: a speed knob only (the same attention up to float rounding).
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, on NVIDIA GPUs only, with
  bfloat16/float16 activations and head sizes up to 128 (a multiple of 8). Packed segments reach it
  as a boolean mask (cuDNN's own fused kernel still never materialises the scores).
* ``default``: splash on TPU (when the sequence is a multiple of 128), cuDNN on GPU (when dtype and
  head size allow), else ``jax_flash`` for sequences of at least :data:`CPU_BLOCKWISE_MIN_SEQ_LEN`
  positions and ``vanilla`` below (where the materialised scores are small and faster on CPU).
  ``vanilla`` is also chosen whenever attention dropout is active.

A backend the platform cannot run is refused before any work by :func:`check_backend_platform` (run
by the training entry point's config checks), with an error naming ``model.attn_backend``.

Numerics: scores and softmax are float32 in every backend; ``upcast`` additionally computes the
``q . k`` product in float32. Masked scores are a large finite negative number, not ``-inf``, so a
fully masked row (which cannot occur: every query sees itself) would stay NaN-free. Everything is
traceable, so all backends work under jit, scan-over-layers and remat.

Axis names: queries ``[..., position, heads, head_size]``; keys/values either
``[..., position, heads, head_size]`` (multi-head) or ``[..., position, kv_heads, head_size]``
(grouped-query: ``heads`` is split into ``kv_heads x q_heads_per_group``, so query head ``h`` uses
key/value head ``h // (heads // kv_heads)``, the Hugging Face ``repeat_kv`` convention).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import haliax as hax
from haliax import Axis, NamedArray

from .flash_attention import blockwise_attention

__all__ = [
    "POS",
    "KEY_POS",
    "HEADS",
    "KV_HEADS",
    "Q_PER_GROUP",
    "HEAD_SIZE",
    "causal_segment_mask",
    "causal_attention",
    "softmax_attention",
    "ATTN_BACKENDS",
    "DEFAULT_FLASH_BLOCK_SIZE",
    "CPU_BLOCKWISE_MIN_SEQ_LEN",
    "check_attn_config",
    "check_backend_platform",
    "resolve_attn_backend",
    "AttentionMask",
    "attention_mask",
    "plan_attention",
    "dot_product_attention",
    "splash_attention",
    "SplashBlockSizes",
    "resolve_splash_block_sizes",
]

POS = "position"
KEY_POS = "key_position"
HEADS = "heads"
KV_HEADS = "kv_heads"
Q_PER_GROUP = "q_heads_per_group"
HEAD_SIZE = "head_size"

# Large enough to vanish under softmax in float32, small enough not to overflow when added to.
_MASKED_SCORE = -1e9


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
    # forward and the backward pass (docs/bench/2026-12-03-cpu-levers.md). Only the small q/k/v/output tensors
    # are transposed here.
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
    (docs/bench/2026-12-03-cpu-levers.md); the gradients agree to float32 rounding (tests/test_models.py).
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


# -- backends -------------------------------------------------------------------------------------------
ATTN_BACKENDS = ("default", "vanilla", "jax_flash", "splash", "cudnn")
# Where each backend runs (jax.default_backend() names); jax_flash and vanilla run everywhere.
_BACKEND_PLATFORMS = {"splash": ("tpu",), "cudnn": ("gpu", "cuda")}
DEFAULT_FLASH_BLOCK_SIZE = 512
# On CPU, `default` picks blockwise attention from this sequence length on: below it the materialised
# scores are small and the single fused kernel is faster (docs/bench/2026-12-03-attention-and-loss.md).
CPU_BLOCKWISE_MIN_SEQ_LEN = 2048


def check_attn_config(backend: str, use_flash_attention: Optional[bool], block_size: Optional[int]) -> str:
    """The requested backend of a model config (``model.attn_backend``, or upstream's
    ``use_flash_attention`` when that alone is given: true means ``jax_flash``, false ``vanilla``), after
    checking the three keys; refuses unknown names, a conflict between the two keys, and a block size that
    is not a positive integer."""
    if backend is not None and backend not in ATTN_BACKENDS:
        hint = " (Transformer Engine is not available here; use cudnn)" if backend == "nvte" else ""
        raise ValueError(f"model.attn_backend {backend!r} is not one of {list(ATTN_BACKENDS)}{hint}")
    if use_flash_attention is not None and backend is not None:
        if use_flash_attention != (backend != "vanilla"):
            raise ValueError(
                f"model.use_flash_attention={str(use_flash_attention).lower()} conflicts with "
                f"model.attn_backend={backend!r}; remove model.use_flash_attention (attn_backend says which "
                "kernel to use)"
            )
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0):
        raise ValueError(f"model.flash_attention_block_size must be a positive integer, got {block_size!r}")
    if backend is not None:
        return backend
    if use_flash_attention is not None:
        return "jax_flash" if use_flash_attention else "vanilla"
    return "default"


def _platform_kind(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def check_backend_platform(backend: str, platform: str) -> None:
    """Refuse a backend the platform (``jax.default_backend()``) cannot run, naming ``model.attn_backend``."""
    allowed = _BACKEND_PLATFORMS.get(backend)
    if allowed is not None and platform not in allowed:
        where = "TPU" if backend == "splash" else "NVIDIA GPUs"
        raise ValueError(
            f"model.attn_backend {backend!r} runs only on {where}, but JAX's platform here is {platform!r}; "
            "use attn_backend: default (the best one this platform has) or jax_flash"
        )


def _cudnn_shapes_ok(dtype, head_size: Optional[int]) -> bool:
    dtype_ok = dtype is None or jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return dtype_ok and (head_size is None or (head_size <= 128 and head_size % 8 == 0))


def resolve_attn_backend(
    backend: str, *, platform: str, seq_len: int, dropout: float = 0.0, dtype=None, head_size: Optional[int] = None
) -> str:
    """The concrete backend ``vanilla | jax_flash | splash | cudnn`` that ``backend`` means here (see the
    module docstring for what ``default`` picks). ``dtype``/``head_size`` refine the GPU choice when known."""
    if backend != "default":
        check_backend_platform(backend, platform)
        return backend
    kind = _platform_kind(platform)
    if dropout > 0.0:
        return "vanilla"
    if kind == "tpu" and seq_len % 128 == 0:
        return "splash"
    if kind == "gpu" and platform != "rocm" and _cudnn_shapes_ok(dtype, head_size):
        return "cudnn"
    if kind == "cpu" and seq_len < CPU_BLOCKWISE_MIN_SEQ_LEN:
        return "vanilla"
    return "jax_flash"


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
    resolves it for this platform, sequence, activation ``dtype`` (as the scores' inputs will have it)
    and active ``dropout``, and materialises the full mask only for ``vanilla``. ``window``: a sliding
    window of that many positions."""
    backend = resolve_attn_backend(
        requested, platform=jax.default_backend(), seq_len=Pos.size, dropout=dropout, dtype=dtype, head_size=head_size
    )
    return attention_mask(Pos, segment_ids, backend, block_size, window, splash_block_sizes)


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
    platform = jax.default_backend()
    check_backend_platform(backend, platform)
    q5, k4, v4, seg, rebuild = _head_arrays(q, k, v, mask.segment_ids, scale, upcast)
    if backend == "jax_flash":
        out = blockwise_attention(q5, k4, v4, seg, block_size=mask.block_size, window=mask.window)
    elif backend == "splash":
        out = splash_attention(q5, k4, v4, seg, block_size=mask.block_size, block_sizes=mask.splash_block_sizes,
                               interpret=platform != "tpu", window=mask.window)
    elif backend == "cudnn":
        out = _cudnn_attention(q5, k4, v4, seg, window=mask.window)
    else:
        raise ValueError(f"model.attn_backend {backend!r} is not one of {list(ATTN_BACKENDS)}")
    return rebuild(out.astype(v.dtype))


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


def _splash_block(seq_len: int, block_size: int) -> int:
    """The largest block up to ``block_size`` that divides ``seq_len`` (the splash kernel needs one)."""
    block = min(block_size, seq_len)
    while seq_len % block:
        block -= 1
    return block


def splash_attention(
    q, k, v, segment_ids=None, *, block_size: int, block_sizes: Optional[SplashBlockSizes] = None,
    interpret: bool = False, window: Optional[int] = None,
) -> jax.Array:
    """Causal attention through JAX's Pallas splash kernel, on the array layout of
    :func:`levanter.models.flash_attention.blockwise_attention` (``q`` already scaled). The kernel's
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


def _cudnn_attention(q, k, v, segment_ids=None, window: Optional[int] = None) -> jax.Array:
    """Causal attention through cuDNN's fused kernel (``jax.nn.dot_product_attention``); same layouts;
    ``window`` becomes cuDNN's local window (the query and the ``window - 1`` positions before it)."""
    b, kv_heads, group, seq_len, head_size = q.shape
    if not _cudnn_shapes_ok(q.dtype, head_size) or q.dtype != k.dtype or k.dtype != v.dtype:
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

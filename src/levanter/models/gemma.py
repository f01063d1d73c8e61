"""Gemma and Gemma 2: Llama's block with Gemma's norms, embedding scale, MLP and head size.

Registered as ``type: gemma`` (upstream Levanter's name) and ``type: gemma2``. What Gemma changes in
:mod:`levanter.models.llama`:

* RMS norms scale by ``1 + weight`` and store ``weight`` (initialised to zero), as the Hugging Face
  checkpoints do, so the stored tensors map one to one and weight decay pulls the scale towards 1, not
  towards 0. The norm, the scale included, is computed in float32 and cast back to the activation dtype
  (Gemma multiplies before the cast, Llama after).
* The token embeddings are multiplied by ``sqrt(hidden_dim)`` (rounded to the activation dtype, as the
  reference implementation does) before the first block; the output head is not scaled.
* ``head_dim`` is a size of its own: the query width ``num_heads * head_dim`` need not equal ``hidden_dim``
  (Gemma 7B: 16 heads of 256 on a 3072-wide residual stream). Scores are scaled by ``1/sqrt(head_dim)``.
* The MLP is gated with the tanh approximation of GELU (``gelu_new``, the same function as transformers'
  ``gelu_pytorch_tanh``), and the output head is tied to the embeddings by default.
* Multi-query attention (``num_kv_heads: 1``, Gemma 2B) and grouped-query attention are the same code path
  as Llama's.

The config is a :class:`~levanter.models.llama.LlamaConfig` (every key means what it means for Llama; only
defaults differ, plus ``norm_embeddings``), and the attention and MLP modules are Llama's
(:class:`~levanter.models.decoder.LlamaAttention`, :class:`~levanter.models.decoder.LlamaMlp`): the parameter
names, axes (``q_proj [embed -> heads, head_size]`` and so on), activation checkpoint names, attention backends
and FLOP count are therefore shared, and a Gemma checkpoint uses the same Hugging Face tensor names as a Llama
one. Only the norms, the embedding scale and the model around the blocks are Gemma's own
(:class:`GemmaLMHeadModel`, not a ``LlamaLMHeadModel``). The trade-off is that Gemma follows Llama's
structure; a change there is a change here.

Gemma 2 (``type: gemma2``, :class:`Gemma2Config`) is the same model with four changes: scores scaled by
``query_pre_attn_scalar ** -0.5`` and soft-capped (``cap * tanh(score / cap)``), a sliding attention window on
layers 0, 2, 4, ..., RMS norms on each sub-block's output as well as its input, and soft-capped output
logits. Soft-capping and per-layer windows are not in the shared attention backends, so Gemma 2 runs its
own materialised kernel (:class:`Gemma2Attention`: ``O(seq_len**2)`` scores per head, differentiated by
JAX): correct everywhere, but without the memory savings of ``jax_flash`` or ``splash`` at long sequences.
The blockwise loss (``cross_entropy_block_size``) would skip the logit cap and is refused with it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp

import haliax as hax
import haliax.nn as hnn
from haliax import Axis, NamedArray

from .attention import HEAD_SIZE, HEADS, KEY_POS, POS, Q_PER_GROUP, causal_segment_mask
from .layers import named
from .decoder import (
    DecoderLMHeadModel,
    LlamaAttention,
    LlamaMlp,
    SandwichNormBlock,
    apply_rotary,
    attention_projections,
    init_decoder_parts,
    plan_config_attention,
)
from .llama import LlamaConfig
from .lm_model import LmConfig, check_input_length
from .rope import rotary_tables
from .token_dot import linear

__all__ = [
    "GemmaConfig",
    "Gemma2Config",
    "GemmaRmsNorm",
    "GemmaDecoderLayer",
    "Gemma2Attention",
    "Gemma2DecoderLayer",
    "GemmaLMHeadModel",
]

# A masked score: vanishes under a float32 softmax and stays finite (as in levanter.models.attention).
_MASKED_SCORE = -1e9


@LmConfig.register_subclass("gemma")
@dataclasses.dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    """A Gemma decoder: Llama's block with (1 + weight) RMS norms, scaled embeddings and a free head size.

    Every field is Llama's (same meaning); the defaults are Gemma 2B's shape (the vocabulary is the
    tokenizer's). ``use_layer_norm_weight: false`` is refused: Gemma's norms always have their offset."""

    seq_len: int = 8192
    hidden_dim: int = 2048
    num_layers: int = 18
    num_heads: int = 8
    # Activation of the MLP's gate: Gemma's is the tanh approximation of GELU (gelu_new).
    activation_function: str = "gelu_new"
    intermediate_dim: int = 16384
    # Key/value heads: 1 is multi-query attention (Gemma 2B); num_heads must be a multiple of it.
    num_kv_heads: int = 1
    # Size of each attention head, independent of hidden_dim / num_heads (Gemma's is 256); must be even (RoPE).
    # null means hidden_dim / num_heads.
    head_dim: Optional[int] = 256
    layer_norm_epsilon: float = 1e-6
    # The output head reuses the token-embedding matrix instead of a matrix of its own (Gemma's are tied).
    tie_word_embeddings: bool = True
    # Multiply the token embeddings by sqrt(hidden_dim) before the first block (Gemma does).
    norm_embeddings: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not self.use_layer_norm_weight:
            raise ValueError(
                "model.use_layer_norm_weight false is not implemented for Gemma (its norms scale by 1 + weight); "
                "remove the key"
            )

    def build(self, Vocab: Axis, *, key) -> "GemmaLMHeadModel":
        return GemmaLMHeadModel.init(Vocab, self, key=key)


@LmConfig.register_subclass("gemma2")
@dataclasses.dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    """A Gemma 2 decoder: Gemma's, plus soft-capped attention scores and logits, a sliding attention window
    on every other layer, and norms after each sub-block as well as before.

    Defaults are Gemma 2 2B's shape. Attention runs in this module's own materialised kernel (soft-capping
    and windows are not in the shared backends), so ``attn_backend`` must be ``default`` or ``vanilla``."""

    hidden_dim: int = 2304
    num_layers: int = 26
    num_heads: int = 8
    intermediate_dim: int = 9216
    num_kv_heads: int = 4
    # Scores are multiplied by query_pre_attn_scalar ** -0.5 (Gemma 2's own scale, not head_dim's).
    query_pre_attn_scalar: int = 256
    # Attention scores become cap * tanh(score / cap) before the mask and softmax; null: no capping.
    attn_logit_softcapping: Optional[float] = 50.0
    # Output logits become cap * tanh(logit / cap); null: no capping.
    final_logit_softcapping: Optional[float] = 30.0
    # Layers 0, 2, 4, ... attend only to the last sliding_window positions (their own included); the
    # others see the whole causal prefix. null: every layer sees the whole prefix.
    sliding_window: Optional[int] = 4096

    def __post_init__(self):
        super().__post_init__()
        if not (self.query_pre_attn_scalar > 0):
            raise ValueError(f"model.query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model.{name} must be positive (or null for none), got {value}")
        if self.attention_backend not in ("default", "vanilla"):
            raise ValueError(
                f"model.attn_backend {self.attention_backend!r} cannot run Gemma 2's attention (soft-capped scores, "
                "sliding windows): use attn_backend: vanilla or default (and no use_flash_attention: true)"
            )
        if self.cross_entropy_block_size is not None and self.final_logit_softcapping is not None:
            raise ValueError(
                "model.cross_entropy_block_size cannot be combined with model.final_logit_softcapping (the blockwise "
                "loss takes the raw logits): set cross_entropy_block_size: null"
            )

    def check_platform(self, platform: str) -> None:
        pass  # the vanilla kernel runs everywhere

    def sliding_layers(self) -> list[bool]:
        """Per layer, whether it attends through the sliding window (even layers, when there is a window)."""
        return [self.sliding_window is not None and i % 2 == 0 for i in range(self.num_layers)]


class GemmaRmsNorm(eqx.Module):
    """RMS norm with scale ``1 + weight`` (weight stored as the offset, initialised to zero), in float32."""

    weight: NamedArray  # [embed]
    axis: Axis = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    @staticmethod
    def init(axis: Axis, eps: float) -> "GemmaRmsNorm":
        return GemmaRmsNorm(hax.zeros(axis), axis, eps)

    def __call__(self, x: NamedArray) -> NamedArray:
        x32 = x.astype(jnp.float32)
        inv = hax.rsqrt(hax.mean(hax.square(x32), axis=self.axis) + self.eps)
        # The offset is added in float32: under a bfloat16 policy, 1 + w rounded to bfloat16 would lose
        # every |w| below 2**-9, which is where the trained offsets of small models sit.
        return (x32 * inv * (1.0 + self.weight.astype(jnp.float32))).astype(x.dtype)


class GemmaDecoderLayer(eqx.Module):
    input_layernorm: GemmaRmsNorm
    self_attn: LlamaAttention
    post_attention_layernorm: GemmaRmsNorm
    mlp: LlamaMlp

    @staticmethod
    def init(config: GemmaConfig, *, key) -> "GemmaDecoderLayer":
        k_attn, k_mlp = jax.random.split(key)
        attn, mlp = LlamaAttention.init(config, key=k_attn), LlamaMlp.init(config, key=k_mlp)
        eps = config.layer_norm_epsilon
        return GemmaDecoderLayer(GemmaRmsNorm.init(config.Embed, eps), attn, GemmaRmsNorm.init(config.Embed, eps), mlp)

    def __call__(self, x: NamedArray, mask, cos: NamedArray, sin: NamedArray, *, key=None) -> NamedArray:
        del key  # no dropout in Gemma; accepted so every block has the same signature
        x = x + self.self_attn(self.input_layernorm(x), mask, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Gemma2Attention(eqx.Module):
    """Llama's projections (same names and axes) around a materialised attention with Gemma 2's score scale,
    soft-capping and an explicit boolean mask (causal, segments, and the window on sliding layers)."""

    q_proj: hnn.Linear  # embed -> (heads, head_size)
    k_proj: hnn.Linear  # embed -> (kv_heads, head_size)
    v_proj: hnn.Linear  # embed -> (kv_heads, head_size)
    o_proj: hnn.Linear  # (heads, head_size) -> embed
    config: Gemma2Config = eqx.field(static=True)

    @staticmethod
    def init(config: Gemma2Config, *, key) -> "Gemma2Attention":
        return Gemma2Attention(*attention_projections(config, key=key), config)

    def __call__(self, x: NamedArray, mask: NamedArray, cos: NamedArray, sin: NamedArray) -> NamedArray:
        c = self.config
        q = apply_rotary(named(linear(self.q_proj, x), "query_proj"), cos, sin)
        k = apply_rotary(named(linear(self.k_proj, x), "key_proj"), cos, sin)
        v = named(linear(self.v_proj, x), "value_proj")
        # Query head h reads key/value head h // (heads / kv_heads), as transformers' repeat_kv does.
        Group = Axis(Q_PER_GROUP, c.num_heads // c.num_kv_heads)
        q = hax.unflatten_axis(q, HEADS, (c.KVHeads, Group))
        k, v = k.rename({POS: KEY_POS}), v.rename({POS: KEY_POS})
        if c.upcast_attn:
            q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        scores = hax.dot(q, k, axis=HEAD_SIZE).astype(jnp.float32) * (c.query_pre_attn_scalar ** -0.5)
        cap = c.attn_logit_softcapping
        if cap is not None:
            scores = hax.tanh(scores / cap) * cap
        scores = hax.where(mask, scores, _MASKED_SCORE)
        probs = hax.nn.softmax(scores, axis=KEY_POS).astype(v.dtype)
        out = hax.flatten_axes(hax.dot(probs, v, axis=KEY_POS), (c.KVHeads, Group), HEADS)
        return named(linear(self.o_proj, named(out, "context")), "out_proj")


class Gemma2DecoderLayer(SandwichNormBlock):
    """Four (1 + weight) norms: on the way into and out of the attention and the MLP; the attention is
    :class:`Gemma2Attention`."""

    @staticmethod
    def init(config: Gemma2Config, *, key) -> "Gemma2DecoderLayer":
        k_attn, k_mlp = jax.random.split(key)
        norms = [GemmaRmsNorm.init(config.Embed, config.layer_norm_epsilon) for _ in range(4)]
        attn, mlp = Gemma2Attention.init(config, key=k_attn), LlamaMlp.init(config, key=k_mlp)
        return Gemma2DecoderLayer(norms[0], attn, norms[1], norms[2], mlp, norms[3])

    def __call__(self, x: NamedArray, full: NamedArray, window: NamedArray, sliding: NamedArray,
                 cos: NamedArray, sin: NamedArray, *, key=None) -> NamedArray:
        del key  # no dropout
        # `sliding` is this layer's slice of the per-layer flags (the scan hands each layer its own).
        mask = hax.named(jnp.where(sliding.array, window.array, full.array), full.axes)
        return self.branches(x, mask, cos, sin)


class GemmaLMHeadModel(DecoderLMHeadModel):
    # layers: GemmaDecoderLayer, or Gemma2DecoderLayer for a Gemma2Config; norm: a GemmaRmsNorm.
    config: GemmaConfig = eqx.field(static=True)
    Vocab: Axis = eqx.field(static=True)

    @staticmethod
    def init(Vocab: Axis, config: GemmaConfig, *, key) -> "GemmaLMHeadModel":
        layer = Gemma2DecoderLayer if isinstance(config, Gemma2Config) else GemmaDecoderLayer
        embed_tokens, layers, lm_head = init_decoder_parts(Vocab, config, layer, key=key)
        norm = GemmaRmsNorm.init(config.Embed, config.layer_norm_epsilon)
        return GemmaLMHeadModel(
            embed_tokens=embed_tokens, layers=layers, norm=norm, lm_head=lm_head, config=config, Vocab=Vocab
        )

    def activations(
        self, input_ids: NamedArray, segment_ids: NamedArray | None = None, *, key=None
    ) -> NamedArray:
        del key  # no dropout
        c = self.config
        Pos = check_input_length(c, input_ids)
        x = self.embed_tokens.embed(input_ids)
        if c.norm_embeddings:
            # The multiplier is rounded to the activation dtype first (sqrt(2048) is 45.25 in bfloat16), as
            # in the reference implementation, so bfloat16 runs match theirs.
            x = x * jnp.asarray(math.sqrt(c.hidden_dim), dtype=x.dtype)
        cos, sin = rotary_tables(Pos, c.HeadSize, c.rope_config)

        if isinstance(c, Gemma2Config):
            full = causal_segment_mask(Pos, segment_ids)
            # key k is in query q's window iff q - k < sliding_window (transformers' convention).
            window = causal_segment_mask(Pos, segment_ids, c.sliding_window)
            sliding = hax.named(jnp.asarray(c.sliding_layers()), (c.Layers,))
            # full, window, cos and sin have no `layers` axis and reach every layer whole; `sliding` has one,
            # so each layer gets its own flag.
            x = self.layers.fold(x, full, window, sliding, cos, sin, unroll=not c.scan_layers)
            return self.norm(x)

        mask = plan_config_attention(c, Pos, segment_ids, x.dtype)
        # mask, cos and sin have no `layers` axis, so the scan passes them unchanged to every layer.
        x = self.layers.fold(x, mask, cos, sin, unroll=not c.scan_layers)
        return self.norm(x)

    def __call__(
        self, input_ids: NamedArray, segment_ids: NamedArray | None = None, *, key=None
    ) -> NamedArray:
        logits = super().__call__(input_ids, segment_ids, key=key)
        cap = self.config.final_logit_softcapping if isinstance(self.config, Gemma2Config) else None
        if cap is None:
            return logits
        return hax.tanh(logits.astype(jnp.float32) / cap) * cap

"""The decoder parts every Llama-style family shares (Llama, Qwen2, Qwen3, Mistral, Mixtral, Gemma, Gemma 2,
OLMo 2), defined once so that there is one block to keep fast and one set of parameter names.

* The attention (:class:`LlamaAttention`: grouped-query heads, the Hugging Face "rotate half" rotary
  encoding, optional biases and q/k norms as the config's properties say) and its projections
  (:func:`attention_projections`), the gated MLP (:class:`LlamaMlp`), the RMS norm (:func:`rms_norm`).
* The pre-norm attention half of a block (:class:`PreNormBlock`, :func:`decoder_block_parts`) and the block
  whose residual branches are normalised on the way out as well as (or instead of) on the way in
  (:class:`SandwichNormBlock`: Gemma 2, OLMo 2).
* The model's parameters and output matrix (:class:`DecoderLMHeadModel`, :func:`init_decoder_parts`) and
  the per-pass attention plan (:func:`plan_config_attention`, with the config's sliding window if it has one).
* The attention switches of the variants with an ``attention_bias`` field and q/k norms
  (:class:`QkNormAttentionBias`: Qwen3, OLMo 2).

The parts read their config through :class:`DecoderConfig`, the fields and properties that
:class:`levanter.models.llama.LlamaConfig` (and so every family built on it) has; they never import the
Llama module, which builds its own block and model from them. Variants switch the attention through
properties of the config (``qkv_bias``, ``o_bias``, ``qk_norm`` and the axes it normalises over,
``attention_window``). Field names are the checkpoints' (``self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``, ...), which the Hugging Face layouts in :mod:`levanter.compat.hf_checkpoints` map.
"""

from __future__ import annotations

from typing import Optional, Protocol, Union

import equinox as eqx
import jax
import jax.numpy as jnp

import haliax as hax
import haliax.nn as hnn
from haliax import Axis, NamedArray

from .attention import HEAD_SIZE, AttentionMask, SplashBlockSizes, dot_product_attention, plan_attention
from .layers import ACTIVATIONS, named, normal_embedding, normal_linear, remat_policy
from .lm_model import LmHeadModel
from .token_dot import linear

__all__ = [
    "DecoderConfig",
    "QkNormAttentionBias",
    "apply_rotary",
    "attention_projections",
    "LlamaAttention",
    "LlamaMlp",
    "rms_norm",
    "decoder_block_parts",
    "init_decoder_parts",
    "plan_config_attention",
    "PreNormBlock",
    "SandwichNormBlock",
    "DecoderLMHeadModel",
]


class DecoderConfig(Protocol):
    """What the shared decoder parts read from a model config: ``LlamaConfig``'s fields and properties."""

    initializer_range: float
    layer_norm_epsilon: float
    use_bias: bool
    use_layer_norm_weight: bool
    activation_function: str
    upcast_attn: bool
    num_layers: int
    tie_word_embeddings: bool
    gradient_checkpointing: Union[bool, str]
    flash_attention_block_size: Optional[int]
    splash_block_sizes: Optional[SplashBlockSizes]

    @property
    def Embed(self) -> Axis: ...

    @property
    def Heads(self) -> Axis: ...

    @property
    def KVHeads(self) -> Axis: ...

    @property
    def HeadSize(self) -> Axis: ...

    @property
    def Mlp(self) -> Axis: ...

    @property
    def Layers(self) -> Axis: ...

    @property
    def qkv_bias(self) -> bool: ...

    @property
    def o_bias(self) -> bool: ...

    @property
    def qk_norm(self) -> bool: ...

    def qk_norm_axes(self, Heads: Axis) -> Axis | tuple[Axis, ...]: ...

    @property
    def attention_window(self) -> Optional[int]: ...

    @property
    def attention_backend(self) -> str: ...


class QkNormAttentionBias:
    """The attention switches of the Llama variants with an ``attention_bias`` field (biases on all four
    attention projections, Hugging Face's option) and an RMS norm on the queries and keys: Qwen3 and OLMo 2.
    Listed before :class:`LlamaConfig` among a config's bases, so that these properties replace Llama's."""

    @property
    def qkv_bias(self) -> bool:
        return self.use_bias or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.use_bias or self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return True


def apply_rotary(x: NamedArray, cos: NamedArray, sin: NamedArray) -> NamedArray:
    HeadSize = x.resolve_axis(HEAD_SIZE)
    half = HeadSize.size // 2
    x1 = x[HEAD_SIZE, :half]
    x2 = x[HEAD_SIZE, half:]
    rotated = hax.concatenate(HEAD_SIZE, [-x2, x1])
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


def attention_projections(config: DecoderConfig, *, key) -> tuple[hnn.Linear, hnn.Linear, hnn.Linear, hnn.Linear]:
    """The q, k, v and o projections of a Llama-style attention (grouped-query heads, biases as configured),
    initialised from ``key``; shared by every block that keeps Llama's projection names and axes."""
    k_q, k_k, k_v, k_o = jax.random.split(key, 4)
    c, std = config, config.initializer_range
    q_proj = normal_linear(c.Embed, (c.Heads, c.HeadSize), std=std, use_bias=c.qkv_bias, key=k_q)
    k_proj = normal_linear(c.Embed, (c.KVHeads, c.HeadSize), std=std, use_bias=c.qkv_bias, key=k_k)
    v_proj = normal_linear(c.Embed, (c.KVHeads, c.HeadSize), std=std, use_bias=c.qkv_bias, key=k_v)
    o_proj = normal_linear((c.Heads, c.HeadSize), c.Embed, std=std, use_bias=c.o_bias, key=k_o)
    return q_proj, k_proj, v_proj, o_proj


class LlamaAttention(eqx.Module):
    q_proj: hnn.Linear  # embed -> (heads, head_size)
    k_proj: hnn.Linear  # embed -> (kv_heads, head_size)
    v_proj: hnn.Linear  # embed -> (kv_heads, head_size)
    o_proj: hnn.Linear  # (heads, head_size) -> embed
    q_norm: Optional[hnn.RmsNorm]  # over config.qk_norm_axes (head_size by default), when config.qk_norm
    k_norm: Optional[hnn.RmsNorm]
    config: DecoderConfig = eqx.field(static=True)

    @staticmethod
    def init(config: DecoderConfig, *, key) -> "LlamaAttention":
        c = config
        q_proj, k_proj, v_proj, o_proj = attention_projections(c, key=key)
        q_norm = rms_norm(c, c.qk_norm_axes(c.Heads)) if c.qk_norm else None
        k_norm = rms_norm(c, c.qk_norm_axes(c.KVHeads)) if c.qk_norm else None
        return LlamaAttention(q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, config)

    def __call__(self, x: NamedArray, mask: AttentionMask, cos: NamedArray, sin: NamedArray) -> NamedArray:
        q = named(linear(self.q_proj, x), "query_proj")
        k = named(linear(self.k_proj, x), "key_proj")
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q).astype(q.dtype), self.k_norm(k).astype(k.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = named(linear(self.v_proj, x), "value_proj")
        attn = named(dot_product_attention(q, k, v, mask, upcast=self.config.upcast_attn), "context")
        return named(linear(self.o_proj, attn), "out_proj")


class LlamaMlp(eqx.Module):
    gate_proj: hnn.Linear  # embed -> mlp
    up_proj: hnn.Linear  # embed -> mlp
    down_proj: hnn.Linear  # mlp -> embed
    activation_function: str = eqx.field(static=True)

    @staticmethod
    def init(config: DecoderConfig, *, key) -> "LlamaMlp":
        k_gate, k_up, k_down = jax.random.split(key, 3)
        c, std = config, config.initializer_range
        return LlamaMlp(
            normal_linear(c.Embed, c.Mlp, std=std, use_bias=c.use_bias, key=k_gate),
            normal_linear(c.Embed, c.Mlp, std=std, use_bias=c.use_bias, key=k_up),
            normal_linear(c.Mlp, c.Embed, std=std, use_bias=c.use_bias, key=k_down),
            c.activation_function,
        )

    def __call__(self, x: NamedArray) -> NamedArray:
        gate = ACTIVATIONS[self.activation_function](named(linear(self.gate_proj, x), "mlpwi_0"))
        return named(linear(self.down_proj, gate * named(linear(self.up_proj, x), "mlpwi_1")), "mlpwo")


def rms_norm(config: DecoderConfig, axis: Optional[Axis | tuple[Axis, ...]] = None) -> hnn.RmsNorm:
    # Normalise in float32 whatever the activation dtype (the statistic is a mean of squares).
    return hnn.RmsNorm.init(
        axis if axis is not None else config.Embed,
        eps=config.layer_norm_epsilon,
        use_weight=config.use_layer_norm_weight,
        use_bias=config.use_bias and axis is None,
        dtype=jnp.float32,
    )


def decoder_block_parts(config: DecoderConfig, FeedForward: type, *, key) -> tuple:
    """``(input_layernorm, self_attn, post_attention_layernorm, feed_forward)`` of a pre-norm Llama-style
    block whose feed-forward is ``FeedForward.init(config, key=...)`` (Llama's MLP, Mixtral's experts)."""
    k_attn, k_ff = jax.random.split(key)
    attn, ff = LlamaAttention.init(config, key=k_attn), FeedForward.init(config, key=k_ff)
    return rms_norm(config), attn, rms_norm(config), ff


def init_decoder_parts(Vocab: Axis, config: DecoderConfig, Layer: type, *, key) -> tuple:
    """``(embed_tokens, layers, lm_head)`` of a decoder-only model: the token embedding, ``config.num_layers``
    ``Layer`` blocks stacked along ``layers`` (``Layer.init(config, key=...)`` each, remat as configured) and
    the output head (None when ``tie_word_embeddings``). Shared by the Llama-style models so that their
    initialisation (and the key each part draws from) is one definition."""
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    std = config.initializer_range
    embed_tokens = normal_embedding(Vocab, config.Embed, std=std, key=k_embed)
    layers = hnn.Stacked.init(
        config.Layers, Layer, gradient_checkpointing=remat_policy(config.gradient_checkpointing)
    )(config, key=jax.random.split(k_layers, config.num_layers))
    lm_head = None
    if not config.tie_word_embeddings:
        lm_head = normal_linear(config.Embed, Vocab, std=std, use_bias=False, key=k_head)
    return embed_tokens, layers, lm_head


def plan_config_attention(config: DecoderConfig, Pos: Axis, segment_ids: NamedArray | None, dtype) -> AttentionMask:
    """:func:`~levanter.models.attention.plan_attention` for a model configured by ``config`` whose
    activations have ``dtype`` (float32 scores when ``upcast_attn``)."""
    return plan_attention(
        config.attention_backend,
        Pos,
        segment_ids,
        block_size=config.flash_attention_block_size,
        splash_block_sizes=config.splash_block_sizes,
        dtype=jnp.float32 if config.upcast_attn else dtype,
        head_size=config.HeadSize.size,
        window=config.attention_window,
    )


class PreNormBlock(eqx.Module):
    """The attention half of a pre-norm Llama-style block; Llama's and Mixtral's blocks add their
    feed-forward (its field name is the checkpoint's: ``mlp``, ``block_sparse_moe``) and its call."""

    input_layernorm: hnn.RmsNorm
    self_attn: LlamaAttention
    post_attention_layernorm: hnn.RmsNorm

    def attend(self, x: NamedArray, mask: AttentionMask, cos: NamedArray, sin: NamedArray) -> NamedArray:
        """The first residual branch: ``x`` plus the attention over its normalised self."""
        return x + self.self_attn(self.input_layernorm(x), mask, cos, sin)


class SandwichNormBlock(eqx.Module):
    """A block whose two residual branches (attention, then the MLP) may each be normalised on the way in
    and on the way out: ``x + post(attn(pre(x)))``, then the same around the MLP. A norm that is None is
    skipped. Gemma 2 has all four (its own norms); OLMo 2 only the two on the way out. The field names are
    the checkpoints' (both use them), so one layout entry serves each."""

    input_layernorm: Optional[eqx.Module]
    self_attn: eqx.Module
    post_attention_layernorm: Optional[eqx.Module]  # on the attention's output, before the residual add
    pre_feedforward_layernorm: Optional[eqx.Module]
    mlp: LlamaMlp
    post_feedforward_layernorm: Optional[eqx.Module]  # on the MLP's output, before the residual add

    def branches(self, x: NamedArray, mask, cos: NamedArray, sin: NamedArray) -> NamedArray:
        """Both residual branches, with ``mask`` handed to the attention as it is."""

        def norm(module, y):
            return y if module is None else module(y)

        x = x + norm(self.post_attention_layernorm, self.self_attn(norm(self.input_layernorm, x), mask, cos, sin))
        return x + norm(self.post_feedforward_layernorm, self.mlp(norm(self.pre_feedforward_layernorm, x)))


class DecoderLMHeadModel(LmHeadModel):
    """The parameters of a Llama-style decoder (token embedding, stacked blocks, final norm, output head)
    and its output matrix; Llama, Mixtral and Gemma add their config and forward pass."""

    embed_tokens: hnn.Embedding  # [vocab, embed]
    layers: hnn.Stacked
    norm: eqx.Module
    lm_head: Optional[hnn.Linear]  # embed -> vocab; None when tie_word_embeddings

    def get_lm_head(self) -> NamedArray:
        if self.lm_head is None:
            return self.embed_tokens.weight  # tied (for Gemma: not scaled by sqrt(hidden_dim) as the input is)
        return self.lm_head.weight * self.lm_head.reparam.active_scale

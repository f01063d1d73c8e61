"""Llama: rotary position embeddings, RMSNorm, SwiGLU MLP and grouped-query attention.

Registered as ``type: llama``. Field names and defaults follow upstream Levanter's ``LlamaConfig``.
Layers are stacked with ``haliax.nn.Stacked`` (scan over ``layers``); ``gradient_checkpointing`` (true/false
or a named policy, ``levanter.models.layers.REMAT_POLICIES``) becomes Stacked's remat policy.
``attn_backend`` picks the attention kernel (``levanter.models.attention``); the forward pass builds one
``AttentionMask`` for it and hands it to every layer.

Parameter axes (for sharding): ``embed_tokens [vocab, embed]``, ``q_proj [embed -> heads, head_size]``,
``k_proj``/``v_proj [embed -> kv_heads, head_size]``, ``o_proj [heads, head_size -> embed]``,
``gate_proj``/``up_proj [embed -> mlp]``, ``down_proj [mlp -> embed]``, ``lm_head [embed -> vocab]``
(absent when ``tie_word_embeddings``); block parameters also carry ``layers``. Unlike upstream, the
query projection is laid out ``[heads, head_size]`` (not ``[kv_heads, q_heads_per_group, ...]``) so
a ``heads -> model`` tensor-parallel mapping shards it; attention splits ``heads`` into
``kv_heads x q_heads_per_group`` internally.

RoPE uses the Hugging Face "rotate half" layout (the two halves of ``head_size`` form the complex
pairs) and row positions ``0..L-1``. Rotary encoding is relative, so packed documents see the same
within-document geometry wherever they start in the row. The ``rope`` block accepts upstream's
nested form (``rope: {type: default | linear | llama3 | yarn, theta: ..., ...}``, see
:mod:`levanter.models.rope`); without it, ``rope_theta`` is used.

What the Llama-style models share is defined once, here: the pre-norm attention half of a block
(:class:`PreNormBlock`, :func:`decoder_block_parts`), the block whose residual branches are normalised on
the way out as well as (or instead of) on the way in (:class:`SandwichNormBlock`: Gemma 2, OLMo 2), the
model's parameters and output matrix (:class:`DecoderLMHeadModel`, :func:`init_decoder_parts`) and the
per-pass attention plan (:func:`plan_config_attention`, with the config's sliding window if it has one);
Mistral, Mixtral, Gemma and OLMo 2 build on them. Variants switch the attention through properties of the
config (``qkv_bias``, ``o_bias``, ``qk_norm`` and the axes it normalises over, ``attention_window``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp

import haliax as hax
import haliax.nn as hnn
from haliax import Axis, NamedArray

from .attention import HEAD_SIZE, AttentionMask, dot_product_attention, plan_attention
from .layers import (
    ACTIVATIONS,
    check_positive,
    named,
    normal_embedding,
    normal_linear,
    remat_policy,
)
from ..refused_keys import refused
from .lm_model import LAYERS, LmConfig, LmHeadModel, check_input_length
from .rope import DefaultRopeConfig, RopeConfig, rotary_tables
from .token_dot import linear

__all__ = [
    "UPSTREAM_REFERENCE_CHECKPOINT",
    "LlamaConfig",
    "QkNormAttentionBias",
    "apply_rotary",
    "attention_projections",
    "LlamaAttention",
    "LlamaMlp",
    "LlamaDecoderLayer",
    "LlamaLMHeadModel",
    "PreNormBlock",
    "SandwichNormBlock",
    "DecoderLMHeadModel",
    "decoder_block_parts",
    "init_decoder_parts",
    "plan_config_attention",
    "rms_norm",
]

# Upstream LlamaConfig's default reference checkpoint: a config that names it chose nothing.
UPSTREAM_REFERENCE_CHECKPOINT = "NousResearch/Llama-2-7b-hf"


@LmConfig.register_subclass("llama")
@dataclasses.dataclass(frozen=True)
class LlamaConfig(LmConfig):
    """A Llama decoder: RMS norms, rotary positions, a gated MLP, grouped-query attention."""

    seq_len: int = 2048
    hidden_dim: int = 4096
    num_layers: int = 32
    # Attention (query) heads; the head size (head_dim) must be even.
    num_heads: int = 32
    # Width of the gated MLP's hidden layer.
    intermediate_dim: int = 11008
    # Activation of the MLP's gate (silu, gelu, gelu_new, relu, ...).
    activation_function: str = "silu"
    upcast_attn: bool = False
    use_bias: bool = False
    # Key/value heads (grouped-query attention): num_heads must be a multiple of it.
    num_kv_heads: int = 32
    # Size of each attention head; null means hidden_dim / num_heads (which must then divide evenly).
    head_dim: Optional[int] = None
    # The output head reuses the token-embedding matrix instead of a matrix of its own.
    tie_word_embeddings: bool = False
    # Give the RMS norms a learned scale.
    use_layer_norm_weight: bool = True
    # Base of the rotary frequencies (rope.theta, when the rope section is given, takes precedence).
    rope_theta: float = 10000.0
    # Upstream's nested rotary settings; overrides rope_theta when given.
    rope: Optional[RopeConfig] = None
    # Upstream's Hugging Face checkpoint that the model converts from and to; refused if set, except to
    # upstream's default (NousResearch/Llama-2-7b-hf), which its exported configs write out.
    reference_checkpoint: Optional[str] = refused(
        "Hugging Face checkpoints are not read through the model config here; use initialize_from_hf to start "
        "from one, or remove the key", default=None, also=(UPSTREAM_REFERENCE_CHECKPOINT,)
    )
    # Upstream's tokenizer for Hugging Face exports; refused if set (data.tokenizer is the one used).
    tokenizer: Optional[str] = refused("the tokenizer is data.tokenizer; remove model.tokenizer")

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "intermediate_dim", "num_kv_heads")
        if self.head_dim is not None:
            check_positive(self, "head_dim")
        elif self.hidden_dim % self.num_heads != 0:
            raise ValueError(
                f"model.hidden_dim ({self.hidden_dim}) must be divisible by model.num_heads ({self.num_heads}), "
                "or set model.head_dim"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be divisible by "
                f"model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.HeadSize.size % 2 != 0:
            raise ValueError(
                f"the head size ({self.HeadSize.size}: model.head_dim, or hidden_dim / num_heads) must be even for RoPE"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"model.rope_theta must be positive, got {self.rope_theta}")
        self.rope_config.check()

    # Variants built on Llama (levanter.models.qwen) switch these; Llama itself follows use_bias throughout.
    @property
    def qkv_bias(self) -> bool:
        """Whether the query, key and value projections have biases."""
        return self.use_bias

    @property
    def o_bias(self) -> bool:
        """Whether the attention output projection has a bias."""
        return self.use_bias

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys pass through an RMS norm (before the rotary encoding)."""
        return False

    def qk_norm_axes(self, Heads: Axis) -> Axis | tuple[Axis, ...]:
        """What the query (``Heads`` is :attr:`Heads`) or key (:attr:`KVHeads`) RMS norm normalises over,
        and the axes of its scale: each head on its own (``head_size``, Qwen3) unless a variant says otherwise."""
        return self.HeadSize

    @property
    def attention_window(self) -> Optional[int]:
        """The sliding attention window in positions (each query sees its own and the ``window - 1`` before it)
        of every layer, or None for the whole causal prefix."""
        return None

    @property
    def rope_config(self) -> RopeConfig:
        """The rotary settings in force: ``rope`` when given, else plain RoPE at ``rope_theta``."""
        return self.rope if self.rope is not None else DefaultRopeConfig(theta=float(self.rope_theta))

    @property
    def rope_theta_and_factor(self) -> tuple[float, float]:
        rope = self.rope_config
        return float(rope.theta), float(getattr(rope, "factor", 1.0))

    @property
    def Heads(self) -> Axis:
        return Axis("heads", self.num_heads)

    @property
    def KVHeads(self) -> Axis:
        return Axis("kv_heads", self.num_kv_heads)

    @property
    def HeadSize(self) -> Axis:
        return Axis(HEAD_SIZE, self.head_dim if self.head_dim is not None else self.hidden_dim // self.num_heads)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_dim)

    @property
    def Layers(self) -> Axis:
        return Axis(LAYERS, self.num_layers)

    def build(self, Vocab: Axis, *, key) -> "LlamaLMHeadModel":
        return LlamaLMHeadModel.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        d, s = self.hidden_dim, self.seq_len
        q = self.num_heads * self.HeadSize.size  # query (and attention output) width
        kv = self.num_kv_heads * self.HeadSize.size
        proj = 2 * d * (q + 2 * kv) + 2 * q * d  # q, k, v, o
        mlp = 2 * 3 * d * self.intermediate_dim  # gate, up, down
        attn = 2 * 2 * s * q  # scores + weighted sum over the full map
        forward = self.num_layers * (proj + mlp + attn) + 2 * d * vocab_size
        return 3.0 * forward


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


def attention_projections(config: LlamaConfig, *, key) -> tuple[hnn.Linear, hnn.Linear, hnn.Linear, hnn.Linear]:
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
    config: LlamaConfig = eqx.field(static=True)

    @staticmethod
    def init(config: LlamaConfig, *, key) -> "LlamaAttention":
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
    def init(config: LlamaConfig, *, key) -> "LlamaMlp":
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


def rms_norm(config: LlamaConfig, axis: Optional[Axis | tuple[Axis, ...]] = None) -> hnn.RmsNorm:
    # Normalise in float32 whatever the activation dtype (the statistic is a mean of squares).
    return hnn.RmsNorm.init(
        axis if axis is not None else config.Embed,
        eps=config.layer_norm_epsilon,
        use_weight=config.use_layer_norm_weight,
        use_bias=config.use_bias and axis is None,
        dtype=jnp.float32,
    )


def decoder_block_parts(config: LlamaConfig, FeedForward: type, *, key) -> tuple:
    """``(input_layernorm, self_attn, post_attention_layernorm, feed_forward)`` of a pre-norm Llama-style
    block whose feed-forward is ``FeedForward.init(config, key=...)`` (Llama's MLP, Mixtral's experts)."""
    k_attn, k_ff = jax.random.split(key)
    attn, ff = LlamaAttention.init(config, key=k_attn), FeedForward.init(config, key=k_ff)
    return rms_norm(config), attn, rms_norm(config), ff


def init_decoder_parts(Vocab: Axis, config: LmConfig, Layer: type, *, key) -> tuple:
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


def plan_config_attention(config: LmConfig, Pos: Axis, segment_ids: NamedArray | None, dtype) -> AttentionMask:
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
        window=getattr(config, "attention_window", None),
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


class LlamaDecoderLayer(PreNormBlock):
    mlp: LlamaMlp

    @staticmethod
    def init(config: LlamaConfig, *, key) -> "LlamaDecoderLayer":
        return LlamaDecoderLayer(*decoder_block_parts(config, LlamaMlp, key=key))

    def __call__(
        self, x: NamedArray, mask: AttentionMask, cos: NamedArray, sin: NamedArray, *, key=None
    ) -> NamedArray:
        del key  # no dropout in Llama; accepted so every block has the same signature
        x = self.attend(x, mask, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


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


class LlamaLMHeadModel(DecoderLMHeadModel):
    config: LlamaConfig = eqx.field(static=True)
    Vocab: Axis = eqx.field(static=True)

    @staticmethod
    def init(Vocab: Axis, config: LlamaConfig, *, key, Layer: type = LlamaDecoderLayer) -> "LlamaLMHeadModel":
        """A Llama-style model whose blocks are ``Layer`` (Llama's, or a variant's called the same way:
        ``layer(x, mask, cos, sin, key=...)``)."""
        embed_tokens, layers, lm_head = init_decoder_parts(Vocab, config, Layer, key=key)
        norm = rms_norm(config)
        return LlamaLMHeadModel(
            embed_tokens=embed_tokens, layers=layers, norm=norm, lm_head=lm_head, config=config, Vocab=Vocab
        )

    def activations(
        self, input_ids: NamedArray, segment_ids: NamedArray | None = None, *, key=None
    ) -> NamedArray:
        del key  # no dropout
        Pos = check_input_length(self.config, input_ids)
        x = self.embed_tokens.embed(input_ids)
        mask = plan_config_attention(self.config, Pos, segment_ids, x.dtype)
        cos, sin = rotary_tables(Pos, self.config.HeadSize, self.config.rope_config)
        # mask, cos and sin have no `layers` axis, so the scan passes them unchanged to every layer.
        # scan_layers=False unrolls the loop at trace time; the parameters stay stacked either way.
        x = self.layers.fold(x, mask, cos, sin, unroll=not self.config.scan_layers)

        return self.norm(x)

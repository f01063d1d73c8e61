"""Gemma (the first generation): Llama's block with Gemma's norms, embedding scale, MLP and head size.

Registered as ``type: gemma`` (upstream Levanter's name). What differs from :mod:`levanter.models.llama`:

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
(:class:`~levanter.models.llama.LlamaAttention`, :class:`~levanter.models.llama.LlamaMlp`): the parameter
names, axes (``q_proj [embed -> heads, head_size]`` and so on), activation checkpoint names, attention backends
and FLOP count are therefore shared, and a Gemma checkpoint uses the same Hugging Face tensor names as a Llama
one. Only the norms, the embedding scale and the model around the blocks are Gemma's own
(:class:`GemmaLMHeadModel`, not a ``LlamaLMHeadModel``). The trade-off is that Gemma follows Llama's
structure; a change there is a change here.

Gemma 2 (logit soft-capping, alternating sliding-window layers, extra norms around each sub-block) is a
different ``model_type`` in Hugging Face and is not implemented here.
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

from .attention import plan_attention
from .layers import normal_embedding, normal_linear, remat_policy
from .llama import LlamaAttention, LlamaConfig, LlamaMlp
from .lm_model import LmConfig, LmHeadModel, check_input_length
from .rope import rotary_tables


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


class GemmaLMHeadModel(LmHeadModel):
    embed_tokens: hnn.Embedding  # [vocab, embed]
    layers: hnn.Stacked[GemmaDecoderLayer]
    norm: GemmaRmsNorm
    lm_head: Optional[hnn.Linear]  # embed -> vocab; None when tie_word_embeddings
    config: GemmaConfig = eqx.field(static=True)
    Vocab: Axis = eqx.field(static=True)

    @staticmethod
    def init(Vocab: Axis, config: GemmaConfig, *, key) -> "GemmaLMHeadModel":
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        std = config.initializer_range
        embed_tokens = normal_embedding(Vocab, config.Embed, std=std, key=k_embed)
        layers = hnn.Stacked.init(
            config.Layers, GemmaDecoderLayer, gradient_checkpointing=remat_policy(config.gradient_checkpointing)
        )(config, key=jax.random.split(k_layers, config.num_layers))
        lm_head = None
        if not config.tie_word_embeddings:
            lm_head = normal_linear(config.Embed, Vocab, std=std, use_bias=False, key=k_head)
        norm = GemmaRmsNorm.init(config.Embed, config.layer_norm_epsilon)
        return GemmaLMHeadModel(
            embed_tokens=embed_tokens, layers=layers, norm=norm, lm_head=lm_head, config=config, Vocab=Vocab
        )

    def get_lm_head(self) -> NamedArray:
        if self.lm_head is None:
            return self.embed_tokens.weight  # tied, and (unlike the input) not scaled by sqrt(hidden_dim)
        return self.lm_head.weight * self.lm_head.reparam.active_scale

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

        mask = plan_attention(
            c.attention_backend,
            Pos,
            segment_ids,
            block_size=c.flash_attention_block_size,
            dtype=jnp.float32 if c.upcast_attn else x.dtype,
            head_size=c.HeadSize.size,
        )
        cos, sin = rotary_tables(Pos, c.HeadSize, c.rope_config)
        # mask, cos and sin have no `layers` axis, so the scan passes them unchanged to every layer.
        x = self.layers.fold(x, mask, cos, sin, unroll=not c.scan_layers)
        return self.norm(x)

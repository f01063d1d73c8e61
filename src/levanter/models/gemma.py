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

The attention and MLP modules are Llama's (:class:`~levanter.models.llama.LlamaAttention`,
:class:`~levanter.models.llama.LlamaMlp`): the parameter names, axes (``q_proj [embed -> heads, head_size]``
and so on), activation checkpoint names and attention backends are therefore shared, and a Gemma checkpoint
uses the same Hugging Face tensor names as a Llama one. The trade-off is that Gemma follows Llama's
structure; a change there is a change here.

Gemma 2 (logit soft-capping, alternating sliding-window layers, extra norms around each sub-block) is a
different ``model_type`` in Hugging Face and is not implemented here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp

import haliax as hax
import haliax.nn as hnn
from haliax import Axis, NamedArray

from ..config_doc import refused
from .attention import check_attn_config, check_backend_platform, plan_attention
from .layers import check_activation, check_epsilon, check_positive, check_remat, normal_embedding, normal_linear
from .layers import remat_policy
from .llama import HEAD_SIZE, LlamaAttention, LlamaMlp
from .lm_model import LAYERS, LmConfig, LmHeadModel, check_input_length
from .rope import DefaultRopeConfig, RopeConfig, rotary_tables


@LmConfig.register_subclass("gemma")
@dataclasses.dataclass(frozen=True)
class GemmaConfig(LmConfig):
    """A Gemma decoder: Llama's block with (1 + weight) RMS norms, scaled embeddings and a free head size.

    Defaults are Gemma 2B's shape (the vocabulary is the tokenizer's)."""

    # Tokens per training sequence (the context length).
    seq_len: int = 8192
    # Width of the residual stream (the token embedding's size).
    hidden_dim: int = 2048
    # Width of the gated MLP's hidden layer.
    intermediate_dim: int = 16384
    # Transformer blocks.
    num_layers: int = 18
    # Attention (query) heads.
    num_heads: int = 8
    # Size of each attention head, independent of hidden_dim / num_heads; must be even (RoPE).
    head_dim: int = 256
    # Key/value heads: 1 is multi-query attention; num_heads must be a multiple of it.
    num_kv_heads: int = 1
    # Activation of the MLP's gate: Gemma's is the tanh approximation of GELU (gelu_new).
    activation_function: str = "gelu_new"
    # Standard deviation of the normal initialisation of the weights.
    initializer_range: float = 0.02
    # Epsilon of the RMS norms, in (0, 1].
    layer_norm_epsilon: float = 1e-6
    # Multiply the token embeddings by sqrt(hidden_dim) before the first block (Gemma does).
    norm_embeddings: bool = True
    # The output head reuses the token-embedding matrix instead of a matrix of its own (Gemma's are tied).
    tie_word_embeddings: bool = True
    # Compute the attention scores and softmax in float32 under a lower-precision policy.
    upcast_attn: bool = False
    # Give the linear layers biases (Gemma's have none; a model with them cannot be exported to Hugging Face).
    use_bias: bool = False
    # true/false or a named remat policy (levanter.models.layers.REMAT_POLICIES).
    gradient_checkpointing: Union[bool, str] = True
    # True: the layers run as one lax.scan; False: the same stacked parameters, the loop unrolled when traced.
    scan_layers: bool = True
    # Which attention kernel runs (levanter.models.attention.ATTN_BACKENDS); None means "default", or what
    # upstream's use_flash_attention says when only that is given (true: jax_flash, false: vanilla).
    attn_backend: Optional[str] = None
    # Upstream's switch for the attention kernel: true runs jax_flash, false vanilla (attn_backend wins).
    use_flash_attention: Optional[bool] = None
    # Query/key block of jax_flash and splash; None means 512 (or the whole sequence when shorter).
    flash_attention_block_size: Optional[int] = None
    # Base of the rotary frequencies (rope.theta, when the rope section is given, takes precedence).
    rope_theta: float = 10000.0
    # Upstream's nested rotary settings; overrides rope_theta when given.
    rope: Optional[RopeConfig] = None
    # Upstream's Hugging Face checkpoint that the model converts from and to; refused if set.
    reference_checkpoint: Optional[str] = refused(
        "Hugging Face checkpoints are not read through the model config here; remove the key", default=None
    )
    # Upstream's tokenizer for Hugging Face exports; refused if set (data.tokenizer is the one used).
    tokenizer: Optional[str] = refused("the tokenizer is data.tokenizer; remove model.tokenizer")


    def __post_init__(self):
        super().__post_init__()
        check_positive(
            self, "seq_len", "hidden_dim", "intermediate_dim", "num_layers", "num_heads", "head_dim", "num_kv_heads"
        )
        check_epsilon(self.layer_norm_epsilon)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"model.head_dim ({self.head_dim}) must be even for RoPE")
        if self.rope_theta <= 0:
            raise ValueError(f"model.rope_theta must be positive, got {self.rope_theta}")
        self.rope_config.check()
        check_activation(self.activation_function)
        check_remat(self.gradient_checkpointing)
        self.attention_backend  # validates attn_backend, use_flash_attention, flash_attention_block_size
        if self.attention_backend == "cudnn" and self.upcast_attn:
            raise ValueError(
                "model.attn_backend 'cudnn' needs model.upcast_attn: false (cuDNN takes bfloat16/float16 queries "
                "and keys; the scores and softmax are float32 inside it either way)"
            )

    @property
    def attention_backend(self) -> str:
        """The requested backend (``default`` until resolved for a platform); validates the keys."""
        return check_attn_config(self.attn_backend, self.use_flash_attention, self.flash_attention_block_size)

    def check_platform(self, platform: str) -> None:
        """Refuse an ``attn_backend`` that ``platform`` (``jax.default_backend()``) cannot run."""
        check_backend_platform(self.attention_backend, platform)

    @property
    def rope_config(self) -> RopeConfig:
        """The rotary settings in force: ``rope`` when given, else plain RoPE at ``rope_theta``."""
        return self.rope if self.rope is not None else DefaultRopeConfig(theta=float(self.rope_theta))

    @property
    def Heads(self) -> Axis:
        return Axis("heads", self.num_heads)

    @property
    def KVHeads(self) -> Axis:
        return Axis("kv_heads", self.num_kv_heads)

    @property
    def HeadSize(self) -> Axis:
        return Axis(HEAD_SIZE, self.head_dim)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_dim)

    @property
    def Layers(self) -> Axis:
        return Axis(LAYERS, self.num_layers)

    def build(self, Vocab: Axis, *, key) -> "GemmaLMHeadModel":
        return GemmaLMHeadModel.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        d, s = self.hidden_dim, self.seq_len
        q = self.num_heads * self.head_dim  # the attention width, not hidden_dim
        kv = self.num_kv_heads * self.head_dim
        proj = 2 * d * (q + 2 * kv) + 2 * q * d  # q, k, v, o
        mlp = 2 * 3 * d * self.intermediate_dim  # gate, up, down
        attn = 2 * 2 * s * q  # scores + weighted sum over the full map
        forward = self.num_layers * (proj + mlp + attn) + 2 * d * vocab_size  # the (tied) head is a matmul too
        return 3.0 * forward


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
            head_size=c.head_dim,
        )
        cos, sin = rotary_tables(Pos, c.HeadSize, c.rope_config)
        # mask, cos and sin have no `layers` axis, so the scan passes them unchanged to every layer.
        x = self.layers.fold(x, mask, cos, sin, unroll=not c.scan_layers)
        return self.norm(x)

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

Llama's block (:class:`LlamaDecoderLayer`) and model (:class:`LlamaLMHeadModel`) are built from the parts
every Llama-style family shares (:mod:`levanter.models.decoder`: the attention, the MLP, the norms, the
pre-norm block, the model's parameters and the per-pass attention plan). Qwen2, Qwen3, Mistral and OLMo 2
are ``LlamaLMHeadModel``s whose config is their own subclass of :class:`LlamaConfig`; Mixtral and Gemma build
their own models from the same parts.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import equinox as eqx
from haliax import Axis, NamedArray

from ..refused_keys import refused
from .attention import HEAD_SIZE, AttentionMask
from .decoder import (
    DecoderLMHeadModel,
    LlamaMlp,
    PreNormBlock,
    decoder_block_parts,
    init_decoder_parts,
    plan_config_attention,
    rms_norm,
)
from .layers import check_positive
from .lm_model import LAYERS, LmConfig, check_input_length
from .rope import DefaultRopeConfig, RopeConfig, rotary_tables

__all__ = ["UPSTREAM_REFERENCE_CHECKPOINT", "LlamaConfig", "LlamaDecoderLayer", "LlamaLMHeadModel"]

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
        return float(rope.theta), rope.scaling_factor()

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

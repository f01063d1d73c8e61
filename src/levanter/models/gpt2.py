"""GPT-2: learned absolute position embeddings, pre-LayerNorm blocks, tied input/output embeddings.

Registered as ``type: gpt2``. Field names and defaults follow upstream Levanter's ``Gpt2Config``.
Layers are stacked with ``haliax.nn.Stacked`` (a ``lax.scan`` over the ``layers`` axis), so compile
time does not grow with depth; ``gradient_checkpointing`` (true/false or a named policy,
``levanter.models.layers.REMAT_POLICIES``) becomes ``Stacked``'s remat policy. ``attn_backend`` picks the
attention kernel (``levanter.models.attention``); the forward pass builds one ``AttentionMask`` for it
and hands it to every layer. Attention dropout (``attn_pdrop``) exists only in the ``vanilla`` kernel.

Parameter axes (for sharding): ``wte [vocab, embed]``, ``wpe [position, embed]``,
``c_attn [embed -> qkv, heads, head_size]`` (applied as three products, one per ``qkv`` slice, so that q, k and
v never share one intermediate), ``c_proj [heads, head_size -> embed]``,
``c_fc [embed -> mlp]``, ``mlp c_proj [mlp -> embed]``; every block parameter also has ``layers``.

Initialisation follows GPT-2: normal(0, ``initializer_range``) everywhere, with the two residual
output projections scaled by ``1/sqrt(2 * num_layers)`` so the residual stream's variance does not
grow with depth. Dropout runs only when a PRNG key is passed to the model.
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
import haliax.quantization as hq
from haliax import Axis, NamedArray

from .attention import AttentionMask, dot_product_attention, plan_attention
from .layers import (
    ACTIVATIONS,
    check_positive,
    named,
    normal_embedding,
    normal_linear,
    remat_policy,
)
from .lm_model import LAYERS, LmConfig, LmHeadModel, check_input_length, split_key
from .token_dot import linear, token_dot_kernel

__all__ = ["Gpt2Config", "Gpt2Attention", "Gpt2Mlp", "Gpt2Block", "Gpt2LMHeadModel"]


@LmConfig.register_subclass("gpt2")
@dataclasses.dataclass(frozen=True)
class Gpt2Config(LmConfig):
    """A GPT-2 decoder: learned positions, layer norms, a plain MLP."""

    # Tokens per training sequence (the context length; at most n_positions).
    seq_len: int = 1024
    hidden_dim: int = 768
    num_layers: int = 12
    # Attention heads; hidden_dim must be a multiple of it.
    num_heads: int = 12
    activation_function: str = "gelu_new"
    upcast_attn: bool = True
    use_bias: bool = True
    # The MLP's hidden layer is mlp_scale x hidden_dim wide.
    mlp_scale: int = 4
    # Dropout rate on the embeddings (0: none).
    embed_pdrop: float = 0.0
    # Dropout rate on each block's residual branches (0: none).
    resid_pdrop: float = 0.0
    # Dropout rate on the attention weights (0: none).
    attn_pdrop: float = 0.0
    # Scale each layer's attention scores by 1 / (layer index + 1), as GPT-2's option does.
    scale_attn_by_inverse_layer_idx: bool = False
    # Rows of the learned position table (HF's n_positions); None means seq_len. Training on longer
    # sequences than the table has is refused up front.
    n_positions: Optional[int] = None

    has_hard_seq_len_limit = True  # learned position embeddings

    @property
    def max_seq_len(self) -> int:
        return self.n_positions if self.n_positions is not None else self.seq_len

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "mlp_scale")
        if self.n_positions is not None and self.seq_len > self.n_positions:
            raise ValueError(
                f"model.seq_len ({self.seq_len}) exceeds the model's {self.n_positions} learned positions "
                "(model.n_positions)"
            )
        if self.hidden_dim % self.num_heads != 0:
            raise ValueError(
                f"model.hidden_dim ({self.hidden_dim}) must be divisible by "
                f"model.num_heads ({self.num_heads})"
            )
        for name in ("embed_pdrop", "resid_pdrop", "attn_pdrop"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"model.{name} must be in [0, 1), got {p}")
        backend = self.attention_backend
        if self.attn_pdrop > 0.0 and backend not in ("default", "vanilla"):
            raise ValueError(
                f"model.attn_pdrop={self.attn_pdrop} needs model.attn_backend: vanilla (or default); "
                f"{backend!r} has no attention dropout"
            )

    @property
    def Heads(self) -> Axis:
        return Axis("heads", self.num_heads)

    @property
    def HeadSize(self) -> Axis:
        return Axis("head_size", self.hidden_dim // self.num_heads)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.hidden_dim * self.mlp_scale)

    @property
    def Layers(self) -> Axis:
        return Axis(LAYERS, self.num_layers)

    def build(self, Vocab: Axis, *, key) -> "Gpt2LMHeadModel":
        return Gpt2LMHeadModel.init(Vocab, self, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        d, mlp, s = self.hidden_dim, self.Mlp.size, self.seq_len
        per_layer = 2 * (4 * d * d + 2 * d * mlp) + 2 * 2 * s * d  # qkv+out, mlp; scores + weighted sum
        forward = self.num_layers * per_layer + 2 * d * vocab_size
        return 3.0 * forward


class Gpt2Attention(eqx.Module):
    c_attn: hnn.Linear  # embed -> (qkv, heads, head_size)
    c_proj: hnn.Linear  # (heads, head_size) -> embed
    config: Gpt2Config = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2Attention":
        k_attn, k_proj = jax.random.split(key)
        Qkv = Axis("qkv", 3)
        std = config.initializer_range
        c_attn = normal_linear(
            config.Embed, (Qkv, config.Heads, config.HeadSize), std=std, use_bias=config.use_bias, key=k_attn
        )
        resid_std = std / math.sqrt(2 * config.num_layers)
        c_proj = normal_linear(
            (config.Heads, config.HeadSize), config.Embed, std=resid_std, use_bias=config.use_bias, key=k_proj
        )
        return Gpt2Attention(c_attn, c_proj, config)

    def __call__(self, x: NamedArray, mask: AttentionMask, layer_idx: NamedArray, *, key=None) -> NamedArray:
        c = self.config
        q, k, v = self._qkv(x)
        scale = 1.0 / math.sqrt(c.HeadSize.size)
        if c.scale_attn_by_inverse_layer_idx:
            # layer_idx is a traced scalar (scanned alongside the stacked blocks), so no recompile per layer.
            scale = scale / (layer_idx.astype(jnp.float32) + 1.0)
        attn = dot_product_attention(
            q, k, v, mask, scale=scale, upcast=c.upcast_attn, dropout=c.attn_pdrop, key=key
        )
        return named(linear(self.c_proj, named(attn, "context")), "out_proj")

    def _qkv(self, x: NamedArray) -> tuple[NamedArray, NamedArray, NamedArray]:
        """The queries, keys and values: three products with the slices of ``c_attn``'s weight (and bias)
        rather than one product sliced afterwards. Each bias add then fuses into its product, and no
        ``[..., qkv, heads, head_size]`` intermediate is written, split and, in the backward pass, assembled
        again (on a TPU those element-wise passes cost more than the product). Under fp8 ``c_attn`` keeps the
        one product, so that its scales' history sees each step once; the int8 kernel keeps no state and
        takes the slices as the plain product does."""
        if isinstance(token_dot_kernel(self.c_attn), hq.Fp8DotGeneralOp):
            qkv = named(linear(self.c_attn, x), "qkv_proj")
            return qkv["qkv", 0], qkv["qkv", 1], qkv["qkv", 2]
        q, k, v = (named(linear(self.c_attn, x, ("qkv", i)), name)
                   for i, name in enumerate(("query_proj", "key_proj", "value_proj")))
        return q, k, v


class Gpt2Mlp(eqx.Module):
    c_fc: hnn.Linear  # embed -> mlp
    c_proj: hnn.Linear  # mlp -> embed
    activation_function: str = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2Mlp":
        k_fc, k_proj = jax.random.split(key)
        std = config.initializer_range
        c_fc = normal_linear(config.Embed, config.Mlp, std=std, use_bias=config.use_bias, key=k_fc)
        resid_std = std / math.sqrt(2 * config.num_layers)
        c_proj = normal_linear(config.Mlp, config.Embed, std=resid_std, use_bias=config.use_bias, key=k_proj)
        return Gpt2Mlp(c_fc, c_proj, config.activation_function)

    def __call__(self, x: NamedArray) -> NamedArray:
        hidden = ACTIVATIONS[self.activation_function](named(linear(self.c_fc, x), "mlpwi"))
        return named(linear(self.c_proj, hidden), "mlpwo")


def _layer_norm(config: Gpt2Config) -> hnn.LayerNorm:
    return hnn.LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_bias=config.use_bias)


class Gpt2Block(eqx.Module):
    ln_1: hnn.LayerNorm
    attn: Gpt2Attention
    ln_2: hnn.LayerNorm
    mlp: Gpt2Mlp
    config: Gpt2Config = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2Config, *, key) -> "Gpt2Block":
        k_attn, k_mlp = jax.random.split(key)
        attn, mlp = Gpt2Attention.init(config, key=k_attn), Gpt2Mlp.init(config, key=k_mlp)
        return Gpt2Block(_layer_norm(config), attn, _layer_norm(config), mlp, config)

    def __call__(self, x: NamedArray, mask: AttentionMask, layer_idx: NamedArray, *, key=None) -> NamedArray:
        k_attn, k_drop1, k_drop2 = split_key(key, 3)
        p = self.config.resid_pdrop
        h = self.attn(self.ln_1(x), mask, layer_idx, key=k_attn)
        x = x + hnn.dropout(h, p, inference=k_drop1 is None, key=k_drop1)
        h = self.mlp(self.ln_2(x))
        return x + hnn.dropout(h, p, inference=k_drop2 is None, key=k_drop2)


class Gpt2LMHeadModel(LmHeadModel):
    wte: hnn.Embedding  # [vocab, embed]; also the output projection (tied)
    wpe: hnn.Embedding  # [position, embed]
    blocks: hnn.Stacked[Gpt2Block]
    ln_f: hnn.LayerNorm
    config: Gpt2Config = eqx.field(static=True)
    Vocab: Axis = eqx.field(static=True)

    @staticmethod
    def init(Vocab: Axis, config: Gpt2Config, *, key) -> "Gpt2LMHeadModel":
        k_wte, k_wpe, k_blocks = jax.random.split(key, 3)
        std = config.initializer_range
        wte = normal_embedding(Vocab, config.Embed, std=std, key=k_wte)
        # GPT-2 initialises position embeddings at half the token-embedding scale.
        wpe = normal_embedding(Axis("position", config.max_seq_len), config.Embed, std=std / 2, key=k_wpe)
        remat = remat_policy(config.gradient_checkpointing)
        stack = hnn.Stacked.init(config.Layers, Gpt2Block, gradient_checkpointing=remat)
        blocks = stack(config, key=jax.random.split(k_blocks, config.num_layers))
        ln_f = _layer_norm(config)
        return Gpt2LMHeadModel(wte=wte, wpe=wpe, blocks=blocks, ln_f=ln_f, config=config, Vocab=Vocab)

    def get_lm_head(self) -> NamedArray:
        return self.wte.weight  # tied: the output projection is the token embedding

    # Learned positions are read by row position: a packed evaluation passes each request's own (pos_ids).
    absolute_positions = True

    def activations(
        self, input_ids: NamedArray, segment_ids: NamedArray | None = None, *, key=None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """As :meth:`LmHeadModel.activations`; ``pos_ids`` (the axes of ``input_ids``), where given, are the
        rows of the position table each token reads instead of its position in the row (requests packed
        into one row each start at 0, as they would alone)."""
        Pos = check_input_length(self.config, input_ids)
        k_embed, k_blocks = split_key(key, 2)

        positions = self.wpe.weight["position", : Pos.size] if pos_ids is None else self.wpe.embed(pos_ids)
        x = self.wte.embed(input_ids) + positions
        x = hnn.dropout(x, self.config.embed_pdrop, inference=k_embed is None, key=k_embed)

        c = self.config
        mask = plan_attention(
            c.attention_backend,
            Pos,
            segment_ids,
            block_size=c.flash_attention_block_size,
            splash_block_sizes=c.splash_block_sizes,
            dtype=jnp.float32 if c.upcast_attn else x.dtype,
            head_size=c.HeadSize.size,
            dropout=c.attn_pdrop if k_blocks is not None else 0.0,
        )
        layer_idx = hax.arange(self.config.Layers)  # scanned with the blocks (inverse-layer-idx scaling)
        block_keys = None if k_blocks is None else jax.random.split(k_blocks, self.config.num_layers)
        # scan_layers=False unrolls the loop at trace time; the parameters stay stacked either way.
        x = self.blocks.fold(x, mask, layer_idx, key=block_keys, unroll=not self.config.scan_layers)

        return self.ln_f(x)

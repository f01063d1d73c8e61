"""OLMo 2: a Llama decoder with its norms moved onto the residual branches' outputs and a norm over the
whole query and key projections.

Registered as ``type: olmo2`` (upstream Levanter's name, field names and defaults: OLMo 2 7B's shape). What
OLMo 2 changes in :mod:`levanter.models.llama`:

* No norm on a branch's input: each block is ``x + post_attention_layernorm(attn(x))``, then
  ``x + post_feedforward_layernorm(mlp(x))`` -- :class:`~levanter.models.decoder.SandwichNormBlock` with
  only its two output norms (Gemma 2 uses all four). The final norm before the head is kept.
* The queries and keys pass through an RMS norm with a learned scale over the whole projection
  (``heads x head_size`` for the queries, ``kv_heads x head_size`` for the keys), not over each head as in
  Qwen3, after the projection and before the rotary encoding. It is Llama's qk-norm switch
  (``LlamaConfig.qk_norm``) with the axes set by :meth:`Olmo2Config.qk_norm_axes`, so the attention module is
  Llama's and the scale tensors have Hugging Face's shape (one vector of ``num_heads * head_dim``).
* ``attention_bias: true`` gives all four attention projections biases (Hugging Face's option; the MLP
  never has them).

An OLMo 2 model is a ``LlamaLMHeadModel`` whose blocks are :class:`Olmo2DecoderLayer`; parameter names are
the checkpoints' (``self_attn.q_norm``, ``post_attention_layernorm``, ``post_feedforward_layernorm``), and
FLOPs per token are Llama's (the norms are not matmuls). Trade-off: the norms are haliax's RMS norm, which
rounds to the activation dtype before applying the scale; transformers' OLMo 2 applies the scale in
float32 first. In float32 the two are the same; under bfloat16 they differ by rounding only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from haliax import Axis, NamedArray

from ..refused_keys import refused
from .attention import AttentionMask
from .decoder import LlamaMlp, QkNormAttentionBias, SandwichNormBlock, decoder_block_parts, rms_norm
from .llama import UPSTREAM_REFERENCE_CHECKPOINT, LlamaConfig, LlamaLMHeadModel
from .lm_model import LmConfig

__all__ = ["OLMO2_REFERENCE_CHECKPOINT", "Olmo2Config", "Olmo2DecoderLayer"]

# Upstream Olmo2Config's default reference checkpoint: a config that names it chose nothing.
OLMO2_REFERENCE_CHECKPOINT = "allenai/OLMo-2-1124-7B"


@LmConfig.register_subclass("olmo2")
@dataclasses.dataclass(frozen=True)
class Olmo2Config(QkNormAttentionBias, LlamaConfig):
    """An OLMo 2 decoder: norms on the residual branches' outputs, an RMS norm over the whole query and key
    projections. Every other field means what it means for Llama."""

    seq_len: int = 4096
    layer_norm_epsilon: float = 1e-6
    # Give the query, key, value and output projections biases (Hugging Face's attention_bias).
    attention_bias: bool = False
    # Upstream's attention-probability dropout; refused unless 0.
    attention_dropout: float = refused(
        "attention dropout is not implemented for OLMo 2 here; remove the key", default=0.0
    )
    # Upstream's Hugging Face checkpoint that the model converts from and to; refused if set, except to
    # upstream's defaults (allenai/OLMo-2-1124-7B, and Llama's), which its configs write out.
    reference_checkpoint: Optional[str] = refused(
        "Hugging Face checkpoints are not read through the model config here; use initialize_from_hf to start "
        "from one, or remove the key", default=None, also=(OLMO2_REFERENCE_CHECKPOINT, UPSTREAM_REFERENCE_CHECKPOINT)
    )

    def qk_norm_axes(self, Heads: Axis) -> tuple[Axis, ...]:
        # Over every head at once: the projection's whole width, as OLMo 2 normalises it.
        return (Heads, self.HeadSize)

    def build(self, Vocab: Axis, *, key) -> LlamaLMHeadModel:
        return LlamaLMHeadModel.init(Vocab, self, key=key, Layer=Olmo2DecoderLayer)


class Olmo2DecoderLayer(SandwichNormBlock):
    """OLMo 2's block: Llama's attention and MLP, each followed (not preceded) by an RMS norm."""

    @staticmethod
    def init(config: Olmo2Config, *, key) -> "Olmo2DecoderLayer":
        # Llama's parts, drawn from the same keys; the input norm is dropped (OLMo 2 has none).
        _, attn, _, mlp = decoder_block_parts(config, LlamaMlp, key=key)
        return Olmo2DecoderLayer(None, attn, rms_norm(config), None, mlp, rms_norm(config))

    def __call__(
        self, x: NamedArray, mask: AttentionMask, cos: NamedArray, sin: NamedArray, *, key=None
    ) -> NamedArray:
        del key  # no dropout; accepted so every block has the same signature
        return self.branches(x, mask, cos, sin)

"""Qwen2 and Qwen3: Llama decoders with small changes to attention.

Registered as ``type: qwen2`` and ``type: qwen3``. Both reuse Llama's modules (:mod:`levanter.models.decoder`:
RMS norms, rotary positions, a gated MLP, grouped-query attention) and switch the attention options that
``LlamaConfig`` exposes as properties, so there is one implementation of the block to keep fast:

* Qwen2: the query, key and value projections have biases (the output projection and the MLP have none).
* Qwen3: no projection biases by default (``attention_bias: true`` gives all four attention projections
  one), and an RMS norm with a learned scale over each query and key head (``head_size``), applied after
  the projection and before the rotary encoding. Qwen3 checkpoints often set ``head_dim`` apart from
  ``hidden_dim / num_heads`` (``model.head_dim``).

Every other field, and its default, is Llama's, except the norms' epsilon (1e-6) and the rotary base (1e6),
which are Qwen's. Hugging Face's sliding-window attention
(``use_sliding_window``) is not implemented; importing a checkpoint that enables it is refused
(:mod:`levanter.compat.hf_checkpoints.qwen`). Trade-off of building on Llama rather than beside it: a
Qwen model is a ``LlamaLMHeadModel`` whose config is a ``Qwen2Config`` / ``Qwen3Config``, so code that
asks ``isinstance(config, LlamaConfig)`` treats it as a Llama (what it is, for sharding and memory).
"""

from __future__ import annotations

import dataclasses

from .decoder import QkNormAttentionBias
from .llama import LlamaConfig
from .lm_model import LmConfig

__all__ = ["Qwen2Config", "Qwen3Config"]


@LmConfig.register_subclass("qwen2")
@dataclasses.dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """A Qwen2 decoder: Llama with biases on the query, key and value projections."""

    # Epsilon of the RMS norms, in (0, 1] (Hugging Face Qwen's default).
    layer_norm_epsilon: float = 1e-6
    # Base of the rotary frequencies (released Qwen models' value; rope.theta, when given, takes precedence).
    rope_theta: float = 1e6

    @property
    def qkv_bias(self) -> bool:
        return True


@LmConfig.register_subclass("qwen3")
@dataclasses.dataclass(frozen=True)
class Qwen3Config(QkNormAttentionBias, LlamaConfig):
    """A Qwen3 decoder: Llama with an RMS norm over each query and key head."""

    # Epsilon of the RMS norms, in (0, 1] (Hugging Face Qwen's default).
    layer_norm_epsilon: float = 1e-6
    # Base of the rotary frequencies (released Qwen models' value; rope.theta, when given, takes precedence).
    rope_theta: float = 1e6

    # Give the query, key, value and output projections biases (Hugging Face's attention_bias).
    attention_bias: bool = False

"""Language models: the :class:`LmConfig` registry, the :class:`LmHeadModel` interface, GPT-2, Llama, Qwen2,
Qwen3, Mixtral (a Llama with a mixture-of-experts MLP), Gemma and Gemma 2.

Importing this package registers every architecture with :class:`LmConfig`, so a YAML ``model:``
block with ``type: gpt2``, ``llama``, ``qwen2``, ``qwen3``, ``mixtral``, ``gemma`` or ``gemma2`` decodes to the
right config class.
"""

from .attention import (
    ATTN_BACKENDS,
    AttentionMask,
    attention_mask,
    causal_attention,
    causal_segment_mask,
    dot_product_attention,
    resolve_attn_backend,
)
from .gemma import Gemma2Config, GemmaConfig, GemmaLMHeadModel
from .gpt2 import Gpt2Config, Gpt2LMHeadModel
from .layers import (
    ACTIVATIONS,
    REMAT_POLICIES,
    check_activation,
    check_positive,
    normal_embedding,
    normal_linear,
    remat_policy,
)
from .llama import LlamaConfig, LlamaLMHeadModel, RopeConfig
from .mixtral import MixtralConfig, MixtralLMHeadModel
from .lm_model import (
    LmConfig,
    LmHeadModel,
    blockwise_next_token_loss,
    check_input_length,
    next_token_loss,
    parameter_shapes,
    split_key,
    tree_nbytes,
)
from .qwen import Qwen2Config, Qwen3Config

__all__ = [
    "ACTIVATIONS",
    "ATTN_BACKENDS",
    "AttentionMask",
    "REMAT_POLICIES",
    "attention_mask",
    "dot_product_attention",
    "remat_policy",
    "resolve_attn_backend",
    "Gemma2Config",
    "GemmaConfig",
    "GemmaLMHeadModel",
    "Gpt2Config",
    "Gpt2LMHeadModel",
    "LlamaConfig",
    "LlamaLMHeadModel",
    "LmConfig",
    "LmHeadModel",
    "MixtralConfig",
    "MixtralLMHeadModel",
    "Qwen2Config",
    "Qwen3Config",
    "RopeConfig",
    "blockwise_next_token_loss",
    "causal_attention",
    "causal_segment_mask",
    "check_activation",
    "check_input_length",
    "check_positive",
    "next_token_loss",
    "normal_embedding",
    "normal_linear",
    "parameter_shapes",
    "split_key",
    "tree_nbytes",
]

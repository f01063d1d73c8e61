"""Language models: the :class:`LmConfig` registry, the :class:`LmHeadModel` interface, GPT-2 and Llama.

Importing this package registers every architecture with :class:`LmConfig`, so a YAML ``model:``
block with ``type: gpt2`` or ``type: llama`` decodes to the right config class.
"""

from .attention import causal_attention, causal_segment_mask
from .gpt2 import Gpt2Config, Gpt2LMHeadModel
from .llama import LlamaConfig, LlamaLMHeadModel, RopeConfig
from .lm_model import LmConfig, LmHeadModel, next_token_loss, parameter_shapes, tree_nbytes

__all__ = [
    "Gpt2Config",
    "Gpt2LMHeadModel",
    "LlamaConfig",
    "LlamaLMHeadModel",
    "LmConfig",
    "LmHeadModel",
    "RopeConfig",
    "causal_attention",
    "causal_segment_mask",
    "next_token_loss",
    "parameter_shapes",
    "tree_nbytes",
]

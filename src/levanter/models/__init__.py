"""Language models: the :class:`LmConfig` registry, the :class:`LmHeadModel` interface, GPT-2, Llama, Qwen2,
Qwen3, Mixtral (a Llama with a mixture-of-experts MLP), Gemma and Gemma 2.

Importing this package registers every architecture with :class:`LmConfig`, so a YAML ``model:``
block with ``type: gpt2``, ``llama``, ``qwen2``, ``qwen3``, ``mixtral``, ``gemma`` or ``gemma2`` decodes to the
right config class.
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    (
        "attention",
        "flash_attention",
        "layers",
        "loss",
        "token_dot",
        "rope",
        "lm_model",
        "gpt2",
        "llama",
        "qwen",
        "mixtral",
        "gemma",
        "reinit",
    ),
)

"""Language models: the :class:`LmConfig` registry, the :class:`LmHeadModel` interface, GPT-2, Llama, Qwen2,
Qwen3, Mistral (a Llama with sliding-window attention), Mixtral (a Llama with a mixture-of-experts MLP), Gemma,
Gemma 2 and OLMo 2.

Importing this package registers every architecture with :class:`LmConfig`, so a YAML ``model:``
block with ``type: gpt2``, ``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``mixtral``, ``gemma``, ``gemma2`` or
``olmo2`` decodes to the right config class.
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    (
        "attention",
        "layers",
        "loss",
        "token_dot",
        "rope",
        "lm_model",
        "gpt2",
        "decoder",
        "llama",
        "qwen",
        "mistral",
        "mixtral",
        "gemma",
        "olmo",
        "reinit",
    ),
)

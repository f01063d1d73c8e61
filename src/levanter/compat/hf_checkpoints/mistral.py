"""Mistral in the Hugging Face layout (``model_type: mistral``, ``MistralForCausalLM``).

The tensors are Llama's (:func:`.llama.llama_layout`) and so are the ``config.json`` fields
(:func:`.llama.llama_fields_from_hf`), plus ``sliding_window`` (a positive number of positions, or null for
none), which maps to our field of the same name. Hugging Face Mistral has no biases and always has norm
weights, so our ``use_bias: true`` and ``use_layer_norm_weight: false`` are refused on export. A ``layer_types``
list naming more than one kind of attention (Ministral's alternating layers) is refused by field:
``MistralForCausalLM`` ignores it and windows every layer, which is unlikely to be what such a checkpoint meant.
"""

from __future__ import annotations

from levanter.models import LmConfig, MistralConfig

from .families import HfFamily, hf_int, register_family
from .llama import LLAMA_SHAPE_FIELDS, llama_fields_from_hf, llama_fields_to_hf, llama_layout, refuse_unexportable

__all__ = ["MISTRAL_LAYOUT", "hf_sliding_window", "mistral_from_hf", "mistral_to_hf"]


def hf_sliding_window(doc: dict, where: str):
    """``config.json``'s ``sliding_window`` (Mistral's and Mixtral's): a positive number of positions, or None."""
    window = doc.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"{where}: field 'sliding_window' must be a positive integer or null, got {window!r}")
    return window


def mistral_from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    layer_types = doc.get("layer_types")
    if layer_types is not None and len(set(layer_types)) > 1:
        raise ValueError(
            f"{where}: field 'layer_types' names {sorted(set(layer_types))}: alternating attention kinds are not "
            "implemented for Mistral (every layer uses sliding_window)"
        )
    cfg = MistralConfig(**llama_fields_from_hf(doc, where), sliding_window=hf_sliding_window(doc, where))
    return cfg, hf_int(doc, where, "vocab_size")


def mistral_to_hf(config: LmConfig, vocab_size: int) -> dict:
    assert isinstance(config, MistralConfig)
    refuse_unexportable(config, "Mistral")
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        **llama_fields_to_hf(config, vocab_size),
        "sliding_window": config.sliding_window,
        "attention_dropout": 0.0,
    }


# Llama's tensors, names and axes unchanged: the window is a setting, not a weight.
MISTRAL_LAYOUT = llama_layout()

register_family(HfFamily(
    name="mistral",
    config_class=MistralConfig,
    model_types=("mistral",),
    from_hf=mistral_from_hf,
    to_hf=mistral_to_hf,
    layout=lambda config: MISTRAL_LAYOUT,
    shape_fields=(*LLAMA_SHAPE_FIELDS, "sliding_window"),
))

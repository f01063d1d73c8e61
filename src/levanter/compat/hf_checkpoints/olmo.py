"""OLMo 2 in the Hugging Face layout (``model_type: olmo2``, ``Olmo2ForCausalLM``).

The ``config.json`` has Llama's fields (:func:`.llama.llama_fields_from_hf`) plus ``attention_bias``, with
transformers' OLMo 2 default for an absent ``rms_norm_eps`` (1e-5). The tensors are Llama's names and axes
except the block's norms: no ``input_layernorm``; ``post_attention_layernorm`` and
``post_feedforward_layernorm`` on the branches' outputs; ``self_attn.q_norm`` / ``k_norm``, one vector over the
whole query (``num_heads * head_dim``) or key (``num_key_value_heads * head_dim``) projection, which our
``[heads, head_size]`` / ``[kv_heads, head_size]`` scales flatten to. With ``attention_bias`` the four attention
projections carry biases (the entries Qwen3's layout has). Our ``use_bias: true`` (MLP and norm biases) and
``use_layer_norm_weight: false`` have no Hugging Face equivalent and are refused on export.
"""

from __future__ import annotations

from levanter.models import LmConfig, Olmo2Config

from .families import L, HfFamily, Layout, hf_int, register_family
from .llama import LLAMA_SHAPE_FIELDS, llama_fields_from_hf, llama_fields_to_hf, refuse_unexportable
from .qwen import QWEN3_LAYOUT

__all__ = ["HF_DEFAULT_RMS_NORM_EPS", "OLMO2_LAYOUT", "olmo2_from_hf", "olmo2_to_hf"]

# transformers' Olmo2Config default for a config.json without rms_norm_eps.
HF_DEFAULT_RMS_NORM_EPS = 1e-5

_LAYER = f"model.layers.{L}"
_PER_HEAD = ("layers.stacked.input_layernorm.weight", "layers.stacked.self_attn.q_norm.weight",
             "layers.stacked.self_attn.k_norm.weight")

OLMO2_LAYOUT: Layout = {
    **{k: v for k, v in QWEN3_LAYOUT.items() if k not in _PER_HEAD},
    "layers.stacked.self_attn.q_norm.weight": (f"{_LAYER}.self_attn.q_norm.weight", (("heads", "head_size"),)),
    "layers.stacked.self_attn.k_norm.weight": (f"{_LAYER}.self_attn.k_norm.weight", (("kv_heads", "head_size"),)),
    "layers.stacked.post_feedforward_layernorm.weight": (f"{_LAYER}.post_feedforward_layernorm.weight", (("embed",),)),
}


def olmo2_from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    if doc.get("rms_norm_eps") is None:
        doc = {**doc, "rms_norm_eps": HF_DEFAULT_RMS_NORM_EPS}
    cfg = Olmo2Config(**llama_fields_from_hf(doc, where), attention_bias=bool(doc.get("attention_bias", False)))
    return cfg, hf_int(doc, where, "vocab_size")


def olmo2_to_hf(config: LmConfig, vocab_size: int) -> dict:
    assert isinstance(config, Olmo2Config)
    refuse_unexportable(config, "OLMo 2", " (attention_bias gives the attention projections biases)")
    return {
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        **llama_fields_to_hf(config, vocab_size),
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
    }


register_family(HfFamily(
    name="olmo2",
    config_class=Olmo2Config,
    model_types=("olmo2",),
    from_hf=olmo2_from_hf,
    to_hf=olmo2_to_hf,
    layout=lambda config: OLMO2_LAYOUT,
    shape_fields=(*LLAMA_SHAPE_FIELDS, "attention_bias"),
))

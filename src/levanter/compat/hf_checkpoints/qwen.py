"""Qwen2 and Qwen3 in the Hugging Face layout (``model_type: qwen2`` / ``qwen3``, ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM``).

Both are Llama's layout (:func:`.llama.llama_layout`) plus their own tensors: Qwen2's biases of the query,
key and value projections; Qwen3's ``q_norm`` / ``k_norm`` scales (one ``head_dim`` vector each per layer)
and, with ``attention_bias``, biases of all four attention projections. Sliding-window attention
(``use_sliding_window``, or a ``layer_types`` entry other than ``full_attention``) is not implemented and is
refused by field; so are options the Hugging Face classes lack (MLP biases, norms without a scale).
"""

from __future__ import annotations

from levanter.models import LmConfig, Qwen2Config, Qwen3Config

from .families import L, HfFamily, Layout, hf_int, register_family
from .llama import LLAMA_SHAPE_FIELDS, llama_fields_from_hf, llama_fields_to_hf, llama_layout, refuse_unexportable

__all__ = ["QWEN2_LAYOUT", "QWEN3_LAYOUT", "qwen2_from_hf", "qwen3_from_hf", "qwen2_to_hf", "qwen3_to_hf"]

_ATTN = f"model.layers.{L}.self_attn"

QWEN2_LAYOUT: Layout = {
    **llama_layout(),
    "layers.stacked.self_attn.q_proj.bias": (f"{_ATTN}.q_proj.bias", (("heads", "head_size"),)),
    "layers.stacked.self_attn.k_proj.bias": (f"{_ATTN}.k_proj.bias", (("kv_heads", "head_size"),)),
    "layers.stacked.self_attn.v_proj.bias": (f"{_ATTN}.v_proj.bias", (("kv_heads", "head_size"),)),
}

# The biases are present only with attention_bias; a layout may name parameters a model lacks.
QWEN3_LAYOUT: Layout = {
    **QWEN2_LAYOUT,
    "layers.stacked.self_attn.o_proj.bias": (f"{_ATTN}.o_proj.bias", (("embed",),)),
    "layers.stacked.self_attn.q_norm.weight": (f"{_ATTN}.q_norm.weight", (("head_size",),)),
    "layers.stacked.self_attn.k_norm.weight": (f"{_ATTN}.k_norm.weight", (("head_size",),)),
}


def _check_attention(doc: dict, where: str) -> None:
    if doc.get("use_sliding_window"):
        raise ValueError(f"{where}: field 'use_sliding_window' true is not supported (no sliding-window attention)")
    layer_types = doc.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{where}: field 'layer_types' names {sorted(set(layer_types) - {'full_attention'})}: only "
            "full_attention layers are supported (no sliding-window attention)"
        )


def qwen2_from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    _check_attention(doc, where)
    return Qwen2Config(**llama_fields_from_hf(doc, where)), hf_int(doc, where, "vocab_size")


def qwen3_from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    _check_attention(doc, where)
    cfg = Qwen3Config(**llama_fields_from_hf(doc, where), attention_bias=bool(doc.get("attention_bias", False)))
    return cfg, hf_int(doc, where, "vocab_size")


def _common_to_hf(config: LmConfig, vocab_size: int) -> dict:
    assert isinstance(config, (Qwen2Config, Qwen3Config))
    return {**llama_fields_to_hf(config, vocab_size), "use_sliding_window": False, "max_window_layers": config.num_layers,
            "layer_types": ["full_attention"] * config.num_layers}


def qwen2_to_hf(config: LmConfig, vocab_size: int) -> dict:
    assert isinstance(config, Qwen2Config)
    refuse_unexportable(config, "Qwen2")
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_common_to_hf(config, vocab_size)}


def qwen3_to_hf(config: LmConfig, vocab_size: int) -> dict:
    assert isinstance(config, Qwen3Config)
    refuse_unexportable(config, "Qwen3", " (attention_bias gives the attention projections biases)")
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_common_to_hf(config, vocab_size),
            "attention_bias": config.attention_bias}


register_family(HfFamily(
    name="qwen2",
    config_class=Qwen2Config,
    model_types=("qwen2",),
    from_hf=qwen2_from_hf,
    to_hf=qwen2_to_hf,
    layout=lambda config: QWEN2_LAYOUT,
    shape_fields=LLAMA_SHAPE_FIELDS,
))

register_family(HfFamily(
    name="qwen3",
    config_class=Qwen3Config,
    model_types=("qwen3",),
    from_hf=qwen3_from_hf,
    to_hf=qwen3_to_hf,
    layout=lambda config: QWEN3_LAYOUT,
    shape_fields=(*LLAMA_SHAPE_FIELDS, "attention_bias"),
))

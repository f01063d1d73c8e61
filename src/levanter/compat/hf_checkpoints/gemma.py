"""Gemma and Gemma 2 in the Hugging Face layout (``model_type: gemma`` / ``gemma2``, ``GemmaForCausalLM`` /
``Gemma2ForCausalLM``).

The tensors have Llama's names and axes (:func:`.llama.llama_layout`) and the ``config.json`` has Llama's
fields (:func:`.llama.llama_fields_from_hf`), with Gemma's defaults where a field is absent. The norm weights
are stored, here and there, as the offset from 1 (the norm scales by ``1 + weight``), so they map unchanged.
What differs from Llama's ``config.json``:

* ``head_dim`` is a size of its own (transformers' default when absent is 256, not
  ``hidden_size / num_attention_heads``), read into ``model.head_dim``;
* the activation: ``hidden_activation`` (older transformers read it first) or ``hidden_act``; the value
  ``gelu`` of the original releases means the tanh approximation (transformers rewrites it to
  ``gelu_pytorch_tanh``), so it is read as that. For the same reason an exact-GELU model
  (``activation_function: gelu``) cannot be exported: transformers would run it with the approximation.
* ``attention_bias`` and ``use_bidirectional_attention`` true are refused (not implemented here), as are
  our ``use_bias: true`` and ``norm_embeddings: false`` on export (Hugging Face Gemma has no such options).

Gemma 2 adds two norms per layer (``pre_feedforward_layernorm``, ``post_feedforward_layernorm``) and the
fields ``query_pre_attn_scalar``, ``attn_logit_softcapping``, ``final_logit_softcapping`` and
``sliding_window``, which map to our fields of the same names. ``layer_types`` must be transformers' default
pattern (sliding window on layers 0, 2, 4, ...), the only one implemented; another is refused by name.
"""

from __future__ import annotations

import dataclasses

from levanter.models import Gemma2Config, GemmaConfig, LmConfig

from .families import L, HfFamily, hf_field, hf_int, refuse_true, register_family
from .llama import LLAMA_SHAPE_FIELDS, llama_fields_from_hf, llama_fields_to_hf, llama_layout

__all__ = [
    "HF_DEFAULT_HEAD_DIM",
    "HF_DEFAULT_ACTIVATION",
    "LAYOUT",
    "from_hf",
    "to_hf",
    "gemma2_from_hf",
    "gemma2_to_hf",
    "GEMMA2_LAYOUT",
]

# transformers' GemmaConfig defaults for fields a config.json may leave out.
HF_DEFAULT_HEAD_DIM = 256
HF_DEFAULT_ACTIVATION = "gelu_pytorch_tanh"

LAYOUT = llama_layout()


def _activation(doc: dict, where: str) -> str:
    name = hf_field(doc, where, "hidden_activation", "hidden_act", default=HF_DEFAULT_ACTIVATION)
    if not isinstance(name, str):
        raise ValueError(f"{where}: field 'hidden_act' must be an activation name, got {name!r}")
    return HF_DEFAULT_ACTIVATION if name == "gelu" else name


def from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    refuse_true(doc, where, ("attention_bias",), "Gemma here has no biases")
    refuse_true(doc, where, ("use_bidirectional_attention",), "attention here is causal")
    fields = llama_fields_from_hf(doc, where)
    fields.update(
        seq_len=min(hf_int(doc, where, "max_position_embeddings", default=8192), GemmaConfig.seq_len),
        # Always explicit: Gemma's head size is its own (the default is 256 whatever hidden_size says).
        head_dim=hf_int(doc, where, "head_dim", default=HF_DEFAULT_HEAD_DIM),
        activation_function=_activation(doc, where),
        tie_word_embeddings=bool(doc.get("tie_word_embeddings", True)),
    )
    return GemmaConfig(**fields), hf_int(doc, where, "vocab_size")


def to_hf(config: LmConfig, vocab_size: int) -> dict:
    assert isinstance(config, GemmaConfig)
    if config.use_bias:
        raise ValueError("model.use_bias true cannot be exported: Hugging Face Gemma has no biases")
    if not config.norm_embeddings:
        raise ValueError(
            "model.norm_embeddings false cannot be exported: Hugging Face Gemma always scales the embeddings "
            "by sqrt(hidden_size)"
        )
    if config.activation_function == "gelu":
        raise ValueError(
            "model.activation_function 'gelu' (exact) cannot be exported as Gemma: transformers reads a Gemma "
            "config's 'gelu' as the tanh approximation; train with gelu_new (Gemma's own) to export"
        )
    fields = llama_fields_to_hf(config, vocab_size)
    return {
        "architectures": ["GemmaForCausalLM"],
        "model_type": "gemma",
        **fields,
        # Both spellings: older transformers read hidden_activation and ignore hidden_act.
        "hidden_activation": fields["hidden_act"],
        "attention_bias": False,
    }


def _default_layer_types(n: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def _optional_positive(doc: dict, where: str, name: str, default):
    value = doc.get(name, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f"{where}: field {name!r} must be a positive number or null, got {value!r}")
    return value


def gemma2_from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    base, vocab = from_hf(doc, where)
    layers = base.num_layers
    layer_types = doc.get("layer_types")
    if layer_types is not None and list(layer_types) != _default_layer_types(layers):
        raise ValueError(
            f"{where}: field 'layer_types' {layer_types!r} is not supported: only the alternating pattern "
            "(sliding_attention on layers 0, 2, 4, ...) is implemented"
        )
    cfg = Gemma2Config(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(GemmaConfig) if f.init},
        query_pre_attn_scalar=hf_int(doc, where, "query_pre_attn_scalar", default=256),
        attn_logit_softcapping=_optional_positive(doc, where, "attn_logit_softcapping", 50.0),
        final_logit_softcapping=_optional_positive(doc, where, "final_logit_softcapping", 30.0),
        sliding_window=_optional_positive(doc, where, "sliding_window", 4096),
    )
    return cfg, vocab


def gemma2_to_hf(config: LmConfig, vocab_size: int) -> dict:
    assert isinstance(config, Gemma2Config)
    doc = to_hf(config, vocab_size)
    doc.update(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        query_pre_attn_scalar=config.query_pre_attn_scalar,
        attn_logit_softcapping=config.attn_logit_softcapping,
        final_logit_softcapping=config.final_logit_softcapping,
        sliding_window=config.sliding_window,
        layer_types=_default_layer_types(config.num_layers),
    )
    return doc


GEMMA2_LAYOUT = {
    **LAYOUT,
    "layers.stacked.pre_feedforward_layernorm.weight": (
        f"model.layers.{L}.pre_feedforward_layernorm.weight", (("embed",),)),
    "layers.stacked.post_feedforward_layernorm.weight": (
        f"model.layers.{L}.post_feedforward_layernorm.weight", (("embed",),)),
}

register_family(HfFamily(
    name="gemma",
    config_class=GemmaConfig,
    model_types=("gemma",),
    from_hf=from_hf,
    to_hf=to_hf,
    layout=lambda config: LAYOUT,
    shape_fields=(*LLAMA_SHAPE_FIELDS, "norm_embeddings"),
))

register_family(HfFamily(
    name="gemma2",
    config_class=Gemma2Config,
    model_types=("gemma2",),
    from_hf=gemma2_from_hf,
    to_hf=gemma2_to_hf,
    layout=lambda config: GEMMA2_LAYOUT,
    shape_fields=(*LLAMA_SHAPE_FIELDS, "norm_embeddings", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "sliding_window"),
))

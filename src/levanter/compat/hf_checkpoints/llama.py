"""Llama in the Hugging Face layout (``model_type: llama``, ``LlamaForCausalLM``).

Hugging Face Llama has no biases (``attention_bias`` / ``mlp_bias`` true are refused), always has norm
weights, and describes rotary scaling in ``rope_scaling`` / ``rope_parameters``
(:func:`levanter.models.rope.rope_from_hf`). The tensor layout is shared with families built on Llama
(:func:`llama_layout`), which add their own tensors to it.
"""

from __future__ import annotations

from levanter.models import LlamaConfig, LmConfig
from levanter.models.rope import rope_from_hf, rope_to_hf

from .families import L, HfFamily, Layout, hf_int, refuse_true, register_family

__all__ = [
    "llama_layout",
    "LAYOUT",
    "llama_fields_from_hf",
    "llama_fields_to_hf",
    "refuse_unexportable",
    "from_hf",
    "to_hf",
    "LLAMA_SHAPE_FIELDS",
]


def llama_layout(prefix: str = "model.") -> Layout:
    """The tensors of a Llama decoder (embedding, blocks, final norm, untied head)."""
    p = f"{prefix}layers.{L}"
    return {
        "embed_tokens.weight": (f"{prefix}embed_tokens.weight", (("vocab",), ("embed",))),
        "layers.stacked.input_layernorm.weight": (f"{p}.input_layernorm.weight", (("embed",),)),
        "layers.stacked.self_attn.q_proj.weight": (f"{p}.self_attn.q_proj.weight", (("heads", "head_size"), ("embed",))),
        "layers.stacked.self_attn.k_proj.weight": (f"{p}.self_attn.k_proj.weight", (("kv_heads", "head_size"), ("embed",))),
        "layers.stacked.self_attn.v_proj.weight": (f"{p}.self_attn.v_proj.weight", (("kv_heads", "head_size"), ("embed",))),
        "layers.stacked.self_attn.o_proj.weight": (f"{p}.self_attn.o_proj.weight", (("embed",), ("heads", "head_size"))),
        "layers.stacked.post_attention_layernorm.weight": (f"{p}.post_attention_layernorm.weight", (("embed",),)),
        "layers.stacked.mlp.gate_proj.weight": (f"{p}.mlp.gate_proj.weight", (("mlp",), ("embed",))),
        "layers.stacked.mlp.up_proj.weight": (f"{p}.mlp.up_proj.weight", (("mlp",), ("embed",))),
        "layers.stacked.mlp.down_proj.weight": (f"{p}.mlp.down_proj.weight", (("embed",), ("mlp",))),
        "norm.weight": (f"{prefix}norm.weight", (("embed",),)),
        "lm_head.weight": ("lm_head.weight", (("vocab",), ("embed",))),
    }


LAYOUT: Layout = llama_layout()


def llama_fields_from_hf(doc: dict, where: str) -> dict:
    """The :class:`LlamaConfig` fields a Llama-like ``config.json`` gives (after the common checks)."""
    d = hf_int(doc, where, "hidden_size")
    heads = hf_int(doc, where, "num_attention_heads")
    head_dim = hf_int(doc, where, "head_dim") if doc.get("head_dim") is not None else None
    if head_dim is not None and head_dim * heads == d:
        head_dim = None  # the implied size: kept implicit, so our config says what a YAML would
    if doc.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"{where}: field 'pretraining_tp' other than 1 is not supported")
    theta, rope = rope_from_hf(doc, where)
    max_pos = hf_int(doc, where, "max_position_embeddings", default=2048)
    return dict(
        seq_len=min(max_pos, 2048),
        hidden_dim=d,
        intermediate_dim=hf_int(doc, where, "intermediate_size"),
        num_layers=hf_int(doc, where, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf_int(doc, where, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        activation_function=str(doc.get("hidden_act", "silu")),
        initializer_range=float(doc.get("initializer_range", 0.02)),
        layer_norm_epsilon=float(doc.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(doc.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope=rope,
    )


def llama_fields_to_hf(config: LlamaConfig, vocab_size: int) -> dict:
    """The ``config.json`` fields a Llama-like model shares (the caller adds model_type and its own)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": config.hidden_dim,
        "intermediate_size": config.intermediate_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.HeadSize.size,
        "hidden_act": config.activation_function,
        "max_position_embeddings": config.seq_len,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_word_embeddings,
        **rope_to_hf(config.rope_config),
        "use_cache": True,
    }


def from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    refuse_true(doc, where, ("attention_bias", "mlp_bias"), "Llama here has no biases")
    return LlamaConfig(**llama_fields_from_hf(doc, where)), hf_int(doc, where, "vocab_size")


def refuse_unexportable(config: LlamaConfig, name: str, note: str = "") -> None:
    """Refuse our ``use_bias: true`` and ``use_layer_norm_weight: false``, which the Hugging Face class ``name``
    (Llama, Mistral, ...: no MLP or norm biases, always norm weights) cannot express; ``note`` ends the message."""
    if config.use_bias or not config.use_layer_norm_weight:
        raise ValueError(
            f"model.use_bias true or model.use_layer_norm_weight false cannot be exported: Hugging Face {name} "
            f"has no MLP or norm biases and always has norm weights{note}"
        )


def to_hf(config: LmConfig, vocab_size: int) -> dict:
    assert isinstance(config, LlamaConfig)
    refuse_unexportable(config, "Llama")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **llama_fields_to_hf(config, vocab_size),
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


# The LlamaConfig fields that describe the weights; families built on Llama extend this tuple.
LLAMA_SHAPE_FIELDS = ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "activation_function", "layer_norm_epsilon", "tie_word_embeddings", "use_bias",
                      "use_layer_norm_weight", "rope_theta", "rope")

register_family(HfFamily(
    name="llama",
    config_class=LlamaConfig,
    model_types=("llama",),
    from_hf=from_hf,
    to_hf=to_hf,
    layout=lambda config: LAYOUT,
    shape_fields=LLAMA_SHAPE_FIELDS,
))

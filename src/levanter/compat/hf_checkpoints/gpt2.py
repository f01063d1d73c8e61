"""GPT-2 in the Hugging Face layout (``model_type: gpt2``, ``GPT2LMHeadModel``).

Hugging Face GPT-2 always has biases and tied embeddings, and a fused ``c_attn`` (query, key and value in
one ``Conv1D``, stored ``[in, out]`` unlike a ``Linear``). Checkpoints name tensors
``transformer.wte.weight`` (``GPT2LMHeadModel``) or ``wte.weight`` (the original release); both are read,
the former is written. ``n_positions`` (the learned position table) is kept, so a run may use a shorter
``seq_len`` but never a longer one.
"""

from __future__ import annotations

from levanter.models import Gpt2Config, LmConfig

from .families import L, HfFamily, Layout, hf_int, register_family

__all__ = ["LAYOUT", "from_hf", "to_hf"]

LAYOUT: Layout = {
    "wte.weight": ("wte.weight", (("vocab",), ("embed",))),
    "wpe.weight": ("wpe.weight", (("position",), ("embed",))),
    "blocks.stacked.ln_1.weight": (f"h.{L}.ln_1.weight", (("embed",),)),
    "blocks.stacked.ln_1.bias": (f"h.{L}.ln_1.bias", (("embed",),)),
    "blocks.stacked.attn.c_attn.weight": (f"h.{L}.attn.c_attn.weight", (("embed",), ("qkv", "heads", "head_size"))),
    "blocks.stacked.attn.c_attn.bias": (f"h.{L}.attn.c_attn.bias", (("qkv", "heads", "head_size"),)),
    "blocks.stacked.attn.c_proj.weight": (f"h.{L}.attn.c_proj.weight", (("heads", "head_size"), ("embed",))),
    "blocks.stacked.attn.c_proj.bias": (f"h.{L}.attn.c_proj.bias", (("embed",),)),
    "blocks.stacked.ln_2.weight": (f"h.{L}.ln_2.weight", (("embed",),)),
    "blocks.stacked.ln_2.bias": (f"h.{L}.ln_2.bias", (("embed",),)),
    "blocks.stacked.mlp.c_fc.weight": (f"h.{L}.mlp.c_fc.weight", (("embed",), ("mlp",))),
    "blocks.stacked.mlp.c_fc.bias": (f"h.{L}.mlp.c_fc.bias", (("mlp",),)),
    "blocks.stacked.mlp.c_proj.weight": (f"h.{L}.mlp.c_proj.weight", (("mlp",), ("embed",))),
    "blocks.stacked.mlp.c_proj.bias": (f"h.{L}.mlp.c_proj.bias", (("embed",),)),
    "ln_f.weight": ("ln_f.weight", (("embed",),)),
    "ln_f.bias": ("ln_f.bias", (("embed",),)),
}


def from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    d = hf_int(doc, where, "n_embd", "hidden_size")
    n_inner = doc.get("n_inner")
    if n_inner is not None and (not isinstance(n_inner, int) or n_inner % d != 0):
        raise ValueError(f"{where}: field 'n_inner' ({n_inner!r}) must be a multiple of n_embd ({d}) (model.mlp_scale)")
    if doc.get("scale_attn_weights", True) is not True:
        raise ValueError(f"{where}: field 'scale_attn_weights' false is not supported (attention is always scaled)")
    if doc.get("add_cross_attention"):
        raise ValueError(f"{where}: field 'add_cross_attention' is not supported (GPT-2 here is decoder-only)")
    if doc.get("tie_word_embeddings", True) is not True:
        raise ValueError(f"{where}: field 'tie_word_embeddings' false is not supported for GPT-2 (always tied here)")
    n_positions = hf_int(doc, where, "n_positions", "max_position_embeddings", default=1024)
    cfg = Gpt2Config(
        seq_len=min(n_positions, 1024),
        hidden_dim=d,
        num_layers=hf_int(doc, where, "n_layer", "num_hidden_layers"),
        num_heads=hf_int(doc, where, "n_head", "num_attention_heads"),
        mlp_scale=4 if n_inner is None else n_inner // d,
        initializer_range=float(doc.get("initializer_range", 0.02)),
        embed_pdrop=float(doc.get("embd_pdrop", 0.0)),
        resid_pdrop=float(doc.get("resid_pdrop", 0.0)),
        attn_pdrop=float(doc.get("attn_pdrop", 0.0)),
        layer_norm_epsilon=float(doc.get("layer_norm_epsilon", 1e-5)),
        activation_function=str(doc.get("activation_function", "gelu_new")),
        scale_attn_by_inverse_layer_idx=bool(doc.get("scale_attn_by_inverse_layer_idx", False)),
        n_positions=n_positions,
    )
    return cfg, hf_int(doc, where, "vocab_size")


def to_hf(config: LmConfig, vocab_size: int) -> dict:
    assert isinstance(config, Gpt2Config)
    if not config.use_bias:
        raise ValueError("model.use_bias false cannot be exported: Hugging Face GPT-2 always has biases")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": config.max_seq_len,
        "n_embd": config.hidden_dim,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.hidden_dim * config.mlp_scale,
        "activation_function": config.activation_function,
        "resid_pdrop": config.resid_pdrop,
        "embd_pdrop": config.embed_pdrop,
        "attn_pdrop": config.attn_pdrop,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
    }


def _import_prefix(names: set) -> str:
    return "" if "wte.weight" in names and "transformer.wte.weight" not in names else "transformer."


def _check_merge(run: LmConfig, hf: LmConfig, what: str) -> None:
    assert isinstance(hf, Gpt2Config)
    if run.seq_len > hf.max_seq_len:
        raise ValueError(
            f"model.seq_len={run.seq_len} exceeds the {hf.max_seq_len} learned positions of {what} "
            "(n_positions in its config.json)"
        )


register_family(HfFamily(
    name="gpt2",
    config_class=Gpt2Config,
    model_types=("gpt2",),
    from_hf=from_hf,
    to_hf=to_hf,
    layout=lambda config: LAYOUT,
    shape_fields=("hidden_dim", "num_layers", "num_heads", "mlp_scale", "layer_norm_epsilon",
                  "activation_function", "scale_attn_by_inverse_layer_idx", "use_bias", "n_positions"),
    export_prefix="transformer.",
    import_prefix=_import_prefix,
    head_is_tied=lambda config: True,
    check_merge=_check_merge,
))

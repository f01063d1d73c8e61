"""Mixtral in the Hugging Face layout (``model_type: mixtral``, ``MixtralForCausalLM``).

Llama's layout (:func:`.llama.llama_layout`) with each MLP replaced by the mixture of experts: the router
``block_sparse_moe.gate.weight`` ``[experts, embed]`` and, per expert ``e``,
``block_sparse_moe.experts.{e}.w1/w3.weight`` ``[mlp, embed]`` and ``w2.weight`` ``[embed, mlp]``, stacked
along our ``experts`` axis. That is the layout Mixtral checkpoints are published in and the one
``transformers`` writes (it fuses the experts into ``gate_up_proj`` / ``down_proj`` in memory only).

``sliding_window`` (a positive number of positions, or null) is read as Mistral's is. Refused by field: router
jitter (``router_jitter_noise``), biases. ``router_aux_loss_coef`` is read into the config (training uses it);
``output_router_logits`` (whether ``transformers`` returns the router logits) has no counterpart and is
written false. A ``config.json`` without any rotary setting gets ``transformers``' Mixtral default theta,
1e6, not Llama's 1e4.
"""

from __future__ import annotations

from levanter.models import LmConfig, MixtralConfig

from .families import E, L, HfFamily, Layout, hf_int, refuse_true, register_family
from .llama import LLAMA_SHAPE_FIELDS, llama_fields_from_hf, llama_fields_to_hf, llama_layout
from .mistral import hf_sliding_window

__all__ = ["DEFAULT_ROPE_THETA", "LAYOUT", "from_hf", "to_hf"]

_MOE = f"model.layers.{L}.block_sparse_moe"
DEFAULT_ROPE_THETA = 1e6  # transformers' MixtralConfig.default_theta

LAYOUT: Layout = {
    **{k: v for k, v in llama_layout().items() if ".mlp." not in k},
    "layers.stacked.block_sparse_moe.gate.weight": (f"{_MOE}.gate.weight", (("experts",), ("embed",))),
    "layers.stacked.block_sparse_moe.w1.weight": (f"{_MOE}.experts.{E}.w1.weight", (("mlp",), ("embed",))),
    "layers.stacked.block_sparse_moe.w2.weight": (f"{_MOE}.experts.{E}.w2.weight", (("embed",), ("mlp",))),
    "layers.stacked.block_sparse_moe.w3.weight": (f"{_MOE}.experts.{E}.w3.weight", (("mlp",), ("embed",))),
}


def from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    refuse_true(doc, where, ("attention_bias", "mlp_bias"), "Mixtral here has no biases")
    if doc.get("router_jitter_noise"):
        raise ValueError(f"{where}: field 'router_jitter_noise' other than 0 is not supported (no router jitter)")
    if not any(doc.get(k) is not None for k in ("rope_theta", "rope_parameters", "rope_scaling")):
        doc = {**doc, "rope_theta": DEFAULT_ROPE_THETA}
    fields = llama_fields_from_hf(doc, where)
    coef = doc.get("router_aux_loss_coef")
    cfg = MixtralConfig(
        **fields,
        num_local_experts=hf_int(doc, where, "num_local_experts", "num_experts", default=8),
        num_experts_per_tok=hf_int(doc, where, "num_experts_per_tok", default=2),
        router_aux_loss_coef=float(coef) if coef is not None else 0.001,  # transformers' default
        sliding_window=hf_sliding_window(doc, where),
    )
    return cfg, hf_int(doc, where, "vocab_size")


def to_hf(config: LmConfig, vocab_size: int) -> dict:
    assert isinstance(config, MixtralConfig)
    if config.use_bias or not config.use_layer_norm_weight:
        raise ValueError(
            "model.use_bias true or model.use_layer_norm_weight false cannot be exported: Hugging Face Mixtral "
            "has no biases and always has norm weights"
        )
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **llama_fields_to_hf(config, vocab_size),
        "num_local_experts": config.num_local_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": config.sliding_window,
        "attention_dropout": 0.0,
    }


register_family(HfFamily(
    name="mixtral",
    config_class=MixtralConfig,
    model_types=("mixtral",),
    from_hf=from_hf,
    to_hf=to_hf,
    layout=lambda config: LAYOUT,
    shape_fields=(*LLAMA_SHAPE_FIELDS, "num_local_experts", "num_experts_per_tok"),
))

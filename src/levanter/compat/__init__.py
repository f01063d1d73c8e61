"""Compatibility with other ecosystems' checkpoint formats: Hugging Face ``transformers`` directories
(:mod:`levanter.compat.hf_checkpoints`)."""

from levanter.compat.hf_checkpoints import (
    HF_SAVE_DTYPES,
    HfExporter,
    load_hf_checkpoint,
    load_hf_config,
    load_hf_weights,
    merge_hf_model_config,
    resolve_hf_checkpoint,
    save_hf_checkpoint,
    weights_like,
)

__all__ = [
    "HF_SAVE_DTYPES",
    "HfExporter",
    "load_hf_checkpoint",
    "load_hf_config",
    "load_hf_weights",
    "merge_hf_model_config",
    "resolve_hf_checkpoint",
    "save_hf_checkpoint",
    "weights_like",
]

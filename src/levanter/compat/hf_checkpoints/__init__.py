"""Hugging Face checkpoints in and out: our models in the ``transformers`` layout.

* :func:`load_hf_config` maps a ``config.json`` onto our model config. Options we do not implement
  (another architecture, a rope type other than default/linear/llama3/yarn (:mod:`levanter.models.rope`),
  biases where the family has none...) are refused, naming the ``config.json`` field, rather than loaded
  into a model that would compute something else.
* :func:`load_hf_checkpoint` reads the weights (``model.safetensors``, or the shards that
  ``model.safetensors.index.json`` names) into our model, in float32.
* :func:`save_hf_checkpoint` writes a directory that ``transformers.AutoModelForCausalLM.from_pretrained``
  loads, all or nothing.
* :func:`merge_hf_model_config` and :class:`HfExporter` are what ``train_lm`` uses for
  ``initialize_from_hf`` and ``hf_save_path``.

This package is split by concept; this module is only the facade that keeps every public name importable
from ``levanter.compat.hf_checkpoints``:

* :mod:`.hub` -- where a checkpoint is (local directory, object-store URL, hub id; fast failure offline);
* :mod:`.safetensors_io` -- the safetensors format and a checkpoint's whole state dict;
* :mod:`.families` -- the registry of model families (config mapping both ways, weight layouts), with
  one module per family (:mod:`.gpt2`, :mod:`.llama`, :mod:`.qwen`, :mod:`.gemma`); its docstring says how to
  add one;
* :mod:`.weights` -- our parameters <-> Hugging Face tensors through a family's layout;
* :mod:`.load` -- reading a checkpoint into our model and merging its shape into a run's config;
* :mod:`.export` -- writing a checkpoint directory, and the exporter used during training.
"""

from .export import HfExporter, save_hf_checkpoint
from .families import (
    L,
    SHAPE_FIELDS,
    HfFamily,
    families,
    family_of,
    hf_config_to_lm,
    lm_to_hf_config,
    register_family,
)
from .gpt2 import LAYOUT as GPT2_LAYOUT
from .hub import resolve_hf_checkpoint
from .llama import LAYOUT as LLAMA_LAYOUT
from .load import load_hf_checkpoint, load_hf_config, load_hf_weights, merge_hf_model_config
from .safetensors_io import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_SIZE,
    HF_SAVE_DTYPES,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    TOKENIZER_FILES,
    read_safetensors,
)
from .weights import to_state_dict, weights_like

__all__ = [
    "HF_SAVE_DTYPES",
    "HfExporter",
    "HfFamily",
    "hf_config_to_lm",
    "lm_to_hf_config",
    "load_hf_checkpoint",
    "load_hf_config",
    "load_hf_weights",
    "merge_hf_model_config",
    "register_family",
    "resolve_hf_checkpoint",
    "save_hf_checkpoint",
    "weights_like",
]

# Importable for callers of the single-module layout, not part of levanter.compat's names.
_ALSO_PUBLIC = (CONFIG_FILE, DEFAULT_MAX_SHARD_SIZE, SAFE_INDEX, SAFE_WEIGHTS, TOKENIZER_FILES, L, SHAPE_FIELDS,
                GPT2_LAYOUT, LLAMA_LAYOUT, families, family_of, read_safetensors, to_state_dict)

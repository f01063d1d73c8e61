"""Reading a Hugging Face checkpoint into our model, and merging its shape into a run's model config.

:func:`load_hf_config` maps ``config.json`` to our config (through the family registry,
:mod:`.families`); :func:`load_hf_checkpoint` and :func:`load_hf_weights` read the weights in float32 or in
a template's dtypes and shardings; :func:`merge_hf_model_config` is what ``train_lm``'s
``initialize_from_hf`` uses: the weight-describing fields from ``config.json``, everything else from the
run's YAML, and a disagreement between the two an error rather than a silent override.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from levanter.models import LlamaConfig, LmConfig
from levanter.utils import fs

from .families import family_name, family_of, hf_config_to_lm
from .hub import resolve_hf_checkpoint
from .safetensors_io import CONFIG_FILE, check_weight_files, load_state_dict, read_json
from .weights import weights_like

__all__ = [
    "read_hf_config_dict",
    "load_hf_config",
    "load_hf_weights",
    "load_hf_checkpoint",
    "merge_hf_model_config",
]


def read_hf_config_dict(path_or_id: str) -> tuple[str, dict]:
    """``(checkpoint directory, its config.json as a dict)``."""
    root = resolve_hf_checkpoint(path_or_id)
    return root, read_json(fs.join(root, CONFIG_FILE), "Hugging Face config")


def load_hf_config(path_or_id: str) -> LmConfig:
    """Our model config for the Hugging Face checkpoint ``path_or_id`` (its ``config.json``)."""
    root, doc = read_hf_config_dict(path_or_id)
    return hf_config_to_lm(doc, fs.join(root, CONFIG_FILE))[0]


def load_hf_weights(template, path_or_id: str):
    """``template`` (our model, e.g. a freshly initialised one) with its parameters replaced by those of the
    Hugging Face checkpoint ``path_or_id``, in the template's dtypes and shardings."""
    root = resolve_hf_checkpoint(path_or_id)
    return weights_like(template, load_state_dict(root), where=f"Hugging Face checkpoint {root}")


def load_hf_checkpoint(path_or_id: str, config: LmConfig | None = None, *, vocab_size: int | None = None):
    """``(config, model)``: the Hugging Face checkpoint ``path_or_id`` as our model, float32 parameters.

    ``config`` (default: :func:`load_hf_config`'s) gives the run settings (seq_len, attention backend...); its
    shape must agree with the checkpoint's. ``vocab_size`` (default: ``config.json``'s) must equal it.
    """
    import haliax as hax
    import jax

    root, doc = read_hf_config_dict(path_or_id)
    where = fs.join(root, CONFIG_FILE)
    hf_config, hf_vocab = hf_config_to_lm(doc, where)
    if config is None:
        config = hf_config
    if vocab_size is not None and vocab_size != hf_vocab:
        raise ValueError(f"vocab_size={vocab_size} does not match the checkpoint's vocab_size {hf_vocab} ({where})")
    state = load_state_dict(root)
    template = jax.eval_shape(lambda k: config.build(hax.Axis("vocab", hf_vocab), key=k), jax.random.PRNGKey(0))
    template = jax.tree.map(lambda s: np.zeros(s.shape, np.float32) if hasattr(s, "shape") else s, template)
    model = weights_like(template, state, where=f"Hugging Face checkpoint {root}")
    return config, model


def merge_hf_model_config(run_model: LmConfig, path_or_id: str, *, use_hf_model_config: bool = False,
                          key: str = "initialize_from_hf") -> tuple[LmConfig, int]:
    """``(model config, vocab_size)`` for a run that starts from the Hugging Face checkpoint ``path_or_id``.

    The fields that shape the weights (:data:`~.families.SHAPE_FIELDS`) come from ``config.json``; the rest
    (``seq_len``, ``attn_backend``, ``gradient_checkpointing``, ``scan_layers``, ``cross_entropy_block_size``...)
    stay the run's. With ``use_hf_model_config`` false, a model block of another ``type``, or a shape field the
    run set to a value other than both its default and the checkpoint's, is an error naming the key (a run
    must not silently train a model other than the one its YAML describes); with it true, the checkpoint's
    type and shape win whatever the YAML says.
    """
    root, doc = read_hf_config_dict(path_or_id)
    hf, vocab = hf_config_to_lm(doc, fs.join(root, CONFIG_FILE))
    check_weight_files(root, key=f"{key}={path_or_id!r}")
    family = family_of(hf)
    hf_type, run_type = family.name, family_name(run_model)
    if type(run_model) is not type(hf):
        if not use_hf_model_config:
            raise ValueError(
                f"{key}={path_or_id!r} is a {hf_type} checkpoint but model.type is {run_type}: set model.type to "
                f"{hf_type}, or use_hf_model_config: true to take the whole model from the checkpoint"
            )
        run_model = type(hf)(seq_len=run_model.seq_len)
    defaults = type(hf)(seq_len=run_model.seq_len)
    changes = {}
    for name in family.shape_fields:
        mine, theirs, default = getattr(run_model, name), getattr(hf, name), getattr(defaults, name)
        if (not use_hf_model_config and mine != default and mine != theirs
                and not (name == "rope_theta" and isinstance(run_model, LlamaConfig) and run_model.rope is not None)):
            raise ValueError(
                f"model.{name}={mine!r} disagrees with {key}={path_or_id!r}, whose config.json gives {theirs!r}: "
                f"remove model.{name} from the config (the checkpoint's shape is used), or set "
                "use_hf_model_config: true to let the checkpoint override it"
            )
        changes[name] = theirs
    if family.check_merge is not None:
        family.check_merge(run_model, hf, f"{key}={path_or_id!r}")
    return dataclasses.replace(run_model, **changes), vocab

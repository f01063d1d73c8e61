"""A LoRA run's adapters as a PEFT checkpoint: ``adapter_model.safetensors`` and ``adapter_config.json``, which
``peft.PeftModel.from_pretrained(base_model, directory)`` loads onto the Hugging Face base model.

Each adapted layer (:class:`levanter.lora.LoraLinear`) gives two tensors, named after the Hugging Face module
the layer's weight belongs to (its tensor name in the family's layout, :mod:`.families`, less ``.weight``),
under PEFT's prefix ``base_model.model.``:

* ``<module>.lora_A.weight`` ``[r, in]`` -- our ``lora_a [In..., lora_r]`` transposed, ``In`` flattened in
  the order of the weight's input axes in the layout;
* ``<module>.lora_B.weight`` ``[out, r]`` -- our ``lora_b [lora_r, Out...]`` transposed likewise.

A stacked layer gives one pair per layer (``model.layers.{i}...``). PEFT adds ``(lora_alpha / r) * B A x`` to
the layer's output, the scale ours computes (``LoraConfig.alpha / r``; ``use_rslora`` is false), so the
adapters loaded by PEFT compute what our adapted model computes. ``target_modules`` in the config lists the
adapted modules by their last name where those names select exactly the adapted modules (PEFT matches a
module whose name ends with ``.<entry>``), else by their full names. ``fan_in_fan_out`` is true only for
layers Hugging Face stores ``[in, out]`` (GPT-2's ``Conv1D``), as PEFT requires for them.

Writes are all or nothing and replace only an earlier export (:func:`.export.write_export`,
:mod:`levanter.compat.export_guard`), as the model exports are; ``adapter_config.json`` is the commit record.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from typing import Optional

import numpy as np

from levanter.lora import LORA_R, LoraConfig, LoraLinear
from levanter.utils.layer_select import dotted_path

from .export import StepExporter, tokenizer_files, write_export
from .families import STACKED, family_name, family_of
from .safetensors_io import dtype_table, safetensors_bytes

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "PeftExporter", "peft_adapter_config",
           "peft_state_dict", "save_peft_adapter"]

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model


def _axis_names(spec) -> tuple:
    import haliax as hax

    return (spec.name,) if isinstance(spec, hax.Axis) else tuple(a.name for a in spec)


def _host(arr, order: tuple) -> np.ndarray:
    import jax

    host = arr.rearrange(order).array
    if not getattr(host, "is_fully_addressable", True):
        from jax.experimental import multihost_utils

        host = multihost_utils.process_allgather(host, tiled=True)
    return np.asarray(jax.device_get(host))


def _adapted_layers(model) -> list:
    """``(layout entry, our layer path, layer)`` of every adapted layer, in model order."""
    import jax

    layout = family_of(model.config).layout(model.config)
    out = []
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, LoraLinear))[0]
    for path, node in flat:
        if not isinstance(node, LoraLinear):
            continue
        where = dotted_path(path)
        entry = layout.get(f"{where}.weight")
        if entry is None:
            raise ValueError(
                f"lora: the adapted layer {where} has no Hugging Face tensor in the {family_name(model.config)} "
                "layout, so its adapter cannot be exported for PEFT; leave it out of lora.target_modules"
            )
        out.append((entry, where, node))
    return out


def _groups(entry, where: str, node) -> tuple[tuple, tuple, bool]:
    """``(input axes, output axes, stored [in, out])`` of the layer's Hugging Face weight."""
    _, groups = entry
    ins, outs = _axis_names(node.In), _axis_names(node.Out)
    if len(groups) == 2 and set(groups[1]) == set(ins) and set(groups[0]) == set(outs):
        return tuple(groups[1]), tuple(groups[0]), False
    if len(groups) == 2 and set(groups[0]) == set(ins) and set(groups[1]) == set(outs):
        return tuple(groups[0]), tuple(groups[1]), True
    raise ValueError(f"lora: the Hugging Face weight of {where} is not [out, in] or [in, out] of the layer's own axes")


def _stacked(name: str) -> tuple:
    return tuple(axis for mark, axis in STACKED if mark in name)


def _each(name: str, stacked: tuple, sizes: dict) -> list:
    """``(index along the stacked axes, tensor name)`` for every tensor a templated name stands for."""
    keys = {"layers": "i", "experts": "e"}
    return [(index, name.format(**{keys[a]: j for a, j in zip(stacked, index)}))
            for index in itertools.product(*(range(sizes[a]) for a in stacked))]


def peft_state_dict(model) -> dict[str, np.ndarray]:
    """The adapters of ``model`` as PEFT's tensors (numpy, the factors' dtype): see the module docstring."""
    prefix = PEFT_PREFIX + family_of(model.config).export_prefix
    out: dict[str, np.ndarray] = {}
    for entry, where, node in _adapted_layers(model):
        name = entry[0]
        ins, outs, _ = _groups(entry, where, node)
        sizes = {a.name: a.size for a in (*node.lora_a.axes, *node.lora_b.axes)}
        stacked = _stacked(name)
        r = sizes[LORA_R]
        a = _host(node.lora_a, (*stacked, LORA_R, *ins))
        b = _host(node.lora_b, (*stacked, *outs, LORA_R))
        n_in, n_out = math.prod(sizes[x] for x in ins), math.prod(sizes[x] for x in outs)
        for index, tensor in _each(name, stacked, sizes):
            module = prefix + tensor[: -len(".weight")]
            out[f"{module}.lora_A.weight"] = a[index].reshape(r, n_in)
            out[f"{module}.lora_B.weight"] = b[index].reshape(n_out, r)
    return out


def _target_modules(model) -> tuple[list, bool]:
    """``(target_modules, fan_in_fan_out)`` for ``adapter_config.json``."""
    layout = family_of(model.config).layout(model.config)
    prefix = family_of(model.config).export_prefix
    adapted = _adapted_layers(model)
    templates = {entry[0] for entry, _, _ in adapted}
    last = sorted({t[: -len(".weight")].rsplit(".", 1)[-1] for t in templates})
    others = [n for n, _ in layout.values() if n.endswith(".weight") and n not in templates]
    if not any(n[: -len(".weight")].rsplit(".", 1)[-1] in last for n in others):
        names = last
    else:  # a short name would also pick layers that carry no adapter: name each module
        sizes = {}
        for _, _, node in adapted:
            sizes.update({a.name: a.size for a in node.lora_a.axes})
        names = sorted(prefix + t[: -len(".weight")] for entry, _, _ in adapted
                       for _, t in _each(entry[0], _stacked(entry[0]), sizes))
    transposed = {_groups(entry, where, node)[2] for entry, where, node in adapted}
    return names, transposed == {True}


def peft_adapter_config(model, lora: LoraConfig, base_model_name_or_path: Optional[str]) -> dict:
    """``adapter_config.json`` for ``model``'s adapters (PEFT's ``LoraConfig`` fields)."""
    targets, fan_in_fan_out = _target_modules(model)
    return {
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "inference_mode": True,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": lora.r,
        "target_modules": targets,
        "task_type": "CAUSAL_LM",
        "use_rslora": False,
    }


def save_peft_adapter(model, lora: LoraConfig, output_dir: str, *, base_model_name_or_path: Optional[str] = None,
                      tokenizer: Optional[str] = None, source: Optional[dict] = None,
                      label: Optional[str] = None) -> str:
    """Write ``model``'s adapters as a PEFT checkpoint directory ``output_dir`` (local path or URL), with the
    tokenizer's files for a Hugging Face tokenizer; returns it. Every process must call it (adapters sharded
    over several hosts are gathered); only process 0 writes. ``output_dir`` must be new, empty or exactly an
    earlier export (``label`` names it in the error)."""
    import jax

    from levanter.compat.export_guard import MARKER, check_replaceable, marker_bytes

    if jax.process_index() == 0:
        check_replaceable(output_dir, label)
    state = peft_state_dict(model)
    if not state:
        raise ValueError("lora: the model carries no adapters to export")
    doc = peft_adapter_config(model, lora, base_model_name_or_path)
    tok_files = tokenizer_files(tokenizer)
    if jax.process_index() != 0:
        return output_dir
    table = {v: k for k, v in dtype_table().items()}
    files: dict[str, bytes] = {ADAPTER_WEIGHTS: safetensors_bytes(state, {k: table[v.dtype] for k, v in state.items()})}
    files.update(tok_files)
    files[ADAPTER_CONFIG] = json.dumps(doc, indent=2, sort_keys=True).encode()  # last: the commit record
    files = {MARKER: marker_bytes(files, source), **files}
    write_export(output_dir, files, commit_file=ADAPTER_CONFIG)
    return output_dir


class PeftExporter(StepExporter):
    """A :class:`.export.StepExporter` writing a LoRA run's adapters in PEFT format (upstream's layout for
    ``peft_save_path``)."""

    what = "the LoRA adapters (PEFT format)"

    def __init__(self, base_path: str, *, every: int, last_step: int, lora: LoraConfig,
                 base_model_name_or_path: Optional[str] = None, tokenizer: Optional[str] = None,
                 key: str = "peft_save_path"):
        super().__init__(base_path, every=every, last_step=last_step, key=key)
        self.lora, self.base_model, self.tokenizer = lora, base_model_name_or_path, tokenizer

    def write(self, model, path: str, step: int) -> None:
        save_peft_adapter(model, self.lora, path, base_model_name_or_path=self.base_model, tokenizer=self.tokenizer,
                          source={"exported_by": "lora_lm", "step": step},
                          label=f"{self.key}: the export directory {path!r}")

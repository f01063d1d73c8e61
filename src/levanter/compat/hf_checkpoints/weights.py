"""Our model's parameters <-> Hugging Face tensors, through the family's layout table.

Our parameters are named arrays (``haliax``); each Hugging Face tensor is described by groups of our axis
names (``c_attn.weight`` of GPT-2 is ``[embed, (qkv, heads, head_size)]``), and per-layer tensors are
stacked along our ``layers`` axis, per-expert ones along ``experts`` (:mod:`.families` explains the table). The same table drives export
(:func:`to_state_dict`) and import (:func:`weights_like`), so the two are exact inverses: an export then an
import is bit-identical. Import is strict both ways: a parameter without a tensor, a tensor of the wrong
shape, and a tensor the model has no place for are each an error naming the tensor.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import numpy as np

from .families import STACKED, family_name, family_of

__all__ = ["to_state_dict", "weights_like"]

# Tensors some checkpoints carry that are not weights (causal-mask and rotary buffers of older versions).
_IGNORED = re.compile(r"(^|\.)attn\.(bias|masked_bias)$|rotary_emb\.inv_freq$")


def _is_named(x) -> bool:
    import haliax as hax

    return isinstance(x, hax.NamedArray)


def _named_leaves(model) -> list[tuple[str, Any]]:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_named)[0]
    out = []
    for path, leaf in flat:
        if _is_named(leaf):
            out.append((jax.tree_util.keystr(path).lstrip(".").replace("']", "").replace("['", "."), leaf))
    return out


def _hf_shape(axes_by_name: dict[str, int], groups) -> tuple[int, ...]:
    return tuple(math.prod(axes_by_name[a] for a in g) for g in groups)


def _stacked_axes(name: str) -> tuple[str, ...]:
    """Our axes that the tensors named by ``name`` are stacked along (``layers`` for ``{i}``, ...)."""
    return tuple(axis for mark, axis in STACKED if mark in name)


def _names(name: str, stacked: tuple[str, ...], sizes: dict[str, int]) -> list[tuple[tuple[int, ...], str]]:
    """``(index along each stacked axis, tensor name)`` of every tensor ``name`` stands for, in row-major order."""
    keys = {"layers": "i", "experts": "e"}
    out = []
    for index in itertools.product(*(range(sizes[a]) for a in stacked)):
        out.append((index, name.format(**{keys[a]: j for a, j in zip(stacked, index)})))
    return out


def to_state_dict(model) -> dict[str, np.ndarray]:
    """Our model's weights as Hugging Face tensors (numpy, the parameters' dtype); tied heads omitted."""
    import jax

    family = family_of(model.config)
    layout = family.layout(model.config)
    prefix = family.export_prefix
    out: dict[str, np.ndarray] = {}
    for path, arr in _named_leaves(model):
        if path not in layout:
            raise ValueError(f"parameter {path} has no Hugging Face name (use_bias or another unexported option?)")
        name, groups = layout[path]
        sizes = {a.name: a.size for a in arr.axes}
        stacked = _stacked_axes(name)
        order = (*stacked, *(a for g in groups for a in g))
        host = arr.rearrange(order).array
        if not getattr(host, "is_fully_addressable", True):
            from jax.experimental import multihost_utils

            host = multihost_utils.process_allgather(host, tiled=True)
        host = np.asarray(jax.device_get(host))
        shape = _hf_shape(sizes, groups)
        for index, tensor in _names(name, stacked, sizes):
            out[prefix + tensor] = host[index].reshape(shape)
    return out


def weights_like(template, state_dict: dict[str, np.ndarray], *, where: str = "checkpoint"):
    """``template`` (a model, or its ``jax.eval_shape``) with every parameter taken from the Hugging Face
    ``state_dict``: same axes, dtype and (for arrays) sharding as the template's leaves."""
    import haliax as hax
    import jax
    import jax.numpy as jnp

    config = template.config
    family = family_of(config)
    layout = family.layout(config)
    prefix = family.prefix_in(set(state_dict))
    used: set[str] = set()

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in state_dict:
            tied = name.endswith("lm_head.weight")
            raise ValueError(f"{where} has no tensor {name!r}" + (" (config.json says the head is untied)" if tied else ""))
        t = state_dict[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, but config.json implies {shape}")
        used.add(name)
        return np.asarray(t, dtype=np.float32)

    def build(path: str, leaf):
        if path not in layout:
            raise ValueError(f"parameter {path} has no Hugging Face name")
        name, groups = layout[path]
        sizes = {a.name: a.size for a in leaf.axes}
        shape = _hf_shape(sizes, groups)
        stacked = _stacked_axes(name)
        hf_axes = tuple(hax.Axis(a, sizes[a]) for a in (*stacked, *(a for g in groups for a in g)))
        tensors = [fetch(prefix + tensor, shape) for _, tensor in _names(name, stacked, sizes)]
        data = np.stack(tensors).reshape(tuple(a.size for a in hf_axes))
        arr = hax.named(jnp.asarray(data), hf_axes).rearrange(tuple(a.name for a in leaf.axes))
        value = arr.array.astype(leaf.array.dtype)
        sharding = getattr(leaf.array, "sharding", None)
        if isinstance(leaf.array, jax.Array) and sharding is not None:
            value = jax.device_put(value, sharding)
        return hax.named(value, leaf.axes)

    leaves = dict(_named_leaves(template))
    flat, treedef = jax.tree_util.tree_flatten_with_path(template, is_leaf=_is_named)
    new_leaves = []
    for path, leaf in flat:
        if _is_named(leaf):
            key = jax.tree_util.keystr(path).lstrip(".").replace("']", "").replace("['", ".")
            new_leaves.append(build(key, leaves[key]))
        else:
            new_leaves.append(leaf)
    model = jax.tree_util.tree_unflatten(treedef, new_leaves)
    extra = sorted(n for n in set(state_dict) - used if not _IGNORED.search(n) and not (n == "lm_head.weight" and family.head_is_tied(config)))
    if extra:
        raise ValueError(
            f"{where} holds tensors this {family_name(config)} model has no place for: {extra[:6]}"
            f"{' and more' if len(extra) > 6 else ''} (a different architecture, or options that are not implemented)"
        )
    return model

"""Naming and choosing a model's linear layers by their dotted paths (``blocks.stacked.mlp.c_fc``), as
``trainer.quantization.targets`` and ``lora.target_modules`` do: the path of a tree node, the check of a
regular expression given for them, and the paths of the linear layers a predicate picks.
"""

from __future__ import annotations

import re
from typing import Any, Callable

__all__ = ["check_layer_regex", "dotted_path", "linear_layer_paths"]


def dotted_path(path) -> str:
    """A jax key path (attributes, dict keys, sequence indices) as ``a.b.0.c``."""
    from jax.tree_util import GetAttrKey

    return ".".join(k.name if isinstance(k, GetAttrKey) else str(getattr(k, "key", getattr(k, "idx", k)))
                    for k in path)


def check_layer_regex(pattern: Any, key: str) -> None:
    """Raise ValueError naming ``key`` when ``pattern`` is a string that is not a valid regular expression."""
    if not isinstance(pattern, str):
        return
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(
            f"{key}={pattern!r} is not a valid regular expression ({e}): give a regex over the dotted layer path "
            "(e.g. '.*mlp.*') or a list of layer names"
        ) from None


def linear_layer_paths(model, picked: Callable[[Any], bool]) -> list[str]:
    """The dotted paths of ``model``'s linear layers (``haliax.nn.Linear``) for which ``picked(layer)`` holds."""
    import haliax.nn as hnn
    import jax

    found = []

    def visit(path, node):
        if isinstance(node, hnn.Linear) and picked(node):
            found.append(dotted_path(path))
        return node

    jax.tree_util.tree_map_with_path(visit, model, is_leaf=lambda x: isinstance(x, hnn.Linear))
    return found

"""fp8's state inside the train step: the scales and amax histories a model built ``with_fp8`` carries.

They are parameters of the model (trained alongside it, checkpointed, restored) but not gradients: the
backward pass computes their new values (haliax's ``OverwriteWithGradient``), which replace them after the
step; the optimizer never sees them, so they get no moments, decay or clipping. Without fp8 the split
leaves nothing aside and each function here is the identity on the rest, so the step is the same program.
"""

from __future__ import annotations

from typing import Any

import haliax.quantization as hq
import jax
import jax.numpy as jnp


def split_overwrites(tree: Any) -> tuple[Any, Any]:
    """``(overwrites, rest)``: the leaves the backward pass overwrites (fp8's state), and the others."""
    return hq.partition_for_grad_overwrite(tree)


def optimized_params(params: Any) -> Any:
    """The parameters the optimizer updates: all but the state that the backward pass overwrites."""
    return split_overwrites(params)[1]


def fp8_state(params: Any) -> Any:
    """fp8's state among ``params``, which the optimizer does not see (None elsewhere)."""
    return split_overwrites(params)[0]


def no_overwrites_yet(overwrites: Any) -> Any:
    """The start of the maximum over microbatches: every value -inf."""
    return jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), overwrites)


def merge_overwrites(acc: Any, new: Any) -> Any:
    """Two microbatches' new fp8 state as one: every microbatch computes it from the same state, the scales
    alike, the histories alike but for their newest entry, this microbatch's absolute maximum. Their
    elementwise maximum is what the whole batch in one pass would give."""
    return jax.tree.map(jnp.maximum, acc, new)


def apply_update(params: Any, updates: Any, overwrites: Any) -> Any:
    """``params`` moved by ``updates``, fp8's scales and histories taking the values the backward pass
    computed for them (none without fp8)."""
    return hq.apply_updates(params, updates, overwrites)


__all__ = [
    "apply_update",
    "fp8_state",
    "merge_overwrites",
    "no_overwrites_yet",
    "optimized_params",
    "split_overwrites",
]

"""Re-initialising the embedding and output rows of chosen tokens (upstream's SFT ``reinit_tokens``).

Chat tokens a base model never saw in pretraining (Llama 3's ``<|start_header_id|>``, ``<|eot_id|>``, ...)
keep rows of much smaller norm than the others; fine-tuning starts better when those rows are drawn afresh
from the distribution of the trained ones. :func:`reinit_token_rows` does that for every parameter with the
model's vocabulary axis -- the token embedding, and the output head unless it is tied -- drawing each chosen
row from a normal distribution truncated at 3 standard deviations, with the mean and standard deviation
over the vocabulary of that parameter, per embedding dimension.

Trade-off: parameters are found by their vocabulary axis, not by name, so every architecture is covered
without a table; ``lm_head`` / ``embeddings`` pick among them by whether the parameter's path names the
output head (``lm_head``).
"""

from __future__ import annotations

from collections.abc import Sequence

import haliax as hax
import jax
import jax.numpy as jnp

__all__ = ["reinit_token_rows"]


def reinit_token_rows(model, token_ids: Sequence[int], key, *, embeddings: bool = True, lm_head: bool = True):
    """``model`` with the rows of ``token_ids`` of its vocabulary-axis parameters drawn afresh (see the module
    docstring); ``embeddings`` / ``lm_head`` choose which parameters. Each array keeps its sharding."""
    vocab = model.Vocab.name
    ids = jnp.asarray(sorted(set(int(i) for i in token_ids)), dtype=jnp.int32)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, hax.NamedArray))
    out = []
    for n, (path, leaf) in enumerate(leaves):
        is_head = "lm_head" in jax.tree_util.keystr(path)
        wanted = lm_head if is_head else embeddings
        if wanted and isinstance(leaf, hax.NamedArray) and vocab in [ax.name for ax in leaf.axes]:
            axis = [ax.name for ax in leaf.axes].index(vocab)
            fn = jax.jit(lambda a, k, axis=axis: _redraw(a, ids, k, axis), out_shardings=leaf.array.sharding)
            leaf = hax.named(fn(leaf.array, jax.random.fold_in(key, n)), leaf.axes)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def _redraw(a, ids, key, axis: int):
    moved = jnp.moveaxis(a, axis, 0).astype(jnp.float32)
    mu, std = moved.mean(axis=0), moved.std(axis=0)
    fresh = jax.random.truncated_normal(key, -3.0, 3.0, (ids.shape[0], *moved.shape[1:])) * std + mu
    return jnp.moveaxis(moved.at[ids].set(fresh).astype(a.dtype), 0, axis)

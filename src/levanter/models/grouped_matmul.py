"""Grouped matrix products for mixture-of-experts layers: ``rows [m, k]`` sorted into contiguous groups, each
group multiplied by its own matrix of ``w [groups, k, n]``.

:func:`grouped_matmul` is ``jax.lax.ragged_dot`` with its gradient written out, because of how JAX and the TPU
compiler treat the three products of a training step:

* the forward product and the gradient of the rows are ragged products over the rows (``ragged_dot``'s
  first mode), which JAX lowers on a TPU to XLA's ragged-dot instruction: a grouped matmul kernel that
  visits each group's rows once;
* the gradient of the weights contracts over the ragged rows (``ragged_dot``'s second mode, one
  ``[k, n]`` product per group), which the TPU compiler (libtpu 0.0.42) computes as a dense product of
  every group against every row under a mask: ``groups`` times the useful work. On a TPU it is computed
  here by the Pallas kernel ``tgmm`` of JAX's megablox package (a transposed grouped matmul over the same
  groups) instead, and through JAX's own gradient of ``ragged_dot`` elsewhere.

The choice is made when the program is lowered (``jax.lax.platform_dependent``), so one trace serves a CPU
run, a TPU run and a TPU plan compiled on a CPU (``train_lm --dry_run --slice``). On a CPU, ``ragged_dot``
itself is computed densely (every group against every row, masked): correct, ``groups`` times slower, which
is why Mixtral's ``moe_dispatch: dense`` is the CPU path. ``tgmm`` runs on one TPU device: XLA does not
partition a Pallas kernel, so over a mesh of several devices (and for a row count that is not a multiple of
128, its row tile) the weights' gradient is JAX's on a TPU too.
"""

from __future__ import annotations

import warnings
from functools import partial

import jax
import jax.numpy as jnp

__all__ = ["grouped_matmul", "grouped_weight_grad_tgmm"]

# tgmm's tile sizes (rows, k, n): the largest of these that divides each dimension. 512 x 512 tiles of
# bfloat16 plus a float32 accumulator take 2 MiB of the core's vector memory, doubled for prefetching.
_TILES = (512, 256, 128)


@jax.custom_vjp
def grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``out[r] = rows[r] @ w[g]`` for each row ``r`` of group ``g``: ``rows [m, k]``, ``w [groups, k, n]``,
    ``group_sizes [groups]`` (int32, summing to ``m``) -> ``[m, n]`` in the inputs' dtype."""
    return jax.lax.ragged_dot(rows, w, group_sizes)


def _fwd(rows, w, group_sizes):
    return jax.lax.ragged_dot(rows, w, group_sizes), (rows, w, group_sizes)


def _bwd(res, g):
    rows, w, group_sizes = res
    g = g.astype(rows.dtype)
    d_rows = jax.lax.ragged_dot(g, jnp.swapaxes(w, 1, 2), group_sizes)
    d_w = jax.lax.platform_dependent(
        rows, g, group_sizes, tpu=partial(_weight_grad_tpu, w.shape[0]), default=partial(_weight_grad, w.shape[0])
    )
    return d_rows, d_w.astype(w.dtype), None


grouped_matmul.defvjp(_fwd, _bwd)


def _weight_grad(groups: int, rows: jax.Array, g: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``d_w [groups, k, n]``: JAX's own gradient of ``ragged_dot`` with respect to its weights."""
    zeros = jnp.zeros((groups, rows.shape[1], g.shape[1]), rows.dtype)
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(rows, w, group_sizes), zeros)
    return vjp(g)[0]


def _tile(size: int) -> int | None:
    return next((t for t in _TILES if size % t == 0), None)


def _mesh_size() -> int:
    """Devices of the mesh the program is traced for (``jax.set_mesh``, or ``with mesh:`` as the slice plan
    enters it); 1 without one."""
    abstract = jax.sharding.get_abstract_mesh()
    if abstract is not None and not abstract.empty:
        return abstract.size
    # The slice plan enters its mesh as ``with mesh:`` (levanter.memory.tpu_compile.compile_only), which JAX
    # records only here; JAX marks the name deprecated in favour of jax.set_mesh, which the check above reads.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.interpreters.pxla import thread_resources

    physical = thread_resources.env.physical_mesh
    return 1 if physical is None or physical.empty else physical.size


def _weight_grad_tpu(groups: int, rows: jax.Array, g: jax.Array, group_sizes: jax.Array) -> jax.Array:
    # A Pallas kernel is not partitioned by XLA: over a mesh of several devices it would need a shard_map,
    # so there the weights' gradient is JAX's (correct, groups times the work).
    if _tile(rows.shape[0]) is None or _mesh_size() > 1:
        return _weight_grad(groups, rows, g, group_sizes)
    return grouped_weight_grad_tgmm(rows, g, group_sizes, groups)


def grouped_weight_grad_tgmm(
    rows: jax.Array, g: jax.Array, group_sizes: jax.Array, groups: int, *, interpret: bool = False
) -> jax.Array:
    """``d_w[e] = rows[group e].T @ g[group e]`` through megablox's ``tgmm`` Pallas kernel (a TPU kernel;
    ``interpret=True`` runs it in Pallas's interpreter on any backend, for tests). ``rows [m, k]`` with ``m``
    a multiple of 128, ``g [m, n]`` -> ``[groups, k, n]`` in ``rows``' dtype (accumulated in float32)."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm

    m, k = rows.shape
    n = g.shape[1]
    tiling = (_tile(m), _tile(k) or min(k, 128), _tile(n) or min(n, 128))
    out = tgmm(jnp.swapaxes(rows, 0, 1), g, group_sizes, jnp.float32, tiling, num_actual_groups=groups,
               interpret=interpret)
    return out.astype(rows.dtype)

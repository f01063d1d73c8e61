"""Grouped matrix products for mixture-of-experts layers: ``rows [m, k]`` sorted into contiguous groups, each
group multiplied by its own matrix of ``w [groups, k, n]``.

:func:`grouped_matmul` is ``jax.lax.ragged_dot`` with its gradient written out, because of how JAX and the TPU
compiler treat the three products of a training step:

* the forward product and the gradient of the rows are ragged products over the rows (``ragged_dot``'s
  first mode). JAX lowers them on a TPU to XLA's ragged-dot instruction, a grouped matmul kernel that visits
  each group's rows once. On one TPU device they are computed by megablox's Pallas kernel ``gmm`` instead,
  with tiles fitted to the product (rows 256 at a time, the whole contraction in one tile where the core's
  vector memory holds it), which runs nearer a dense product's rate (figures in
  docs/bench/2026-12-07-tpu-rows.md);
* the gradient of the weights contracts over the ragged rows (``ragged_dot``'s second mode, one
  ``[k, n]`` product per group), which the TPU compiler (libtpu 0.0.42) computes as a dense product of
  every group against every row under a mask: ``groups`` times the useful work. On one TPU device it is
  computed by megablox's ``tgmm`` (a transposed grouped matmul over the same groups) instead, and through
  JAX's own gradient of ``ragged_dot`` elsewhere.

The choice is made when the program is lowered (``jax.lax.platform_dependent``), so one trace serves a CPU
run, a TPU run and a TPU plan compiled on a CPU (``train_lm --dry_run --slice``). On a CPU, ``ragged_dot``
itself is computed densely (every group against every row, masked): correct, ``groups`` times slower, which
is why Mixtral's ``moe_dispatch: dense`` is the CPU path. The Pallas kernels run on one TPU device: XLA does
not partition a Pallas kernel, so over a mesh of several devices (and for a row count that is not a multiple
of 128, their row tile) every product is ``ragged_dot``'s on a TPU too.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ..utils.mesh import mesh_size

__all__ = ["grouped_matmul", "grouped_matmul_gmm", "grouped_weight_grad_tgmm", "gmm_tiling", "tgmm_tiling"]

# The kernels' row tile: 256 rows a step measured fastest on a v5e for both kernels (512 and 1,024 slower at
# every k and n tried), 128 where the rows are not a multiple of 256.
_ROW_TILES = (256, 128)
# Bytes of the core's vector memory the kernels' tiles may take, by the estimates below. A tiling too large
# is refused when the step compiles (RESOURCE_EXHAUSTED), so each budget sits under every refusal the v5e's
# compiler gave in a sweep of 256-row tiles, with a margin, and admits the tiles measured fastest at Mixtral's
# shapes (scripts/bench/grouped_matmul.py; the sweep in docs/bench/2026-12-07-tpu-rows.md).
_GMM_VMEM = 10 * 2**20
_TGMM_VMEM = 15_500_000


def _tile_sizes(size: int) -> list[int]:
    """Tile sizes for a dimension of ``size``, largest first: the whole dimension, then the multiples of 128
    (the lane width a tile must fill unless it spans the dimension) that divide it."""
    return [size] + [t for t in range(size - size % 128, 0, -128) if size % t == 0 and t != size]


def gmm_tiling(m: int, k: int, n: int) -> tuple[int, int, int] | None:
    """``gmm``'s tiles ``(rows, k, n)`` for ``[m, k] x [k, n]``: the row tile of :data:`_ROW_TILES`, then the
    largest k tile (the whole contraction if it fits: no accumulation across steps), then the largest n tile,
    whose double-buffered bf16 tiles and float32 accumulator fit :data:`_GMM_VMEM`; None if no tiling
    divides the dimensions."""
    tm = next((t for t in _ROW_TILES if m % t == 0), None)
    if tm is None:
        return None
    for tk in _tile_sizes(k):
        for tn in _tile_sizes(n):
            if 4 * (tm * tk + tk * tn + tm * tn) + 4 * tm * tn <= _GMM_VMEM:
                return tm, tk, tn
    return None


def tgmm_tiling(m: int, k: int, n: int, out_bytes: int = 2) -> tuple[int, int, int] | None:
    """``tgmm``'s tiles ``(rows, k, n)`` for ``d_w [groups, k, n]`` from ``[m, k]`` rows and an ``[m, n]``
    cotangent: the row tile of :data:`_ROW_TILES`, then the largest ``k x n`` output tile (the larger k tile
    on a tie) whose double-buffered bf16 inputs, float32 accumulator and double-buffered output of
    ``out_bytes`` an entry (:func:`grouped_weight_grad_tgmm` writes the rows' dtype) fit :data:`_TGMM_VMEM`."""
    tm = next((t for t in _ROW_TILES if m % t == 0), None)
    if tm is None:
        return None
    fits = [(tk * tn, tk, tn) for tk in _tile_sizes(k) for tn in _tile_sizes(n)
            if 4 * tm * (tk + tn) + (4 + 2 * out_bytes) * tk * tn <= _TGMM_VMEM]
    if not fits:
        return None
    _, tk, tn = max(fits)
    return tm, tk, tn


@jax.custom_vjp
def grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``out[r] = rows[r] @ w[g]`` for each row ``r`` of group ``g``: ``rows [m, k]``, ``w [groups, k, n]``,
    ``group_sizes [groups]`` (int32, summing to ``m``) -> ``[m, n]`` in the inputs' dtype."""
    return jax.lax.ragged_dot(rows, w, group_sizes)


def _fwd(rows, w, group_sizes):
    return _product(rows, w, group_sizes, transpose_w=False), (rows, w, group_sizes)


def _bwd(res, g):
    rows, w, group_sizes = res
    g = g.astype(rows.dtype)
    d_rows = _product(g, w, group_sizes, transpose_w=True)
    d_w = jax.lax.platform_dependent(
        rows, g, group_sizes, tpu=partial(_weight_grad_tpu, w.shape[0]), default=partial(_weight_grad, w.shape[0])
    )
    return d_rows, d_w.astype(w.dtype), None


grouped_matmul.defvjp(_fwd, _bwd)


def _product(rows: jax.Array, w: jax.Array, group_sizes: jax.Array, *, transpose_w: bool) -> jax.Array:
    """``rows @ w[g]`` per group (``w[g].T`` with ``transpose_w``): gmm on one TPU device, ragged_dot elsewhere."""

    def ragged(rows, w, group_sizes):
        return jax.lax.ragged_dot(rows, jnp.swapaxes(w, 1, 2) if transpose_w else w, group_sizes)

    n = w.shape[1] if transpose_w else w.shape[2]
    if gmm_tiling(rows.shape[0], rows.shape[1], n) is None or mesh_size() > 1:
        return ragged(rows, w, group_sizes)
    return jax.lax.platform_dependent(
        rows, w, group_sizes, tpu=partial(grouped_matmul_gmm, transpose_w=transpose_w), default=ragged
    )


def grouped_matmul_gmm(
    rows: jax.Array, w: jax.Array, group_sizes: jax.Array, *, transpose_w: bool = False, interpret: bool = False
) -> jax.Array:
    """``rows [m, k] @ w[g]`` per group through megablox's ``gmm`` Pallas kernel (``w [groups, k, n]``, or
    ``[groups, n, k]`` read transposed with ``transpose_w``; a TPU kernel: ``interpret=True`` runs it in
    Pallas's interpreter on any backend, for tests) -> ``[m, n]`` in ``rows``' dtype, accumulated in float32."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm

    m, k = rows.shape
    n = w.shape[1] if transpose_w else w.shape[2]
    tiling = gmm_tiling(m, k, n)
    if tiling is None:
        raise ValueError(f"no gmm tiling divides a grouped product of {m} rows x {k} -> {n}")
    return gmm(rows, w.astype(rows.dtype), group_sizes, rows.dtype, tiling, transpose_rhs=transpose_w,
               interpret=interpret)


def _weight_grad(groups: int, rows: jax.Array, g: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``d_w [groups, k, n]``: JAX's own gradient of ``ragged_dot`` with respect to its weights."""
    zeros = jnp.zeros((groups, rows.shape[1], g.shape[1]), rows.dtype)
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(rows, w, group_sizes), zeros)
    return vjp(g)[0]


def _weight_grad_tpu(groups: int, rows: jax.Array, g: jax.Array, group_sizes: jax.Array) -> jax.Array:
    # A Pallas kernel is not partitioned by XLA: over a mesh of several devices it would need a shard_map,
    # so there the weights' gradient is JAX's (correct, groups times the work).
    if tgmm_tiling(*rows.shape, g.shape[1], rows.dtype.itemsize) is None or mesh_size() > 1:
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
    tiling = tgmm_tiling(m, k, n, rows.dtype.itemsize)  # the output is written in rows' dtype
    if tiling is None:
        raise ValueError(f"no tgmm tiling divides a grouped weight gradient of {m} rows x {k} -> {n}")
    # The kernel sums each tile in float32 and casts once as it stores: asking for rows' dtype gives the same
    # numbers as a float32 output cast afterwards, without writing and reading the float32 copy.
    return tgmm(jnp.swapaxes(rows, 0, 1), g, group_sizes, rows.dtype, tiling, num_actual_groups=groups,
                interpret=interpret)

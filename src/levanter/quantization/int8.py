"""int8 matrix products for ``trainer.quantization.int8``, and where on a TPU they are worth computing.

The kernel (:func:`int8_matmul`) computes a linear layer's three products, each one of :data:`WAYS`: the
compute dtype, int8 through XLA, or int8 through a fused Pallas kernel (TPU; Pallas's interpreter elsewhere).
Numerics, the same every int8 way: absolute-max scales, round to nearest, products accumulated in int32 by the
matrix units' int8 mode and scaled back in float32.

* forward ``x @ w``: ``x`` quantized by rows (one scale per token), ``w`` by columns (one per output);
* input gradient ``g @ w.T``: ``w``'s column scales moved onto ``g``'s columns and ``g * sw`` quantized by
  rows, so that the forward pass's int8 copy of ``w`` is reused;
* weight gradient ``x.T @ g`` (on request; training keeps it in the compute dtype, as upstream's AQT
  configuration does): the tokens in blocks of 512 (:func:`_fused_rows`), each block's ``x`` and ``g``
  quantized by columns (one scale per feature over the block's tokens), the blocks' products summed in
  float32. A scale over every token of the batch would let the tokens with the largest gradients round the
  others' to zero (AQT calls the per-block form local quantization of the contraction axis).

Why these choices: per-token and per-output scales keep an outlier token or channel from flattening the
others (a per-tensor scale would); round to nearest needs no random numbers (stochastic rounding draws one per
element of the gradient, a pass over memory as long as the product on a TPU). The gradient is otherwise
straight-through: the float product's.

Why the fused kernels (:func:`_fused_product`, :func:`_fused_weight_grad`): an int8 product runs at twice the
bf16 rate on a TPU v5e's matrix units, but quantizing its operands through XLA is element-wise work over the
activations (an absolute maximum per row, then the rounding), memory-bound passes that XLA does not fuse into
the product and that take most of the gain. The kernels quantize each block in the core's own memory on the
way into the product, reading the bf16 activation once as the bf16 product does; they pay for the quantizing
in the vector unit instead, and run on one device only (XLA does not partition a Pallas kernel): over a mesh
the int8 way is XLA's.

Where it pays (:func:`product_plan`): on a TPU, while the step is first traced, each layer shape is timed
alone, forward and backward, each of the :data:`PLANS` (on the device, at the shape the step computes it; a
few seconds per shape, once per process), and computed in int8 only where a plan measured at least
:data:`_MARGIN` faster than the plain product; the choice is logged once per layer and shape with the
figures, as a warning where the layer stays in the compute dtype, which it then computes through the plain
``dot_general``, exactly as without int8. Timed alone, a layer's input is made by one element-wise operation;
in the step it is a fusion XLA may handle differently, so the choice is a guide, not a guarantee (hence the
margin). On other platforms the forward product and the input gradient are int8 through XLA: a simulation
of the numerics (CPUs have no int8 matrix units), as the tests need it.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from ..utils.mesh import mesh_size

logger = logging.getLogger(__name__)

_MATMUL = (((1,), (0,)), ((), ()))  # [M, K] . [K, N]
_BY_ROWS_OF_W = (((1,), (1,)), ((), ()))  # [M, N] . [K, N] -> [M, K]
_OVER_TOKENS = (((0,), (0,)), ((), ()))  # [M, K] . [M, N] -> [K, N]


def _absmax_scale(x, axis: int):
    """float32 scales, one per row of ``x`` along ``axis`` (kept as a size-1 axis): its absolute maximum / 127,
    1 where the row is all zeros (any scale quantizes zeros to zeros). Plain ``jnp``: the fused kernels
    compute their scales with it in the core's memory, so every int8 way shares the numerics."""
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32)
    return jnp.where(amax > 0, amax * (1.0 / 127.0), 1.0)


def _to_int8(x, scale):
    """``x / scale`` rounded to the nearest integer, as int8 (``scale`` from :func:`_absmax_scale`, so that
    every value lands in [-127, 127]; the clip only guards the last bit of float rounding). A product by the
    reciprocal: a TPU divides in several passes of its vector unit."""
    return jnp.clip(jnp.round(x.astype(jnp.float32) * (1.0 / scale)), -127.0, 127.0).astype(jnp.int8)


def _int8_product(a, b, dims):
    """``dot_general`` of two int8 arrays accumulated in int32 (the matrix units' int8 mode), as float32."""
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.int32).astype(jnp.float32)


# Scoped vector memory the fused kernels ask the compiler for: a block of rows kept in int8 across the
# output's column tiles and a float32 accumulator outgrow the default scope (16 MiB); a v5e core has 128 MiB.
_VMEM_LIMIT = 64 * 2**20
# Column tiles: of the forward product's and the input gradient's output; of the weight gradient's [K, N].
_PRODUCT_COLUMNS = 2048
_GRAD_TILE = (512, 2048)


def _fused_rows(m: int) -> Optional[int]:
    """The rows (tokens) of one block of the fused kernels: the rows :func:`_fused_product` quantizes at once,
    the tokens :func:`_fused_weight_grad` scales together; None where ``m`` splits into none."""
    return next((t for t in (512, 256, 128) if m % t == 0), None)


def _col_tile(n: int, cap: int) -> Optional[int]:
    """The widest multiple of 128 (the matrix units' width) up to ``cap`` that divides ``n``, else None."""
    return next((t for t in range(min(cap, n) // 128 * 128, 0, -128) if n % t == 0), None)


def _tpu_params(semantics):
    from jax.experimental.pallas import tpu as pltpu

    params = pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=_VMEM_LIMIT)
    return {"compiler_params": params}


def _product_kernel(transpose_w: bool):
    dims = _BY_ROWS_OF_W if transpose_w else _MATMUL

    def kernel(x_ref, pre_ref, w_ref, post_ref, o_ref, q_ref, s_ref):
        from jax.experimental import pallas as pl

        # The block of rows is quantized once, at its first column tile, and kept for the others.
        @pl.when(pl.program_id(1) == 0)
        def _():
            x = x_ref[...].astype(jnp.float32) * pre_ref[...]
            s = _absmax_scale(x, 1)
            q_ref[...], s_ref[...] = _to_int8(x, s), s

        acc = jax.lax.dot_general(q_ref[...], w_ref[...], dims, preferred_element_type=jnp.int32)
        o_ref[...] = (acc.astype(jnp.float32) * s_ref[...] * post_ref[...]).astype(o_ref.dtype)

    return kernel


def _fused_product(x, pre, qw, post, transpose_w: bool = False):
    """``rowquant(x * pre) . qw * post`` in one Pallas kernel for a TPU: ``x`` [M, K] (bf16) read once a
    block of rows, scaled by ``pre`` [1, K] and quantized by rows in the kernel's memory, multiplied by the
    int8 ``qw`` ([K, N]; [N, K] read transposed with ``transpose_w``, so that the input's gradient reads the
    forward's copy as it is) in int32 and scaled back by the rows' scales and ``post`` [1, N]. The quantizing
    costs no pass over memory, where XLA spends two (an absolute maximum, then the rounding)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    (m, k), n = x.shape, qw.shape[0] if transpose_w else qw.shape[1]
    tm, tn = _fused_rows(m), _col_tile(n, _PRODUCT_COLUMNS)
    w_spec = (pl.BlockSpec((tn, k), lambda i, j: (j, 0)) if transpose_w
              else pl.BlockSpec((k, tn), lambda i, j: (0, j)))
    on_tpu = jax.default_backend() == "tpu"
    return pl.pallas_call(
        _product_kernel(transpose_w),
        grid=(m // tm, n // tn),
        in_specs=[pl.BlockSpec((tm, k), lambda i, j: (i, 0)), pl.BlockSpec((1, k), lambda i, j: (0, 0)),
                  w_spec, pl.BlockSpec((1, tn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((tm, k), jnp.int8), pltpu.VMEM((tm, 1), jnp.float32)],
        interpret=not on_tpu,  # elsewhere Pallas's interpreter (tests)
        **(_tpu_params(("parallel", "arbitrary")) if on_tpu else {}),
    )(x, pre.astype(jnp.float32), qw, post.astype(jnp.float32))


def _weight_grad_kernel(x_ref, g_ref, o_ref, acc_ref):
    from jax.experimental import pallas as pl

    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # Both operands quantized by columns (one scale per feature over the block's tokens). x's block is turned
    # in float32 first, so that its scales come out as a column, the shape that scales the accumulator's rows.
    xt, g = x_ref[...].astype(jnp.float32).T, g_ref[...].astype(jnp.float32)  # [tk, tm], [tm, tn]
    sx, sg = _absmax_scale(xt, 1), _absmax_scale(g, 0)  # [tk, 1], [1, tn]
    acc = jax.lax.dot_general(_to_int8(xt, sx), _to_int8(g, sg), _MATMUL, preferred_element_type=jnp.int32)
    acc_ref[...] += acc.astype(jnp.float32) * sx * sg

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _fused_weight_grad(x, g):
    """``x.T @ g`` (the weight's gradient: ``x`` [M, K], ``g`` [M, N] -> [K, N] in ``x``'s dtype) in int8 in
    one Pallas kernel for a TPU: per block of :func:`_fused_rows` tokens, each operand quantized by columns
    (one scale per feature over the block's tokens) in the kernel's memory, their int8 product summed in
    float32 with the block's scales. :func:`_blockwise_weight_grad` is the same numerics through XLA."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    (m, k), n = x.shape, g.shape[1]
    tm, tk, tn = _fused_rows(m), _col_tile(k, _GRAD_TILE[0]), _col_tile(n, _GRAD_TILE[1])
    on_tpu = jax.default_backend() == "tpu"
    return pl.pallas_call(
        _weight_grad_kernel,
        grid=(k // tk, n // tn, m // tm),
        in_specs=[pl.BlockSpec((tm, tk), lambda i, j, r: (r, i)),
                  pl.BlockSpec((tm, tn), lambda i, j, r: (r, j))],
        out_specs=pl.BlockSpec((tk, tn), lambda i, j, r: (i, j)),
        out_shape=jax.ShapeDtypeStruct((k, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        interpret=not on_tpu,
        **(_tpu_params(("parallel", "parallel", "arbitrary")) if on_tpu else {}),
    )(x, g.astype(x.dtype))


def _blockwise_weight_grad(x, g):
    """:func:`_fused_weight_grad`'s numerics through XLA: the tokens in blocks of :func:`_fused_rows`, each
    block's ``x`` and ``g`` quantized by columns, the blocks' int8 products scaled and summed in float32."""
    (m, k), n = x.shape, g.shape[1]
    tm = _fused_rows(m) or m
    xb = x.astype(jnp.float32).reshape(m // tm, tm, k)
    gb = g.astype(jnp.float32).reshape(m // tm, tm, n)
    sx, sg = _absmax_scale(xb, 1), _absmax_scale(gb, 1)  # [blocks, 1, k], [blocks, 1, n]
    acc = jax.lax.dot_general(_to_int8(xb, sx), _to_int8(gb, sg), (((1,), (1,)), ((0,), (0,))),
                              preferred_element_type=jnp.int32)  # [blocks, k, n]
    return jnp.sum(acc.astype(jnp.float32) * jnp.swapaxes(sx, 1, 2) * sg, axis=0).astype(x.dtype)


# How one product is computed: in the compute dtype, in int8 through XLA (quantizing passes, then the product),
# or in int8 through the fused Pallas kernels (TPU only).
WAYS = ("float", "xla", "fused")
# The three products of a linear layer, in the order int8_matmul takes their ways.
PRODUCTS = ("forward", "input gradient", "weight gradient")


def _forward_product(way, x, w, qw, sw):
    """``x @ w`` computed ``way`` (``qw``, ``sw``: ``w`` quantized by columns, unused by ``float``)."""
    if way == "fused":
        return _fused_product(x, jnp.ones((1, x.shape[1]), jnp.float32), qw, sw)
    if way == "xla":
        sx = _absmax_scale(x, 1)
        return (_int8_product(_to_int8(x, sx), qw, _MATMUL) * sx * sw).astype(x.dtype)
    return jax.lax.dot_general(x, w, _MATMUL)


def _input_grad_product(way, g, w, sw):
    """``g @ w.T`` computed ``way``: ``w`` is the weight (``float``) or its int8 copy with column scales
    ``sw``. With ``w ~ qw * sw`` (one scale per column of ``w``, the contracted axis here), ``sw`` moves onto
    ``g``'s columns and ``g * sw`` is quantized by rows, so the product reads the forward pass's int8 copy."""
    if way == "fused":
        return _fused_product(g, sw, w, jnp.ones((1, w.shape[0]), jnp.float32), transpose_w=True)
    if way == "xla":
        gs = g.astype(jnp.float32) * sw
        sg = _absmax_scale(gs, 1)
        return (_int8_product(_to_int8(gs, sg), w, _BY_ROWS_OF_W) * sg).astype(g.dtype)
    return jax.lax.dot_general(g, w, _BY_ROWS_OF_W).astype(g.dtype)


def _weight_grad_product(way, x, g):
    """``x.T @ g`` computed ``way``."""
    if way == "fused":
        return _fused_weight_grad(x, g)
    if way == "xla":
        return _blockwise_weight_grad(x, g)
    return jax.lax.dot_general(x, g, _OVER_TOKENS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul(x, w, forward: str, input_grad: str, weight_grad: str):
    return _matmul_fwd(x, w, forward, input_grad, weight_grad)[0]


def _matmul_fwd(x, w, forward, input_grad, weight_grad):
    quantized = forward != "float" or input_grad != "float"
    sw = _absmax_scale(w, 0) if quantized else None
    qw = _to_int8(w, sw) if quantized else None
    y = _forward_product(forward, x, w, qw, sw)
    return y, (x, qw, sw) if input_grad != "float" else (x, w, None)


def _matmul_bwd(forward, input_grad, weight_grad, res, g):
    x, w, sw = res
    g = g.astype(x.dtype)
    return _input_grad_product(input_grad, g, w, sw), _weight_grad_product(weight_grad, x, g)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def int8_matmul(x, w, forward: str = "xla", input_grad: str = "xla", weight_grad: str = "float"):
    """``x @ w`` for ``x`` [M, K] and ``w`` [K, N] of one float dtype, in ``x``'s dtype: each of the layer's
    three products (the forward, the input's gradient, the weight's gradient) computed one of the
    :data:`WAYS` (module docstring); all three in the compute dtype, the plain ``dot_general``."""
    ways = (forward, input_grad, weight_grad)
    if any(way not in WAYS for way in ways):
        raise ValueError(f"int8_matmul: forward={forward!r}, input_grad={input_grad!r} and "
                         f"weight_grad={weight_grad!r} must be in {WAYS}")
    if all(way == "float" for way in ways):
        return jax.lax.dot_general(x, w, _MATMUL)  # the plain product: no custom gradient around it
    if "fused" in ways and not _fused_fits(x.shape[0], x.shape[1], w.shape[1]):
        raise ValueError(f"int8_matmul: the fused kernels take rows and widths in multiples of 128; "
                         f"[{x.shape[0]} x {x.shape[1]}] . [{w.shape[0]} x {w.shape[1]}]")
    return _matmul(x, w, forward, input_grad, weight_grad)


# A layer computes in int8 only where it measured this much faster than in the compute dtype: a layer's time
# in the step differs from its time alone (what XLA fuses around it, a forward pass computed again under
# gradient checkpointing); docs/bench/2026-12-07-tpu-rows.md has a layer faster alone and slower in the step.
_MARGIN = 0.10

# The ways a layer's (forward, input gradient, weight gradient) are timed together (:func:`product_plan`): the
# compute dtype (the plain ``dot_general``); the forward product and the input gradient in int8 through XLA or
# the fused kernels; the forward product alone in int8 either way. The weight's gradient stays in the compute
# dtype: its fused kernel measured no faster than bf16 on a v5e at the benchmark models' shapes.
PLANS = (("float", "float", "float"), ("xla", "xla", "float"), ("fused", "fused", "float"),
         ("xla", "float", "float"), ("fused", "float", "float"))


def _layer_fn(ways: tuple[str, str, str]):
    """A layer's forward product and its two gradients computed ``ways`` (all in the compute dtype: the plain
    ``dot_general``, as a kept layer computes it), each activation made by an element-wise operation (as a
    norm, an activation function or the next layer's backward makes it)."""

    def run(h, v, w, g, u):
        y, vjp = jax.vjp(lambda h, w: int8_matmul(h * v, w, *ways), h, w)
        return (y, *vjp(g * u))

    return run


@functools.lru_cache(maxsize=None)
def _layer_seconds(m: int, k: int, n: int, dtype, ways: tuple[str, str, str], repeats: int = 10) -> float:
    """Seconds a layer ``[m, k] . [k, n]`` takes forward and backward on this process's first device with its
    products computed ``ways`` (:func:`_layer_fn`), quantizing included; the median of ``repeats`` runs after
    one that warms up. Runs now even inside a trace (``ensure_compile_time_eval``): the step being traced is
    not run. Cached: a shape is timed once a process."""
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = [(m, k), (k,), (k, n), (m, n), (n,)]
    compiled = jax.jit(_layer_fn(ways)).lower(*(jax.ShapeDtypeStruct(s, dtype, sharding=sharding)
                                                for s in shapes)).compile()
    with jax.ensure_compile_time_eval():
        args = [jax.device_put(jnp.full(s, 0.5, dtype), device) for s in shapes]
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fused_fits(m: int, k: int, n: int) -> bool:
    """Whether the fused kernels tile a layer ``[m, k] . [k, n]``: rows in blocks of 128, and both widths in
    multiples of 128 (the matrix units' width; each is an output's columns in one of the products)."""
    return _fused_rows(m) is not None and k % 128 == 0 and n % 128 == 0


def _describe(ways: tuple[str, str, str], dtype) -> str:
    names = {"float": jnp.dtype(dtype).name, "xla": "int8 (XLA)", "fused": "int8 (fused kernel)"}
    return ", ".join(f"{product} {names[way]}" for product, way in zip(PRODUCTS, ways))


@functools.lru_cache(maxsize=None)
def product_plan(m: int, k: int, n: int, dtype_name: str, kernels: bool = True) -> tuple[str, str, str, str]:
    """For a layer's product ``[m, k] . [k, n]`` in ``dtype_name``: (how the forward product is computed, how
    the input's gradient is, how the weight's gradient is, why), each one of :data:`WAYS`. On a TPU, the layer
    timed forward and backward each of the :data:`PLANS` (those with the fused kernels only with ``kernels``),
    and the fastest taken if it measured at least :data:`_MARGIN` faster than the compute dtype, else the
    compute dtype; elsewhere the forward product and the input's gradient in int8 through XLA (a simulation of
    the numerics) and the weight's gradient in the compute dtype, with an empty why. Cached: each shape is
    measured once a process."""
    if jax.default_backend() != "tpu":
        return "xla", "xla", "float", ""
    dtype = jnp.dtype(dtype_name)
    seconds = {}
    for ways in PLANS:
        if "fused" in ways and not (kernels and _fused_fits(m, k, n)):
            continue
        try:
            seconds[ways] = _layer_seconds(m, k, n, dtype, ways)
        except Exception as e:  # a fused kernel refused at this shape: the other ways remain
            logger.info("trainer.quantization.int8: %s does not compile for [%d x %d] . [%d x %d] (%s); "
                        "it is left out there", _describe(ways, dtype), m, k, k, n, str(e)[:200])
    plain = ("float",) * 3
    best = min(seconds, key=seconds.get)
    if seconds[best] > (1 - _MARGIN) * seconds[plain]:
        best = plain
    figures = "; ".join(f"{_describe(ways, dtype)}: {1e3 * t:.3f} ms" for ways, t in seconds.items())
    why = f"{_describe(best, dtype)} (forward and backward measured alone: {figures})"
    return (*best, why)


_LOGGED: set = set()


def _plan_for(layer: str, m: int, k: int, n: int, dtype) -> tuple[str, str, str]:
    """:func:`product_plan` for the local share of ``m`` rows (the token axis split over every device, as data
    parallelism splits it; the fused kernels only on one device, as XLA does not partition a Pallas kernel),
    logged once per layer and shape: a warning where int8 pays for none of the layer's products."""
    devices = jax.device_count()
    local = m // devices if m % devices == 0 and m // devices >= 128 else m
    *ways, why = product_plan(local, k, n, jnp.dtype(dtype).name, mesh_size() == 1)
    if why and (layer, m, k, n) not in _LOGGED:
        _LOGGED.add((layer, m, k, n))
        if all(way == "float" for way in ways):
            logger.warning("trainer.quantization.int8: %s ([%d x %d] . [%d x %d] per device) computes in %s, "
                           "not int8: no int8 way measured %d %% faster here. %s", layer or "a layer",
                           local, k, k, n, jnp.dtype(dtype).name, round(100 * _MARGIN), why)
        else:
            logger.info("trainer.quantization.int8: %s ([%d x %d] . [%d x %d] per device): %s",
                        layer or "a layer", local, k, k, n, why)
    return tuple(ways)


def _int8_dot_general(lhs, rhs, dimension_numbers, layer: str = "", precision=None,
                      preferred_element_type=None, ways: Optional[tuple[str, str, str]] = None):
    """``jax.lax.dot_general(lhs, rhs, dimension_numbers)`` through :func:`int8_matmul`: each operand laid
    out as a matrix (its free axes, then the contracted ones; free reshapes for the layouts the linear layers
    use), batch axes mapped with ``jax.vmap``; its products computed ``ways`` (None: as :func:`product_plan`
    says for the shape). Where all three are in the compute dtype, the plain ``dot_general`` itself, so that
    the layer's step is exactly an unquantized one's (a custom gradient around it would change what XLA fuses
    and saves for the backward pass)."""
    (lc, rc), (lb, rb) = dimension_numbers
    if lb:
        # Peel one batch axis at a time: map over it, the other axes renumbered without it.
        rest_l = [d for d in range(lhs.ndim) if d != lb[0]]
        rest_r = [d for d in range(rhs.ndim) if d != rb[0]]
        renum_l, renum_r = {d: i for i, d in enumerate(rest_l)}, {d: i for i, d in enumerate(rest_r)}
        inner = (((tuple(renum_l[d] for d in lc), tuple(renum_r[d] for d in rc)),
                  (tuple(renum_l[d] for d in lb[1:]), tuple(renum_r[d] for d in rb[1:]))))
        return jax.vmap(lambda a, b: _int8_dot_general(a, b, inner, layer, precision, preferred_element_type,
                                                       ways), in_axes=(lb[0], rb[0]))(lhs, rhs)
    l_free = [d for d in range(lhs.ndim) if d not in lc]
    r_free = [d for d in range(rhs.ndim) if d not in rc]
    k = math.prod(lhs.shape[d] for d in lc)
    m, n = math.prod(lhs.shape[d] for d in l_free), math.prod(rhs.shape[d] for d in r_free)
    ways = ways or _plan_for(layer, m, k, n, lhs.dtype)
    if all(way == "float" for way in ways):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    x = jnp.transpose(lhs, (*l_free, *lc)).reshape(m, k)
    w = jnp.transpose(rhs, (*rc, *r_free)).reshape(k, n).astype(x.dtype)
    out = int8_matmul(x, w, *ways).reshape(*(lhs.shape[d] for d in l_free), *(rhs.shape[d] for d in r_free))
    return out if preferred_element_type is None else out.astype(preferred_element_type)


class Int8DotGeneral(eqx.Module):
    """A linear layer's ``dot_general`` computing in int8 (:func:`int8_matmul`, :func:`product_plan`); holds no
    array. ``layer``: the layer's name, for the log; ``ways``: how its (forward, input gradient, weight
    gradient) are computed, each one of :data:`WAYS`, or None for the plan's choice at each shape."""

    layer: str = eqx.field(static=True, default="")
    ways: Optional[tuple[str, str, str]] = eqx.field(static=True, default=None)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        return _int8_dot_general(lhs, rhs, dimension_numbers, self.layer, precision, preferred_element_type,
                                 self.ways)


__all__ = ["Int8DotGeneral", "int8_matmul", "product_plan"]

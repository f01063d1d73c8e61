"""int8 matrix products for ``trainer.quantization.int8``, and where on a TPU they are worth computing.

The kernel (:func:`int8_matmul`): ``x @ w`` with ``x`` quantized by rows (one scale per token) and ``w`` by
columns (one per output), absolute-max scales, round to nearest, the product accumulated in int32 by the matrix
units' int8 mode and scaled back in float32. Its gradient is the float product's (straight-through): the
input's gradient is a second int8 product (the output gradient quantized by rows, after ``w``'s column scales
are moved onto it, so that ``w``'s int8 copy from the forward pass is reused), the weight's gradient a product
in the compute dtype. Why these choices: per-token and per-output scales keep an outlier token or channel from
flattening the others (a per-tensor scale would); round to nearest needs no random numbers (stochastic rounding
draws one per element of the gradient, a pass over memory as long as the product on a TPU); the weight's
gradient sums over every token of the batch, where 8 bits lose most and where quantizing both operands along
the token axis costs two more passes over the activations.

Where it pays (:func:`product_plan`): an int8 product runs at twice the bf16 rate on a TPU v5e's matrix units,
but quantizing its operands is element-wise work over the activations (an absolute maximum per row, then the
rounding), memory-bound passes that XLA does not fuse into the product. A product whose contracted axis is
short next to its output (an MLP's first projection, width 768 into 3,072) is bound by writing its output,
not by the matrix units, and gains nothing (the TPU compiler's own estimates, ``estimated_cycles`` in the
optimized HLO for a v5e, put every product of the benchmark models slower in int8 once its quantizing passes
are counted). Hence a second int8 way, a Pallas kernel (:func:`_fused_product`) that quantizes each block of
rows in its own memory on the way into the product, reading the bf16 activation once as the bf16 product
does. On a TPU, while the step is first traced, each product of each layer shape (the forward and the input
gradient apart) is timed alone every way (bf16, int8 through XLA, int8 fused), on the device, at the shape the
step computes it (a few seconds per shape, once per process), and computed the fastest way; the choices are
logged once per layer and shape, with the figures. Timed alone, the product's producer is a single
element-wise operation: in the step it may be a fusion XLA handles differently, so the choice is a close
guide, not a guarantee. On other platforms every selected product is int8: a simulation of the numerics
(CPUs have no int8 matrix units), as the tests need it.
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

logger = logging.getLogger(__name__)

_MATMUL = (((1,), (0,)), ((), ()))  # [M, K] . [K, N]
_BY_ROWS_OF_W = (((1,), (1,)), ((), ()))  # [M, N] . [K, N] -> [M, K]
_OVER_TOKENS = (((0,), (0,)), ((), ()))  # [M, K] . [M, N] -> [K, N]


def _absmax_scale(x, axis: int):
    """float32 scales, one per row of ``x`` along ``axis`` (kept as a size-1 axis): its absolute maximum / 127,
    1 where the row is all zeros (any scale quantizes zeros to zeros)."""
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32)
    return jnp.where(amax > 0, amax / 127.0, 1.0)


def _to_int8(x, scale):
    """``x / scale`` rounded to the nearest integer, as int8 (``scale`` from :func:`_absmax_scale`, so that
    every value lands in [-127, 127]; the clip only guards the last bit of float rounding). A product by the
    reciprocal: a TPU divides in several passes of its vector unit."""
    return jnp.clip(jnp.round(x.astype(jnp.float32) * (1.0 / scale)), -127.0, 127.0).astype(jnp.int8)


def _int8_product(a, b, dims):
    """``dot_general`` of two int8 arrays accumulated in int32 (the matrix units' int8 mode), as float32."""
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.int32).astype(jnp.float32)


def _fused_kernel(x_ref, pre_ref, w_ref, post_ref, o_ref):
    x = x_ref[...].astype(jnp.float32) * pre_ref[...]
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    scale = jnp.where(amax > 0, amax * (1.0 / 127.0), 1.0)
    q = jnp.clip(jnp.round(x * (1.0 / scale)), -127.0, 127.0).astype(jnp.int8)
    acc = jax.lax.dot_general(q, w_ref[...], _MATMUL, preferred_element_type=jnp.int32)
    o_ref[...] = (acc.astype(jnp.float32) * scale * post_ref[...]).astype(o_ref.dtype)


def _fused_rows(m: int) -> Optional[int]:
    """The rows of ``x`` one step of :func:`_fused_product` takes, or None where ``m`` splits into none."""
    return next((t for t in (512, 256, 128) if m % t == 0), None)


def _fused_product(x, pre, qw, post):
    """``rowquant(x * pre) . qw * post`` in one Pallas kernel for a TPU: each block of rows of ``x`` (bf16)
    is read once, scaled by ``pre`` [1, K], quantized by rows in the kernel's memory, multiplied by the int8
    ``qw`` [K, N] in int32 and scaled back by its row scales and ``post`` [1, N]. The quantizing costs no pass
    over memory, where XLA spends two (an absolute maximum, then the rounding) beside the product."""
    from jax.experimental import pallas as pl

    (m, k), n = x.shape, qw.shape[1]
    tm = _fused_rows(m)
    return pl.pallas_call(
        _fused_kernel,
        grid=(m // tm,),
        in_specs=[pl.BlockSpec((tm, k), lambda i: (i, 0)), pl.BlockSpec((1, k), lambda i: (0, 0)),
                  pl.BlockSpec((k, n), lambda i: (0, 0)), pl.BlockSpec((1, n), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((tm, n), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        interpret=jax.default_backend() != "tpu",  # elsewhere Pallas's interpreter (tests)
    )(x, pre.astype(jnp.float32), qw, post.astype(jnp.float32))


# How one product is computed: in the compute dtype, in int8 through XLA (quantizing passes, then the product),
# or in int8 through the fused Pallas kernel (TPU only).
WAYS = ("float", "xla", "fused")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x, w, forward: str, input_grad: str):
    return _matmul_fwd(x, w, forward, input_grad)[0]


def _matmul_fwd(x, w, forward, input_grad):
    sw = _absmax_scale(w, 0)
    qw = _to_int8(w, sw)
    if forward == "fused":
        y = _fused_product(x, jnp.ones((1, x.shape[1]), jnp.float32), qw, sw)
    elif forward == "xla":
        sx = _absmax_scale(x, 1)
        y = (_int8_product(_to_int8(x, sx), qw, _MATMUL) * sx * sw).astype(x.dtype)
    else:
        y = jax.lax.dot_general(x, w, _MATMUL)
    return y, (x, qw, sw) if input_grad != "float" else (x, w, None)


def _matmul_bwd(forward, input_grad, res, g):
    x, w, sw = res
    # dx = g . w^T with w ~ qw * sw (sw one per column of w, the contracted axis here): sw moves onto g's
    # columns and g * sw is quantized by rows, so the product reads w's int8 copy from the forward pass.
    if input_grad == "fused":
        dx = _fused_product(g.astype(x.dtype), sw, w.T, jnp.ones((1, w.shape[0]), jnp.float32))
    elif input_grad == "xla":
        gs = g.astype(jnp.float32) * sw
        sg = _absmax_scale(gs, 1)
        dx = (_int8_product(_to_int8(gs, sg), w, _BY_ROWS_OF_W) * sg).astype(x.dtype)
    else:
        dx = jax.lax.dot_general(g.astype(w.dtype), w, _BY_ROWS_OF_W).astype(x.dtype)
    dw = jax.lax.dot_general(x, g.astype(x.dtype), _OVER_TOKENS)
    return dx, dw


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def int8_matmul(x, w, forward: str = "xla", input_grad: str = "xla"):
    """``x @ w`` for ``x`` [M, K] and ``w`` [K, N] of one float dtype, in ``x``'s dtype: the forward product
    and the input's gradient each computed one of the :data:`WAYS` (int8 through XLA unless told), the weight's
    gradient in the compute dtype (module docstring)."""
    if forward not in WAYS or input_grad not in WAYS:
        raise ValueError(f"int8_matmul: forward={forward!r} and input_grad={input_grad!r} must be in {WAYS}")
    return _matmul(x, w, forward, input_grad)


@functools.lru_cache(maxsize=None)
def _product_seconds(m: int, k: int, n: int, dtype, way: str, repeats: int = 10) -> float:
    """Seconds ``[m, k] . [k, n]`` takes on this process's first device computed ``way`` (one of :data:`WAYS`)
    as a layer computes it in a step: the activation made by an element-wise operation (as a norm or an
    activation function makes it, one XLA can fuse into the product), quantizing included; the median of
    ``repeats`` runs after one that warms up. Runs now even inside a trace (``ensure_compile_time_eval``):
    the step being traced is not run. Cached: an MLP's two projections share their shapes transposed."""
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in ((m, k), (k,), (k, n))]

    def product(h, v, w):
        return int8_matmul(h * v, w, forward=way)

    with jax.ensure_compile_time_eval():
        compiled = jax.jit(product).lower(*shapes).compile()
        args = [jax.device_put(jnp.full(s.shape, 0.5, dtype), device) for s in shapes]
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@functools.lru_cache(maxsize=None)
def product_plan(m: int, k: int, n: int, dtype_name: str) -> tuple[str, str, str]:
    """For a layer's product ``[m, k] . [k, n]`` in ``dtype_name``: (how the forward product is computed, how
    the input's gradient is, why), each one of :data:`WAYS`. On a TPU, the way each measured fastest (module
    docstring); elsewhere ``xla`` for both, with an empty why. Cached: each shape is measured once a process."""
    if jax.default_backend() != "tpu":
        return "xla", "xla", ""
    dtype = jnp.dtype(dtype_name)
    chosen, why = [], []
    for label, (rows, inner, outer) in (("forward", (m, k, n)), ("input gradient", (m, n, k))):
        seconds = {}
        for way in WAYS:
            if way == "fused" and _fused_rows(rows) is None:
                continue
            try:
                seconds[way] = _product_seconds(rows, inner, outer, dtype, way)
            except Exception as e:  # the fused kernel refused at this shape: the other ways remain
                logger.info("trainer.quantization.int8: the fused int8 kernel does not compile for [%d x %d] . "
                            "[%d x %d] (%s); it is left out there", rows, inner, inner, outer, str(e)[:200])
        best = min(seconds, key=seconds.get)
        chosen.append(best)
        names = {"float": dtype.name, "xla": "int8 (XLA)", "fused": "int8 (fused kernel)"}
        figures = ", ".join(f"{names[w]} {1e3 * t:.3f} ms" for w, t in seconds.items())
        why.append(f"{label} in {names[best]} (measured alone: {figures})")
    return chosen[0], chosen[1], "; ".join(why)


_LOGGED: set = set()


def _plan_for(layer: str, m: int, k: int, n: int, dtype) -> tuple[str, str]:
    """:func:`product_plan` for the local share of ``m`` rows (the token axis split over every device, as data
    parallelism splits it), logged once per layer and shape."""
    devices = jax.device_count()
    local = m // devices if m % devices == 0 and m // devices >= 128 else m
    forward, input_grad, why = product_plan(local, k, n, jnp.dtype(dtype).name)
    if why and (layer, m, k, n) not in _LOGGED:
        _LOGGED.add((layer, m, k, n))
        logger.info("trainer.quantization.int8: %s ([%d x %d] . [%d x %d] per device): %s", layer or "a layer",
                    local, k, k, n, why)
    return forward, input_grad


def _int8_dot_general(lhs, rhs, dimension_numbers, layer: str = ""):
    """``jax.lax.dot_general(lhs, rhs, dimension_numbers)`` through :func:`int8_matmul`: each operand laid
    out as a matrix (its free axes, then the contracted ones; free reshapes for the layouts the linear layers
    use), batch axes mapped with ``jax.vmap``."""
    (lc, rc), (lb, rb) = dimension_numbers
    if lb:
        # Peel one batch axis at a time: map over it, the other axes renumbered without it.
        rest_l = [d for d in range(lhs.ndim) if d != lb[0]]
        rest_r = [d for d in range(rhs.ndim) if d != rb[0]]
        renum_l, renum_r = {d: i for i, d in enumerate(rest_l)}, {d: i for i, d in enumerate(rest_r)}
        inner = (((tuple(renum_l[d] for d in lc), tuple(renum_r[d] for d in rc)),
                  (tuple(renum_l[d] for d in lb[1:]), tuple(renum_r[d] for d in rb[1:]))))
        return jax.vmap(lambda a, b: _int8_dot_general(a, b, inner, layer), in_axes=(lb[0], rb[0]))(lhs, rhs)
    l_free = [d for d in range(lhs.ndim) if d not in lc]
    r_free = [d for d in range(rhs.ndim) if d not in rc]
    k = math.prod(lhs.shape[d] for d in lc)
    x = jnp.transpose(lhs, (*l_free, *lc)).reshape(-1, k)
    w = jnp.transpose(rhs, (*rc, *r_free)).reshape(k, -1).astype(x.dtype)
    forward, input_grad = _plan_for(layer, x.shape[0], k, w.shape[1], x.dtype)
    out = int8_matmul(x, w, forward, input_grad)
    return out.reshape(*(lhs.shape[d] for d in l_free), *(rhs.shape[d] for d in r_free))


class Int8DotGeneral(eqx.Module):
    """A linear layer's ``dot_general`` computing in int8 (:func:`int8_matmul`, :func:`product_plan`); holds no
    array. ``layer``: the layer's name, for the log."""

    layer: str = eqx.field(static=True, default="")

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        out = _int8_dot_general(lhs, rhs, dimension_numbers, self.layer)
        return out if preferred_element_type is None else out.astype(preferred_element_type)


__all__ = ["Int8DotGeneral", "int8_matmul", "product_plan"]

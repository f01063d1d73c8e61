"""Projections computed as one 2-D matrix product over all token positions.

A transformer's projections contract ``embed`` (or ``mlp``, or ``heads x head_size``) of an activation
``[batch, position, ...]``. Written as a named dot over the 3-D activation, XLA lowers the backward pass's
weight gradient as a contraction over *two* axes (``batch`` and ``position``), and on CPU it copies the
activations into a transposed layout to do it. Merging ``batch x position`` into one axis first (a free
reshape of a row-major array) turns every projection, forward and backward, into a plain matrix
product, which XLA on CPU runs without the copies (docs/bench/2026-12-03-cpu-levers.md). The merged axis
keeps the name of the activation's first axis, normally ``batch``, so the axis mapping still shards it
over the data axis: each device holds the same whole sequences as before, and no collective is added.

The functions fall back to the plain named dot when merging does not apply (the activation shares a
non-contracted axis with the weight, e.g. under ``vmap``, or has a single outer axis already).
"""

from __future__ import annotations

import math
from typing import Optional, Protocol, Sequence, runtime_checkable

import haliax as hax
import haliax.nn as hnn
from haliax import Axis, NamedArray
from haliax.quantization import DefaultDotGeneralOp

__all__ = ["token_dot", "token_dot_kernel", "LowRankAdapted", "lora_adapter", "linear"]


def _as_axes(spec, array: NamedArray) -> tuple[Axis, ...]:
    names = (spec,) if isinstance(spec, (str, Axis)) else tuple(spec)
    return tuple(array.resolve_axis(a.name if isinstance(a, Axis) else a) for a in names)


def token_dot(x: NamedArray, weight: NamedArray, axis, dot_general=None) -> NamedArray:
    """``hax.dot(x, weight, axis=axis)`` with x's outer axes merged into one for the product.

    Same axes and values as the named dot (up to float rounding); the outer axes of ``x`` (those not
    contracted) come first in the result, then the weight's remaining axes. ``dot_general``: the product's
    kernel (a quantized one, :mod:`levanter.quantization`); None: ``jax.lax.dot_general``.
    """
    kw = {} if dot_general is None else {"dot_general": dot_general}
    contracted = _as_axes(axis, x)
    contracted_names = {a.name for a in contracted}
    outer: Sequence[Axis] = tuple(a for a in x.axes if a.name not in contracted_names)
    weight_names = {a.name for a in weight.axes}
    if len(outer) < 2 or any(a.name in weight_names for a in outer):
        return hax.dot(x, weight, axis=axis, **kw)
    x = x.rearrange((*outer, *contracted))
    Tokens = Axis(outer[0].name, math.prod(a.size for a in outer))
    flat = x.flatten_axes(tuple(outer), Tokens)
    out = hax.dot(flat, weight, axis=axis, **kw).rearrange((Tokens, ...))
    return out.unflatten_axis(Tokens, tuple(outer))


def token_dot_kernel(layer: hnn.Linear):
    """The layer's ``dot_general``, or None for haliax's default (a plain ``jax.lax.dot_general``)."""
    op = layer.dot_general
    return None if op is None or isinstance(op, DefaultDotGeneralOp) else op


@runtime_checkable
class LowRankAdapted(Protocol):
    """A linear layer with a low-rank adapter beside it (:class:`levanter.lora.LoraLinear`, which this part
    cannot import: ``lora`` builds on ``models``): ``lora_scale * (x . lora_a) . lora_b`` is added to its
    product."""

    lora_a: Optional[NamedArray]  # [In..., lora_r]
    lora_b: Optional[NamedArray]  # [lora_r, Out...]
    lora_scale: float


def lora_adapter(layer: hnn.Linear) -> Optional[LowRankAdapted]:
    """``layer`` if it carries a LoRA adapter, else None."""
    return layer if isinstance(layer, LowRankAdapted) and layer.lora_a is not None else None


def linear(layer: hnn.Linear, x: NamedArray, select: Optional[tuple[str, int]] = None) -> NamedArray:
    """``layer(x)`` computed with :func:`token_dot` (same parameters, same result axes, and the layer's own
    ``dot_general``, so that a layer quantized by haliax keeps its int8 kernel), plus a LoRA adapter's product
    where the layer has one. ``select``: ``(axis, i)``, one entry of an output axis, computed alone from that
    slice of the weight and bias (and of the adapter's ``lora_b``)."""
    weight, bias = layer.weight * layer.reparam.active_scale, layer.bias
    if select is not None:
        weight, bias = weight[select], None if bias is None else bias[select]
    out = hax.auto_sharded(token_dot(x, weight, layer.In, dot_general=token_dot_kernel(layer)))
    if bias is not None:
        out = hax.auto_sharded(out + bias)
    adapted = lora_adapter(layer)  # a LoRA adapter: two thin products beside
    if adapted is not None:
        lora_a = adapted.lora_a
        lora_b = adapted.lora_b if select is None else adapted.lora_b[select]
        low = token_dot(token_dot(x, lora_a, layer.In), lora_b, lora_a.axes[-1])
        out = hax.auto_sharded(out + low * adapted.lora_scale)
    return out

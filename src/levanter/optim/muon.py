"""Muon (``optimizer: {type: muon}``): orthogonalised momentum for the linear layers' weights, AdamW for the rest.

Muon (Jordan et al. 2024) replaces each weight matrix's momentum ``M`` by an approximation of its
orthogonal factor ``U V^T`` (``M = U S V^T``), computed with a few Newton-Schulz iterations
(``backend_steps``), and scales it by ``sqrt(max(1, fan_out / fan_in))`` (or, with ``use_kimi_scaling``,
by ``0.2 sqrt(max(fan_in, fan_out))``, which gives updates of AdamW's size). The orthogonalisation is
:func:`optax.contrib.scale_by_muon`; this module decides which parameters get it and how they become
matrices, and builds the two groups' schedules, decay and clipping.

Which parameters (as upstream Levanter): the ``weight`` of every ``haliax.nn.Linear`` except the output
head (a field named ``lm_head``, or a Linear onto the ``vocab`` axis); embeddings (also GPT-2's tied output projection), biases, norms' scales
and everything else go to AdamW with ``adam_lr``.

How a named weight becomes a matrix (as upstream, which flattens a Linear's articulated axes): the axes of
the layer's ``In`` are flattened into the matrix's input (reduction) side, those of its ``Out`` into its
output side, and every other axis of the weight (the ``layers`` axis of a scanned stack) is a batch axis:
each layer's matrix is orthogonalised on its own. So GPT-2's ``c_attn`` (embed -> qkv x heads x head_size)
is one ``embed x (3 heads head_size)`` matrix per layer, and an attention output projection
(heads x head_size -> embed) one ``(heads head_size) x embed`` matrix. A mixture of experts' expert axis is
part of ``In`` or ``Out`` and so is flattened too, not treated per expert.

Schedules: the matrices' rate follows ``learning_rate`` and AdamW's ``adam_lr``, both with the configured
warmup and decay. Upstream's ``lr`` field is not read by upstream either (its Muon rate comes from
``learning_rate``); it parses at its default and is refused when set. Weight decay applies to matrices in
both groups (as our AdamW). ``max_grad_norm`` clips the AdamW group's gradient by that group's own global
norm (as upstream); Muon's updates are normalised anyway.

Differences from upstream: optax keeps the momentum as an average (``beta m + (1 - beta) g``, bias-corrected)
where upstream sums (``momentum m + g``); the Newton-Schulz step normalises its input, so the directions
agree up to the first steps' bias correction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import haliax as hax
import haliax.nn as hnn
import jax
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from ..refused_keys import refused
from .config import OptimizerConfig, decay_mask

__all__ = ["MuonConfig", "muon_labels", "muon_dimension_numbers"]

_HEAD_NAMES = ("lm_head",)


def _is_linear(x) -> bool:
    return isinstance(x, hnn.Linear)


def _path_names(path) -> list[str]:
    return [str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path]


def _is_head(path, layer: hnn.Linear) -> bool:
    # Upstream goes by the name; the vocabulary axis catches a head under another name.
    outs = (layer.Out,) if isinstance(layer.Out, (hax.Axis, str)) else layer.Out
    return any(n in _HEAD_NAMES for n in _path_names(path)) or any(
        (a.name if isinstance(a, hax.Axis) else a) == "vocab" for a in outs
    )


def muon_labels(params):
    """``"muon"`` for every Linear's weight outside the output head, ``"adam"`` for everything else (a tree
    shaped like ``params``, for :func:`optax.multi_transform`)."""

    def label(path, node):
        if _is_linear(node) and not _is_head(path, node):
            return dataclasses.replace(node, weight="muon", bias=None if node.bias is None else "adam")
        return jax.tree.map(lambda _: "adam", node, is_leaf=lambda x: isinstance(x, hax.NamedArray))

    return jax.tree_util.tree_map_with_path(
        label, params, is_leaf=lambda x: _is_linear(x) or isinstance(x, hax.NamedArray)
    )


def _axis_indices(weight: hax.NamedArray, spec) -> tuple[int, ...]:
    names = {a.name if isinstance(a, hax.Axis) else a for a in ((spec,) if isinstance(spec, (hax.Axis, str)) else spec)}
    return tuple(i for i, a in enumerate(weight.axes) if a.name in names)


def _dims(layer: hnn.Linear) -> MuonDimensionNumbers:
    w = layer.weight
    return MuonDimensionNumbers(reduction_axis=_axis_indices(w, layer.In), output_axis=_axis_indices(w, layer.Out))


def muon_dimension_numbers(updates):
    """For each Linear weight in ``updates``, how it becomes matrices: its ``In`` axes are the reduction side,
    its ``Out`` axes the output side, the rest batch axes (a tree for ``scale_by_muon``'s
    ``weight_dimension_numbers``; other leaves are left as they are, being masked out of Muon's group)."""

    def for_node(node):
        if not _is_linear(node) or not isinstance(node.weight, hax.NamedArray):
            return node
        dims = _dims(node)
        w = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(node.weight), [dims])
        return dataclasses.replace(node, weight=w)

    return jax.tree.map(for_node, updates, is_leaf=_is_linear)


def _scale_by_shape(use_kimi_scaling: bool) -> optax.GradientTransformation:
    """Muon's per-matrix size factor: ``sqrt(max(1, fan_out / fan_in))``, or Kimi's ``0.2 sqrt(max(fan_in,
    fan_out))``."""

    def factor(layer: hnn.Linear) -> float:
        d = _dims(layer)
        fan_in = math.prod(layer.weight.array.shape[i] for i in d.reduction_axis)
        fan_out = math.prod(layer.weight.array.shape[i] for i in d.output_axis)
        return 0.2 * math.sqrt(max(fan_in, fan_out)) if use_kimi_scaling else math.sqrt(max(1.0, fan_out / fan_in))

    def update(updates, state, params=None):
        def for_node(node):
            if not _is_linear(node) or not isinstance(node.weight, hax.NamedArray):
                return node
            return dataclasses.replace(node, weight=node.weight * factor(node))

        return jax.tree.map(for_node, updates, is_leaf=_is_linear), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


_LR_NOT_READ = (
    "upstream's Muon takes the matrices' learning rate from learning_rate and never reads lr; set "
    "learning_rate (and adam_lr for the other parameters) instead"
)


@OptimizerConfig.register_subclass("muon")
@dataclasses.dataclass(frozen=True)
class MuonConfig(OptimizerConfig):
    """Muon: Newton-Schulz-orthogonalised momentum for linear layers' weights, AdamW for the other
    parameters (levanter.optim.muon); learning_rate is the matrices' peak rate, adam_lr the others'."""

    # Upstream's unread Muon rate; accepted at its default, refused if set (use learning_rate).
    lr: float = refused(_LR_NOT_READ, default=0.02)
    # Peak learning rate of the AdamW group (embeddings, output head, biases, norms), on the same schedule.
    adam_lr: float = 6e-4
    # Muon's momentum decay, in [0, 1).
    momentum: float = 0.95
    # Nesterov momentum for Muon's group.
    nesterov: bool = True
    # Newton-Schulz iterations per orthogonalisation (at least 1; 5 is usual).
    backend_steps: int = 5
    # Decoupled weight decay on matrices (both groups).
    weight_decay: float = 0.0
    # AdamW group's first-moment decay, in [0, 1).
    beta1: float = 0.9
    # AdamW group's second-moment decay, in [0, 1).
    beta2: float = 0.95
    # AdamW group's epsilon (positive).
    epsilon: float = 1e-8
    # Added to the momentum's norm before the Newton-Schulz iterations divide by it (positive).
    muon_epsilon: float = 1e-8
    # Clip the AdamW group's gradient to this global L2 norm; null: no clipping.
    max_grad_norm: Optional[float] = 1.0
    # Scale Muon's updates by 0.2 sqrt(max(fan_in, fan_out)) (AdamW-sized, Kimi's rule) instead of
    # sqrt(max(1, fan_out / fan_in)); then use AdamW-like learning_rate and weight_decay.
    use_kimi_scaling: bool = False

    def __post_init__(self):
        super().__post_init__()
        for name in ("momentum", "beta1", "beta2"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {v}")
        for name in ("epsilon", "muon_epsilon"):
            v = getattr(self, name)
            if v <= 0:
                raise ValueError(f"optimizer.{name} must be positive, got {v}: it keeps a zero gradient's update "
                                 "from being 0/0 = NaN (1e-8 is usual)")
        if self.adam_lr < 0:
            raise ValueError(f"optimizer.adam_lr must be non-negative, got {self.adam_lr}")
        if isinstance(self.backend_steps, bool) or not isinstance(self.backend_steps, int) or self.backend_steps < 1:
            raise ValueError(f"optimizer.backend_steps must be a whole number >= 1, got {self.backend_steps!r}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"optimizer.max_grad_norm must be positive or null, got {self.max_grad_norm}")

    def build(self, num_train_steps: int) -> optax.GradientTransformation:
        muon_rate = self.lr_scheduler(num_train_steps)
        adam_rate = dataclasses.replace(self, learning_rate=self.adam_lr).lr_scheduler(num_train_steps)
        decay = [optax.add_decayed_weights(self.weight_decay, mask=decay_mask)] if self.weight_decay > 0 else []
        muon = optax.chain(
            scale_by_muon(
                ns_steps=self.backend_steps, beta=self.momentum, eps=self.muon_epsilon, nesterov=self.nesterov,
                weight_dimension_numbers=muon_dimension_numbers,
            ),
            _scale_by_shape(self.use_kimi_scaling),
            *decay,
            optax.scale_by_learning_rate(muon_rate),
        )
        clip = [optax.clip_by_global_norm(self.max_grad_norm)] if self.max_grad_norm is not None else []
        adam = optax.chain(
            *clip,
            optax.scale_by_adam(b1=self.beta1, b2=self.beta2, eps=self.epsilon),
            *decay,
            optax.scale_by_learning_rate(adam_rate),
        )
        return self.with_step_skipping(optax.multi_transform({"muon": muon, "adam": adam}, muon_labels))


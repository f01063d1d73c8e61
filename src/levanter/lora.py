"""LoRA: low-rank adapters on a model's linear layers, the rest of the model fixed.

:func:`loraize` turns the linear layers that ``LoraConfig.target_modules`` selects into :class:`LoraLinear`
layers: the same layer (its weight, bias and kernel, under the same names, so checkpoints and Hugging Face
weights still find them) plus two factors ``lora_a [In, lora_r]`` and ``lora_b [lora_r, Out]``. The layer
computes ``W x + b + (alpha / r) * (x . lora_a) . lora_b``; ``lora_b`` starts at zero, so a freshly
loraized model computes exactly what the base model does. Training only the factors
(:func:`lora_trainable`, the trainer's ``is_trainable``) fits a model to new data with a small fraction of
its parameters and their optimizer state. :func:`merge_lora` folds the factors back into the weights: the
merged model is a plain model of the same architecture, which exports like any other.

Upstream Levanter's names and semantics: ``target_modules`` is a regular expression matched at the start of
each layer's dotted path, a list of names a path ends with, or null for every linear layer; ``r`` the rank;
``alpha`` the scale's numerator. The factors are named arrays over the layer's own axes, so they shard
like its weight, and per-layer factors of stacked layers carry the ``layers`` axis like every other
per-layer array. Trade-offs: the factors are applied beside the layer's product (two extra thin products
per layer, forward and backward) rather than merged into it, which keeps the base weights untouched and
exactly recoverable; LoRA dropout is not built (``dropout`` other than 0 is refused), and a layer that
already computes through a quantized kernel (``trainer.quantization``'s fp8 state, built into the model) is
refused rather than adapted. The output projection of models with an untied ``lm_head`` is left alone: the
loss reads its weight directly, so an adapter there would never run.
"""

from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Union

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
from jax.tree_util import GetAttrKey

from .models.token_dot import linear
from .utils.layer_select import check_layer_regex, dotted_path, linear_layer_paths

__all__ = ["LORA_R", "LoraConfig", "LoraLinear", "check_checkpoint_lora", "loraize", "lora_from_record",
           "join_adapters", "lora_layer_paths", "lora_record", "lora_trainable", "merge_lora", "split_adapters"]

LORA_R = "lora_r"  # the factors' rank axis


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the linear layers (levanter.lora): which layers, the rank and the scale."""

    # Layers to adapt: a regex matched at the start of each linear layer's dotted path (e.g. '.*attn.*'), a
    # list of names the path ends with (e.g. [q_proj, v_proj]), or null for every linear layer.
    target_modules: Optional[Union[List[str], str]] = None
    # The rank of each adapter (the size of the lora_r axis).
    r: int = 8
    # The adapters' output is scaled by alpha / r.
    alpha: float = 8.0
    # Dropout on the adapters' input; only 0 is built.
    dropout: float = 0.0

    def check(self, key: str = "lora") -> None:
        """Raise ValueError naming ``<key>.<field>`` for a setting that cannot be honoured."""
        if self.r < 1:
            raise ValueError(f"{key}.r={self.r} must be at least 1 (the rank of each adapter)")
        if self.dropout != 0:
            raise ValueError(
                f"{key}.dropout={self.dropout} is not supported: LoRA dropout is not built here; set {key}.dropout: 0"
            )
        check_layer_regex(self.target_modules, f"{key}.target_modules")

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def matches(self, path: str) -> bool:
        """Whether the linear layer at dotted ``path`` gets an adapter."""
        if self.target_modules is None:
            return True
        if isinstance(self.target_modules, str):
            return re.match(self.target_modules, path) is not None
        return any(path.endswith(name) for name in self.target_modules)


class LoraLinear(hnn.Linear):
    """A linear layer with a low-rank adapter: ``W x + b + lora_scale * (x . lora_a) . lora_b``. Its weight,
    bias and kernel are the base layer's, under the same names."""

    lora_a: Optional[hax.NamedArray] = None  # [In..., lora_r]
    lora_b: Optional[hax.NamedArray] = None  # [lora_r, Out...]
    lora_scale: float = eqx.field(static=True, default=1.0)

    def __call__(self, inputs, *, key=None):
        return linear(self, inputs)

    def merged(self) -> hnn.Linear:
        """The plain layer whose weight includes the adapter's product (in the weight's dtype)."""
        delta = hax.dot(self.lora_a, self.lora_b, axis=LORA_R) * self.lora_scale
        weight = (self.weight + delta.rearrange(self.weight.axes)).astype(self.weight.dtype)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(hnn.Linear)}  # the base layer's own
        return hnn.Linear(**{**fields, "weight": weight})


def _axes(spec) -> tuple:
    return (spec,) if isinstance(spec, hax.Axis) else tuple(spec)


def _is_layer(node) -> bool:
    return isinstance(node, (hnn.Linear, hnn.Stacked))


def loraize(model, config: LoraConfig, *, key: jax.Array):
    """``model`` with an adapter on each linear layer ``config`` selects (``lora_a`` drawn from a truncated
    normal of standard deviation 1/sqrt(fan-in), ``lora_b`` zero: the model computes what it did). Raises
    ValueError naming ``lora.target_modules`` when they select no layer, and refuses layers that already
    compute through a quantized kernel (``trainer.quantization``)."""
    config.check()
    counter = iter(range(1 << 30))

    def adapt(prefix: tuple, blocks: tuple, path, node):
        path = prefix + path
        if isinstance(node, hnn.Stacked):
            inner = jax.tree_util.tree_map_with_path(
                lambda p, m: adapt(path + (GetAttrKey("stacked"),), blocks + (node.Block,), p, m),
                node.stacked, is_leaf=_is_layer)
            return dataclasses.replace(node, stacked=inner)
        if not isinstance(node, hnn.Linear) or isinstance(node, LoraLinear) or not config.matches(dotted_path(path)):
            return node
        if path == (GetAttrKey("lm_head"),):
            return node  # the loss reads the output projection's weight directly: an adapter there would not run
        if not isinstance(node.dot_general, hax.quantization.DefaultDotGeneralOp):
            raise ValueError(
                f"lora: the layer {dotted_path(path)} computes through a quantized kernel (trainer.quantization): LoRA "
                "and quantized training are not built together; remove trainer.quantization"
            )
        R = hax.Axis(LORA_R, config.r)
        In, Out = _axes(node.In), _axes(node.Out)
        fan_in = 1
        for a in In:
            fan_in *= a.size
        layer_key = jax.random.fold_in(key, next(counter))
        a = hax.random.truncated_normal(layer_key, (*blocks, *In, R), -2, 2) * (fan_in ** -0.5)
        b = hax.zeros((*blocks, R, *Out), dtype=a.dtype)
        fields = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
        return LoraLinear(**fields, lora_a=a.astype(node.weight.dtype), lora_b=b.astype(node.weight.dtype),
                          lora_scale=config.scale)

    adapted = jax.tree_util.tree_map_with_path(lambda p, m: adapt((), (), p, m), model, is_leaf=_is_layer)
    if not lora_layer_paths(adapted):
        raise ValueError(
            f"lora.target_modules={config.target_modules!r} matches none of the model's linear layers: give layer "
            "names (e.g. q_proj, v_proj, c_attn) or a regex over their dotted paths (e.g. '.*attn.*'), or remove "
            "target_modules to adapt every linear layer"
        )
    return adapted


def lora_layer_paths(model) -> list[str]:
    """The dotted paths of ``model``'s layers that carry an adapter."""
    return linear_layer_paths(model, lambda layer: isinstance(layer, LoraLinear))


def lora_trainable(model) -> object:
    """The filter spec that trains the adapters' factors and nothing else (the trainer's ``is_trainable``)."""
    spec = jax.tree.map(lambda _: False, model)

    def mark(node):
        if isinstance(node, LoraLinear):
            return dataclasses.replace(node, lora_a=True, lora_b=True)
        return node

    return jax.tree.map(mark, spec, is_leaf=lambda x: isinstance(x, LoraLinear))


def merge_lora(model):
    """``model`` with every adapter folded into its layer's weight: a plain model of the same architecture."""
    return jax.tree.map(lambda n: n.merged() if isinstance(n, LoraLinear) else n, model,
                        is_leaf=lambda x: isinstance(x, LoraLinear))



def split_adapters(model) -> tuple:
    """``(adapters, base)``: the adapters' factors, ``(lora_a, lora_b)`` of each adapted layer in tree order, and
    the model without them (``lora_a`` and ``lora_b`` None), which holds exactly the tensors of the base model
    (a Hugging Face checkpoint is loaded into it). :func:`join_adapters` puts them back."""
    found = []

    def strip(node):
        if isinstance(node, LoraLinear):
            found.append((node.lora_a, node.lora_b))
            return dataclasses.replace(node, lora_a=None, lora_b=None)
        return node

    base = jax.tree.map(strip, model, is_leaf=lambda x: isinstance(x, LoraLinear))
    return found, base


def join_adapters(base, adapters: list):
    """``base`` (from :func:`split_adapters`) with the factors ``adapters`` put back, in tree order."""
    it = iter(adapters)

    def fill(node):
        if isinstance(node, LoraLinear):
            a, b = next(it)
            return dataclasses.replace(node, lora_a=a, lora_b=b)
        return node

    return jax.tree.map(fill, base, is_leaf=lambda x: isinstance(x, LoraLinear))


_RECORD_KEYS = ("target_modules", "r", "alpha")


def lora_record(config: Optional[LoraConfig]) -> dict:
    """What a checkpoint records of a LoRA run (``{"lora": {...}}``; nothing otherwise): the settings that shape
    its adapters, so that a reader of the checkpoint can rebuild the model it holds."""
    if config is None:
        return {}
    return {"lora": {k: getattr(config, k) for k in _RECORD_KEYS}}


def lora_from_record(record: dict) -> Optional[LoraConfig]:
    """The LoRA settings a checkpoint's metadata records (:func:`lora_record`), or None for a run without."""
    lora = record.get("lora")
    return None if lora is None else LoraConfig(**{k: lora[k] for k in _RECORD_KEYS if k in lora})


def check_checkpoint_lora(record: dict, config: Optional[LoraConfig], where: str) -> None:
    """Before any work: raise ValueError naming ``lora`` when the checkpoint whose metadata is ``record``
    (described by ``where``) holds adapters other than this run's settings would build (or none where this run
    has some, or the reverse): its arrays could not be restored into this run's model, or would be put to
    another use (alpha scales what the factors compute)."""
    theirs, mine = record.get("lora"), lora_record(config).get("lora")
    if theirs is not None and isinstance(theirs.get("target_modules"), tuple):
        theirs = {**theirs, "target_modules": list(theirs["target_modules"])}
    if mine is not None and isinstance(mine.get("target_modules"), tuple):
        mine = {**mine, "target_modules": list(mine["target_modules"])}
    if theirs == mine:
        return

    def say(lora):
        return "no LoRA adapters" if lora is None else "lora " + ", ".join(f"{k}={lora.get(k)!r}" for k in _RECORD_KEYS)

    raise ValueError(
        f"{where} was written with {say(theirs)}, but this run has {say(mine)}: a checkpoint is resumed only with "
        "the adapters it holds. Set lora as in the run that wrote it, or start a new run (another trainer.id)"
    )

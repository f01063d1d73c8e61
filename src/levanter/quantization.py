"""``trainer.quantization``: int8 training of the linear layers, through haliax's quantization support.

Upstream Levanter's section, with its keys: ``int8: true`` computes every linear layer's matrix products
(forward and both backward products) in int8 with haliax's ``Int8DotGeneralOp`` (Google's AQT, per-axis
absolute-max scales, int32 accumulation); ``targets`` limits that to the layers named (a list of layer
names such as ``[c_fc, c_proj]``, or a regular expression matched against the dotted path of each layer,
e.g. ``.*mlp.*``); ``fp8: true`` is upstream's fp8 training.

How it is applied here: the parameters stay in their own dtype (float32, or what ``trainer.mp`` says) and
are what the optimizer updates and checkpoints hold; the loss function quantizes the model's linear
layers each time it is traced (:func:`quantize`), so the step, its gradients and evaluation run through
the int8 kernels while the stored state is exactly that of an unquantized run. The trade-offs: a
checkpoint moves freely between quantized and unquantized runs, and int8 adds no state (AQT's int8 keeps
none); the embedding and the output projection (not ``Linear`` layers here) stay in the compute dtype, as
upstream's do. Whether int8 is faster depends on the hardware's int8 matrix units (TPU v5e has them; on
CPU it is a numerics simulation, slower than float32).

fp8 is refused, naming the key, before any work: fp8 training keeps per-layer scale histories that must
be overwritten from the gradient each step (haliax's ``OverwriteWithGradient``), which this trainer does not
carry, and CPUs and TPUs up to v5e have no fp8 matrix units in any case.
"""

from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Union

import jax
from jax.tree_util import GetAttrKey

import haliax.nn as hnn
import haliax.quantization as hq

@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """int8 training: the model's linear layers compute their products in int8, forward and backward; the
    parameters, optimizer state and checkpoints stay as they are (levanter.quantization)."""

    # Compute the linear layers' matrix products in int8 (haliax's AQT int8 kernel), forward and backward.
    int8: bool = False
    # Upstream's fp8 training; refused (no fp8 scale state is kept, and CPUs and TPU v5e lack fp8 units).
    fp8: bool = False
    # Layers to quantize: a list of layer names (e.g. [c_fc, c_proj]) or a regex over the dotted layer
    # path (e.g. .*mlp.*); null: every linear layer.
    targets: Optional[Union[List[str], str]] = None
    # fp8 only (upstream): the length of the scale history; refused unless fp8 were on.
    amax_history_length: int = 1024
    # fp8 only (upstream): the dtype the fp8 products are computed in; refused unless fp8 were on.
    compute_dtype: Optional[str] = None

    def check(self, platform: str) -> None:
        """Raise ValueError naming the key for a setting that cannot be honoured on ``platform``."""
        if self.fp8:
            raise ValueError(
                f"trainer.quantization.fp8=true is not supported: fp8 training keeps per-layer scale histories "
                f"that this trainer does not carry between steps, and this platform ({platform!r}) has no fp8 "
                "matrix units (neither CPUs nor TPUs up to v5e do). Use trainer.quantization.int8: true for "
                "quantized training, or remove trainer.quantization"
            )
        if self.amax_history_length != 1024 or self.compute_dtype is not None:
            key = "amax_history_length" if self.amax_history_length != 1024 else "compute_dtype"
            raise ValueError(
                f"trainer.quantization.{key} applies to fp8 only, which is not built here: remove the key"
            )
        if isinstance(self.targets, str):
            try:
                re.compile(self.targets)
            except re.error as e:
                raise ValueError(
                    f"trainer.quantization.targets={self.targets!r} is not a valid regular expression ({e}): give "
                    "a regex over the dotted layer path (e.g. '.*mlp.*') or a list of layer names"
                ) from None
        if self.targets is not None and not self.int8:
            raise ValueError(
                "trainer.quantization.targets is set but int8 is not: the targets would quantize nothing; "
                "set trainer.quantization.int8: true or remove targets"
            )

    @property
    def enabled(self) -> bool:
        return self.int8


def _haliax_config(config: QuantizationConfig) -> hq.QuantizationConfig:
    targets = list(config.targets) if isinstance(config.targets, (list, tuple)) else config.targets
    return hq.QuantizationConfig(targets=targets, int8=config.int8)


def quantized_layer_paths(model) -> list[str]:
    """The dotted paths of ``model``'s linear layers that compute in int8 (their ``dot_general`` is haliax's
    ``Int8DotGeneralOp``)."""
    found = []

    def visit(path, node):
        if isinstance(node, hnn.Linear) and isinstance(node.dot_general, hq.Int8DotGeneralOp):
            found.append(".".join(k.name if isinstance(k, GetAttrKey) else str(getattr(k, "key", k)) for k in path))
        return node

    jax.tree_util.tree_map_with_path(visit, model, is_leaf=lambda x: isinstance(x, hnn.Linear))
    return found


def quantize(model, config: Optional[QuantizationConfig]):
    """``model`` with the linear layers ``config`` selects computing in int8; unchanged when ``config`` is
    None or off. Raises ValueError naming ``trainer.quantization.targets`` when they select no layer (a
    run that silently quantized nothing would report int8 training it never did)."""
    if config is None or not config.enabled:
        return model
    quantized = hq.quantize_linear_layers(model, _haliax_config(config))
    if not quantized_layer_paths(quantized):
        raise ValueError(
            f"trainer.quantization.targets={config.targets!r} matches none of the model's linear layers: give "
            "layer names (e.g. c_fc, q_proj, down_proj) or a regex over their dotted paths (e.g. '.*mlp.*'), "
            "or remove targets to quantize every linear layer"
        )
    return quantized


__all__ = ["QuantizationConfig", "quantize", "quantized_layer_paths"]

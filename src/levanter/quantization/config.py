"""``trainer.quantization``: int8 or fp8 training of the linear layers.

Upstream Levanter's section, with its keys: ``int8: true`` computes every linear layer's matrix products in
int8 (the forward product and the input's gradient; the weight's gradient stays in the compute dtype, as in
upstream's AQT configuration) with the project's kernels (:mod:`.int8`: per-token and per-output absolute-max
scales, int32 accumulation; on a TPU, each layer in int8 only where it measured faster at start-up, the others
kept in the compute dtype and logged); ``fp8: true`` computes them through float8 with haliax's
``Fp8DotGeneralOp`` (e4m3 for activations and weights, e5m2 for the output gradient, delayed scaling from
a history of the last ``amax_history_length`` absolute maxima); ``targets`` limits either to the layers named
(a list of layer names such as ``[c_fc, c_proj]``, or a regular expression matched against the dotted path
of each layer, e.g. ``.*mlp.*``).

How int8 is applied: the parameters stay in their own dtype (float32, or what ``trainer.mp`` says) and
are what the optimizer updates and checkpoints hold; the loss function quantizes the model's linear
layers each time it is traced (:func:`quantize`), so the step, its gradients and evaluation run through
the int8 kernels while the stored state is exactly that of an unquantized run. The trade-offs: a
checkpoint moves freely between quantized and unquantized runs, and int8 adds no state (its kernel keeps
none); the embedding and the output projection stay in the compute dtype, as upstream's do (an untied
``lm_head`` is a linear layer, but the loss reads its weight directly, so it keeps the plain kernel and, under
fp8, no state). Whether int8 is faster depends on the hardware's int8 matrix units (TPU v5e has them; on
CPU it is a numerics simulation, slower than float32).

How fp8 is applied: its scales and amax histories are state that each step computes in its backward pass
and the next step reads, so they live in the model from the moment it is built (:func:`with_fp8`), are
checkpointed with it, and the trainer overwrites them with what the backward pass returns for them instead
of handing them to the optimizer (haliax's ``OverwriteWithGradient``; :mod:`levanter.training`). A checkpoint
of an fp8 run therefore holds that state and resumes only as an fp8 run with the same layers and history
length; its weights export to Hugging Face as any other run's. The products are quantized and dequantized
around a matrix product in the compute dtype (haliax's scheme): on hardware with fp8 matrix units XLA may
fuse that into an fp8 product; CPUs and TPUs up to v5e have none, so there it simulates fp8's numerics and
is slower than plain training.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp

import haliax.nn as hnn
import haliax.quantization as hq

from ..utils.layer_select import check_layer_regex, dotted_path, linear_layer_paths
from .int8 import Int8DotGeneral

@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """int8 training: the model's linear layers compute their products in int8, forward and backward; the
    parameters, optimizer state and checkpoints stay as they are (levanter.quantization)."""

    # Compute the linear layers' forward and input-gradient products in int8 (on a TPU, the layers that
    # measured faster at start-up; logged).
    int8: bool = False
    # Compute the linear layers' matrix products through float8 with delayed scaling (haliax's fp8 kernel);
    # its scales and histories are kept in the model and checkpointed. A simulation on CPUs and TPUs up to v5e.
    fp8: bool = False
    # Layers to quantize: a list of layer names (e.g. [c_fc, c_proj]) or a regex over the dotted layer
    # path (e.g. .*mlp.*); null: every linear layer.
    targets: Optional[Union[List[str], str]] = None
    # fp8 only: how many steps' absolute maxima each scale is computed from.
    amax_history_length: int = 1024
    # fp8 only: the dtype the dequantized products are computed in (e.g. bfloat16); null: the weights' dtype.
    compute_dtype: Optional[str] = None

    def check(self, platform: str) -> None:
        """Raise ValueError naming the key for a setting that cannot be honoured on ``platform``."""
        if self.fp8 and self.int8:
            raise ValueError(
                "trainer.quantization.fp8 and trainer.quantization.int8 are both true: a layer computes in one of "
                "them; set one to false"
            )
        if not self.fp8 and (self.amax_history_length != 1024 or self.compute_dtype is not None):
            key = "amax_history_length" if self.amax_history_length != 1024 else "compute_dtype"
            raise ValueError(
                f"trainer.quantization.{key} applies to fp8 only, and fp8 is not on: set "
                "trainer.quantization.fp8: true or remove the key"
            )
        if self.amax_history_length < 1:
            raise ValueError(
                f"trainer.quantization.amax_history_length={self.amax_history_length} must be at least 1 (the "
                "number of steps' absolute maxima a scale is computed from)"
            )
        if self.compute_dtype is not None:
            _float_dtype(self.compute_dtype)
        check_layer_regex(self.targets, "trainer.quantization.targets")
        if self.targets is not None and not (self.int8 or self.fp8):
            raise ValueError(
                "trainer.quantization.targets is set but neither int8 nor fp8 is: the targets would quantize "
                "nothing; set trainer.quantization.int8: true (or fp8: true) or remove targets"
            )

    @property
    def enabled(self) -> bool:
        """Whether the loss quantizes the model as it is traced (int8; fp8's state is in the model itself)."""
        return self.int8


def _float_dtype(name: str):
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        raise ValueError(
            f"trainer.quantization.compute_dtype={name!r} is not a float dtype of 16 or more bits: give e.g. "
            "bfloat16 or float32, or remove the key to compute in the weights' dtype"
        )
    return dtype


def _haliax_config(config: QuantizationConfig) -> hq.QuantizationConfig:
    targets = list(config.targets) if isinstance(config.targets, (list, tuple)) else config.targets
    if config.fp8:
        dtype = None if config.compute_dtype is None else _float_dtype(config.compute_dtype)
        return hq.QuantizationConfig(targets=targets, fp8=True, amax_history_length=config.amax_history_length,
                                     compute_dtype=dtype)
    return hq.QuantizationConfig(targets=targets, int8=config.int8)


def quantized_layer_paths(model) -> list[str]:
    """The dotted paths of ``model``'s linear layers that compute in int8 or fp8 (their ``dot_general`` is
    :class:`~.int8.Int8DotGeneral` or haliax's ``Fp8DotGeneralOp``)."""
    kernels = (Int8DotGeneral, hq.Fp8DotGeneralOp)
    return linear_layer_paths(model, lambda layer: isinstance(layer.dot_general, kernels))


def quantize(model, config: Optional[QuantizationConfig]):
    """``model`` with the linear layers ``config`` selects computing in int8; unchanged when ``config`` is
    None or off. Raises ValueError naming ``trainer.quantization.targets`` when they select no layer (a
    run that silently quantized nothing would report int8 training it never did)."""
    if config is None or not config.enabled:
        return model
    return _quantized(model, config)


def with_fp8(model, config: Optional[QuantizationConfig]):
    """``model`` with the linear layers ``config`` selects computing through fp8, each with its fresh scales
    and amax histories (part of the model from here on: trained, checkpointed, restored); unchanged when
    ``config`` is None or fp8 is off. Raises ValueError naming ``trainer.quantization.targets`` when they
    select no layer."""
    if config is None or not config.fp8:
        return model
    return _quantized(model, config)


def _without_head_kernel(model):
    """``model`` with its output projection (an untied ``lm_head`` layer) back on the plain kernel: the loss
    reads that weight directly (``get_lm_head``, the blockwise loss), so a kernel there would never run, and
    fp8 would keep a state that no step writes."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, hnn.Linear) and not isinstance(head.dot_general, hq.DefaultDotGeneralOp):
        model = eqx.tree_at(lambda m: m.lm_head.dot_general, model, hq.DefaultDotGeneralOp.init())
    return model


_FP8_KEYS = ("targets", "amax_history_length", "compute_dtype")


def fp8_record(config: Optional[QuantizationConfig]) -> dict:
    """What a checkpoint records of an fp8 run (``{"fp8": {...}}``; nothing otherwise): the settings that
    shape its layers' fp8 state, so that a reader of the checkpoint can rebuild the model it holds."""
    if config is None or not config.fp8:
        return {}
    return {"fp8": {k: getattr(config, k) for k in _FP8_KEYS}}


def fp8_from_record(record: dict) -> Optional[QuantizationConfig]:
    """The fp8 settings a checkpoint's metadata records (:func:`fp8_record`), or None for a run without fp8."""
    fp8 = record.get("fp8")
    return None if fp8 is None else QuantizationConfig(fp8=True, **{k: fp8[k] for k in _FP8_KEYS if k in fp8})


def check_checkpoint_fp8(record: dict, config: Optional[QuantizationConfig], where: str) -> None:
    """Before any work: raise ValueError naming ``trainer.quantization`` when the checkpoint whose metadata is
    ``record`` (described by ``where``) holds fp8 state other than this run's settings would build (or none
    where this run keeps some, or the reverse): its arrays could not be restored into this run's model."""
    theirs, mine = record.get("fp8"), fp8_record(config).get("fp8")
    if theirs == mine:
        return

    def say(fp8):
        return "fp8 off" if fp8 is None else "fp8 on (" + ", ".join(f"{k}={fp8.get(k)!r}" for k in _FP8_KEYS) + ")"

    raise ValueError(
        f"{where} was written with trainer.quantization {say(theirs)}, but this run has {say(mine)}: an fp8 "
        "run's checkpoint holds its layers' fp8 scales and histories, so it is restored only by a run with the "
        "same fp8 settings. Set trainer.quantization as in the run that wrote it"
    )


def _quantized(model, config: QuantizationConfig):
    quantized = _without_head_kernel(hq.quantize_linear_layers(model, _haliax_config(config)))
    if config.int8:
        # haliax marks the selected layers with its AQT kernel; each computes through ours instead, named (without
        # its block's index) for the log of which of its products run in int8.
        def ours(path, node):
            if not isinstance(node, hq.Int8DotGeneralOp):
                return node
            name = ".".join(p for p in dotted_path(path).split(".")[:-1] if not p.isdigit())
            return Int8DotGeneral(layer=name)

        quantized = jax.tree_util.tree_map_with_path(ours, quantized,
                                                     is_leaf=lambda n: isinstance(n, hq.Int8DotGeneralOp))
    if not quantized_layer_paths(quantized):
        raise ValueError(
            f"trainer.quantization.targets={config.targets!r} matches none of the model's linear layers: give "
            "layer names (e.g. c_fc, q_proj, down_proj) or a regex over their dotted paths (e.g. '.*mlp.*'), "
            "or remove targets to quantize every linear layer"
        )
    return quantized


__all__ = ["QuantizationConfig", "check_checkpoint_fp8", "fp8_from_record", "fp8_record", "quantize", "quantized_layer_paths", "with_fp8"]

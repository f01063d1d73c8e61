"""Building blocks the architectures share: activation functions by config name, the config checks
that name the offending ``model.*`` key, and normal-initialised linear and embedding layers."""

from __future__ import annotations

import math
from typing import Callable

import haliax as hax
import haliax.nn as hnn
from haliax import Axis, NamedArray

ACTIVATIONS: dict[str, Callable[[NamedArray], NamedArray]] = {
    "gelu_new": lambda x: hnn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: hnn.gelu(x, approximate=True),
    "gelu": lambda x: hnn.gelu(x, approximate=False),
    "quick_gelu": hnn.quick_gelu,
    "relu": hnn.relu,
    "silu": hnn.silu,
    "swish": hnn.silu,
}


def check_positive(config, *names: str) -> None:
    """Refuse a config whose fields ``names`` are not all positive, naming the first that is not."""
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ValueError(f"model.{name} must be positive, got {value}")


def check_activation(name: str) -> None:
    """Refuse an ``activation_function`` that is not one of :data:`ACTIVATIONS`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"model.activation_function {name!r} is not one of {sorted(ACTIVATIONS)}")


def normal_linear(In, Out, *, std: float, use_bias: bool, key) -> hnn.Linear:
    """A haliax Linear whose weight is (truncated at 3 sigma) normal with standard deviation ``std``."""
    # Linear.init draws truncated_normal * init_scale / sqrt(|In|); undo the fan-in factor.
    return hnn.Linear.init(In, Out, key=key, use_bias=use_bias, init_scale=std * math.sqrt(hax.axis_size(In)))


def normal_embedding(Vocab: Axis, Embed: Axis, *, std: float, key) -> hnn.Embedding:
    weight = hax.random.truncated_normal(key, (Vocab, Embed), -3, 3) * std
    return hnn.Embedding(weight=weight, Vocab=Vocab, Embed=Embed)

"""Building blocks the architectures share: activation functions by config name, the config checks
that name the offending ``model.*`` key, the remat policies ``gradient_checkpointing`` names, and
normal-initialised linear and embedding layers."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Union

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name

import haliax as hax
import haliax.nn as hnn
from haliax import Axis, NamedArray

__all__ = [
    "ACTIVATIONS",
    "check_positive",
    "check_epsilon",
    "check_activation",
    "SAVED_NAMES",
    "REMAT_POLICIES",
    "RematSpec",
    "check_remat",
    "remat_policy",
    "named",
    "normal_linear",
    "normal_embedding",
]

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


def check_epsilon(value: float, name: str = "layer_norm_epsilon") -> None:
    """Refuse a norm epsilon outside (0, 1]: it is added to the variance under the square root, so a
    negative or NaN one makes the first step's loss NaN, and one above 1 flattens every activation."""
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(
            f"model.{name} must be a small positive number in (0, 1] (e.g. 1e-5), got {value}: it is added "
            "to the variance in every norm, so a negative or non-finite one makes the loss NaN at step 0"
        )


def check_activation(name: str) -> None:
    """Refuse an ``activation_function`` that is not one of :data:`ACTIVATIONS`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"model.activation_function {name!r} is not one of {sorted(ACTIVATIONS)}")


# Activations a block marks by name (jax.ad_checkpoint.checkpoint_name) for the named-save policies below;
# the names are MaxText's. "context" is the attention output; the splash kernel gives its residuals (output and
# log-sum-exp) the same name, so a policy that saves "context" also spares the backward pass its forward kernel.
SAVED_NAMES: dict[str, tuple[str, ...]] = {
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj", "qkv_proj"),
    "save_out_proj": ("out_proj",),
    "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj"),
    "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj", "mlpwo"),
    "save_dot_with_context_except_mlp": ("query_proj", "key_proj", "value_proj", "qkv_proj", "context", "out_proj"),
    # Every matmul's output and the attention output: the backward pass recomputes only elementwise work.
    "minimal_with_context": (
        "query_proj", "key_proj", "value_proj", "qkv_proj", "context", "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1",
        "mlpwo",
    ),
}

# `gradient_checkpointing` values besides true/false: what each block saves for the backward pass.
# true and "nothing_saveable" (JAX's name) save only each layer's input and recompute the rest;
# "dots_saveable" saves every matmul output (JAX's policy of that name; with the vanilla kernel that
# includes the [position, key_position] scores); "save_dots" saves the outputs of the weight matmuls only
# (dots without batch dimensions), recomputing the elementwise work and attention; "offload" (upstream's
# name, haliax's policy) keeps each layer's input in host memory instead of device memory; "recompute" /
# "full", "save_all" and "nested" are haliax's other named policies, accepted as upstream does; the names of
# SAVED_NAMES save each layer's input plus the activations listed there, recomputing the rest (MaxText's policies
# of those names: on a TPU, saving the attention projections and output costs a few GiB and spares the backward
# pass their matmuls and the attention kernel's forward; docs/bench/2026-12-06-tpu-v5e.md has the figures).
REMAT_POLICIES = (
    "nothing_saveable", "dots_saveable", "save_dots", "offload", "recompute", "full", "save_all", "nested",
    *SAVED_NAMES,
)
RematSpec = Union[bool, str]


@dataclasses.dataclass(frozen=True)
class _JaxRematPolicy(hnn.ScanCheckpointPolicy):
    """A haliax scan checkpoint policy that applies one of ``jax.checkpoint_policies`` to every block."""

    jax_policy: Callable = None

    def checkpoint(self, carry_name: str, input_name: str, callable):
        return eqx.filter_checkpoint(callable, policy=self.jax_policy, prevent_cse=self.prevent_cse)


def check_remat(value: RematSpec) -> None:
    """Refuse a ``gradient_checkpointing`` value that is neither a boolean nor a named policy."""
    if isinstance(value, bool) or value in REMAT_POLICIES:
        return
    raise ValueError(
        f"model.gradient_checkpointing {value!r} is not true, false or one of {list(REMAT_POLICIES)}"
    )


def remat_policy(value: RematSpec):
    """What ``haliax.nn.Stacked`` takes for a ``gradient_checkpointing`` value (see :data:`REMAT_POLICIES`)."""
    check_remat(value)
    if value is True or value == "nothing_saveable":
        return True
    if value is False:
        return False
    if value == "dots_saveable":
        return _JaxRematPolicy(jax_policy=jax.checkpoint_policies.dots_saveable)
    if value == "save_dots":
        return _JaxRematPolicy(jax_policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    if value in SAVED_NAMES:
        return hnn.ScanCheckpointPolicy(save_carries=True, save_block_internals=list(SAVED_NAMES[value]))
    return value  # haliax's own names


def named(x: NamedArray, name: str) -> NamedArray:
    """``x`` marked as the activation ``name`` (see :data:`SAVED_NAMES`); a no-op outside a remat policy."""
    return jax.tree.map(lambda a: checkpoint_name(a, name), x)


def normal_linear(In, Out, *, std: float, use_bias: bool, key) -> hnn.Linear:
    """A haliax Linear whose weight is (truncated at 3 sigma) normal with standard deviation ``std``."""
    # Linear.init draws truncated_normal * init_scale / sqrt(|In|); undo the fan-in factor.
    return hnn.Linear.init(In, Out, key=key, use_bias=use_bias, init_scale=std * math.sqrt(hax.axis_size(In)))


def normal_embedding(Vocab: Axis, Embed: Axis, *, std: float, key) -> hnn.Embedding:
    weight = hax.random.truncated_normal(key, (Vocab, Embed), -3, 3) * std
    return hnn.Embedding(weight=weight, Vocab=Vocab, Embed=Embed)

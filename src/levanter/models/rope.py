"""Rotary position embeddings: the ``model.rope:`` block, its frequency tables and its Hugging Face mapping.

``rope:`` is a choice registry with upstream Levanter's spelling::

    rope: {type: default, theta: 10000, factor: 1.0}          # alias ``linear``: positions / factor
    rope: {type: llama3, theta: 500000, factor: 8, low_freq_factor: 1, high_freq_factor: 4,
           original_max_position_embeddings: 8192}
    rope: {type: yarn, theta: 10000, factor: 4, beta_fast: 32, beta_slow: 1,
           original_max_position_embeddings: 4096}                # + mscale, mscale_all_dim, attention_factor

The frequencies follow ``transformers``' ``modeling_rope_utils`` (``_compute_llama3_parameters``,
``_compute_yarn_parameters``) so that an imported checkpoint computes what it computed there: llama3 divides
the low frequencies by ``factor`` and blends the middle band; yarn blends interpolated and extrapolated
frequencies over a ramp between the ``beta_fast``/``beta_slow`` correction dimensions and multiplies
``cos``/``sin`` by an attention factor (``0.1 ln(factor) + 1`` unless given).

:func:`rope_from_hf` / :func:`rope_to_hf` translate to and from ``config.json``'s ``rope_parameters``
(transformers 5) and ``rope_scaling`` (older releases); unknown rope types are refused naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import draccus
import jax
import jax.numpy as jnp
import numpy as np

import haliax as hax
from haliax import Axis, NamedArray

__all__ = [
    "RopeConfig",
    "DefaultRopeConfig",
    "Llama3RopeConfig",
    "YarnRopeConfig",
    "rotary_tables",
    "rope_from_hf",
    "rope_to_hf",
]


@dataclasses.dataclass(frozen=True)
class RopeConfig(draccus.ChoiceRegistry):
    """Rotary-embedding settings (upstream's ``rope:`` block): ``default`` (alias ``linear``), ``llama3``, ``yarn``."""

    # Base of the rotary frequencies.
    theta: float = 10000.0

    @classmethod
    def default_choice_name(cls) -> Optional[str]:
        return "default"

    def inv_freq(self, head_size: int) -> np.ndarray:
        """float32 inverse frequencies, one per pair of ``head_size``."""
        return _base_inv_freq(self.theta, head_size)

    def attention_scaling(self) -> float:
        """Multiplier on ``cos`` and ``sin`` (1 except for yarn)."""
        return 1.0

    def scaling_factor(self) -> float:
        """The type's ``factor`` (how far it stretches positions or frequencies); 1 for a type without one."""
        return 1.0

    def check(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"model.rope.theta must be positive, got {self.theta}")

    def hf_type(self) -> str:
        raise NotImplementedError

    def hf_params(self) -> dict:
        """The type-specific ``rope_parameters`` entries (without ``rope_type``/``rope_theta``)."""
        return {}


def _base_inv_freq(theta: float, head_size: int) -> np.ndarray:
    # float32 throughout, in the order transformers computes it, so imported models match to rounding.
    exponents = np.arange(0, head_size, 2, dtype=np.float32) / np.float32(head_size)
    return (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)


@RopeConfig.register_subclass("default")
@dataclasses.dataclass(frozen=True)
class DefaultRopeConfig(RopeConfig):
    # Positions are divided by this (linear scaling); 1.0 = plain RoPE.
    factor: float = 1.0

    def inv_freq(self, head_size: int) -> np.ndarray:
        return (_base_inv_freq(self.theta, head_size) / np.float32(self.factor)).astype(np.float32)

    def check(self) -> None:
        super().check()
        if self.factor <= 0:
            raise ValueError(f"model.rope.factor must be positive, got {self.factor}")

    def scaling_factor(self) -> float:
        return float(self.factor)

    def hf_type(self) -> str:
        return "default" if self.factor == 1.0 else "linear"

    def hf_params(self) -> dict:
        return {} if self.factor == 1.0 else {"factor": self.factor}


RopeConfig.register_subclass("linear", DefaultRopeConfig)


@RopeConfig.register_subclass("llama3")
@dataclasses.dataclass(frozen=True)
class Llama3RopeConfig(RopeConfig):
    # Base of the rotary frequencies (Llama 3's 500000 by default).
    theta: float = 500000.0
    # Low frequencies (wavelength > original_max_position_embeddings / low_freq_factor) are divided by this.
    factor: float = 8.0
    # Wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor.
    low_freq_factor: float = 1.0
    # Wavelengths below original_max_position_embeddings / high_freq_factor are kept; between the two
    # bounds the frequency is blended.
    high_freq_factor: float = 4.0
    # Context length the model was pretrained at.
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_size: int) -> np.ndarray:
        inv = _base_inv_freq(self.theta, head_size)
        old = self.original_max_position_embeddings
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > old / self.low_freq_factor, inv / np.float32(self.factor), inv)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= old / self.high_freq_factor) & (wavelen <= old / self.low_freq_factor)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def check(self) -> None:
        super().check()
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError("model.rope factor, low_freq_factor and original_max_position_embeddings must be positive")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"model.rope.high_freq_factor ({self.high_freq_factor}) must exceed model.rope.low_freq_factor "
                f"({self.low_freq_factor})"
            )

    def scaling_factor(self) -> float:
        return float(self.factor)

    def hf_type(self) -> str:
        return "llama3"

    def hf_params(self) -> dict:
        return {"factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@RopeConfig.register_subclass("yarn")
@dataclasses.dataclass(frozen=True)
class YarnRopeConfig(RopeConfig):
    # Context extension ratio: interpolated frequencies are the base ones divided by this.
    factor: float = 1.0
    # Rotations over original_max_position_embeddings above which a dimension keeps its frequency.
    beta_fast: float = 32.0
    # Rotations below which a dimension is fully interpolated; the ramp between the two is linear.
    beta_slow: float = 1.0
    # Context length the model was pretrained at.
    original_max_position_embeddings: int = 2048
    # cos/sin multiplier; unset = 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio when both are set.
    attention_factor: Optional[float] = None
    # With mscale_all_dim, the attention factor is (0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1).
    mscale: Optional[float] = None
    # The denominator's mscale (see mscale); ignored unless both are set.
    mscale_all_dim: Optional[float] = None
    # Round the ramp's correction dimensions outward to integers (transformers' default).
    truncate: bool = True

    def inv_freq(self, head_size: int) -> np.ndarray:
        pos_freqs = np.power(np.float32(self.theta), np.arange(0, head_size, 2, dtype=np.float32) / np.float32(head_size))
        extrapolated = np.float32(1.0) / pos_freqs

        def correction_dim(rotations: float) -> float:
            return (head_size * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                    / (2 * math.log(self.theta)))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_size - 1)
        if low == high:
            high += 0.001  # as transformers: avoids a zero-width ramp
        ramp = np.clip((np.arange(head_size // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extrapolate = 1 - ramp
        interpolated = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)
        return (interpolated * (1 - extrapolate) + extrapolated * extrapolate).astype(np.float32)

    def attention_scaling(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
        return get_mscale(self.factor)

    def check(self) -> None:
        super().check()
        if self.factor <= 0 or self.original_max_position_embeddings <= 0 or self.beta_fast <= 0 or self.beta_slow <= 0:
            raise ValueError(
                "model.rope factor, beta_fast, beta_slow and original_max_position_embeddings must be positive"
            )

    def scaling_factor(self) -> float:
        return float(self.factor)

    def hf_type(self) -> str:
        return "yarn"

    def hf_params(self) -> dict:
        out = {"factor": self.factor, "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
               "original_max_position_embeddings": self.original_max_position_embeddings}
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if not self.truncate:
            out["truncate"] = False
        return out


def rotary_tables(Pos: Axis, HeadSize: Axis, rope: RopeConfig) -> tuple[NamedArray, NamedArray]:
    """float32 ``cos``/``sin`` tables ``[position, head_size]`` in the rotate-half layout."""
    with jax.ensure_compile_time_eval():
        inv_freq = jnp.asarray(rope.inv_freq(HeadSize.size))
    angles = jnp.arange(Pos.size, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    scale = rope.attention_scaling()
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return hax.named(cos, (Pos, HeadSize)), hax.named(sin, (Pos, HeadSize))


# ------------------------------------------------------------------------------------------------
# Hugging Face config.json
# ------------------------------------------------------------------------------------------------


def rope_from_hf(doc: dict, where: str) -> tuple[float, Optional[RopeConfig]]:
    """``(rope_theta, rope block or None)`` for a Llama ``config.json`` ``doc``; refuses unknown rope types."""
    params, scaling = doc.get("rope_parameters"), doc.get("rope_scaling")
    if isinstance(params, dict) and params:
        field, rope = "rope_parameters", dict(params)
    elif isinstance(scaling, dict) and scaling:
        field, rope = "rope_scaling", dict(scaling)
    else:
        return float(doc.get("rope_theta", 10000.0)), None
    theta = float(rope.get("rope_theta", doc.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    # transformers falls back to the top-level value, then to max_position_embeddings.
    original = int(rope.get("original_max_position_embeddings")
                   or doc.get("original_max_position_embeddings") or doc.get("max_position_embeddings") or 2048)
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, DefaultRopeConfig(theta=theta, factor=float(rope.get("factor", 1.0)))
    if kind == "llama3":
        return theta, Llama3RopeConfig(
            theta=theta, factor=float(rope.get("factor", 8.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original)
    if kind == "yarn":
        factor = rope.get("factor")
        if factor is None:
            factor = int(doc.get("max_position_embeddings", original)) / original
        optional = {name: float(rope[name]) for name in ("attention_factor", "mscale", "mscale_all_dim")
                    if rope.get(name) is not None}
        return theta, YarnRopeConfig(
            theta=theta, factor=float(factor), beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0), original_max_position_embeddings=original,
            truncate=bool(rope.get("truncate", True)), **optional)
    raise ValueError(
        f"{where}: field {field!r} has rope_type {kind!r}, which is not implemented (only 'default', 'linear', "
        "'llama3' and 'yarn' rotary embeddings are)"
    )


def rope_to_hf(rope: RopeConfig) -> dict:
    """The ``config.json`` entries ``rope_theta``, ``rope_parameters`` and ``rope_scaling`` for ``rope``."""
    kind, params = rope.hf_type(), rope.hf_params()
    return {
        "rope_theta": rope.theta,
        "rope_parameters": {"rope_type": kind, "rope_theta": rope.theta, **params},
        "rope_scaling": None if kind == "default" else {"rope_type": kind, **params},
    }

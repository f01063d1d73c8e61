"""A mixture's weights and stop strategy, checked: what :class:`~levanter.data.mixture.MixtureDataset` and the
data config (:mod:`levanter.data.config`) both accept.

Weights are a mapping ``{source: weight}`` or stages ``[[start_step, mapping], ...]``; each stage becomes
exact fractions summing to 1, so the mixture's per-block counts (largest-remainder rounding) do not depend
on float rounding. Kept apart from the mixture's index math and reads: the config checks its ``weights:``
and ``stop_strategy:`` keys with the same functions before any dataset is built.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from fractions import Fraction

from ..schedule import StepSchedule

__all__ = ["STOP_STRATEGIES", "stage_schedule"]

STOP_STRATEGIES = ("restart", "first_exhausted", "all_exhausted")


def stage_schedule(weights, names: Sequence[str]) -> StepSchedule[list[Fraction]]:
    """Validate ``weights`` (a mapping, or ``[(start_step, mapping), ...]``) into normalised stages.

    Each stage's weights become fractions summing to 1, one per name of ``names`` in order. Errors
    start with ``weights``; the data config rewrites that prefix to its own key.
    """
    if isinstance(weights, Mapping):
        raw_stages = [(0, weights)]
    elif isinstance(weights, Sequence) and not isinstance(weights, str):
        raw_stages = []
        for k, entry in enumerate(weights):
            if not (isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) == 2):
                raise ValueError(f"weights stage {k}: expected [start_step, {{source: weight}}], got {entry!r}")
            raw_stages.append((entry[0], entry[1]))
    else:
        raise ValueError(f"weights: expected a mapping or a list of [start_step, mapping], got {weights!r}")
    if not raw_stages:
        raise ValueError("weights: no stages given")

    stages = []
    for k, (start, mapping) in enumerate(raw_stages):
        if not isinstance(start, numbers.Integral) or isinstance(start, bool):
            raise ValueError(f"weights stage {k}: start step must be an integer, got {start!r}")
        if not isinstance(mapping, Mapping):
            raise ValueError(f"weights stage {k} (step {start}): expected a mapping of source -> weight")
        unknown = [n for n in mapping if n not in names]
        if unknown:
            raise ValueError(
                f"weights stage {k} (step {start}): unknown source {unknown[0]!r}; known sources: {list(names)}"
            )
        fr = []
        for n in names:
            w = mapping.get(n, 0)
            if not isinstance(w, numbers.Real) or isinstance(w, bool) or not math.isfinite(w):
                raise ValueError(f"weights stage {k} (step {start}): weight of {n!r} must be a finite number, got {w!r}")
            if w < 0:
                raise ValueError(f"weights stage {k} (step {start}): weight of {n!r} is negative ({w})")
            # Fraction takes Python floats and rationals; a numpy float (np.float32) goes through float.
            fr.append(Fraction(w) if isinstance(w, (float, numbers.Rational)) else Fraction(float(w)))
        total = sum(fr)
        if total == 0:
            raise ValueError(f"weights stage {k} (step {start}): all weights are zero")
        stages.append((int(start), [f / total for f in fr]))

    return StepSchedule(
        stages,
        name="weights",
        first_error="{name}: the first stage must start at step 0, got step {start}",
        order_error="{name}: stage start steps must be strictly increasing, got {prev} then {cur}",
    )

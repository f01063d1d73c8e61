"""What lowers a train step's memory, each figure from a compile, and ``per_device_parallelism: auto``.

The keys that lower a step that does not fit (:func:`suggestions`), each compiled ahead of time like the
step itself (:class:`levanter.memory.step.StepCompiler`): ``trainer.per_device_parallelism`` (the largest
that fits), ``model.gradient_checkpointing: true``, ``model.cross_entropy_block_size`` and
``model.attn_backend: jax_flash`` where the model does not use them yet, and, where none alone fits, all of
them together. Those extra compiles happen only where a step does not fit.

``auto`` picks the largest per-device microbatch that divides every per-device batch of the schedule (the
divisors, found up to the square root: a batch of 10^12 costs a million trials) and
whose step needs at most ``1 - AUTO_HEADROOM`` of the device's memory (room for the allocator's
fragmentation and the loader's next batch). The search (:func:`search_microbatch`) compiles the whole batch
first, then a candidate halfway down; with two figures it predicts the largest candidate that fits
(memory grows about linearly with the microbatch) and compiles that; it stops once the largest fitting
candidate is bracketed by a measured one that does not fit. Compiles are deterministic, so the same
config on the same device picks the same number; the run also records the pick in its checkpoints and a
resumed run takes it from there (:mod:`levanter.memory.fit`: re-checked with one compile, searched again
only if it no longer fits).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Optional, Sequence


from levanter.memory.step import StepCompiler, StepMemory, largest_batch
from levanter.models import Gpt2Config, LmConfig, attention_platform, resolve_attn_backend
from levanter.training import TrainerConfig

logger = logging.getLogger(__name__)

AUTO_HEADROOM = 0.05  # auto leaves this share of the device's memory unplanned


# -- per_device_parallelism ------------------------------------------------------------------------------
def current_microbatch(tcfg: TrainerConfig) -> int:
    """Sequences per device per microbatch of the schedule's largest step as the config has it."""
    return tcfg.microbatch_size or largest_batch(tcfg) // tcfg.data_axis_size


def microbatch_candidates(tcfg: TrainerConfig) -> list[int]:
    """Per-device microbatches that divide every per-device batch of the schedule, largest first."""
    dp = tcfg.data_axis_size
    g = 0
    for seg in tcfg.batch_schedule.segments:
        g = math.gcd(g, seg.value // dp)
    return divisors(g)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (>= 1), largest first. Found in pairs up to the square root, so a batch of
    10^12 sequences costs a million trials, not 10^12."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def search_microbatch(measure_at: Callable[[int], StepMemory], candidates: Sequence[int], budget: int,
                      known: Optional[dict[int, StepMemory]] = None
                      ) -> tuple[Optional[int], dict[int, StepMemory]]:
    """``(the largest candidate whose step needs at most budget bytes, or None; every figure measured)``.

    ``measure_at(d)`` compiles the step at per-device microbatch ``d``; ``known`` are figures already
    measured. Memory is taken to grow with ``d``: a fitting ``d`` rules out nothing above it only until a
    larger one is measured not to fit, so the search ends when every candidate between the largest
    fitting one and the smallest non-fitting one has been decided.
    """
    seen: dict[int, StepMemory] = dict(known or {})
    cands = sorted(set(candidates), reverse=True)

    def ok(d):
        return seen[d].need is not None and seen[d].oom is None and seen[d].need <= budget

    while True:  # a measured non-candidate (the whole batch of a ramp's largest step) still bounds the search
        fit = max((d for d in seen if d in cands and ok(d)), default=None)
        fail = min((d for d in seen if not ok(d)), default=None)
        open_ = [d for d in cands
                 if d not in seen and (fail is None or d < fail) and (fit is None or d > fit)]
        if not open_:
            return fit, seen
        pick = _predict(seen, open_, budget)
        if pick is None:  # no figures to extrapolate from: halve from the smallest that does not fit
            half = (fail if fail is not None else 2 * open_[0]) // 2
            pick = max((d for d in open_ if d <= half), default=open_[-1])
        seen[pick] = measure_at(pick)
        logger.info("per_device_parallelism %d: the step needs %s per device", pick, seen[pick].describe())


def _predict(seen: dict[int, StepMemory], open_: list[int], budget: int) -> Optional[int]:
    """The largest open candidate a straight line through the two smallest measured figures puts within
    ``budget`` (memory = fixed state + a share per sequence); None without two figures."""
    points = sorted((d, m.need) for d, m in seen.items() if m.need is not None)[:2]
    if len(points) < 2 or points[1][1] <= points[0][1]:
        return None
    (d0, m0), (d1, m1) = points
    slope = (m1 - m0) / (d1 - d0)
    reach = d0 + (budget - m0) / slope
    within = [d for d in open_ if d <= reach]
    return max(within) if within else min(open_)


# -- what lowers the step --------------------------------------------------------------------------------
TOGETHER = "all of these together"  # the key of the suggestion that combines the others


@dataclasses.dataclass(frozen=True)
class Suggestion:
    key: str
    value: Any
    memory: StepMemory

    @property
    def value_text(self) -> str:
        return str(self.value).lower() if isinstance(self.value, bool) else str(self.value)

    def line(self, limit: Optional[int]) -> str:
        verdict = " (fits)" if limit is not None and self.memory.fits(limit) else ""
        value = f"({self.value})" if self.key == TOGETHER else self.value_text
        return f"{self.key}: {value} -> {self.memory.describe()}{verdict}"


# Remat policies that keep more than each layer's input on the device: full remat (true) keeps less.
_SAVING_POLICIES = ("dots_saveable", "save_dots", "save_all")


def model_alternatives(model_config: LmConfig, vocab_size: int) -> list[tuple[str, Any, Any]]:
    """``(key, value, model config)`` for each model key that lowers the step's memory and that the model
    does not use yet: full remat (for no remat, or a policy that saves activations), the blockwise loss,
    blockwise attention. A change the architecture refuses (Gemma 2 has no blockwise attention, and no
    blockwise loss with its logit cap) is not suggested."""
    return _alternatives(model_config, vocab_size)[0]


def attention_dropout(model_config: LmConfig) -> float:
    """The model's attention dropout: GPT-2's ``attn_pdrop``; the other architectures have none."""
    return model_config.attn_pdrop if isinstance(model_config, Gpt2Config) else 0.0


def _alternatives(model_config: LmConfig, vocab_size: int) -> tuple[list[tuple[str, Any, Any]], Any]:
    """:func:`model_alternatives`, and the model config with all of them at once."""
    from levanter.models.layers import SAVED_NAMES

    out = []
    together: dict = {}

    def offer(key: str, value: Any, **changes) -> None:
        try:
            out.append((key, value, dataclasses.replace(model_config, **changes)))
        except ValueError:
            return  # the model's own check refuses this key; suggesting it would only lead to that error
        together.update(changes)

    remat = model_config.gradient_checkpointing
    if remat is False or remat in _SAVING_POLICIES or remat in SAVED_NAMES:
        offer("model.gradient_checkpointing", True, gradient_checkpointing=True)
    if model_config.cross_entropy_block_size is None and vocab_size >= 4096:
        block = min(8192, 1 << int(math.log2(vocab_size // 4)))
        offer("model.cross_entropy_block_size", block, cross_entropy_block_size=block)
    dropout = attention_dropout(model_config)
    resolved = resolve_attn_backend(model_config.attention_backend, platform=attention_platform(),
                                    seq_len=model_config.seq_len, dropout=dropout)
    if resolved == "vanilla" and dropout == 0.0 and model_config.seq_len >= 256:
        changes = {"attn_backend": "jax_flash"}
        if model_config.use_flash_attention is not None:
            changes["use_flash_attention"] = None
        offer("model.attn_backend", "jax_flash", **changes)
    try:
        combined = dataclasses.replace(model_config, **together)
    except ValueError:  # each alone is accepted, not all at once: no combined figure
        combined = None
    return out, combined


def suggestions(compiler: StepCompiler, base: StepMemory, limit: int
                ) -> tuple[list[Suggestion], Optional[int]]:
    """What each key alone makes of a step that does not fit, compiled ahead of time; where none alone
    fits, what all of them together make of it (one more compile); and the ``per_device_parallelism``
    auto would pick (None: none fits)."""
    out = []
    pick, seen = auto_pick(compiler, base, limit)
    current = current_microbatch(compiler.trainer_config)
    smaller = pick if pick is not None else min(seen, default=None)
    if smaller is not None and smaller < current:
        out.append(Suggestion("trainer.per_device_parallelism", smaller, seen[smaller]))
    alternatives, combined = _alternatives(compiler.model_config, compiler.vocab_size)
    for key, value, model_config in alternatives:
        memory = compiler.compile(model_config=model_config)
        logger.info("%s: %s: the step needs %s per device", key, value, memory.describe())
        out.append(Suggestion(key, value, memory))
    if len(out) >= 2 and combined is not None and not any(s.memory.fits(limit) for s in out):
        # No key alone fits: the smallest microbatch and every model key at once, the most the step's keys do.
        micro = out[0].value if out[0].key == "trainer.per_device_parallelism" else None
        at = compiler if micro is None else compiler.with_microbatch(micro)
        memory = at.compile(model_config=combined)
        parts = ", ".join(f"{s.key}: {s.value_text}" for s in out)
        logger.info("%s together: the step needs %s per device", parts, memory.describe())
        out.append(Suggestion(TOGETHER, parts, memory))
    return out, pick


def auto_pick(compiler: StepCompiler, base: Optional[StepMemory], limit: int) -> tuple[Optional[int], dict]:
    """``(the per-device microbatch auto picks, or None; the figures measured)``. ``base``: the step as
    the config has it, already measured (it counts for its own microbatch)."""
    tcfg = compiler.trainer_config
    cands = microbatch_candidates(tcfg)
    known = {}
    if base is not None:
        known[current_microbatch(tcfg)] = base

    def at(d: int) -> StepMemory:
        return compiler.compile(per_device_parallelism=d)

    budget = int(limit * (1 - AUTO_HEADROOM))
    return search_microbatch(at, cands, budget, known)


__all__ = [
    "AUTO_HEADROOM",
    "TOGETHER",
    "Suggestion",
    "attention_dropout",
    "auto_pick",
    "current_microbatch",
    "divisors",
    "microbatch_candidates",
    "model_alternatives",
    "search_microbatch",
    "suggestions",
]

"""The run's memory check before the first step, and ``trainer.per_device_parallelism: auto`` resolved.

A run (:func:`fit_trainer`) compiles its step for the schedule's largest batch before the first step
(:class:`levanter.memory.step.StepCompiler`) and reuses that executable for the run
(:meth:`levanter.training.Trainer.use_compiled`), so the check costs no extra compile where it passes. A
step that cannot fit is one :class:`StepDoesNotFitError` (exit 2) saying what it needs and what the device
has, and the keys that lower it with the figure each alone would give, each compiled the same way
(:func:`levanter.memory.levers.suggestions`). Where the device's memory is unknown (CPUs) nothing is
compiled here and ``auto`` trains the whole batch at once.

``auto``'s pick (:func:`levanter.memory.levers.auto_pick`) is the same on every process (process 0's) and
is recorded in the run's checkpoints; a resumed run takes it from there, re-checked with one compile and
searched again only if it no longer fits. XLA's ``RESOURCE_EXHAUSTED`` that the check did not foresee
(fragmentation, a backend without memory statistics) becomes the same one error
(:func:`device_oom_as_error`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional, Sequence

import jax

from levanter.checkpoint import ResumePoint
from levanter.memory.levers import (
    AUTO_HEADROOM,
    Suggestion,
    auto_pick,
    current_microbatch,
    microbatch_candidates,
    suggestions,
)
from levanter.memory.step import StepCompiler, StepMemory, device_memory, is_resource_exhausted, largest_batch
from levanter.memory.step import oom_figures, size
from levanter.training import Trainer
from levanter.training import TrainerConfig

logger = logging.getLogger(__name__)

RECORD_KEY = "per_device_parallelism"  # the checkpoint metadata key of auto's pick


class StepDoesNotFitError(ValueError):
    """The compiled train step needs more memory than a device has (a user error: exit 2)."""


def does_not_fit(base: StepMemory, limit: int, source: str, batch: str, found: Sequence[Suggestion],
                 auto: bool = False, splittable: bool = True) -> str:
    """The one-paragraph error of a step that cannot fit."""
    figures = oom_figures(base.oom) if base.oom else None
    if figures is not None and size(figures[1]) != size(limit):
        # The compiler's capacity is what it budgets the program against (a TPU keeps part of its HBM back),
        # so that is the figure the need is compared with.
        source = f"as the compiler counts it; {source} reports {size(limit)}"
        limit = figures[1]
    what = f"the train step needs {base.describe()} per device but a device has {size(limit)} ({source})"
    if base.vector_memory:
        what = (f"the train step needs {base.describe()}: the compiler refused a kernel's tiles (the "
                f"device's {size(limit)} of HBM ({source}) is not what ran out)")
    why = f"measured by compiling it ahead of time for a batch of {batch}"
    if base.oom:
        why += f"; the compiler said: {base.oom[:200]}"
    lowers = "; ".join(s.line(limit) for s in found) if found else "none of the keys it knows of"
    if auto:
        tail = "use more devices (trainer.per_device_parallelism: auto found no microbatch that fits)"
    elif not splittable:
        tail = "use more devices (one sequence per device is already the smallest microbatch)"
    else:
        tail = ("set trainer.per_device_parallelism: auto to train with the largest microbatch that fits, or "
                "use more devices")
    return (
        f"{what}: it cannot fit ({why}). What each key alone makes of it (compiled the same way): {lowers}. "
        f"Change one of them, or {tail}; --dry_run prints the whole memory plan."
    )


# -- the run's check ----------------------------------------------------------------------------------------
def fit_trainer(compiler: StepCompiler, *, recorded: Optional[int] = None) -> Trainer:
    """The run's trainer, its step for the largest batch compiled ahead of time and checked against the
    device's memory (:class:`StepDoesNotFitError` when it cannot fit), with ``per_device_parallelism:
    auto`` resolved (``recorded``: the pick a checkpoint of the run recorded). Where the device's memory
    is unknown nothing is compiled here and ``auto`` means the whole batch at once."""
    tcfg = compiler.trainer_config
    limit, source = device_memory()
    auto = tcfg.per_device_parallelism == "auto"
    if limit is None:
        if auto:
            logger.info("per_device_parallelism: auto: the device's memory is %s; the whole batch at once",
                        source)
            return compiler.with_microbatch(-1).trainer()
        return compiler.trainer()
    batch = f"{largest_batch(tcfg)} x {compiler.model_config.seq_len} tokens"
    if auto:
        cands = microbatch_candidates(tcfg)
        first = recorded if recorded in cands else cands[0]
        compiler = compiler.with_microbatch(first)
        memory = compiler.compile()
        seen = {first: memory}
        pick = first if memory.fits(limit, AUTO_HEADROOM if recorded is None else 0.0) else None
        if pick is None:
            pick, seen = auto_pick(compiler, memory, limit)
        agreed = _agree(pick or 0)  # every process trains with process 0's pick (one program)
        if agreed and agreed not in seen:
            seen[agreed] = compiler.with_microbatch(agreed).compile()
        pick = agreed or None
        if pick is None:
            smallest = min(seen)
            found, _ = suggestions(compiler.with_microbatch(smallest), seen[smallest], limit)
            raise StepDoesNotFitError(does_not_fit(seen[smallest], limit, source, batch, found, auto=True))
        compiler, memory = compiler.with_microbatch(pick), seen[pick]
        how = "recorded in the run's checkpoint" if recorded == pick else (
            f"the largest that leaves {AUTO_HEADROOM:.0%} of the device's {size(limit)} ({source}) free")
        logger.warning("per_device_parallelism: auto -> %d sequences per device per microbatch (%s; the step "
                       "needs %s per device, by %s)", pick, how, memory.describe(), memory.basis)
    else:
        memory = compiler.compile()
        if not memory.fits(limit):
            found, _ = suggestions(compiler, memory, limit)
            splittable = min(microbatch_candidates(tcfg)) < current_microbatch(tcfg)
            raise StepDoesNotFitError(
                does_not_fit(memory, limit, source, batch, found, splittable=splittable))
        logger.info("the train step needs %s per device of %s (%s; by %s)", memory.describe(), size(limit),
                    source, memory.basis)
    trainer = compiler.trainer()
    if memory.compiled is not None:
        state, abatch, batch_size = compiler.inputs(trainer)
        trainer.use_compiled(batch_size, state, abatch, memory.compiled)
    return trainer


def _agree(value: int) -> int:
    """Process 0's ``value`` on every process (the processes' devices may report different memory)."""
    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def recorded_pick(tcfg: TrainerConfig, point: Optional[ResumePoint]) -> Optional[int]:
    """The ``per_device_parallelism`` that ``auto`` picked, as the checkpoint the run resumes from
    (``point``, :meth:`TrainerConfig.resume_point`) records it (None: not ``auto``, a fresh start, or
    nothing recorded)."""
    if tcfg.per_device_parallelism != "auto" or point is None:
        return None
    value = point.records.get(RECORD_KEY)
    return value if isinstance(value, int) and value > 0 else None


@contextlib.contextmanager
def device_oom_as_error():
    """Turn XLA's ``RESOURCE_EXHAUSTED`` (a compile or a step that ran out of device memory) into a
    :class:`StepDoesNotFitError` whose message says what lowers it, instead of a traceback."""
    try:
        yield
    except StepDoesNotFitError:
        raise
    except Exception as e:  # noqa: BLE001 -- only device out-of-memory errors are translated
        if not is_resource_exhausted(e):
            raise
        raise StepDoesNotFitError(out_of_memory_message(e)) from None


def out_of_memory_message(err: BaseException) -> str:
    """The ``error:`` paragraph of a device running out of memory that the check did not foresee (a
    backend without memory statistics, fragmentation): what XLA said it needed and had, and what lowers
    it."""
    figures = oom_figures(str(err))
    first = next((line.strip() for line in str(err).splitlines() if "RESOURCE_EXHAUSTED" in line or
                  "memory" in line.lower()), str(err).strip()[:200])
    need = (f"the train step needs {size(figures[0])} per device but a device has {size(figures[1])}"
            if figures else "a device ran out of memory")
    return (
        f"{need} (XLA: {first[:240]}). Lower it with trainer.per_device_parallelism (a smaller microbatch; "
        "auto picks the largest that fits), model.gradient_checkpointing: true, "
        "model.cross_entropy_block_size (e.g. 8192) or model.attn_backend: jax_flash; --dry_run "
        "--device_memory SIZE prints what each needs without running."
    )


__all__ = [
    "RECORD_KEY",
    "StepDoesNotFitError",
    "device_oom_as_error",
    "does_not_fit",
    "fit_trainer",
    "out_of_memory_message",
    "recorded_pick",
]

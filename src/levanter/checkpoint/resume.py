"""Where a run starts from: the checkpoint it resumes, one it branches from, or none.

A run resumes from the latest complete checkpoint of its own directory, from ``trainer.load_checkpoint_path``,
or starts fresh (``trainer.load_checkpoint: false``); a branch (``trainer.initialize_from``,
``initialize_from_checkpoint_path``) starts at step 0 from another run's checkpoint. This module answers
those questions once per run:

- :func:`resolve_checkpoint`: the one resolution of a path a user gives (a ``step-N`` directory itself, or
  the latest complete checkpoint under a run directory), with the error naming the config key at fault.
- :func:`find_resume_point`: the checkpoint a run resumes from, its ``metadata.json`` read once into a
  :class:`ResumePoint` (step and the run's records); whether the run already finished is a comparison of
  that step, not another read.
- :func:`restore` and :func:`initialize_from`: the arrays loaded into the state's structure.

The functions take the few config values they need, not the trainer's config, so that ``checkpoint`` stays
below ``trainer`` (``TrainerConfig.resume_point`` passes them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import jax

from levanter.checkpoint.errors import CheckpointMismatchError, CorruptCheckpointError
from levanter.checkpoint.layout import (
    METADATA_FILENAME,
    discover_latest_checkpoint,
    is_complete,
    read_checkpoint_metadata,
    unreadable_checkpoints,
)
from levanter.checkpoint.restore import load_checkpoint
from levanter.utils import fs

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """A complete checkpoint, read once: its path, the step it holds and the records the run that wrote it
    kept in its ``metadata.json`` (``metadata``: the data schedule, the model, the branch origin, ...), and
    the names of the arrays it holds (``leaves``: ``model/...``, ``opt_state/...``)."""

    path: str
    step: int
    records: dict
    leaves: tuple = ()

    @classmethod
    def read(cls, path: str) -> "ResumePoint":
        doc = read_checkpoint_metadata(path)
        return cls(path, int(doc["step"]), doc.get("metadata") or {}, tuple(r["name"] for r in doc["leaves"]))

    def holds(self, subtree: str) -> bool:
        """Whether the checkpoint holds any array under ``subtree`` (a field of the saved state)."""
        prefix = subtree + "/"
        return any(name == subtree or name.startswith(prefix) for name in self.leaves)

    def finished(self, num_train_steps: int) -> bool:
        """Whether the checkpoint is at or past ``num_train_steps``: nothing is left to train."""
        return self.step >= num_train_steps


def resolve_checkpoint(path: str, key: str, *, fix: str = "") -> str:
    """The complete checkpoint ``path`` names: a ``step-N`` directory itself, else the latest complete one
    under it (a run directory). ``FileNotFoundError`` naming ``key`` when there is none; ``fix`` (a
    sentence) is added to its message."""
    is_step = fs.basename(fs.abspath(path)).startswith("step-")
    if is_step and is_complete(path):
        return path
    found = None if is_step else discover_latest_checkpoint(path)
    if found is None:
        why = "does not exist" if not fs.exists(path) else "holds no complete checkpoint"
        raise FileNotFoundError(
            f"{key}={path!r} {why} (expected a step-N checkpoint directory with its {METADATA_FILENAME}, or a run "
            f"directory holding one){'. ' + fix if fix else ''}"
        )
    return found


def find_resume_point(
    run_dir: str,
    *,
    load_checkpoint: Optional[bool] = None,
    load_checkpoint_path: Optional[str] = None,
    num_train_steps: Optional[int] = None,
) -> Optional[ResumePoint]:
    """The checkpoint a run whose checkpoints go to ``run_dir`` resumes from, or None to start fresh.

    ``load_checkpoint: false`` starts fresh whatever is on disk; ``true`` requires a checkpoint; null takes
    one if there is one. ``load_checkpoint_path`` replaces the run's latest: a path that holds no complete
    checkpoint is an error (a typo must not start a run from step 0). A run directory holding checkpoint
    data that cannot be read is an error too (resuming before it would overwrite it, and the run's metrics
    with it) -- except when the run's latest checkpoint already reaches ``num_train_steps``: that run
    trains nothing and writes nothing, so it is reported finished.
    """
    if load_checkpoint is False:
        return None
    point = None
    if load_checkpoint_path is None:
        latest = discover_latest_checkpoint(run_dir)
        point = ResumePoint.read(latest) if latest is not None else None
        if point is not None and num_train_steps is not None and point.finished(num_train_steps):
            return point
    check_readable(run_dir)
    if load_checkpoint_path is not None:
        point = ResumePoint.read(resolve_checkpoint(
            load_checkpoint_path, "trainer.load_checkpoint_path",
            fix="Fix the path, or remove the key to start from scratch."))
    if point is None and load_checkpoint:
        raise FileNotFoundError(
            f"trainer.load_checkpoint is true but no complete checkpoint exists under "
            f"{load_checkpoint_path or run_dir!r}"
        )
    return point


def check_readable(run_dir: str) -> None:
    """Refuse a run directory holding ``step-N`` directories without ``metadata.json``
    (:func:`~levanter.checkpoint.layout.unreadable_checkpoints`): training on would overwrite them."""
    unreadable = unreadable_checkpoints(run_dir)
    if unreadable:
        raise CorruptCheckpointError(
            f"the run directory {run_dir} holds checkpoints that cannot be read (no {METADATA_FILENAME}): "
            f"{', '.join(unreadable[:4])}{' and more' if len(unreadable) > 4 else ''}. Training on would "
            "start before them and overwrite them and the run's metrics. Restore their metadata.json or move "
            "them away to resume, or set trainer.load_checkpoint: false to start this run from scratch."
        )


def restore(state: Any, point: Optional[ResumePoint]) -> Any:
    """``state`` (a template: the fresh initial state) with every array of ``point``'s checkpoint; ``state``
    itself when there is none."""
    if point is None:
        return state
    logger.info("resuming from checkpoint %s", point.path)
    return load_checkpoint(state, point.path)


def initialize_from(state: Any, path: str, *, optimizer_state: bool, key: str) -> Any:
    """``state`` (a fresh initial state with ``model`` and ``opt_state``) with the weights -- and, if
    ``optimizer_state``, the optimizer state -- of the complete checkpoint ``path``, still at its step 0:
    the start of a branch (a new run, e.g. the cooldown of a curriculum study, from another run's
    checkpoint).

    The optimizer state is taken as saved (Adam's moments and its bias-correction count go on) except the
    learning-rate schedule's count, which restarts at 0 (:func:`restart_schedules`): the branch follows its
    own ``optimizer`` schedule from its step 0, not the origin's from the origin's step. Everything else
    (the step, the training key) stays this run's. A checkpoint that does not fit the model (or optimizer)
    is a ``ValueError`` naming ``key``, the array and both shapes."""
    try:
        model = load_checkpoint(state.model, path, subpath="model")
        opt_state = state.opt_state
        if optimizer_state:
            opt_state = restart_schedules(load_checkpoint(state.opt_state, path, subpath="opt_state"))
    except CheckpointMismatchError as e:
        what = "model and optimizer" if optimizer_state else "model"
        raise ValueError(
            f"{key}={path!r} does not fit this run's {what} ({e}): set model (and optimizer) as in the run "
            "that wrote it"
        ) from None
    logger.info("loaded the %s of checkpoint %s", "weights and optimizer state" if optimizer_state else "weights",
                path)
    return dataclasses.replace(state, model=model, opt_state=opt_state)


def restart_schedules(opt_state):
    """``opt_state`` with the count of every learning-rate schedule (``optax.ScaleByScheduleState``) set
    to 0, on the same devices; everything else unchanged."""
    import optax  # here: reading and writing checkpoints needs no optimizer library

    def is_schedule(x) -> bool:
        return isinstance(x, optax.ScaleByScheduleState)

    def reset(x):
        return optax.ScaleByScheduleState(count=x.count - x.count) if is_schedule(x) else x

    return jax.tree.map(reset, opt_state, is_leaf=is_schedule)


__all__ = [
    "ResumePoint",
    "check_readable",
    "find_resume_point",
    "initialize_from",
    "resolve_checkpoint",
    "restart_schedules",
    "restore",
]

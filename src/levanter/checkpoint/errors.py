"""The errors a checkpoint operation raises beyond the standard ones (a full disk is
:class:`levanter.errors.OutOfSpaceError`, a missing path ``FileNotFoundError``)."""

from __future__ import annotations

__all__ = ["CheckpointMismatchError", "CheckpointSaveError", "CorruptCheckpointError"]


class CorruptCheckpointError(ValueError):
    """A checkpoint directory exists but cannot be restored (incomplete, truncated, missing files)."""


class CheckpointMismatchError(ValueError):
    """The checkpoint is intact but does not fit the template (leaf set, shape or dtype differ)."""


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (non-finite values, permissions, I/O error); nothing was committed."""

